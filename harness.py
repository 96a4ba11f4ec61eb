"""The job around a script's update loop: flags, start-up checks, Runtime, Run, evaluation, logging, checkpoints, cli.

Sections: Job harness (StartupError, SharedArgs / PPOArgs and their checks, the start-up checks, Runtime,
AsyncRollouts, Run, evaluate, RunLogger, checkpoints and resume, cli, config files and RENAMED_FLAGS), then the CPU
learning benchmarks' shared settings (LEARNING_SETTINGS). The top layer: imports common.py, samplers.py,
training.py and offline.py.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import queue
import random
import shutil
import subprocess
import sys
import threading
import time
import typing
import zipfile
from pathlib import Path
from typing import Callable, ClassVar, Literal, Sequence

import numpy as np
import torch
import tyro
from torch.distributed.tensor import DTensor

import common
import offline
import plan
import samplers
import training
from evaluation import EVAL_SEED, eval_count, evaluate, seeded_sampling  # noqa: F401 (scripts: harness.evaluate)
from offline import TASK_TYPES


# =============================================================================================
# Job harness: start-up checks, runtime, the run around main()'s update loop, evaluation, logging, checkpoints
# =============================================================================================
class StartupError(ValueError):
    """A bad flag, game, checkpoint or endpoint, found before training (the CLI prints it as one line, exits 2)."""


@contextlib.contextmanager
def startup_errors():
    """A ValueError raised inside is a StartupError."""
    try:
        yield
    except ValueError as error:
        raise StartupError(str(error)) from error


def require_all(*conditions: tuple[bool, str]) -> None:
    """A ValueError with the message of the first condition that does not hold (at start: a start-up error)."""
    for ok, message in conditions:
        if not ok:
            raise ValueError(message)


def check_bounds(args, bound: str, *names: str) -> None:
    """Every named flag must be `bound` (">= 1", "> 0", ">= 0"; None passes); the error names the flag and value."""
    op, limit = bound.split()
    for name in names:
        value = getattr(args, name)
        if value is not None and not (value > float(limit) if op == ">" else value >= float(limit)):
            raise ValueError(f"--{name.replace('_', '-')} must be {bound}, got {value}")


def check_choices(args) -> None:
    """Every Literal flag holds one of its choices (tyro checks them on the command line, not in Args(...))."""
    for name, hint in typing.get_type_hints(type(args)).items():
        if typing.get_origin(hint) is Literal and getattr(args, name) not in typing.get_args(hint):
            raise ValueError(
                f"--{name.replace('_', '-')} must be one of {typing.get_args(hint)}, got {getattr(args, name)!r}"
            )


@dataclasses.dataclass
class SharedArgs:
    """The flags every script shares, declared once: each script's Args extends this (or PPOArgs) with its
    algorithm's flags, and may give a shared flag a default of its own by declaring it again (exp_name: ALGORITHM)."""

    GLOBAL_COUNTS: ClassVar[tuple[str, ...]] = ()  # counts of the run that each process takes a share of
    UPDATE_COUNTS: ClassVar[tuple[str, ...]] = ()  # the flags whose sum is the run's updates
    # ---- model and optimisation ----
    model: str = "Qwen/Qwen3-4B-Instruct-2507"
    """HF model id or local path; `tiny` = the offline tiny model (tests, smoke runs)"""
    chat_template: str = ""
    """a Jinja chat template file that replaces the model's own (as `vllm serve --chat-template`); "" = the model's"""
    enable_thinking: bool = True
    """passed to the chat template; --no-enable-thinking: Qwen3 hybrid models answer without reasoning (refused for
    a template without the switch)"""
    lora_rank: int = 32
    """LoRA rank; 0 = no adapter, every weight is trained"""
    lora_alpha: int = 64
    """LoRA alpha (scale = alpha / rank)"""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """module names that get LoRA adapters"""
    learning_rate: float = 1e-6
    """AdamW learning rate"""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold (global L2 norm)"""
    temperature: float = 1.0
    """sampling temperature (logprobs are taken at this temperature too)"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    micro_batch_tokens: int = 16384
    """token budget of one forward/backward micro-batch (rows x padded length); gradients accumulate"""
    sample_batch_size: int = 32
    """prompts per generate() call"""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """the compute dtype (auto: bfloat16 on CUDA, float32 elsewhere); trained weights and the loss's logprobs stay float32"""
    gradient_checkpointing: Literal["auto", "on", "off"] = "auto"
    """recompute activations in the backward pass instead of keeping them (auto: on with CUDA, off elsewhere)"""
    fsdp: bool = False
    """shard the weights, gradients and AdamW state over the processes (PyTorch FSDP2, 2+ processes); the weights are
    gathered whole on every process between updates, for sampling (docs/training-jobs.md: Sharding)"""
    # ---- data ----
    data_root: str | None = None
    """ALFWorld data dir holding json_2.1.1/ (None = the generated offline game set; --model tiny-agent: its games)"""
    split: Literal["train", "valid_seen", "valid_unseen"] = "train"
    """split the training games come from"""
    task_types: tuple[str, ...] | None = None
    """ALFWorld task types to train on (None = all six)"""
    seed: int = 1
    """seed of the game order and of sampling"""
    # ---- token budgets ----
    max_turn_tokens: int = 512
    """new tokens per turn"""
    max_trajectory_tokens: int = 24576
    """token budget of one episode (an episode stops before overflowing it)"""
    # ---- runs ----
    exp_name: str = "run"
    """run name prefix: runs/{exp_name}__{seed}__{time} (each script's Args: its ALGORITHM)"""
    output_dir: str = "runs"
    """where run directories go"""
    track: bool = False
    """log to Weights & Biases (mode from WANDB_MODE)"""
    wandb_project: str = "cleanrl-agents"
    """W&B project"""
    save_every: int = 10
    """checkpoint every this many updates (and at the end); 0 = only at the end"""
    keep_checkpoints: int = 0
    """checkpoints kept on disk: the newest N (the final one, and the one --resume auto takes, among them); 0 = all"""
    eval_every: int = 10
    """evaluation every this many updates and at the end; 0 = never"""
    eval_games: int | Literal["all"] = 20
    """games per evaluation split (valid_seen, valid_unseen; all = every game of the split) and sampled episodes on
    the training games, all processes together"""
    eval_temperature: float = 0.0
    """temperature of the evaluation splits' episodes (0 = greedy; verl-agent samples at 0.4)"""
    resume: str = ""
    """"" = new run, "auto" = newest checkpoint of the latest run named exp_name with this seed, or a checkpoint/run
    path; flags that change what the run is must equal its config.json"""
    eval_only: str = ""
    """evaluate a checkpoint (its dir, a run dir = its newest, or "auto") into a new run dir's metrics.jsonl, and exit;
    every flag not passed takes the run's value"""
    threads: int = 0
    """torch CPU threads per process (0 = OMP_NUM_THREADS if set, else the cores / the processes on this machine)"""
    preset: str = ""
    """named settings that become the defaults (`script.py NAME --flags`; --help lists them); flags override them"""
    config: str = ""
    """a JSON or YAML file of flag values that become the defaults (a run's config.json reruns it); flags override it"""
    plan: bool = False
    """print what the run needs per GPU (memory, KV cache, disk, tokens per update; from the model's config) and exit"""
    plan_gpu_memory_gb: float = 0.0
    """--plan: one GPU's memory in GiB (as nvidia-smi shows it; 0 = the visible device's)"""
    plan_processes: int = 0
    """--plan: the processes, one a GPU, to plan for (0 = the launched ones)"""
    # ---- sampler ----
    sampler: Literal["auto", "generate", "vllm-colocate", "vllm"] = "auto"
    """auto: vllm-colocate where CUDA and vLLM are, else generate; generate: model.generate() in the training process;
    vllm-colocate: a vLLM engine in the training process; vllm: a vLLM server you start (docs/vllm.md)"""
    vllm_gpu_memory_utilization: float = 0.3
    """--sampler vllm-colocate on CUDA: the fraction of the GPU's whole memory the engine takes (weights and KV cache)
    while it samples; it sleeps while training"""
    kv_cache_mb: int = 8192
    """--sampler generate: MB of KV caches kept between a branch's turns, so that a turn prefills only the tokens added
    since the last (a branch past the budget re-prefills its history; 0 = every turn re-prefills)"""
    sampler_url: str = ""
    """with --sampler vllm: the server's OpenAI API root, e.g. http://localhost:8000/v1"""
    sampler_adapter_dir: str = ""
    """where the adapter (vllm-colocate, full weights: the model) is saved for vLLM to load after each update
    ("" = {output_dir}/sampler_adapters)"""
    sampler_concurrency: int = 64
    """completion requests in flight per process"""
    sampler_timeout_s: float = 600.0
    """one completion request's timeout (it is retried after that)"""
    sampler_deadline_s: float = 1800.0
    """one turn's burst of requests, retries included, must finish by then or the update fails"""
    recompute_logprobs: bool = True
    """with a vLLM sampler (vllm, vllm-colocate): the loss's old logprobs come from a trainer forward pass, not vLLM"""
    max_logprob_drift: float | None = None
    """with a vLLM sampler: the largest mean |logprob(sampler) - logprob(trainer)| a trained token may have in an update
    on any process before the run stops (None: 1e-3 at float32 compute, 5e-2 at bfloat16; training.max_logprob_drift)"""
    async_steps: int = 0
    """K: with --sampler vllm, a background thread samples the next updates' rollouts through the server while the
    current update trains; no datum trains on weights more than K updates newer than the adapter that sampled it
    (0 = synchronous: sample, then train; docs/vllm.md: Rollouts ahead of training)"""

