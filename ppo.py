"""PPO with a scalar value head for multi-turn ALFWorld agents: the learned critic (CleanRL style).

Per update: play G games x N full episodes. A value head, a linear layer on the policy's last hidden state at the last
prompt token of each turn (the LoRA trunk is shared with the policy), gives V(s_t) of the state before turn t. The
turn rewards (1 on the winning turn, an optional invalid-action penalty) and those values give turn-level GAE
advantages, A_t = delta_t + gamma lam A_{t+1} with delta_t = r_t + gamma V(s_{t+1}) - V(s_t) (V after the last turn:
0, every episode ends), normalised over the update's tokens and given to every token generated at turn t. One loss
trains both: PPO-clip on the policy (dual clip, an optional k3 KL loss to the base model) plus --vf-coef times the
clipped value loss against the returns A_t + V(s_t). An optional warm-up trains only the value head first, on
Monte-Carlo returns, so that the advantages start from a critic that has seen the task. `# Eq. N` marks an equation
of the PPO paper (Schulman et al. 2017, arXiv:1707.06347); the clipped loss itself is training.ppo_clip_loss (Eq. 7).

    python ppo.py                                 # verl-agent's ALFWorld PPO settings where they apply
    python ppo.py --value-warmup-updates 3        # the critic first, as TEMPO's phase 1
    python ppo.py --model tiny --help
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

import common
import harness
import training

# fork 1: the algorithm's name (a checkpoint carries it; another algorithm's is refused), its constants, the docstring
ALGORITHM = "ppo"
EPS = 1e-8  # veRL's epsilon under the whitening's variance


# fork 2: the algorithm's flags in Args (harness.SharedArgs / PPOArgs hold the shared ones) and validate_args
@dataclass
class Args(harness.PPOArgs):
    exp_name: str = ALGORITHM
    """run name prefix: runs/{exp_name}__{seed}__{time}"""
    # ---- PPO (defaults: verl-agent's ALFWorld PPO run where they apply; docs/ppo.md says which) ----
    groups_per_update: int = 64
    """G: games per update (all processes together: each plays G / processes)"""
    group_size: int = 1
    """N: episodes sampled per game (PPO compares nothing within a group; verl-agent: 1)"""
    gamma: float = 1.0
    """discount per turn in GAE (veRL: 1)"""
    lam: float = 1.0
    """GAE lambda (veRL: 1, the Monte-Carlo return less V; 0: one-turn TD)"""
    vf_coef: float = 0.5
    """weight of the value loss in the shared loss (veRL trains a separate critic and has none; CleanRL: 0.5)"""
    vf_clip: float | None = 0.5
    """the value loss is the larger of the errors of V and of V clipped to old V +- this (veRL: 0.5); None = off"""
    normalize_advantages: bool = True
    """whiten the advantages over the update's generated tokens, all processes (veRL's masked whitening)"""
    value_warmup_updates: int = 0
    """the first this many updates train only the value head (and the trunk under it) on Monte-Carlo returns"""
    invalid_action_penalty: float = 0.0
    """subtracted from the reward of a turn whose reply held no valid tool call, in units of the win reward
    (verl-agent's 0.1 against a win of 10 is 0.01)"""


def validate_args(args: Args) -> None:
    harness.validate_ppo_args(args)  # the shared flags, PPOArgs' and every Literal flag's choices
    harness.check_bounds(args, ">= 1", "group_size")
    harness.check_bounds(args, "> 0", "vf_clip")
    harness.check_bounds(args, ">= 0", "vf_coef", "value_warmup_updates", "invalid_action_penalty")
    harness.require_all(
        (0 <= args.gamma <= 1, f"--gamma must lie in [0, 1], got {args.gamma}"),
        (0 <= args.lam <= 1, f"--lam must lie in [0, 1], got {args.lam}"),
        (
            args.value_warmup_updates < args.num_updates,
            f"--value-warmup-updates ({args.value_warmup_updates}) must be below --num-updates ({args.num_updates})",
        ),
    )


# fork 3: the algorithm's signals and prompts: functions of trajectories, replies and flags (no Runtime)
# =============================================================================================
# Turn-level GAE (update steps 2-4): rewards, value positions, advantages and returns, the value fields of a datum
# =============================================================================================
def gae_advantages(
    rewards: Sequence[float], values: Sequence[float], gamma: float, lam: float, last_value: float = 0.0
) -> tuple[list[float], list[float]]:
    """(advantages, returns) of one trajectory's turns: values[t] = V(s_t), the state before turn t; last_value = V of
    the state after the last turn (0 when the episode ended). delta_t = r_t + gamma V(s_{t+1}) - V(s_t),
    A_t = delta_t + gamma lam A_{t+1}, returns = A + V. lam 1: the Monte-Carlo return less V; lam 0: one-step TD."""
    harness.require_all((len(rewards) == len(values), f"{len(rewards)} rewards but {len(values)} values"))
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(values) else last_value
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running  # Eq. 11-12 (truncated GAE)
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values)]


