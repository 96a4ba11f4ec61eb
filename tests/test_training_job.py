"""The algorithm scripts as training jobs (tiny model, generated games, CPU): a SIGKILLed job resumes exactly, bad
input fails at start, non-finite steps are skipped, --eval-only, and real 2-process `accelerate launch` runs with W&B
offline. The expensive subprocess scenarios run once per script and are shared by the tests below them."""

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from accelerate.utils import set_seed
from algorithm_scripts import MODULES
from chat_server import ScriptedEndpoint
from safetensors.torch import load_file
from test_vllm import assert_trained_on_the_served_policy, served_adapters

import adca_grpo
import common
import harness
import offline
import plan
import samplers
import tempo
import training

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = MODULES  # every algorithm script, found (algorithm_scripts.py)
JUDGE_KEY_ENV = "TRAINING_JOB_JUDGE_KEY"
SHARED = dict(
    seed=0,
    max_turn_tokens=16,
    max_trajectory_tokens=4096,
    micro_batch_tokens=4096,
    sample_batch_size=16,
    lora_rank=4,
    lora_alpha=8,
    learning_rate=1e-2,
    save_every=1,
    eval_every=0,
    eval_games=1,
)
BUDGETS = {
    # warm-up, then two TD updates: the second one starts from states the first one stored
    "tempo": dict(
        macro_rounds=2,
        max_turns=4,
        group_size=2,
        critic_samples=2,
        endpoint_samples=1,
        groups_per_update=2,
        warmup_updates=1,
        warmup_groups_per_update=1,
        td_updates=2,
        max_critic_tokens=16,
        state_selection="uniform",  # every endpoint stored: the tiny model's groups are all degenerate (the default,
        # outcome, stores none of them)
    ),
    # every trajectory labelled by the judge below: its GOOD/BAD labels give non-zero advantages, so the adapter trains
    "adca_grpo": dict(
        num_updates=3,
        groups_per_update=2,
        group_size=2,
        max_turns=2,
        alpha=0.5,
        skip_type="none",
        labeler_backend="api",
        labeler_model="judge",
        labeler_api_key_env=JUDGE_KEY_ENV,
        labeler_concurrency=2,
        labeler_max_new_tokens=16,
    ),
    # the random tiny model never writes a tool call: every step is penalised alike and the advantages are 0
    "gigpo": dict(num_updates=3, groups_per_update=2, group_size=2, max_turns=2, invalid_action_penalty=0.01),
}
# SIGKILL during the update after this checkpoint (TEMPO: the store is full)
KILL_AFTER = {"tempo": 2}  # 1 for the others
TIMING_KEYS = re.compile(r"^time/|^prm/latency_")  # wall-clock metrics: never equal across runs


def judge_endpoint(delay_s: float = 0.0) -> ScriptedEndpoint:
    """GOOD/BAD alternating per step from a phase hashed from the request (the same request always gets the same
    labels; a trajectory of 2+ steps never gets uniform ones, so the labels always train), after delay_s."""

    def behave(content, attempt):
        if "STEPS (" not in content:  # adca_grpo's start-up check of the endpoint
            return 200, "OK", delay_s
        steps = int(content.split("STEPS (")[1].split(" ")[0])
        phase = hashlib.sha256(content.encode()).digest()[0]
        labels = [(phase + j) % 2 for j in range(steps)]
        return (
            200,
            "\n".join(f"Step {j + 1} Judgment: {'GOOD' if good else 'BAD'}" for j, good in enumerate(labels)),
            delay_s,
        )

    return ScriptedEndpoint(behave)


@pytest.fixture(scope="module")
def judge():
    os.environ[JUDGE_KEY_ENV] = "not-a-secret"
    with judge_endpoint() as server:
        yield server
    del os.environ[JUDGE_KEY_ENV]


def settings(name, games_root, tiny_model_dir, output_dir, judge_url="", **overrides) -> dict:
    extra = {"labeler_base_url": judge_url} if name == "adca_grpo" else {}
    return {
        **SHARED,
        **budget(name),
        **extra,
        "model": str(tiny_model_dir),
        "data_root": str(games_root),
        "output_dir": str(output_dir),
        **overrides,
    }


def cli(values: dict) -> list[str]:
    flags = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else ["--no-" + flag[2:]]
        else:
            flags += [flag, *map(str, value)] if isinstance(value, tuple) else [flag, str(value)]
    return flags


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def policy_loss(module):
    """The script's train_step loss: its own policy_loss, or training.ppo_update's (training.ppo_clip_loss)."""
    return getattr(module, "policy_loss", training.ppo_clip_loss)


def checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("update_*"))


def budget(name) -> dict:
    """A script's budget here: BUDGETS' (tailored to these tests), else (a new script) its smoke preset's own values."""
    if name in BUDGETS:
        return BUDGETS[name]
    smoke, default = SCRIPTS[name].PRESETS["smoke"][1], SCRIPTS[name].Args()
    own = [f.name for f in dataclasses.fields(smoke) if f.name not in ("model", *SHARED)]
    return {key: getattr(smoke, key) for key in own if getattr(smoke, key) != getattr(default, key)}


def kill_after(name) -> int:
    return KILL_AFTER.get(name, 1)


def total_updates(name) -> int:
    return updates(budget(name))


def updates(values: dict) -> int:
    return values["num_updates"] if "num_updates" in values else values["warmup_updates"] + values["td_updates"]


def for_processes(name, values: dict, processes: int = 2) -> dict:
    """The values with each of the run's counts (the script's GLOBAL_COUNTS) times `processes`: each process plays what
    one process plays alone with `values`."""
    counts = SCRIPTS[name].Args.GLOBAL_COUNTS
    return {key: value * processes if key in counts else value for key, value in values.items()}


def copy_as_died_after(output_dir: Path, copy_dir: Path, update: int) -> Path:
    """A copy of the one run in output_dir as a death in update + 1 leaves it (the atomic saves keep checkpoints
    1..update whole; the rows logged after them stay, for the resume to drop); returns the copy's run dir."""
    shutil.copytree(output_dir, copy_dir)
    (run_dir,) = [metrics.parent for metrics in copy_dir.glob("*/metrics.jsonl")]
    for checkpoint in checkpoints(run_dir)[update:]:
        shutil.rmtree(checkpoint)
    return run_dir


def job_env(**extra) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **extra}


