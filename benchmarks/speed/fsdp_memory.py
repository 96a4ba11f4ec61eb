"""--fsdp on CPU (gloo): per-process peak memory of one full-weight update (training.train_step, AdamW's first step) on
a random Qwen2-shaped model at 1 process (unsharded) and 2 processes (--fsdp), against the floor (weights + gradients
+ Adam) / N, and the update's loss, gradient norm and weights, which must agree across the two (the same global
batch: each process trains its half).

    python -m benchmarks.speed.fsdp_memory                 # ~95M parameters: the states dominate
    python -m benchmarks.speed.fsdp_memory --size toy      # the tiny model (tests/test_training_job.py runs this)

Each run is fresh processes (`accelerate launch --multi_gpu` for 2). Memory is resident set size (glibc told to return
every freed block of 1 MiB or more at once), sampled every 2 ms by a thread, above the process's own before the model
loads (on a GPU also torch's peak allocation), in two phases: the update (forward, backward, optimizer step) and the
gather that follows it (under --fsdp every process then holds the whole weights again, for sampling)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[2]
SIZES = {  # hidden, intermediate, layers (offline.build_tiny_model: 4 heads, 2 KV heads, tied embeddings)
    "toy": (64, 128, 2),
    "large": (1024, 2816, 8),  # ~95M parameters: 1.5 GB of fp32 weights, gradients and Adam in one process
}


@dataclass
class Args:
    size: str = "large"
    """model size: one of SIZES"""
    processes: tuple[int, ...] = (1, 2)
    """process counts to measure (2+: --fsdp)"""
    datums: int = 4
    """the global batch: sequences of --tokens tokens, split over the processes"""
    tokens: int = 256
    """tokens per sequence"""
    out: str = ""
    """a directory for each run's JSON and weights ("" = a temporary one)"""
    worker: str = ""
    """internal: the model directory; measure in this process and write into --out"""
    lora_rank: int = 0
    """0 = full weights (the measured case); > 0 = a LoRA adapter (the first-update test)"""


class PeakMemory:
    """The process's resident set size, sampled by a thread, and on a GPU torch's peak allocation, per phase."""

    def __init__(self):
        import psutil

        self.process, self.peak_bytes, self.running = psutil.Process(), 0, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self):
        while self.running:
            self.peak_bytes = max(self.peak_bytes, self.process.memory_info().rss)
            time.sleep(0.002)

    def mark(self) -> tuple[int, int]:
        """Starts a new phase; returns the peaks (RSS, GPU) of the one that ended."""
        import torch

        time.sleep(0.01)
        peak, self.peak_bytes = self.peak_bytes, self.process.memory_info().rss
        gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        return peak, gpu


def measure(args: Args) -> None:
    """One process of a run: load, one train_step on this process's share of the global batch, report."""
    import types

    import torch
    from safetensors.torch import save_file

    import harness
    import samplers
    import training

    torch.manual_seed(0)
    rss = PeakMemory()
    accelerator = harness.make_accelerator()
    run_args = harness.PPOArgs(
        model=args.worker, lora_rank=args.lora_rank, lora_alpha=2 * max(args.lora_rank, 1), learning_rate=1e-3,
        micro_batch_tokens=args.tokens, fsdp=accelerator.num_processes > 1, dual_clip_c=None,
    )  # fmt: skip
    before, _ = rss.mark()
    tokenizer, model, optimizer = samplers.load_model(run_args, accelerator)
    rt = types.SimpleNamespace(
        args=run_args, accelerator=accelerator, tokenizer=tokenizer, model=model, optimizer=optimizer,
        heads=torch.nn.ModuleDict(),
    )  # fmt: skip
    rng = random.Random(0)  # the same global batch in every process
    vocab = len(tokenizer)
    datums = []
    for _ in range(args.datums):
        tokens = [rng.randrange(vocab) for _ in range(args.tokens)]
        mask = [0.0] + [float(rng.random() < 0.5) for _ in range(args.tokens - 1)]
        old = [-rng.uniform(5.0, 9.0) for _ in range(args.tokens)]
        datums.append(training.Datum(tokens, old, [rng.gauss(0, 1) * m for m in mask], mask))
    mine = datums[accelerator.process_index :: accelerator.num_processes]
    gathered = samplers.gather_weights
    phases = {}

    def gather_after_update(policy):  # the update ends where train_step gathers the weights again
        phases["update"] = rss.mark()
        gathered(policy)

    samplers.gather_weights = gather_after_update
    loaded, _ = rss.mark()
    metrics = training.train_step(rt, mine, training.ppo_clip_loss)
    phases["gather"] = rss.mark()
    samplers.gather_weights = gathered
    policy = accelerator.unwrap_model(model)
    weights = {k: v.detach().cpu().contiguous() for k, v in samplers.trained_weights(policy).items()}
    parameters = sum(p.numel() for p in policy.parameters())  # gathered: the whole model
    trained = sum(v.numel() for v in weights.values())
    state_bytes = 4 * trained * next(policy.parameters()).element_size()  # weights, gradients, 2 Adam moments
    result = {
        "processes": accelerator.num_processes,
        "rank": accelerator.process_index,
        "parameters": parameters,
        "trained_parameters": trained,
        "loss": metrics["train/loss"],
        "grad_norm": metrics["train/grad_norm"],
        "weights_sha256": samplers.adapter_sha256(weights),
        "baseline_gb": before / 1e9,
        "loaded_gb": (loaded - before) / 1e9,
        "update_peak_gb": (phases["update"][0] - before) / 1e9,
        "after_gather_peak_gb": (phases["gather"][0] - before) / 1e9,
        "floor_gb": state_bytes / accelerator.num_processes / 1e9,
        "update_peak_gpu_gb": phases["update"][1] / 1e9,  # 0 on CPU
        "after_gather_peak_gpu_gb": phases["gather"][1] / 1e9,
    }
    out = Path(args.out)
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    if accelerator.is_main_process:
        save_file(weights, str(out / "weights.safetensors"))
    rss.running = False
    harness.close_distributed()