def turn_rewards(traj: common.Trajectory, invalid_action_penalty: float) -> list[float]:
    """r_t: 1 on the winning turn, less the penalty on a turn whose reply held no valid tool call."""
    return [step.reward - invalid_action_penalty * (not step.valid) for step in traj.steps]


def value_positions(traj: common.Trajectory) -> list[int]:
    """Per turn, the position of its prompt's last token in the trajectory's sequence: its hidden state has read
    the state s_t the turn acts in (and predicts the turn's first token)."""
    return [step.prompt_length - 1 for step in traj.steps]


def value_datums(trajectories, advantages, values, returns) -> list[training.Datum]:
    """trajectory_datums (each turn's advantage on its generated tokens), each with three extra fields at the turns'
    value positions (0 elsewhere): value_weight (the turn's generated tokens), old_value (V(s_t) at the rollout) and
    value_return (the target)."""
    datums = []
    for datum, traj, turn_values, turn_returns in zip(
        training.trajectory_datums(trajectories, advantages), trajectories, values, returns
    ):
        extra = {name: [0.0] * len(datum.tokens) for name in ("value_weight", "old_value", "value_return")}
        for position, step, value, target in zip(value_positions(traj), traj.steps, turn_values, turn_returns):
            extra["value_weight"][position] = float(len(step.completion_tokens))
            extra["old_value"][position], extra["value_return"][position] = value, target
        datums.append(dataclasses.replace(datum, extra=extra))
    return datums


def explained_variance(values: Sequence[float], returns: Sequence[float]) -> float:
    """1 - Var(R - V) / Var(R) over the turns (1: V predicts the returns; 0: no better than their mean)."""
    mean = math.fsum(returns) / max(1, len(returns))
    total = math.fsum((r - mean) ** 2 for r in returns)
    residual_mean = math.fsum(r - v for r, v in zip(returns, values)) / max(1, len(returns))
    residual = math.fsum((r - v - residual_mean) ** 2 for r, v in zip(returns, values))
    return 1.0 - residual / total if total > 0 else float("nan")


