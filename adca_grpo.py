"""ADCA-GRPO: multi-turn GRPO where an LLM labels every step GOOD or BAD (AgentEvolver's `decouple` scheme).

Per update: play G games x N full episodes each (one GRPO group per game), score each trajectory 0/1
(won), ask a labeller to judge every step GOOD or BAD (ONE request per trajectory, showing the task and first
observation, the agent's numbered replies with the game's answers, and the outcome as +1/-1), z-score the labels
and the outcomes separately within each group, fuse them per step (alpha * labels + outcome on the last step),
take suffix sums as the step advantages, broadcast them to the generated tokens, and take PPO-clip steps on a LoRA
adapter. With `--no-attribution`, `--alpha 0` or after `--prm-steps` updates it is plain multi-turn GRPO (the
baseline): every generated token gets its episode's GRPO outcome advantage.

    python adca_grpo.py --labeler-base-url http://localhost:8000/v1 --labeler-model Qwen/Qwen3-32B
    python adca_grpo.py --labeler-backend self      # the policy labels its own steps: no endpoint, no key
    python adca_grpo.py --no-attribution            # plain multi-turn GRPO
    python adca_grpo.py --model tiny --help
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import time
import typing
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import numpy as np
import openai
import torch
import tyro

import common

# fork 1: the algorithm's name (a checkpoint carries it; another algorithm's is refused) and the docstring
ALGORITHM = "adca_grpo"
ORM_DISTRIBUTIONS = ("last_step", "all_steps", "only_prm")
PERMANENT_HTTP_ERRORS = (400, 401, 403, 404, 422)  # a labeller request that got one of these is not retried


# fork 2: the algorithm's flags in Args (keep the shared ones: the plumbing reads them) and in validate_args
@dataclass
class Args:
    # ---- model and optimisation (shared with tempo.py) ----
    model: str = "Qwen/Qwen3-4B-Instruct-2507"
    """HF model id or local path; `tiny` = the offline tiny model (tests, smoke runs)"""
    lora_rank: int = 32
    """LoRA rank"""
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
    # ---- data ----
    data_root: str | None = None
    """ALFWorld data dir holding json_2.1.1/ (None = the generated offline game set)"""
    split: Literal["train", "valid_seen", "valid_unseen"] = "train"
    """split the training games come from"""
    task_types: tuple[str, ...] | None = None
    """ALFWorld task types to train on (None = all six)"""
    seed: int = 1
    """seed of the game order and of sampling"""
    # ---- GRPO ----
    num_updates: int = 200
    """policy updates (one rollout and one optimizer step each)"""
    games_per_update: int = 8
    """G: games per update (per process), one GRPO group each"""
    trajectories_per_game: int = 8
    """N: episodes sampled per game (the group size)"""
    max_turns: int = 30
    """T: turns per episode (the rollout horizon)"""
    max_turn_tokens: int = 512
    """new tokens per turn"""
    max_trajectory_tokens: int = 24576
    """token budget of one episode (an episode stops before overflowing it)"""
    clip_eps: float = 0.2
    """PPO clip range below 1 (and above, unless --clip-eps-high is set)"""
    clip_eps_high: float | None = 0.28
    """PPO clip range above 1 (DAPO's clip-higher, AgentEvolver's 0.28); None = --clip-eps"""
    dual_clip_c: float | None = 3.0
    """dual-clip PPO: the loss of a token with a negative advantage is capped at c * |A| (AgentEvolver: 3); None = off"""
    kl_beta: float = 0.0
    """weight of the per-token KL to the base model (the adapter disabled) subtracted from the advantage; 0 = off"""
    kl_loss_coef: float = 0.0
    """weight of the k3 KL to the base model as a loss term (AgentEvolver: 0.001); 0 = off"""
    ppo_epochs: int = 1
    """passes over each rollout's data (old logprobs are recomputed by the policy when this or --mini-batches > 1)"""
    mini_batches: int = 1
    """optimizer steps per pass (the rollout's trajectories split at random)"""
    # ---- ADCA: step attribution ----
    attribution: bool = True
    """label steps and use the labels (--no-attribution: plain multi-turn GRPO)"""
    alpha: float = 0.1
    """weight of the z-scored step labels next to the z-scored outcome (0 = plain GRPO)"""
    alpha_schedule: Literal["constant", "cosine"] = "constant"
    """constant alpha, or cosine decay from --alpha to --alpha-min over the --prm-steps labelled updates"""
    alpha_min: float = 0.0
    """final alpha of the cosine schedule"""
    fix_base: float = 0.2
    """raw step reward: +fix_base for GOOD, -fix_base for BAD (before the group z-score)"""
    orm_distribution: Literal["last_step", "all_steps", "only_prm"] = "last_step"
    """where the outcome advantage is added: on the last step only, on every step, or nowhere (labels only)"""
    equal_trajectory_weight: bool = True
    """label z-score with every trajectory weighing the same (--no-equal-trajectory-weight: every step)"""
    length_normalization: bool = False
    """scale a trajectory's step rewards by 1/sqrt(its number of steps)"""
    skip_type: Literal["skip_small_adv", "skip_all_neg", "none"] = "skip_small_adv"
    """trajectories not sent to the labeller: |outcome advantage| < 1e-8, outcome <= 0, or none"""
    prm_steps: int = 20
    """label only during the first N updates (cost control), plain GRPO after"""
    prm_metrics_only: bool = False
    """label and log the prm/ dashboard, but train with plain GRPO advantages (to judge a labeller before trusting it)"""
    # ---- ADCA: the labeller ----
    labeler_backend: Literal["auto", "api", "self", "oracle"] = "auto"
    """api: an OpenAI-compatible endpoint; self: the policy itself, greedy; oracle: privileged planner judgments
    (GOOD when a step shortens the optimal remaining plan; an upper bound for ablations); auto: api if
    --labeler-base-url is set, else self"""
    labeler_base_url: str = ""
    """chat-completions base URL, e.g. http://localhost:8000/v1 (vllm serve) or DashScope's .../compatible-mode/v1"""
    labeler_model: str = "qwen-max"
    """model name sent to the endpoint"""
    labeler_api_key_env: str = "DASHSCOPE_API_KEY"
    """NAME of the environment variable holding the endpoint's key (the key itself is never logged)"""
    labeler_concurrency: int = 16
    """labelling requests in flight at once, all processes together (split across them)"""
    labeler_timeout_s: float = 120.0
    """timeout of one request"""
    labeler_deadline_s: float = 900.0
    """all labelling of one update ends by then; trajectories without labels get uniform ones"""
    labeler_max_attempts: int = 20
    """attempts per request (all within the deadline); 400/401/403/404/422 answers are not retried"""
    labeler_circuit_failures: int = 5
    """this many connection failures in a row end the update's labelling at once (fallback labels); the next tries again"""
    labeler_rate_limit_backoff_s: float = 1.0
    """wait after a first 429; x1.5 per further attempt, plus 0-25% jitter"""
    labeler_rate_limit_backoff_cap_s: float = 60.0
    """longest wait after a 429"""
    labeler_error_backoff_s: float = 2.0
    """wait after another error, times the attempt number"""
    labeler_error_backoff_cap_s: float = 15.0
    """longest wait after another error"""
    labeler_max_step_chars: int = 2000
    """the first observation and each step's reply and answer shown to the labeller are cut to this many characters"""
    labeler_max_new_tokens: int = 4096
    """longest labeller reply (tokens)"""
    labeler_log_dir: str = ""
    """write one JSONL record per labelling request here (empty: no log)"""
    # ---- runs (shared with tempo.py) ----
    exp_name: str = "adca_grpo"
    """run name prefix: runs/{exp_name}__{seed}__{time}"""
    output_dir: str = "runs"
    """where run directories go"""
    track: bool = False
    """log to Weights & Biases (mode from WANDB_MODE)"""
    wandb_project: str = "cleanrl-agents"
    """W&B project"""
    save_every: int = 10
    """checkpoint every this many updates (and at the end); 0 = only at the end"""
    eval_every: int = 10
    """greedy evaluation every this many updates and at the end; 0 = never"""
    eval_games: int = 20
    """games per evaluation split (valid_seen, valid_unseen)"""
    resume: str = ""
    """"" = new run, "auto" = newest checkpoint of the latest run named exp_name with this seed, or a checkpoint/run
    path; flags that change what the run is must equal its config.json"""
    eval_only: str = ""
    """evaluate a checkpoint (its dir, a run dir = its newest, or "auto") into a new run dir's metrics.jsonl, and exit;
    every flag left at its default takes the run's value"""
    threads: int = 0
    """torch CPU threads per process (0 = OMP_NUM_THREADS if set, else the cores / the processes on this machine)"""
    # ---- sampler (shared with tempo.py) ----
    sampler: Literal["generate", "vllm"] = "generate"
    """generate: model.generate() in the training process; vllm: a vLLM server you start (README: Sampling through vLLM)"""
    sampler_url: str = ""
    """with --sampler vllm: the server's OpenAI API root, e.g. http://localhost:8000/v1"""
    sampler_adapter_dir: str = ""
    """where the adapter is saved for the server to load after each update ("" = {output_dir}/sampler_adapters)"""
    sampler_concurrency: int = 64
    """completion requests in flight per process"""
    sampler_timeout_s: float = 600.0
    """one completion request's timeout (it is retried after that)"""
    sampler_deadline_s: float = 1800.0
    """one turn's burst of requests, retries included, must finish by then or the update fails"""
    recompute_logprobs: bool = True
    """with --sampler vllm: the loss's old logprobs come from a trainer forward pass, not from the server"""


# fork 3: the algorithm's signals (here) and its policy_loss (before ppo_update)
# =============================================================================================
# ADCA advantages (update steps 2, 4 and 5): AgentEvolver's decouple fusion of labels and outcomes, the plain GRPO
# baseline
# =============================================================================================
EPS = 1e-8


def groups_of(group_ids: Sequence[int]) -> list[list[int]]:
    """The indices of each group's members, groups in order of first appearance."""
    members = defaultdict(list)
    for i, group in enumerate(group_ids):
        members[group].append(i)
    return list(members.values())


def within_groups(orm_scores: Sequence[float], group_ids: Sequence[int], normalize) -> list[float]:
    """normalize(a group's scores) -> their advantages, for every group."""
    advantages = [0.0] * len(orm_scores)
    for idxs in groups_of(group_ids):
        for i, advantage in zip(idxs, normalize([float(orm_scores[i]) for i in idxs])):
            advantages[i] = advantage
    return advantages


def grpo_advantages(orm_scores: Sequence[float], group_ids: Sequence[int]) -> list[float]:
    """The plain GRPO baseline's outcome advantage, as veRL computes it for AgentEvolver's trainer:
    (score - group mean) / (unbiased group std + 1e-6); a group of one is left as it is (mean 0, std 1)."""

    def normalize(scores):
        mean, std = (math.fsum(scores) / len(scores), statistics.stdev(scores)) if len(scores) > 1 else (0.0, 1.0)
        return [(score - mean) / (std + 1e-6) for score in scores]

    return within_groups(orm_scores, group_ids, normalize)


def group_outcome_advantages(orm_scores: Sequence[float], group_ids: Sequence[int]) -> list[float]:
    """The decouple's outcome term: z-score of the outcome within its group, population std (only centred
    when the group's outcomes are all equal, so a uniform group gets exactly 0)."""

    def normalize(scores):
        mean = math.fsum(scores) / len(scores)
        std = math.sqrt(math.fsum((s - mean) ** 2 for s in scores) / len(scores))  # population std
        return [score - mean if std <= EPS else (score - mean) / (std + 1e-12) for score in scores]

    return within_groups(orm_scores, group_ids, normalize)


