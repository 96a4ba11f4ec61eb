"""Evaluation: a policy's success on its training games and on the held-out splits, with n and an interval per split.

Between plan.py and harness.py (harness.evaluate is this module's evaluate): it plays episodes with the Runtime's
samplers and returns eval/ metrics. Papers report valid_unseen (ALFWorld's held-out scenes; docs/reproduce.md).
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch

import common

EVAL_SEED = 0  # the sampler's seed for every evaluation: common random numbers across checkpoints and runs
SPLITS = ("valid_seen", "valid_unseen")
Z95 = 1.959964  # the normal quantile of a two-sided 95% interval


def eval_count(args) -> int | None:
    """--eval-games as a count: None for `all` (every game of a split)."""
    return None if args.eval_games == "all" else args.eval_games


def wilson_interval(wins: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a success rate: valid at small n and at 0 or n wins, where the normal one is not."""
    if n == 0:
        return 0.0, 1.0
    p = wins / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


def success_metrics(prefix: str, won: list[bool]) -> dict:
    """{prefix}/success_rate, /n and the 95% Wilson interval's /success_ci_low and /success_ci_high."""
    low, high = wilson_interval(sum(won), len(won))
    return {
        f"{prefix}/success_rate": sum(won) / len(won),
        f"{prefix}/n": float(len(won)),
        f"{prefix}/success_ci_low": low,
        f"{prefix}/success_ci_high": high,
    }


def evaluate(rt, max_turns: int) -> dict:
    """eval/train/: --eval-games sampled episodes (rt.sample_fn, the run's temperature), shared among the processes,
    from the start of each one's training games, cycling through them (all: each game once): episode success, the same
    measure in every script. Then eval/valid_seen/ and eval/valid_unseen/: one episode on each of --eval-games games
    (eval_subset; all: every game of the split) at --eval-temperature (rt.eval_fn: 0 = greedy), sharded over the
    processes. Sampled episodes are seeded with EVAL_SEED. Success with n and its interval per split (one line each on
    stderr); invalid_action_rate = turns whose reply was not an admissible action (bad format or not admissible)."""
    from accelerate.utils import gather_object

    args, accelerator, metrics = rt.args, rt.accelerator, {}
    rank, processes, count = accelerator.process_index, accelerator.num_processes, eval_count(args)
    with seeded_sampling(EVAL_SEED + rank):
        mine = len(rt.games) if count is None else len(range(rank, count, processes))  # this process's episodes
        starts = [common.game_start_or_skip(rt.games[i % len(rt.games)], rt.protocol, "eval") for i in range(mine)]
        starts = [state for state in starts if state is not None]
        groups = rt.play(starts, 1, horizon=max_turns, max_turns=max_turns) if starts else []
    won = [traj.won for group in groups for traj in group]
    won = sum(gather_object([won]), []) if processes > 1 else won
    if won:
        metrics |= success_metrics("eval/train", won)
    for split in SPLITS:
        try:
            games = common.eval_subset(args.data_root, split, args.task_types, count)
        except FileNotFoundError as error:
            print(f"[eval] skipping {split}: {error}", file=sys.stderr)
            continue
        mine = [common.game_start_or_skip(game, rt.protocol, "eval") for game in games[rank::processes]]
        starts, skipped = [state for state in mine if state is not None], sum(state is None for state in mine)
        with seeded_sampling(EVAL_SEED + rank):
            groups = rt.play(starts, 1, horizon=max_turns, max_turns=max_turns, sample_fn=rt.eval_fn) if starts else []
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
        results = gather_object(results) if processes > 1 else results
        skipped = sum(gather_object([skipped])) if processes > 1 else skipped
        if skipped:
            metrics[f"eval/{split}/bad_games_skipped"] = float(skipped)
        if not results:
            continue
        won = [r for r in results if r["won"]]
        metrics |= success_metrics(f"eval/{split}", [r["won"] for r in results])
        if won:
            metrics[f"eval/{split}/mean_steps_to_success"] = sum(r["steps"] for r in won) / len(won)
        metrics[f"eval/{split}/invalid_action_rate"] = sum(r["inadmissible"] for r in results) / max(
            1, sum(r["steps"] for r in results)
        )
        for task_type in sorted({r["task_type"] for r in results}):
            of_type = [r["won"] for r in results if r["task_type"] == task_type]
            metrics[f"eval/{split}/success/{task_type}"] = sum(of_type) / len(of_type)
    if accelerator.is_main_process:
        for split in ("train", *SPLITS):
            if f"eval/{split}/n" in metrics:
                low, high = metrics[f"eval/{split}/success_ci_low"], metrics[f"eval/{split}/success_ci_high"]
                print(
                    f"[eval] {split}: success {metrics[f'eval/{split}/success_rate']:.3f} "
                    f"(n {metrics[f'eval/{split}/n']:.0f}, 95% interval {low:.3f}-{high:.3f})",
                    file=sys.stderr,
                )
    return metrics


@contextlib.contextmanager
def seeded_sampling(seed: int):
    """torch's RNG (the sampler's) seeded with `seed` inside, restored after: the same random numbers for every
    checkpoint evaluated, the training run's own stream untouched."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield
