"""Per-update time of a script's `learning` preset through each sampler, side by side in one run: `generate` (the
trainer's generate() with KV reuse), `vllm-colocate` (a vLLM engine in the training process) and `vllm` (a real vLLM
server, benchmarks/vllm_cpu.py). The arms run interleaved, --repeats times each, every run --updates updates with no
evaluation and no checkpoint; an update's time is the sum of its row's time/* metrics (sampling, critic or labels,
training). The trainer runs on one thread pinned to one core; the server (its arm only) on another core.

    python -m benchmarks.speed.sampler_modes --script gigpo --updates 3 --repeats 2
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.vllm_cpu import ROOT, VllmServer, on_cores, split_cores

SAMPLERS = ("generate", "vllm-colocate", "vllm")


def run(script: str, sampler: str, updates: int, out: Path, cores, url: str = "") -> list[float]:
    """Each update's seconds (its time/* metrics summed) of one run."""
    command = [sys.executable, str(ROOT / f"{script}.py"), "learning", "--sampler", sampler, "--threads", "1",
               f"--num-updates={updates}", "--eval-every=0", "--save-every=0", "--output-dir", str(out)]  # fmt: skip
    command += ["--sampler-url", url] if url else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, preexec_fn=on_cores(cores))
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    (metrics,) = out.glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [sum(v for k, v in row.items() if k.startswith("time/")) for row in rows if row.get("update", 0) >= 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--script", default="gigpo", choices=("gigpo", "adca_grpo", "ppo"), help="a --num-updates script"
    )
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    args = parser.parse_args()
    server_cores, trainer_cores = split_cores()
    times: dict[str, list[float]] = {s: [] for s in SAMPLERS}
    with tempfile.TemporaryDirectory() as scratch:
        with VllmServer("assets/tiny-agent", Path(scratch) / "server.log", cores=server_cores) as server:
            for repeat in range(args.repeats):
                for sampler in SAMPLERS:
                    out = Path(scratch) / f"{sampler}-{repeat}"
                    url = server.url if sampler == "vllm" else ""
                    seconds = run(args.script, sampler, args.updates, out, trainer_cores, url)
                    times[sampler] += seconds
                    print(json.dumps({"sampler": sampler, "repeat": repeat, "update_seconds": seconds}), flush=True)
    summary = {
        sampler: {"n": len(t), "mean_s": round(statistics.mean(t), 2), "sd_s": round(statistics.stdev(t), 2)}
        for sampler, t in times.items()
    }
    reference = summary["generate"]["mean_s"]
    for sampler, row in summary.items():
        row["ratio_to_generate"] = round(row["mean_s"] / reference, 3)
    print(json.dumps({"script": args.script, "updates": args.updates, "repeats": args.repeats, "summary": summary,
                      "load_average": os.getloadavg()}))  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"times": times, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
