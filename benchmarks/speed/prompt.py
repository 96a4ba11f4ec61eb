"""Prompt and rollout-turn costs: extending the prompt at turn 1 vs turn 50 (should be flat); time per rollout turn
for 16 branches with the tiny model and tempo.py's sampler, split into sampling vs everything else; with the learning
benchmark's 0.93M model, one sampling turn vs history length and a long-horizon rollout (16 branches x 24 turns) end
to end, each with and without KV reuse (--kv-cache-mb 0).

    python -m benchmarks.speed.prompt [--data-root DIR] [--branches 16] [--turns 8] [--long-turns 24]
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
import harness
import offline
import samplers
import tempo

TOOL = '<tool_call>\n{"name": "alfworld_step", "arguments": {"action": "%s"}}\n</tool_call>'


def timed_sampler(sample_fn, clock):
    """The training scripts' sampler, with its wall time added to clock["sampling"]."""

    def sample(prompts, max_new_tokens):
        start = time.perf_counter()
        completions = sample_fn(prompts, max_new_tokens)
        clock["sampling"] += time.perf_counter() - start
        return completions

    return sample


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--branches", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-turn-tokens", type=int, default=48)
    parser.add_argument("--histories", type=int, nargs="*", default=[300, 1500, 3000, 6000])
    parser.add_argument("--long-turns", type=int, default=24)
    args = parser.parse_args()
    torch.manual_seed(0)
    model_dir = samplers.resolve_model("tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    protocol = common.ChatProtocol(tokenizer)
    game_file = common.discover_games(args.data_root or offline.default_data_root(), "train")[0]

    # 1. prompt extension cost vs history length
    state = common.game_start(game_file, protocol)
    prompt = list(state.prefix_tokens)
    completion = protocol.encode("I will look around.\n" + TOOL % "look") + [protocol.eos_token_id]
    content = protocol.tool_message(common.STATUS_EXECUTED, state.observation, state.admissible)
    per_turn = []
    for _ in range(50):
        start = time.perf_counter()
        for _ in range(20):
            delta = protocol.delta(completion, content)
        per_turn.append((time.perf_counter() - start) / 20)
        prompt += completion + delta
    reply = protocol.tokenizer.decode(completion, skip_special_tokens=True)
    history = state.messages + [
        {"role": m, "content": c} for _ in range(50) for m, c in (("assistant", reply), ("tool", content))
    ]
    full = protocol.render(history, add_generation_prompt=True)
    start = time.perf_counter()
    protocol.encode(protocol.render(history, add_generation_prompt=True))
    retokenise = time.perf_counter() - start
    print(
        f"prompt extension: turn 1 {per_turn[0] * 1e6:.0f} us, turn 50 {per_turn[-1] * 1e6:.0f} us "
        f"(ratio {per_turn[-1] / per_turn[0]:.2f}); prompt at turn 50 = {len(prompt)} tokens "
        f"(full render {len(protocol.encode(full))}); re-rendering + re-tokenising the 50-turn chat instead: "
        f"{retokenise * 1e6:.0f} us ({retokenise / per_turn[-1]:.0f}x)"
    )

    # 2. rollout turn time, sampling vs the rest
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    clock = {"sampling": 0.0}
    start = time.perf_counter()
    groups = common.rollout(
        [state],
        args.branches,
        timed_sampler(samplers.make_sampler(model, tokenizer, harness.make_accelerator(), tempo.Args()), clock),
        protocol,
        horizon=args.turns,
        max_episode_steps=50,
        max_turn_tokens=args.max_turn_tokens,
        max_trajectory_tokens=32_000,
    )
    total = time.perf_counter() - start
    turns = max(len(t.steps) for t in groups[0])
    print(
        f"rollout: {args.branches} branches x {turns} turns in {total:.2f} s = {total / turns * 1e3:.0f} ms/turn: "
        f"sampling {clock['sampling'] / turns * 1e3:.0f} ms, everything else "
        f"{(total - clock['sampling']) / turns * 1e3:.0f} ms (env, parsing, prompt deltas, restore)"
    )

    # 3. one sampling turn vs history length, 4. a long-horizon rollout: with and without KV reuse
    model_dir = samplers.resolve_model("tiny-agent")  # its architecture: hidden 128, 4 layers, 2 KV heads
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    accelerator = harness.make_accelerator()
    sample_fns = {
        name: samplers.make_sampler(model, tokenizer, accelerator, tempo.Args(kv_cache_mb=mb))
        for name, mb in (("reuse", tempo.Args.kv_cache_mb), ("re-prefill", 0))
    }
    print(
        f"learning benchmark model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M), {args.branches} "
        f"prompts x <= {args.max_turn_tokens} new tokens, {torch.get_num_threads()} thread(s)"
    )
    turn = {name: [] for name in sample_fns}
    for history in args.histories:
        timings = sampling_turn(sample_fns, history, args.branches, args.max_turn_tokens, len(tokenizer))
        for name, (seconds, generated) in timings.items():
            turn[name].append(seconds)
            print(f"  turn at a {history:5d}-token history, {name:10s}: {seconds:6.2f} s ({generated} new tokens)")
    first, last = args.histories[0], args.histories[-1]
    for name, times in turn.items():
        print(f"  {name}: a turn at {last} tokens costs {times[-1] / times[0]:.1f}x one at {first}")
    print(
        f"  reuse vs re-prefill: {', '.join(f'{b / a:.1f}x at {h}' for h, a, b in zip(args.histories, *turn.values()))}"
    )

    protocol = common.ChatProtocol(tokenizer)
    state = common.game_start(game_file, protocol)
    totals = {}
    for name, sample_fn in sample_fns.items():
        clock = {"sampling": 0.0}
        torch.manual_seed(0)
        start = time.perf_counter()
        (group,) = common.rollout(
            [state],
            args.branches,
            timed_sampler(sample_fn, clock),
            protocol,
            horizon=args.long_turns,
            max_episode_steps=args.long_turns,
            max_turn_tokens=args.max_turn_tokens,
            max_trajectory_tokens=32_000,
        )
        totals[name] = time.perf_counter() - start
        print(
            f"rollout {args.branches} branches x {max(len(t.steps) for t in group)} turns, {name:10s}: "
            f"{totals[name]:6.1f} s end to end (sampling {clock['sampling']:.1f} s), history "
            f"{len(state.prefix_tokens)} -> {max(len(t.tokens) for t in group)} tokens"
        )
    print(f"  reuse is {totals['re-prefill'] / totals['reuse']:.1f}x faster end to end")


def sampling_turn(sample_fns: dict, history: int, rows: int, max_new_tokens: int, vocab: int) -> dict:
    """Per sampler, (seconds, new tokens) of one call whose prompts are `history` tokens long and extend the sequences
    of a call before (its prompt + reply + observation tokens), as a rollout turn's do; random ids, the same prompts
    for every sampler (the call before is made once, through the reuse sampler, which keeps its caches)."""
    generator = torch.Generator().manual_seed(history)
    ids = lambda n: torch.randint(100, vocab, (n,), generator=generator).tolist()  # noqa: E731
    earlier = [ids(history - max_new_tokens - 64) for _ in range(rows)]
    torch.manual_seed(0)
    replies = sample_fns["reuse"](earlier, max_new_tokens)
    prompts = [p + r.tokens + ids(history - len(p) - len(r.tokens)) for p, r in zip(earlier, replies)]
    timings = {}
    for name, sample_fn in sample_fns.items():
        torch.manual_seed(1)
        start = time.perf_counter()
        completions = sample_fn(prompts, max_new_tokens)
        timings[name] = time.perf_counter() - start, sum(len(c.tokens) for c in completions)
    return timings


if __name__ == "__main__":
    main()