def _prm_zscores(
    step_flags: Sequence[Sequence[bool]], group_ids: Sequence[int], fix_base: float, equal_trajectory_weight: bool
) -> list[list[float]]:
    """+fix_base for GOOD, -fix_base for BAD, z-scored within each group over its steps."""
    raw = [[fix_base if flag else -fix_base for flag in flags] for flags in step_flags]
    z = [[] for _ in raw]
    for idxs in groups_of(group_ids):
        idxs = [i for i in idxs if raw[i]]
        if len({r for i in idxs for r in raw[i]}) == 1:
            for i in idxs:  # all labels equal: exactly 0 (the formula gives rounding noise / sqrt(eps))
                z[i] = [0.0] * len(raw[i])
            continue
        if equal_trajectory_weight:  # every trajectory weighs the same, however many steps it has
            mean = math.fsum(math.fsum(raw[i]) / len(raw[i]) for i in idxs) / len(idxs)
            var = math.fsum(math.fsum((r - mean) ** 2 for r in raw[i]) / len(raw[i]) for i in idxs) / len(idxs)
            sd = math.sqrt(var + EPS)
        else:  # every step weighs the same
            flat = [r for i in idxs for r in raw[i]]
            mean = math.fsum(flat) / len(flat)
            sd = max(math.sqrt(math.fsum((r - mean) ** 2 for r in flat) / len(flat)), EPS)
        for i in idxs:
            z[i] = [(r - mean) / (sd + 1e-12) for r in raw[i]]
    return z


def decouple_step_rewards(
    orm_scores: Sequence[float],
    step_flags: Sequence[Sequence[bool]],
    group_ids: Sequence[int],
    *,
    fix_base: float,
    alpha: float,
    orm_distribution: str,
    equal_trajectory_weight: bool,
    length_normalization: bool,
) -> list[list[float]]:
    """AgentEvolver's `decouple` scheme: PRM labels and ORM outcomes are z-scored separately within
    each group, then fused per step: alpha * z_prm + the outcome advantage (on the last step, on every
    step, or nowhere with only_prm), optionally scaled by 1/sqrt(steps). A trajectory without steps gets []."""
    check(
        (
            len(orm_scores) == len(step_flags) == len(group_ids),
            f"orm_scores, step_flags and group_ids differ in length: {len(orm_scores)}, {len(step_flags)}, "
            f"{len(group_ids)}",
        ),
        (orm_distribution in ORM_DISTRIBUTIONS, f"unknown orm_distribution {orm_distribution!r}: {ORM_DISTRIBUTIONS}"),
    )
    prm_z = _prm_zscores(step_flags, group_ids, fix_base, equal_trajectory_weight)
    rewards = []
    for z, adv in zip(prm_z, group_outcome_advantages(orm_scores, group_ids)):
        scale = 1.0 / math.sqrt(len(z)) if length_normalization and z else 1.0
        rewards.append(
            [(alpha * zj + adv * _outcome_on_step(orm_distribution, j, len(z))) * scale for j, zj in enumerate(z)]
        )
    return rewards


def _outcome_on_step(orm_distribution: str, step: int, num_steps: int) -> float:
    """1 where the decouple adds the outcome advantage to a step's reward, else 0."""
    return float(orm_distribution == "all_steps" or (orm_distribution == "last_step" and step == num_steps - 1))


def decouple_health_metrics(
    orm_scores: Sequence[float], step_flags: Sequence[Sequence[bool]], group_ids: Sequence[int], **decouple
) -> dict[str, float]:
    """AgentEvolver's decouple dashboard (decouple: decouple_step_rewards' keyword arguments): how large the
    attribution term is next to the outcome term and whether the labels agree with the outcomes. A trajectory is
    positive when its score is > 0."""
    fused = decouple_step_rewards(orm_scores, step_flags, group_ids, **decouple)
    prm_z = _prm_zscores(step_flags, group_ids, decouple["fix_base"], decouple["equal_trajectory_weight"])
    outcome_adv = group_outcome_advantages(orm_scores, group_ids)
    alpha, orm_distribution = decouple["alpha"], decouple["orm_distribution"]
    attr_values, out_values, shares, alpha_ratios, sign_agree = [], [], [], [], []
    good_majority_in_won, bad_majority_in_lost = [], []
    for i, z in enumerate(prm_z):
        if not z:
            continue
        attr_values += z
        out_values.append(outcome_adv[i])
        attr_abs = math.fsum(abs(alpha * zj) for zj in z)
        out_last = abs(outcome_adv[i]) * _outcome_on_step(orm_distribution, len(z) - 1, len(z))
        out_abs = out_last * (len(z) if orm_distribution == "all_steps" else 1)
        shares.append(out_last / (out_last + attr_abs + 1e-12))
        alpha_ratios.append(attr_abs / (out_abs + 1e-12))
        positive = float(orm_scores[i]) > 0
        sign_agree.append(float((math.fsum(fused[i]) > 0) == positive))
        num_good = sum(bool(f) for f in step_flags[i])
        if positive:
            good_majority_in_won.append(num_good > len(z) - num_good)
        else:
            bad_majority_in_lost.append(num_good <= len(z) - num_good)
    return {
        "prm/decouple/attr_mean": _mean(attr_values),
        "prm/decouple/attr_std": _std(attr_values),
        "prm/decouple/out_mean": _mean(out_values),
        "prm/decouple/out_std": _std(out_values),
        "prm/decouple/outcome_share_last_mean": _mean(shares),
        "prm/decouple/alpha_effective": _mean(alpha_ratios),
        "prm/decouple/sum_step_reward_sign_agree": _mean(sign_agree),
        "prm/decouple/pos_traj_prm_good_majority_rate": _mean(good_majority_in_won),
        "prm/decouple/neg_traj_prm_bad_majority_rate": _mean(bad_majority_in_lost),
    }


def _mean(values: Sequence[float]) -> float:
    """The mean; 0 for no values."""
    return math.fsum(values) / len(values) if values else 0.0


def _std(values: Sequence[float]) -> float:
    """The population standard deviation; 0 for no values."""
    mean = _mean(values)
    return math.sqrt(_mean([(v - mean) ** 2 for v in values]))


def suffix_sum(step_rewards: Sequence[Sequence[float]]) -> list[list[float]]:
    """Advantage of step j = sum of the step rewards from j to the end: [1, 2, 3] -> [6, 5, 3]."""
    return [list(itertools.accumulate(reversed(rewards)))[::-1] for rewards in step_rewards]


def step_advantages(
    orm_scores: Sequence[float], step_flags: Sequence[Sequence[bool]], group_ids: Sequence[int], decouple: dict | None
) -> list[list[float]]:
    """The advantage of every step. decouple=None: plain multi-turn GRPO, every step gets its episode's
    GRPO outcome advantage, whatever the decouple settings say. Otherwise: suffix sums of the decouple's step
    rewards (decouple_step_rewards' keyword arguments)."""
    if decouple is None:
        return [
            [advantage] * len(flags) for advantage, flags in zip(grpo_advantages(orm_scores, group_ids), step_flags)
        ]
    return suffix_sum(decouple_step_rewards(orm_scores, step_flags, group_ids, **decouple))


def alpha_at(update: int, args: Args) -> float:
    """Attribution weight for this update (0-based): constant, or cosine from --alpha down to --alpha-min over the
    --prm-steps labelled updates."""
    if not args.attribution:
        return 0.0
    if args.alpha_schedule == "constant":
        return args.alpha
    progress = min(update / max(1, args.prm_steps - 1), 1.0)
    return args.alpha_min + 0.5 * (args.alpha - args.alpha_min) * (1.0 + math.cos(math.pi * progress))


# =============================================================================================
# ADCA labels (update step 3): one request per trajectory, every step judged GOOD or BAD
# =============================================================================================
# Steps are numbered from 1 in the prompt ("Step 1" is the first step); parse_judgments maps them back to 0-based.
LABEL_SYSTEM_PROMPT = (
    "You judge the steps of an agent that played a household text game (ALFWorld). You receive the task with the "
    "game's first observation (the room and what it holds), the numbered steps (the agent's whole reply - its "
    "reasoning and the command it sent - then the game's answer) and the episode's outcome: +1 (positive) if the "
    "agent completed the task, -1 (negative) if it did not.\n"
    "- Judge every step on its own merit, by what it did and what the game answered. Do not give all steps the same "
    "label because of the outcome: a won episode can hold useless steps and a lost one useful steps.\n"
    "- GOOD: the step brought the task closer (going where a needed object or receptacle is, finding, taking, "
    "opening, cleaning, heating, cooling or placing the right object) or repaired an earlier mistake.\n"
    "- BAD: the step was useless, repeated, invalid, not admissible or harmful. A step whose result is never used "
    "later is BAD. Completing the task with the wrong object or in the wrong place is BAD.\n"
    "Reply in the required format and nothing else."
)


JUDGMENT_PATTERN = re.compile(r"\bstep\s+(\d{1,6})\s*judg(?:e)?ment\s*:\s*(good|bad)\b", re.IGNORECASE)


def parse_judgments(text: str, num_steps: int) -> list[bool] | None:
    """GOOD/BAD flags (True = GOOD) for steps 0..num_steps-1 from `Step i Judgment: GOOD|BAD` lines,
    where i counts from 1 as in the prompt. Case-insensitive, markdown emphasis ignored, the last
    judgment of a step wins, numbers outside 1..num_steps are ignored. None unless every step has
    a judgment (or the input is not text). Never raises."""
    if not isinstance(text, str) or not isinstance(num_steps, int) or num_steps < 0:
        return None
    judgments = {}
    for match in JUDGMENT_PATTERN.finditer(text.replace("*", "")):
        step = int(match.group(1)) - 1
        if 0 <= step < num_steps:
            judgments[step] = match.group(2).upper() == "GOOD"
    return [judgments[j] for j in range(num_steps)] if len(judgments) == num_steps else None