# =============================================================================================
# A job killed with SIGKILL mid-update, resumed with --resume auto, equals a job that ran straight through
# =============================================================================================
@pytest.fixture(scope="module")
def killed_job(games_root, tiny_model_dir, tmp_path_factory, judge):
    """Per script, once: (straight run dir, killed-then-resumed run dir, the killed job's stderr)."""
    done = {}

    def run(name):
        if name in done:
            return done[name]
        module, out = SCRIPTS[name], tmp_path_factory.mktemp(f"killed_{name}")
        straight = settings(name, games_root, tiny_model_dir, out / "straight", judge.url, keep_checkpoints=1)
        straight = module.main(module.Args(**straight))  # keeps only its final checkpoint (compared below)

        values = settings(name, games_root, tiny_model_dir, out / "killed", judge.url)
        stderr_path = out / "killed.stderr"
        with open(stderr_path, "w") as stderr:
            job = subprocess.Popen(
                [sys.executable, str(ROOT / f"{name}.py"), *cli(values)],
                cwd=out,
                env=job_env(),
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        # Kill once checkpoint k exists and the next update has played its first turn (the turn bar says so).
        started = re.compile(rf"\[checkpoint\][^\n]*update_{kill_after(name):06d}.*rollout: 1turn", re.DOTALL)
        deadline = time.monotonic() + 120
        while not started.search(stderr_path.read_text()):
            assert job.poll() is None and time.monotonic() < deadline, stderr_path.read_text()[-3000:]
            time.sleep(0.02)
        job.send_signal(signal.SIGKILL)
        assert job.wait(timeout=30) == -signal.SIGKILL
        (killed,) = (out / "killed").iterdir()
        assert [c.name for c in checkpoints(killed)] == [f"update_{n:06d}" for n in range(1, kill_after(name) + 1)]
        assert len(read_rows(killed / "metrics.jsonl")) == kill_after(name)  # the kill came mid-update

        # What a kill at other moments leaves: a half-written checkpoint, a row logged after the last checkpoint, a torn line.
        partial = killed / "checkpoints" / f".tmp_update_{kill_after(name) + 1:06d}_12345"
        partial.mkdir()
        (partial / "adapter_model.safetensors").write_bytes(b"\0" * 10)
        with open(killed / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"update": kill_after(name) + 1, "train/loss": 123.0}) + '\n{"update": ')

        resumed = module.main(module.Args(**{**values, "resume": "auto"}))
        done[name] = straight, resumed, stderr_path.read_text()
        return done[name]

    return run


