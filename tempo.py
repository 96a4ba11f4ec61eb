"""TEMPO: macro-step policy optimization for long-horizon LLM agents in ALFWorld (CleanRL style).

One LoRA policy plays two roles. As the ACTOR it plays the game through tool calls. As the CRITIC it reads
the task, the actor's replies so far with the game's answers, and the game's walkthrough (privileged: never in
actor prompts), and answers with `<value>p</value>`, the chance that the agent still wins. An episode of T turns is cut into macro steps
of H turns. Each update restores saved mid-episode states, runs N branches for one macro step, values the
branches' endpoints with the critic (TD bootstrap), gives every branch the advantage R_n - mean(R) with
R_n = segment reward + V(endpoint), trains the critic towards mean(R) from the start state, and puts the
endpoints back into a FIFO state store so later updates start from them. --state-selection outcome (the default)
keeps the lineages whose branches disagreed (a start state whose group had a gradient goes back with its
endpoints); uncertain stores only endpoints whose outcome the critic calls uncertain and draws start states where N
branches are most likely to disagree; source is the source's rule (every endpoint stored, drawn uniformly and kept).

Phase 1 (value warm-up) trains the critic alone on Monte-Carlo returns of full games.
Phase 2 (TD loop) trains actor and critic together, in one forward/backward and one optimizer step.

    accelerate launch tempo.py --td-updates 40
    python tempo.py --model tiny --help
"""

from __future__ import annotations

import functools
import math
import random
import re
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal, Sequence

import torch

import common
import harness
import training

# fork 1: the algorithm's name (a checkpoint carries it; another algorithm's is refused), its constants, the docstring
ALGORITHM = "tempo"


# fork 2: the algorithm's flags in Args (harness.SharedArgs / PPOArgs hold the shared ones) and validate_args
@dataclass
class Args(harness.SharedArgs):
    GLOBAL_COUNTS: ClassVar[tuple[str, ...]] = ("groups_per_update", "warmup_groups_per_update")
    UPDATE_COUNTS: ClassVar[tuple[str, ...]] = ("warmup_updates", "td_updates")
    exp_name: str = ALGORITHM
    """run name prefix: runs/{exp_name}__{seed}__{time}"""
    # ---- TEMPO ----
    macro_rounds: int = 10
    """H: turns per macro step (one TD segment)"""
    max_turns: int = 50
    """T: turns per episode; a multiple of H"""
    group_size: int = 4
    """N: branches rolled out from every start state (one group)"""
    critic_samples: int = 4
    """K: critic samples on every start state (their rewards are centred within the K, by default)"""
    endpoint_samples: int = 2
    """critic samples averaged into the value of one branch endpoint (--endpoint-values rollout: continuations)"""
    endpoint_values: Literal["critic", "rollout"] = "critic"
    """what values a branch endpoint: the critic (the method) or, an ablation, the mean return of --endpoint-samples
    continuations of the episode from it by the current policy (never trained, tokens in td/oracle_generated_tokens)"""
    groups_per_update: int = 4
    """start states per TD update (all processes together: each takes its share), one group of N branches each"""
    fresh_state_share: float = 0.0
    """share of each TD update's start states that are fresh games (0: stored states, fresh games only
    when the store runs short); keeps some starts at the task's beginning when the store fills with dead ends"""
    warmup_updates: int = 4
    """phase 1: critic-only updates on Monte-Carlo returns"""
    warmup_groups_per_update: int = 4
    """phase 1: fresh games per warm-up update (all processes together), one group of N full trajectories each"""
    td_updates: int = 40
    """phase 2: TD updates (actor + critic)"""
    state_store_capacity: int = 256
    """FIFO capacity of each process's store of macro-boundary states"""
    state_selection: Literal["outcome", "uncertain", "uniform", "source"] = "outcome"
    """outcome: drawn uniformly, but what the branches did decides, not the critic: a start state whose group had a
    gradient goes back into the store with its endpoints, a degenerate group's start and endpoints are dropped;
    uncertain: draw start states with probability 1 - V^N - (1 - V)^N + --uncertain-floor (the chance that N branches
    from a state the critic values V disagree) among the endpoints valued inside --uncertain-band; uniform: every
    endpoint whose critic prompt fits stored, drawn uniformly, a drawn state removed; source: 09-tempo's store, every
    endpoint stored, drawn uniformly, drawn states kept (they leave only by FIFO eviction)"""
    uncertain_band: tuple[float, float] = (0.05, 1.0)
    """[lo, hi]: with --state-selection uncertain, endpoints valued outside it are not stored (default: those the
    critic calls hopeless, so the store does not fill with dead ends; 0 1 keeps every endpoint)"""
    uncertain_floor: float = 0.05
    """added to every stored state's draw weight, so states the critic calls certain are still drawn (a critic that
    answers only 0 or 1 values every state certain)"""
    r_max: float = 1.0
    """normaliser of the critic reward -|V - G| / r_max (a parse failure counts as the largest error, 1)"""
    critic_error: Literal["abs", "squared"] = "abs"
    """critic reward -|V - G| / r_max (the source; its best answer is G's median: 0 or 1 for 0/1 outcomes) or
    squared, -((V - G) / r_max)^2 (its best answer is G's mean: the state's value)"""
    td_critic: bool = True
    """phase 2 trains the critic towards its TD targets (the source); --no-td-critic keeps the critic as phase 1 left
    it, sampled for endpoint values only (the actor's updates of the shared LoRA still move it): at long horizon it
    then kept its ranking of held-out states, which TD training lowered, but the actor did no better
    (docs/does-it-learn.md)"""
    clip_eps: float | None = None
    """PPO clip range below 1 (and above, unless --clip-eps-high is set); None = the source's plain importance-sampling
    policy gradient (Tinker style). The clip acts only from an update's second optimizer step (--ppo-epochs,
    --mini-batches): at the first the ratio is 1"""
    clip_eps_high: float | None = None
    """PPO clip range above 1 (clip-higher); None = --clip-eps"""
    ppo_epochs: int = 1
    """passes over each update's datums (old logprobs are recomputed by the policy when this or --mini-batches > 1)"""
    mini_batches: int = 1
    """optimizer steps per pass (the update's actor and critic datums split at random)"""
    prefix_is_correction: bool = False
    """weight a stored state's actor advantages by p_now(prefix) / p_old(prefix)"""
    prefix_is_max_weight: float = 2.0
    """bound of the prefix importance weight: it is clipped to [1 / max, max]"""
    max_critic_tokens: int = 512
    """new tokens per critic reply (a critic prompt longer than --max-trajectory-tokens minus this is skipped)"""
    critic_step_chars: int = 1000
    """characters of each actor reply's reasoning shown to the critic (cut in the middle; the action is always shown)"""