def _trim(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " ...[cut]"


def describe_steps(traj: common.Trajectory) -> list[tuple[str, str]]:
    """(the agent's whole reply, the game's answer) per step, as the labeller sees them."""

    def answer(step: common.StepRecord) -> str:
        if not step.valid:
            return "Invalid format: no action was sent, the game did not advance."
        return step.observation if step.admissible else f"Not an admissible action. {step.observation}"

    return [(step.text.strip(), answer(step)) for step in traj.steps]


def outcome_score(orm_score: float) -> float:
    """The outcome as the labeller is told it (as AgentEvolver sends it): the 0/1 score rescaled to [-1, 1]."""
    return 2.0 * orm_score - 1.0


def build_label_messages(
    first_observation: str, steps: Sequence[tuple[str, str]], outcome: float, max_step_chars: int
) -> list[dict]:
    """The single chat request that asks for a judgment of every step of one trajectory."""
    polarity = "positive" if outcome > 0 else "negative"
    lines = [f"TASK AND FIRST OBSERVATION:\n{_trim(first_observation.strip(), max_step_chars)}", ""]
    lines.append(f"STEPS ({len(steps)} in total):")
    for j, (reply, answer) in enumerate(steps, start=1):
        lines += [f"Step {j}", f"Agent: {_trim(reply, max_step_chars)}", f"Game: {_trim(answer, max_step_chars)}", ""]
    lines += [
        f"OUTCOME: {outcome:+.4f} ({polarity})",
        "",
        f"Judge every step from 1 to {len(steps)}. Answer in exactly this format, nothing else:",
        "Step 1 Analysis: <one or two sentences>",
        "Step 1 Judgment: GOOD or BAD",
        "Step 2 Analysis: <one or two sentences>",
        "Step 2 Judgment: GOOD or BAD",
        "...",
    ]
    return [{"role": "system", "content": LABEL_SYSTEM_PROMPT}, {"role": "user", "content": "\n".join(lines)}]


@dataclass
class LabelRequest:
    trajectory_id: str
    messages: list[dict]
    num_steps: int


@dataclass
class LabelReply:
    text: str | None  # None: no reply (errors, refusals, deadline)
    error: str | None
    latency_s: float
    attempts: int


class ContentRefusal(Exception):
    """The endpoint refused the request on content grounds (moderation)."""


def labeler_api_key(args: Args) -> str:
    """The key from the environment variable named by --labeler-api-key-env (never from a flag, never logged)."""
    key = os.environ.get(args.labeler_api_key_env)
    if not key:
        raise ValueError(
            f"--labeler-api-key-env names {args.labeler_api_key_env}, which is not set; export the labeller's "
            "key there (any value, e.g. EMPTY, for a local server without auth)"
        )
    return key


class ApiLabeler:
    """Any OpenAI-compatible chat-completions endpoint, through the official async client, with this
    script's retry policy (the client's own retries are off): 429s back off exponentially with
    jitter, other errors linearly, refusals and permanent 4xx answers are not retried, nothing outlives the
    deadline, and a run of connection failures opens a circuit that ends the update's labelling at once."""

    def __init__(self, args: Args, concurrency: int | None = None):
        self.args, self.api_key = args, labeler_api_key(args)
        self.model_name = args.labeler_model
        self.concurrency = concurrency or args.labeler_concurrency  # this process's share of the bound
        self.circuit_opened = False  # in the last call

    def client(self, kind=openai.AsyncOpenAI):
        """The endpoint's client (async for labelling, openai.OpenAI for the start-up check); its retries are ours."""
        args = self.args
        return kind(base_url=args.labeler_base_url, api_key=self.api_key, max_retries=0, timeout=args.labeler_timeout_s)

    def check_endpoint(self) -> None:
        """At start, before the model loads: the endpoint answers, serves --labeler-model (when it lists its
        models) and one tiny request works. Raises one clear ValueError otherwise."""
        model, url = self.args.labeler_model, self.args.labeler_base_url
        with self.client(openai.OpenAI) as client:
            try:
                served = [served_model.id for served_model in client.models.list().data]
            except openai.APIConnectionError as error:
                raise ValueError(f"--labeler-base-url {url}: cannot reach the labeller ({error})") from error
            except openai.NotFoundError:
                served = None  # no /models route: the request below decides
            except openai.APIStatusError as error:
                raise ValueError(f"--labeler-base-url {url}: /models answered {error.status_code} ({error})") from error
            if served is not None and model not in served:
                raise ValueError(f"--labeler-model {model} is not served by {url} (it serves {served})")
            try:
                test = [{"role": "user", "content": "Reply with OK."}]
                client.chat.completions.create(model=model, messages=test, temperature=0.0, max_tokens=1)
            except Exception as error:  # noqa: BLE001 - any failure here means the labeller cannot work
                raise ValueError(
                    f"--labeler-base-url {url}: a one-token test request to --labeler-model {model} "
                    f"failed ({type(error).__name__}: {error})"
                ) from error

    def __call__(self, requests: Sequence[LabelRequest]) -> list[LabelReply]:
        self.circuit_opened = False
        return asyncio.run(self._label_all(requests)) if requests else []

    async def _label_all(self, requests: Sequence[LabelRequest]) -> list[LabelReply]:
        args = self.args
        deadline = asyncio.get_running_loop().time() + args.labeler_deadline_s
        semaphore, circuit = asyncio.Semaphore(self.concurrency), CircuitBreaker(args.labeler_circuit_failures)
        async with self.client() as client:
            replies = await asyncio.gather(
                *(self._label_one(client, r, semaphore, deadline, circuit) for r in requests)
            )
        self.circuit_opened = circuit.open.is_set()
        if self.circuit_opened:
            print(
                f"\n[labeller] WARNING: {args.labeler_circuit_failures} connection failures in a row to "
                f"{args.labeler_base_url}: circuit open, {sum(r.text is None for r in replies)} of {len(replies)} "
                "trajectories of this update get fallback labels; the next update tries again\n",
                file=sys.stderr,
            )
        return list(replies)

    async def _label_one(
        self, client, request: LabelRequest, semaphore: asyncio.Semaphore, deadline: float, circuit: CircuitBreaker
    ) -> LabelReply:
        args, loop = self.args, asyncio.get_running_loop()
        start, error, attempts = loop.time(), None, 0
        try:
            async with asyncio.timeout_at(deadline):  # the update's deadline ends waits and requests alike
                while attempts < args.labeler_max_attempts and not circuit.open.is_set():
                    attempts += 1
                    try:
                        text = await self._complete(client, request.messages, semaphore, circuit)
                        return LabelReply(text, None, loop.time() - start, attempts)
                    except CircuitOpen:
                        attempts -= 1  # never sent
                    except Exception as exc:  # noqa: BLE001 - every failure is counted, none may crash training
                        error = f"{type(exc).__name__}: {exc}"
                        permanent = isinstance(exc, ContentRefusal) or (
                            isinstance(exc, openai.APIStatusError) and exc.status_code in PERMANENT_HTTP_ERRORS
                        )
                        if permanent or attempts == args.labeler_max_attempts:
                            break
                        with contextlib.suppress(TimeoutError):  # an opening circuit ends the wait at once
                            await asyncio.wait_for(circuit.open.wait(), timeout=self.backoff_s(exc, attempts))
        except TimeoutError:  # the update's deadline, not the per-request timeout (that is openai.APITimeoutError)
            error = f"update deadline ({args.labeler_deadline_s} s) passed; last error: {error}"
        if circuit.open.is_set():
            error = f"circuit open ({args.labeler_circuit_failures} connection failures in a row); last error: {error}"
        return LabelReply(None, error, loop.time() - start, attempts)

    def backoff_s(self, error: Exception, attempts: int) -> float:
        """The wait before the next attempt: after a 429 exponential with 0-25% jitter, after another error linear."""
        args, message = self.args, str(error).lower()
        if isinstance(error, openai.RateLimitError) or "rate limit" in message or "429" in message:
            wait = min(args.labeler_rate_limit_backoff_s * 1.5 ** (attempts - 1), args.labeler_rate_limit_backoff_cap_s)
            return wait * (1.0 + 0.25 * random.random())
        return min(args.labeler_error_backoff_s * attempts, args.labeler_error_backoff_cap_s)

    async def _complete(
        self, client: openai.AsyncOpenAI, messages: list[dict], semaphore: asyncio.Semaphore, circuit: CircuitBreaker
    ) -> str:
        args = self.args
        async with semaphore:  # held only while a request is in flight, never while backing off
            if circuit.open.is_set():  # it opened while this request waited for its turn
                raise CircuitOpen
            try:  # counted before the next request may start
                response = await client.chat.completions.create(
                    model=args.labeler_model, messages=messages, temperature=0.0, max_tokens=args.labeler_max_new_tokens
                )
            except Exception as exc:
                circuit.record(
                    isinstance(exc, openai.APIConnectionError) and not isinstance(exc, openai.APITimeoutError)
                )
                raise
            circuit.record(connection_failed=False)
        if not response.choices:
            raise ValueError("reply without choices")
        choice = response.choices[0]
        if choice.finish_reason == "content_filter":
            raise ContentRefusal("finish_reason content_filter")
        return choice.message.content or ""


class CircuitOpen(Exception):
    """The update's labelling stopped: too many connection failures in a row."""


class CircuitBreaker:
    """Counts connection failures in a row (any other outcome resets the count); `open` is set at the threshold."""

    def __init__(self, threshold: int):
        self.threshold, self.failures, self.open = threshold, 0, asyncio.Event()

    def record(self, connection_failed: bool) -> None:
        self.failures = self.failures + 1 if connection_failed else 0
        if self.failures >= self.threshold:
            self.open.set()


class PolicyLabeler:
    """The policy model itself labels, greedily, in-process (no key needed). The labels are context
    for the advantages only: their tokens never enter a training batch."""

    def __init__(self, generate_greedy: common.SampleFn, tokenizer, args: Args):
        self.generate_greedy, self.tokenizer, self.args = generate_greedy, tokenizer, args
        self.model_name = f"self:{args.model}"

    def __call__(self, requests: Sequence[LabelRequest]) -> list[LabelReply]:
        if not requests:
            return []
        start = time.perf_counter()
        prompts = [
            self.tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            for r in requests
        ]
        completions = self.generate_greedy(prompts, self.args.labeler_max_new_tokens)
        latency = (time.perf_counter() - start) / len(requests)
        return [LabelReply(c.text, None, latency, 1) for c in completions]


def skips_labelling(args: Args, outcome_advantage: float, orm_score: float) -> bool:
    """--skip-type: a trajectory whose group outcome advantage is ~0 (skip_small_adv) or that lost (skip_all_neg) is
    not sent to the labeller."""
    small, lost = abs(outcome_advantage) < 1e-8, orm_score <= 0
    return (args.skip_type == "skip_small_adv" and small) or (args.skip_type == "skip_all_neg" and lost)


def label_trajectories(
    trajectories: Sequence[common.Trajectory],
    outcome_advantages: Sequence[float],
    orm_scores: Sequence[float],
    labeler: Callable[[Sequence[LabelRequest]], list[LabelReply]],
    args: Args,
    update: int,
    rank: int = 0,
    log_file: Path | None = None,
) -> tuple[list[list[bool]], dict[str, float]]:
    """GOOD/BAD flags for every step of every trajectory, and the prm/* metrics.

    A trajectory skipped by --skip-type (its group outcome advantage is ~0, or it lost), or whose request failed
    or whose reply did not parse, gets uniform flags: all GOOD if it won, else all BAD."""
    requests, asked = [], []
    for i, (traj, advantage, orm) in enumerate(zip(trajectories, outcome_advantages, orm_scores)):
        if traj.steps and not skips_labelling(args, advantage, orm):
            steps, outcome = describe_steps(traj), outcome_score(orm)
            messages = build_label_messages(traj.start.observation, steps, outcome, args.labeler_max_step_chars)
            requests.append(LabelRequest(f"u{update}-r{rank}-g{traj.group}-b{traj.branch}", messages, len(steps)))
            asked.append(i)
    replies = labeler(requests)
    parsed = [parse_judgments(reply.text, request.num_steps) for request, reply in zip(requests, replies)]
    flags = [[orm > 0] * len(traj.steps) for traj, orm in zip(trajectories, orm_scores)]  # the uniform fallback
    for i, labels in zip(asked, parsed):
        flags[i] = labels if labels is not None else flags[i]
    if log_file is not None:
        with open(log_file, "a") as f:
            for request, reply, labels in zip(requests, replies, parsed):
                record = {
                    "update": update,
                    "trajectory_id": request.trajectory_id,
                    "messages": request.messages,
                    "reply": reply.text,
                    "flags": labels,
                    "latency_s": round(reply.latency_s, 4),
                    "attempts": reply.attempts,
                    "model": labeler.model_name,
                    "error": reply.error,
                }
                f.write(json.dumps(record) + "\n")
    judged = [(orm_scores[i] > 0, labels) for i, labels in zip(asked, parsed) if labels is not None]
    failures, latencies = sum(reply.text is None for reply in replies), sorted(reply.latency_s for reply in replies)
    metrics = {
        "prm/label_requests": Count(len(requests)),
        "prm/label_failures": Count(failures),
        "prm/parse_failures": Count(sum(labels is None for labels in parsed) - failures),
        "prm/skipped": Count(sum(bool(traj.steps) for traj in trajectories) - len(requests)),
        "prm/good_rate": _mean([flag for _, labels in judged for flag in labels]),
        "prm/pos_traj_good_rate": _mean([flag for won, labels in judged if won for flag in labels]),
        "prm/neg_traj_bad_rate": _mean([not flag for won, labels in judged if not won for flag in labels]),
        "prm/circuit_open": float(getattr(labeler, "circuit_opened", False)),
        "prm/latency_p50": _percentile(latencies, 0.50),
        "prm/latency_p95": _percentile(latencies, 0.95),
    }
    return flags, metrics


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    return float(sorted_values[round(q * (len(sorted_values) - 1))]) if sorted_values else 0.0


def oracle_labeler(
    trajectories: Sequence[common.Trajectory],
    outcome_advantages: Sequence[float],
    orm_scores: Sequence[float],
    args: Args,
) -> tuple[list[list[bool]], dict[str, float]]:
    """--labeler-backend oracle: label_trajectories' contract (flags, prm/* metrics; --skip-type honoured) with
    common.oracle_step_flags (privileged planner judgments) instead of an LLM. No requests can fail."""
    asked = [
        bool(traj.steps) and not skips_labelling(args, advantage, orm)
        for traj, advantage, orm in zip(trajectories, outcome_advantages, orm_scores)
    ]
    flags = [  # a skipped trajectory: all GOOD if it won, else all BAD (as label_trajectories does)
        common.oracle_step_flags(traj) if ask else [orm > 0] * len(traj.steps)
        for traj, orm, ask in zip(trajectories, orm_scores, asked)
    ]
    metrics = {
        "prm/label_requests": Count(sum(asked)),
        "prm/label_failures": Count(0),
        "prm/parse_failures": Count(0),
        "prm/skipped": Count(sum(bool(traj.steps) for traj in trajectories) - sum(asked)),
        "prm/good_rate": _mean([flag for labels, ask in zip(flags, asked) if ask for flag in labels]),
    }
    return flags, metrics


# =============================================================================================
# One ADCA-GRPO update
# =============================================================================================
def validate_args(args: Args) -> None:
    validate_model_args(args)  # the shared flags, and every Literal flag's choices
    check_bounds(args, ">= 1", "num_updates", "games_per_update", "max_turns", "max_turn_tokens", "ppo_epochs")
    check_bounds(args, ">= 1", "mini_batches", "labeler_concurrency", "labeler_max_attempts", "labeler_max_new_tokens")
    check_bounds(args, ">= 1", "labeler_circuit_failures", "labeler_max_step_chars")
    check_bounds(args, "> 0", "clip_eps_high", "fix_base", "labeler_timeout_s", "labeler_deadline_s")
    check_bounds(args, ">= 0", "kl_beta", "kl_loss_coef", "alpha", "prm_steps", "labeler_error_backoff_s")
    check_bounds(args, ">= 0", "labeler_error_backoff_cap_s", "labeler_rate_limit_backoff_s")
    check_bounds(args, ">= 0", "labeler_rate_limit_backoff_cap_s")
    check(
        (
            args.trajectories_per_game >= 2,
            f"--trajectories-per-game must be >= 2 (GRPO compares within a group), got {args.trajectories_per_game}",
        ),
        (
            args.max_trajectory_tokens > args.max_turn_tokens,
            f"--max-trajectory-tokens ({args.max_trajectory_tokens}) must exceed --max-turn-tokens ({args.max_turn_tokens})",
        ),
        (0 < args.clip_eps < 1, f"--clip-eps must lie in (0, 1), got {args.clip_eps}"),
        (
            args.dual_clip_c is None or args.dual_clip_c > 1,
            f"--dual-clip-c must be > 1 (the loss cap is c * |A|), got {args.dual_clip_c}",
        ),
        (
            0 <= args.alpha_min <= args.alpha or args.alpha_schedule == "constant",
            f"--alpha-min must lie in [0, --alpha] for the cosine schedule, got {args.alpha_min}",
        ),
        (
            args.labeler_backend != "api" or bool(args.labeler_base_url),
            "--labeler-backend api needs --labeler-base-url",
        ),
        (
            not args.labeler_base_url or args.labeler_base_url.startswith(("http://", "https://")),
            f"--labeler-base-url must start with http:// or https://, got {args.labeler_base_url!r}",
        ),
        (bool(args.labeler_model), "--labeler-model must not be empty"),
        (bool(args.labeler_api_key_env), "--labeler-api-key-env must name an environment variable"),
    )
    if needs_labels(args) and labeler_backend(args) == "api":
        labeler_api_key(args)


def needs_labels(args: Args) -> bool:
    return args.attribution and args.alpha > 0 and args.prm_steps > 0 and not args.eval_only


def labelling_at(update: int, args: Args) -> bool:
    """Whether update `update` (1-based) asks for labels: attribution on, alpha > 0 now, within --prm-steps."""
    return needs_labels(args) and alpha_at(update - 1, args) > 0 and update <= args.prm_steps


def decouple_settings(args: Args, update: int) -> dict:
    """decouple_step_rewards' keyword arguments for update `update` (1-based): the decouple flags, and alpha now."""
    flags = ("fix_base", "orm_distribution", "equal_trajectory_weight", "length_normalization")
    return {flag: getattr(args, flag) for flag in flags} | {"alpha": alpha_at(update - 1, args)}


def trained_decouple(args: Args, update: int) -> dict | None:
    """The decouple settings that shape update `update`'s advantages, or None: plain multi-turn GRPO (no labels in
    this update, or --prm-metrics-only), whatever the decouple flags say."""
    return decouple_settings(args, update) if labelling_at(update, args) and not args.prm_metrics_only else None


def labeler_backend(args: Args) -> str:
    """--labeler-backend auto: the api when an endpoint is configured, else the policy itself."""
    if args.labeler_backend != "auto":
        return args.labeler_backend
    return "api" if args.labeler_base_url else "self"


# fork 4: what an update needs (built by make_runtime); per-process state a checkpoint keeps goes into
# state_dict / load_state_dict
@dataclass
class Runtime:
    args: Args
    accelerator: object
    tokenizer: object
    model: object
    optimizer: object
    protocol: common.ChatProtocol
    sample_fn: common.SampleFn
    greedy_fn: common.SampleFn
    labeler: Callable[[Sequence[LabelRequest]], list[LabelReply]] | None  # None: no labels (plain GRPO)
    label_log: Path | None
    data_root: str
    games: list[str]  # this process's shard of the training games, shuffled with the seed
    game_cursor: int = 0
    on_turn: Callable[[int, int], None] | None = None  # rollout progress (the logger's turn bar)
    bad_games: int = 0  # games skipped since the last metrics row (rollout/bad_games_skipped)

    def fresh_state(self) -> common.SavedState:
        return next_fresh_state(self)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this process."""
        return {"game_cursor": self.game_cursor}

    def load_state_dict(self, state: dict) -> None:
        self.game_cursor = state["game_cursor"]


def make_runtime(args: Args, accelerator) -> Runtime:
    """Labeller (an api one checks its key and its endpoint, and gets this process's share of --labeler-concurrency),
    this process's training games, then the model, samplers and label log."""
    rank, processes = accelerator.process_index, accelerator.num_processes
    backend = labeler_backend(args) if needs_labels(args) else None
    labeler = label_log = None
    if backend == "api":
        check(
            (
                args.labeler_concurrency >= processes,
                f"--labeler-concurrency ({args.labeler_concurrency}) must be >= the number of processes "
                f"({processes}): it bounds all of them together",
            )
        )
        share = args.labeler_concurrency // processes + (rank < args.labeler_concurrency % processes)
        labeler = ApiLabeler(args, share)
        labeler.check_endpoint()
    if args.labeler_log_dir:
        label_log = require_writable_dir(args.labeler_log_dir, "--labeler-log-dir") / f"labels_rank{rank}.jsonl"
    parts = runtime_parts(args, accelerator)
    if backend in ("self", "oracle"):
        labeler = oracle_labeler if backend == "oracle" else PolicyLabeler(parts["greedy_fn"], parts["tokenizer"], args)
    return Runtime(**parts, labeler=labeler, label_log=label_log)


def group_metrics(groups: Sequence[Sequence[common.Trajectory]]) -> dict:
    """Groups whose episodes all won or all lost (nothing to compare within them), and games that did not restore."""
    outcomes = [{traj.won for traj in group} for group in groups if group]
    return {
        "rollout/groups_all_won": Count(sum(o == {True} for o in outcomes)),
        "rollout/groups_all_lost": Count(sum(o == {False} for o in outcomes)),
        "rollout/restore_failures": Count(sum(not group for group in groups)),
    }


def policy_logprobs(rt: Runtime, datums: Sequence[Datum]) -> list[list[float]]:
    """The current policy's per-token logprobs of the datums (no gradient)."""
    args, tokens = rt.args, [d.tokens for d in datums]
    return sequence_logprobs(
        rt.model, rt.accelerator, tokens, args.temperature, rt.tokenizer.pad_token_id, args.micro_batch_tokens
    )


def policy_loss(
    logprobs: torch.Tensor,
    batch: dict[str, torch.Tensor],
    total_tokens: float,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    kl_loss_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """train_step's loss: PPO-clip per generated token, token mean over the whole update (veRL's token-mean).

    ratio = exp(logp - old_logp), loss = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high)) (clip-higher when
    eps_high > eps); dual clip caps the loss of a token with A < 0 at -A * c, so a huge ratio on a bad token cannot
    dominate; the KL term is k3 = exp(ref - logp) - (ref - logp) - 1 (clamped to [-10, 10] as veRL's low_var_kl)."""
    mask, advantages = batch["mask"], batch["advantages"]
    ratio = torch.exp(logprobs - batch["old_logprobs"])
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    stats = {"clip_frac": ((clipped > unclipped).float() * mask).sum().item()}
    if dual_clip_c is not None:
        capped = torch.minimum(per_token, -advantages * dual_clip_c)
        dual_clipped = (advantages < 0) & (capped < per_token)
        per_token = torch.where(advantages < 0, capped, per_token)
        stats["dual_clip_frac"] = (dual_clipped.float() * mask).sum().item()
    if kl_loss_coef > 0:
        log_ratio = batch["ref_logprobs"] - logprobs
        kl = (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)
        per_token = per_token + kl_loss_coef * kl
        stats["kl_k3"] = (kl.detach() * mask).sum().item()
    return (per_token * mask).sum() / total_tokens, stats


def ppo_update(rt: Runtime, datums: list[Datum]) -> dict:
    """--ppo-epochs passes over the datums, each split at random into --mini-batches optimizer steps (with more than
    one, adca_update has made the old logprobs the policy's own before the first). Returns train_step's metrics
    averaged over the steps (tokens: per pass)."""
    args = rt.args
    steps = args.ppo_epochs * args.mini_batches
    loss_fn = functools.partial(
        policy_loss,
        clip_eps=args.clip_eps,
        clip_eps_high=args.clip_eps_high,
        dual_clip_c=args.dual_clip_c,
        kl_loss_coef=args.kl_loss_coef,
    )
    per_step = []
    for _ in range(args.ppo_epochs):
        order = random.sample(range(len(datums)), len(datums)) if args.mini_batches > 1 else range(len(datums))
        for part in range(args.mini_batches):
            per_step.append(train_step(rt, [datums[i] for i in order[part :: args.mini_batches]], loss_fn))
    merged = {key: math.fsum(m.get(key, 0.0) for m in per_step) / steps for key in per_step[0]}
    merged["train/tokens"] = math.fsum(m["train/tokens"] for m in per_step) / args.ppo_epochs
    merged["train/nonfinite_skipped"] = math.fsum(m["train/nonfinite_skipped"] for m in per_step)
    merged["train/optimizer_steps"] = float(steps)
    return merged


# fork 5: one update -> (metrics, samples); a metric that counts something is a Count (summed over processes)
def adca_update(rt: Runtime, update: int) -> tuple[dict, list[dict]]:
    args, t0 = rt.args, time.time()
    # ---- step 1: roll out G games x N full episodes
    starts = [rt.fresh_state() for _ in range(args.games_per_update)]
    groups = play(rt, starts, args.trajectories_per_game, horizon=args.max_turns, max_episode_steps=args.max_turns)
    trajectories = [traj for group in groups for traj in group]
    group_ids = [traj.group for traj in trajectories]
    t_rollout = time.time()

    # ---- step 2: outcome: ORM score 1 if won else 0, and its advantage within the group (the decouple's z-score;
    # ~0 marks a group skip_small_adv skips)
    orm_scores = [1.0 if traj.won else 0.0 for traj in trajectories]
    outcome_advantages = group_outcome_advantages(orm_scores, group_ids)

    # ---- step 3: label the steps good/bad (only while attribution is on, alpha > 0 and update <= --prm-steps)
    labelling = labelling_at(update, args)
    step_flags, metrics = label_steps(rt, update, labelling, trajectories, outcome_advantages, orm_scores)
    t_label = time.time()

    # ---- steps 4-5: decouple the outcome and the labels into step rewards, suffix sums over the steps
    # (--prm-metrics-only: only logged); without labels, plain multi-turn GRPO
    if labelling:
        metrics |= decouple_health_metrics(orm_scores, step_flags, group_ids, **decouple_settings(args, update))
    advantages_per_step = step_advantages(orm_scores, step_flags, group_ids, trained_decouple(args, update))

    # ---- step 6: broadcast each step's advantage to the tokens generated at that step
    datums = trajectory_datums(trajectories, advantages_per_step)
    metrics |= refresh_old_logprobs(rt, datums, always=args.ppo_epochs * args.mini_batches > 1)
    if (args.kl_beta > 0 or args.kl_loss_coef > 0) and datums:
        metrics |= add_reference_kl(rt, datums)

    # ---- step 7: PPO-clip, --ppo-epochs passes of --mini-batches optimizer steps each
    metrics |= ppo_update(rt, datums)
    t_update = time.time()

    metrics |= rollout_metrics(trajectories) | group_metrics(groups)
    metrics["train/step_advantage_abs_mean"] = _mean([abs(a) for row in advantages_per_step for a in row])
    metrics |= {"time/rollout": t_rollout - t0, "time/label": t_label - t_rollout, "time/update": t_update - t_label}
    return metrics, update_samples(trajectories[:2], outcome_advantages, step_flags, advantages_per_step)


def update_samples(trajectories, outcome_advantages, step_flags, advantages_per_step) -> list[dict]:
    """The given trajectories, readable, with their labels and advantages, for samples.jsonl."""
    return [
        {
            "game": traj.start.game_file,
            "task": traj.start.task,
            "won": traj.won,
            "stop_reason": traj.stop_reason,
            "outcome_advantage": outcome_advantages[i],
            "step_flags": step_flags[i],
            "step_advantages": advantages_per_step[i],  # as trained
            "messages": traj.messages[len(traj.start.messages) :],
        }
        for i, traj in enumerate(trajectories)
    ]


def label_steps(rt: Runtime, update: int, labelling: bool, trajectories, outcome_advantages, orm_scores):
    """(step flags per trajectory, prm/ metrics) from the labeller; without labelling, uniform flags as for a
    skipped trajectory (plain GRPO does not read them)."""
    args = rt.args
    metrics = {"prm/alpha": alpha_at(update - 1, args) if labelling else 0.0, "prm/labelling": float(labelling)}
    if not labelling:
        return [[score > 0] * len(traj.steps) for traj, score in zip(trajectories, orm_scores)], metrics
    if rt.labeler is oracle_labeler:
        step_flags, label_metrics = oracle_labeler(trajectories, outcome_advantages, orm_scores, args)
    else:
        rank = rt.accelerator.process_index
        step_flags, label_metrics = label_trajectories(
            trajectories, outcome_advantages, orm_scores, rt.labeler, args, update, rank, rt.label_log
        )
    return step_flags, metrics | label_metrics


def add_reference_kl(rt: Runtime, datums: list[Datum]) -> dict:
    """The base model's logprobs on the datums: kept for the loss's KL term (--kl-loss-coef), and the KL as per-token
    shaping of the advantage (--kl-beta: E[grad log p * (log p - log p_ref)] is its gradient). Returns train/kl."""
    args = rt.args
    policy = rt.accelerator.unwrap_model(rt.model)
    with policy.disable_adapter():
        reference = policy_logprobs(rt, datums)
    log_ratios = []
    for datum, ref in zip(datums, reference):
        datum.ref_logprobs = ref if args.kl_loss_coef > 0 else None
        for t, trained in enumerate(datum.mask):
            if trained:
                log_ratios.append(datum.old_logprobs[t] - ref[t])
                datum.advantages[t] -= args.kl_beta * log_ratios[-1]
    return {"train/kl": _mean(log_ratios)}


# =============================================================================================
# Main: the updates (train(), in the plumbing below, runs the job around them)
# =============================================================================================
# fork 6: main: the number of updates, RESUME_MAY_CHANGE, POSTFIX_KEYS
# Flags that only extend a run, or change how the labeller is reached rather than who labels.
RESUME_MAY_CHANGE = tuple(
    "num_updates labeler_base_url labeler_api_key_env labeler_concurrency labeler_timeout_s labeler_deadline_s "
    "labeler_max_attempts labeler_circuit_failures labeler_rate_limit_backoff_s labeler_rate_limit_backoff_cap_s "
    "labeler_error_backoff_s labeler_error_backoff_cap_s labeler_log_dir".split()
)
POSTFIX_KEYS = ("rollout/success_rate", "prm/good_rate", "prm/label_failures", "train/loss")


def main(args: Args) -> Path:
    """Train (or evaluate, with --eval-only); returns the run directory."""
    with training_job(args, ALGORITHM, validate_args, RESUME_MAY_CHANGE) as (args, accelerator, checkpoint, state):
        with starting():  # labeller and sampler endpoint checks
            rt = make_runtime(args, accelerator)
        if checkpoint is not None and rt.label_log is not None:
            drop_rows_after(rt.label_log, state["update"])  # a resumed update labels again
        labeler = labeler_backend(args) if rt.labeler is not None else "none"

        def one_update(rt: Runtime, update: int) -> tuple[dict, list[dict], dict]:
            return *adca_update(rt, update), {"labeler": labeler}

        return train(rt, ALGORITHM, checkpoint, state, args.num_updates, one_update, args.max_turns, POSTFIX_KEYS)


# ===== model side: identical in tempo.py and adca_grpo.py =====
# The plumbing of a training job, byte-identical in both scripts (tests/test_layout.py): first the job that main()
# runs (training_job, train), then start-up checks, loading, sampling, teacher-forced logprobs, the micro-batched
# optimizer step, run logging, checkpoints and evaluation. Reads only the shared Args fields; everything
# algorithm-specific is passed in.
@contextlib.contextmanager
def training_job(args, algorithm: str, validate_args, resume_may_change: Sequence[str] = ()):
    """The accelerator, start-up checks (start) and seeds around a run; yields (args as the run uses them,
    accelerator, checkpoint to resume or evaluate or None, its trainer state or None)."""
    accelerator = make_accelerator()
    try:
        args, checkpoint, trainer_state = start(args, algorithm, accelerator, validate_args, resume_may_change)
        seed_everything(args.seed + accelerator.process_index)
        yield args, accelerator, checkpoint, trainer_state
    finally:
        close_distributed()


def next_fresh_state(rt) -> common.SavedState:
    """The next of rt.games from its start (games cycle in their shuffled order). A game that passed the start-up
    parse but does not load is skipped, named on stderr and counted (rt.bad_games): a bad game never ends the run."""
    for _ in rt.games:
        game = rt.games[rt.game_cursor % len(rt.games)]
        rt.game_cursor += 1
        if (state := start_or_skip(game, rt.protocol, "games", seed=rt.game_cursor)) is not None:
            return state
        rt.bad_games += 1
    raise RuntimeError(f"none of this process's {len(rt.games)} training games loads")


def start_or_skip(game: str, protocol, stage: str, seed: int = 0) -> common.SavedState | None:
    """The game's start state; None, with a warning naming it, for a game that passed the start-up parse but does
    not load (a broken grammar: grammars are parsed at first use)."""
    try:
        return common.fresh_state(game, protocol, seed=seed)
    except common.BadGameError as error:
        print(f"[{stage}] WARNING: skipped a game that does not load: {error}", file=sys.stderr)
        return None


def train(rt, algorithm: str, checkpoint, trainer_state, total_updates: int, one_update, eval_steps: int, postfix_keys):
    """The job around an algorithm's updates: --eval-only, or resume (rt.load_state_dict, then model, optimizer
    and RNGs), then per update: one_update(rt, update) -> (metrics, samples, tags), metrics reduced over the
    processes, evaluation every --eval-every, a metrics row (with the tags) and a checkpoint (tags and every
    process's rt.state_dict()). Returns the run directory."""
    args, accelerator = rt.args, rt.accelerator
    if args.eval_only:  # the checkpoint's adapter, one evaluation: one metrics row (update = the checkpoint's)
        load_checkpoint(checkpoint, rt.model, None, accelerator)
        run_dir = new_run_dir(args)
        logger = RunLogger(args, run_dir, accelerator, 1, 0)
        rt.on_turn = logger.on_turn
        metrics = evaluate(rt, eval_steps)
        logger.log(trainer_state["update"], {"checkpoint": str(checkpoint), **metrics})
        logger.close()
        if accelerator.is_main_process:
            print(json.dumps(metrics, indent=2))
        return run_dir

    done = trainer_state["update"] if checkpoint is not None else 0
    run_dir = checkpoint.parent.parent if checkpoint is not None else new_run_dir(args)
    logger = RunLogger(args, run_dir, accelerator, total_updates, done, postfix_keys)
    rt.on_turn = logger.on_turn
    if checkpoint is not None:
        rt.load_state_dict(trainer_state["rank_states"][accelerator.process_index])
        load_checkpoint(checkpoint, rt.model, rt.optimizer, accelerator)  # last: the RNG states as they were saved
        if accelerator.is_main_process:
            print(f"resumed {checkpoint} (update {done} of {total_updates})", file=sys.stderr)

    for update in range(done + 1, total_updates + 1):
        metrics, samples, tags = one_update(rt, update)
        metrics["rollout/bad_games_skipped"], rt.bad_games = Count(rt.bad_games), 0
        metrics = reduce_metrics(accelerator, metrics)
        last = update == total_updates
        if args.eval_every and args.eval_games and (last or update % args.eval_every == 0):
            metrics.update(evaluate(rt, eval_steps))
        logger.log(update, {**tags, **metrics}, samples)
        if last or (args.save_every and update % args.save_every == 0):
            save_checkpoint(run_dir, update, rt.model, rt.optimizer, accelerator, algorithm, tags, rt.state_dict())
    logger.close()
    return run_dir


class StartupError(ValueError):
    """A bad flag, game, checkpoint or endpoint, found before training (the CLI prints it as one line, exits 2)."""


@contextlib.contextmanager
def starting():
    """A ValueError raised inside is a StartupError."""
    try:
        yield
    except ValueError as error:
        raise StartupError(str(error)) from error


# Flags a resumed run may change: where and how fast it runs and what it logs, not what it trains.
RESUME_FREE_FLAGS = tuple(
    "resume eval_only output_dir track wandb_project save_every eval_every eval_games threads micro_batch_tokens "
    "sample_batch_size sampler sampler_url sampler_adapter_dir sampler_concurrency sampler_timeout_s "
    "sampler_deadline_s".split()
)


def start(args, algorithm: str, accelerator, validate_args, resume_may_change: Sequence[str] = ()):
    """Every check that can fail at start, before any model loads: flags, threads, model, output dir, checkpoint,
    games. Returns (args as the run uses them, checkpoint to load or None, its trainer state or None). The args:
    data root resolved; --eval-only: every flag left at its default takes the evaluated run's value (its
    config.json); --resume: flags that change what the run is (all but RESUME_FREE_FLAGS and resume_may_change)
    must equal the run's."""
    with starting():
        validate_model_args(args)  # before looking the checkpoint up (--resume and --eval-only exclude each other)
        flag, spec = ("--eval-only", args.eval_only) if args.eval_only else ("--resume", args.resume)
        checkpoint = find_checkpoint(spec, args.output_dir, args.exp_name, args.seed, flag)
        config_file = checkpoint.parent.parent / "config.json" if checkpoint is not None else None
        config = json.loads(config_file.read_text()) if config_file is not None and config_file.is_file() else {}
        if args.eval_only:
            defaults = dataclasses.asdict(type(args)())
            inherited = {
                key: tuple(value) if isinstance(value, list) else value
                for key, value in config.items()
                if key in defaults
                and key not in ("resume", "eval_only", "output_dir", "threads")
                and getattr(args, key) == defaults[key]
            }
            args = dataclasses.replace(args, **inherited)
        validate_args(args)
        set_threads(args, int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)))
        check_model(args.model)
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
        with accelerator.main_process_first():  # the offline game set is generated once, not once per process
            args = dataclasses.replace(args, data_root=args.data_root or str(common.default_data_root()))
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
        games = [] if args.eval_only else training_games(args, accelerator)[1]
        for split in ("valid_seen", "valid_unseen") if args.eval_only or args.eval_every else ():
            try:
                games += common.eval_subset(args.data_root, split, args.task_types, args.eval_games)
            except FileNotFoundError:
                pass  # evaluate() says so
        common.check_games(games)
        return args, checkpoint, state


def cli(args_type, main) -> None:
    """tyro's CLI around main: a StartupError prints just its message and exits 2, as tyro does for a bad flag."""
    args = tyro.cli(args_type)
    try:
        main(args)
    except StartupError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def validate_model_args(args) -> None:
    """Fail at start, naming the flag, on any shared setting that cannot work."""
    check_choices(args)
    check_bounds(args, ">= 1", "lora_rank", "micro_batch_tokens", "sample_batch_size", "sampler_concurrency")
    check_bounds(args, "> 0", "lora_alpha", "learning_rate", "max_grad_norm", "temperature", "sampler_timeout_s")
    check_bounds(args, "> 0", "sampler_deadline_s")
    check_bounds(args, ">= 0", "weight_decay", "seed", "save_every", "eval_every", "eval_games", "threads")
    check(
        (bool(args.model), "--model must not be empty"),
        (len(args.lora_targets) >= 1 and all(args.lora_targets), "--lora-targets must name at least one module"),
        (all(0 <= b < 1 for b in args.adam_betas), f"--adam-betas must lie in [0, 1), got {args.adam_betas}"),
        (0 < args.top_p <= 1, f"--top-p must lie in (0, 1], got {args.top_p}"),
        (args.data_root != "", "--data-root must not be empty (leave it unset for the offline games)"),
        (
            args.task_types is None or (len(args.task_types) >= 1 and set(args.task_types) <= set(common.TASK_TYPES)),
            f"--task-types must be among {common.TASK_TYPES}, got {args.task_types}",
        ),
        (
            bool(args.exp_name) and "__" not in args.exp_name and "/" not in args.exp_name,
            f"--exp-name must be non-empty without '__' or '/', got {args.exp_name!r}",
        ),
        (bool(args.output_dir), "--output-dir must not be empty"),
        (not args.track or bool(args.wandb_project), "--wandb-project must not be empty with --track"),
        (not (args.resume and args.eval_only), "--resume and --eval-only cannot be combined"),
        (not args.eval_only or args.eval_games >= 1, "--eval-only needs --eval-games >= 1"),
        (
            args.sampler == "generate" or args.sampler_url.startswith(("http://", "https://")),
            f"--sampler vllm needs --sampler-url http://HOST:PORT/v1, got {args.sampler_url!r}",
        ),
        (
            args.sampler == "vllm" or not args.sampler_url,
            "--sampler-url is only used with --sampler vllm (the default sampler is generate)",
        ),
    )


def check(*conditions: tuple[bool, str]) -> None:
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


def make_accelerator():
    """CPU or CUDA; DDP when launched on several processes. FSDP and DeepSpeed are refused: the update sums
    LoRA gradients by hand and generate() runs on the unwrapped model, both of which need whole weights per process."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise ValueError(
            f"accelerate config: {accelerator.distributed_type} is not supported; launch with DDP "
            "(accelerate launch --multi_gpu), see the README"
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
    anything loads; `tiny` is always there."""
    from transformers import AutoConfig

    if model == "tiny":
        return
    looks_local = os.path.isabs(model) or model.startswith(".") or os.path.exists(model)
    if looks_local and not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"--model {model}: no such model directory (expected a config.json there)")
    try:
        AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        raise ValueError(f"--model {model}: cannot load its config ({error})") from error