def test_a_count_metric_says_so_and_an_int_metric_is_refused():
    """Counts are summed over the processes, maxima the largest, everything else averaged (the 2-process runs below
    check the sums); a bare int could be either, so it fails loudly instead of being averaged."""
    accelerator = harness.make_accelerator()
    metrics = {"x/requests": training.SummedMetric(3), "x/rate": 0.5, "x/peak": training.MaxMetric(2)}
    merged = training.reduce_metrics(accelerator, metrics)
    assert merged == {"x/requests": 3.0, "x/rate": 0.5, "x/peak": 2.0}
    for value in (3, True):
        with pytest.raises(TypeError, match="metric x/requests is an int: make it SummedMetric"):
            training.reduce_metrics(accelerator, {"x/requests": value})


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_killed_job_resumes_exactly(killed_job, name):
    straight, resumed, killed_stderr = killed_job(name)
    n = total_updates(name)
    assert "rollout: 1turn" in killed_stderr and "update" in killed_stderr  # tqdm: update bar and turn bar
    assert [c.name for c in checkpoints(resumed)] == [f"update_{u:06d}" for u in range(1, n + 1)]
    assert not list((resumed / "checkpoints").glob(".tmp_*"))  # the next save cleared the half-written one

    rows, expected = read_rows(resumed / "metrics.jsonl"), read_rows(straight / "metrics.jsonl")
    assert [r["update"] for r in rows] == [r["update"] for r in expected] == list(range(1, n + 1))
    for row, want in zip(rows, expected):
        assert row.keys() == want.keys() and row["rollout/generated_tokens"] > 0
        if "num_updates" in budget(name):  # one process plays the run's games per update
            assert row["rollout/episodes"] == budget(name)["groups_per_update"] * budget(name)["group_size"]
        for key in row:
            if isinstance(row[key], str):
                assert row[key] == want[key], key
            elif not TIMING_KEYS.search(key):
                assert row[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (row["update"], key)

    final = f"update_{n:06d}"
    assert [c.name for c in checkpoints(straight)] == [final]  # --keep-checkpoints 1: the final one only
    weights = load_file(resumed / "checkpoints" / final / "adapter_model.safetensors")
    expected_weights = load_file(straight / "checkpoints" / final / "adapter_model.safetensors")
    assert weights.keys() == expected_weights.keys()
    for key in weights:
        torch.testing.assert_close(weights[key], expected_weights[key], rtol=1e-5, atol=1e-7)
    if (resumed / "checkpoints" / final / harness.HEADS_FILE).is_file():  # the algorithm's own modules (ppo.py's head)
        heads = load_file(resumed / "checkpoints" / final / harness.HEADS_FILE)
        expected_heads = load_file(straight / "checkpoints" / final / harness.HEADS_FILE)
        assert heads.keys() == expected_heads.keys() and any(v.abs().sum() > 0 for v in heads.values())  # trained
        for key in heads:
            torch.testing.assert_close(heads[key], expected_heads[key], rtol=1e-5, atol=1e-7)
    optimizer = torch.load(resumed / "checkpoints" / final / "optimizer.pt", weights_only=True)["state"]
    expected_optimizer = torch.load(straight / "checkpoints" / final / "optimizer.pt", weights_only=True)["state"]
    for index in expected_optimizer:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(optimizer[index][key], expected_optimizer[index][key], rtol=1e-5, atol=1e-9)
    state = json.loads((resumed / "checkpoints" / final / "trainer_state.json").read_text())
    expected_state = json.loads((straight / "checkpoints" / final / "trainer_state.json").read_text())
    assert state["rank_states"] == expected_state["rank_states"]  # game cursor, TEMPO's store and its sampler
    if name == "tempo":
        assert rows[-1]["td/fresh_states"] == 0  # the resumed update started from the restored store
        assert len(state["rank_states"][0]["store"]) > 0
    elif name == "adca_grpo":  # the judge's labels trained the adapter: the comparison is not of untouched adapters
        first = load_file(resumed / "checkpoints" / "update_000001" / "adapter_model.safetensors")
        assert any(not torch.equal(first[k], weights[k]) for k in weights)
        assert all(r["prm/label_requests"] == 4 and r["train/grad_norm"] > 0 for r in rows)
    elif name == "gigpo":  # the sampled episodes (and so the step groups) are the straight run's
        assert all(r["gigpo/step_groups"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("lora_rank", [4, 0])
def test_checkpoint_round_trip_continues_exactly(name, lora_rank, games_root, tiny_model_dir, tmp_path, judge):
    """With real gradients (advantages +1 / -1 on two sampled branches): 3 steps straight == 1 step, checkpoint,
    a fresh process-like runtime (other seed) loading it, 2 more steps. Same samples, weights, optimizer state.
    LoRA, and --lora-rank 0: every weight trained, checkpointed as a model.safetensors."""
    module = SCRIPTS[name]
    args = module.Args(**settings(name, games_root, tiny_model_dir, tmp_path, judge.url, lora_rank=lora_rank))
    accelerator = harness.make_accelerator()

    def runtime(seed):
        set_seed(seed)
        return module.Runtime(args, accelerator)

    def step(rt):
        start = common.game_start(rt.games[0], rt.protocol)
        (group,) = common.rollout(
            [start],
            2,
            rt.sample_fn,
            rt.protocol,
            horizon=2,
            max_turns=2,
            max_turn_tokens=16,
            max_trajectory_tokens=4096,
        )
        datums = []
        for traj, advantage in zip(group, (1.0, -1.0)):
            tokens, old_logprobs, step_ids = traj.sequence()
            mask = [float(k >= 0) for k in step_ids]
            datums.append(training.Datum(tokens, old_logprobs, [advantage * m for m in mask], mask))
        metrics = training.train_step(rt, datums, policy_loss(module))
        assert metrics["train/grad_norm"] > 0 and metrics["train/nonfinite_skipped"] == 0
        return [traj.tokens for traj in group]

    def trainable(rt):
        return {
            n: p.detach().clone() for n, p in accelerator.unwrap_model(rt.model).named_parameters() if p.requires_grad
        }

    straight = runtime(0)
    step(straight)
    checkpoint = harness.save_checkpoint(
        tmp_path / "run", 1, straight.model, straight.optimizer, accelerator, name, {}, {}
    )
    samples = [step(straight), step(straight)]

    resumed = runtime(123)
    harness.load_checkpoint(checkpoint, resumed.model, resumed.optimizer, accelerator)
    assert [step(resumed), step(resumed)] == samples
    weights = trainable(straight)
    assert len(weights) == (len(list(resumed.model.parameters())) if lora_rank == 0 else 4 * len(args.lora_targets))
    for key, value in weights.items():
        torch.testing.assert_close(trainable(resumed)[key], value, rtol=0, atol=0)
    saved = load_file(checkpoint / harness.weights_file(lora=lora_rank > 0))
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["adapter_sha256"] == samplers.adapter_sha256(saved)
    harness.check_checkpoint(checkpoint, args, name, "--resume", 1)
    with pytest.raises(ValueError, match="--lora-rank .* does not match the checkpoint"):
        harness.check_checkpoint(checkpoint, dataclasses.replace(args, lora_rank=4 - lora_rank), name, "--resume", 1)


# =============================================================================================
# --eval-only
# =============================================================================================
@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_eval_only_on_a_checkpoint_same_metrics_in_every_script(
    name, killed_job, games_root, tiny_model_dir, tmp_path, judge
):
    """One row of exactly harness.evaluate's metrics for the games evaluated: the same names in every script."""
    module, (_, run_dir, _) = SCRIPTS[name], killed_job(name)
    checkpoint = checkpoints(run_dir)[-1]
    values = settings(name, games_root, tiny_model_dir, tmp_path, judge.url, eval_only=str(checkpoint), eval_games=2)
    eval_dir = module.main(module.Args(**values))
    (row,) = read_rows(eval_dir / "metrics.jsonl")
    assert row["update"] == total_updates(name) and row["checkpoint"] == str(checkpoint)
    success = ("success_rate", "n", "success_ci_low", "success_ci_high")  # with its n and 95% interval
    expected = {f"eval/train/{key}" for key in success}
    for split in ("valid_seen", "valid_unseen"):
        task_types = {common.load_task_type(game) for game in common.eval_subset(str(games_root), split, None, 2)}
        expected |= {f"eval/{split}/{key}" for key in (*success, "invalid_action_rate")}
        expected |= {f"eval/{split}/success/{task_type}" for task_type in task_types}
        if row[f"eval/{split}/success_rate"] > 0:
            expected.add(f"eval/{split}/mean_steps_to_success")
    assert {k for k in row if k.startswith("eval/")} == expected
    assert not (eval_dir / "checkpoints").exists() and len(checkpoints(run_dir)) == total_updates(name)


# =============================================================================================
# Bad input fails at start, with a message that names the flag
# =============================================================================================
@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(split="test"), "--split"),
        (dict(seed=-1), "--seed"),
        (dict(task_types=()), "--task-types"),
        (dict(eval_only="auto", eval_games=0), "--eval-only needs --eval-games"),
        (dict(eval_games=-1), "--eval-games must be >= 0 or all"),
        (dict(groups_per_update=3, plan=True, plan_processes=2), "--groups-per-update 3 is the run's count"),
        (dict(track=True, wandb_project=""), "--wandb-project"),
        (dict(model="no-such-org/no-such-model"), "--model"),
        (dict(model="/no/such/model"), "--model"),
        (dict(data_root="/no/such/alfworld"), "--data-root"),
        (dict(output_dir="{file}/runs"), "--output-dir"),
        (dict(resume="/no/such/checkpoint"), "--resume"),
        (dict(eval_only="auto"), "--eval-only auto: no checkpoint"),
        (dict(fsdp=True), "--fsdp shards over several processes, and this run has one"),
    ],
)
def test_bad_input_fails_at_start(name, overrides, message, games_root, tiny_model_dir, tmp_path, judge):
    (tmp_path / "file").write_text("")
    overrides = {k: v.format(file=tmp_path / "file") if isinstance(v, str) else v for k, v in overrides.items()}
    output_dir, module = overrides.pop("output_dir", tmp_path / "runs"), SCRIPTS[name]
    with pytest.raises(ValueError, match=re.escape(message)):
        module.main(module.Args(**settings(name, games_root, tiny_model_dir, output_dir, judge.url, **overrides)))
    assert not list(tmp_path.glob("runs/*"))  # nothing was started


def corrupt_truncated_adapter(checkpoint: Path):
    path = checkpoint / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def corrupt_garbage_state(checkpoint: Path):
    (checkpoint / "trainer_state.json").write_text('{"algorithm": "tem')


def corrupt_truncated_optimizer(checkpoint: Path):
    path = checkpoint / "optimizer.pt"
    path.write_bytes(path.read_bytes()[:100])


