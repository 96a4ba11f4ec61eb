"""TEMPO: macro-step policy optimization for long-horizon LLM agents in ALFWorld (CleanRL style, one file).

One LoRA policy plays two roles. As the ACTOR it plays the game through tool calls. As the CRITIC it reads
the task, the actor's replies so far with the game's answers, and the game's walkthrough (privileged: never in
actor prompts), and answers with `<value>p</value>`, the chance that the agent still wins. An episode of T turns is cut into macro steps
of H turns. Each update restores saved mid-episode states, runs N branches for one macro step, values the
branches' endpoints with the critic (TD bootstrap), gives every branch the advantage R_n - mean(R) with
R_n = segment reward + V(endpoint), trains the critic towards mean(R) from the start state, and puts the
endpoints back into a FIFO state store so later updates start from them.

Phase 1 (value warm-up) trains the critic alone on Monte-Carlo returns of full games.
Phase 2 (TD loop) trains actor and critic together, in one forward/backward and one optimizer step.

    accelerate launch tempo.py --td-updates 40
    python tempo.py --model tiny --help
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
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
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import numpy as np
import torch
import tyro

import common

ALGORITHM = "tempo"


@dataclass
class Args:
    # ---- model and optimisation (shared with adca_grpo.py) ----
    model: str = "Qwen/Qwen3-4B-Instruct-2507"
    """HF model id or local path; `tiny` = the offline tiny model (tests, smoke runs)"""
    lora_rank: int = 32
    """LoRA rank of the one adapter shared by actor and critic"""
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
    """seed of games order, sampling and the state store"""
    # ---- TEMPO ----
    macro_rounds: int = 10
    """H: turns per macro step (one TD segment)"""
    max_episode_steps: int = 50
    """T: turns per episode; a multiple of H"""
    branches: int = 4
    """N: branches rolled out from every start state"""
    critic_samples: int = 4
    """K: critic samples on every start state (their rewards are centred within the K)"""
    endpoint_samples: int = 2
    """critic samples averaged into the value of one branch endpoint"""
    states_per_batch: int = 4
    """start states per TD update (per process)"""
    warmup_updates: int = 4
    """phase 1: critic-only updates on Monte-Carlo returns"""
    warmup_games_per_batch: int = 4
    """phase 1: fresh games per warm-up update (each played by N full trajectories)"""
    td_updates: int = 40
    """phase 2: TD updates (actor + critic)"""
    state_store_capacity: int = 256
    """FIFO capacity of the store of macro-boundary states"""
    r_max: float = 1.0
    """normaliser of the critic reward -|V - G| / r_max (a parse failure counts as the largest error, 1)"""
    ppo_clip: tuple[float, float] | None = None
    """(eps_low, eps_high): PPO-clip the ratio; None = plain importance-sampling policy gradient (Tinker style)"""
    prefix_is_correction: bool = False
    """weight a stored state's actor advantages by p_now(prefix) / p_old(prefix)"""
    prefix_is_max_weight: float = 2.0
    """bound of the prefix importance weight: it is clipped to [1 / max, max]"""
    max_trajectory_tokens: int = 24576
    """token budget of one episode's prompt (a branch stops before overflowing it)"""
    max_turn_tokens: int = 512
    """new tokens per actor turn"""
    max_critic_tokens: int = 512
    """new tokens per critic reply (a critic prompt longer than --max-trajectory-tokens minus this is skipped)"""
    critic_step_chars: int = 1000
    """characters of each actor reply's reasoning shown to the critic (cut in the middle; the action is always shown)"""
    # ---- runs (shared with adca_grpo.py) ----
    exp_name: str = "tempo"
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
    # ---- sampler (shared with adca_grpo.py) ----
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


# =============================================================================================
# TEMPO: value parsing, signals, prompts, state store
# =============================================================================================
_VALUE_RE = re.compile(r"<value>\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*</value>", re.IGNORECASE)


