"""GiGPO: group-in-group policy optimisation for multi-turn ALFWorld agents, with exact-state anchors (CleanRL style).

Per update: play G games x N full episodes each (one episode group per game). Every step gets two relative
advantages. The episode advantage A_E compares the episode's score (1 if won) with the other episodes of its group,
as verl-agent computes it: over the group's steps, so a long episode counts once per step. The step advantage A_S
compares the step's discounted return R_t = r_t + gamma * R_{t+1} with the returns of the other steps of its group
taken from the same anchor: the same exact engine state (`--anchor state`, the default: the facts that hold, however
the episode got there) or the same observation text (`--anchor observation`, verl-agent's way). A = A_E + w * A_S is
given to every token generated at that step, and PPO-clip steps on a LoRA adapter follow (dual clip c = 3, an
optional k3 KL loss to the base model).

    python gigpo.py                              # exact-state anchors
    python gigpo.py --anchor observation         # verl-agent's anchors: the observation text
    python gigpo.py --model tiny --help
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Literal, Sequence

import common
import harness
import training

# fork 1: the algorithm's name (a checkpoint carries it; another algorithm's is refused), its constants, the docstring
ALGORITHM = "gigpo"
EPS = 1e-6  # verl-agent's epsilon under both normalisations' std


# fork 2: the algorithm's flags in Args (harness.SharedArgs / PPOArgs hold the shared ones) and validate_args
@dataclass
class Args(harness.PPOArgs):
    exp_name: str = ALGORITHM
    """run name prefix: runs/{exp_name}__{seed}__{time}"""
    # ---- GiGPO (defaults: verl-agent's ALFWorld run; its invalid-action penalty and KL loss are off) ----
    anchor: Literal["state", "observation"] = "state"
    """steps of one group form a step group when taken from the same exact engine state (state) or the same
    observation text (observation: verl-agent's anchors)"""
    gamma: float = 0.95
    """discount of the step return R_t = r_t + gamma * R_{t+1}"""
    step_advantage_w: float = 1.0
    """w: weight of the step advantage in A = A_E + w * A_S"""
    normalize_std: bool = True
    """divide both advantages by their group's std + 1e-6 (--no-normalize-std: only subtract the group mean)"""
    invalid_action_penalty: float = 0.0
    """subtracted from the return and the episode score of a step whose reply held no valid tool call, in units of
    the win reward (verl-agent's 0.1 against a win of 10 is 0.01)"""


def validate_args(args: Args) -> None:
    harness.validate_ppo_args(args)  # the shared flags, PPOArgs' and every Literal flag's choices
    harness.check_bounds(args, ">= 0", "step_advantage_w", "invalid_action_penalty")
    harness.require_all(
        (args.group_size >= 2, f"--group-size must be >= 2 (GiGPO compares within a group), got {args.group_size}"),
        (0 <= args.gamma <= 1, f"--gamma must lie in [0, 1], got {args.gamma}"),
    )


# fork 3: the algorithm's signals and prompts: functions of trajectories, replies and flags (no Runtime)
# =============================================================================================
# GiGPO advantages (update steps 2-4): episode groups, step groups by anchor, A = A_E + w * A_S
# =============================================================================================
# Equation numbers are the GiGPO paper's (arXiv 2505.10978), as verl-agent's gigpo/core_gigpo.py cites them.
def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """R_t = r_t + gamma * R_{t+1}, nothing after the last step: [0, 0, 1] at gamma 0.5 -> [0.25, 0.5, 1]."""
    returns, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * running
        returns[t] = running
    return returns


def relative_to_group(
    values: Sequence[float], keys: Sequence[Hashable], normalize_std: bool, alone_mean_zero: bool
) -> list[float]:
    """Each value minus the mean of the values with its key, divided by their unbiased std + 1e-6 when normalize_std.
    A value alone under its key: std 1 and mean 0 (alone_mean_zero: verl-agent's episode groups) or its own value
    (verl-agent's step groups: it gets 0)."""
    members = defaultdict(list)
    for i, key in enumerate(keys):
        members[key].append(i)
    relative = [0.0] * len(values)
    for idxs in members.values():
        group = [values[i] for i in idxs]
        if len(group) > 1:
            mean, std = math.fsum(group) / len(group), statistics.stdev(group)
        else:
            mean, std = 0.0 if alone_mean_zero else group[0], 1.0
        for i in idxs:
            relative[i] = (values[i] - mean) / (std + EPS) if normalize_std else values[i] - mean
    return relative


def step_group_keys(episode_groups: Sequence[Hashable], anchors: Sequence[Sequence[Hashable]]) -> list[list[tuple]]:
    """Per trajectory, per step: its step group, (episode group, anchor)."""
    return [[(group, anchor) for anchor in steps] for group, steps in zip(episode_groups, anchors)]


def gigpo_advantages(
    episode_scores: Sequence[float],
    episode_groups: Sequence[Hashable],
    step_rewards: Sequence[Sequence[float]],
    anchors: Sequence[Sequence[Hashable]],
    gamma: float,
    step_weight: float,
    normalize_std: bool,
    step_penalties: Sequence[Sequence[float]] | None = None,
) -> list[list[float]]:
    """A = A_E + step_weight * A_S per trajectory and step, as verl-agent's gigpo/core_gigpo.py computes it with every
    step one batch row.

    Row (i, t) scores episode_scores[i] - step_penalties[i][t]. A_E: the row's score relative to the rows of its
    episode group (episode_groups[i]); a group of one row has mean 0, std 1. A_S: the row's discounted return
    (step_rewards, gamma) less its penalty, relative to the rows of its step group (the same episode group and an equal
    anchor); a row alone in its step group gets 0. step_penalties (verl-agent's invalid-action penalty) are taken off
    after discounting, as verl-agent takes them off its step returns; None = no penalties."""
    penalties = step_penalties if step_penalties is not None else [[0.0] * len(r) for r in step_rewards]
    harness.require_all(
        (
            len(episode_scores) == len(episode_groups) == len(step_rewards) == len(anchors) == len(penalties),
            f"episode_scores, episode_groups, step_rewards, anchors and step_penalties differ in length: "
            f"{[len(x) for x in (episode_scores, episode_groups, step_rewards, anchors, penalties)]}",
        ),
        (
            all(len(r) == len(a) == len(p) for r, a, p in zip(step_rewards, anchors, penalties)),
            "step_rewards, anchors and step_penalties must have one entry per step of each trajectory",
        ),
    )
    rows = [(i, t) for i, rewards in enumerate(step_rewards) for t in range(len(rewards))]
    scores = [episode_scores[i] - penalties[i][t] for i, t in rows]
    returns = [discounted_returns(rewards, gamma) for rewards in step_rewards]  # Eq. 5
    step_returns = [returns[i][t] - penalties[i][t] for i, t in rows]
    keys = step_group_keys(episode_groups, anchors)  # Eq. 6: the step groups
    # Eq. 3: A_E, the episode relative advantage; Eq. 7: A_S, the step relative advantage
    episode_part = relative_to_group(scores, [episode_groups[i] for i, _ in rows], normalize_std, alone_mean_zero=True)
    step_part = relative_to_group(step_returns, [keys[i][t] for i, t in rows], normalize_std, alone_mean_zero=False)
    advantages = [[0.0] * len(rewards) for rewards in step_rewards]
    for (i, t), a_e, a_s in zip(rows, episode_part, step_part):
        advantages[i][t] = a_e + step_weight * a_s  # Eq. 8
    return advantages


def step_anchors(traj: common.Trajectory, anchor: str) -> list[Hashable]:
    """What each step was taken from: the exact engine state (the facts that hold: equal however they were reached,
    different whenever a fact differs) or the observation text the agent was shown last (the start's for step 0)."""
    if anchor == "state":
        return [step.state for step in traj.steps]
    return [traj.start.observation, *(step.observation for step in traj.steps)][: len(traj.steps)]


def step_groups(trajectories: Sequence[common.Trajectory], anchors: Sequence[Sequence[Hashable]]) -> dict:
    """Step group (episode group, anchor) -> its steps, as gigpo_advantages groups them."""
    members = defaultdict(list)
    for traj, keys in zip(trajectories, step_group_keys([traj.group for traj in trajectories], anchors)):
        for key, step in zip(keys, traj.steps):
            members[key].append(step)
    return members


def step_group_metrics(groups: dict, anchor: str) -> dict:
    """gigpo/: the number and mean size of the step groups, the share of steps alone in theirs, and with observation
    anchors the share of step groups whose steps were taken from more than one exact engine state (aliasing)."""
    sizes = [len(steps) for steps in groups.values()]
    metrics = {
        "gigpo/step_groups": training.SummedMetric(len(sizes)),
        "gigpo/step_group_size_mean": math.fsum(sizes) / max(1, len(sizes)),
        "gigpo/singleton_step_share": sum(size == 1 for size in sizes) / max(1, sum(sizes)),
    }
    if anchor == "observation":
        aliased = sum(len({step.state for step in steps}) > 1 for steps in groups.values())
        metrics["gigpo/aliased_group_share"] = aliased / max(1, len(sizes))
    return metrics


# fork 4: Runtime: what the updates need besides harness.Runtime's games, model, optimizer, protocol and samplers
# (what a checkpoint keeps of it goes into state_dict / load_state_dict); the training call: training.ppo_update, or
# the algorithm's own policy_loss and ppo_update
class Runtime(harness.Runtime):
    """GiGPO needs nothing else: the shared games, model, optimizer, protocol and samplers (and the game cursor that
    harness.Runtime's state_dict keeps)."""


# fork 5: the updates -> (metrics, samples) and their helpers; a metric that counts something is a training.SummedMetric
# =============================================================================================
# One GiGPO update
# =============================================================================================
def gigpo_update(rt: Runtime) -> tuple[dict, list[dict]]:
    args, t0 = rt.args, time.time()
    # ---- step 1: roll out G games x N full episodes (one episode group per game)
    groups = rt.rollout_groups()  # --async-steps K: sampled ahead, at most K versions behind
    trajectories = [traj for group in groups for traj in group]
    t_rollout = time.time()

    # ---- step 2: per step the env's reward (1 on the winning step) and the invalid-action penalty; per episode its
    # score, the rewards' sum (1 if won)
    step_rewards = [[step.reward for step in traj.steps] for traj in trajectories]
    penalties = [[args.invalid_action_penalty * (not step.valid) for step in traj.steps] for traj in trajectories]
    scores = [traj.reward for traj in trajectories]

    # ---- step 3: the anchor of every step: the exact engine state it was taken from, or its observation text (Eq. 6)
    anchors = [step_anchors(traj, args.anchor) for traj in trajectories]
    groups_by_anchor = step_groups(trajectories, anchors)

    # ---- step 4: A = A_E (within the episode group) + w * A_S (within the step group), per step (Eqs. 3, 7, 8)
    advantages = gigpo_advantages(
        scores,
        [traj.group for traj in trajectories],
        step_rewards,
        anchors,
        args.gamma,
        args.step_advantage_w,
        args.normalize_std,
        penalties,
    )

    # ---- step 5: broadcast each step's advantage to the tokens generated at that step
    datums = training.trajectory_datums(trajectories, advantages)
    metrics = training.refresh_old_logprobs(rt, datums, always=args.ppo_epochs * args.mini_batches > 1)
    if args.kl_loss_coef > 0 and datums:
        training.add_reference_logprobs(rt, datums)

    # ---- step 6: PPO-clip, --ppo-epochs passes of --mini-batches optimizer steps each
    metrics |= training.ppo_update(rt, datums)
    t_update = time.time()

    metrics |= training.rollout_metrics(trajectories) | training.group_metrics(groups)
    metrics |= step_group_metrics(groups_by_anchor, args.anchor)
    flat = [abs(a) for row in advantages for a in row]
    metrics["gigpo/advantage_abs_mean"] = math.fsum(flat) / max(1, len(flat))
    metrics |= {"time/rollout": t_rollout - t0, "time/update": t_update - t_rollout}
    return metrics, update_samples(trajectories[:2], anchors, groups_by_anchor, advantages, penalties)


def update_samples(trajectories, anchors, groups_by_anchor, advantages, penalties) -> list[dict]:
    """The given trajectories, readable, with per step the size of its step group, its penalty and its advantage, for
    samples.jsonl."""
    return [
        {
            "game": traj.start.game_file,
            "task": traj.start.task,
            "won": traj.won,
            "stop_reason": traj.stop_reason,
            "step_group_sizes": [len(groups_by_anchor[traj.group, anchor]) for anchor in anchors[i]],
            "step_penalties": penalties[i],
            "step_advantages": advantages[i],  # as trained
            "messages": traj.messages[len(traj.start.messages) :],
        }
        for i, traj in enumerate(trajectories)
    ]


# =============================================================================================
# Main: the update loop
# =============================================================================================
# fork 6: main: the update loop, RESUME_MAY_CHANGE, POSTFIX_KEYS, PRESETS
RESUME_MAY_CHANGE = ("num_updates",)  # flags that only extend a run
POSTFIX_KEYS = ("rollout/success_rate", "gigpo/singleton_step_share", "train/loss")
PRESETS = {  # name -> (what it is, its values); `python gigpo.py NAME --flags`
    "smoke": (
        "the offline smoke run: tiny random model, generated games, 3 updates, CPU (~45 s on busy cores)",
        Args(
            model="tiny",
            num_updates=3,
            groups_per_update=2,
            group_size=4,
            max_turns=4,
            max_turn_tokens=48,
            eval_games=2,
            eval_every=3,
        ),
    ),
    "learning": (
        "the CPU learning benchmark's recipe: tiny agent, its 4 games, 12 updates of 4 x 4, state anchors (~2-3 min)",
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
        "the long-horizon CPU benchmark's recipe: tiny-agent-long, pick two / clean / cool games, T 20, state anchors",
        Args(
            **harness.LEARNING_SETTINGS["learning-long"],
            num_updates=12,
            groups_per_update=4,
            group_size=4,
            max_turns=20,
        ),
    ),
    # langfengQ/verl-agent@796ed31, examples/gigpo_trainer/run_alfworld.sh with veRL's ppo_trainer.yaml: every value's
    # file and line, and what is not expressible here, in docs/gigpo.md
    "source": (
        "verl-agent's ALFWorld GiGPO run: Qwen2.5-1.5B, 16 games x 8, 50 steps, KL loss 0.01, penalty 0.1 of 10",
        Args(
            model="Qwen/Qwen2.5-1.5B-Instruct",
            num_updates=150,
            groups_per_update=16,
            group_size=8,
            max_turns=50,
            learning_rate=1e-6,
            adam_betas=(0.9, 0.999),
            weight_decay=0.01,
            kl_loss_coef=0.01,
            invalid_action_penalty=0.01,
            anchor="observation",
            gamma=0.95,
            step_advantage_w=1.0,
            normalize_std=True,
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
            metrics, samples = gigpo_update(rt)
            metrics = run.gather(metrics)
            if run.evaluates(update):
                metrics |= harness.evaluate(rt, args.max_turns)
            run.log(update, {"anchor": args.anchor, **metrics}, samples)
            run.checkpoint(update, {"anchor": args.anchor})
        return run.close()


if __name__ == "__main__":
    harness.cli(Args, main, PRESETS)
