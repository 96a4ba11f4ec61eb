"""The docs' tables of the learning benchmark, regenerated from the committed results by one command:

    python -m benchmarks.learning.tables            # rewrite every table in docs/ between its markers, and the figure
    python -m benchmarks.learning.tables --check    # rewrite nothing; exit 1 naming each table (or figure) that differs

A table sits in its page between `<!-- table: NAME -->` and `<!-- /table -->`. TABLES says which result folders it pools
(an arm's runs from several folders, each seed once, all from one warm start), which arms under which labels, which
seeds, and the arm the others are compared with (compare.summarise: n, Welch's t intervals, the change's with the
start's own episodes counted, a percentile bootstrap interval and the Mann-Whitney p with its Holm adjustment beside
Welch's, the smallest difference detectable at 80% power at the sd it states, provenance). A table pools seeds of
several folders only where the arm's runs have identical flags (compare.check_poolable) and one warm start's evaluation.
The generalisation table is benchmarks/learning/generalise.py's own (its results.json), the confirmatory table
confirmatory.py's. The figure (FIGURE, draw_figure) sets the confirmatory comparison, as far as its runs have finished,
beside the exploratory ranking (rank-held-out); the numbers it draws are kept in the PNG, so --check compares those,
not pixels. tests/test_docs.py fails when a page's table or the figure is stale, and when the ranking table holds an
arm at another lr than the one its grid chose (chosen_lr: the protocol's rule).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.learning import compare, confirmatory, generalise

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
E16 = "long-full-last-stage-critic-e16"  # the long setting's warm start before 2026-12-03 (lost: not rebuilt alike)
SHIPPED = "long-full-long-warm-start"  # its successor, shipped in assets/long-warm-start
RANK = "rank-full-rank-agent"  # the ranking setting from assets/rank-agent
FIGURE = ROOT / "docs" / "ranking.png"  # the confirmatory and the exploratory ranking, drawn by draw_figure
RANK_ARMS = ("grpo", "gigpo", "tempo", "ppo", "adca_oracle")  # the arms that rank (issue 53), each tuned on seeds 1-3
RANK_CHOSEN = ("grpo@2e-3", "gigpo@2e-3", "ppo@2e-3", "adca_oracle@2e-3", "tempo@5e-4")  # by chosen_lr on rank-tuning
RANK_GRID_FOLDERS = (  # the grid {3e-4, 5e-4, 1e-3}, then 2e-3 and 4e-3 for the arms that chose its top
    "rank-tuning", "rank-tuning-gigpo", "rank-tuning-tempo", "rank-tuning-tempo-b", "rank-tuning-ppo",
    "rank-tuning-ppo-b", "rank-tuning-adca", "rank-tuning-adca-b", "rank-lr-probe", "rank-lr-probe-b",
    "rank-lr-probe-c", "rank-lr-probe-d", "rank-tuning-wide",
)  # fmt: skip
RANK_HELD_OUT_FOLDERS = (
    "rank-held-out", "rank-held-out-tempo", "rank-held-out-tempo-b", "rank-held-out-ppo", "rank-held-out-adca",
    "rank-held-out-adca-b", "rank-oracle", "rank-oracle-b", "rank-held-out-wide", "rank-held-out-wide-b",
)  # fmt: skip


def rank_arm(name: str) -> tuple[str, str]:
    """(name, label) of a ranking-setting arm: "ppo@2e-3" is "ppo, lr 2e-3"; without @LR an arm runs at 1e-3."""
    arm, _, lr = name.partition("@")
    return name, f"{arm}, lr {lr or '1e-3'}"


@dataclass(frozen=True)
class Table:
    page: str  # under ROOT
    folders: tuple[str, ...]  # under benchmarks/results, each holding a results.json
    arms: tuple[tuple[str, str], ...]  # (arm name in results.json, label in the table)
    seeds: tuple[int, ...]
    reference: str  # a label of `arms`


TEMPO_PRESET = ("tempo_outcome@3e-4", "tempo (preset: outcome store, lr 3e-4)")
TABLES = {
    "long-tuning": Table(
        "docs/lab-notes.md",
        (f"long-tuning/{SHIPPED}",),
        (
            ("grpo@3e-4", "grpo, lr 3e-4"),
            ("grpo@5e-4", "grpo, lr 5e-4"),
            ("grpo", "grpo, lr 1e-3"),
            ("tempo", "tempo (preset), lr 3e-4"),
            ("tempo@5e-4", "tempo (preset), lr 5e-4"),
            ("tempo@1e-3", "tempo (preset), lr 1e-3"),
        ),
        (1, 2, 3, 4, 5),
        "grpo, lr 5e-4",
    ),
    "long-held-out": Table(
        "docs/lab-notes.md",
        (f"long-held-out/{SHIPPED}",),
        (
            ("grpo@5e-4", "grpo, lr 5e-4 (chosen on seeds 1-5)"),
            ("grpo", "grpo, lr 1e-3"),
            ("tempo", "tempo (preset), lr 3e-4"),
            ("tempo_source", "tempo_source (09-tempo's store), lr 3e-4"),
            ("tempo_oracle", "tempo_oracle (endpoints valued by one continuation), lr 3e-4"),
            ("tempo_oracle@1e-3", "tempo_oracle (endpoints valued by one continuation), lr 1e-3"),
        ),
        (6, 7, 8, 9, 10),
        "grpo, lr 5e-4 (chosen on seeds 1-5)",
    ),
    # seeds 1-10 of the arms whose runs on both seed sets have identical flags (check_poolable refuses others): seeds
    # 1-5 are the ones each lr was chosen on, so a chosen arm's pooled mean carries the winner's curse (the docs say)
    "long-pooled": Table(
        "docs/lab-notes.md",
        (f"long-tuning/{SHIPPED}", f"long-held-out/{SHIPPED}"),
        (
            ("grpo@5e-4", "grpo, lr 5e-4 (chosen on seeds 1-5)"),
            ("grpo", "grpo, lr 1e-3"),
            ("tempo", "tempo (preset), lr 3e-4 (chosen on seeds 1-5)"),
        ),
        tuple(range(1, 11)),
        "grpo, lr 5e-4 (chosen on seeds 1-5)",
    ),
    # the ranking setting (issue 53): 32 training games, the short recipe, rank-agent (benchmarks/learning/agents.py); a
    # folder per stream (parallel processes), each folder's start rank-tuning's
    "rank-tuning": Table(
        "docs/lab-notes.md",
        tuple(f"{folder}/{RANK}" for folder in RANK_GRID_FOLDERS),
        tuple(
            rank_arm(f"{arm}{lr}")
            for arm in RANK_ARMS
            for lr in ("@3e-4", "@5e-4", "", *(() if arm == "tempo" else ("@2e-3", "@4e-3")))
        ),
        (1, 2, 3),
        "grpo, lr 2e-3",  # GRPO's chosen lr (the highest mean end on seeds 1-3)
    ),
    "rank-held-out": Table(
        "docs/does-it-learn.md",
        tuple(f"{folder}/{RANK}" for folder in RANK_HELD_OUT_FOLDERS),
        (  # each at the lr its grid chose (rank-tuning)
            *map(rank_arm, RANK_CHOSEN),
            ("tempo_oracle16@5e-4", "tempo, endpoints valued by 16 continuations (the exact oracle), lr 5e-4"),
        ),
        tuple(range(4, 10)),
        "grpo, lr 2e-3",
    ),
    "rank-pooled": Table(  # seeds 1-3 chose these lrs: the winner's curse is in the pooled figures
        "docs/lab-notes.md",
        tuple(f"{folder}/{RANK}" for folder in RANK_GRID_FOLDERS + RANK_HELD_OUT_FOLDERS),
        tuple(map(rank_arm, RANK_CHOSEN)),
        tuple(range(1, 10)),
        "grpo, lr 2e-3",
    ),
    "rank-held-out-first-grid": Table(  # the first grid's choice (its top, 1e-3, for four arms): superseded
        "docs/lab-notes.md",
        tuple(f"{folder}/{RANK}" for folder in RANK_HELD_OUT_FOLDERS),
        tuple(map(rank_arm, ("grpo", "gigpo", "ppo", "adca_oracle", "tempo@5e-4"))),
        tuple(range(4, 10)),
        "grpo, lr 1e-3",
    ),
    "long-tuning-seeds": Table(
        "docs/lab-notes.md",
        (f"tempo-selection/{E16}",),
        (
            ("grpo", "grpo (lr 1e-3)"),
            ("gigpo", "gigpo (lr 1e-3)"),
            ("ppo", "ppo (lr 1e-3)"),
            ("adca_oracle", "adca_oracle (lr 1e-3)"),
            TEMPO_PRESET,
            ("tempo_outcome@5e-4", "tempo, lr 5e-4"),
            ("tempo_outcome", "tempo, lr 1e-3"),
            ("tempo_wide@1e-3", "tempo, 8 groups per update, lr 1e-3"),
        ),
        (1, 2, 3, 4, 5),
        "grpo (lr 1e-3)",
    ),
    "long-held-out-seeds": Table(
        "docs/lab-notes.md",
        (f"tempo-held-out/{E16}",),
        (("grpo", "grpo (lr 1e-3)"), TEMPO_PRESET, ("tempo_outcome@5e-4", "tempo, lr 5e-4")),
        (6, 7, 8, 9, 10),
        "grpo (lr 1e-3)",
    ),
    "long-pooled-seeds": Table(
        "docs/lab-notes.md",
        (f"tempo-selection/{E16}", f"tempo-held-out/{E16}"),
        (("grpo", "grpo (lr 1e-3)"), TEMPO_PRESET, ("tempo_outcome@5e-4", "tempo, lr 5e-4")),
        tuple(range(1, 11)),
        "grpo (lr 1e-3)",
    ),
    "async-steps": Table(
        "docs/benchmarks.md",
        ("learning-async/full",),
        (("grpo_vllm", "grpo_vllm (K = 0)"), ("grpo_async1", "grpo_async1 (K = 1)")),
        (1, 2, 3, 4, 5),
        "grpo_vllm (K = 0)",
    ),
    "short": Table(
        "docs/lab-notes.md",
        ("learning-crn/full",),
        (
            ("grpo", "grpo"),
            ("gigpo", "gigpo"),
            ("ppo", "ppo"),
            ("tempo_outcome", "tempo (outcome store, lr 1e-3)"),
            ("tempo_outcome@3e-4", "tempo (outcome store, lr 3e-4)"),
        ),
        (1, 2, 3),
        "grpo",
    ),
}


def pooled(table: Table) -> dict:
    """One results dict of the table's folders: their shared start and the runs of its arms and seeds, each run's
    algorithm renamed to its label. Refuses folders evaluated from different starts and a seed found twice."""
    labels = dict(table.arms)
    merged: dict = {"runs": {}}
    for folder in table.folders:
        results = json.loads((RESULTS / folder / "results.json").read_text())
        evaluation = {k: results["start"][k] for k in ("sampled", "greedy", "episodes")}
        if any(merged.setdefault("start", results["start"])[k] != v for k, v in evaluation.items()):
            raise ValueError(f"{folder}: its warm start's evaluation differs from {table.folders[0]}'s: not poolable")
        for run in results["runs"].values():
            if run["algorithm"] in labels and run["seed"] in table.seeds:
                key = f"{labels[run['algorithm']]}-s{run['seed']}"
                if key in merged["runs"]:
                    raise ValueError(f"{key}: in two of {table.folders}: a seed is pooled once")
                merged["runs"][key] = {**run, "algorithm": labels[run["algorithm"]]}
    return merged


def chosen_lr(table: Table, arm: str) -> str:
    """The protocol's lr rule: of arm's grid in table (arm, arm@LR, ...), the name with the highest mean end over the
    table's seeds. Refuses a grid with a run missing or unfinished: an lr is chosen once the whole grid has run."""
    results = pooled(table)  # its runs named by their labels
    grid = [name for name, _ in table.arms if name.partition("@")[0] == arm]
    labels = dict(table.arms)
    ends = {name: [compare.success(r["points"][-1]) for r in compare.arm_runs(results, labels[name])] for name in grid}
    incomplete = [name for name in grid if len(ends[name]) < len(table.seeds)]
    if not grid or incomplete:
        raise ValueError(f"{arm}: its grid is not complete on seeds {table.seeds} ({incomplete or 'no lr'})")
    return max(grid, key=lambda name: statistics.mean(ends[name]))


