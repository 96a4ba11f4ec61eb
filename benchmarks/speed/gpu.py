"""The prepared device check, sized for ~4 minutes on one H100/H200. First every algorithm script's `smoke` preset on
the device (what load_model does there: bf16, gradient checkpointing); then, on a randomly initialised model of
Qwen3-4B's shape, one GRPO update (adca_grpo.py --no-attribution) and one TEMPO TD update (tempo.py) through the
scripts' own main() (with vLLM installed, the GRPO update also through --sampler vllm-colocate), and one
training.train_step on a GRPO update's episodes with advantages +1 / -1 (a random model wins nothing, so the updates
train nothing). Each measurement is printed as one JSON line the moment it is done (a run cut short by its time limit
keeps what it printed), beside a plain transformers / peft reference measured in the same run: `generate()` at the
same batch and turn length for sampling, a forward + backward over the same sequences for the train step, and the
ratio ours / reference. On a machine with 2+ GPUs, also --fsdp (benchmarks/speed/fsdp_memory.py at its large size).

    python -m benchmarks.speed.gpu                       # on a GPU machine: Qwen3-4B's shape
    python -m benchmarks.speed.gpu --size toy --device-peak-tflops 0   # CPU, seconds: what tests/test_gpu_benchmark.py runs

The model has random weights (no download) and the tiny tokenizer (its ids lie inside Qwen's vocabulary), so replies
are random text: every turn generates --max-turn-tokens tokens, the worst case for sampling. Games: a small offline
set (`offline.make_games`, --games per task type) unless --data-root is given. MFU counts 6 x parameters FLOPs per
token of the training forward pass (train/sequence_tokens: forward + backward; gradient checkpointing's extra forward
not credited) and 2 x parameters per sampled token (actor and critic).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

import adca_grpo
import common
import harness
import offline
import samplers
import tempo
import training

QWEN3_4B = dict(  # Qwen/Qwen3-4B's config.json (the shape only; weights are random)
    hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000, tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)  # fmt: skip
TOY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
)  # fmt: skip (vocab: the tokenizer's)
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}  # dense, no sparsity


@dataclass
class Args:
    size: Literal["qwen3-4b", "toy"] = "qwen3-4b"
    """model shape: Qwen3-4B's, or a toy one for a CPU check"""
    data_root: str = ""
    """ALFWorld-layout games ("" = generate a small offline set)"""
    games: int = 2
    """offline games per task type when --data-root is not given"""
    max_turns: int = 2
    """turns per episode (GRPO) and per macro step (TEMPO H; T = 2 H)"""
    max_turn_tokens: int = 128
    """new tokens per turn"""
    reference_prompt_tokens: int = 512
    """prompt length of the plain generate() reference"""
    smoke_scripts: tuple[str, ...] = ("adca_grpo", "gigpo", "ppo", "tempo")
    """the scripts whose `smoke` preset runs first"""
    groups_per_update: int = 4
    """GRPO groups per update (TEMPO: start states per update)"""
    group_size: int = 8
    """episodes per game (TEMPO: branches per state)"""
    device_peak_tflops: float | None = None
    """the device's bf16 peak (None: looked up from the GPU's name; 0: no MFU)"""
    out: str = ""
    """also write the results as JSON here"""


def build_model(shape: dict, out_dir: Path) -> Path:
    """A random Qwen3 of `shape`, bf16 on a GPU, with the tiny model's tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(samplers.resolve_model("tiny"))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    shape = {"vocab_size": len(tokenizer), **shape}
    config = Qwen3Config(**shape, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def peak_tflops(args: Args) -> float:
    import torch

    if args.device_peak_tflops is not None:
        return args.device_peak_tflops
    if not torch.cuda.is_available():
        return 0.0
    name = torch.cuda.get_device_name()
    return next((tflops for key, tflops in BF16_PEAK_TFLOPS.items() if key in name), 0.0)


def peak_memory_gb() -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if torch.cuda.is_available() else None


def reset_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def mfu(flops: float, seconds: float, tflops: float) -> float | None:
    return float(f"{flops / seconds / (tflops * 1e12):.4g}") if tflops else None


def measure_smoke(name: str, out_dir: Path) -> dict:
    """The script's `smoke` preset on this device: whether it ran, and its wall time (an error is reported, not raised:
    the measurements after it still run)."""
    module = importlib.import_module(name)
    start = time.perf_counter()
    try:
        module.main(dataclasses.replace(module.PRESETS["smoke"][1], output_dir=str(out_dir / name)))
        error = None
    except Exception as failure:  # noqa: BLE001 (the check reports every script's outcome)
        error = f"{type(failure).__name__}: {failure}"[:2000]
    return {
        "measured": f"{name} smoke",
        "ok": error is None,
        "error": error,
        "wall_s": round(time.perf_counter() - start, 1),
    }


def measure_update(name: str, module, run_args, parameters: int, tflops: float) -> dict:
    """One update through the script's main(): its wall time, sampling (actor and critic) and peak memory."""
    reset_peak_memory()
    start = time.perf_counter()
    run_dir = module.main(run_args)
    wall = time.perf_counter() - start
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sampled = row["rollout/generated_tokens"] + row.get("critic/generated_tokens", 0.0)
    sampling_s = row["time/rollout"] + row.get("time/critic", 0.0)
    return {
        "measured": f"{name} update",
        "sampler": run_args.sampler,
        "parameters": parameters,
        "wall_s": round(wall, 1),
        "sampling_s": round(sampling_s, 2),
        "sampled_tokens": sampled,
        "sampled_tokens_per_s": round(sampled / sampling_s, 1),
        "sample_mfu": mfu(2 * parameters * sampled, sampling_s, tflops),
        "peak_gpu_memory_gb": peak_memory_gb(),
    }