# fork 4: Runtime: what the updates need besides harness.Runtime's games, model, optimizer, protocol and samplers
# (what a checkpoint keeps of it goes into state_dict / load_state_dict); the training call: training.ppo_update, or
# the algorithm's own policy_loss and ppo_update
class ValueHead(torch.nn.Linear):
    """V(s) = w . h + b on the policy's last hidden state h, zero at the start (the return of a lost episode)."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size, 1)
        torch.nn.init.zeros_(self.weight)
        torch.nn.init.zeros_(self.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden.float()).squeeze(-1)


class Runtime(harness.Runtime):
    """The shared games, model, optimizer, protocol and samplers, and the value head (rt.heads["value"]: the
    optimizer steps it with the policy, checkpoints keep it)."""

    def make_heads(self, config) -> dict[str, torch.nn.Module]:
        return {"value": ValueHead(config.get_text_config().hidden_size)}


def policy_loss(
    logprobs: torch.Tensor,
    batch: dict[str, torch.Tensor],
    total_tokens: float,
    *,
    value_head: torch.nn.Module | None = None,
    vf_coef: float = 0.5,
    vf_clip: float | None = 0.5,
    **clip_settings,
) -> tuple[torch.Tensor, dict[str, float]]:
    """train_step's loss: training.ppo_clip_loss (PPO-clip per generated token, dual clip, k3 KL; clip_settings) plus
    vf_coef x the value loss, token mean over the update. Value: V(s_t) read by the head at each turn's last prompt
    token (value_weight > 0), 0.5 max((V - R)^2, (clip(V, old V +- vf_clip) - R)^2), weighted by the turn's generated
    tokens (value_weight): the token mean of a critic that gives every token of turn t the value V(s_t). Without a
    value head (a policy-only train_step) the PPO-clip loss alone."""
    loss, stats = training.ppo_clip_loss(logprobs, batch, total_tokens, **clip_settings)
    if value_head is None:
        return loss, stats
    turns = batch["value_weight"] > 0
    weight, old, target = batch["value_weight"][turns], batch["old_value"][turns], batch["value_return"][turns]
    values = value_head(batch["hidden_states"][turns])
    error = (values - target) ** 2
    stats["value_clip_frac"] = 0.0
    if vf_clip is not None:
        clipped_error = (old + (values - old).clamp(-vf_clip, vf_clip) - target) ** 2
        stats["value_clip_frac"] = ((clipped_error > error).float() * weight).sum().item()
        error = torch.maximum(error, clipped_error)
    value_loss = 0.5 * (error * weight).sum()
    stats["value_loss"] = value_loss.item()
    return loss + vf_coef * value_loss / total_tokens, stats


def ppo_update(rt: Runtime, datums: list[training.Datum], warmup: bool = False) -> dict:
    """The loss with the run's clip, dual-clip, KL and value settings over --ppo-epochs x --mini-batches steps; in a
    warm-up update no KL term and no value clip (the advantages are 0: the value loss alone trains)."""
    args = rt.args
    loss_fn = functools.partial(
        policy_loss,
        value_head=rt.heads["value"],
        vf_coef=args.vf_coef,
        vf_clip=None if warmup else args.vf_clip,
        clip_eps=args.clip_eps,
        clip_eps_high=args.clip_eps_high,
        dual_clip_c=args.dual_clip_c,
        kl_loss_coef=0.0 if warmup else args.kl_loss_coef,
    )
    metrics = training.ppo_steps(rt, datums, loss_fn, args.ppo_epochs, args.mini_batches)
    for name in ("loss", "clip_frac"):  # the loss's value terms, per trained token as train_step reports them
        metrics[f"value/{name}"] = metrics.pop(f"train/value_{name}", 0.0)
    return metrics


@torch.no_grad()
def state_values(rt: Runtime, trajectories: Sequence[common.Trajectory]) -> list[list[float]]:
    """V(s_t) of every turn of every trajectory under the current trunk and head."""
    sequences = [traj.sequence()[0] for traj in trajectories]
    hidden = training.hidden_states_at(rt, sequences, [value_positions(traj) for traj in trajectories])
    return [rt.heads["value"](states).tolist() for states in hidden]


def normalized(rt: Runtime, advantages: list[list[float]], tokens: list[list[int]]) -> list[list[float]]:
    """The turn advantages whitened over the generated tokens of the update on every process (each turn counts once
    per token it generated), as veRL whitens token advantages: (A - mean) / sqrt(unbiased var + 1e-8)."""
    sums = [0.0, 0.0, 0.0]
    for row, counts in zip(advantages, tokens):
        for a, n in zip(row, counts):
            sums = [sums[0] + n, sums[1] + n * a, sums[2] + n * a * a]
    device = rt.accelerator.device
    n, total, squares = rt.accelerator.reduce(torch.tensor(sums, dtype=torch.float64, device=device), "sum").tolist()
    if n < 2:
        return advantages
    mean = total / n
    var = max(0.0, squares - n * mean * mean) / (n - 1)
    return [[(a - mean) / math.sqrt(var + EPS) for a in row] for row in advantages]


# fork 5: the updates -> (metrics, samples) and their helpers; a metric that counts something is a training.SummedMetric
# =============================================================================================
# One PPO update (a value warm-up update: the value loss on Monte-Carlo returns alone)
# =============================================================================================
def gae_update(rt: Runtime, warmup: bool = False) -> tuple[dict, list[dict]]:
    args, t0 = rt.args, time.time()
    # ---- step 1: roll out G games x N full episodes
    groups = rt.rollout_groups()  # --async-steps K: sampled ahead, at most K versions behind
    trajectories = [traj for group in groups for traj in group]
    t_rollout = time.time()

    # ---- step 2: per turn the reward r_t and V(s_t), the value head on the last prompt token's hidden state
    rewards = [turn_rewards(traj, args.invalid_action_penalty) for traj in trajectories]
    values = state_values(rt, trajectories)

    # ---- step 3: turn-level GAE (every episode has ended: V after its last turn is 0); in the warm-up the targets
    # are the Monte-Carlo returns (lam 1) and the policy is not trained
    gae = [gae_advantages(r, v, args.gamma, 1.0 if warmup else args.lam) for r, v in zip(rewards, values)]
    advantages, returns = [a for a, _ in gae], [ret for _, ret in gae]
    tokens = [[len(step.completion_tokens) for step in traj.steps] for traj in trajectories]
    trained = [[0.0] * len(row) for row in advantages] if warmup else advantages
    if args.normalize_advantages and not warmup:
        trained = normalized(rt, advantages, tokens)

    # ---- step 4: each turn's advantage on its generated tokens; its V(s_t) and return at its value position
    datums = value_datums(trajectories, trained, values, returns)
    metrics = training.refresh_old_logprobs(rt, datums, always=args.ppo_epochs * args.mini_batches > 1)
    if args.kl_loss_coef > 0 and not warmup and datums:
        training.add_reference_logprobs(rt, datums)

    # ---- step 5: PPO-clip plus the clipped value loss (the warm-up: unclipped), --ppo-epochs x --mini-batches steps
    metrics |= ppo_update(rt, datums, warmup)
    t_update = time.time()

    metrics |= training.rollout_metrics(trajectories) | training.group_metrics(groups)
    flat_values, flat_returns = [v for row in values for v in row], [r for row in returns for r in row]
    metrics["value/mean"] = math.fsum(flat_values) / max(1, len(flat_values))
    metrics["value/return_mean"] = math.fsum(flat_returns) / max(1, len(flat_returns))
    metrics["value/explained_variance"] = explained_variance(flat_values, flat_returns)
    metrics["value/warmup"] = float(warmup)
    flat = [abs(a) for row in advantages for a in row]
    metrics["actor/advantage_abs_mean"] = math.fsum(flat) / max(1, len(flat))  # before whitening
    metrics |= {"time/rollout": t_rollout - t0, "time/update": t_update - t_rollout}
    return metrics, update_samples(trajectories[:2], rewards, values, returns, trained)


def update_samples(trajectories, rewards, values, returns, advantages) -> list[dict]:
    """The given trajectories, readable, with per turn its reward, V(s_t), return and advantage as trained, for
    samples.jsonl."""
    return [
        {
            "game": traj.start.game_file,
            "task": traj.start.task,
            "won": traj.won,
            "stop_reason": traj.stop_reason,
            "turn_rewards": rewards[i],
            "turn_values": values[i],
            "turn_returns": returns[i],
            "turn_advantages": advantages[i],  # as trained
            "messages": traj.messages[len(traj.start.messages) :],
        }
        for i, traj in enumerate(trajectories)
    ]


# =============================================================================================
# Main: the update loop
# =============================================================================================
# fork 6: main: the update loop, RESUME_MAY_CHANGE, POSTFIX_KEYS, PRESETS
RESUME_MAY_CHANGE = ("num_updates",)  # flags that only extend a run
POSTFIX_KEYS = ("rollout/success_rate", "value/explained_variance", "train/loss")
PRESETS = {  # name -> (what it is, its values); `python ppo.py NAME --flags`
    "smoke": (
        "the offline smoke run: tiny random model, generated games, 3 updates (1 value warm-up), CPU (~2 min, busy)",
        Args(
            model="tiny",
            num_updates=3,
            groups_per_update=2,
            group_size=4,
            max_turns=4,
            max_turn_tokens=48,
            invalid_action_penalty=0.01,  # the random model never calls a tool: returns -0.01 per turn left to train V
            value_warmup_updates=1,
            eval_games=2,
            eval_every=3,
        ),
    ),
    "learning": (
        "the CPU learning benchmark's recipe: tiny agent, its 4 games, 12 updates of 4 x 4 (~2-3 min)",
        Args(
            **harness.LEARNING_SETTINGS["learning"],
            clip_eps_high=0.28,  # adca_grpo.py's: one clip for every ranking arm (never acts at 1 step)
            num_updates=12,
            groups_per_update=4,
            group_size=4,
            max_turns=6,
        ),
    ),
    "learning-long": (
        "the long-horizon CPU benchmark's recipe: tiny-agent-long, pick two / clean / cool games, T 20",
        Args(
            **harness.LEARNING_SETTINGS["learning-long"],
            num_updates=12,
            groups_per_update=4,
            group_size=4,
            max_turns=20,
        ),
    ),
    # langfengQ/verl-agent@796ed31, examples/ppo_trainer/run_alfworld.sh with veRL's ppo_trainer.yaml: every value's
    # file and line, and what is not expressible here, in docs/ppo.md
    "source": (
        "verl-agent's ALFWorld PPO run: 128 games x 1, 50 steps, lr 1e-6, GAE 1 / 1, KL loss 0.01, penalty 0.1 of 10",
        Args(
            model="Qwen/Qwen2.5-1.5B-Instruct",
            num_updates=150,
            groups_per_update=128,
            group_size=1,
            max_turns=50,
            learning_rate=1e-6,
            adam_betas=(0.9, 0.999),
            weight_decay=0.01,
            gamma=1.0,
            lam=1.0,
            vf_clip=0.5,
            kl_loss_coef=0.01,
            invalid_action_penalty=0.01,
            eval_temperature=0.4,
            keep_checkpoints=3,
        ),
    ),
}


def main(args: Args) -> Path:
    """Train (or evaluate, with --eval-only); returns the run directory."""
    with harness.training_job(args, ALGORITHM, validate_args, RESUME_MAY_CHANGE) as job:
        args = job.args  # as the run uses them (the data root resolved)
        with harness.startup_errors():  # sampler endpoint checks
            rt = Runtime(args, job.accelerator)
        if args.eval_only:
            return harness.evaluate_checkpoint(job, rt, args.max_turns)
        run = harness.Run(job, rt, args.num_updates, POSTFIX_KEYS)  # resumes a checkpoint
        for update in run.updates():
            metrics, samples = gae_update(rt, warmup=update <= args.value_warmup_updates)
            metrics = run.gather(metrics)
            if run.evaluates(update):
                metrics |= harness.evaluate(rt, args.max_turns)
            run.log(update, metrics, samples)
            run.checkpoint(update, {})
        return run.close()


if __name__ == "__main__":
    harness.cli(Args, main, PRESETS)