def render(table: Table) -> str:
    """The table's markdown: compare.summarise over the pooled runs, with where they come from."""
    results, labels = pooled(table), [label for _, label in table.arms]
    text = compare.summarise(results, labels, table.reference)
    heldout = compare.heldout_summary(results, labels)
    if heldout:
        text += f"\nOn games no run trains on (valid_seen, valid_unseen of the same task types):\n\n{heldout}"
    folders = ", ".join(f"`benchmarks/results/{folder}/`" for folder in table.folders)
    seeds = f"{table.seeds[0]}-{table.seeds[-1]}" if len(table.seeds) > 2 else ", ".join(map(str, table.seeds))
    return f"{text}\n(seeds {seeds}; from {folders})\n"


def marked(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- table: {re.escape(name)} -->\n)(.*?)(<!-- /table -->)", re.S)


def confirmatory_table() -> str:
    """benchmarks/learning/confirmatory.py's table of its results folder (the runs finished so far)."""
    path = ROOT / confirmatory.FOLDER / "results.json"
    if not path.is_file():
        return f"(no confirmatory run has finished: `{confirmatory.FOLDER}/results.json` does not exist yet)\n"
    results = json.loads(path.read_text())
    start = f"sampled {compare.success(results['start']):.3f}, greedy {compare.success(results['start'], 'greedy'):.2f}"
    seeds = f"seeds {confirmatory.SEEDS[0]}-{confirmatory.SEEDS[-1]}"
    return f"{confirmatory.table(results)}\n(the start: {start}; {seeds}; from `{confirmatory.FOLDER}/`)\n"