def training_games(args, accelerator) -> tuple[str, list[str]]:
    """(data root, this process's shard of the training games, shuffled with the seed); fails naming --data-root."""
    try:
        games = common.discover_games(args.data_root, args.split, args.task_types, seed=args.seed)
    except FileNotFoundError as error:
        raise ValueError(f"--data-root {args.data_root}: {error}") from error
    return args.data_root, games[accelerator.process_index :: accelerator.num_processes] or games


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def runtime_parts(args, accelerator) -> dict:
    """What every Runtime holds: this process's shard of the training games (checked before the model loads), the
    model, its optimizer, the chat protocol and the samplers (T = --temperature, and greedy)."""
    data_root, games = training_games(args, accelerator)
    tokenizer, model, optimizer = load_model(args, accelerator)
    return dict(
        args=args,
        accelerator=accelerator,
        tokenizer=tokenizer,
        model=model,
        optimizer=optimizer,
        protocol=common.ChatProtocol(tokenizer),
        sample_fn=make_sampler(model, tokenizer, accelerator, args),
        greedy_fn=make_sampler(model, tokenizer, accelerator, args, greedy=True),
        data_root=data_root,
        games=games,
    )


def play(rt, starts, branches: int, *, horizon: int, max_episode_steps: int, sample_fn=None):
    """common.rollout with the run's token budgets, progress bar and sampler (rt.sample_fn unless given)."""
    return common.rollout(
        starts,
        branches,
        sample_fn or rt.sample_fn,
        rt.protocol,
        horizon=horizon,
        max_episode_steps=max_episode_steps,
        max_turn_tokens=rt.args.max_turn_tokens,
        max_trajectory_tokens=rt.args.max_trajectory_tokens,
        on_turn=rt.on_turn,
    )


