"""RLOO: multi-turn REINFORCE leave-one-out for ALFWorld agents (CleanRL style), written by following
docs/new-algorithm.md only (tests/test_fork.py puts it into a copy of the repository and runs its tests there).

Per update: play G games x N full episodes each (one group per game). An episode's advantage is its return (1 if won)
minus the mean return of the other N - 1 episodes of its group (Kool et al. 2019; Ahmadian et al. 2024), given to
every token it generated; PPO-clip steps on a LoRA adapter follow (training.ppo_update).

    python rloo.py smoke
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import harness
import training

# fork 1: the algorithm's name (a checkpoint carries it; another algorithm's is refused), its constants, the docstring
ALGORITHM = "rloo"


# fork 2: the algorithm's flags in Args (harness.SharedArgs / PPOArgs hold the shared ones) and validate_args
@dataclass
class Args(harness.PPOArgs):
    exp_name: str = ALGORITHM
    """run name prefix: runs/{exp_name}__{seed}__{time}"""


def validate_args(args: Args) -> None:
    harness.validate_ppo_args(args)
    harness.require_all(
        (args.group_size >= 2, f"--group-size must be >= 2 (RLOO compares in a group), got {args.group_size}")
    )


# fork 3: the algorithm's signals and prompts: functions of trajectories, replies and flags (no Runtime)
def leave_one_out(returns: Sequence[float], groups: Sequence[int]) -> list[float]:
    """Each return minus the mean of the other returns of its group: [1, 0, 0] -> [1, -0.5, -0.5]."""
    members = defaultdict(list)
    for i, group in enumerate(groups):
        members[group].append(i)
    advantages = [0.0] * len(returns)
    for idxs in members.values():
        total = math.fsum(returns[i] for i in idxs)
        for i in idxs:
            advantages[i] = returns[i] - (total - returns[i]) / (len(idxs) - 1) if len(idxs) > 1 else 0.0
    return advantages


# fork 4: Runtime: what the updates need besides harness.Runtime's games, model, optimizer, protocol and samplers
# (what a checkpoint keeps of it goes into state_dict / load_state_dict); the training call: training.ppo_update, or
# the algorithm's own policy_loss and ppo_update
Runtime = harness.Runtime  # RLOO needs nothing else; training.ppo_update trains it


# fork 5: the updates -> (metrics, samples) and their helpers; a metric that counts something is a training.SummedMetric
def rloo_update(rt: Runtime) -> tuple[dict, list[dict]]:
    args, t0 = rt.args, time.time()
    # ---- step 1: roll out G games x N full episodes (one group per game)
    groups = rt.rollout_groups()  # --async-steps K: sampled ahead, at most K versions behind
    episodes = [traj for group in groups for traj in group]
    t_rollout = time.time()

    # ---- step 2: the leave-one-out advantage of each episode, the same at each of its steps
    advantages = leave_one_out([traj.reward for traj in episodes], [traj.group for traj in episodes])
    datums = training.trajectory_datums(episodes, [[a] * len(traj.steps) for a, traj in zip(advantages, episodes)])

    # ---- step 3: PPO-clip (training.ppo_update), with the k3 KL term when --kl-loss-coef > 0
    metrics = training.refresh_old_logprobs(rt, datums, always=args.ppo_epochs * args.mini_batches > 1)
    if args.kl_loss_coef > 0 and datums:
        training.add_reference_logprobs(rt, datums)
    metrics |= training.ppo_update(rt, datums)
    metrics |= training.rollout_metrics(episodes) | training.group_metrics(groups)
    metrics |= {"rloo/advantage_abs_mean": math.fsum(map(abs, advantages)) / max(1, len(advantages))}
    metrics |= {"time/rollout": t_rollout - t0, "time/update": time.time() - t_rollout}
    samples = [
        {"game": traj.start.game_file, "won": traj.won, "advantage": advantage, "messages": traj.messages}
        for traj, advantage in zip(episodes[:2], advantages)
    ]
    return metrics, samples


# fork 6: main: the update loop, RESUME_MAY_CHANGE, POSTFIX_KEYS, PRESETS
RESUME_MAY_CHANGE = ("num_updates",)  # flags that only extend a run
POSTFIX_KEYS = ("rollout/success_rate", "rloo/advantage_abs_mean", "train/loss")
PRESETS = {  # name -> (what it is, its values); `python rloo.py NAME --flags`
    "smoke": (
        "the offline smoke run: tiny random model, generated games, 3 updates of 2 x 4, CPU",
        Args(model="tiny", num_updates=3, groups_per_update=2, group_size=4, max_turns=4, max_turn_tokens=48),
    ),
    "learning": (
        "the CPU learning benchmark's recipe: tiny agent, its 4 games, 12 updates of 4 x 4",
        Args(**harness.LEARNING_SETTINGS["learning"], num_updates=12, groups_per_update=4, group_size=4, max_turns=6),
    ),
    "learning-long": (
        "the long-horizon CPU benchmark's recipe: tiny-agent-long, 12 updates of 4 x 4, T 20",
        Args(
            **harness.LEARNING_SETTINGS["learning-long"], num_updates=12, groups_per_update=4, group_size=4, max_turns=20
        ),
    ),
    "source": (
        "RLOO as Ahmadian et al. (2024) run it, at GiGPO's ALFWorld scale: Qwen2.5-1.5B, 16 games x 8, 50 turns",
        Args(model="Qwen/Qwen2.5-1.5B-Instruct", groups_per_update=16, group_size=8, max_turns=50),
    ),
}


def main(args: Args) -> Path:
    """Train (or evaluate, with --eval-only); returns the run directory."""
    with harness.training_job(args, ALGORITHM, validate_args, RESUME_MAY_CHANGE) as job:
        args = job.args
        with harness.startup_errors():
            rt = Runtime(args, job.accelerator)
        if args.eval_only:
            return harness.evaluate_checkpoint(job, rt, args.max_turns)
        run = harness.Run(job, rt, args.num_updates, POSTFIX_KEYS)
        for update in run.updates():
            metrics, samples = rloo_update(rt)
            metrics = run.gather(metrics)
            if run.evaluates(update):
                metrics |= harness.evaluate(rt, args.max_turns)
            run.log(update, metrics, samples)
            run.checkpoint(update, {})
        return run.close()


if __name__ == "__main__":
    harness.cli(Args, main, PRESETS)