def validate_args(args: Args) -> None:
    harness.validate_model_args(args)
    harness.check_bounds(
        args, ">= 1", "macro_rounds", "endpoint_samples", "groups_per_update", "warmup_groups_per_update"
    )
    harness.check_bounds(
        args, ">= 1", "prefix_is_max_weight", "max_critic_tokens", "critic_step_chars",
        "ppo_epochs", "mini_batches",
    )  # fmt: skip
    harness.check_bounds(args, ">= 0", "warmup_updates", "td_updates")
    harness.check_bounds(args, "> 0", "r_max", "clip_eps_high")
    harness.require_all(
        (
            0 <= args.fresh_state_share <= 1,
            f"--fresh-state-share must be in [0, 1], got {args.fresh_state_share}",
        ),
        (
            0 <= args.uncertain_band[0] < args.uncertain_band[1] <= 1,
            f"--uncertain-band needs 0 <= lo < hi <= 1, got {args.uncertain_band}",
        ),
        (args.uncertain_floor >= 0, f"--uncertain-floor must be >= 0, got {args.uncertain_floor}"),
        (
            args.max_turns >= 1 and (args.eval_only or args.max_turns % args.macro_rounds == 0),
            f"--max-turns ({args.max_turns}) must be a positive multiple of --macro-rounds ({args.macro_rounds})",
        ),
        (args.group_size >= 2, f"--group-size must be >= 2 (advantages compare branches), got {args.group_size}"),
        (
            args.critic_samples >= 2,
            f"--critic-samples must be >= 2 (rewards are centred within them), got {args.critic_samples}",
        ),
        (args.warmup_updates + args.td_updates >= 1, "--warmup-updates + --td-updates must be >= 1"),
        (
            args.async_steps == 0,
            "--async-steps: tempo.py samples synchronously. Its phase-2 starts are drawn from the state store and its "
            "segments valued by the critic that the update before trains, so sampling ahead would change what the "
            "store holds when a state is drawn (not measured here; docs/vllm.md)",
        ),
        (
            args.state_store_capacity >= args.groups_per_update,
            f"--state-store-capacity ({args.state_store_capacity}) must be >= --groups-per-update ({args.groups_per_update})",
        ),
        (args.clip_eps is None or 0 < args.clip_eps < 1, f"--clip-eps must lie in (0, 1), got {args.clip_eps}"),
        (
            args.max_critic_tokens < args.max_trajectory_tokens,
            f"--max-critic-tokens ({args.max_critic_tokens}) must be below --max-trajectory-tokens "
            f"({args.max_trajectory_tokens}): critic prompt and reply share that budget",
        ),
    )