# The figure's arms, in its order, with their labels; the exploratory panels hold the first five (rank-held-out)
FIGURE_ARMS = dict(
    zip(confirmatory.ARMS, ("GRPO", "GiGPO", "PPO", "ADCA-GRPO (oracle)", "TEMPO", "TEMPO at GRPO's trained tokens"))
)


def figure_numbers() -> dict:
    """What the figure shows, per panel (confirmatory, exploratory) and arm: n, and the end's mean with its 95% t
    interval and its difference from GRPO with Welch's 95% interval (at one seed the point alone)."""
    path = ROOT / confirmatory.FOLDER / "results.json"
    confirm = json.loads(path.read_text()) if path.is_file() else {"runs": {}}
    table = TABLES["rank-held-out"]
    explore, labels = pooled(table), dict(table.arms)
    panels = {
        "confirmatory": (confirm, confirmatory.ends(confirm)),
        "exploratory": (explore, {name: [compare.success(r["points"][-1]) for r in compare.arm_runs(explore, label)]
                                  for name, label in labels.items() if name in RANK_CHOSEN}),
    }  # fmt: skip
    numbers = {}
    for panel, (results, ends) in panels.items():
        reference = ends.get(confirmatory.REFERENCE, [])
        numbers[f"{panel} start"] = round(compare.success(results["start"]), 4) if "start" in results else None
        numbers[panel] = {
            name: {
                "n": len(values),
                "end": estimate(confirmatory.mean_interval, values),
                "difference": None if name == confirmatory.REFERENCE else estimate(
                    compare.difference_interval, values, reference
                ),
            }
            for name in FIGURE_ARMS if (values := ends.get(name)) is not None
        }  # fmt: skip
    return numbers