@dataclasses.dataclass
class PPOArgs(SharedArgs):
    """SharedArgs and the flags of a policy-gradient script that trains with the shared PPO-clip step (ppo_update):
    its update loop's sizes and the loss's settings."""

    GLOBAL_COUNTS: ClassVar[tuple[str, ...]] = ("groups_per_update",)  # the run's, split: plan.process_shares
    UPDATE_COUNTS: ClassVar[tuple[str, ...]] = ("num_updates",)  # their sum: the run's updates (plan.run_updates)

    # ---- the update loop and the shared PPO-clip step (ppo_update) ----
    num_updates: int = 200
    """policy updates (one rollout each)"""
    groups_per_update: int = 8
    """G: games per update (all processes together: each plays G / processes), one episode group each"""
    group_size: int = 8
    """N: episodes sampled per game (the group size)"""
    max_turns: int = 50
    """T: turns per episode (the rollout horizon)"""
    clip_eps: float = 0.2
    """PPO clip range below 1 (and above, unless --clip-eps-high is set)"""
    clip_eps_high: float | None = None
    """PPO clip range above 1 (clip-higher); None = --clip-eps"""
    dual_clip_c: float | None = 3.0
    """dual-clip PPO: the loss of a token with a negative advantage is capped at c * |A| (veRL: 3); None = off"""
    kl_loss_coef: float = 0.0
    """weight of the k3 KL to the base model (the adapter disabled) as a loss term (verl-agent: 0.01); 0 = off"""
    ppo_epochs: int = 1
    """passes over each rollout's data (old logprobs are recomputed by the policy when this or --mini-batches > 1)"""
    mini_batches: int = 1
    """optimizer steps per pass (the rollout's trajectories split at random)"""
    off_policy_loss: Literal["ppo", "decoupled"] = "ppo"
    """with --async-steps >= 1: ppo = PPO-clip of the ratio to the behaviour policy (the adapter that sampled the
    episode); decoupled = AReaL's: PPO-clip of the ratio to the weights before this update, times the behaviour weight
    min(pi_before / pi_behaviour, --behaviour-weight-cap)"""
    behaviour_weight_cap: float = 2.0
    """--off-policy-loss decoupled: the truncation of the behaviour weight"""


def validate_model_args(args) -> None:
    """Fail at start, naming the flag, on any shared setting that cannot work."""
    check_choices(args)
    check_bounds(args, ">= 1", "micro_batch_tokens", "sample_batch_size", "sampler_concurrency", "max_turn_tokens")
    check_bounds(args, ">= 0", "lora_rank")
    check_bounds(args, "> 0", "lora_alpha", "learning_rate", "max_grad_norm", "temperature", "sampler_timeout_s")
    check_bounds(args, "> 0", "sampler_deadline_s")
    check_bounds(args, ">= 0", "weight_decay", "seed", "save_every", "eval_every", "threads", "eval_temperature")
    check_bounds(args, ">= 0", "async_steps", "keep_checkpoints", "plan_gpu_memory_gb", "plan_processes")
    check_bounds(args, "> 0", "max_logprob_drift")
    require_all(
        (bool(args.model), "--model must not be empty"),
        (len(args.lora_targets) >= 1 and all(args.lora_targets), "--lora-targets must name at least one module"),
        (all(0 <= b < 1 for b in args.adam_betas), f"--adam-betas must lie in [0, 1), got {args.adam_betas}"),
        (0 < args.top_p <= 1, f"--top-p must lie in (0, 1], got {args.top_p}"),
        (args.data_root != "", "--data-root must not be empty (leave it unset for the offline games)"),
        (
            args.task_types is None or (len(args.task_types) >= 1 and set(args.task_types) <= set(TASK_TYPES)),
            f"--task-types must be among {TASK_TYPES}, got {args.task_types}",
        ),
        (
            bool(args.exp_name) and "__" not in args.exp_name and "/" not in args.exp_name,
            f"--exp-name must be non-empty without '__' or '/', got {args.exp_name!r}",
        ),
        (bool(args.output_dir), "--output-dir must not be empty"),
        (not args.track or bool(args.wandb_project), "--wandb-project must not be empty with --track"),
        (not (args.resume and args.eval_only), "--resume and --eval-only cannot be combined"),
        (eval_count(args) is None or eval_count(args) >= 0, f"--eval-games must be >= 0 or all, got {args.eval_games}"),
        (not args.eval_only or args.eval_games != 0, "--eval-only needs --eval-games >= 1 (or all)"),
        (
            args.sampler != "vllm" or args.sampler_url.startswith(("http://", "https://")),
            f"--sampler vllm needs --sampler-url http://HOST:PORT/v1, got {args.sampler_url!r}",
        ),
        (
            args.sampler != "vllm" or args.lora_rank > 0,
            "--sampler vllm needs a LoRA adapter (--lora-rank >= 1): pushing full weights to the server is not "
            "implemented",
        ),
        (
            args.sampler == "vllm" or not args.sampler_url,
            "--sampler-url is only used with --sampler vllm (the server; the default, auto, samples in this process)",
        ),
        (
            args.sampler == "vllm" or args.async_steps == 0,
            "--async-steps needs --sampler vllm: generate() and the vllm-colocate engine run in the training "
            "process, on the weights being trained and on the device training uses, so there is nothing to overlap "
            "them with",
        ),
        (
            args.sampler != "vllm-colocate" or not args.fsdp,
            "--sampler vllm-colocate with --fsdp is not supported (each process's engine would need the gathered "
            "weights written out after every update): drop --fsdp (each process keeps its own engine) or use "
            "--sampler vllm",
        ),
        (
            0 < args.vllm_gpu_memory_utilization < 1,
            f"--vllm-gpu-memory-utilization must lie in (0, 1), got {args.vllm_gpu_memory_utilization}",
        ),
        (
            not (args.fsdp and args.async_steps),
            "--async-steps with --fsdp is not supported: a datum's logprobs are recomputed under the weights of the "
            "version that sampled it, and under --fsdp forward passes run on weights gathered by a collective, which "
            "processes holding data of different versions cannot join",
        ),
        (
            args.max_trajectory_tokens > args.max_turn_tokens,
            f"--max-trajectory-tokens ({args.max_trajectory_tokens}) must exceed --max-turn-tokens ({args.max_turn_tokens})",
        ),
    )


def validate_ppo_args(args: PPOArgs) -> None:
    """validate_model_args, then PPOArgs' flags: the update loop's sizes and the PPO-clip step's settings."""
    validate_model_args(args)
    check_bounds(args, ">= 1", "num_updates", "groups_per_update", "max_turns", "ppo_epochs")
    check_bounds(args, ">= 1", "mini_batches")
    check_bounds(args, "> 0", "clip_eps_high")
    check_bounds(args, ">= 0", "kl_loss_coef")
    check_bounds(args, ">= 1", "behaviour_weight_cap")
    require_all(
        (
            args.off_policy_loss == "ppo" or args.async_steps >= 1,
            "--off-policy-loss decoupled needs --async-steps >= 1 (synchronous data is on-policy)",
        ),
        (0 < args.clip_eps < 1, f"--clip-eps must lie in (0, 1), got {args.clip_eps}"),
        (
            args.lora_rank > 0 or args.kl_loss_coef == 0,
            "--kl-loss-coef needs --lora-rank >= 1 (the reference is the model with its adapter disabled)",
        ),
        (
            args.dual_clip_c is None or args.dual_clip_c > 1,
            f"--dual-clip-c must be > 1 (the loss cap is c * |A|), got {args.dual_clip_c}",
        ),
    )


