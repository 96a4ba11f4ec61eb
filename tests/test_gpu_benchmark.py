"""benchmarks/speed/gpu.py, the prepared device check, runs end to end at toy size on CPU (the real size needs a GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_check_runs_at_toy_size(games_root, tmp_path):
    out = tmp_path / "gpu.json"
    command = [sys.executable, "-m", "benchmarks.speed.gpu", "--size", "toy", "--data-root", str(games_root)]
    command += ["--max-turns", "2", "--max-turn-tokens", "8", "--groups-per-update", "2", "--group-size", "2"]
    command += ["--reference-prompt-tokens", "16", "--smoke-scripts", "gigpo", "--device-peak-tflops", "1"]
    command += ["--out", str(out)]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    smoke, reference, grpo, tempo_td, step = json.loads(out.read_text())
    assert [r["measured"] for r in (smoke, reference, grpo, tempo_td, step)] == [
        "gigpo smoke", "reference generate", "grpo update", "tempo_td update", "train_step"
    ]  # fmt: skip
    assert smoke["ok"] and smoke["error"] is None
    assert reference["sampled_tokens_per_s"] > 0 and reference["batch"] == 2 * 2
    assert grpo["sampled_tokens"] == 2 * 2 * 2 * 8  # random replies never end early: every turn is 8 tokens
    assert tempo_td["sampled_tokens"] > grpo["sampled_tokens"]  # branches and the critic's replies
    assert step["trained_tokens"] == grpo["sampled_tokens"] and step["forward_tokens"] > step["trained_tokens"]
    assert all(r[k] > 0 for r in (grpo, tempo_td) for k in ("sampled_tokens_per_s", "sample_mfu"))
    assert all(r["ratio_to_reference_generate"] > 0 for r in (grpo, tempo_td))
    assert step["train_mfu"] > 0 and step["trained_tokens_per_s"] > 0 and step["ratio_to_reference"] > 0
    # one JSON line per measurement, printed as each is done
    assert [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")] == [
        smoke, reference, grpo, tempo_td, step
    ]  # fmt: skip