def corrupt_nan_adapter(checkpoint: Path):
    """A well-formed safetensors file whose weights are all NaN (its header is kept: it opens fine)."""
    path = checkpoint / "adapter_model.safetensors"
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    nan = torch.tensor([float("nan")], dtype=torch.float32).numpy().tobytes()
    path.write_bytes(data[:start] + nan * ((len(data) - start) // 4))


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize(
    "corrupt, overrides, message",
    [
        (corrupt_truncated_adapter, {}, "corrupt or incomplete checkpoint"),
        (corrupt_garbage_state, {}, "corrupt or incomplete checkpoint"),
        (corrupt_truncated_optimizer, {}, "corrupt or incomplete checkpoint"),
        (corrupt_nan_adapter, {}, "does not match the sha256"),
        (None, {"lora_rank": 8}, "--lora-rank 8 does not match"),
    ],
)
def test_bad_checkpoint_fails_at_start(
    name, corrupt, overrides, message, killed_job, games_root, tiny_model_dir, tmp_path, judge
):
    module = SCRIPTS[name]
    _, run_dir, _ = killed_job(name)
    copy = tmp_path / "runs" / run_dir.name
    shutil.copytree(run_dir, copy)
    rows_before = (copy / "metrics.jsonl").read_text()
    if corrupt is not None:
        corrupt(checkpoints(copy)[-1])
    values = settings(name, games_root, tiny_model_dir, tmp_path / "runs", judge.url, resume="auto", **overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        module.main(module.Args(**values))
    assert (copy / "metrics.jsonl").read_text() == rows_before
    if corrupt is corrupt_truncated_adapter:  # also refused for --eval-only
        with pytest.raises(ValueError, match="--eval-only .*corrupt"):
            module.main(module.Args(**{**values, "resume": "", "eval_only": str(checkpoints(copy)[-1])}))


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_checkpoint_of_the_other_algorithm_fails_at_start(
    name, killed_job, games_root, tiny_model_dir, tmp_path, judge
):
    """The script's own checkpoint with another algorithm's name in its trainer_state.json."""
    other = "adca_grpo" if name == "tempo" else "tempo"
    checkpoint = tmp_path / "other" / "update_000001"
    shutil.copytree(checkpoints(killed_job(name)[1])[-1], checkpoint)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    (checkpoint / "trainer_state.json").write_text(json.dumps({**state, "algorithm": other}))
    module = SCRIPTS[name]
    for flag in ("resume", "eval_only"):
        with pytest.raises(ValueError, match=f"checkpoint of '{other}'; this script trains '{name}'"):
            module.main(
                module.Args(
                    **settings(name, games_root, tiny_model_dir, tmp_path, judge.url, **{flag: str(checkpoint)})
                )
            )


# =============================================================================================
# --resume auto is per seed; flags that change what the run is must match it
# =============================================================================================
@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_resume_auto_is_per_seed_and_refuses_flags_that_change_the_run(
    name, killed_job, games_root, tiny_model_dir, tmp_path, judge, capsys
):
    module = SCRIPTS[name]
    _, run_dir, _ = killed_job(name)
    runs = tmp_path / "runs"
    copy = runs / run_dir.name
    shutil.copytree(run_dir, copy)
    exp_name = module.Args().exp_name
    other_seed = runs / f"{exp_name}__7__9999999999"  # a newer run of another seed
    shutil.copytree(run_dir, other_seed)
    values = settings(name, games_root, tiny_model_dir, runs, judge.url, resume="auto")
    assert harness.find_checkpoint("auto", str(runs), exp_name, 0, "--resume") == checkpoints(copy)[-1]
    assert harness.find_checkpoint("auto", str(runs), exp_name, 7, "--resume") == checkpoints(other_seed)[-1]
    assert harness.find_checkpoint("auto", str(runs), exp_name, 2, "--resume") is None

    # another seed has nothing to resume, and says so (this start then fails on purpose, at the data root)
    with pytest.raises(harness.StartupError, match="--data-root"):
        module.main(module.Args(**{**values, "seed": 2, "data_root": str(tmp_path / "nowhere")}))
    assert (
        f"--resume auto: no checkpoint of a run {exp_name}__2__* in {runs}; starting a new run"
        in capsys.readouterr().err
    )

    # a run written before the scripts took one vocabulary: its config.json has the old flag names, read as the new
    config = json.loads((copy / "config.json").read_text())
    old_names = {"group_size": "branches", "groups_per_update": "states_per_batch", "max_turns": "max_episode_steps"}
    if name != "tempo":
        old_names = {"group_size": "trajectories_per_game", "groups_per_update": "games_per_update"}
    (copy / "config.json").write_text(json.dumps({old_names.get(key, key): value for key, value in config.items()}))

    rows_before = (copy / "metrics.jsonl").read_text()
    with pytest.raises(harness.StartupError) as error:
        module.main(module.Args(**{**values, "learning_rate": 0.5, "temperature": 0.7, "group_size": 3}))
    assert str(copy / "config.json") in str(error.value)
    assert "--learning-rate 0.5 (the run: 0.01); --temperature 0.7 (the run: 1.0)" in str(error.value)
    assert f"--group-size 3 (the run: {values['group_size']})" in str(error.value)
    assert f"{copy / 'config.json'}: old flag names read as the new ones: " in capsys.readouterr().err
    assert (copy / "metrics.jsonl").read_text() == rows_before

    # one more update, fewer threads and another micro-batch size: the same run, extended
    more = (
        {"td_updates": budget(name)["td_updates"] + 1} if name == "tempo" else {"num_updates": total_updates(name) + 1}
    )
    resumed = module.main(module.Args(**{**values, **more, "threads": 1, "micro_batch_tokens": 2048}))
    assert resumed == copy and len(checkpoints(copy)) == total_updates(name) + 1
    assert json.loads((copy / "config.json").read_text())["micro_batch_tokens"] == 2048


# =============================================================================================
# --eval-only evaluates the run as it was trained
# =============================================================================================
@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_eval_only_evaluates_the_run_as_trained(name, killed_job, tmp_path, judge):
    """Only --eval-only and --output-dir given on the command line: model, data, budgets and eval games come from the
    run's config.json. A flag passed still overrides, even at its Args default (--seed 1; the run's seed is 0), and
    without training-only checks (tempo: 3 turns is no multiple of --macro-rounds 2)."""
    module = SCRIPTS[name]
    _, run_dir, _ = killed_job(name)
    turns = "max_turns" if name == "tempo" else "max_turns"
    assert module.Args().seed == 1
    argv = ["--eval-only", str(run_dir), "--output-dir", str(tmp_path), f"--{turns.replace('_', '-')}", "3"]
    eval_dir = harness.cli(module.Args, module.main, argv=argv + ["--seed", "1"])
    config, trained = (json.loads((d / "config.json").read_text()) for d in (eval_dir, run_dir))
    assert config[turns] == 3 and config["eval_only"] == str(run_dir)
    assert trained["seed"] == 0 and config["seed"] == 1 and eval_dir.name.startswith(f"{trained['exp_name']}__1__")
    for key in ("model", "data_root", "exp_name", "max_turn_tokens", "max_trajectory_tokens", "eval_games"):
        assert config[key] == trained[key], key
    (row,) = read_rows(eval_dir / "metrics.jsonl")
    assert row["checkpoint"] == str(checkpoints(run_dir)[-1]) and "eval/valid_seen/success_rate" in row
    for split in ("valid_seen", "valid_unseen"):  # success with its n and its 95% interval
        low, rate, high = (row[f"eval/{split}/{key}"] for key in ("success_ci_low", "success_rate", "success_ci_high"))
        assert row[f"eval/{split}/n"] == trained["eval_games"] and 0 <= low <= rate <= high <= 1


# =============================================================================================
# Bad games fail at start, named; start-up errors are one line and exit 2; threads; launched process count
# =============================================================================================
@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("split", ["train", "valid_unseen"])
def test_bad_game_fails_at_start_naming_it(name, split, games_root, tiny_model_dir, tmp_path, judge):
    """Valid JSON, PDDL missing a parenthesis: a training game, or an evaluation game of a run that evaluates."""
    data_root = tmp_path / "games"
    shutil.copytree(games_root, data_root)
    module = SCRIPTS[name]
    bad = common.eval_subset(data_root, split, None, 1)[0] if split != "train" else common.discover_games(data_root)[0]
    data = json.loads(Path(bad).read_text())
    Path(bad).write_text(json.dumps({**data, "pddl_problem": data["pddl_problem"].rstrip().removesuffix(")")}))
    values = settings(name, games_root, tiny_model_dir, tmp_path / "runs", judge.url, data_root=str(data_root))
    with pytest.raises(harness.StartupError, match=re.escape(bad) + ".*Missing"):
        module.main(module.Args(**{**values, "eval_every": 1}))
    assert not list(tmp_path.glob("runs/*"))


@pytest.mark.slow
def test_config_records_the_data_root_used(games_root, tiny_model_dir, tmp_path, monkeypatch, judge):
    """Without --data-root the run uses the offline game set; config.json (written from these args) says where."""
    generated = tmp_path / "cache" / f"offline-games-n{offline.DEFAULT_GAMES}-seed{offline.DEFAULT_GAMES_SEED}"
    generated.parent.mkdir()
    generated.symlink_to(games_root)  # stands in for the generated set
    monkeypatch.setattr(offline, "DEFAULT_CACHE_DIR", tmp_path / "cache")
    args = tempo.Args(**settings("tempo", games_root, tiny_model_dir, tmp_path / "runs", data_root=None))
    args, _, _ = harness.startup_checks(args, tempo.ALGORITHM, harness.make_accelerator(), tempo.validate_args)
    assert args.data_root == str(generated)


@pytest.mark.slow
def test_game_that_fails_to_load_mid_run_is_skipped_not_fatal(games_root, tiny_model_dir, tmp_path, judge, capfd):
    """A broken grammar passes the start-up parse (grammars are parsed when a game first loads): the run skips that
    game with a warning naming it, counts it, and finishes."""
    data_root = tmp_path / "games"
    shutil.copytree(games_root, data_root)
    bad = common.discover_games(data_root, seed=0)[1]  # the second game adca_grpo's first update plays
    data = json.loads(Path(bad).read_text())
    Path(bad).write_text(json.dumps({**data, "grammar": data["grammar"].replace(";", "", 3)}))
    with pytest.raises(common.BadGameError, match=re.escape(bad)):
        common.load_game(bad)
    values = settings("adca_grpo", games_root, tiny_model_dir, tmp_path / "runs", judge.url, data_root=str(data_root))
    run_dir = adca_grpo.main(adca_grpo.Args(**{**values, "num_updates": 1, "save_every": 0}))
    (row,) = read_rows(run_dir / "metrics.jsonl")
    assert row["rollout/bad_games_skipped"] == 1 and row["prm/label_requests"] == 4  # two good games were played
    assert f"skipped a game that does not load: {bad}" in capfd.readouterr().err


@pytest.mark.slow
def test_eval_game_that_fails_to_load_mid_run_is_skipped_not_fatal(games_root, tiny_model_dir, tmp_path, capfd):
    """The same for an evaluation game: the evaluation goes on without it, says so and counts it."""
    data_root = tmp_path / "games"
    shutil.copytree(games_root, data_root)
    bad = common.eval_subset(data_root, "valid_seen", None, 1)[0]
    data = json.loads(Path(bad).read_text())
    Path(bad).write_text(json.dumps({**data, "grammar": data["grammar"].replace(";", "", 3)}))
    values = settings("tempo", games_root, tiny_model_dir, tmp_path / "runs", data_root=str(data_root))
    run_dir = tempo.main(tempo.Args(**{**values, "warmup_updates": 1, "td_updates": 0, "eval_every": 1}))
    _, row = read_rows(run_dir / "metrics.jsonl")  # the start's evaluation, then update 1's
    assert row["eval/valid_seen/bad_games_skipped"] == 1 and "eval/valid_seen/success_rate" not in row
    assert "eval/valid_unseen/success_rate" in row  # the other split was evaluated
    assert f"[eval] WARNING: skipped a game that does not load: {bad}" in capfd.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, flags, message",
    [
        ("tempo.py", ["--seed", "-1"], "error: --seed must be >= 0, got -1"),
        (  # found while the runtime is built: the labeller's endpoint check
            "adca_grpo.py",
            ["--labeler-backend", "api", "--labeler-base-url", "http://127.0.0.1:9/v1", "--eval-every", "0"],
            "error: --labeler-base-url http://127.0.0.1:9/v1: cannot reach the labeller",
        ),
    ],
)
def test_startup_error_prints_one_line_and_exits_2(script, flags, message, games_root, tiny_model_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / script), "--model", str(tiny_model_dir), "--data-root", str(games_root), *flags],
        cwd=tmp_path,
        env=job_env(DASHSCOPE_API_KEY="EMPTY"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1].startswith(message)


@pytest.mark.slow
def test_launch_that_runs_fewer_processes_than_asked_warns(tmp_path):
    """On CPU, `accelerate launch --num_processes 2` without --multi_gpu runs one process: said at start."""
    accelerate = str(Path(sys.executable).parent / "accelerate")
    # --quiet: accelerate >= 1.16 would otherwise repeat the child's stderr in its own traceback
    command = [accelerate, "launch", "--quiet", "--cpu", "--num_processes", "2", "--num_machines", "1"]
    command += ["--mixed_precision", "no"]
    result = subprocess.run(
        [*command, "--dynamo_backend", "no", str(ROOT / "tempo.py"), "--model", "tiny", "--seed", "-1"],
        cwd=tmp_path,
        env=job_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stderr.count("launched for several processes but running ONE") == 1, result.stderr[-2000:]
    assert "error: --seed must be >= 0" in result.stderr


def test_threads_flag_default_and_oversubscription_warning(monkeypatch, capsys):
    cores = len(os.sched_getaffinity(0))
    try:
        assert harness.set_threads(tempo.Args(threads=2), 1) == 2 and torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert harness.set_threads(tempo.Args(), 1) == 1 and torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert harness.set_threads(tempo.Args(), 2) == max(1, cores // 2)
        capsys.readouterr()
        assert harness.set_threads(tempo.Args(), 4 * cores) == 1  # more local processes than cores
        assert "oversubscribed" in capsys.readouterr().err
    finally:
        torch.set_num_threads(1)


# =============================================================================================
# Non-finite steps are skipped and counted
# =============================================================================================
@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_nonfinite_loss_skips_the_step(name, games_root, tiny_model_dir, tmp_path, judge, capsys):
    module = SCRIPTS[name]
    args = module.Args(**settings(name, games_root, tiny_model_dir, tmp_path, judge.url, learning_rate=1e30))
    accelerator = harness.make_accelerator()
    set_seed(0)
    rt = module.Runtime(args, accelerator)
    (group,) = common.rollout(
        [common.game_start(rt.games[0], rt.protocol)],
        1,
        rt.sample_fn,
        rt.protocol,
        horizon=2,
        max_turns=2,
        max_turn_tokens=16,
        max_trajectory_tokens=4096,
    )
    tokens, old_logprobs, step_ids = group[0].sequence()
    mask = [float(k >= 0) for k in step_ids]

    def train(advantage):
        before = {n: p.detach().clone() for n, p in rt.model.named_parameters() if p.requires_grad}
        datum = training.Datum(tokens, old_logprobs, [advantage * m for m in mask], mask)
        metrics = training.train_step(rt, [datum], policy_loss(module))
        changed = any(not torch.equal(before[n], p) for n, p in rt.model.named_parameters() if p.requires_grad)
        return metrics, changed

    metrics, changed = train(float("nan"))  # a NaN advantage
    assert metrics["train/nonfinite_skipped"] == 1 and not changed
    metrics, changed = train(1.0)  # a finite step with a learning rate of 1e30: the weights explode...
    assert metrics["train/nonfinite_skipped"] == 0 and changed
    metrics, changed = train(1.0)  # ...and the next loss is not finite: skipped, weights untouched
    assert (
        metrics["train/nonfinite_skipped"] == 1
        and not changed
        and not torch.isfinite(torch.tensor(metrics["train/loss"]))
    )
    assert capsys.readouterr().err.count("step skipped") == 2


# =============================================================================================
# A real 2-process job: `accelerate launch` on CPU (gloo), W&B offline
# =============================================================================================
def launch(
    name, values: dict, tmp_path: Path, timeout_s: int = 240, preset: str = "", cwd: Path | None = None
) -> tuple[subprocess.CompletedProcess, list[int]]:
    """`accelerate launch` with 2 CPU processes under `timeout` (the script's preset, if given, then the values), in
    cwd (default tmp_path); returns the result and the pids of any process of the job still alive after it ended
    (found by a marker in their environment; they are killed)."""
    marker = uuid.uuid4().hex
    command = [
        "timeout",
        "-k",
        "10",
        str(timeout_s),
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(ROOT / f"{name}.py"),
        *([preset] if preset else []),
        *cli(values),
    ]
    env = job_env(
        WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb"), OMP_NUM_THREADS="1", TRAINING_JOB_MARKER=marker
    )
    result = subprocess.run(
        command, cwd=cwd or tmp_path, env=env, capture_output=True, text=True, timeout=timeout_s + 30
    )
    time.sleep(1.0)  # let exiting children go
    leftovers = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("TRAINING_JOB_MARKER") == marker:
                leftovers.append(process.pid)
                process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return result, leftovers


# TEMPO's 2-process job trains every weight (--lora-rank 0), the others' a LoRA adapter; TEMPO's LoRA on 2 processes is
# its --fsdp job's (test_fsdp_two_process_job)
DDP_FULL_WEIGHTS = ("tempo",)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_two_process_job(name, games_root, tiny_model_dir, tmp_path, monkeypatch):
    """2 processes (DDP): one line per update, every checkpoint once with every rank's state and the same weights on
    both ranks, W&B offline with the sample tables; TEMPO's: every weight trained, and the 2-process resume."""
    n, lora_rank = total_updates(name), 0 if name in DDP_FULL_WEIGHTS else 4
    monkeypatch.setenv(JUDGE_KEY_ENV, "not-a-secret")  # inherited by the job
    with judge_endpoint(delay_s=0.1) if name == "adca_grpo" else contextlib.nullcontext() as judge:
        values = settings(
            name,
            games_root,
            tiny_model_dir,
            tmp_path / "runs",
            judge.url if judge else "",
            track=True,
            lora_rank=lora_rank,
            **({"labeler_log_dir": str(tmp_path / "labels")} if judge else {}),
        )
        values = for_processes(name, values)  # each process plays what one plays alone with the budget
        (tmp_path / "wandb").mkdir()
        result, leftovers = launch(name, values, tmp_path)
    assert result.returncode == 0, result.stderr[-5000:]
    assert not leftovers, f"processes of the job still running after it ended: {leftovers}"
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = read_rows(run_dir / "metrics.jsonl")
    assert [r["update"] for r in rows] == list(range(1, n + 1))  # one line per update: logged once
    run_counts = {k: values.get(k, getattr(SCRIPTS[name].Args(), k)) for k in SCRIPTS[name].Args.GLOBAL_COUNTS}
    shares = "; ".join(f"--{k.replace('_', '-')} {v} ({v // 2} per process)" for k, v in run_counts.items())
    assert f"[start] 2 process(es): {shares}" in result.stderr
    if name != "tempo":  # the run's games: both processes' episodes
        assert all(r["rollout/episodes"] == values["groups_per_update"] * values["group_size"] for r in rows)

    # Every checkpoint was written once, holds every rank's state, and all ranks held the same adapter.
    assert [c.name for c in checkpoints(run_dir)] == [f"update_{u:06d}" for u in range(1, n + 1)]
    assert result.stderr.count("identical on 2 process(es)") == n
    for checkpoint in checkpoints(run_dir):
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        assert len(state["rank_states"]) == 2 and len(torch.load(checkpoint / "rng.pt", weights_only=True)) == 2
        weights = load_file(checkpoint / harness.weights_file(lora=lora_rank > 0))
        assert state["adapter_sha256"] == samplers.adapter_sha256(weights)
        assert f"{state['adapter_sha256'][:16]} identical on 2 process(es)" in result.stderr
        if "heads_sha256" in state:  # the algorithm's own modules (ppo.py's value head), identical on both ranks too
            assert state["heads_sha256"] == samplers.adapter_sha256(load_file(checkpoint / harness.HEADS_FILE))
            assert f"and heads sha256 {state['heads_sha256'][:16]}" in result.stderr

    # W&B offline: one run (the main process's), with the sample trajectories as tables.
    (wandb_run,) = (tmp_path / "wandb" / "wandb").glob("offline-run-*")
    assert list(wandb_run.glob("*.wandb")) and list(wandb_run.glob("files/media/table/samples_*.table.json"))

    if name == "adca_grpo":
        assert judge.max_in_flight <= 2  # --labeler-concurrency 2 bounds both processes together
        assert all(r["prm/label_requests"] == 8 and r["prm/label_failures"] == 0 for r in rows)  # 4 per rank
        assert all(r["train/tokens"] == r["rollout/generated_tokens"] > 0 for r in rows)  # summed over ranks alike
        for rank in (0, 1):
            assert len((tmp_path / "labels" / f"labels_rank{rank}.jsonl").read_text().splitlines()) == 4 * n
        return
    if name != "tempo":  # 2 games x N episodes per rank: the tokens (GiGPO: the step groups) summed over the ranks
        assert all(r["train/tokens"] == r["rollout/generated_tokens"] > 0 for r in rows)
        assert name != "gigpo" or all(r["gigpo/step_groups"] >= 4 for r in rows)
        return

    # TEMPO: each rank kept its own store of states from its own games; a 2-process resume restores both shards.
    stores = json.loads((checkpoints(run_dir)[-2] / "trainer_state.json").read_text())["rank_states"]
    games = [{json.loads(saved)["game_file"] for saved, _value in rank["store"]} for rank in stores]
    assert all(games) and not games[0] & games[1]
    assert all(r["rollout/generated_tokens"] > 0 for r in rows)
    with pytest.raises(ValueError, match="written by 2 processes"):
        tempo.main(tempo.Args(**{**values, "track": False, "resume": str(checkpoints(run_dir)[-2])}))
    # A 2-process checkpoint written when the counts were per process (no "counts" in its state) is refused.
    old = shutil.copytree(checkpoints(run_dir)[-2], tmp_path / "old_checkpoint")
    state = json.loads((old / "trainer_state.json").read_text())
    del state["counts"]
    (old / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="were per process"):
        harness.check_checkpoint(old, tempo.Args(**values), "tempo", "--resume", 2)
    shutil.rmtree(checkpoints(run_dir)[-1])  # resume from update n - 1 as if the job had died in update n
    result, leftovers = launch(name, {**values, "resume": "auto"}, tmp_path)
    assert result.returncode == 0 and not leftovers, result.stderr[-5000:]
    resumed = read_rows(run_dir / "metrics.jsonl")
    assert [r["update"] for r in resumed] == list(range(1, n + 1)) and resumed[-1]["td/fresh_states"] == 0


def test_a_count_of_the_run_that_does_not_divide_among_the_processes_is_refused_with_the_fix():
    """The counts of an update are the run's: each process takes its share, at any process count."""
    assert plan.process_shares(SCRIPTS["gigpo"].Args(groups_per_update=3), 1) == {"groups_per_update": 3}
    with pytest.raises(ValueError, match=r"--groups-per-update 3 .* 2 processes.* multiple of 2 \(2 or 4\)"):
        plan.process_shares(SCRIPTS["gigpo"].Args(groups_per_update=3), 2)
    counts = dict(groups_per_update=8, warmup_groups_per_update=4)
    assert plan.process_shares(tempo.Args(**counts), 4) == dict(groups_per_update=2, warmup_groups_per_update=1)
    with pytest.raises(ValueError, match=r"--warmup-groups-per-update 4 .* 8 processes.* multiple of 8 \(8\)"):
        plan.process_shares(tempo.Args(**counts), 8)


# =============================================================================================
# --fsdp: the policy sharded over 2 CPU processes (FSDP2 on gloo)
# =============================================================================================
@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_fsdp_first_update_equals_one_unsharded_process(lora_rank, tmp_path):
    """The same global batch, one train_step: 1 process unsharded and 2 processes --fsdp (each training its half)
    agree on the loss, the gradient norm and every trained weight after the step (benchmarks/speed/fsdp_memory.py
    at toy size: it also reports the memory)."""
    from benchmarks.speed import fsdp_memory

    args = fsdp_memory.Args(size="toy", out=str(tmp_path), lora_rank=lora_rank, datums=4, tokens=64)
    runs = fsdp_memory.main(args)
    (single,), sharded = runs[1], runs[2]
    assert single["trained_parameters"] == sharded[0]["trained_parameters"] > 0
    assert (lora_rank == 0) == (single["trained_parameters"] == single["parameters"])
    for rank in sharded:
        assert rank["loss"] == pytest.approx(single["loss"], rel=1e-5, abs=1e-6)
        assert rank["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
        assert rank["weights_sha256"] == sharded[0]["weights_sha256"]  # both processes hold the same whole weights
    one, two = (load_file(tmp_path / f"processes_{n}" / "weights.safetensors") for n in (1, 2))
    start = load_file(tmp_path / "model" / "model.safetensors")
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-6)
    moved = [name for name in one if name in start and not torch.equal(one[name], start[name])]
    assert lora_rank or moved  # full weights: the step moved them (LoRA: B starts at 0, A moves)


@pytest.fixture(scope="module")
def tiny_agent() -> dict:
    """The tiny agent (assets/tiny-agent) on its own games (made once into the cache)."""
    model, games = offline.tiny_agent()
    return dict(model=str(model), data_root=str(games), task_types=offline.TINY_AGENT_TASK_TYPES)


# Every script twice, LoRA and full weights, each run trained; one of the two also resumed from a mid-run checkpoint:
# LoRA for ADCA-GRPO (the judge's labels train its adapter), full weights for the others (ppo.py: and its value head)
FSDP_RESUMED_WITH_LORA = ("adca_grpo",)
FSDP_JOBS = [(name, rank, rank == (4 if name in FSDP_RESUMED_WITH_LORA else 0)) for name in SCRIPTS for rank in (4, 0)]
# The random tiny model trains nothing where its episodes all fail alike and only outcomes tell steps apart: TEMPO (its
# critic never writes a value), GiGPO and any outcome-only script (a fork's: tests/test_fork.py). ADCA-GRPO's judge
# labels and PPO's value head train it; the others get the tiny agent, which trains in every update. GiGPO: at 24-token
# turns some replies are cut short (invalid actions, penalised) and others are not; TEMPO: at 48-token turns (whole
# actions) its critic's 4 values of a state differ; any other script: whole actions and episodes long enough to win
# (4 turns: ~1 in 4; both forks' jobs train at 4 as at 6, in ~2/3 of the time), so that outcomes differ within a
# group. At 1e-2 with full weights the agent wrote no critic value after one update: 1e-4.
TRAINS_ON_THE_RANDOM_MODEL = ("adca_grpo", "ppo")
ON_THE_TINY_AGENT = {
    "tempo": dict(max_turn_tokens=48, critic_samples=4, learning_rate=1e-4),
    "gigpo": dict(max_turn_tokens=24, learning_rate=1e-4),
}
OUTCOMES_ON_THE_TINY_AGENT = dict(max_turn_tokens=48, max_turns=4, learning_rate=1e-4)
FSDP_VLLM = "gigpo"  # its LoRA job samples through the vLLM server (on the tiny agent, which the server serves)
FSDP_EVAL_ONLY = "gigpo"  # its resumed run (full weights) is also evaluated with --eval-only (once: ~5-10 s each)
FSDP_BF16 = "ppo"  # its full-weights job computes in bfloat16: float32 shards and float32 gathered weights


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, lora_rank, resume",
    [pytest.param(*job, marks=pytest.mark.vllm_server) if job[0] == FSDP_VLLM and job[1] else job for job in FSDP_JOBS],
)
def test_fsdp_two_process_job(
    name, lora_rank, resume, games_root, tiny_model_dir, tiny_agent, tmp_path, monkeypatch, request
):
    """--fsdp on 2 processes: the job trains, its checkpoints hold the whole weights (identical on both ranks) and the
    whole optimizer state; with `resume`, a copy of its directory as a death in update k + 1 leaves it (checkpoints
    1..k; the rows of later updates logged) resumed on 2 processes with --resume auto logs the same metrics and ends
    with the same weights and optimizer state (GiGPO's: --eval-only then evaluates it in one process). A real SIGKILL
    mid-update is the single-process test's (test_killed_job_resumes_exactly, every script).
    GiGPO's LoRA job samples through the vLLM server, which serves the adapter of the weights each update trains."""
    monkeypatch.setenv(JUDGE_KEY_ENV, "not-a-secret")  # inherited by the job
    vllm = request.getfixturevalue("vllm") if name == FSDP_VLLM and lora_rank else None
    with judge_endpoint() if name == "adca_grpo" else contextlib.nullcontext() as judge:
        url = judge.url if judge else ""
        straight = settings(
            name, games_root, tiny_model_dir, tmp_path / "straight", url, lora_rank=lora_rank, fsdp=True
        )
        if "num_updates" in straight:  # the fewest for a resume in an update after a checkpoint (TEMPO's budget: 3)
            straight["num_updates"] = kill_after(name) + 1
        if name not in TRAINS_ON_THE_RANDOM_MODEL:
            straight |= tiny_agent | ON_THE_TINY_AGENT.get(name, OUTCOMES_ON_THE_TINY_AGENT)
        straight = for_processes(name, straight)
        if vllm:
            straight |= dict(sampler="vllm", sampler_url=vllm.url, sampler_adapter_dir=str(tmp_path / "adapters"))
        if name == FSDP_BF16 and not lora_rank:
            straight["dtype"] = "bfloat16"
        # the vLLM job runs in the repo's directory: the server names its model by a path relative to it
        result, leftovers = launch(name, straight, tmp_path, cwd=ROOT if vllm else None)
        assert result.returncode == 0 and not leftovers, result.stderr[-5000:]
        if resume:
            copy_as_died_after(tmp_path / "straight", tmp_path / "resumed", kill_after(name))
            values = {**straight, "output_dir": str(tmp_path / "resumed"), "resume": "auto"}
            resumed, leftovers = launch(name, values, tmp_path)
            assert resumed.returncode == 0 and not leftovers, resumed.stderr[-5000:]
            assert f"resumed {tmp_path / 'resumed'}" in resumed.stderr
    runs = [next((tmp_path / d).iterdir()) for d in ("straight", "resumed")[: 1 + resume]]
    n = updates(straight)
    rows = [read_rows(run / "metrics.jsonl") for run in runs]
    for run, run_rows in zip(runs, rows):
        assert [r["update"] for r in run_rows] == list(range(1, n + 1))
        assert [c.name for c in checkpoints(run)] == [f"update_{u:06d}" for u in range(1, n + 1)]
    assert any(r.get("train/grad_norm", 0) > 0 for r in rows[0])  # it trained (TEMPO logs none for an idle update)
    final = [checkpoints(run)[-1] for run in runs]
    weights = [load_file(c / harness.weights_file(lora=lora_rank > 0)) for c in final]
    state = json.loads((final[0] / "trainer_state.json").read_text())
    assert state["adapter_sha256"] == samplers.adapter_sha256(weights[0]) and len(state["rank_states"]) == 2
    assert result.stderr.count("identical on 2 process(es)") == n
    optimizer = [torch.load(c / "optimizer.pt", weights_only=True)["state"] for c in final]
    trained = sum(v.numel() for v in weights[0].values())
    assert sum(s["exp_avg"].numel() for s in optimizer[0].values()) >= trained  # whole, not one rank's shard
    if lora_rank == 0:  # the checkpoint is a transformers model directory
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(final[0])
    if vllm:
        assert_trained_on_the_served_policy(rows[0])  # each update sampled from the served copy of what it trained
        # The server's newest adapter (written once, the earlier ones removed): what the last update sampled with
        sampled = checkpoints(runs[0])[-2]
        digest = json.loads((sampled / "trainer_state.json").read_text())["adapter_sha256"]
        adapter = f"{name}-{straight['lora_alpha']}-{digest[:16]}"
        assert [p.name for p in (tmp_path / "adapters").iterdir()] == [adapter] and adapter in served_adapters(vllm.url)
        served = load_file(tmp_path / "adapters" / adapter / "adapter_model.safetensors")
        checkpointed = load_file(sampled / "adapter_model.safetensors")
        assert served.keys() == checkpointed.keys() and all(torch.equal(served[k], checkpointed[k]) for k in served)
    if not resume:
        return
    for row, want in zip(rows[1], rows[0]):
        assert row.keys() == want.keys()
        for key in (k for k in row if not TIMING_KEYS.search(k)):
            expected = want[key] if isinstance(want[key], str) else pytest.approx(want[key], rel=1e-6, abs=1e-9)
            assert row[key] == expected, (row["update"], key)
    assert any(r.get("train/grad_norm", 0) > 0 for r in rows[1][kill_after(name) :])  # the resumed updates trained
    states = [json.loads((c / "trainer_state.json").read_text())["rank_states"] for c in final]
    assert states[1] == states[0]  # each process's game cursor (TEMPO: and its state store)
    for key in weights[0]:
        torch.testing.assert_close(weights[1][key], weights[0][key], rtol=1e-5, atol=1e-7)
    for index in optimizer[0]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(optimizer[1][index][key], optimizer[0][index][key], rtol=1e-5, atol=1e-9)
    if name == FSDP_EVAL_ONLY:  # in one process, no --fsdp: taken from the command line, not from the run's config
        argv = ["--eval-only", str(runs[1]), "--output-dir", str(tmp_path / "eval")]
        (row,) = read_rows(harness.cli(SCRIPTS[name].Args, SCRIPTS[name].main, argv=argv) / "metrics.jsonl")
        assert row["update"] == n and row["checkpoint"] == str(final[1]) and "eval/train/success_rate" in row
