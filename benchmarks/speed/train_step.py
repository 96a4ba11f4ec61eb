"""One training step at a Qwen-size vocabulary: peak memory and trained tokens/s of today's path (the lm_head and the
log-softmax only at the trained positions, LOGIT_CHUNK at a time, recomputed in the backward pass:
training.teacher_forced) against the full-logits path it replaced (fp32 logits of every position, kept here as the
reference), the floor (the lm_head at the trained positions only, all at once, nothing recomputed) and the body alone
(the transformer without any lm_head: what no logprob path can beat).

    python -m benchmarks.speed.train_step                      # 4,096 and 16,384 tokens, 10% trained
    python -m benchmarks.speed.train_step --tokens 4096 --trained-share 0.3

Each measurement runs in a fresh process (peak RSS is per process): a random 2-layer Qwen2 with Qwen's 151,936-token
vocabulary, LoRA as the scripts load it, one `training.train_step` on one datum whose trained tokens are spread over it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[2]

PATHS = ("full_logits", "selective", "floor", "body_only")


@dataclass
class Args:
    tokens: tuple[int, ...] = (4096, 16384)
    """datum lengths to measure"""
    trained_share: float = 0.1
    """share of the datum's tokens that are trained (generated tokens; the rest is prompt and observations)"""
    vocab_size: int = 151936
    """Qwen2.5 / Qwen3's vocabulary"""
    hidden_size: int = 256
    """hidden size of the random model"""
    layers: int = 2
    """transformer layers of the random model"""
    threads: int = 1
    """torch threads"""
    path: str = ""
    """internal: measure this one path (one of full_logits, selective, floor) in this process"""
    model_dir: str = ""
    """internal: the random model's directory"""


def full_logits_logprobs(policy, rows, temperature, pad_id, device, needed=None):
    """The replaced path: fp32 logits of every position, /temperature, full-vocabulary logsumexp."""
    import torch

    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], device=device)
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    logits = policy(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    logits = logits / temperature
    logprobs = logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(logprobs, (1, 0))


def trained_positions_at_once(policy, rows, temperature, pad_id, device, needed=None):
    """The floor: the lm_head and log-softmax at the needed positions only, in one piece, kept for the backward."""
    import torch

    input_ids = torch.tensor(rows, device=device)  # one datum: no padding
    model = policy.get_base_model()
    hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
    row, column = needed.nonzero(as_tuple=True)
    logits = model.get_output_embeddings()(hidden[row, column - 1]).float() / temperature
    picked = logits.gather(-1, input_ids[row, column].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.zeros(input_ids.shape, device=device).index_put((row, column), picked)


def body_only(policy, rows, temperature, pad_id, device, needed=None):
    """The transformer body forward (and, through the loss, backward), no lm_head."""
    import torch

    input_ids = torch.tensor(rows, device=device)
    hidden = policy.get_base_model().get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
    return hidden.mean(-1)  # a differentiable stand-in of the logprobs' shape


def measure(args: Args) -> dict:
    import types

    import psutil
    import torch

    import harness
    import samplers
    import tempo
    import training

    torch.set_num_threads(args.threads)
    run_args = tempo.Args(model=args.model_dir, lora_rank=16, lora_alpha=32, micro_batch_tokens=max(args.tokens))
    accelerator = harness.make_accelerator()
    tokenizer, model, optimizer = samplers.load_model(run_args, accelerator)
    rt = types.SimpleNamespace(
        args=run_args,
        accelerator=accelerator,
        tokenizer=tokenizer,
        model=model,
        optimizer=optimizer,
        heads=torch.nn.ModuleDict(),
    )
    other_paths = {"full_logits": full_logits_logprobs, "floor": trained_positions_at_once, "body_only": body_only}
    if args.path in other_paths:  # train_step's forward pass: (logprobs, hidden states), which tempo's loss ignores
        training.teacher_forced = lambda *forward_args: (other_paths[args.path](*forward_args), None)
    rng = random.Random(0)
    (n,) = args.tokens
    tokens = [rng.randrange(args.vocab_size) for _ in range(n)]
    mask = [0.0] + [1.0 if rng.random() < args.trained_share else 0.0 for _ in range(n - 1)]
    datum = training.Datum(tokens, [-1.0] * n, [rng.gauss(0, 1) * m for m in mask], mask)
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    metrics = training.train_step(rt, [datum], tempo.policy_loss)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"path": args.path, "tokens": n, "trained": sum(mask), "seconds": seconds,
            "peak_growth_gb": max(0, peak - before) / 1e9, "loss": metrics["train/loss"]}  # fmt: skip


def main(args: Args) -> None:
    if args.path:
        print(json.dumps(measure(args)))
        return
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    import samplers

    with tempfile.TemporaryDirectory() as model_dir:
        tiny = samplers.resolve_model("tiny")  # a tokenizer for the model dir; the ids below are random in the vocab
        AutoTokenizer.from_pretrained(tiny).save_pretrained(model_dir)
        config = Qwen2Config(
            vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
            max_position_embeddings=max(args.tokens) + 1,
        )  # fmt: skip
        Qwen2ForCausalLM(config).save_pretrained(model_dir)
        print(f"random Qwen2: {args.layers} layers, hidden {args.hidden_size}, vocabulary {args.vocab_size}; "
              f"{args.trained_share:.0%} of the tokens trained; {args.threads} thread(s)")  # fmt: skip
        for n in args.tokens:
            results = {}
            for path in PATHS:
                child = dataclasses.replace(args, path=path, model_dir=model_dir, tokens=(n,))
                flags = [f"--{k.replace('_', '-')}" for k in ("path", "model_dir", "threads", "trained_share")]
                values = [child.path, child.model_dir, str(child.threads), str(child.trained_share)]
                command = [
                    sys.executable,
                    "-m",
                    __spec__.name,
                    "--tokens",
                    str(n),
                    "--vocab-size",
                    str(args.vocab_size),
                ]
                command += [x for pair in zip(flags, values) for x in pair]
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
                out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=True).stdout
                results[path] = json.loads(out.strip().splitlines()[-1])
            full, ours, floor, body = (results[p] for p in PATHS)
            for path in PATHS:
                r = results[path]
                print(f"{n:6d} tokens ({r['trained']:.0f} trained)  {path:11s}  peak +{r['peak_growth_gb']:.2f} GB  "
                      f"{r['seconds']:6.2f} s  {r['trained'] / r['seconds']:7.0f} trained tok/s")  # fmt: skip
            print(f"{n:6d} tokens: selective vs full logits: memory {full['peak_growth_gb'] / ours['peak_growth_gb']:.1f}x "
                  f"less, {full['seconds'] / ours['seconds']:.1f}x faster; vs the floor: "
                  f"{ours['seconds'] / floor['seconds']:.2f}x the time, "
                  f"{ours['peak_growth_gb'] / max(floor['peak_growth_gb'], 1e-9):.2f}x the memory; vs the body alone: "
                  f"{ours['seconds'] / body['seconds']:.2f}x the time; loss equal: "
                  f"{abs(full['loss'] - ours['loss']) < 1e-4 and abs(floor['loss'] - ours['loss']) < 1e-4}")  # fmt: skip


if __name__ == "__main__":
    main(tyro.cli(Args))
