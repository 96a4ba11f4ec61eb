"""Wall time per update at --async-steps 0 (sample, then train) against K = 1 and 2 (the next batches sampled while the
current update trains), side by side in one run: the same GRPO job (`adca_grpo.py learning --no-attribution`: the
tiny agent, 4 games x 4 episodes, 6 turns) through one real vLLM server (benchmarks/vllm_cpu.py), the arms
interleaved repeat by repeat so that a change in the machine's load hits all of them. With two cores or more the
server is pinned to core 0 and the trainer to core 1.

An update's wall time is the sum of its time/ metrics: the wait for its rollout (at K = 0 the whole rollout), labelling
(none here) and training, i.e. the update loop minus logging. The ceiling of the overlap is (sampling + training) /
max(sampling, training) of the K = 0 arm: the slower of the two sets the pace once they overlap.

    python -m benchmarks.speed.async_steps                       # 3 repeats x K = 0, 1, 2, 6 updates each (~25 min)
    python -m benchmarks.speed.async_steps --repeats 1 --num-updates 3 --steps 0 1   # a quick look
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import samplers
from benchmarks.vllm_cpu import ROOT, VllmServer, on_cores, split_cores


def run_job(steps: int, url: str, output_dir: Path, args, trainer_cores: list[int] | None) -> list[dict]:
    """One GRPO run at --async-steps `steps`; its metrics rows."""
    command = [
        sys.executable, str(ROOT / "adca_grpo.py"), "learning", "--no-attribution", "--sampler", "vllm",
        f"--sampler-url={url}", f"--async-steps={steps}", f"--num-updates={args.num_updates}", "--eval-every=0",
        "--save-every=0", f"--exp-name=grpo-k{steps}", f"--output-dir={output_dir}", "--threads=1",
        f"--seed={args.seed}",
    ]  # fmt: skip
    log = output_dir / f"k{steps}.log"
    with open(log, "a") as out:
        done = subprocess.run(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=on_cores(trainer_cores)
        )
        if done.returncode:
            raise RuntimeError(f"the K = {steps} run failed:\n" + log.read_text()[-3000:])
    (metrics,) = sorted(output_dir.glob(f"grpo-k{steps}__*/metrics.jsonl"))[-1:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    for run_dir in output_dir.glob(f"grpo-k{steps}__*"):  # the next repeat finds only its own run
        run_dir.rename(output_dir / f"done-{time.time_ns()}")
    return rows


def wall(row: dict) -> float:
    return sum(value for key, value in row.items() if key.startswith("time/"))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 1, 2], help="the --async-steps of the arms")
    parser.add_argument("--repeats", type=int, default=3, help="runs per arm, interleaved")
    parser.add_argument("--num-updates", type=int, default=6, help="updates per run; the first is left out")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.num_updates < 2 or 0 not in args.steps:
        parser.error("--num-updates must be >= 2 (update 1 has nothing to overlap) and --steps must include 0")
    cores, (server_cores, trainer_cores) = len(os.sched_getaffinity(0)), split_cores()
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {cores} cores" + (" (busy: the figures are contaminated)" if load > 1 else ""))
    with tempfile.TemporaryDirectory() as tmp:
        model = samplers.resolve_model("tiny-agent")
        with VllmServer(model, Path(tmp) / "server.log", max_model_len=8192, cores=server_cores) as server:
            per_arm = {steps: [] for steps in args.steps}
            for repeat in range(args.repeats):
                for steps in args.steps:
                    rows = run_job(steps, server.url, Path(tmp), args, trainer_cores)
                    per_arm[steps] += rows[1:]
                    print(f"repeat {repeat + 1}, K = {steps}: {[round(wall(row), 1) for row in rows[1:]]} s/update")
    base = statistics.median(wall(row) for row in per_arm[0])
    sampling = statistics.median(row["time/rollout"] for row in per_arm[0])
    training_s = statistics.median(wall(row) - row["time/rollout"] for row in per_arm[0])
    print(f"\nupdates 2-{args.num_updates} of {args.repeats} run(s) per arm: median (min-max)\n")
    print("| --async-steps | wall s / update | waiting for the rollout s | training s | K = 0 / K |")
    print("|---|---|---|---|---|")
    for steps, rows in per_arm.items():
        walls = [wall(row) for row in rows]
        print(
            f"| {steps} | {spread(walls)} | {spread([row['time/rollout'] for row in rows])} | "
            f"{spread([wall(row) - row['time/rollout'] for row in rows])} | {base / statistics.median(walls):.2f}x |"
        )
    print(
        f"\nceiling (K = 0: sampling {sampling:.1f} s, training {training_s:.1f} s): "
        f"{(sampling + training_s) / max(sampling, training_s):.2f}x"
    )
    staleness = {steps: max(row["rollout/staleness_max"] for row in rows) for steps, rows in per_arm.items() if steps}
    print(f"largest rollout/staleness_max per K: {staleness}")


if __name__ == "__main__":
    main()
