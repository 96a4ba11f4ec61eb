"""plot.py: run directories -> comparison and critic PNGs, mean +/- std across seeds."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import plot


def _write_run(directory, exp_name, seed, success, critic=True, eval_only=""):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"exp_name": exp_name, "seed": seed, "eval_only": eval_only}))
    rows = [
        {
            "update": u,
            "rollout/generated_tokens": 0.0 if eval_only else 100.0,
            **({"critic/abs_error_mean": 1.0 / (u + 1)} if critic else {}),
            "eval/valid_seen/success_rate": s,
        }
        for u, s in enumerate(success)
    ]
    (directory / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_plot_runs(tmp_path):
    _write_run(tmp_path / "tempo__1__0", "tempo", 1, [0.0, 0.2, 0.4])
    _write_run(tmp_path / "tempo__2__0", "tempo", 2, [0.0, 0.4, 0.6, 0.9])
    _write_run(tmp_path / "grpo__1__0", "grpo", 1, [0.1, 0.1, 0.2])
    runs = [str(p) for p in sorted(tmp_path.iterdir())]
    subprocess.run(
        [
            sys.executable,
            str(Path(plot.__file__)),
            *runs,
            "--out",
            str(tmp_path / "plots"),
            "--metrics",
            "eval/valid_seen/success_rate",
        ],
        check=True,
        capture_output=True,
    )
    written = sorted((tmp_path / "plots").iterdir())
    assert [p.name for p in written] == ["comparison.png", "critic.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)

    seeds = [plot.load_run(tmp_path / d)[1] for d in ("tempo__1__0", "tempo__2__0")]
    curves = [plot.series(rows, "eval/valid_seen/success_rate")[::2] for rows in seeds]
    xs, mean, std = plot.mean_std(curves)
    np.testing.assert_allclose(xs, [0, 1, 2])
    np.testing.assert_allclose(mean, [0.0, 0.3, 0.5])
    np.testing.assert_allclose(std, [0.0, 0.1, 0.1])
    _, tokens, _ = plot.series(seeds[0], "eval/valid_seen/success_rate")
    np.testing.assert_allclose(tokens, [100, 200, 300])
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        plot.load_run(tmp_path / "plots")


def _plot(*args):
    command = [sys.executable, str(Path(plot.__file__)), *map(str, args)]
    if "--metrics" not in args:
        command += ["--metrics", "eval/valid_seen/success_rate"]
    return subprocess.run(command, capture_output=True, text=True)


def test_one_point_runs_eval_only_dirs_and_colours(tmp_path):
    """One evaluation per run (the README's smoke runs) is drawn as markers; an --eval-only dir is not a seed and
    does not pull the tokens axis; an experiment keeps its colour in every panel, also where another has no data."""
    _write_run(tmp_path / "adca__1__0", "adca", 1, [0.5], critic=False)
    _write_run(tmp_path / "tempo__1__0", "tempo", 1, [0.25])
    _write_run(tmp_path / "tempo__1__9", "tempo", 1, [0.75], eval_only="runs/tempo__1__0")
    runs = {}
    for run_dir in sorted(tmp_path.iterdir()):
        name, rows, eval_only = plot.load_run(run_dir)
        if not eval_only:
            runs.setdefault(name, []).append(rows)
    metrics = ("critic/abs_error_mean", "eval/valid_seen/success_rate")
    figure = plot.plot_metrics(runs, metrics, tmp_path / "comparison.png")
    colours = {}
    for ax in figure.axes:
        for line in ax.lines:
            assert line.get_marker() == "o" and len(line.get_xdata()) == 1
            colours.setdefault(line.get_label(), set()).add(line.get_color())
    assert colours == {"adca (n=1)": {"C0"}, "tempo (n=1)": {"C1"}}  # critic panel: tempo alone, still C1
    tokens_ax = figure.axes[3]
    assert [list(line.get_xdata()) for line in tokens_ax.lines] == [[100.0], [100.0]]

    result = _plot(*sorted(tmp_path.glob("*__*")), "--out", tmp_path / "plots")
    assert result.returncode == 0, result.stderr
    assert "skipped" in result.stderr and "tempo__1__9: an --eval-only run" in result.stderr
    assert (tmp_path / "plots" / "critic.png").is_file()

    result = _plot(tmp_path / "adca__1__0", "--out", tmp_path / "adca_plots")
    assert result.returncode == 0 and "critic.png skipped: no run logged critic metrics" in result.stderr
    assert [p.name for p in (tmp_path / "adca_plots").iterdir()] == ["comparison.png"]


def test_nothing_to_plot_fails_clearly(tmp_path):
    _write_run(tmp_path / "tempo__1__0", "tempo", 1, [0.25])
    _write_run(tmp_path / "tempo__1__9", "tempo", 1, [0.75], eval_only="runs/tempo__1__0")
    result = _plot(tmp_path / "tempo__1__0", "--out", tmp_path / "plots", "--metrics", "eval/no_such_metric")
    assert result.returncode != 0 and "--metrics ['eval/no_such_metric'] logged by none of the runs" in result.stderr
    result = _plot(tmp_path / "tempo__1__9", "--out", tmp_path / "plots")
    assert result.returncode != 0 and "no training runs" in result.stderr
    assert not (tmp_path / "plots").exists()


def _write_training_run(directory, exp_name, seed, success):
    """A run trained with --eval-every 0: its rows have the training metrics, no eval/."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"exp_name": exp_name, "seed": seed, "eval_every": 0}))
    rows = [
        {"update": u, "rollout/generated_tokens": 1000.0, "rollout/success_rate": s, "train/loss": 0.1}
        for u, s in enumerate(success, start=1)
    ]
    (directory / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_runs_that_never_evaluated_say_so(tmp_path):
    _write_training_run(tmp_path / "grpo__1__0", "grpo", 1, [0.2, 0.4, 0.6])
    _write_training_run(tmp_path / "tempo__1__0", "tempo", 1, [0.2, 0.2, 0.3])
    runs = [tmp_path / "grpo__1__0", tmp_path / "tempo__1__0"]
    result = _plot(*runs, "--out", tmp_path / "plots", "--metrics", "eval/valid_seen/success_rate")
    assert result.returncode != 0
    assert "--metrics ['eval/valid_seen/success_rate'] logged by none of the runs" in result.stderr
    assert "no run evaluated" in result.stderr and "--metrics rollout/success_rate" in result.stderr
    assert not (tmp_path / "plots").exists()  # no figure of zeros

    result = _plot(*runs, "--out", tmp_path / "plots", "--metrics", "rollout/success_rate")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "plots" / "comparison.png").read_bytes().startswith(b"\x89PNG")

    _write_run(tmp_path / "adca__1__0", "adca", 1, [0.1, 0.3], critic=False)  # one experiment evaluated
    result = _plot(*runs, tmp_path / "adca__1__0", "--out", tmp_path / "mixed")
    assert result.returncode == 0, result.stderr
    assert "eval/valid_seen/success_rate: no rows in the runs of ['grpo', 'tempo']" in result.stderr


def test_a_pattern_plots_every_eval_metric_it_matches(tmp_path):
    """--metrics 'eval/*/success_rate': every split each run evaluated (valid_unseen: what papers report)."""
    for seed in (1, 2):
        _write_run(tmp_path / f"gigpo__{seed}__0", "gigpo", seed, [0.1, 0.3], critic=False)
        metrics_file = tmp_path / f"gigpo__{seed}__0" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
        for row in rows:
            row["eval/valid_unseen/success_rate"] = row["eval/valid_seen/success_rate"] / 2
        metrics_file.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    runs = [tmp_path / "gigpo__1__0", tmp_path / "gigpo__2__0"]
    done = _plot(*runs, "--out", tmp_path / "plots", "--metrics", "eval/*/success_rate")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "plots" / "comparison.png").read_bytes().startswith(b"\x89PNG")
    missing = _plot(*runs, "--out", tmp_path / "plots", "--metrics", "eval/valid_x*/success_rate")
    assert missing.returncode != 0 and "eval/valid_x*/success_rate" in missing.stderr