def estimate(interval, *samples: list[float]) -> list | None:
    """interval(*samples) rounded: (estimate, low, high); with a single value in a sample, the point alone (low and
    high None); None without values."""
    if not all(samples):
        return None
    if min(map(len, samples)) > 1:
        return [round(v, 4) for v in interval(*samples)]
    means = [sum(sample) / len(sample) for sample in samples]
    return [round(means[0] - (means[1] if len(means) > 1 else 0.0), 4), None, None]


def draw_figure(numbers: dict, path: Path) -> None:
    """The figure: per row (confirmatory, exploratory), each arm's end sampled success with its 95% t interval and
    its difference from GRPO with Welch's 95% interval (a hollow point: one seed, no interval); the numbers drawn are
    kept in the PNG's Description."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {
        "confirmatory": f"Confirmatory: seeds {confirmatory.SEEDS[0]}-{confirmatory.SEEDS[-1]}, 16 episodes a game",
        "exploratory": "Exploratory (the earlier ranking): seeds 4-9, 8 episodes a game",
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), sharex="col")
    names = list(FIGURE_ARMS)[::-1]  # GRPO on top
    for (panel, title), (end_ax, diff_ax) in zip(rows.items(), axes):
        arms, start = numbers[panel], numbers[f"{panel} start"]
        labels = [f"{FIGURE_ARMS[n]} (n = {arms[n]['n']})" if n in arms else f"{FIGURE_ARMS[n]} (not run)"
                  for n in names]  # fmt: skip
        if start is not None:
            end_ax.axvline(start, color="grey", lw=1, ls="--")
            title += f"\nthe start {start:.2f} (dashed)"
        for ax, key in ((end_ax, "end"), (diff_ax, "difference")):
            for y, name in enumerate(names):
                point = arms.get(name, {}).get(key)
                if point and point[1] is None:  # one seed: the point, hollow, without an interval
                    ax.plot(point[0], y, "o", mfc="none", color="C0")
                elif point:
                    mean, low, high = point
                    ax.errorbar(mean, y, xerr=[[mean - low], [high - mean]], fmt="o", color="C0", capsize=3)
            ax.set_yticks(range(len(names)), labels if ax is end_ax else [""] * len(names), fontsize=8)
            ax.grid(axis="x", alpha=0.3)
        diff_ax.axvline(0, color="grey", lw=1)
        diff_ax.xaxis.set_major_locator(plt.MaxNLocator(6))
        end_ax.set_title(title, fontsize=9, loc="left")
        diff_ax.set_title("minus GRPO (Welch 95%)", fontsize=9, loc="left")
    axes[1][0].set_xlabel("end sampled success (mean over seeds, 95% t interval)")
    axes[1][1].set_xlabel("difference from GRPO's end")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Description": json.dumps(numbers, sort_keys=True)})
    plt.close(fig)


def figure_is_current(path: Path, numbers: dict) -> bool:
    from PIL import Image

    if not path.is_file():
        return False
    with Image.open(path) as image:
        return image.info.get("Description") == json.dumps(numbers, sort_keys=True)


def generalisation() -> str:
    """benchmarks/learning/generalise.py's table: warm starts against success on games they never trained on."""
    results = json.loads((RESULTS / "generalisation" / "results.json").read_text())
    return f"{generalise.table(results)}\n(from `benchmarks/results/generalisation/results.json`)\n"