# Flags a resumed run may change: where and how fast it runs and what it logs, not what it trains.
RESUME_FREE_FLAGS = tuple(
    "preset config resume eval_only output_dir track wandb_project save_every eval_every eval_games eval_temperature "
    "threads keep_checkpoints plan plan_gpu_memory_gb plan_processes micro_batch_tokens sample_batch_size fsdp sampler "
    "sampler_url sampler_adapter_dir sampler_concurrency sampler_timeout_s sampler_deadline_s kv_cache_mb "
    "vllm_gpu_memory_utilization".split()
)


def make_accelerator():
    """CPU or CUDA; DDP when launched on several processes (--fsdp: sharded by the scripts themselves, load_model).
    accelerate's own FSDP, DeepSpeed and Megatron plugins are refused: they would wrap the model a second time."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise ValueError(
            f"accelerate config: {accelerator.distributed_type} is not supported; launch with "
            "`accelerate launch --multi_gpu` and pass --fsdp to shard the model (docs/training-jobs.md: Sharding)"
        )
    if os.environ.get("MASTER_PORT") and accelerator.num_processes == 1:  # `accelerate launch --num_processes N`
        print(
            "[start] WARNING: launched for several processes but running ONE: on CPU, accelerate needs "
            "`accelerate launch --multi_gpu --num_processes N ...` (see the README)",
            file=sys.stderr,
        )
    return accelerator


def set_threads(args, local_processes: int) -> int:
    """torch's CPU threads: --threads, else OMP_NUM_THREADS when set, else the cores shared by the local processes.
    Warns when the machine is already busy: threads fighting over cores made runs 20x slower."""
    cores = len(os.sched_getaffinity(0))
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, cores // local_processes)
    torch.set_num_threads(threads)
    load = os.getloadavg()[0]
    if load + threads * local_processes > cores + 0.5:
        print(
            f"[start] WARNING: load average {load:.1f} on {cores} cores before this run's "
            f"{local_processes} x {threads} thread(s): oversubscribed, expect a large slowdown"
            + (" (try --threads 1)" if threads > 1 else ""),
            file=sys.stderr,
        )
    return threads


def require_writable_dir(path, flag: str) -> Path:
    """Create `path` if needed and prove a file can be written there; the error names the flag."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"{flag} {path} is not a writable directory: {error}") from error
    return path


def check_model(model: str) -> None:
    """The model's config must be readable (a local dir with config.json, the HF cache, or the hub) before
    anything loads; `tiny` and `tiny-agent` are always there (built on first use)."""
    from transformers import AutoConfig

    if model == "tiny":
        return
    if model in offline.TINY_AGENTS:
        offline.tiny_agent_weights(model)  # shipped, or built by benchmarks/learning/agents.py
        return
    looks_local = os.path.isabs(model) or model.startswith(".") or os.path.exists(model)
    if looks_local and not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"--model {model}: no such model directory (expected a config.json there)")
    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"--model {model}: cannot load its config ({str(error).splitlines()[0]}). Without the model (offline): "
            "`python SCRIPT.py learning` trains the shipped tiny agent (--model tiny-agent) on its own games"
        ) from error
    text_config = getattr(config, "text_config", None) or config
    for name in ("final_logit_softcapping", "logit_scale"):  # logits that are not lm_head(hidden): forward_logprobs
        if getattr(text_config, name, None) not in (None, 1.0):
            raise ValueError(
                f"--model {model}: its config sets {name}; the training step supports plain lm_head logits"
            )


def training_games(args, accelerator) -> list[str]:
    """This process's shard of the training games, shuffled with the seed; fails naming --data-root."""
    try:
        games = common.discover_games(args.data_root, args.split, args.task_types, seed=args.seed)
    except FileNotFoundError as error:
        raise ValueError(f"--data-root {args.data_root}: {error}") from error
    return games[accelerator.process_index :: accelerator.num_processes] or games


def startup_checks(args, algorithm: str, accelerator, validate_args, resume_may_change: Sequence[str] = ()):
    """Every check that can fail at start, before any model loads: flags, threads, model, chat template, output dir,
    checkpoint, games. Returns (args as the run uses them, checkpoint to load or None, its trainer state or None). The
    args: data root and chat template file resolved; --resume: flags that change what the run is (all but
    RESUME_FREE_FLAGS and resume_may_change) must equal the run's (with --eval-only the CLI has taken them from the
    run: cli())."""
    with startup_errors():
        validate_model_args(args)  # before looking the checkpoint up (--resume and --eval-only exclude each other)
        flag, spec = ("--eval-only", args.eval_only) if args.eval_only else ("--resume", args.resume)
        checkpoint = find_checkpoint(spec, args.output_dir, args.exp_name, args.seed, flag)
        config_file = checkpoint.parent.parent / "config.json" if checkpoint is not None else None
        config = json.loads(config_file.read_text()) if config_file is not None and config_file.is_file() else {}
        config = renamed_flags(config, str(config_file), note=not args.eval_only)  # --eval-only: cli() said it
        validate_args(args)
        require_all(
            (
                not args.fsdp or (args.plan and args.plan_processes or accelerator.num_processes) > 1,
                "--fsdp shards over several processes, and this run has one: launch it with `accelerate launch "
                "--multi_gpu --num_processes N` (N >= 2), or drop --fsdp",
            ),
        )
        shares = plan.process_shares(args, accelerator.num_processes)
        if shares and accelerator.is_main_process and not args.plan:  # --plan says it for its process count
            print(
                f"[start] {accelerator.num_processes} process(es): "
                + "; ".join(f"--{k.replace('_', '-')} {getattr(args, k)} ({v} per process)" for k, v in shares.items()),
                file=sys.stderr,
            )
        set_threads(args, int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)))
        check_model(args.model)
        if args.plan:  # only the plan
            if accelerator.is_main_process:
                print(plan.run_plan(args, args.plan_processes or accelerator.num_processes)[1])
            raise SystemExit(0)
        if torch.cuda.is_available() and accelerator.is_main_process:  # the plan before the run: an estimate, a warning
            plan.warn_if_it_does_not_fit(args, accelerator.num_processes)
        require_writable_dir(args.output_dir, "--output-dir")
        if checkpoint is None and spec:
            if args.eval_only:
                raise ValueError(
                    f"--eval-only auto: no checkpoint of a run {args.exp_name}__{args.seed}__* in {args.output_dir}"
                )
            print(
                f"[start] --resume auto: no checkpoint of a run {args.exp_name}__{args.seed}__* in "
                f"{args.output_dir}; starting a new run",
                file=sys.stderr,
            )
        # before the games are made (a fresh clone makes 240 first): an engine that cannot build stops at once
        sampler, reason = samplers.sampler_choice(args, accelerator.device)
        if args.sampler == "auto" and accelerator.is_main_process:
            print(f"[start] --sampler auto: {sampler} ({reason})", file=sys.stderr)
        elif sampler == "vllm-colocate" and (problem := samplers.colocated_engine_problem(args, accelerator.device)):
            raise ValueError(f"--sampler vllm-colocate: {problem}")
        args = dataclasses.replace(args, sampler=sampler)
        with accelerator.main_process_first():  # the offline games and the tiny agent are built once, not per process
            template = str(Path(args.chat_template).resolve()) if args.chat_template else ""
            args = dataclasses.replace(
                args, data_root=common.resolve_data_root(args.data_root, args.model), chat_template=template
            )
            samplers.chat_protocol(args)  # the chat template (the tokenizer only: no weights load)
        state = None
        if checkpoint is not None:
            state = check_checkpoint(
                checkpoint, args, algorithm, flag, None if args.eval_only else accelerator.num_processes
            )
            ours, free = json.loads(json.dumps(dataclasses.asdict(args))), (*RESUME_FREE_FLAGS, *resume_may_change)
            differences = [
                f"--{key.replace('_', '-')} {ours[key]} (the run: {config[key]})"
                for key in ours
                if not args.eval_only and key in config and key not in free and ours[key] != config[key]
            ]
            if differences:
                raise ValueError(
                    f"--resume {checkpoint}: these flags change what the run is, and differ from its "
                    f"{config_file}: {'; '.join(differences)}. Pass the run's values, or start a new run"
                )
        games = [] if args.eval_only else training_games(args, accelerator)
        for split in ("valid_seen", "valid_unseen") if args.eval_only or args.eval_every else ():
            try:
                games += common.eval_subset(args.data_root, split, args.task_types, eval_count(args))
            except FileNotFoundError:
                pass  # evaluate() says so
        common.check_games(games)
        return args, checkpoint, state