def load_model(args, accelerator):
    """Tokenizer (left padding), base model + one LoRA adapter, AdamW on the adapter, prepared by accelerate."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = common.resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    on_gpu = accelerator.device.type == "cuda"
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if on_gpu else torch.float32)
    if on_gpu:  # long multi-turn sequences: activations would not fit otherwise
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        target_modules=list(args.lora_targets),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=args.learning_rate,
        betas=tuple(args.adam_betas),
        weight_decay=args.weight_decay,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    return tokenizer, model, optimizer


class SampledTokenLogprobs:
    """A generate() logits processor that records log_softmax(raw logits / temperature) of each sampled token.
    generate() runs it before temperature/top-p and hands it the tokens sampled so far, so it keeps one step's
    distribution at a time instead of the [steps, batch, vocab] logits that output_logits would hold."""

    def __init__(self, temperature: float):
        self.temperature, self.previous, self.steps = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.steps.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def logprobs(self, sequences: torch.Tensor) -> torch.Tensor:
        """[batch, new tokens] once generate() has returned `sequences`."""
        return torch.stack(self.steps + [self.previous.gather(-1, sequences[:, -1:]).squeeze(-1)], dim=1)


def make_sampler(model, tokenizer, accelerator, args, greedy: bool = False) -> common.SampleFn:
    """common.SampleFn over generate(): left-padded chunks of sample_batch_size prompts. A token's logprob is
    log_softmax(raw logits / temperature), which equals a teacher-forced pass at that temperature.
    With --sampler vllm the samples come from the server instead (ServerSampler)."""
    from transformers import LogitsProcessorList

    if args.sampler == "vllm":
        return ServerSampler(model, tokenizer, accelerator, args, greedy)

    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id

    @torch.no_grad()
    def sample(prompts: list[list[int]], max_new_tokens: int) -> list[common.Completion]:
        policy = accelerator.unwrap_model(model)
        was_training = policy.training
        policy.eval()
        completions = []
        for first in range(0, len(prompts), args.sample_batch_size):
            chunk = prompts[first : first + args.sample_batch_size]
            width = max(len(p) for p in chunk)
            input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in chunk], device=accelerator.device)
            attention_mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=accelerator.device
            )
            recorder = SampledTokenLogprobs(args.temperature)
            # Every sampling field is passed: the model's own generation_config would otherwise apply.
            sequences = policy.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=not greedy,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=0,
                repetition_penalty=1.0,
                max_new_tokens=max_new_tokens,
                logits_processor=LogitsProcessorList([recorder]),
                pad_token_id=pad_id,
                eos_token_id=eos_id,
            )
            new_tokens, logprobs = sequences[:, width:], recorder.logprobs(sequences)
            for row_tokens, row_logprobs in zip(new_tokens.tolist(), logprobs.tolist()):
                end = row_tokens.index(eos_id) + 1 if eos_id in row_tokens else len(row_tokens)
                text = tokenizer.decode(row_tokens[:end], skip_special_tokens=True)
                completions.append(common.Completion(row_tokens[:end], row_logprobs[:end], text))
        policy.train(was_training)
        return completions

    return sample


class ServerSampler:
    """common.SampleFn through a vLLM server's OpenAI API, as vLLM 0.20 serves it (vllm/entrypoints/openai:
    /v1/models, /v1/completions, /v1/load_lora_adapter, /v1/unload_lora_adapter). Prompts go as token ids and the
    sampled ids come back with their logprobs (return_tokens_as_token_ids), so nothing is re-tokenised. The server
    samples with the current adapter, named after its weights: whenever the LoRA parameters have changed (an
    optimizer step, a resumed checkpoint) the main process saves them and loads them under the new name, unloading
    the previous one; the other processes wait until the server lists the new name."""

    def __init__(self, model, tokenizer, accelerator, args, greedy: bool = False):
        self.model, self.tokenizer, self.accelerator, self.args = model, tokenizer, accelerator, args
        self.url, self.greedy = args.sampler_url.rstrip("/"), greedy
        self.adapter_dir = Path(args.sampler_adapter_dir or Path(args.output_dir) / "sampler_adapters").resolve()
        self.adapter_name, self.weights_version = None, None
        served = self._served_models()
        bases = {name for card in served if card.get("parent") is None for name in (card["id"], card.get("root"))}
        if not {args.model, common.resolve_model(args.model)} & bases:  # tiny: served by its path
            raise ValueError(
                f"--model {args.model}, but the server at --sampler-url {self.url} serves "
                f"{sorted(c['id'] for c in served)}: start `vllm serve {args.model}` there"
            )
        self.sync_adapter()  # the first load proves that runtime LoRA loading works and that the rank fits

    def _control(self, method: str, path: str, body: dict | None = None):
        import httpx

        try:
            return httpx.request(method, self.url + path, json=body, timeout=self.args.sampler_timeout_s)
        except httpx.HTTPError as error:
            raise ValueError(
                f"--sampler-url {self.url}: no server answers {method} {path} ({type(error).__name__}: {error}); "
                "start vLLM first (README: Sampling through vLLM)"
            ) from error

    def _served_models(self) -> list[dict]:
        response = self._control("GET", "/models")
        if response.status_code != 200:
            raise ValueError(
                f"--sampler-url {self.url}: GET /models answered {response.status_code} "
                f"({error_message(response)}); the URL must be the OpenAI API root, ending in /v1"
            )
        return response.json()["data"]

    def sync_adapter(self) -> None:
        """Make the server's copy of the adapter the current one, if the LoRA parameters changed in place since
        the last call (torch counts in-place writes per tensor: optimizer steps, checkpoint loads) or the server
        no longer serves it (it was restarted)."""
        from peft import get_peft_model_state_dict

        policy = self.accelerator.unwrap_model(self.model)
        version = sum(p._version for p in policy.parameters() if p.requires_grad)
        served = {card["id"] for card in self._served_models()}
        if version == self.weights_version and self.adapter_name in served:
            return
        digest = adapter_sha256(get_peft_model_state_dict(policy))
        name = f"{self.args.exp_name}-{self.args.lora_alpha}-{digest[:16]}"
        if self.accelerator.is_main_process:
            if name not in served:
                policy.save_pretrained(str(self.adapter_dir / name))
                self._load_adapter(name)
            if self.adapter_name not in (None, name):
                self._control("POST", "/unload_lora_adapter", {"lora_name": self.adapter_name})  # 404: already gone
                shutil.rmtree(self.adapter_dir / self.adapter_name, ignore_errors=True)
        else:
            self._wait_until_served(name)
        self.adapter_name, self.weights_version = name, version

    def _load_adapter(self, name: str) -> None:
        path = self.adapter_dir / name
        response = self._control("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        if response.status_code == 200:
            return
        message = error_message(response)
        if response.status_code == 404 and '"error"' not in response.text:  # FastAPI's own 404: no such route
            problem = (
                "the server does not allow runtime LoRA loading: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"
            )
        elif "max_lora_rank" in message:
            problem = (
                f"--lora-rank {self.args.lora_rank} is above the server's --max-lora-rank; "
                f"restart vllm serve with --max-lora-rank >= {self.args.lora_rank}"
            )
        elif "not enabled" in message.lower():
            problem = "the server was started without LoRA: start vllm serve with --enable-lora"
        elif response.status_code == 404:
            problem = f"the server cannot read {path}: --sampler-adapter-dir must be a directory the server sees"
        else:
            problem = "loading the adapter failed"
        raise ValueError(
            f"--sampler-url {self.url}: {problem} (POST /load_lora_adapter: {response.status_code} {message})"
        )

    def _wait_until_served(self, name: str) -> None:
        deadline = time.monotonic() + self.args.sampler_deadline_s
        while name not in {card["id"] for card in self._served_models()}:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"--sampler-url {self.url}: the main process did not load adapter {name} within "
                    f"--sampler-deadline-s {self.args.sampler_deadline_s} s"
                )
            time.sleep(0.5)

    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[common.Completion]:
        self.sync_adapter()
        return asyncio.run(self._complete_all(prompts, max_new_tokens)) if prompts else []

    async def _complete_all(self, prompts: list[list[int]], max_new_tokens: int) -> list[common.Completion]:
        import httpx

        args = self.args
        deadline = asyncio.get_running_loop().time() + args.sampler_deadline_s
        semaphore = asyncio.Semaphore(args.sampler_concurrency)
        limits = httpx.Limits(max_connections=args.sampler_concurrency)
        async with httpx.AsyncClient(base_url=self.url, timeout=args.sampler_timeout_s, limits=limits) as client:
            return list(
                await asyncio.gather(*(self._complete(client, p, max_new_tokens, semaphore, deadline) for p in prompts))
            )

    async def _complete(self, client, prompt: list[int], max_new_tokens: int, semaphore, deadline: float):
        """One prompt: server errors, timeouts and lost connections are retried with exponential backoff until
        the deadline; a request the server refuses (4xx) fails at once."""
        import httpx

        args, loop = self.args, asyncio.get_running_loop()
        body = {  # every sampling field is sent: the server's defaults come from the model's generation_config
            "model": self.adapter_name,
            "prompt": list(prompt),
            "max_tokens": max_new_tokens,
            "temperature": 0.0 if self.greedy else args.temperature,
            "top_p": 1.0 if self.greedy else args.top_p,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "stop_token_ids": [self.tokenizer.eos_token_id],
        }
        attempts, error = 0, None
        while (remaining := deadline - loop.time()) > 0:
            attempts += 1
            try:
                async with semaphore:
                    response = await asyncio.wait_for(client.post("/completions", json=body), timeout=remaining)
            except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    return self._completion(response.json())
                error = f"{response.status_code} {error_message(response)}"
                if response.status_code < 500 and response.status_code not in (408, 429):
                    raise RuntimeError(f"--sampler-url {self.url}: the server refused a completion request ({error})")
            await asyncio.sleep(min(0.5 * 2 ** (attempts - 1), 15.0, max(0.0, deadline - loop.time())))
        raise RuntimeError(
            f"--sampler-url {self.url}: a completion was not answered within --sampler-deadline-s "
            f"{args.sampler_deadline_s} s ({attempts} attempts); last error: {error}"
        )

    def _completion(self, payload: dict) -> common.Completion:
        logprobs = payload["choices"][0].get("logprobs") or {}
        names, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
        if len(names) != len(values) or None in values or not all(str(n).startswith("token_id:") for n in names):
            raise RuntimeError(
                f"--sampler-url {self.url}: the completion came back without token ids and logprobs "
                "(return_tokens_as_token_ids, logprobs); is it a vLLM server?"
            )
        tokens = [int(n.removeprefix("token_id:")) for n in names]
        end = tokens.index(self.tokenizer.eos_token_id) + 1 if self.tokenizer.eos_token_id in tokens else len(tokens)
        text = self.tokenizer.decode(tokens[:end], skip_special_tokens=True)
        return common.Completion(tokens[:end], [float(x) for x in values[:end]], text)


def error_message(response) -> str:
    """The message of an error response: vLLM's {"error": {"message"}} (older: {"message"}), FastAPI's {"detail"}."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else body.get("message") or body.get("detail")
        if message:
            return str(message)
    return response.text[:500]