def run(args: Args, model_dir: Path, processes: int, out: Path) -> list[dict]:
    """One measurement in fresh processes; each process's result."""
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--worker", str(model_dir), "--out", str(out), "--datums", str(args.datums), "--tokens", str(args.tokens)]
    flags += ["--lora-rank", str(args.lora_rank)]
    if processes == 1:
        command = [sys.executable, "-m", __spec__.name, *flags]
    else:
        command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes",
                   str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "-m", __spec__.name, *flags]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env["MALLOC_MMAP_THRESHOLD_"] = str(2**20)  # freed tensors go back to the OS at once, so RSS follows them
    result = subprocess.run(["timeout", "-k", "10", "900", *command], capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{processes} process(es) failed:\n{result.stderr[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]


def build_model(size: str, model_dir: Path) -> None:
    """A random Qwen2 of the size, with the tiny model's tokenizer (and vocabulary)."""
    import offline

    hidden, intermediate, layers = SIZES[size]
    offline.build_tiny_model(model_dir, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers)


def main(args: Args) -> dict:
    if args.worker:
        measure(args)
        return {}
    if args.size not in SIZES:
        raise SystemExit(f"--size must be one of {sorted(SIZES)}, got {args.size!r}")
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(args.out or scratch)
        model_dir = out / "model"
        build_model(args.size, model_dir)
        runs = {n: run(args, model_dir, n, out / f"processes_{n}") for n in args.processes}
    for n, ranks in runs.items():
        worst = max(ranks, key=lambda r: r["update_peak_gb"])
        print(f"{n} process(es){' --fsdp' if n > 1 else ''}: {worst['parameters'] / 1e6:.1f}M parameters; per process: "
              f"update peak +{worst['update_peak_gb']:.3f} GB (floor {worst['floor_gb']:.3f} GB), after the gather "
              f"+{worst['after_gather_peak_gb']:.3f} GB, loaded +{worst['loaded_gb']:.3f} GB; loss {worst['loss']:.6f}, "
              f"grad norm {worst['grad_norm']:.6f}")  # fmt: skip
    if 1 in runs:
        single = runs[1][0]
        for n in (n for n in runs if n > 1):
            worst = max(runs[n], key=lambda r: r["update_peak_gb"])
            print(f"{n} vs 1 process: update peak {worst['update_peak_gb'] / single['update_peak_gb']:.2f}x, "
                  f"after the gather {worst['after_gather_peak_gb'] / single['after_gather_peak_gb']:.2f}x; "
                  f"loss difference {abs(worst['loss'] - single['loss']):.2e}, grad norm difference "
                  f"{abs(worst['grad_norm'] - single['grad_norm']):.2e}")  # fmt: skip
    return runs


if __name__ == "__main__":
    main(tyro.cli(Args))