@dataclasses.dataclass
class Job:
    """What the start-up checks settled for a run: the args as it uses them, the accelerator, and the checkpoint to
    resume or evaluate (None: a new run) with its trainer state."""

    args: object
    accelerator: object
    algorithm: str
    checkpoint: Path | None
    trainer_state: dict | None


class RunStop(RuntimeError):
    """The run cannot go on (out of memory, a sampler that drifted from the trainer): it stops with the reason and what
    to change, its last checkpoint kept for --resume; the command exits 1 with the message alone."""


def last_checkpoint_note(args) -> str:
    last = find_checkpoint("auto", args.output_dir, args.exp_name, args.seed, "--resume")  # what --resume auto takes
    return f"the last checkpoint, {last}, is kept" if last is not None else "no checkpoint was saved yet"


def out_of_memory_message(args, error: Exception) -> str:
    """What ran out (torch's out-of-memory error, or the vLLM engine's at its build or wake-up), the checkpoint to
    resume from, and the knobs that bound what a run holds at once."""
    return (
        f"out of memory ({str(error).splitlines()[0] if str(error) else type(error).__name__}); "
        f"{last_checkpoint_note(args)}: lower "
        f"--sample-batch-size ({args.sample_batch_size}, prompts sampled at once), --micro-batch-tokens "
        f"({args.micro_batch_tokens}, tokens of one forward/backward), --kv-cache-mb ({args.kv_cache_mb}, KV caches "
        f"kept between turns) or --vllm-gpu-memory-utilization ({args.vllm_gpu_memory_utilization}, the vLLM "
        "engine's share of the GPU), then continue with --resume auto"
    )


@contextlib.contextmanager
def training_job(args, algorithm: str, validate_args, resume_may_change: Sequence[str] = ()):
    """The accelerator, the start-up checks (start) and the seeds around a run; yields its Job."""
    from accelerate.utils import set_seed

    accelerator = make_accelerator()
    try:
        args, checkpoint, trainer_state = startup_checks(args, algorithm, accelerator, validate_args, resume_may_change)
        set_seed(args.seed + accelerator.process_index)
        yield Job(args, accelerator, algorithm, checkpoint, trainer_state)
    except (torch.OutOfMemoryError, samplers.EngineOutOfMemory) as error:
        raise RunStop(out_of_memory_message(args, error)) from error
    except training.SamplerDrifted as error:
        raise RunStop(f"{error}; {last_checkpoint_note(args)}") from error
    finally:
        samplers.close_colocated_engine()
        close_distributed()


class Runtime:
    """What every algorithm's update needs: this process's shard of the training games (shuffled with the seed,
    found before the model loads), the model and its optimizer, the chat protocol, the samplers (T = --temperature,
    and greedy) and the cursor of the next fresh game. An algorithm subclasses it for its own state and extends
    state_dict / load_state_dict with what a checkpoint must keep of it."""

    def __init__(self, args, accelerator):
        self.args, self.accelerator = args, accelerator
        self.games = training_games(args, accelerator)
        self.heads = torch.nn.ModuleDict(self.make_heads(samplers.model_config(args.model)))
        self.tokenizer, self.model, self.optimizer = samplers.load_model(args, accelerator, self.heads)
        self.protocol = samplers.chat_protocol(args, self.tokenizer)
        self.sample_fn = samplers.make_sampler(self.model, self.tokenizer, accelerator, args)
        self.greedy_fn = samplers.make_sampler(self.model, self.tokenizer, accelerator, args, greedy=True)
        at_eval = dataclasses.replace(args, temperature=args.eval_temperature, async_steps=0)
        sampled = at_eval.temperature and samplers.make_sampler(self.model, self.tokenizer, accelerator, at_eval)
        self.eval_fn = sampled or self.greedy_fn  # the evaluation splits' sampler (evaluate)
        self.game_cursor = 0  # of the games in the updates trained (--async-steps: not those sampled ahead)
        self.bad_games = 0  # games skipped since the last metrics row (rollout/bad_games_skipped)
        self.on_turn: Callable[[int, int], None] | None = None  # rollout progress (the logger's turn bar)
        self.rollouts: AsyncRollouts | None = None  # --async-steps: the background sampler (Run starts it)

    def share(self, name: str) -> int:
        """This process's share of a count of the run (its Args' GLOBAL_COUNTS; start-up checked that it divides)."""
        return getattr(self.args, name) // self.accelerator.num_processes

    def make_heads(self, config) -> dict[str, torch.nn.Module]:
        """The algorithm's own trainable modules on the policy (a value head reading its hidden states), by name, from
        the model's config: the optimizer steps them with the policy, every process starts from rank 0's, and
        checkpoints keep them (heads.safetensors, checked on load). None here."""
        return {}

    def next_game_start(self) -> common.SavedState:
        """The next training game from its start (games cycle in their shuffled order)."""
        (state,), self.game_cursor, skipped = self.game_starts(1, self.game_cursor)
        self.bad_games += skipped
        return state

    def game_starts(self, n: int, cursor: int) -> tuple[list[common.SavedState], int, int]:
        """n training games from their start, the first at `cursor` in the shuffled order (games cycle): (the starts,
        the cursor after them, the games skipped). A game that passed the start-up parse but does not load is skipped
        and named on stderr: a bad game never ends the run."""
        starts, skipped = [], 0
        while len(starts) < n:
            for _ in self.games:
                game = self.games[cursor % len(self.games)]
                cursor += 1
                if (state := common.game_start_or_skip(game, self.protocol, "games", seed=cursor)) is not None:
                    starts.append(state)
                    break
                skipped += 1
            else:
                raise RuntimeError(f"none of this process's {len(self.games)} training games loads")
        return starts, cursor, skipped

    def rollout_groups(self) -> list[list[common.Trajectory]]:
        """Step 1 of an update: this process's share of --groups-per-update games from their start, --group-size
        episodes each, to --max-turns. --async-steps 0: played now, with the weights as they are. K >= 1: the batch
        AsyncRollouts sampled for this update, at most K versions behind these weights."""
        args = self.args
        if self.rollouts is not None:
            batch = self.rollouts.next_batch()
        else:
            starts, cursor, skipped = self.game_starts(self.share("groups_per_update"), self.game_cursor)
            groups = self.play(starts, args.group_size, horizon=args.max_turns, max_turns=args.max_turns)
            batch = RolloutBatch(groups, 0, cursor, skipped)
        self.game_cursor = batch.game_cursor
        self.bad_games += batch.bad_games
        return batch.groups

    def play(self, starts, group_size: int, *, horizon: int, max_turns: int, sample_fn=None):
        """rollout() with the run's token budgets, progress bar and sampler (self.sample_fn unless given)."""
        return common.rollout(
            starts,
            group_size,
            sample_fn or self.sample_fn,
            self.protocol,
            horizon=horizon,
            max_turns=max_turns,
            max_turn_tokens=self.args.max_turn_tokens,
            max_trajectory_tokens=self.args.max_trajectory_tokens,
            on_turn=self.on_turn,
        )

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this process."""
        return {"game_cursor": self.game_cursor}

    def load_state_dict(self, state: dict) -> None:
        self.game_cursor = state["game_cursor"]


@dataclasses.dataclass
class RolloutBatch:
    """One update's rollout: its groups, the weights version that sampled them, the game cursor after its games and
    the games it skipped."""

    groups: list[list[common.Trajectory]]
    version: int
    game_cursor: int
    bad_games: int


class RolloutsStopped(Exception):
    """AsyncRollouts.close() ended a rollout in flight (its next turn)."""


class AsyncRollouts:
    """--async-steps K: a background thread plays the rollouts of the coming updates through the vLLM server while the
    current update trains. The trainer's thread keeps the model (it alone reads and writes the weights and loads
    adapters); this thread drives the server and the games.

    Version v = the weights after v updates. Before it takes the batch of update u, the trainer publishes version u - 1:
    its adapter loaded into the server (ServerSampler.sync_adapter, which keeps the K + 1 newest loaded and on disk)
    and its trained tensors kept here (weights_of: the behaviour logprobs). The rule: the batch of update u is begun
    only once version u - 1 - K is published, with the newest published adapter, and every turn of every episode in it
    is sampled with that one adapter. Update u trains version u - 1, so each datum is at most K versions behind the
    weights it updates (staleness = u - 1 - its version); no batch can go stale past the bound, so none is requeued or
    dropped. The thread samples no batch past the run's last update. A batch not yet trained is lost with the process
    (kill, crash): the checkpoint's game cursor is that of the updates trained, so a resumed run samples those games
    again, with its own weights, and trains nothing twice."""

    def __init__(self, rt, done: int, total_updates: int):
        self.rt, self.bound, self.total_updates = rt, rt.args.async_steps, total_updates
        self.update = done  # the last update whose batch the trainer took
        self.cursor = rt.game_cursor  # the sampling thread's: games begun
        self.latest, self.versions = -1, {}  # version -> (adapter name, trained tensors), the K + 1 newest
        self.staleness: list[int] = []  # of the last batch taken, per episode
        self.ready: queue.Queue = queue.Queue()
        self.changed = threading.Condition()
        self.stopping = False
        self.publish(done)
        self.thread = threading.Thread(target=self._sample_ahead, args=(done + 1,), name="async-rollouts", daemon=True)
        self.thread.start()

    def publish(self, version: int) -> None:
        """The trainer's weights as `version`: their adapter served, their tensors kept; the oldest beyond K + 1 go."""
        rt = self.rt
        rt.sample_fn.sync_adapter()
        policy = rt.accelerator.unwrap_model(rt.model)
        tensors = [p.detach().clone() for p in policy.parameters() if p.requires_grad]
        with self.changed:
            self.versions[version] = (rt.sample_fn.adapter_name, tensors)
            for old in [v for v in self.versions if v < version - self.bound]:
                del self.versions[old]
            self.latest = version
            self.changed.notify_all()

    @contextlib.contextmanager
    def weights_of(self, version: int):
        """The policy's trained parameters set to `version`'s inside (the trainer's thread), restored after."""
        params = [p for p in self.rt.accelerator.unwrap_model(self.rt.model).parameters() if p.requires_grad]
        if version == self.latest:
            yield
            return
        current = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, saved in zip(params, self.versions[version][1]):
                p.copy_(saved)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, saved in zip(params, current):
                    p.copy_(saved)

    def _sample_ahead(self, first: int) -> None:
        """The batches of updates first.. to the last, in order, each begun within the bound."""
        args, rt = self.rt.args, self.rt
        try:
            for update in range(first, self.total_updates + 1):
                with self.changed:  # the bound: version update - 1 - K must be out
                    self.changed.wait_for(lambda: self.stopping or self.latest >= update - 1 - self.bound)
                    if self.stopping:
                        return
                    version, (adapter, _) = self.latest, self.versions[self.latest]
                sample = rt.sample_fn.pinned(adapter)

                def sample_fn(prompts, max_new_tokens):
                    if self.stopping:
                        raise RolloutsStopped
                    return sample(prompts, max_new_tokens)

                starts, self.cursor, skipped = rt.game_starts(rt.share("groups_per_update"), self.cursor)
                groups = rt.play(
                    starts, args.group_size, horizon=args.max_turns, max_turns=args.max_turns, sample_fn=sample_fn
                )
                for traj in (traj for group in groups for traj in group):
                    traj.version = version
                self.ready.put(RolloutBatch(groups, version, self.cursor, skipped))
        except RolloutsStopped:
            return
        except BaseException as error:  # the trainer raises it when it asks for the next batch
            self.ready.put(error)

    def next_batch(self) -> RolloutBatch:
        """The next update's batch (waits for it), after publishing the weights that update trains."""
        self.update += 1
        if self.update - 1 > self.latest:
            self.publish(self.update - 1)
        batch = self.ready.get()
        if isinstance(batch, BaseException):
            raise RuntimeError(f"--async-steps: sampling the rollouts ahead failed: {batch}") from batch
        self.staleness = [self.update - 1 - batch.version for group in batch.groups for _ in group]
        return batch

    def metrics(self) -> dict:
        """rollout/staleness_mean and _max: versions between the weights trained and the adapter that sampled."""
        return {
            "rollout/staleness_mean": math.fsum(self.staleness) / max(1, len(self.staleness)),
            "rollout/staleness_max": training.MaxMetric(max(self.staleness, default=0)),
        }

    def close(self) -> None:
        """Stops the thread (a rollout in flight ends at its next turn, its batch unused)."""
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        self.thread.join()