def token_budget_batches(lengths: Sequence[int], micro_batch_tokens: int) -> list[list[int]]:
    """Indices grouped so that rows x longest row <= micro_batch_tokens (a longer row goes alone).
    Sorted by length so that padding stays small."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > micro_batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def forward_logprobs(policy, rows: list[list[int]], temperature: float, pad_id: int, device) -> torch.Tensor:
    """Teacher-forced logprob of every token given the ones before it, at `temperature` (right-padded batch).
    Column 0 has no prediction and is 0."""
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], device=device)
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    logits = policy(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    logits = logits / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    logprobs = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(logprobs, (1, 0))


@torch.no_grad()
def sequence_logprobs(
    model, accelerator, sequences: list[list[int]], temperature: float, pad_id: int, micro_batch_tokens: int
) -> list[list[float]]:
    """Per-token logprobs of whole sequences under the current policy (no gradient)."""
    policy = accelerator.unwrap_model(model)
    was_training = policy.training
    policy.eval()
    result: list[list[float]] = [[] for _ in sequences]
    for batch in token_budget_batches([len(s) for s in sequences], micro_batch_tokens):
        logprobs = forward_logprobs(
            policy, [list(sequences[i]) for i in batch], temperature, pad_id, accelerator.device
        )
        for row, i in enumerate(batch):
            result[i] = logprobs[row, : len(sequences[i])].tolist()
    policy.train(was_training)
    return result


def refresh_old_logprobs(rt, datums: list[Datum], always: bool = False) -> dict:
    """The datums' old logprobs become the trainer's own: always (an update of several optimizer steps measures its
    ratios from the policy before the first, as veRL does), or with --sampler vllm and --recompute-logprobs (the
    server's kernels and precision differ). With the server, the drift |server - trainer| over the trained tokens is
    reported."""
    args = rt.args
    if not datums or not (always or (args.sampler == "vllm" and args.recompute_logprobs)):
        return {}
    trainer = sequence_logprobs(
        rt.model,
        rt.accelerator,
        [d.tokens for d in datums],
        args.temperature,
        rt.tokenizer.pad_token_id,
        args.micro_batch_tokens,
    )
    drift = []
    for datum, fresh in zip(datums, trainer):
        drift += [abs(old - new) for old, new, m in zip(datum.old_logprobs, fresh, datum.mask) if m]
        datum.old_logprobs = fresh
    if args.sampler != "vllm":
        return {}
    return {
        "rollout/logprob_drift_mean": math.fsum(drift) / max(1, len(drift)),
        "rollout/logprob_drift_max": max(drift, default=0.0),
    }


@dataclass
class Datum:
    """One training sequence: per token the old (sampling) logprob, the advantage and whether it is trained;
    ref_logprobs (the base model's, for a KL loss term) when the loss needs them."""

    tokens: list[int]
    old_logprobs: list[float]
    advantages: list[float]
    mask: list[float]
    ref_logprobs: list[float] | None = None

    def __post_init__(self):
        n = len(self.tokens)
        if not (len(self.old_logprobs) == len(self.advantages) == len(self.mask) == n) or n < 2:
            raise ValueError(f"datum fields must have one entry per token (>= 2 tokens), got {n} tokens")
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"ref_logprobs must have one entry per token ({n}), got {len(self.ref_logprobs)}")
        if self.mask[0]:
            raise ValueError("the first token of a datum has no prediction and cannot be trained")


def broadcast_to_tokens(step_advantages: Sequence[Sequence[float]], step_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) step ids (-1 = context) -> (B, L) float advantages: every token generated at step k
    gets its row's step_advantages[k]; context tokens get 0."""
    if step_ids.dim() != 2 or len(step_advantages) != step_ids.shape[0]:
        raise ValueError(
            f"step_ids must be (B, L) with B = {len(step_advantages)} rows, got shape {tuple(step_ids.shape)}"
        )
    width = max((len(row) for row in step_advantages), default=0)
    table = torch.zeros(len(step_advantages), width + 1, dtype=torch.float32)  # last column: 0 for context
    for i, row in enumerate(step_advantages):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    lengths = torch.tensor([len(row) for row in step_advantages]).unsqueeze(1)
    ids = step_ids.long().cpu()
    if bool((ids >= lengths).any()):
        raise ValueError("step_ids refer to a step beyond the advantages given for that row")
    index = torch.where(ids >= 0, ids, torch.full_like(ids, width))
    return table.gather(1, index).to(step_ids.device)


def trajectory_datums(trajectories: Sequence[common.Trajectory], step_advantages: Sequence[Sequence[float]]):
    """One datum per trajectory (its saved prefix and its steps): every token generated at its step k is trained with
    its step_advantages[k]; the prompts and the saved prefix are context."""
    sequences = [traj.sequence() for traj in trajectories]
    width = max((len(tokens) for tokens, _, _ in sequences), default=0)
    step_ids = torch.tensor([ids + [-1] * (width - len(ids)) for _, _, ids in sequences], dtype=torch.long)
    token_advantages = broadcast_to_tokens(step_advantages, step_ids.view(len(sequences), width)).tolist()
    return [
        Datum(list(tokens), list(old_logprobs), advantages[: len(tokens)], [1.0 if k >= 0 else 0.0 for k in ids])
        for (tokens, old_logprobs, ids), advantages in zip(sequences, token_advantages)
    ]


# loss_fn(logprobs, batch, total_tokens) -> (loss, stats); see train_step
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], float], tuple[torch.Tensor, dict[str, float]]]