def measure_train_step(run_args, parameters: int, tflops: float) -> dict:
    """One train_step on a GRPO update's worth of episodes (groups_per_update x group size), advantages +1 / -1."""
    import functools

    rt = adca_grpo.Runtime(run_args, harness.make_accelerator())
    starts = [rt.next_game_start() for _ in range(run_args.groups_per_update)]
    turns, branches = run_args.max_turns, run_args.group_size
    trajectories = [t for group in rt.play(starts, branches, horizon=turns, max_turns=turns) for t in group]
    signs = [[1.0 if i % 2 else -1.0] * len(t.steps) for i, t in enumerate(trajectories)]
    loss = functools.partial(training.ppo_clip_loss, clip_eps=0.2, clip_eps_high=0.28)
    datums = training.trajectory_datums(trajectories, signs)
    reset_peak_memory()
    start = time.perf_counter()
    metrics = training.train_step(rt, datums, loss)
    seconds = time.perf_counter() - start
    forward_tokens = metrics["train/sequence_tokens"]
    reference_s = reference_forward_backward(rt, datums)
    return {
        "measured": "train_step",
        "reference_seconds": round(reference_s, 2),
        "ratio_to_reference": round(reference_s / seconds, 3),  # > 1: faster than the plain forward + backward
        "parameters": parameters,
        "datums": len(datums),
        "forward_tokens": forward_tokens,
        "trained_tokens": metrics["train/tokens"],
        "seconds": round(seconds, 2),
        "trained_tokens_per_s": round(metrics["train/tokens"] / seconds, 1),
        "forward_tokens_per_s": round(forward_tokens / seconds, 1),
        "train_mfu": mfu(6 * parameters * forward_tokens, seconds, tflops),
        "peak_gpu_memory_gb": peak_memory_gb(),
    }