TOKEN_BUDGET_WARNING_SHARE = 0.05  # above this share of an update's episodes stopped on the token budget: a warning


def token_budget_warning(metrics: dict, args) -> str | None:
    """The warning (Run.gather prints the first) when more than TOKEN_BUDGET_WARNING_SHARE of an update's episodes
    stopped on --max-trajectory-tokens rather than on a win or the turn limit."""
    share = metrics.get("rollout/stopped/token_budget", 0.0)
    if share > TOKEN_BUDGET_WARNING_SHARE:
        return (
            f"[rollout] WARNING (said once): {share:.0%} of the update's episodes stopped on --max-trajectory-tokens "
            f"({args.max_trajectory_tokens}): raise it, or lower --max-turns / --max-turn-tokens"
        )
    return None


class Run:
    """The bookkeeping around the update loop that each script's main() writes out: the run directory (new, or the
    resumed run's), its logger, and on resume the runtime, model, optimizer and RNG states as they were saved."""

    def __init__(self, job: Job, rt: Runtime, total_updates: int, postfix_keys: Sequence[str] = ()):
        self.job, self.rt, self.total_updates = job, rt, total_updates
        self.warned = False  # the token budget's warning (gather)
        resumed = job.checkpoint
        self.done = job.trainer_state["update"] if resumed is not None else 0
        self.dir = resumed.parent.parent if resumed is not None else new_run_dir(job.args)
        self.logger = RunLogger(job.args, self.dir, job.accelerator, total_updates, self.done, postfix_keys)
        rt.on_turn = self.logger.on_turn
        if resumed is not None:
            rt.load_state_dict(job.trainer_state["rank_states"][job.accelerator.process_index])
            load_checkpoint(resumed, rt.model, rt.optimizer, job.accelerator, rt.heads)  # last: the RNG states as saved
            if job.accelerator.is_main_process:
                print(f"resumed {resumed} (update {self.done} of {total_updates})", file=sys.stderr)
        elif self.evaluates(0):  # the policy a new run starts from, as row 0: its curves begin where training does
            self.log(0, evaluate(rt, job.args.max_turns))
        if job.args.async_steps:
            rt.rollouts = AsyncRollouts(rt, self.done, total_updates)  # samples ahead from now on

    def updates(self) -> range:
        """The updates still to run."""
        return range(self.done + 1, self.total_updates + 1)

    def gather(self, metrics: dict) -> dict:
        """An update's metrics, with the games skipped since the last row, over all processes (reduce_metrics). The
        first update whose episodes stopped on the token budget more often than TOKEN_BUDGET_WARNING_SHARE says so."""
        metrics["rollout/bad_games_skipped"], self.rt.bad_games = training.SummedMetric(self.rt.bad_games), 0
        if (engine := getattr(self.rt.sample_fn, "engine", None)) is not None:  # vllm-colocate: asleep only to train
            metrics["time/engine_sleeps"], engine.sleeps = float(engine.sleeps), 0
        if self.rt.rollouts is not None:
            metrics |= self.rt.rollouts.metrics()
        metrics = training.reduce_metrics(self.job.accelerator, metrics)
        warning = token_budget_warning(metrics, self.job.args)
        if warning and not self.warned and self.job.accelerator.is_main_process:
            self.warned = True
            print(warning, file=sys.stderr)
        return metrics

    def evaluates(self, update: int) -> bool:
        """Whether an evaluation follows this update (0: before the first): every --eval-every and after the last
        (with --eval-games)."""
        args = self.job.args
        return bool(args.eval_every and args.eval_games) and (
            update == self.total_updates or update % args.eval_every == 0
        )

    def log(self, update: int, metrics: dict, samples: Sequence[dict] = ()) -> None:
        self.logger.log(update, metrics, samples)

    def checkpoint(self, update: int, tags: dict) -> None:
        """Every --save-every updates and after the last: a checkpoint with the tags and every process's
        rt.state_dict(); then only the newest --keep-checkpoints stay."""
        args, rt = self.job.args, self.rt
        if update == self.total_updates or (args.save_every and update % args.save_every == 0):
            save_checkpoint(
                self.dir,
                update,
                rt.model,
                rt.optimizer,
                rt.accelerator,
                self.job.algorithm,
                tags,
                rt.state_dict(),
                rt.heads,
            )
            if args.keep_checkpoints and rt.accelerator.is_main_process:
                for old in _checkpoints_in(self.dir)[: -args.keep_checkpoints]:
                    shutil.rmtree(old)

    def close(self) -> Path:
        """Returns the run directory."""
        if self.rt.rollouts is not None:
            self.rt.rollouts.close()
        self.logger.close()
        return self.dir