def train_step(rt, datums: list[Datum], loss_fn: LossFn) -> dict:
    """One optimizer step of rt.model on all datums (token-budget micro-batches, gradient accumulation).

    The algorithm's loss_fn gets the policy's teacher-forced logprobs of one micro-batch [rows, width], the
    micro-batch's right-padded datum fields (old_logprobs, advantages, mask; ref_logprobs when every datum has them)
    and the number of trained tokens of the whole update on all processes; it returns the micro-batch's share of the
    update's loss and per-token sums, logged as train/{name} means. A non-finite loss or gradient norm skips the step."""
    from accelerate.utils import gather_object

    args, accelerator, optimizer, pad_id = rt.args, rt.accelerator, rt.optimizer, rt.tokenizer.pad_token_id
    policy = accelerator.unwrap_model(rt.model)  # gradients are summed across processes by hand below
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    device = accelerator.device
    local = torch.tensor([sum(sum(d.mask) for d in datums)], dtype=torch.float64, device=device)
    total_tokens = accelerator.reduce(local, reduction="sum").item()
    optimizer.zero_grad(set_to_none=True)
    if total_tokens == 0:
        return {"train/tokens": 0.0, "train/nonfinite_skipped": 0.0}
    loss_sum = ratio_sum = ratio_max = 0.0
    stat_sums: dict[str, float] = {}
    for batch in token_budget_batches([len(d.tokens) for d in datums], args.micro_batch_tokens):
        rows = [datums[i] for i in batch]
        width = max(len(d.tokens) for d in rows)
        fields = ["old_logprobs", "advantages", "mask"] + (
            ["ref_logprobs"] if all(d.ref_logprobs is not None for d in rows) else []
        )
        padded = {
            name: torch.tensor([getattr(d, name) + [0.0] * (width - len(d.tokens)) for d in rows], device=device)
            for name in fields
        }
        logprobs = forward_logprobs(policy, [d.tokens for d in rows], args.temperature, pad_id, device)
        loss, stats = loss_fn(logprobs, padded, total_tokens)
        loss.backward()
        loss_sum += loss.item()
        ratio = torch.exp(logprobs.detach() - padded["old_logprobs"]) * padded["mask"]
        ratio_sum += ratio.sum().item()
        ratio_max = max(ratio_max, ratio.max().item())
        for name, value in stats.items():
            stat_sums[name] = stat_sums.get(name, 0.0) + float(value)
    names = sorted(stat_sums)
    if accelerator.num_processes > 1:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        names = sorted({name for rank_names in gather_object([names]) for name in rank_names})
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
    sums = [loss_sum, ratio_sum] + [stat_sums.get(name, 0.0) for name in names]
    loss_total, ratio_total, *stat_totals = accelerator.reduce(
        torch.tensor(sums, dtype=torch.float64, device=device), "sum"
    ).tolist()
    ratio_max = (
        accelerator.reduce(torch.tensor([ratio_max], device=device), "max").item()
        if accelerator.num_processes > 1
        else ratio_max
    )
    finite = math.isfinite(loss_total) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    elif accelerator.is_main_process:
        print(f"[train] non-finite loss {loss_total} or gradient norm {grad_norm}: step skipped", file=sys.stderr)
    optimizer.zero_grad(set_to_none=True)
    return {
        "train/loss": loss_total,
        "train/tokens": total_tokens,
        "train/grad_norm": grad_norm,
        "train/ratio_mean": ratio_total / total_tokens,
        "train/ratio_max": ratio_max,
        **{f"train/{name}": total / total_tokens for name, total in zip(names, stat_totals)},
        "train/nonfinite_skipped": 0.0 if finite else 1.0,
    }


