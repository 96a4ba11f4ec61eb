"""plot.py: run directories -> comparison and critic PNGs, mean +/- std across seeds."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import plot


def _write_run(directory, exp_name, seed, success):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"exp_name": exp_name, "seed": seed}))
    rows = [
        {
            "update": u,
            "rollout/generated_tokens": 100.0,
            "critic/abs_error_mean": 1.0 / (u + 1),
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
