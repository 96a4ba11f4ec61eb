"""ADCA-GRPO: multi-turn GRPO where an LLM labels every step GOOD or BAD (AgentEvolver's `decouple` scheme).

Per update: play G games x N full episodes each (one GRPO group per game), score each trajectory 0/1
(won), ask a labeller to judge every step GOOD or BAD (ONE request per trajectory, showing the task and first
observation, the agent's numbered replies with the game's answers, and the outcome as +1/-1), z-score the labels
and the outcomes separately within each group, fuse them per step (alpha * labels + outcome on the last step),
take suffix sums as the step advantages, broadcast them to the generated tokens, and take PPO-clip steps on a LoRA
adapter. With `--no-attribution`, `--alpha 0` or after `--prm-steps` updates it is per-episode GRPO (the
learning benchmark's baseline): every generated token gets its episode's GRPO outcome advantage.

    python adca_grpo.py --labeler-base-url http://localhost:8000/v1 --labeler-model Qwen/Qwen3-32B
    python adca_grpo.py --labeler-backend self      # the policy labels its own steps: no endpoint, no key
    python adca_grpo.py --no-attribution            # per-episode GRPO
    python adca_grpo.py --model tiny --help
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import re
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import openai

import common
import harness
import training

# fork 1: the algorithm's name (a checkpoint carries it; another algorithm's is refused), its constants, the docstring
ALGORITHM = "adca_grpo"
ORM_DISTRIBUTIONS = ("last_step", "all_steps", "only_prm")
PERMANENT_HTTP_ERRORS = (400, 401, 403, 404, 422)  # a labeller request that got one of these is not retried


# fork 2: the algorithm's flags in Args (harness.SharedArgs / PPOArgs hold the shared ones) and validate_args
@dataclass
class Args(harness.PPOArgs):
    exp_name: str = ALGORITHM
    """run name prefix: runs/{exp_name}__{seed}__{time}"""
    # ---- GRPO ----
    max_turns: int = 30
    """T: turns per episode (the rollout horizon)"""
    clip_eps_high: float | None = 0.28
    """PPO clip range above 1 (DAPO's clip-higher, AgentEvolver's 0.28); None = --clip-eps"""
    kl_beta: float = 0.0
    """weight of the per-token KL to the base model (the adapter disabled) subtracted from the advantage; 0 = off"""
    # ---- ADCA: step attribution ----
    attribution: bool = True
    """label steps and use the labels (--no-attribution: per-episode GRPO)"""
    alpha: float = 0.1
    """weight of the z-scored step labels next to the z-scored outcome (0 = per-episode GRPO)"""
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
    """label only during the first N updates (cost control), per-episode GRPO after"""
    prm_metrics_only: bool = False
    """label and log the prm/ dashboard, but train with per-episode GRPO advantages (to judge a labeller first)"""
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


def validate_args(args: Args) -> None:
    harness.validate_ppo_args(args)  # the shared flags, PPOArgs' and every Literal flag's choices
    harness.check_bounds(args, ">= 1", "labeler_concurrency", "labeler_max_attempts", "labeler_max_new_tokens")
    harness.check_bounds(args, ">= 1", "labeler_circuit_failures", "labeler_max_step_chars")
    harness.check_bounds(args, "> 0", "fix_base", "labeler_timeout_s", "labeler_deadline_s")
    harness.check_bounds(args, ">= 0", "kl_beta", "alpha", "prm_steps", "labeler_error_backoff_s")
    harness.check_bounds(args, ">= 0", "labeler_error_backoff_cap_s", "labeler_rate_limit_backoff_s")
    harness.check_bounds(args, ">= 0", "labeler_rate_limit_backoff_cap_s")
    harness.require_all(
        (
            args.group_size >= 2,
            f"--group-size must be >= 2 (GRPO compares within a group), got {args.group_size}",
        ),
        (
            args.lora_rank > 0 or args.kl_beta == 0,
            "--kl-beta needs --lora-rank >= 1 (the reference is the model with its adapter disabled)",
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


# fork 3: the algorithm's signals and prompts: functions of trajectories, replies and flags (no Runtime)
# =============================================================================================
# ADCA advantages (update steps 2, 4 and 5): AgentEvolver's decouple fusion of labels and outcomes, the per-episode GRPO
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
    """The per-episode GRPO baseline's outcome advantage, as veRL computes it for AgentEvolver's trainer:
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
    harness.require_all(
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
    """The advantage of every step. decouple=None: per-episode GRPO, every step gets its episode's
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
            self.tokenizer.apply_chat_template(
                r.messages,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                enable_thinking=self.args.enable_thinking,  # the actor's switch (a template without one ignores it)
            )
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
        "prm/label_requests": training.SummedMetric(len(requests)),
        "prm/label_failures": training.SummedMetric(failures),
        "prm/parse_failures": training.SummedMetric(sum(labels is None for labels in parsed) - failures),
        "prm/skipped": training.SummedMetric(sum(bool(traj.steps) for traj in trajectories) - len(requests)),
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
        "prm/label_requests": training.SummedMetric(sum(asked)),
        "prm/label_failures": training.SummedMetric(0),
        "prm/parse_failures": training.SummedMetric(0),
        "prm/skipped": training.SummedMetric(sum(bool(traj.steps) for traj in trajectories) - sum(asked)),
        "prm/good_rate": _mean([flag for labels, ask in zip(flags, asked) if ask for flag in labels]),
    }
    return flags, metrics


# =============================================================================================
# When to label, and with which decouple settings
# =============================================================================================
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
    """The decouple settings that shape update `update`'s advantages, or None: per-episode GRPO (no labels in
    this update, or --prm-metrics-only), whatever the decouple flags say."""
    return decouple_settings(args, update) if labelling_at(update, args) and not args.prm_metrics_only else None


def labeler_backend(args: Args) -> str:
    """--labeler-backend auto: the api when an endpoint is configured, else the policy itself."""
    if args.labeler_backend != "auto":
        return args.labeler_backend
    return "api" if args.labeler_base_url else "self"


# fork 4: Runtime: what the updates need besides harness.Runtime's games, model, optimizer, protocol and samplers
# (what a checkpoint keeps of it goes into state_dict / load_state_dict); the training call: training.ppo_update, or
# the algorithm's own policy_loss and ppo_update
class Runtime(harness.Runtime):
    def __init__(self, args: Args, accelerator):
        """The labeller first (an api one checks its key and its endpoint before the model loads, and gets this
        process's share of --labeler-concurrency), then harness.Runtime's parts and the label log."""
        rank, processes = accelerator.process_index, accelerator.num_processes
        backend = labeler_backend(args) if needs_labels(args) else None
        self.labeler: Callable[[Sequence[LabelRequest]], list[LabelReply]] | None = None  # None: per-episode GRPO
        if backend == "api":
            harness.require_all(
                (
                    args.labeler_concurrency >= processes,
                    f"--labeler-concurrency ({args.labeler_concurrency}) must be >= the number of processes "
                    f"({processes}): it bounds all of them together",
                )
            )
            share = args.labeler_concurrency // processes + (rank < args.labeler_concurrency % processes)
            self.labeler = ApiLabeler(args, share)
            self.labeler.check_endpoint()
        self.label_log = None
        if args.labeler_log_dir:
            log_dir = harness.require_writable_dir(args.labeler_log_dir, "--labeler-log-dir")
            self.label_log = log_dir / f"labels_rank{rank}.jsonl"
        super().__init__(args, accelerator)
        if backend in ("self", "oracle"):
            self.labeler = (
                oracle_labeler if backend == "oracle" else PolicyLabeler(self.greedy_fn, self.tokenizer, args)
            )


def add_reference_logprobs(rt: Runtime, datums: list[training.Datum]) -> dict:
    """The base model's logprobs on the datums: kept for the loss's KL term (--kl-loss-coef), and the KL as per-token
    shaping of the advantage (--kl-beta: E[grad log p * (log p - log p_ref)] is its gradient). Returns train/kl."""
    args = rt.args
    reference = training.trained_logprobs(rt, datums, reference=True)
    log_ratios = []
    for datum, ref in zip(datums, reference):
        datum.ref_logprobs = ref if args.kl_loss_coef > 0 else None
        for t, trained in enumerate(datum.mask):
            if trained:
                log_ratios.append(datum.old_logprobs[t] - ref[t])
                datum.advantages[t] -= args.kl_beta * log_ratios[-1]
    return {"train/kl": _mean(log_ratios)}


# fork 5: the updates -> (metrics, samples) and their helpers; a metric that counts something is a training.SummedMetric
# =============================================================================================
# One ADCA-GRPO update
# =============================================================================================
def adca_update(rt: Runtime, update: int) -> tuple[dict, list[dict]]:
    args, t0 = rt.args, time.time()
    # ---- step 1: roll out G games x N full episodes
    groups = rt.rollout_groups()  # --async-steps K: sampled ahead, at most K versions behind
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
    # (--prm-metrics-only: only logged); without labels, per-episode GRPO
    if labelling:
        metrics |= decouple_health_metrics(orm_scores, step_flags, group_ids, **decouple_settings(args, update))
    advantages_per_step = step_advantages(orm_scores, step_flags, group_ids, trained_decouple(args, update))

    # ---- step 6: broadcast each step's advantage to the tokens generated at that step
    datums = training.trajectory_datums(trajectories, advantages_per_step)
    metrics |= training.refresh_old_logprobs(rt, datums, always=args.ppo_epochs * args.mini_batches > 1)
    if (args.kl_beta > 0 or args.kl_loss_coef > 0) and datums:
        metrics |= add_reference_logprobs(rt, datums)

    # ---- step 7: PPO-clip, --ppo-epochs passes of --mini-batches optimizer steps each
    metrics |= training.ppo_update(rt, datums)
    t_update = time.time()

    metrics |= training.rollout_metrics(trajectories) | training.group_metrics(groups)
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
    skipped trajectory (per-episode GRPO does not read them)."""
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


# =============================================================================================
# Main: the update loop
# =============================================================================================
# fork 6: main: the update loop, RESUME_MAY_CHANGE, POSTFIX_KEYS, PRESETS
# Flags that only extend a run, or change how the labeller is reached rather than who labels.
RESUME_MAY_CHANGE = tuple(
    "num_updates labeler_base_url labeler_api_key_env labeler_concurrency labeler_timeout_s labeler_deadline_s "
    "labeler_max_attempts labeler_circuit_failures labeler_rate_limit_backoff_s labeler_rate_limit_backoff_cap_s "
    "labeler_error_backoff_s labeler_error_backoff_cap_s labeler_log_dir".split()
)
POSTFIX_KEYS = ("rollout/success_rate", "prm/good_rate", "prm/label_failures", "train/loss")
PRESETS = {  # name -> (what it is, its values); `python adca_grpo.py NAME --flags`
    "smoke": (
        "the offline smoke run: tiny random model, generated games, 3 updates, the policy labels itself, CPU (~20 s)",
        Args(
            model="tiny",
            num_updates=3,
            groups_per_update=2,
            group_size=4,
            max_turns=4,
            max_turn_tokens=48,
            labeler_backend="self",
            labeler_max_new_tokens=64,
            skip_type="none",
            eval_games=2,
            eval_every=3,
        ),
    ),
    "learning": (
        "the CPU learning benchmark's recipe: tiny agent, its 4 games, 12 updates of 4 x 4, oracle labels (~2-3 min)",
        Args(
            **harness.LEARNING_SETTINGS["learning"],
            num_updates=12,
            groups_per_update=4,
            group_size=4,
            max_turns=6,
            labeler_backend="oracle",
            prm_steps=12,
        ),
    ),
    "learning-long": (
        "the long-horizon CPU benchmark's recipe: tiny-agent-long, pick two / clean / cool games, T 20, oracle labels",
        Args(
            **harness.LEARNING_SETTINGS["learning-long"],
            num_updates=12,
            groups_per_update=4,
            group_size=4,
            max_turns=20,
            labeler_backend="oracle",
            prm_steps=12,
        ),
    ),
    # modelscope/AgentEvolver@a5a8db8, config/agentevolver.yaml with its veRL fallback and the labeller's call: every
    # value's file and line, and what is not expressible here, in docs/adca_grpo.md
    "source": (
        "AgentEvolver's config/agentevolver.yaml: 32 tasks x 8, 30 steps, T 0.9, KL loss 0.001, 4 mini-batches",
        Args(
            model="Qwen/Qwen2.5-14B-Instruct",
            groups_per_update=32,
            group_size=8,
            max_turns=30,
            max_turn_tokens=4096,
            max_trajectory_tokens=25580,
            temperature=0.9,
            learning_rate=1e-6,
            adam_betas=(0.9, 0.999),
            weight_decay=0.01,
            kl_loss_coef=0.001,
            mini_batches=4,
            clip_eps_high=0.28,
            alpha=0.1,
            fix_base=0.2,
            prm_steps=100,
            skip_type="none",
            orm_distribution="last_step",
            equal_trajectory_weight=True,
            labeler_concurrency=20,
            labeler_max_attempts=200,
            labeler_max_new_tokens=8192,
            keep_checkpoints=3,
        ),
    ),
}


def main(args: Args) -> Path:
    """Train (or evaluate, with --eval-only); returns the run directory."""
    with harness.training_job(args, ALGORITHM, validate_args, RESUME_MAY_CHANGE) as job:
        args = job.args  # as the run uses them (the data root resolved)
        with harness.startup_errors():  # labeller and sampler endpoint checks
            rt = Runtime(args, job.accelerator)
        if args.eval_only:
            return harness.evaluate_checkpoint(job, rt, args.max_turns)
        run = harness.Run(job, rt, args.num_updates, POSTFIX_KEYS)  # resumes a checkpoint
        if run.done and rt.label_log is not None:
            harness.drop_rows_after(rt.label_log, run.done)  # a resumed update labels again
        labeler = labeler_backend(args) if rt.labeler is not None else "none"
        for update in run.updates():
            metrics, samples = adca_update(rt, update)
            metrics = run.gather(metrics)
            if run.evaluates(update):
                metrics |= harness.evaluate(rt, args.max_turns)
            run.log(update, {"labeler": labeler, **metrics}, samples)
            run.checkpoint(update, {"labeler": labeler})
        return run.close()


if __name__ == "__main__":
    harness.cli(Args, main, PRESETS)