def rollout_metrics(trajectories: Sequence[common.Trajectory]) -> dict:
    """rollout/ metrics of a batch of trajectories; {} for none."""
    steps = [step for traj in trajectories for step in traj.steps]
    if not trajectories:
        return {}
    return {
        "rollout/valid_format_rate": sum(s.valid for s in steps) / max(1, len(steps)),
        "rollout/admissible_rate": sum(s.admissible for s in steps) / max(1, len(steps)),
        "rollout/steps": len(steps) / len(trajectories),
        "rollout/success_rate": sum(t.won for t in trajectories) / len(trajectories),
        "rollout/generated_tokens": Count(sum(len(s.completion_tokens) for s in steps)),
    }


class Count(float):
    """A metric that counts something: summed over the processes, where every other metric is averaged."""


def reduce_metrics(accelerator, metrics: dict) -> dict:
    """Metrics of all processes: a Count is summed, everything else averaged over the processes that report it.
    An int (or bool) metric is refused: a count must say that it is one, or it would be averaged silently."""
    from accelerate.utils import gather_object

    for key, value in metrics.items():
        if isinstance(value, int):
            raise TypeError(f"metric {key} is an int: make it Count(...) (summed over processes) or a float (averaged)")
    per_rank = gather_object([metrics]) if accelerator.num_processes > 1 else [metrics]
    merged = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):
        values = [m[key] for m in per_rank if key in m]
        merged[key] = sum(values) if isinstance(values[0], Count) else sum(values) / len(values)
    return merged


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


class RunLogger:
    """config.json, metrics.jsonl (one line per update), samples.jsonl, optional W&B (metrics and a table of
    sample trajectories per update), and tqdm bars over updates and over the turns of the current rollout.
    Only the main process writes."""

    def __init__(self, args, run_dir: Path, accelerator, total_updates: int, done: int, postfix_keys=()):
        from tqdm import tqdm

        self.run_dir, self.postfix_keys = Path(run_dir), postfix_keys
        self.active = accelerator.is_main_process
        self.wandb = None
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if done:
            for name in ("metrics.jsonl", "samples.jsonl"):
                drop_rows_after(self.run_dir / name, done)
        (self.run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
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
        """common.rollout's progress callback: turns done in the current rollout, branches still playing."""
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
        self.bar.update(1)
        self.bar.set_postfix({k.split("/")[-1]: f"{numeric[k]:.3g}" for k in self.postfix_keys if k in numeric})

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


def adapter_sha256(adapter: dict[str, torch.Tensor]) -> str:
    """Checksum of an adapter state dict (names and fp32 values), as saved in adapter_model.safetensors."""
    digest = hashlib.sha256()
    for name in sorted(adapter):
        digest.update(name.encode())
        digest.update(adapter[name].detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def save_checkpoint(
    run_dir: Path, update: int, model, optimizer, accelerator, algorithm: str, trainer_state: dict, rank_state: dict
) -> Path:
    """checkpoints/update_{n:06d}/: adapter (safetensors), optimizer, RNG states and trainer_state.json of every
    process, written by the main process into a temporary dir that is then renamed: a checkpoint dir is always
    complete, whenever the job dies. All processes call; they must hold the same adapter (checked, loudly)."""
    from accelerate.utils import gather_object
    from peft import get_peft_model_state_dict

    policy = accelerator.unwrap_model(model)
    checksum = adapter_sha256(get_peft_model_state_dict(policy))
    per_rank = [{"state": rank_state, "rng": _rng_state(), "adapter_sha256": checksum}]
    per_rank = gather_object(per_rank) if accelerator.num_processes > 1 else per_rank
    if len({r["adapter_sha256"] for r in per_rank}) > 1:
        raise RuntimeError(
            f"update {update}: the adapter differs across processes (sha256 per rank: "
            f"{[r['adapter_sha256'][:16] for r in per_rank]}); gradients were not synchronised"
        )
    checkpoints = Path(run_dir) / "checkpoints"
    final = checkpoints / f"update_{update:06d}"
    if accelerator.is_main_process:
        for stale in checkpoints.glob(".tmp_*"):  # left by a job killed while saving
            shutil.rmtree(stale, ignore_errors=True)
        tmp = checkpoints / f".tmp_{final.name}_{os.getpid()}"
        tmp.mkdir(parents=True)
        policy.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save([r["rng"] for r in per_rank], tmp / "rng.pt")
        state = {
            "algorithm": algorithm,
            "update": update,
            **trainer_state,
            "adapter_sha256": checksum,
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
        print(
            f"[checkpoint] {final}: adapter sha256 {checksum[:16]} identical on {accelerator.num_processes} "
            f"process(es)",
            file=sys.stderr,
        )
    accelerator.wait_for_everyone()
    return final


def _checkpoints_in(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary dirs of an interrupted save start with a dot)."""
    return sorted(p for p in (run_dir / "checkpoints").glob("update_*") if (p / "trainer_state.json").is_file())


def load_checkpoint(path: Path, model, optimizer, accelerator) -> None:
    """Adapter weights; with an optimizer (resuming) also its state and this process's RNG states, so call it
    right before the first update. Nothing is unpickled: safetensors, and torch.load(weights_only=True)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(path / "adapter_model.safetensors"))  # on CPU; copied into the parameters' device
    set_peft_model_state_dict(accelerator.unwrap_model(model), weights)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location=accelerator.device))
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

    try:
        state = json.loads((path / "trainer_state.json").read_text())
        adapter_config = json.loads((path / "adapter_config.json").read_text())
        adapter = load_file(str(path / "adapter_model.safetensors"))
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
    if state.get("adapter_sha256") not in (None, adapter_sha256(adapter)):
        raise ValueError(
            f"{flag} {path}: corrupt checkpoint (adapter_model.safetensors does not match the sha256 in "
            "trainer_state.json); pass an older checkpoint dir"
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
    saved = {
        "--lora-rank": adapter_config.get("r"),
        "--lora-alpha": adapter_config.get("lora_alpha"),
        "--lora-targets": sorted(adapter_config.get("target_modules") or []),
    }
    ours = {"--lora-rank": args.lora_rank, "--lora-alpha": args.lora_alpha, "--lora-targets": sorted(args.lora_targets)}
    for name, value in saved.items():
        if value != ours[name]:
            raise ValueError(f"{name} {ours[name]} does not match the checkpoint {path} ({value})")
    return state


def evaluate(rt, max_episode_steps: int) -> dict:
    """Greedy episodes (rt.greedy_fn) on --eval-games games (common.eval_subset) of valid_seen and valid_unseen,
    sharded over the processes. invalid_action_rate = turns whose reply was not an admissible action (bad format or
    not admissible)."""
    from accelerate.utils import gather_object

    args, accelerator, metrics = rt.args, rt.accelerator, {}
    for split in ("valid_seen", "valid_unseen"):
        try:
            games = common.eval_subset(args.data_root, split, args.task_types, args.eval_games)
        except FileNotFoundError as error:
            print(f"[eval] skipping {split}: {error}", file=sys.stderr)
            continue
        mine = [
            start_or_skip(game, rt.protocol, "eval")
            for game in games[accelerator.process_index :: accelerator.num_processes]
        ]
        starts, skipped = [state for state in mine if state is not None], sum(state is None for state in mine)
        groups = (
            play(rt, starts, 1, horizon=max_episode_steps, max_episode_steps=max_episode_steps, sample_fn=rt.greedy_fn)
            if starts
            else []
        )
        results = [
            {
                "task_type": common.load_task_type(traj.start.game_file),
                "won": traj.won,
                "steps": len(traj.steps),
                "inadmissible": sum(not step.admissible for step in traj.steps),
            }
            for group in groups
            for traj in group
        ]
        results = gather_object(results) if accelerator.num_processes > 1 else results
        skipped = sum(gather_object([skipped])) if accelerator.num_processes > 1 else skipped
        if skipped:
            metrics[f"eval/{split}/bad_games_skipped"] = float(skipped)
        if not results:
            continue
        won = [r for r in results if r["won"]]
        metrics[f"eval/{split}/success_rate"] = len(won) / len(results)
        if won:
            metrics[f"eval/{split}/mean_steps_to_success"] = sum(r["steps"] for r in won) / len(won)
        metrics[f"eval/{split}/invalid_action_rate"] = sum(r["inadmissible"] for r in results) / max(
            1, sum(r["steps"] for r in results)
        )
        for task_type in sorted({r["task_type"] for r in results}):
            of_type = [r["won"] for r in results if r["task_type"] == task_type]
            metrics[f"eval/{split}/success/{task_type}"] = sum(of_type) / len(of_type)
    return metrics


def close_distributed() -> None:
    """Two-process CPU runs have hung at exit without this."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ===== end model side =====


if __name__ == "__main__":
    cli(Args, main)