def parse_value(text) -> float | None:
    """The last `<value>x</value>` of a critic reply, clamped to [0, 1]; None when absent or not finite."""
    matches = _VALUE_RE.findall(text) if isinstance(text, str) else []
    if not matches:
        return None
    value = float(matches[-1])
    return min(1.0, max(0.0, value)) if math.isfinite(value) else None


def actor_signals(
    segment_rewards: Sequence[float], endpoint_values: Sequence[float | None], terminal: Sequence[bool]
) -> tuple[list[float], float, list[float]]:
    """R_n = r_n + V_n (V_n = 0 for a terminal branch), G = mean(R), A_n = R_n - G."""
    if not (len(segment_rewards) == len(endpoint_values) == len(terminal)) or not segment_rewards:
        raise ValueError("actor_signals needs one reward, value and terminal flag per branch (at least one branch)")
    if any(value is None and not done for value, done in zip(endpoint_values, terminal)):
        raise ValueError("a non-terminal branch needs an endpoint value")
    returns = [float(r) + (0.0 if done else float(v)) for r, v, done in zip(segment_rewards, endpoint_values, terminal)]
    value_target = sum(returns) / len(returns)
    return returns, value_target, [r - value_target for r in returns]


def critic_errors(values: Sequence[float | None], target: float) -> list[float]:
    """|V_k - G| per critic sample; a parse failure (None) counts as 1, the largest error a parsed value can make
    (values and targets both lie in [0, 1])."""
    return [1.0 if v is None else abs(v - target) for v in values]


def critic_signals(values: Sequence[float | None], target: float, r_max: float) -> tuple[list[float], list[float]]:
    """Reward -|V_k - G| / r_max per critic sample (a parse failure scores exactly like the worst possible
    parsed answer, -1 / r_max), centred within the group."""
    if not values:
        raise ValueError("critic_signals needs at least one critic sample")
    rewards = [-error / r_max for error in critic_errors(values, target)]
    mean = sum(rewards) / len(rewards)
    return rewards, [r - mean for r in rewards]


def is_degenerate(advantages: Sequence[float]) -> bool:
    return all(abs(a) < 1e-9 for a in advantages)


CRITIC_SYSTEM_PROMPT = (
    "You are the critic of an agent playing a household text game (ALFWorld). You see the task, the agent's "
    "replies so far (its reasoning and the actions it sent) with the game's answers, and a reference solution "
    "that the agent cannot see. Judge what the agent has achieved and understood, whether its current "
    "hypothesis and plan still lead to the goal (check them against the reference), and what obstacles remain. "
    "Estimate the probability that the agent, from where it stands now, completes the task within its remaining "
    "steps. Reason briefly, then end your reply with <value>p</value>, p a number between 0 and 1."
)
PRIVILEGED_HEADER = "Reference solution (privileged, hidden from the agent):"
ADMISSIBLE_SEPARATOR = "\nAdmissible actions: "  # how common.ChatProtocol appends the list to user/tool messages