# fork 3: the algorithm's signals and prompts: functions of trajectories, replies and flags (no Runtime)
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


def critic_signals(
    values: Sequence[float | None], target: float, r_max: float, squared: bool = False
) -> tuple[list[float], list[float]]:
    """Reward -|V_k - G| / r_max (squared: -((V_k - G) / r_max)^2) per critic sample (a parse failure scores exactly
    like the worst possible parsed answer, an error of 1), centred within the group."""
    if not values:
        raise ValueError("critic_signals needs at least one critic sample")
    rewards = [-((error / r_max) ** (2 if squared else 1)) for error in critic_errors(values, target)]
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
    max_turns: int,
    step_chars: int,
    enable_thinking: bool = True,
) -> list[int]:
    """Critic prompt tokens: task, steps left, the privileged walkthrough and the condensed history, rendered
    as a plain chat (no tools), with the actor's thinking switch (a template without one ignores it)."""
    reference = "\n".join(f"{i + 1}. {action}" for i, action in enumerate(walkthrough)) or "(none)"
    user = (
        f"Task: {task}\nSteps taken: {round_index} of {max_turns} ({max_turns - round_index} left)\n\n"
        f"{PRIVILEGED_HEADER}\n{reference}\n\nHistory:\n" + "\n".join(condensed_history(messages, step_chars))
    )
    chat = [{"role": "system", "content": CRITIC_SYSTEM_PROMPT}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    return tokenizer.encode(text, add_special_tokens=False)


class StateStore:
    """FIFO store of macro-boundary states, each with the critic's value V of it; the oldest fall out beyond
    `capacity`. selection "source", "uniform" and "outcome": every state added is kept and drawn uniformly (under
    "outcome" td_update adds only the starts and endpoints of groups with a gradient). "uncertain": a state valued
    outside `band` is not kept, and states are drawn with probability proportional to 1 - V^N - (1 - V)^N + `floor`:
    the chance that N branches from a state won with probability V do not all end alike (a group with a gradient).
    A drawn state leaves the store, except under "source" (09-tempo's states.py: drawn states stay)."""

    def __init__(self, capacity: int, selection: str = "uniform", band=(0.0, 1.0), group_size: int = 4, floor=0.0):
        self.entries: deque[tuple[common.SavedState, float]] = deque(maxlen=capacity)
        self.selection, self.band, self.group_size, self.floor = selection, band, group_size, floor

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, state: common.SavedState, value: float) -> bool:
        """Keep the state (True) unless the rule leaves it out."""
        if self.selection == "uncertain" and not self.band[0] <= value <= self.band[1]:
            return False
        self.entries.append((state, value))
        return True

    def weight(self, value: float) -> float:
        n = self.group_size
        return 1.0 if self.selection != "uncertain" else 1.0 - value**n - (1.0 - value) ** n + self.floor

    def take(self, n: int, rng: random.Random) -> list[tuple[common.SavedState, float]]:
        """Up to n distinct (state, value) pairs, drawn by the rule's weights without replacement; taken states leave
        the store, except under "source"."""
        if self.selection == "source":
            return [self.entries[i] for i in rng.sample(range(len(self.entries)), min(n, len(self.entries)))]
        pool, taken = list(self.entries), []
        for _ in range(min(n, len(pool))):
            i = rng.choices(range(len(pool)), [self.weight(value) for _, value in pool])[0]
            taken.append(pool.pop(i))
        self.entries = deque(pool, self.entries.maxlen)
        return taken


def critic_datum(prompt: list[int], reply: common.Completion, advantage: float) -> training.Datum:
    """Critic prompt as context, the whole reply trained."""
    context, n = [0.0] * len(prompt), len(reply.tokens)
    return training.Datum(
        prompt + reply.tokens, context + reply.logprobs, context + [advantage] * n, context + [1.0] * n
    )