def regenerate(check: bool = False) -> list[str]:
    """Rewrite each table in its page (check: only compare); returns the names of the tables that differed."""
    stale = []
    tables = {name: (table.page, lambda table=table: render(table)) for name, table in TABLES.items()}
    tables["generalisation"] = ("docs/does-it-learn.md", generalisation)
    tables["confirmatory"] = ("docs/does-it-learn.md", confirmatory_table)
    for name, (page_name, fresh_text) in tables.items():
        page = ROOT / page_name
        text = page.read_text()
        match = marked(name).search(text)
        if match is None:
            raise ValueError(f"{page_name}: no <!-- table: {name} --> ... <!-- /table --> markers")
        fresh = fresh_text()
        if match.group(2) != fresh:
            stale.append(name)
            if not check:
                page.write_text(text[: match.start(2)] + fresh + text[match.end(2) :])
    numbers = figure_numbers()
    if not figure_is_current(FIGURE, numbers):
        stale.append(FIGURE.name)
        if not check:
            draw_figure(numbers, FIGURE)
    return stale


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="regenerate the docs' learning-benchmark tables from benchmarks/results")
    cli.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table differs")
    check = cli.parse_args().check
    stale = regenerate(check)
    print(f"{'stale' if check else 'rewritten'}: {', '.join(stale)}" if stale else "every table is up to date")
    sys.exit(1 if check and stale else 0)