def evaluate_checkpoint(job: Job, rt: Runtime, max_turns: int) -> Path:
    """--eval-only: the checkpoint's adapter, one evaluation, one metrics row (update = the checkpoint's) in a new
    run directory, which is returned."""
    load_checkpoint(job.checkpoint, rt.model, None, job.accelerator, rt.heads)
    run_dir = new_run_dir(job.args)
    logger = RunLogger(job.args, run_dir, job.accelerator, 1, 0)
    rt.on_turn = logger.on_turn
    metrics = evaluate(rt, max_turns)
    logger.log(job.trainer_state["update"], {"checkpoint": str(job.checkpoint), **metrics})
    logger.close()
    if job.accelerator.is_main_process:
        print(json.dumps(metrics, indent=2))
    return run_dir


def new_run_dir(args) -> Path:
    return Path(args.output_dir) / f"{args.exp_name}__{args.seed}__{int(time.time())}"


def drop_rows_after(path: Path, update: int) -> None:
    """Keep only the JSONL rows of updates <= `update`: a run that died after logging an update but before
    checkpointing it repeats that update when resumed. A line cut short by the kill goes too."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["update"] <= update:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def provenance() -> dict:
    """What produced a run, besides its flags (config.json): the code's commit and whether the tree had uncommitted
    changes to tracked files, the command line, the Python and every installed package's version, the time."""

    def git(*command: str) -> str | None:
        try:
            done = subprocess.run(["git", *command], cwd=Path(__file__).parent, capture_output=True, text=True)
        except OSError:  # no git on the machine
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "argv": sys.argv,
        "python": sys.version.split()[0],
        "packages": {d.metadata["Name"]: d.version for d in importlib.metadata.distributions() if d.metadata["Name"]},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


