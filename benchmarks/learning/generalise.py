"""Does a warm start play games it never trained on? The ranking setting's second tier (issue 53): warm starts cloned
with rank-agent's recipe (agents.RANK_RECIPE: two sft.py stages on 8 noisy-expert episodes a game) on more training
games and by a larger random Qwen2, each scored on the ranking setting's 32 training games (in every point's training
set) and on the valid_seen / valid_unseen games of the same task types, beside what its clone cost.

    python -m benchmarks.learning.generalise                      # every point of POINTS not in results.json yet
    python -m benchmarks.learning.generalise --points g32-h128    # some of them

Each clone stage is cached (agents.build's rule: a killed build restarts its stage), each evaluation saved in
--out/results.json as it finishes; rerun the command to go on. The table in docs/does-it-learn.md comes from
`python -m benchmarks.learning.tables`. Training games beyond the 240-game set's 32 a type come from further generated
sets (seed 1, 2, ...: ~4.5 min each on 2 cores); the held-out games are always the 240-game set's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import common
import harness
import offline
from benchmarks.learning import agents, compare

RESULTS = agents.ROOT / "benchmarks" / "results" / "generalisation"
GAMES_PER_SET = 32  # training games of each short task type in one generated 240-game set
TRAIN_EPISODES, HELDOUT_EPISODES = 8, 16  # sampled episodes a game: training games (32), held-out games (8 a split)


@dataclass(frozen=True)
class Point:
    games_per_type: int  # training games cloned on, of each of the two short task types
    hidden_size: int  # of the random Qwen2 (intermediate 3x, 4 layers, 2 KV heads): 128 is the tiny agents' 0.9M


POINTS = {
    "g16-h128": Point(16, 128),  # rank-agent itself (agents.RANK_RECIPE on agents.rank_games)
    "g32-h128": Point(32, 128),
    "g64-h128": Point(64, 128),
    "g32-h256": Point(32, 256),
}


def games(point: Point, root: Path) -> Path:
    """The point's games root: rank_games for 16 a type, else copies of the first games_per_type training games of
    each type from as many generated sets as that takes, with the 240-game set's held-out games."""
    if point.games_per_type == agents.RANK_GAMES_PER_TYPE:
        return agents.rank_games(root)
    sources = [offline.default_data_root(seed=seed) for seed in range(math.ceil(point.games_per_type / GAMES_PER_SET))]
    return agents.copy_games(
        root / f"generalise-games-{point.games_per_type}", sources, point.games_per_type, agents.RANK_RECIPE.task_types
    )  # fmt: skip


def clone(name: str, point: Point, root: Path, threads: int) -> list[dict]:
    """Build the point's warm start (rank-agent's stages, agents.clone) into root; each stage's sft.json summary
    (optimizer steps, final loss, wall seconds), in stage order. g16-h128 is rank-agent's own cached build."""
    prefix = agents.RANK_RECIPE.dir_prefix if name == "g16-h128" else f"generalise-{name}"
    model = agents.base_model(root, point.hidden_size)
    stages = []
    for path in agents.clone(agents.RANK_AGENT, model, games(point, root), root / prefix, threads):
        summary = json.loads((path / "sft.json").read_text())
        stages.append({k: summary[k] for k in ("steps", "final_loss", "seconds")} | {"path": str(path)})
    return stages


def evaluate(name: str, point: Point, root: Path, threads: int, entry: dict, save) -> None:
    """Fill entry (saved after each step) with the clone's stages, its parameter count, and sampled / greedy success
    on the 32 ranking-setting training games and on each held-out split."""
    if "clone" not in entry:
        entry["clone"] = clone(name, point, root, threads)
        save()
    warm = Path(entry["clone"][-1]["path"])
    if "parameters" not in entry:
        from transformers import AutoModelForCausalLM

        entry["parameters"] = AutoModelForCausalLM.from_pretrained(warm).num_parameters()
        entry["model_sha256"] = compare.directory_sha256(warm)
    args = compare.Args(setting="rank", threads=threads)
    types = agents.RANK_RECIPE.task_types
    splits = {"train": (agents.rank_games(root), TRAIN_EPISODES)}
    splits |= {split: (games(point, root), HELDOUT_EPISODES) for split in agents.HELDOUT_SPLITS}
    for split, (games_root, episodes) in splits.items():
        if split not in entry:
            compare.log(f"{name}: {split}")
            entry[split] = compare.Evaluator(warm, common.discover_games(games_root, split, types), args)(
                None, episodes
            )
            save()


def interval(point: dict) -> str:
    """Sampled success with its Clopper-Pearson 95% interval over the episodes pooled (games are clustered, so it is
    narrower than one over games would be), greedy success, and the share of sampled replies that were admissible."""
    from scipy import stats

    wins, episodes = sum(point["sampled"]), len(point["sampled"]) * point["episodes"]
    ci = stats.binomtest(wins, episodes).proportion_ci()
    greedy = compare.success(point, "greedy")
    return f"{wins / episodes:.2f} [{ci.low:.2f}, {ci.high:.2f}] / {greedy:.2f} ({point['admissible']['sampled']:.0%})"


def table(results: dict) -> str:
    """One row a point: its training games, parameters, clone cost (steps and minutes of both stages, the last
    stage's final loss), and success on training and held-out games."""
    lines = [
        "| warm start | training games | parameters | clone (both stages) | training games sampled [95%] / greedy "
        "(admissible replies) | valid_seen, the same | valid_unseen, the same |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, entry in results.items():
        if not all(split in entry for split in ("train", *agents.HELDOUT_SPLITS)):
            continue
        point = POINTS[name]
        stages = entry["clone"]
        minutes = sum(s["seconds"] for s in stages) / 60
        cost = f"{sum(s['steps'] for s in stages):,} steps, loss {stages[-1]['final_loss']:.3f}, {minutes:.0f} min"
        cells = " | ".join(interval(entry[split]) for split in ("train", *agents.HELDOUT_SPLITS))
        lines.append(f"| {name} | {2 * point.games_per_type} | {entry['parameters'] / 1e6:.1f}M | {cost} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    cli = argparse.ArgumentParser(description="warm starts on more games / larger models against unseen-game success")
    cli.add_argument("--points", nargs="*", default=list(POINTS), choices=sorted(POINTS))
    cli.add_argument("--cache", default=str(agents.CACHE), help="games, base models and clone stages (not committed)")
    cli.add_argument("--out", default=str(RESULTS), help="results.json (committed)")
    cli.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = cli.parse_args()
    results_file = Path(args.out) / "results.json"
    results_file.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}

    def save() -> None:
        tmp = results_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, results_file)

    for name in args.points:
        entry = results.setdefault(name, {"games_per_type": POINTS[name].games_per_type})
        if "provenance" not in entry:  # the code that built and scored it
            entry["provenance"] = {k: v for k, v in harness.provenance().items() if k in ("commit", "dirty", "time")}
        started = time.time()
        evaluate(name, POINTS[name], Path(args.cache), args.threads, entry, save)
        save()
        compare.log(f"{name}: done in {(time.time() - started) / 60:.0f} min")
    print(table(results))


if __name__ == "__main__":
    main()