def trim_middle(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars` characters by dropping its middle: the plan at the start and the conclusion
    at the end stay."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    return text[:head] + " [...] " + text[len(text) - (max_chars - head) :]


def condensed_history(messages: Sequence[dict], step_chars: int) -> list[str]:
    """The chat as the critic reads it: the first observation, then per turn the actor's reply (its reasoning
    trimmed to `step_chars`, then the action it sent; a reply without a valid action is shown trimmed as
    written) and what the game answered. Admissible-action lists are dropped."""
    lines, turn = [], 0
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "user":
            lines.append(f"Start: {content.split(ADMISSIBLE_SEPARATOR)[0].strip()}")
        elif role == "assistant":
            turn += 1
            action = common.parse_action(content)
            if action is None:
                lines.append(f"Step {turn}: (no valid action) {trim_middle(content.strip(), step_chars)}".rstrip())
            else:  # parse_action found exactly one tool call, at the end
                reasoning = trim_middle(content[: content.find("<tool_call>")].strip(), step_chars)
                lines.append(f"Step {turn}: " + (f"{reasoning}\n> {action}" if reasoning else f"> {action}"))
        elif role == "tool":
            status, _, observation = content.split(ADMISSIBLE_SEPARATOR)[0].partition("\nObservation: ")
            lines[-1] += f" [{status.removeprefix('Status: ').split(':')[0]}] {observation.strip()}"
    return lines


def critic_prompt(
    tokenizer,
    task: str,
    walkthrough: Sequence[str],
    messages: Sequence[dict],
    round_index: int,
    max_episode_steps: int,
    step_chars: int,
) -> list[int]:
    """Critic prompt tokens: task, steps left, the privileged walkthrough and the condensed history, rendered
    as a plain chat (no tools)."""
    reference = "\n".join(f"{i + 1}. {action}" for i, action in enumerate(walkthrough)) or "(none)"
    user = (
        f"Task: {task}\nSteps taken: {round_index} of {max_episode_steps} ({max_episode_steps - round_index} left)\n\n"
        f"{PRIVILEGED_HEADER}\n{reference}\n\nHistory:\n" + "\n".join(condensed_history(messages, step_chars))
    )
    chat = [{"role": "system", "content": CRITIC_SYSTEM_PROMPT}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


class StateStore:
    """FIFO store of macro-boundary states; the oldest fall out beyond `capacity`."""

    def __init__(self, capacity: int):
        self.states: deque[common.SavedState] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self.states)

    def add(self, state: common.SavedState) -> None:
        self.states.append(state)

    def take(self, n: int, rng: random.Random) -> list[common.SavedState]:
        """Up to n states, uniformly without replacement; taken states leave the store."""
        picked = set(rng.sample(range(len(self.states)), min(n, len(self.states))))
        taken = [s for i, s in enumerate(self.states) if i in picked]
        self.states = deque((s for i, s in enumerate(self.states) if i not in picked), self.states.maxlen)
        return taken


def policy_loss(
    logprobs: torch.Tensor,
    batch: dict[str, torch.Tensor],
    total_tokens: float,
    *,
    clip: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """train_step's loss, token mean over the whole update. ratio = exp(logp - old_logp): clip=None is the
    importance-sampling policy gradient -ratio * A (Tinker style); clip=(eps_low, eps_high) is PPO's
    -min(ratio * A, clip(ratio) * A)."""
    mask, advantages = batch["mask"], batch["advantages"]
    ratio = torch.exp(logprobs - batch["old_logprobs"])
    if clip is None:
        per_token, is_clipped = -ratio * advantages, torch.zeros_like(mask)
    else:
        clipped_ratio = ratio.clamp(1.0 - clip[0], 1.0 + clip[1])
        per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
        is_clipped = (clipped_ratio * advantages < ratio * advantages).float()
    return (per_token * mask).sum() / total_tokens, {"clip_frac": (is_clipped * mask).sum().item()}


def critic_datum(prompt: list[int], reply: common.Completion, advantage: float) -> Datum:
    """Critic prompt as context, the whole reply trained."""
    context, n = [0.0] * len(prompt), len(reply.tokens)
    return Datum(prompt + reply.tokens, context + reply.logprobs, context + [advantage] * n, context + [1.0] * n)


def score_critic(prompts, replies, targets: Sequence[float], r_max: float):
    """The critic's replies to each state's prompt scored against the state's target G: per state the parsed values
    and the centred rewards -|V_k - G| / r_max (the advantages), then all critic datums. A state without replies
    (prompt over budget) or whose rewards are all equal teaches nothing and gives no datum."""
    values = [[parse_value(r.text) for r in group] for group in replies]
    advantages = [critic_signals(v, g, r_max)[1] if v else [] for v, g in zip(values, targets)]
    datums = [
        critic_datum(prompt, reply, a)
        for prompt, group, group_advantages in zip(prompts, replies, advantages)
        if group_advantages and not is_degenerate(group_advantages)
        for reply, a in zip(group, group_advantages)
    ]
    return values, advantages, datums


def validate_args(args: Args) -> None:
    validate_model_args(args)
    check_bounds(args, ">= 1", "macro_rounds", "endpoint_samples", "states_per_batch", "warmup_games_per_batch")
    check_bounds(args, ">= 1", "prefix_is_max_weight", "max_turn_tokens", "max_critic_tokens", "critic_step_chars")
    check_bounds(args, ">= 0", "warmup_updates", "td_updates")
    check_bounds(args, "> 0", "r_max")
    check(
        (
            args.max_episode_steps >= 1 and (args.eval_only or args.max_episode_steps % args.macro_rounds == 0),
            f"--max-episode-steps ({args.max_episode_steps}) must be a positive multiple of --macro-rounds ({args.macro_rounds})",
        ),
        (args.branches >= 2, f"--branches must be >= 2 (advantages compare branches), got {args.branches}"),
        (
            args.critic_samples >= 2,
            f"--critic-samples must be >= 2 (rewards are centred within them), got {args.critic_samples}",
        ),
        (args.warmup_updates + args.td_updates >= 1, "--warmup-updates + --td-updates must be >= 1"),
        (
            args.state_store_capacity >= args.states_per_batch,
            f"--state-store-capacity ({args.state_store_capacity}) must be >= --states-per-batch ({args.states_per_batch})",
        ),
        (
            args.ppo_clip is None or (0 < args.ppo_clip[0] < 1 and args.ppo_clip[1] > 0),
            f"--ppo-clip needs 0 < eps_low < 1 and eps_high > 0, got {args.ppo_clip}",
        ),
        (
            args.max_critic_tokens < args.max_trajectory_tokens,
            f"--max-critic-tokens ({args.max_critic_tokens}) must be below --max-trajectory-tokens "
            f"({args.max_trajectory_tokens}): critic prompt and reply share that budget",
        ),
        (
            args.max_trajectory_tokens > args.max_turn_tokens,
            f"--max-trajectory-tokens ({args.max_trajectory_tokens}) must exceed --max-turn-tokens ({args.max_turn_tokens})",
        ),
    )


# =============================================================================================
# Run state shared by the two phases
# =============================================================================================
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
    data_root: str
    games: list[str]  # this process's shard of the training games, shuffled with the seed
    store: StateStore
    rng: random.Random  # state-store sampling (saved in checkpoints)
    game_cursor: int = 0
    on_turn: Callable[[int, int], None] | None = None  # rollout progress (the logger's turn bar)
    bad_games: int = 0  # games skipped since the last metrics row (rollout/bad_games_skipped)

    def fresh_state(self) -> common.SavedState:
        return next_fresh_state(self)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this process: the game cursor, the store and its sampling RNG."""
        return {
            "game_cursor": self.game_cursor,
            "rng": list(self.rng.getstate()),
            "store": [s.to_json() for s in self.store.states],
        }

    def load_state_dict(self, state: dict) -> None:
        self.game_cursor = state["game_cursor"]
        self.rng.setstate((state["rng"][0], tuple(state["rng"][1]), state["rng"][2]))
        for saved in state["store"]:
            self.store.add(common.SavedState.from_json(saved))

    def critic_prompt(self, game_file: str, task: str, messages, round_index: int) -> list[int] | None:
        """The critic prompt of a state; None when it leaves no room for a reply in --max-trajectory-tokens
        (never sent; the caller counts it)."""
        args, walkthrough = self.args, common.load_game(game_file).walkthrough
        prompt = critic_prompt(
            self.tokenizer, task, walkthrough, messages, round_index, args.max_episode_steps, args.critic_step_chars
        )
        return prompt if len(prompt) <= args.max_trajectory_tokens - args.max_critic_tokens else None

    def train(self, datums: list[Datum]) -> dict:
        drift = refresh_old_logprobs(self, datums)
        return drift | train_step(self, datums, functools.partial(policy_loss, clip=self.args.ppo_clip))


def sample_critic(rt: Runtime, requests: Sequence[tuple[list[int] | None, int]]) -> list[list[common.Completion]]:
    """n critic replies to each (prompt, n) in one sampler call; none to a prompt over budget (None, never sent)."""
    batch = [prompt for prompt, n in requests if prompt is not None for _ in range(n)]
    replies = iter(rt.sample_fn(batch, rt.args.max_critic_tokens) if batch else [])
    return [[next(replies) for _ in range(n)] if prompt is not None else [] for prompt, n in requests]


def critic_metrics(values_per_state, targets: Sequence[float], advantages_per_state, corr_key: str) -> dict:
    """The critic on a batch of states, one target G each (no samples: prompt over budget): the targets' mean and std,
    the share of sampled states whose centred rewards are all 0, the parse failure rate, mean |V - G| (a failure
    counts as 1) and over parsed samples only, and under `corr_key` corr(each state's mean parsed estimate, G)."""
    sampled = [advantages for advantages in advantages_per_state if advantages]
    metrics = {
        "critic/value_target_mean": statistics.fmean(targets) if targets else 0.0,
        "critic/value_target_std": statistics.pstdev(targets) if targets else 0.0,
        "critic/degenerate_group_rate": sum(map(is_degenerate, sampled)) / max(1, len(sampled)),
    }
    errors = [e for values, g in zip(values_per_state, targets) for e in critic_errors(values, g)]
    if not errors:
        return metrics
    parsed_per_state = [([v for v in values if v is not None], g) for values, g in zip(values_per_state, targets)]
    parsed = [(v, g) for values, g in parsed_per_state for v in values]
    metrics["critic/parse_failure_rate"] = 1 - len(parsed) / len(errors)
    metrics["critic/abs_error_mean"] = statistics.fmean(errors)
    if parsed:
        metrics["critic/abs_error_parsed_mean"] = statistics.fmean(abs(v - g) for v, g in parsed)
    estimates = [(statistics.fmean(values), g) for values, g in parsed_per_state if values]
    if len({v for v, _ in estimates}) > 1 and len({g for _, g in estimates}) > 1:
        metrics[corr_key] = statistics.correlation([v for v, _ in estimates], [g for _, g in estimates])
    return metrics


def sample_row(traj: common.Trajectory, **extra) -> dict:
    """A readable trajectory segment for samples.jsonl."""
    start = traj.start
    row = dict(game=start.game_file, round_index=start.round_index, task=start.task, stop_reason=traj.stop_reason)
    return row | {"messages": traj.messages[len(start.messages) :], **extra}


# =============================================================================================
# Phase 1: value warm-up (critic only, Monte-Carlo targets)
# =============================================================================================
def warmup_update(rt: Runtime) -> tuple[dict, list[dict]]:
    args, t0 = rt.args, time.time()
    # ---- Phase 1, step 1: fresh games, N full trajectories each (one macro step = the whole episode)
    starts = [rt.fresh_state() for _ in range(args.warmup_games_per_batch)]
    groups = play(rt, starts, args.branches, horizon=args.max_episode_steps, max_episode_steps=args.max_episode_steps)
    trajectories = [traj for group in groups for traj in group]
    t_rollout = time.time()

    # ---- Phase 1, step 2: the state at every H-turn boundary before the end (the start included), its target =
    # the trajectory's return (0/1 won); a state whose critic prompt is over budget is skipped
    states, too_long = [], 0  # (trajectory, critic prompt, target) per boundary state
    for traj in trajectories:
        for round_index in range(traj.start.round_index, traj.round_index, args.macro_rounds):
            messages = traj.messages[: len(traj.start.messages) + 2 * (round_index - traj.start.round_index)]
            prompt = rt.critic_prompt(traj.start.game_file, traj.start.task, messages, round_index)
            if prompt is None:
                too_long += 1
            else:
                states.append((traj, prompt, 1.0 if traj.won else 0.0))
    prompts, targets = [prompt for _, prompt, _ in states], [target for _, _, target in states]

    # ---- Phase 1, step 3: K critic samples per boundary state, reward -|V - G| / r_max centred within the K
    replies = sample_critic(rt, [(prompt, args.critic_samples) for prompt in prompts])
    values, advantages, datums = score_critic(prompts, replies, targets, args.r_max)
    t_critic = time.time()

    # ---- Phase 1, step 4: update the critic only
    metrics = rt.train(datums) | rollout_metrics(trajectories)
    metrics |= critic_metrics(values, targets, advantages, "critic/value_corr") | {
        "warmup/success_rate": sum(t.won for t in trajectories) / max(1, len(trajectories)),
        "warmup/boundary_states": Count(len(states) + too_long),
        "critic/prompt_too_long_rate": too_long / max(1, len(states) + too_long),
        "time/rollout": t_rollout - t0,
        "time/critic": t_critic - t_rollout,
        "time/update": time.time() - t_critic,
    }
    return metrics, [sample_row(traj, critic_reply=replies[0][0].text, value_target=g) for traj, _, g in states[:1]]


# =============================================================================================
# Phase 2: TD loop (actor + critic)
# =============================================================================================
def has_room(traj: common.Trajectory, args: Args) -> bool:
    """Another turn fits in the episode's token budget."""
    return len(traj.tokens) + args.max_turn_tokens <= args.max_trajectory_tokens


def prefix_weights(rt: Runtime, starts: Sequence[common.SavedState]) -> list[float | None]:
    """exp(log p_now(prefix) - log p_old(prefix)) over the prefix's generated tokens, clipped to
    [1 / max, max]; None for a state without generated tokens (a fresh game: nothing to correct)."""
    args, bound = rt.args, math.log(rt.args.prefix_is_max_weight)
    with_prefix = [i for i, s in enumerate(starts) if any(k >= 0 for k in s.prefix_step_ids)]
    rows, pad_id = [starts[i].prefix_tokens for i in with_prefix], rt.tokenizer.pad_token_id
    current = sequence_logprobs(rt.model, rt.accelerator, rows, args.temperature, pad_id, args.micro_batch_tokens)
    weights: list[float | None] = [None] * len(starts)
    for i, logprobs in zip(with_prefix, current):
        generated = zip(logprobs, starts[i].prefix_logprobs, starts[i].prefix_step_ids)
        log_ratio = sum(now - old for now, old, k in generated if k >= 0)
        weights[i] = math.exp(min(max(log_ratio, -bound), bound))
    return weights


def td_update(rt: Runtime) -> tuple[dict, list[dict]]:
    args, t0 = rt.args, time.time()
    # ---- Phase 2, step 1: start states, uniformly from the store; fresh games when it runs short
    starts = rt.store.take(args.states_per_batch, rt.rng)
    fresh = args.states_per_batch - len(starts)
    starts += [rt.fresh_state() for _ in range(fresh)]

    # ---- Phase 2, step 2: restore each state (replay, verified; one that fails is dropped, never fatal) and run N
    # branches for H turns
    groups = play(rt, starts, args.branches, horizon=args.macro_rounds, max_episode_steps=args.max_episode_steps)
    live_starts, live_groups = [s for s, g in zip(starts, groups) if g], [g for g in groups if g]
    t_rollout = time.time()

    # ---- Phase 2, step 3: value the branch endpoints with the critic (and sample it on the start states for step 5)
    critic = critic_pass(rt, live_starts, live_groups)

    # ---- Phase 2, step 4: branch returns R_n = r_n + V(endpoint_n) (0 for a terminal branch), A_n = R_n - mean(R)
    signals = [
        actor_signals([t.reward for t in group], values, [v is None for v in values])
        for group, values in zip(live_groups, critic.branch_values)
    ]
    weights = prefix_weights(rt, live_starts) if args.prefix_is_correction else [None] * len(live_starts)

    # ---- Phase 2, step 5: critic targets: K samples on each start state, reward -|V - G| towards G = mean(R)
    targets = [target for _, target, _ in signals]
    start_values, critic_advantages, critic_datums = score_critic(
        critic.start_prompts, critic.start_replies, targets, args.r_max
    )

    # ---- Phase 2, step 6: one update, actor datums (saved prefix + segment) and critic datums (prompt + reply)
    datums = []
    for group, (_, _, advantages), weight in zip(live_groups, signals, weights):
        if not is_degenerate(advantages):
            scale = 1.0 if weight is None else weight
            datums += trajectory_datums(group, [[a * scale] * len(t.steps) for t, a in zip(group, advantages)])
    t_critic = time.time()
    metrics = rt.train(datums + critic_datums)
    t_update = time.time()

    # ---- Phase 2, step 7: endpoints with room for another turn (and a critic prompt within budget, so they can be
    # valued again) go back into the store
    stored = [t for t, p in zip(critic.endpoints, critic.endpoint_prompts) if p is not None and has_room(t, args)]
    for traj in stored:
        rt.store.add(traj.saved_state())

    metrics |= td_metrics(rt, live_groups, critic, signals, weights, start_values, critic_advantages)
    metrics |= {
        "td/fresh_states": Count(fresh),
        "td/new_endpoints": Count(len(stored)),
        "td/restore_failures": Count(len(starts) - len(live_starts)),
        "td/macro_index_mean": statistics.fmean(s.round_index / args.macro_rounds for s in starts),
        "time/rollout": t_rollout - t0,
        "time/critic": t_critic - t_rollout,
        "time/update": t_update - t_critic,
    }
    return metrics, td_samples(live_groups, critic, signals)


@dataclass
class CriticPass:
    """The critic's one batched call of a TD update: E samples on every branch endpoint, K on every start state."""

    branch_values: list[list[float | None]]  # per group and branch: V(endpoint), mean of its parsed samples (0 when
    # all fail or its prompt is over budget); None for a terminal branch (won, at T, or out of tokens mid-segment)
    endpoints: list[common.Trajectory]  # the branches that stopped at the macro boundary
    endpoint_prompts: list[list[int] | None]  # None: over budget, never sent
    start_prompts: list[list[int] | None]
    start_replies: list[list[common.Completion]]  # [] when the start state's prompt is over budget
    endpoint_failures: int  # endpoint samples that did not parse


def critic_pass(rt: Runtime, starts: Sequence[common.SavedState], groups) -> CriticPass:
    """A branch stopped at the macro boundary is valued (also one with no token room for another turn: truncated,
    not ended); every other branch is terminal."""
    E, K = rt.args.endpoint_samples, rt.args.critic_samples
    endpoints = [t for group in groups for t in group if t.stop_reason == common.STOP_HORIZON]
    endpoint_prompts = [rt.critic_prompt(t.start.game_file, t.start.task, t.messages, t.round_index) for t in endpoints]
    start_prompts = [rt.critic_prompt(s.game_file, s.task, s.messages, s.round_index) for s in starts]
    replies = sample_critic(rt, [(p, E) for p in endpoint_prompts] + [(p, K) for p in start_prompts])
    parsed = [[v for v in (parse_value(r.text) for r in group) if v is not None] for group in replies[: len(endpoints)]]
    failures = sum(len(group) - len(values) for group, values in zip(replies, parsed))
    endpoint_values = iter([statistics.fmean(values) if values else 0.0 for values in parsed])
    branch_values = [
        [next(endpoint_values) if t.stop_reason == common.STOP_HORIZON else None for t in group] for group in groups
    ]
    return CriticPass(branch_values, endpoints, endpoint_prompts, start_prompts, replies[len(endpoints) :], failures)


def td_metrics(rt, groups, critic: CriticPass, signals, weights, start_values, critic_advantages) -> dict:
    trajectories = [traj for group in groups for traj in group]
    targets = [target for _, target, _ in signals]
    zero_reward_gaps = []
    for group, values in zip(groups, critic.branch_values):
        zero = [v for v, t in zip(values, group) if v is not None and t.reward == 0]
        zero_reward_gaps.append(statistics.pstdev(zero) if len(zero) >= 2 else 0.0)
    metrics = rollout_metrics(trajectories)
    metrics |= critic_metrics(start_values, targets, critic_advantages, "critic/td_target_corr")
    parsed_weights = [w for w in weights if w is not None]
    if parsed_weights:
        metrics["td/prefix_is_weight_mean"] = statistics.fmean(parsed_weights)
        metrics["td/prefix_is_weight_max"] = max(parsed_weights)
    endpoint_values = [v for values in critic.branch_values for v in values if v is not None]
    if endpoint_values:
        metrics["critic/endpoint_value_mean"] = statistics.fmean(endpoint_values)
    prompts = critic.endpoint_prompts + critic.start_prompts
    return metrics | {
        "critic/endpoint_parse_failures": Count(critic.endpoint_failures),
        "critic/prompt_too_long_rate": sum(p is None for p in prompts) / max(1, len(prompts)),
        "actor/segment_reward_mean": statistics.fmean(t.reward for t in trajectories) if trajectories else 0.0,
        "actor/degenerate_group_rate": sum(is_degenerate(a) for _, _, a in signals) / max(1, len(groups)),
        "actor/macro_boundary_rate": len(critic.endpoints) / max(1, len(trajectories)),
        "actor/value_gap_zero_reward": statistics.fmean(zero_reward_gaps) if zero_reward_gaps else 0.0,
        "td/store_size": Count(len(rt.store)),
    }


def td_samples(groups, critic: CriticPass, signals) -> list[dict]:
    """The first group's first branch, for samples.jsonl."""
    if not groups:
        return []
    replies, (_, value_target, advantages) = critic.start_replies[0], signals[0]
    return [
        sample_row(
            groups[0][0],
            segment_reward=groups[0][0].reward,
            endpoint_value=critic.branch_values[0][0],
            advantage=advantages[0],
            critic_reply=replies[0].text if replies else None,
            value_target=value_target,
        )
    ]


# =============================================================================================
# Main: warm-up updates, then TD updates (train(), in the plumbing below, runs the job around them)
# =============================================================================================
RESUME_MAY_CHANGE = ("td_updates",)  # flags that only extend a run
POSTFIX_KEYS = ("critic/abs_error_mean", "critic/value_corr", "rollout/success_rate", "td/fresh_states", "train/loss")


def make_runtime(args: Args, accelerator) -> Runtime:
    """What runtime_parts builds (games shard, model, optimizer, protocol, samplers) and an empty state store."""
    return Runtime(
        **runtime_parts(args, accelerator),
        store=StateStore(args.state_store_capacity),
        rng=random.Random(args.seed + accelerator.process_index),
    )


def one_update(rt: Runtime, update: int) -> tuple[dict, list[dict], dict]:
    phase = "warmup" if update <= rt.args.warmup_updates else "td"
    metrics, samples = warmup_update(rt) if phase == "warmup" else td_update(rt)
    return metrics, samples, {"phase": phase}


def main(args: Args) -> Path:
    """Train (or evaluate, with --eval-only); returns the run directory."""
    with training_job(args, ALGORITHM, validate_args, RESUME_MAY_CHANGE) as (args, accelerator, checkpoint, state):
        with starting():  # endpoint checks
            rt = make_runtime(args, accelerator)
        total_updates = args.warmup_updates + args.td_updates
        return train(rt, ALGORITHM, checkpoint, state, total_updates, one_update, args.max_episode_steps, POSTFIX_KEYS)


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