class RunLogger:
    """config.json, provenance.jsonl (a line per start: commit, packages), metrics.jsonl (one line per update),
    samples.jsonl, optional W&B (metrics and a table of
    sample trajectories per update), and tqdm bars over updates and over the turns of the current rollout.
    Only the main process writes."""

    def __init__(self, args, run_dir: Path, accelerator, total_updates: int, done: int, postfix_keys=()):
        from tqdm import tqdm

        self.run_dir, self.postfix_keys = Path(run_dir), postfix_keys
        self.recent = {key: collections.deque(maxlen=4) for key in postfix_keys}  # the bar's last 4 updates
        self.active = accelerator.is_main_process
        self.wandb = None
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if done:
            for name in ("metrics.jsonl", "samples.jsonl"):
                drop_rows_after(self.run_dir / name, done)
        (self.run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
        with open(self.run_dir / "provenance.jsonl", "a") as f:  # one line per start or resume of the run
            f.write(json.dumps({"updates_done": done, **provenance()}) + "\n")
        self.metrics_file = open(self.run_dir / "metrics.jsonl", "a")
        self.samples_file = open(self.run_dir / "samples.jsonl", "a")
        if args.track:
            import wandb

            # The mode comes from WANDB_MODE, never forced online; without it and without credentials: offline.
            mode = None if os.environ.get("WANDB_MODE") or wandb.login(prompt=False, verify=False) else "offline"
            self.wandb = wandb.init(
                project=args.wandb_project,
                name=self.run_dir.name,
                id=self.run_dir.name,
                resume="allow",
                config=dataclasses.asdict(args),
                dir=None if os.environ.get("WANDB_DIR") else str(self.run_dir),
                mode=mode,
            )
        self.bar = tqdm(total=total_updates, initial=done, desc=self.run_dir.name, unit="update", dynamic_ncols=True)
        self.turns = tqdm(desc="rollout", unit="turn", position=1, leave=False, dynamic_ncols=True)

    def on_turn(self, turn_index: int, live_branches: int) -> None:
        """rollout's progress callback: turns done in the current rollout, branches still playing."""
        if not self.active:
            return
        if turn_index == 1:
            self.turns.reset()
        self.turns.update(1)
        self.turns.set_postfix(live=live_branches)

    def log(self, update: int, metrics: dict, samples: Sequence[dict] = ()):
        if not self.active:
            return
        self.metrics_file.write(json.dumps({"update": update, **metrics}) + "\n")
        self.metrics_file.flush()
        for sample in samples:
            self.samples_file.write(json.dumps({"update": update, **sample}) + "\n")
        self.samples_file.flush()
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.wandb is not None:
            import wandb

            rows = [
                [
                    update,
                    s.get("game", ""),
                    s.get("task", ""),
                    "\n\n".join(f"[{m['role']}] {m['content']}" for m in s.get("messages", ())),
                    json.dumps({k: v for k, v in s.items() if k not in ("game", "task", "messages")}),
                ]
                for s in samples
            ]
            table = (
                {"samples": wandb.Table(columns=["update", "game", "task", "messages", "details"], data=rows)}
                if rows
                else {}
            )
            self.wandb.log({**numeric, **table}, step=update)
        self.bar.update(1 if update else 0)  # row 0 (the start's evaluation) is no update
        for key in (k for k in self.postfix_keys if k in numeric):
            self.recent[key].append(numeric[key])
        # means over the last 4 updates: one update's 16 episodes are too noisy to show a trend
        self.bar.set_postfix({k.split("/")[-1]: f"{sum(v) / len(v):.3g}" for k, v in self.recent.items() if v})

    def close(self):
        if not self.active:
            return
        self.turns.close()
        self.bar.close()
        self.metrics_file.close()
        self.samples_file.close()
        if self.wandb is not None:
            self.wandb.finish()


def _rng_state() -> dict:
    python = random.getstate()
    numpy = np.random.get_state()
    return {
        "python": [python[0], list(python[1]), python[2]],
        "numpy": [numpy[0], numpy[1].tolist(), numpy[2], numpy[3], numpy[4]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: dict) -> None:
    python, numpy = state["python"], state["numpy"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    np.random.set_state((numpy[0], np.array(numpy[1], dtype=np.uint32), numpy[2], numpy[3], numpy[4]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def placed_like(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole saved tensor as `like` holds it: under --fsdp this process's shard (each process slices the whole
    tensor it read itself, no communication), else the tensor."""
    from torch.distributed.tensor import distribute_tensor

    if not isinstance(like, DTensor):
        return tensor
    return distribute_tensor(tensor.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def full_tensor_on_cpu(tensor):
    """A shard (DTensor) gathered whole, on the CPU (a collective: every process calls it); other values as they are."""
    return tensor.full_tensor().cpu() if isinstance(tensor, DTensor) else tensor


HEADS_FILE = "heads.safetensors"  # an algorithm's own modules (Runtime.make_heads) in a checkpoint


def weights_file(lora: bool) -> str:
    return "adapter_model.safetensors" if lora else "model.safetensors"


def save_checkpoint(
    run_dir: Path,
    update: int,
    model,
    optimizer,
    accelerator,
    algorithm: str,
    trainer_state: dict,
    rank_state: dict,
    heads: torch.nn.Module | None = None,
) -> Path:
    """checkpoints/update_{n:06d}/: the trained weights (a peft adapter dir, or with --lora-rank 0 config.json and
    model.safetensors of every weight: both load with from_pretrained), the algorithm's heads (heads.safetensors, when
    it has any), optimizer, RNG states and trainer_state.json of every process, written by the main process into a
    temporary dir that is then renamed: a checkpoint dir is always complete, whenever the job dies. All processes call;
    they must hold the same weights and heads (checked, loudly). Not accelerate's save_state: it pickles, and keeps
    custom state of the main process only."""
    from accelerate.utils import gather_object
    from peft import PeftModel
    from safetensors.torch import save_file

    policy = accelerator.unwrap_model(model)
    weights = samplers.trained_weights(policy)
    checksum = samplers.adapter_sha256(weights)
    saved = optimizer.state_dict()  # --fsdp: every process gathers the shards (a collective), the main one writes
    saved["state"] = {i: {k: full_tensor_on_cpu(v) for k, v in state.items()} for i, state in saved["state"].items()}
    head_weights = {k: v.detach().cpu().contiguous() for k, v in (heads.state_dict() if heads else {}).items()}
    heads_checksum = {"heads_sha256": samplers.adapter_sha256(head_weights)} if head_weights else {}
    checksums = {"adapter_sha256": checksum} | heads_checksum
    per_rank = [{"state": rank_state, "rng": _rng_state(), **checksums}]
    per_rank = gather_object(per_rank) if accelerator.num_processes > 1 else per_rank
    for key, what in (("adapter_sha256", "adapter"), ("heads_sha256", "heads")):
        if len({r.get(key) for r in per_rank}) > 1:
            raise RuntimeError(
                f"update {update}: the {what} differ(s) across processes (sha256 per rank: "
                f"{[r[key][:16] for r in per_rank]}); gradients were not synchronised"
            )
    checkpoints = Path(run_dir) / "checkpoints"
    final = checkpoints / f"update_{update:06d}"
    if accelerator.is_main_process:
        for stale in checkpoints.glob(".tmp_*"):  # left by a job killed while saving
            shutil.rmtree(stale, ignore_errors=True)
        tmp = checkpoints / f".tmp_{final.name}_{os.getpid()}"
        tmp.mkdir(parents=True)
        if isinstance(policy, PeftModel):
            samplers.save_adapter(policy, tmp)
        else:  # one file, the parameters' own names: from_pretrained reads it, load_checkpoint copies it back
            policy.config.save_pretrained(tmp)
            save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, tmp / weights_file(lora=False))
        if head_weights:
            save_file(head_weights, tmp / HEADS_FILE)
        torch.save(saved, tmp / "optimizer.pt")
        torch.save([r["rng"] for r in per_rank], tmp / "rng.pt")
        state = {
            "algorithm": algorithm,
            "update": update,
            "counts": "global",  # GLOBAL_COUNTS are the run's (before: per process; check_checkpoint)
            **trainer_state,
            **checksums,
            "rank_states": [r["state"] for r in per_rank],
        }
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        if final.exists():  # saving an update again (resumed from an older checkpoint): move the old one aside first
            old = checkpoints / f".tmp_old_{final.name}_{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        heads_note = f", and heads sha256 {checksums['heads_sha256'][:16]}" if head_weights else ""
        print(
            f"[checkpoint] {final}: adapter sha256 {checksum[:16]} identical on {accelerator.num_processes} "
            f"process(es){heads_note}",
            file=sys.stderr,
        )
    accelerator.wait_for_everyone()
    return final


def _checkpoints_in(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary dirs of an interrupted save start with a dot)."""
    return sorted(p for p in (run_dir / "checkpoints").glob("update_*") if (p / "trainer_state.json").is_file())


def load_checkpoint(path: Path, model, optimizer, accelerator, heads: torch.nn.Module | None = None) -> None:
    """The trained weights and the algorithm's heads; with an optimizer (resuming) also its state and this process's
    RNG states, so call it right before the first update. Nothing is unpickled: safetensors, and
    torch.load(weights_only=True)."""
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    policy = accelerator.unwrap_model(model)
    lora = isinstance(policy, PeftModel)
    for unit in samplers.fsdp_modules(policy):  # --fsdp: the shards are the weights; gathered again below
        unit.reshard()
    ours = samplers.trained_weights(policy)
    weights = {
        name: placed_like(tensor, ours[name]) for name, tensor in load_file(str(path / weights_file(lora))).items()
    }
    if lora:
        set_peft_model_state_dict(policy, weights)
    else:
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                parameter.copy_(weights[name])
    samplers.gather_weights(policy)
    if heads:
        saved = load_file(str(path / HEADS_FILE)) if (path / HEADS_FILE).is_file() else {}
        ours = heads.state_dict()
        if {k: tuple(v.shape) for k, v in saved.items()} != {k: tuple(v.shape) for k, v in ours.items()}:
            raise ValueError(
                f"{path}: the checkpoint's heads ({ {k: tuple(v.shape) for k, v in saved.items()} }) are not this "
                f"algorithm's ({ {k: tuple(v.shape) for k, v in ours.items()} })"
            )
        heads.load_state_dict(saved)
    if optimizer is not None:
        # mmap: each process reads only what it keeps (its shard); load_state_dict moves the state to the parameters'
        saved = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu", mmap=True)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        saved["state"] = {
            i: {k: placed_like(v, params[i]) if v.shape == params[i].shape else v for k, v in state.items()}
            for i, state in saved["state"].items()
        }  # --fsdp: this process's shard of each moment; the step count as it is
        optimizer.load_state_dict(saved)
        _set_rng_state(torch.load(path / "rng.pt", weights_only=True)[accelerator.process_index])


def find_checkpoint(spec: str, output_dir: str, exp_name: str, seed: int, flag: str) -> Path | None:
    """`spec` of --resume / --eval-only: "" -> None; "auto" -> newest checkpoint of the latest run named exp_name
    with this seed (None if there is none); a checkpoint dir; or a run dir (its newest checkpoint)."""
    if not spec:
        return None
    if spec == "auto":
        runs = sorted(
            Path(output_dir).glob(f"{exp_name}__{seed}__*"),
            key=lambda p: (int(p.name.split("__")[-1]), p.name) if p.name.split("__")[-1].isdigit() else (0, p.name),
        )
        for run_dir in reversed(runs):
            if checkpoints := _checkpoints_in(run_dir):
                return checkpoints[-1]
        return None
    path = Path(spec)
    if (path / "trainer_state.json").is_file():
        return path
    if checkpoints := _checkpoints_in(path):
        return checkpoints[-1]
    raise ValueError(f"{flag} {spec}: no checkpoint there (expected trainer_state.json or checkpoints/update_*)")


def check_checkpoint(path: Path, args, algorithm: str, flag: str, num_processes: int | None) -> dict:
    """Open every file of a checkpoint and compare it with the flags, before anything loads; returns its
    trainer state. num_processes: resuming (optimizer and RNG states needed, one state per process)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    lora = (path / "adapter_config.json").is_file()  # else full weights (--lora-rank 0)
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        adapter_config = json.loads((path / "adapter_config.json").read_text()) if lora else {"r": 0}
        adapter = load_file(str(path / weights_file(lora)))
        heads = load_file(str(path / HEADS_FILE)) if isinstance(state, dict) and "heads_sha256" in state else None
        if num_processes is not None:
            for name in ("optimizer.pt", "rng.pt"):
                zipfile.ZipFile(path / name).close()  # a torch.save file is a zip; a truncated one has no directory
    except (OSError, ValueError, SafetensorError, zipfile.BadZipFile) as error:
        raise ValueError(
            f"{flag} {path}: corrupt or incomplete checkpoint ({type(error).__name__}: {error}); "
            "pass an older checkpoint dir"
        ) from error
    if (
        not isinstance(state, dict)
        or not isinstance(state.get("update"), int)
        or not isinstance(state.get("rank_states"), list)
    ):
        raise ValueError(f"{flag} {path}: corrupt checkpoint (trainer_state.json lacks update / rank_states)")
    if state.get("adapter_sha256") not in (None, samplers.adapter_sha256(adapter)):
        raise ValueError(
            f"{flag} {path}: corrupt checkpoint ({weights_file(lora)} does not match the sha256 in "
            "trainer_state.json); pass an older checkpoint dir"
        )
    if heads is not None and state["heads_sha256"] != samplers.adapter_sha256(heads):
        raise ValueError(
            f"{flag} {path}: corrupt checkpoint ({HEADS_FILE} does not match the sha256 in trainer_state.json); "
            "pass an older checkpoint dir"
        )
    if state.get("algorithm") != algorithm:
        raise ValueError(
            f"{flag} {path} is a checkpoint of {state.get('algorithm')!r}; this script trains {algorithm!r}"
        )
    if num_processes is not None and len(state["rank_states"]) != num_processes:
        raise ValueError(
            f"{flag} {path} was written by {len(state['rank_states'])} processes; resume it with the same "
            f"number (now {num_processes})"
        )
    if num_processes is not None and num_processes > 1 and state.get("counts") != "global":
        raise ValueError(
            f"{flag} {path} was written when --groups-per-update and the other counts of an update were per process "
            f"(now: all processes together); resume it with the commit that wrote it, or start a new run"
        )
    saved = {"--lora-rank": adapter_config.get("r")}
    ours = {"--lora-rank": args.lora_rank}
    if lora and args.lora_rank:
        saved |= {
            "--lora-alpha": adapter_config.get("lora_alpha"),
            "--lora-targets": sorted(adapter_config.get("target_modules") or []),
        }
        ours |= {"--lora-alpha": args.lora_alpha, "--lora-targets": sorted(args.lora_targets)}
    for name, value in saved.items():
        if value != ours[name]:
            raise ValueError(f"{name} {ours[name]} does not match the checkpoint {path} ({value})")
    return state


def cli(args_type, main, presets: dict | None = None, argv: Sequence[str] | None = None):
    """tyro's CLI around main (argv: the command line's by default); returns what main returns. The parse's defaults
    are Args(), then a preset's values (`script.py NAME ...` or --preset NAME; presets: name -> (one line, Args)), then
    a --config file's, which --help shows; every flag given overrides them. With --eval-only every flag not given takes
    the evaluated run's value (its config.json). A StartupError prints just its message and exits 2, as tyro does for
    a bad flag."""
    presets = presets or {}
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in presets:
        argv = ["--preset", *argv]
    listing = "presets (`script.py NAME --flags`): " + "; ".join(f"{n}: {line}" for n, (line, _) in presets.items())
    description = f"{sys.modules[args_type.__module__].__doc__ or ''}\n{listing if presets else ''}"
    bare = [flag for flag in argv if flag not in ("-h", "--help")]  # --help shows the preset's or file's values
    args = tyro.cli(args_type, args=bare, description=description)
    try:
        if args.preset or args.config or bare != argv:
            args = tyro.cli(args_type, args=argv, default=configured_defaults(args, presets), description=description)
        if args.eval_only:
            args = tyro.cli(args_type, args=argv, default=evaluated_run_args(args), description=description)
        return main(args)
    except StartupError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except RunStop as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None


def configured_defaults(args, presets: dict):
    """Args(), then --preset's values, then the --config file's (JSON or YAML: flag names as keys, a run's own
    config.json included); unknown keys, bad values and unknown presets are start-up errors naming them."""
    with startup_errors():
        require_all(
            (
                not args.preset or args.preset in presets,
                f"--preset must be one of {sorted(presets)}, got {args.preset!r}",
            )
        )
        default = presets[args.preset][1] if args.preset else type(args)()
        if args.config:
            default = config_file_args(args.config, default)
    return dataclasses.replace(default, preset=args.preset, config=args.config)


# Flags renamed when the scripts took one vocabulary (docs/new-algorithm.md): old name -> new name (or names, for a
# pair of values split in two). A --config file or a run's config.json written before still loads, with a note.
RENAMED_FLAGS = {
    "max_episode_steps": "max_turns",  # tempo.py
    "branches": "group_size",  # tempo.py
    "trajectories_per_game": "group_size",  # adca_grpo.py, gigpo.py
    "states_per_batch": "groups_per_update",  # tempo.py
    "games_per_update": "groups_per_update",  # adca_grpo.py, gigpo.py
    "warmup_games_per_batch": "warmup_groups_per_update",  # tempo.py
    "ppo_clip": ("clip_eps", "clip_eps_high"),  # tempo.py: [eps_low, eps_high], or null (the IS loss)
}


# Flags removed from a script because they lost (docs/does-it-learn.md keeps their figures): name -> (the value every
# run without the flag had, the commit that last had it). A file holding one at that value still loads (the key is
# dropped, with a note); at another value it is refused: that run needs the commit.
REMOVED_FLAGS = {
    "critic_replay": (0, "3d8e148"),  # tempo.py
    "critic_replay_capacity": (512, "3d8e148"),  # tempo.py
    "critic_coef": (1.0, "3d8e148"),  # tempo.py
    "critic_baseline": ("state", "3d8e148"),  # tempo.py
}


def renamed_flags(values: dict, source: str, note: bool = True) -> dict:
    """`values` (flag name -> value, from a file) with every old name of RENAMED_FLAGS read as its new one(s) and
    every REMOVED_FLAGS key at its old value dropped; a note on stderr names them. A file holding both a flag's old and
    new name, or a removed flag at another value, is refused."""
    renamed, notes = {}, []
    for key, value in values.items():
        if key in REMOVED_FLAGS:
            default, commit = REMOVED_FLAGS[key]
            require_all(
                (value == default, f"{source}: {key} = {value!r} is no longer a flag; that run needs commit {commit}")
            )
            notes.append(f"{key} dropped (removed; it held its only value, {default!r})")
            continue
        new = RENAMED_FLAGS.get(key)
        if new is None:
            renamed[key] = value
            continue
        parts = dict(zip(new, (None, None) if value is None else value)) if isinstance(new, tuple) else {new: value}
        both = sorted(set(parts) & set(values))
        require_all((not both, f"{source}: holds both {key} and its new name {' and '.join(both)}; keep only the new"))
        renamed |= parts
        notes.append(f"{key} -> {' + '.join(parts)}")
    if notes and note:
        print(f"[config] {source}: old flag names read as the new ones: {'; '.join(notes)}", file=sys.stderr)
    return renamed


def config_file_args(path: str, default, keep: Sequence[str] = (), strict: bool = True):
    """`default` with the values of a JSON / YAML file of flags, parsed as the command line would parse them; the
    fields in `keep` stay default's; strict=False skips keys that are no flags of this script (an older run's)."""
    import yaml

    try:
        text = Path(path).read_text()
        values = yaml.safe_load(text) if path.endswith((".yaml", ".yml")) else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError) as error:
        raise ValueError(f"--config {path}: cannot read it ({type(error).__name__}: {error})") from error
    fields = {f.name: f for f in dataclasses.fields(default)}
    require_all((isinstance(values, dict), f"--config {path}: expected a mapping of flag names to values"))
    values = renamed_flags(values, f"--config {path}")
    unknown = sorted(set(values) - set(fields))
    require_all(
        (not strict or not unknown, f"--config {path}: unknown keys {unknown} (not flags of this script; see --help)")
    )
    flags = []
    for key, value in values.items():
        if key in ("preset", "config", *keep) or key not in fields:  # preset, config: where a run's values came from
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{key.replace('_', '-')}")
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, "None" if value is None else str(value)]
    try:
        return tyro.cli(type(default), args=flags, default=default)
    except SystemExit as error:  # tyro printed which value it refused
        raise ValueError(f"--config {path}: a value above is not valid for its flag") from error


def evaluated_run_args(args):
    """args with every field but resume, eval_only, output_dir, threads and fsdp (how this launch runs) taken from the
    config.json of the run that --eval-only names (args unchanged when it has none: startup_checks() then says what is
    missing)."""
    with startup_errors():
        checkpoint = find_checkpoint(args.eval_only, args.output_dir, args.exp_name, args.seed, "--eval-only")
    config_file = checkpoint.parent.parent / "config.json" if checkpoint is not None else None
    if config_file is None or not config_file.is_file():
        return args
    with startup_errors():
        return config_file_args(
            str(config_file), args, keep=("resume", "eval_only", "output_dir", "threads", "fsdp"), strict=False
        )


def close_distributed() -> None:
    """Two-process CPU runs have hung at exit without this."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# =============================================================================================
# The presets' shared settings (the tiny agents of offline.py)
# =============================================================================================
# The CPU learning benchmarks' settings every script shares: its `learning` / `learning-long` presets add the rest
LEARNING_SETTINGS = {
    name: dict(
        model=agent,
        task_types=offline.TINY_AGENTS[agent].task_types,
        lora_rank=16,
        lora_alpha=32,
        learning_rate=1e-3,
        max_turn_tokens=48,
        max_trajectory_tokens=trajectory_tokens,
        sample_batch_size=64,
        save_every=6,
        eval_every=3,  # eval/train/success_rate, the quickstart's curve (benchmarks/learning/compare.py passes 0: it
        eval_games=16,  # evaluates each checkpoint on the training games itself, with more episodes)
    )
    for name, agent, trajectory_tokens in (
        ("learning", "tiny-agent", 8192),
        ("learning-long", "tiny-agent-long", 16384),
    )
}