def score_critic(prompts, replies, targets: Sequence[float], r_max: float, squared=False):
    """The critic's replies to each state's prompt scored against the state's target G: per state the parsed values,
    then all critic datums, trained with the rewards (critic_signals) centred within each state's K replies. A state
    without replies (prompt over budget) or whose centred rewards are all 0 teaches nothing and gives no datum."""
    values = [[parse_value(r.text) for r in group] for group in replies]
    scored = [critic_signals(v, g, r_max, squared) if v else ([], []) for v, g in zip(values, targets)]
    advantages = [centred for _, centred in scored]
    datums = [
        critic_datum(prompt, reply, a)
        for prompt, group, group_advantages in zip(prompts, replies, advantages)
        if group_advantages and not is_degenerate(group_advantages)
        for reply, a in zip(group, group_advantages)
    ]
    return values, datums


# =============================================================================================
# Run state shared by the two phases
# =============================================================================================
# fork 4: Runtime: what the updates need besides harness.Runtime's games, model, optimizer, protocol and samplers
# (what a checkpoint keeps of it goes into state_dict / load_state_dict); the training call: training.ppo_update, or
# the algorithm's own policy_loss and ppo_update
class Runtime(harness.Runtime):
    def __init__(self, args: Args, accelerator):
        super().__init__(args, accelerator)
        self.store = StateStore(
            args.state_store_capacity, args.state_selection, args.uncertain_band, args.group_size, args.uncertain_floor
        )
        self.rng = random.Random(args.seed + accelerator.process_index)  # state-store sampling (saved in checkpoints)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this process: the game cursor, the store, its sampling RNG."""
        return super().state_dict() | {
            "rng": list(self.rng.getstate()),
            "store": [[s.to_json(), value] for s, value in self.store.entries],
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.rng.setstate((state["rng"][0], tuple(state["rng"][1]), state["rng"][2]))
        self.store.entries.extend((common.SavedState.from_json(saved), value) for saved, value in state["store"])

    def critic_prompt(self, game_file: str, task: str, messages, round_index: int) -> list[int] | None:
        """The critic prompt of a state; None when it leaves no room for a reply in --max-trajectory-tokens
        (never sent; the caller counts it)."""
        args, walkthrough = self.args, common.load_game(game_file).walkthrough
        prompt = critic_prompt(
            self.tokenizer, task, walkthrough, messages, round_index, args.max_turns, args.critic_step_chars,
            args.enable_thinking,
        )  # fmt: skip
        return prompt if len(prompt) <= args.max_trajectory_tokens - args.max_critic_tokens else None


def policy_loss(
    logprobs: torch.Tensor,
    batch: dict[str, torch.Tensor],
    total_tokens: float,
    *,
    clip_eps: float | None = None,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """train_step's loss, token mean over the whole update. ratio = exp(logp - old_logp): clip_eps=None is the
    importance-sampling policy gradient -ratio * A (Tinker style); else PPO's -min(ratio * A, clip(ratio) * A) with
    clip(ratio) in [1 - clip_eps, 1 + clip_eps_high] (clip_eps_high None: clip_eps)."""
    mask, advantages = batch["mask"], batch["advantages"]
    ratio = torch.exp(logprobs - batch["old_logprobs"])
    if clip_eps is None:
        per_token, is_clipped = -ratio * advantages, torch.zeros_like(mask)
    else:
        eps_high = clip_eps if clip_eps_high is None else clip_eps_high
        clipped_ratio = ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)
        per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
        is_clipped = (clipped_ratio * advantages < ratio * advantages).float()
    return (per_token * mask).sum() / total_tokens, {"clip_frac": (is_clipped * mask).sum().item()}


def ppo_update(rt: Runtime, datums: list[training.Datum]) -> dict:
    """The loss with the run's clip settings, over --ppo-epochs x --mini-batches steps."""
    args = rt.args
    loss_fn = functools.partial(policy_loss, clip_eps=args.clip_eps, clip_eps_high=args.clip_eps_high)
    return training.ppo_steps(rt, datums, loss_fn, args.ppo_epochs, args.mini_batches)


# fork 5: the updates -> (metrics, samples) and their helpers; a metric that counts something is a training.SummedMetric
def sample_critic(rt: Runtime, requests: Sequence[tuple[list[int] | None, int]]) -> list[list[common.Completion]]:
    """n critic replies to each (prompt, n) in one sampler call; none to a prompt over budget (None, never sent)."""
    batch = [prompt for prompt, n in requests if prompt is not None for _ in range(n)]
    replies = iter(rt.sample_fn(batch, rt.args.max_critic_tokens) if batch else [])
    return [[next(replies) for _ in range(n)] if prompt is not None else [] for prompt, n in requests]


def score_critic_by_flags(rt: Runtime, prompts, replies, targets: Sequence[float]):
    """score_critic with the run's --r-max and --critic-error."""
    return score_critic(prompts, replies, targets, rt.args.r_max, rt.args.critic_error == "squared")


def critic_metrics(values_per_state, targets: Sequence[float], corr_key: str) -> dict:
    """The critic on a batch of states, one target G each (no samples: prompt over budget): the targets' mean and std,
    the share of sampled states whose K replies all miss G by the same error, the parse failure rate, mean |V - G| (a
    failure counts as 1) and over parsed samples only, and under `corr_key` corr(each state's mean parsed estimate,
    G)."""
    sampled = [critic_errors(values, g) for values, g in zip(values_per_state, targets) if values]
    metrics = {
        "critic/value_target_mean": statistics.fmean(targets) if targets else 0.0,
        "critic/value_target_std": statistics.pstdev(targets) if targets else 0.0,
    }
    if sampled:
        metrics["critic/degenerate_group_rate"] = sum(max(e) - min(e) < 1e-9 for e in sampled) / len(sampled)
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
    starts = [rt.next_game_start() for _ in range(rt.share("warmup_groups_per_update"))]
    groups = rt.play(starts, args.group_size, horizon=args.max_turns, max_turns=args.max_turns)
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
    values, datums = score_critic_by_flags(rt, prompts, replies, targets)
    t_critic = time.time()

    # ---- Phase 1, step 4: update the critic only
    metrics = training.refresh_old_logprobs(rt, datums, always=args.ppo_epochs * args.mini_batches > 1)
    metrics |= ppo_update(rt, datums) | training.rollout_metrics(trajectories)
    metrics |= critic_metrics(values, targets, "critic/value_corr") | {
        "warmup/success_rate": sum(t.won for t in trajectories) / max(1, len(trajectories)),
        "warmup/boundary_states": training.SummedMetric(len(states) + too_long),
        "critic/generated_tokens": training.SummedMetric(sum(len(r.tokens) for group in replies for r in group)),
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
    generated = [[k >= 0 for k in starts[i].prefix_step_ids] for i in with_prefix]
    current = training.sequence_logprobs(
        rt.model, rt.accelerator, rows, args.temperature, pad_id, args.micro_batch_tokens, needed=generated
    )
    weights: list[float | None] = [None] * len(starts)
    for i, logprobs in zip(with_prefix, current):
        generated = zip(logprobs, starts[i].prefix_logprobs, starts[i].prefix_step_ids)
        log_ratio = sum(now - old for now, old, k in generated if k >= 0)
        weights[i] = math.exp(min(max(log_ratio, -bound), bound))
    return weights


def td_update(rt: Runtime) -> tuple[dict, list[dict]]:
    args, t0 = rt.args, time.time()
    # ---- Phase 2, step 1: start states from the store by --state-selection; fresh games when it runs short (or by
    # share)
    share = rt.share("groups_per_update")
    taken = rt.store.take(share - round(args.fresh_state_share * share), rt.rng)
    fresh = share - len(taken)
    starts = [state for state, _ in taken] + [rt.next_game_start() for _ in range(fresh)]

    # ---- Phase 2, step 2: restore each state (replay, verified; one that fails is dropped, never fatal) and run N
    # branches for H turns
    groups = rt.play(starts, args.group_size, horizon=args.macro_rounds, max_turns=args.max_turns)
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
    # (--no-td-critic: none sampled, no critic datums)
    targets = [target for _, target, _ in signals]
    start_values, critic_datums = score_critic_by_flags(rt, critic.start_prompts, critic.start_replies, targets)

    # ---- Phase 2, step 6: one update, actor datums (saved prefix + segment) and critic datums (prompt + reply)
    datums = []
    for group, (_, _, advantages), weight in zip(live_groups, signals, weights):
        if not is_degenerate(advantages):
            scale = 1.0 if weight is None else weight
            datums += training.trajectory_datums(group, [[a * scale] * len(t.steps) for t, a in zip(group, advantages)])
    t_critic = time.time()
    actor_tokens = sum(sum(d.mask) for d in datums)
    datums += critic_datums
    metrics = training.refresh_old_logprobs(rt, datums, always=args.ppo_epochs * args.mini_batches > 1)
    metrics |= ppo_update(rt, datums)
    t_update = time.time()

    # ---- Phase 2, step 7: the endpoints (and under outcome the start states) that --state-selection keeps go back
    # into the store
    stored, starts_kept = store_continuations(rt, live_starts, critic, signals)

    metrics |= td_metrics(live_groups, critic, signals, weights, start_values)
    metrics |= store_metrics(rt.store, args.max_turns // args.macro_rounds, args.macro_rounds)
    metrics |= {
        "actor/trained_tokens": training.SummedMetric(actor_tokens),
        "td/fresh_states": training.SummedMetric(fresh),
        "td/new_endpoints": training.SummedMetric(stored),
        "td/endpoints_left_out": training.SummedMetric(len(critic.endpoints) - stored),
        "td/starts_kept": training.SummedMetric(starts_kept),
        "td/oracle_generated_tokens": training.SummedMetric(critic.oracle_tokens),
        "td/restore_failures": training.SummedMetric(len(starts) - len(live_starts)),
        "td/macro_index_mean": statistics.fmean(s.round_index / args.macro_rounds for s in starts),
        **({"td/start_value_mean": statistics.fmean(value for _, value in taken)} if taken else {}),
        "time/rollout": t_rollout - t0,
        "time/critic": t_critic - t_rollout,
        "time/update": t_update - t_critic,
    }
    return metrics, td_samples(live_groups, critic, signals)


def store_continuations(rt: Runtime, live_starts, critic: CriticPass, signals) -> tuple[int, int]:
    """Endpoints with room for another turn (and a critic prompt within budget, so they can be valued again; under
    source any) go back into the store, with their value, if --state-selection keeps them; under outcome only a group
    with a gradient continues: its endpoints, and its start state (valued G) drawn again. Returns (endpoints stored,
    start states kept)."""
    args = rt.args
    gradient = [not is_degenerate(advantages) for _, _, advantages in signals]
    outcome, source = args.state_selection == "outcome", args.state_selection == "source"
    endpoints = zip(critic.endpoints, critic.endpoint_prompts, critic.endpoint_values, critic.endpoint_groups)
    candidates = [
        (t, v)
        for t, p, v, i in endpoints
        if (p is not None or source) and has_room(t, args) and (gradient[i] or not outcome)
    ]
    stored = sum(rt.store.add(traj.saved_state(), value) for traj, value in candidates)
    kept_starts = [(s, g) for s, (_, g, _), kept in zip(live_starts, signals, gradient) if kept] if outcome else []
    for state, value in kept_starts:
        rt.store.add(state, value)
    return stored, len(kept_starts)


@dataclass
class CriticPass:
    """The critic's one batched call of a TD update: E samples on every branch endpoint, K on every start state
    (none with --no-td-critic: they only train it)."""

    branch_values: list[list[float | None]]  # per group and branch: V(endpoint), mean of its parsed samples (0 when
    # all fail or its prompt is over budget); None for a terminal branch (won, at T, or out of tokens mid-segment)
    endpoints: list[common.Trajectory]  # the branches that stopped at the macro boundary
    endpoint_groups: list[int]  # the index of each one's group
    endpoint_values: list[float]  # their values, as in branch_values
    endpoint_prompts: list[list[int] | None]  # None: over budget, never sent
    start_prompts: list[list[int] | None]
    start_replies: list[list[common.Completion]]  # [] when the start state's prompt is over budget (or --no-td-critic)
    endpoint_failures: int  # endpoint samples that did not parse
    generated_tokens: int  # of all critic replies (the actor's are rollout/generated_tokens)
    oracle_tokens: int  # generated by --endpoint-values rollout's continuations (never trained)
    oracle_standard_errors: list[float]  # of each endpoint's value under --endpoint-values rollout (E >= 2)


def critic_pass(rt: Runtime, starts: Sequence[common.SavedState], groups) -> CriticPass:
    """A branch stopped at the macro boundary is valued (also one with no token room for another turn: truncated,
    not ended); every other branch is terminal."""
    E, K = rt.args.endpoint_samples, rt.args.critic_samples if rt.args.td_critic else 0  # K: only to train it
    oracle = rt.args.endpoint_values == "rollout"
    indexed = [(i, t) for i, group in enumerate(groups) for t in group if t.stop_reason == common.STOP_HORIZON]
    endpoints = [t for _, t in indexed]
    endpoint_prompts = [rt.critic_prompt(t.start.game_file, t.start.task, t.messages, t.round_index) for t in endpoints]
    start_prompts = [rt.critic_prompt(s.game_file, s.task, s.messages, s.round_index) for s in starts]
    replies = sample_critic(rt, [(p, 0 if oracle else E) for p in endpoint_prompts] + [(p, K) for p in start_prompts])
    parsed = [[v for v in (parse_value(r.text) for r in group) if v is not None] for group in replies[: len(endpoints)]]
    failures = sum(len(group) - len(values) for group, values in zip(replies, parsed))
    endpoint_values = [statistics.fmean(values) if values else 0.0 for values in parsed]
    continuations = []
    if oracle:  # the ablation: each endpoint's mean Monte-Carlo return under the current policy (a failed restore: 0)
        turns = rt.args.max_turns
        continuations = rt.play([t.saved_state() for t in endpoints], E, horizon=turns, max_turns=turns)
        endpoint_values = [statistics.fmean(t.reward for t in group) if group else 0.0 for group in continuations]
    values = iter(endpoint_values)
    branch_values = [[next(values) if t.stop_reason == common.STOP_HORIZON else None for t in group] for group in groups]
    generated = sum(len(r.tokens) for group in replies for r in group)
    oracle_tokens = sum(sum(len(s.completion_tokens) for s in t.steps) for group in continuations for t in group)
    oracle_standard_errors = [
        statistics.stdev(t.reward for t in group) / math.sqrt(len(group)) for group in continuations if len(group) > 1
    ]
    return CriticPass(
        branch_values,
        endpoints,
        [i for i, _ in indexed],
        endpoint_values,
        endpoint_prompts,
        start_prompts,
        replies[len(endpoints) :],
        failures,
        generated,
        oracle_tokens,
        oracle_standard_errors,
    )


def td_metrics(groups, critic: CriticPass, signals, weights, start_values) -> dict:
    trajectories = [traj for group in groups for traj in group]
    targets = [target for _, target, _ in signals]
    zero_reward_gaps = []
    for group, values in zip(groups, critic.branch_values):
        zero = [v for v, t in zip(values, group) if v is not None and t.reward == 0]
        zero_reward_gaps.append(statistics.pstdev(zero) if len(zero) >= 2 else 0.0)
    metrics = training.rollout_metrics(trajectories)
    if "rollout/success_rate" in metrics:  # a segment's success, not an episode's (that is eval/train/success_rate)
        metrics["td/segment_success_rate"] = metrics.pop("rollout/success_rate")
    metrics |= critic_metrics(start_values, targets, "critic/td_target_corr")
    parsed_weights = [w for w in weights if w is not None]
    if parsed_weights:
        metrics["td/prefix_is_weight_mean"] = statistics.fmean(parsed_weights)
        metrics["td/prefix_is_weight_max"] = training.MaxMetric(max(parsed_weights))
    endpoint_values = [v for values in critic.branch_values for v in values if v is not None]
    if endpoint_values:
        metrics["critic/endpoint_value_mean"] = statistics.fmean(endpoint_values)
    if critic.oracle_standard_errors and len(critic.endpoint_values) > 1:
        # an exact oracle's values differ between endpoints by much more than each one's own sampling error
        metrics["td/oracle_value_se_mean"] = statistics.fmean(critic.oracle_standard_errors)
        metrics["td/oracle_value_sd"] = statistics.stdev(critic.endpoint_values)
    prompts = critic.endpoint_prompts + critic.start_prompts
    return metrics | {
        "critic/endpoint_parse_failures": training.SummedMetric(critic.endpoint_failures),
        "critic/generated_tokens": training.SummedMetric(critic.generated_tokens),
        "critic/prompt_too_long_rate": sum(p is None for p in prompts) / max(1, len(prompts)),
        "actor/segment_reward_mean": statistics.fmean(t.reward for t in trajectories) if trajectories else 0.0,
        "actor/degenerate_group_rate": sum(is_degenerate(a) for _, _, a in signals) / max(1, len(groups)),
        "actor/macro_boundary_rate": len(critic.endpoints) / max(1, len(trajectories)),
        "actor/value_gap_zero_reward": statistics.fmean(zero_reward_gaps) if zero_reward_gaps else 0.0,
    }


def store_metrics(store: StateStore, macro_steps: int, macro_rounds: int) -> dict:
    """The store after the update: its size, mean value, and the share of its states at each macro index (1 .. T/H - 1:
    an endpoint is a boundary after at least one macro step, before the last; 0 too once a kept fresh start is in)."""
    metrics = {"td/store_size": training.SummedMetric(len(store))}
    if store.entries:
        indices = [state.round_index // macro_rounds for state, _ in store.entries]
        metrics["td/store_value_mean"] = statistics.fmean(value for _, value in store.entries)
        metrics["td/store_macro_index_mean"] = statistics.fmean(indices)
        shown = sorted({*range(1, macro_steps), *indices})
        metrics |= {f"td/store_macro_index_{k}_share": indices.count(k) / len(indices) for k in shown}
    return metrics


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
# Main: warm-up updates, then TD updates
# =============================================================================================
# fork 6: main: the update loop, RESUME_MAY_CHANGE, POSTFIX_KEYS, PRESETS
RESUME_MAY_CHANGE = ("td_updates",)  # flags that only extend a run
POSTFIX_KEYS = ("critic/abs_error_mean", "critic/value_corr", "td/segment_success_rate", "td/fresh_states", "train/loss")
PRESETS = {  # name -> (what it is, its values); `python tempo.py NAME --flags`
    "smoke": (
        "the offline smoke run: tiny random model, generated games, 2 warm-up + 4 TD updates, CPU (~30 s)",
        Args(
            model="tiny",
            warmup_updates=2,
            td_updates=4,
            macro_rounds=2,
            max_turns=6,
            warmup_groups_per_update=2,
            max_turn_tokens=32,
            max_critic_tokens=32,
            max_trajectory_tokens=8192,
            eval_every=6,
            eval_games=2,
        ),
    ),
    "learning": (
        "the CPU learning benchmark's recipe: tiny agent, its 4 games, T 6, H 3, 3 warm-up + 9 TD updates (~2-3 min)",
        Args(
            **harness.LEARNING_SETTINGS["learning"],
            macro_rounds=3,
            max_turns=6,
            group_size=4,
            critic_samples=4,
            endpoint_samples=1,
            groups_per_update=4,
            warmup_updates=3,
            warmup_groups_per_update=4,
            td_updates=9,
            max_critic_tokens=16,
        ),
    ),
    "learning-long": (
        "the long-horizon CPU benchmark's recipe: tiny-agent-long, pick two / clean / cool, T 20, H 5, 3 + 21 updates",
        Args(
            # lr 3e-4, not the others' 1e-3: an update trains ~1/5 of GRPO's tokens, and at 1e-3 3 of 5 seeds fell
            # while at 3e-4 none did (docs/does-it-learn.md)
            **{**harness.LEARNING_SETTINGS["learning-long"], "learning_rate": 3e-4},
            macro_rounds=5,
            max_turns=20,
            group_size=4,
            critic_samples=4,
            endpoint_samples=1,
            groups_per_update=4,
            warmup_updates=3,
            warmup_groups_per_update=4,
            td_updates=21,  # 3 + 21 updates: about the generated tokens of the others' 12 (docs/does-it-learn.md)
            max_critic_tokens=16,
        ),
    ),
    # agentic-rl-lab/09-tempo, the reproduction's defaults: Qwen3.5-4B, H = 10, T = 50, N = K = 4, 2 endpoint samples,
    # 4 warm-up + 40 TD updates, LoRA 32, lr 1e-6, AdamW betas 0.9 / 0.95, its state store (docs/tempo.md)
    "source": (
        "09-tempo's settings (agentic-rl-lab): Qwen3.5-4B, H 10, T 50, N = K = 4, 2 endpoint samples, 4 + 40 updates",
        Args(
            model="Qwen/Qwen3.5-4B",
            macro_rounds=10,
            max_turns=50,
            group_size=4,
            critic_samples=4,
            endpoint_samples=2,
            warmup_updates=4,
            td_updates=40,
            max_trajectory_tokens=12000,  # rollout.py's MAX_SEQUENCE_TOKENS (docs/tempo.md)
            lora_rank=32,
            lora_alpha=64,
            learning_rate=1e-6,
            adam_betas=(0.9, 0.95),
            state_selection="source",
            keep_checkpoints=3,
        ),
    ),
}


def main(args: Args) -> Path:
    """Train (or evaluate, with --eval-only); returns the run directory."""
    with harness.training_job(args, ALGORITHM, validate_args, RESUME_MAY_CHANGE) as job:
        args = job.args  # as the run uses them (the data root resolved)
        with harness.startup_errors():  # endpoint checks
            rt = Runtime(args, job.accelerator)
        if args.eval_only:
            return harness.evaluate_checkpoint(job, rt, args.max_turns)
        run = harness.Run(job, rt, args.warmup_updates + args.td_updates, POSTFIX_KEYS)  # resumes a checkpoint
        for update in run.updates():
            phase = "warmup" if update <= args.warmup_updates else "td"
            metrics, samples = warmup_update(rt) if phase == "warmup" else td_update(rt)
            metrics = run.gather(metrics)
            if run.evaluates(update):
                metrics |= harness.evaluate(rt, args.max_turns)
            run.log(update, {"phase": phase, **metrics}, samples)
            run.checkpoint(update, {"phase": phase})
        return run.close()


if __name__ == "__main__":
    harness.cli(Args, main, PRESETS)
