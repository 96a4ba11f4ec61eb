"""Turn run directories into PNGs: the comparison figure (a metric vs update and vs generated tokens,
one line per experiment, mean +/- std across seeds) and TEMPO's critic panel.

    python plot.py runs/tempo__* runs/grpo__* --out plots/     (needs the `plot` extra: matplotlib)

--eval-only run dirs (one evaluation of another run's checkpoint) are left out: they are not seeds.
"""

import dataclasses
import fnmatch
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import tyro

CRITIC_PANEL = (
    "critic/abs_error_mean",
    "critic/value_target_mean",
    "critic/value_target_std",
    "critic/value_corr",
    "critic/parse_failure_rate",
)
TOKENS_METRIC = "rollout/generated_tokens"


@dataclasses.dataclass
class Args:
    runs: tyro.conf.Positional[tuple[Path, ...]]
    """run directories (each holds config.json and metrics.jsonl)"""
    out: Path = Path("plots")
    """folder for the PNGs"""
    metrics: tuple[str, ...] = ("eval/train/success_rate",)
    """metrics of the comparison figure, or patterns of them ('eval/*/success_rate': every split's). Any logged metric:
    eval/train/success_rate, sampled episode success on the training games, the same measure in every script;
    eval/valid_seen/ and eval/valid_unseen/ (held out, at --eval-temperature; valid_unseen is what papers report)"""


def load_run(run_dir: Path) -> tuple[str, list[dict], bool]:
    """(exp_name, metrics rows, whether it is an --eval-only run)."""
    config_file, metrics_file = run_dir / "config.json", run_dir / "metrics.jsonl"
    if not config_file.is_file() or not metrics_file.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (needs config.json and metrics.jsonl)")
    config = json.loads(config_file.read_text())
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    return config.get("exp_name", run_dir.name.split("__")[0]), rows, bool(config.get("eval_only"))


def series(rows: list[dict], metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(updates, cumulative generated tokens, values) where the metric was logged."""
    tokens = np.cumsum([row.get(TOKENS_METRIC, 0.0) for row in rows])
    points = [(row["update"], tok, row[metric]) for row, tok in zip(rows, tokens) if metric in row]
    if not points:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    return tuple(np.array(column, dtype=float) for column in zip(*points))


def mean_std(curves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Align seeds on the x values they share (all of them where lengths differ: the shortest prefix)."""
    length = min(len(x) for x, _ in curves)
    xs = np.mean([x[:length] for x, _ in curves], axis=0)
    ys = np.array([y[:length] for _, y in curves])
    return xs, ys.mean(axis=0), ys.std(axis=0)


def plot_metrics(
    runs: dict[str, list[list[dict]]], metrics: tuple[str, ...], out_file: Path, x_axes=("update", "tokens")
):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {name: f"C{i % 10}" for i, name in enumerate(sorted(runs))}  # one colour per experiment, every panel
    figure, axes = plt.subplots(len(metrics), len(x_axes), figsize=(6 * len(x_axes), 3.5 * len(metrics)), squeeze=False)
    for row, metric in enumerate(metrics):
        for col, x_axis in enumerate(x_axes):
            ax = axes[row][col]
            for name, seeds in sorted(runs.items()):
                curves = []
                for rows in seeds:
                    updates, tokens, values = series(rows, metric)
                    if len(values):
                        curves.append((updates if x_axis == "update" else tokens, values))
                if not curves:
                    continue
                xs, mean, std = mean_std(curves)
                marker = "o" if len(xs) <= 30 else None  # a single evaluation is a point, not a line
                ax.plot(xs, mean, marker=marker, markersize=4, color=colours[name], label=f"{name} (n={len(curves)})")
                ax.fill_between(xs, mean - std, mean + std, alpha=0.2, color=colours[name])
            ax.set_xlabel("update" if x_axis == "update" else "generated tokens")
            ax.set_ylabel(metric)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out_file, dpi=120)
    plt.close(figure)
    return figure


def main(args: Args) -> list[Path]:
    """Writes the PNGs and returns their paths; exits non-zero with a message when there is nothing to plot."""
    runs: dict[str, list[list[dict]]] = defaultdict(list)
    for run_dir in args.runs:
        try:
            name, rows, eval_only = load_run(Path(run_dir))
        except FileNotFoundError as error:
            sys.exit(f"error: {error}")
        if eval_only:
            print(
                f"skipped {run_dir}: an --eval-only run (one evaluation of a checkpoint), not a seed", file=sys.stderr
            )
        else:
            runs[name].append(rows)
    if not runs:
        sys.exit(f"error: no training runs among {[str(r) for r in args.runs]}")
    logged = {key for seeds in runs.values() for rows in seeds for row in rows for key in row}
    matches = {m: sorted(fnmatch.filter(logged, m)) if set(m) & set("*?[") else [m] for m in args.metrics}
    if unknown := [m for m, matched in matches.items() if not set(matched) & logged]:
        hint = ""
        if any(m.startswith("eval/") for m in unknown) and not any(key.startswith("eval/") for key in logged):
            hint = (
                "; no run evaluated (trained with --eval-every 0): plot the training curve with --metrics"
                " rollout/success_rate (episode success, except in TEMPO's TD updates, which log a segment's as"
                " td/segment_success_rate)"
            )
        sys.exit(
            f"error: --metrics {unknown} logged by none of the runs (no metrics.jsonl row has it){hint}; "
            f"they log e.g. {sorted(logged)[:20]}"
        )
    args = dataclasses.replace(args, metrics=tuple(dict.fromkeys(m for matched in matches.values() for m in matched)))
    for metric in args.metrics:
        if missing := sorted(
            name for name, seeds in runs.items() if not any(metric in row for rows in seeds for row in rows)
        ):
            print(f"{metric}: no rows in the runs of {missing}; they are left out of its panels", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    plot_metrics(runs, args.metrics, args.out / "comparison.png")
    written = [args.out / "comparison.png"]
    if critic := tuple(m for m in CRITIC_PANEL if m in logged):
        plot_metrics(runs, critic, args.out / "critic.png", x_axes=("update",))
        written.append(args.out / "critic.png")
    else:
        print("critic.png skipped: no run logged critic metrics (TEMPO runs do)", file=sys.stderr)
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main(tyro.cli(Args))