def reference_forward_backward(rt, datums) -> float:
    """Seconds of a plain peft forward + backward over the same sequences, in the same token-budget micro-batches:
    the mean token log-likelihood's gradient (no chunking, no masks beyond padding, no optimizer step)."""
    import torch

    policy, device = rt.accelerator.unwrap_model(rt.model), rt.accelerator.device
    batches = training.token_budget_batches([len(d.tokens) for d in datums], rt.args.micro_batch_tokens)
    synchronize()
    start = time.perf_counter()
    for batch in batches:
        width = max(len(datums[i].tokens) for i in batch)
        ids = torch.tensor([datums[i].tokens + [0] * (width - len(datums[i].tokens)) for i in batch], device=device)
        mask = torch.tensor([[1] * len(datums[i].tokens) + [0] * (width - len(datums[i].tokens)) for i in batch],
                            device=device)  # fmt: skip
        logits = policy(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        ((loss * mask[:, 1:]).sum() / mask.sum()).backward()
    synchronize()
    seconds = time.perf_counter() - start
    policy.zero_grad(set_to_none=True)
    return seconds


def reference_generate(model_dir: Path, batch: int, prompt_tokens: int, new_tokens: int, tflops: float) -> dict:
    """Plain transformers generate() (sampled, T = 1, sdpa, the device's dtype) at `batch` prompts of random ids: new
    tokens a second, the reference for the samplers' rates."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model = model.to(device).eval()
    ids = torch.randint(10, model.config.vocab_size - 10, (batch, prompt_tokens), device=device)
    synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, pad_token_id=0)  # fmt: skip
    synchronize()
    seconds = time.perf_counter() - start
    parameters = sum(p.numel() for p in model.parameters())
    del model
    return {
        "measured": "reference generate", "batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "seconds": round(seconds, 2), "sampled_tokens_per_s": round(batch * new_tokens / seconds, 1),
        "sample_mfu": mfu(2 * parameters * batch * new_tokens, seconds, tflops),
    }  # fmt: skip


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_fsdp(out_dir: Path) -> dict | None:
    """--fsdp over every GPU against one unsharded process; None (said on stderr) with fewer than 2 GPUs."""
    import torch

    from benchmarks.speed import fsdp_memory

    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"[fsdp] not measured: {gpus} GPU(s); --fsdp needs 2+ (NCCL: one process per GPU)", file=sys.stderr)
        return None
    runs = fsdp_memory.main(fsdp_memory.Args(size="large", processes=(1, gpus), out=str(out_dir)))
    (single,), sharded = runs[1], max(runs[gpus], key=lambda rank: rank["update_peak_gpu_gb"])
    return {
        "measured": "fsdp update",
        "parameters": single["parameters"],
        "processes": gpus,
        "update_peak_gpu_gb_1_process": round(single["update_peak_gpu_gb"], 3),
        "update_peak_gpu_gb_sharded": round(sharded["update_peak_gpu_gb"], 3),
        "after_gather_peak_gpu_gb_sharded": round(sharded["after_gather_peak_gpu_gb"], 3),
        "floor_gb_sharded": round(sharded["floor_gb"], 3),
        "update_peak_ratio": round(sharded["update_peak_gpu_gb"] / single["update_peak_gpu_gb"], 3),
        "loss_difference": abs(sharded["loss"] - single["loss"]),
        "grad_norm_difference": abs(sharded["grad_norm"] - single["grad_norm"]),
    }


def main(args: Args) -> list[dict]:
    import torch
    from transformers import AutoConfig

    results = []

    def report(result: dict) -> None:
        print(json.dumps(result), flush=True)
        results.append(result)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        for name in args.smoke_scripts:
            report(measure_smoke(name, scratch / "smoke"))
        model_dir = build_model(QWEN3_4B if args.size == "qwen3-4b" else TOY, scratch / "model")
        config = AutoConfig.from_pretrained(model_dir)
        parameters = (  # embeddings once (tied), attention, MLP, norms
            config.vocab_size * config.hidden_size
            + config.num_hidden_layers
            * (
                config.hidden_size * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
                + 3 * config.hidden_size * config.intermediate_size
            )
        )
        data_root = args.data_root
        if not data_root:
            data_root = str(scratch / "games")
            offline.make_games(data_root, n=args.games * len(common.TASK_TYPES), seed=0, log=lambda *a: None)
        shared = dict(
            model=str(model_dir), data_root=data_root, output_dir=str(scratch / "runs"), learning_rate=1e-6,
            max_turn_tokens=args.max_turn_tokens, eval_every=0, save_every=0, seed=0, sampler="generate",
        )  # fmt: skip
        grpo = adca_grpo.Args(
            **shared, exp_name="gpu_grpo", attribution=False, num_updates=1, groups_per_update=args.groups_per_update,
            group_size=args.group_size, max_turns=args.max_turns,
        )  # fmt: skip
        td = tempo.Args(
            **shared, exp_name="gpu_tempo", warmup_updates=0, td_updates=1, groups_per_update=args.groups_per_update,
            group_size=args.group_size, macro_rounds=args.max_turns, max_turns=2 * args.max_turns,
            max_critic_tokens=args.max_turn_tokens,
        )  # fmt: skip
        tflops = peak_tflops(args)
        batch = args.groups_per_update * args.group_size
        reference = reference_generate(model_dir, batch, args.reference_prompt_tokens, args.max_turn_tokens, tflops)
        report(reference)
        arms = [("grpo", adca_grpo, grpo), ("tempo_td", tempo, td)]
        if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
            arms.insert(1, ("grpo", adca_grpo, dataclasses.replace(grpo, sampler="vllm-colocate")))
        for name, module, run_args in arms:
            result = measure_update(name, module, run_args, parameters, tflops)
            ratio = result["sampled_tokens_per_s"] / reference["sampled_tokens_per_s"]
            report(result | {"ratio_to_reference_generate": round(ratio, 3)})
        report(measure_train_step(grpo, parameters, tflops))
        if fsdp := measure_fsdp(scratch / "fsdp"):
            report(fsdp)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
