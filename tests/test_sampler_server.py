"""`--sampler vllm` against faults a real vLLM server cannot be made to show on demand, injected by the stand-in of
tests/vllm_server.py (vLLM's OpenAI routes over real HTTP, backed by the tiny model): slow replies (the concurrency
bound, the deadline), bursts of 5xx answers (retries), a server without the runtime LoRA routes; and the sampler
flags. Everything a real server does is checked against one in tests/test_vllm.py."""

import time

import pytest
from vllm_server import TinyVllmServer

import harness
import samplers
import tempo


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    """Model, tokenizer and accelerator of a run (the server sampler is built on top in each test)."""
    args = tempo.Args(
        model=str(tiny_model_dir), lora_rank=4, lora_alpha=8, output_dir=str(tmp_path_factory.mktemp("o"))
    )
    accelerator = harness.make_accelerator()
    tokenizer, model, _ = samplers.load_model(args, accelerator)
    return args, accelerator, tokenizer, model


def server_args(args, url, **overrides) -> tempo.Args:
    return tempo.Args(**{**vars(args), "sampler": "vllm", "sampler_url": url, **overrides})


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"go to shelf {i}"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(n)
    ]


def test_one_turn_is_one_bounded_burst_of_concurrent_requests(tiny_model_dir, trainer):
    args, accelerator, tokenizer, model = trainer
    with TinyVllmServer(tiny_model_dir, delay_s=0.2) as slow:
        slow_args = server_args(args, slow.url, sampler_concurrency=3)
        sampler = samplers.make_sampler(model, tokenizer, accelerator, slow_args)
        assert len(sampler(chat_prompts(tokenizer, 6), 4)) == 6
        # one request a prompt, 3 of them at once and never more (speed is the benchmarks' business: a wall-clock bound
        # here failed on a loaded machine)
        assert slow.completions == 6 and slow.max_in_flight == 3


def test_server_errors_are_retried_with_backoff(tiny_model_dir, trainer):
    args, accelerator, tokenizer, model = trainer
    with TinyVllmServer(tiny_model_dir, fail_completions=2) as flaky:
        sampler = samplers.make_sampler(
            model, tokenizer, accelerator, server_args(args, flaky.url, sampler_concurrency=1)
        )
        assert len(sampler(chat_prompts(tokenizer, 2), 4)) == 2 and flaky.completions == 4


def test_a_slow_server_fails_the_call_at_the_deadline(tiny_model_dir, trainer):
    args, accelerator, tokenizer, model = trainer
    with TinyVllmServer(tiny_model_dir, delay_s=2.0) as slow:
        settings = dict(sampler_timeout_s=0.3, sampler_deadline_s=1.0)
        sampler = samplers.make_sampler(model, tokenizer, accelerator, server_args(args, slow.url, **settings))
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="not answered within --sampler-deadline-s 1.0 s"):
            sampler(chat_prompts(tokenizer, 2), 4)
        assert time.monotonic() - start < 2.0  # not a hang: the deadline, not the server, ended the call


def test_a_server_without_runtime_lora_loading_is_refused_at_start(tiny_model_dir, trainer):
    """(A real server started without VLLM_ALLOW_RUNTIME_LORA_UPDATING has no such routes either: FastAPI's 404.)"""
    args, accelerator, tokenizer, model = trainer
    with TinyVllmServer(tiny_model_dir, runtime_lora=False) as plain:
        with pytest.raises(ValueError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"):
            samplers.make_sampler(model, tokenizer, accelerator, server_args(args, plain.url))


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(sampler="vllm"), "--sampler-url"),
        (dict(sampler="vllm", sampler_url="localhost:8000/v1"), "--sampler-url"),
        (dict(sampler_url="http://localhost:8000/v1"), "--sampler-url"),
        (dict(sampler="vllm", sampler_url="http://x/v1", sampler_concurrency=0), "--sampler-concurrency"),
        (dict(sampler="vllm", sampler_url="http://x/v1", sampler_deadline_s=0), "--sampler-deadline-s"),
    ],
)
def test_sampler_flags_are_checked_at_start(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        harness.validate_model_args(tempo.Args(**overrides))
