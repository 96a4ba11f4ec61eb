"""Every algorithm script's `smoke` preset through its real command line (cli), with the default sampler
(generate() with KV reuse), on the tests' 12 games (a fresh clone's first run would otherwise make the 240 of the
default data root first, ~3.5 min): as is (the fast tier's run of each script; also in the venv at the declared
lower bounds, tests/test_floors.py), and with what load_model does on a GPU (bfloat16 compute, gradient
checkpointing; --dtype bfloat16 --gradient-checkpointing on), so that a dtype or checkpointing mistake shows on CPU."""

import json
import math
import os

import pytest
from algorithm_scripts import MODULES, NAMES
from test_floors import AT_THE_FLOORS

import harness

CUDA_BRANCH = ["--dtype", "bfloat16", "--gradient-checkpointing", "on"]
AT_FLOORS = bool(os.environ.get(AT_THE_FLOORS))


@pytest.mark.parametrize(
    "precision",
    [
        "default",  # the fast tier's one update of each script (bfloat16 on a CPU is several times slower)
        pytest.param("cuda_branch", marks=[pytest.mark.slow, pytest.mark.skipif(AT_FLOORS, reason="main venv only")]),
    ],
)
@pytest.mark.parametrize("name", NAMES)
def test_smoke_preset_trains(name, precision, games_root, tmp_path, capfd):
    module = MODULES[name]
    flags = CUDA_BRANCH if precision == "cuda_branch" else []
    argv = ["smoke", "--data-root", str(games_root), "--output-dir", str(tmp_path), *flags]
    harness.cli(module.Args, module.main, module.PRESETS, argv)
    (run,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    updates = [row for row in rows if row.get("update", 0) >= 1 and "rollout/generated_tokens" in row]
    assert updates and all(row["rollout/generated_tokens"] > 0 for row in updates)
    assert all(math.isfinite(value) for row in rows for value in row.values() if isinstance(value, float))
    assert (run / "checkpoints").is_dir() and list((run / "checkpoints").iterdir())
    expected = (
        "bfloat16 compute, bfloat16 weights + float32 LoRA, gradient checkpointing on"
        if flags
        else "float32 compute, float32 weights + float32 LoRA, gradient checkpointing off"
    )
    assert f"[start] model: {expected}" in capfd.readouterr().err
