"""Same behaviour before and after a refactor: each algorithm script's presets run in a checkout of the project (a git
worktree at any commit, or this one), their metrics and the last checkpoint's adapter / head hashes written to one JSON
file; `--compare A B` lists every difference between two such files, timings aside.

    git worktree add /tmp/before COMMIT
    python -m benchmarks.behaviour --tree /tmp/before --out /tmp/before.json
    python -m benchmarks.behaviour --out /tmp/after.json
    python -m benchmarks.behaviour --compare /tmp/before.json /tmp/after.json

Each run gets one torch thread (the runs' figures depend on the thread count) and its own output folder."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("tempo", "adca_grpo", "gigpo", "ppo")
TIMING = re.compile(r"^time/|_per_s$|/seconds$|_s$|latency")  # wall-clock figures: they differ between any two runs


def run_preset(tree: Path, script: str, preset: str, out: Path) -> dict:
    """One preset of one script, run in `tree`: its metric rows and its last checkpoint's hashes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    command = [sys.executable, f"{script}.py", preset, "--output-dir", str(out), "--threads", "1"]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{script} {preset} failed in {tree}:\n{done.stderr[-4000:]}")
    (run,) = [path.parent for path in out.glob("*/metrics.jsonl")]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = max((run / "checkpoints").glob("update_*"))
    state = json.loads((last / "trainer_state.json").read_text())
    return {
        "metrics": rows,
        "hashes": {k: v for k, v in state.items() if k.endswith("_sha256")},
    }


def compare(before: dict, after: dict) -> list[str]:
    """Every difference between two files' runs: a run only in one, a metric row, a key or a value (timings aside), a
    hash."""
    differences = [f"{name}: only in one file" for name in sorted(before.keys() ^ after.keys())]
    for name in sorted(before.keys() & after.keys()):
        a, b = before[name], after[name]
        if a["hashes"] != b["hashes"]:
            differences.append(f"{name}: hashes {a['hashes']} != {b['hashes']}")
        if len(a["metrics"]) != len(b["metrics"]):
            differences.append(f"{name}: {len(a['metrics'])} metric rows != {len(b['metrics'])}")
        for row_a, row_b in zip(a["metrics"], b["metrics"]):
            for key in sorted(k for k in row_a.keys() | row_b.keys() if not TIMING.search(k)):
                if row_a.get(key, "(absent)") != row_b.get(key, "(absent)"):
                    update = row_a.get("update", row_b.get("update"))
                    differences.append(f"{name} update {update}: {key} {row_a.get(key, '(absent)')} != "
                                       f"{row_b.get(key, '(absent)')}")  # fmt: skip
    return differences


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--tree", default=str(ROOT), help="the checkout whose scripts run (default: this one)")
    cli.add_argument("--presets", nargs="+", default=["smoke", "learning"])
    cli.add_argument("--scripts", nargs="+", default=list(SCRIPTS))
    cli.add_argument("--out", help="the JSON file written (runs already in it are kept, not run again)")
    cli.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="list the differences of two files")
    args = cli.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        differences = compare(before, after)
        print("\n".join(differences) or f"identical: {len(before)} runs, metrics and hashes")
        raise SystemExit(1 if differences else 0)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    for script in args.scripts:
        for preset in args.presets:
            name = f"{script} {preset}"
            if name not in results:
                with tempfile.TemporaryDirectory() as tmp:
                    results[name] = run_preset(Path(args.tree).resolve(), script, preset, Path(tmp))
                out.write_text(json.dumps(results, indent=1))
                print(f"{name}: {len(results[name]['metrics'])} rows, {results[name]['hashes']}", flush=True)


if __name__ == "__main__":
    main()
