"""Does it learn? GRPO vs ADCA-GRPO (oracle labels) vs GiGPO vs PPO vs TEMPO from one warm start, on a few training
games, on CPU.

Every stage is cached under --cache, so a killed run picks up where it stopped (rerun the same command):
  1-3. the tiny agent (`benchmarks/learning/agents.py`, `--model tiny-agent`): the offline generator's first 12 games, of which
     the look_at and pick_and_place training games are used (4 games, 4-step walkthroughs), a small random Qwen2
     (~0.9M parameters), and the warm start: `sft.py` on noisy-expert episodes, with TEMPO critic examples;
  4. each algorithm x seed: `SCRIPT learning` (the script's preset of this recipe) as a subprocess (`--resume auto`),
     a checkpoint every --eval-every updates;
  5. each checkpoint: sampled success (T=1, --eval-episodes per game) and greedy success, in-process with the
     scripts' own sampler and rollout;
  6. TEMPO's critic at the start and at each TEMPO checkpoint, against the true V of held-out states of the warm
     start's own episodes (benchmarks/learning/critic.py: Pearson r and mean |V_hat - V|, beside a value head, the constant and
     the "Nothing happens." count), and PPO's trained value head at each PPO checkpoint on the same states;
  7. results.json, learning.png (success vs generated tokens, mean +/- std over seeds), tempo_critic.png and
     learning.md (start, end, change with a 95% interval, tokens to reach GRPO's final level; the critic's scores).

    python -m benchmarks.learning.compare                 # the full comparison
    python -m benchmarks.learning.compare --quick         # one seed, fewer updates: a smoke check of the whole pipeline
    python -m benchmarks.learning.compare --setting long --eval-every 12 --eval-episodes 8 --tempo-td-updates 21
                                                  # the long-horizon setting (docs/does-it-learn.md)
    python -m benchmarks.learning.compare --seeds 1 --algorithms grpo@3e-4 grpo tempo@3e-4 tempo
                                                  # an lr sweep: NAME@LR is the variant NAME at lr LR
    python -m benchmarks.learning.compare --algorithms grpo_vllm grpo_async1 --reference grpo_vllm --seeds 1 2 3 4 5
                                                  # --async-steps 1 against 0, both through one CPU vLLM server
                                                  # that compare.py starts (the arms needing one: runs.needs_server)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import tyro

import common
import harness
import samplers
from benchmarks.learning import agents, critic
from benchmarks.learning.runs import (
    MAIN_ARMS,
    SAVE_EVERY,
    SETTINGS,
    UPDATES,
    algorithm,
    algorithm_command,
    needs_server,
    recipe,
    run,
    run_updates,
)  # fmt: skip


@dataclass
class Args:
    out: str = "benchmarks/results/learning"
    """results directory (results.json, learning.png, tempo_critic.png, learning.md): committed"""
    cache: str = str(agents.CACHE)
    """games, models and run directories (checkpoints): not committed"""
    setting: Literal["short", "long", "rank"] = "short"
    """short: 4 games with 4-step walkthroughs, T 6 (tiny-agent); long: pick two / clean / cool games with 6-10-step
    walkthroughs, T 20, TEMPO's H 5 (tiny-agent-long); each script's `learning` / `learning-long` preset; rank: the
    ranking setting, 32 look_at / pick_and_place training games of the generated set (rank-agent, built by
    benchmarks/learning/agents.py), the short setting's `learning` preset"""
    quick: bool = False
    """one seed, --quick-updates updates: the pipeline end to end in minutes"""
    algorithms: tuple[str, ...] = ()
    """which of ALGORITHMS to run (grpo, adca_oracle, gigpo, tempo, tempo_ppo, ...); NAME@LR: at lr LR; none given:
    MAIN_ARMS when running, every arm in results.json with --report-only"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds per algorithm"""
    updates: int = UPDATES
    """training updates per run (TEMPO: a quarter warm-up, the rest TD updates)"""
    tempo_td_updates: int = 0
    """TD updates of the TEMPO runs (0: --updates minus TEMPO's warm-up); more give TEMPO the others' generated tokens"""
    quick_updates: int = 4
    """updates per run with --quick"""
    eval_every: int = SAVE_EVERY
    """checkpoint and evaluate every N updates"""
    eval_episodes: int = 16
    """sampled (T=1) episodes per game and evaluation point (x 4 games)"""
    start_eval_episodes: int = 32
    """sampled episodes per game for the shared warm start"""
    warm_start: str = ""
    """a model directory every run starts from instead of the setting's tiny agent (its games stay); results and runs
    go to folders named after it"""
    threads: int = 1
    """torch threads of every stage"""
    heldout_episodes: int = 0
    """sampled episodes per game on the valid_seen and valid_unseen games of the setting's task types (games no run
    trains on), at the start and at each run's last checkpoint; 0: not evaluated"""
    critic_eval: bool = False
    """score TEMPO's critic (and PPO's value head) against true V at the start and at each TEMPO (PPO) evaluation
    point (~4 min a point)"""
    start_from: str = ""
    """another --out whose results.json's warm-start evaluation this one shares (its setting and warm start): folders
    filled side by side by parallel processes pool as one evaluation of one warm start; empty: evaluated here"""
    report_only: bool = False
    """only rewrite the table and plots from results.json (e.g. after stopping a run part way)"""
    reference: str = "grpo"
    """the arm every other arm's end success is compared with (Welch interval): grpo_vllm for grpo_async1"""
    sampler_url: str = ""
    """a running vLLM server of the warm start for the arms that sample through one (grpo_vllm, grpo_async1); empty:
    compare.py starts one on the CPU while such runs train (benchmarks/vllm_cpu.py: on one core, the runs on another)"""
    eval_seed: int = harness.EVAL_SEED
    """the sampler's seed of every evaluation here (the same random numbers for every checkpoint and run); a
    confirmatory comparison takes one that no earlier evaluation used"""
    clip: tuple[float, float] | None = None
    """the PPO clip range (below 1, above 1) given to every arm's script as --clip-eps, --clip-eps-high: one setting
    for all arms; None: each script's preset (GRPO and ADCA-GRPO 0.2 / 0.28, GiGPO and PPO 0.2 / 0.2, TEMPO none)"""


def log(message: str) -> None:
    print(f"[learning {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_dir(runs: Path, name: str, seed: int) -> Path | None:
    dirs = sorted(runs.glob(f"{name}-s{seed}__*"))
    return dirs[-1] if dirs else None


def trained(runs: Path, name: str, seed: int, updates: int, td_updates: int) -> bool:
    """Whether the run of `name` at `seed` saved its last checkpoint."""
    rdir = run_dir(runs, name, seed)
    return rdir is not None and (rdir / "checkpoints" / f"update_{run_updates(name, updates, td_updates):06d}").is_dir()


@contextlib.contextmanager
def sampler_server(args: Args, warm: Path, pending: Sequence[str], log_file: Path):
    """(the server URL, the cores of the training runs) while the runs train: --sampler-url if given; else, when an arm
    still to train (pending) samples through a vLLM server, a CPU server of the warm start started here and stopped at
    the end, on one core with the runs on another (on one core, they share it); else ("", None)."""
    if args.sampler_url or not any(map(needs_server, pending)):
        yield args.sampler_url, None
        return
    from benchmarks.vllm_cpu import VllmServer, split_cores

    server_cores, trainer_cores = split_cores()
    log(f"starting a vLLM server of {warm} on cores {server_cores}, the runs on {trainer_cores} (log: {log_file})")
    context = recipe(args.setting).max_trajectory_tokens  # what the scripts check the server's context against
    with VllmServer(warm, log_file, max_model_len=context, cores=server_cores) as server:
        yield server.url, trainer_cores


def metrics_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


# =============================================================================================
# Stage 5: sampled and greedy success of a checkpoint, with the scripts' own sampler
# =============================================================================================
class Evaluator:
    def __init__(self, warm: Path, games: list[str], args: Args):
        import torch
        from transformers import AutoTokenizer

        torch.set_num_threads(args.threads)
        self.warm, self.games, self.args, self.recipe = warm, games, args, recipe(args.setting)
        self.accelerator = harness.make_accelerator()
        self.tokenizer = AutoTokenizer.from_pretrained(warm, padding_side="left")
        self.protocol = common.ChatProtocol(self.tokenizer)

    def __call__(self, checkpoint: Path | None, episodes: int) -> dict:
        """Wins per game, sampled (`episodes` a game, T = 1) and greedy (one), and each mode's share of replies that
        were admissible commands (a memorised command from other games is not: "Nothing happens.")."""
        import torch
        from peft import PeftModel

        model = samplers.pretrained(self.warm, torch.float32)
        if checkpoint is not None:
            model = PeftModel.from_pretrained(model, checkpoint).merge_and_unload()
        sampling, cap = dataclasses.replace(self.recipe, temperature=1.0, top_p=1.0), self.recipe.max_turns
        result, admissible = {}, {}
        for mode, branches in (("sampled", episodes), ("greedy", 1)):
            greedy = mode == "greedy"
            sample_fn = samplers.make_sampler(model, self.tokenizer, self.accelerator, sampling, greedy=greedy)
            starts = [common.game_start(game, self.protocol) for game in self.games]
            with harness.seeded_sampling(self.args.eval_seed):  # common random numbers: the same for every checkpoint
                groups = common.rollout(
                    starts, branches, sample_fn, self.protocol, horizon=cap, max_turns=cap,
                    max_turn_tokens=sampling.max_turn_tokens, max_trajectory_tokens=sampling.max_trajectory_tokens,
                )  # fmt: skip
            result[mode] = [sum(t.won for t in group) for group in groups]  # wins per game
            steps = [step for group in groups for t in group for step in t.steps]
            admissible[mode] = sum(step.admissible for step in steps) / len(steps)  # replies the game could execute
        return result | {"episodes": episodes, "admissible": admissible}


def success(point: dict, mode: str = "sampled") -> float:
    return sum(point[mode]) / (len(point[mode]) * (point["episodes"] if mode == "sampled" else 1))


# =============================================================================================
# Stage 6: statistics, tables and plots
# =============================================================================================
def difference_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): the difference of two arms' means over their per-seed values, with Welch's t
    interval at `level` (Welch-Satterthwaite degrees of freedom; scipy's ttest_ind with equal_var=False)."""
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"difference_interval needs >= 2 values per arm, got {len(a)} and {len(b)}")
    interval = stats.ttest_ind(a, b, equal_var=False).confidence_interval(level)
    return statistics.fmean(a) - statistics.fmean(b), float(interval.low), float(interval.high)


def change_interval(values: Sequence[float], start: float, level: float = 0.95) -> tuple[float, float, float]:
    """(mean(values) - start, low, high): one-sample t interval of the per-seed changes from the shared start (whose
    own evaluation noise is common to every arm, so it is not in the interval)."""
    from scipy import stats

    if len(values) < 2:
        raise ValueError(f"change_interval needs >= 2 values, got {len(values)}")
    interval = stats.ttest_1samp([v - start for v in values], 0.0).confidence_interval(level)
    return statistics.fmean(values) - start, float(interval.low), float(interval.high)


def episode_outcomes(point: dict, mode: str = "sampled") -> list[int]:
    """The evaluation point's episodes as 0/1 outcomes (its wins per game, each game's episodes one after another)."""
    n = point["episodes"] if mode == "sampled" else 1
    return [int(e < wins) for wins in point[mode] for e in range(n)]


def change_interval_with_start(
    values: Sequence[float], start: dict, level: float = 0.95
) -> tuple[float, float, float]:  # fmt: skip
    """(mean(values) - the start's success, low, high): Welch's t interval of the per-seed ends against the start's
    evaluation taken as its sample of 0/1 episodes, so the start's own sampling noise is in the interval (the ends
    reuse the start's random numbers, so they correlate with it: treating them as independent makes it wider, not
    narrower)."""
    return difference_interval(values, episode_outcomes(start), level)


BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 9999, 0  # fixed, so that the regenerated tables do not move


def bootstrap_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): the percentile bootstrap interval of the difference of means, each arm resampled
    on its own (scipy.stats.bootstrap, a fixed seed). Its bounds are differences of means of observed values, so they
    stay within [-1, 1] and within what the data can give; at n = 5 a percentile interval is narrower than its level
    claims (it ignores that the spread itself is estimated), so it is read beside Welch's, not instead of it."""
    import numpy as np
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"bootstrap_interval needs >= 2 values per arm, got {len(a)} and {len(b)}")
    result = stats.bootstrap(
        (np.asarray(a, float), np.asarray(b, float)),
        lambda x, y, axis: np.mean(x, axis=axis) - np.mean(y, axis=axis),
        vectorized=True, paired=False, confidence_level=level, n_resamples=BOOTSTRAP_RESAMPLES, method="percentile",
        rng=np.random.default_rng(BOOTSTRAP_SEED),
    )  # fmt: skip
    interval = result.confidence_interval
    return statistics.fmean(a) - statistics.fmean(b), float(interval.low), float(interval.high)


def rank_test_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided Mann-Whitney U p-value of a against b, by permutation (scipy's PermutationMethod: exact when the
    distinct splits of the pooled values number at most BOOTSTRAP_RESAMPLES, e.g. 252 at n = 5 + 5; ties handled)."""
    import numpy as np
    from scipy import stats

    method = stats.PermutationMethod(n_resamples=BOOTSTRAP_RESAMPLES, rng=np.random.default_rng(BOOTSTRAP_SEED))
    return float(stats.mannwhitneyu(a, b, alternative="two-sided", method=method).pvalue)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values, in their order: the k-th smallest is multiplied by the
    number of hypotheses not yet rejected (m - k + 1), capped at 1 and kept at least its predecessor's; each adjusted
    p below the level rejects with the family-wise error rate held at it."""
    order = sorted(range(len(p_values)), key=p_values.__getitem__)
    adjusted, running = [0.0] * len(p_values), 0.0
    for k, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - k) * p_values[index]))
        adjusted[index] = running
    return adjusted


def detectable_difference(n_a: int, n_b: int, sd: float, level: float = 0.95, power: float = 0.8) -> float:
    """The smallest true difference of means that a two-sided two-sample t-test at `level` finds with probability
    `power`, for arms of n_a and n_b seeds whose values spread by `sd` (noncentral t)."""
    from scipy import optimize, stats

    if n_a < 2 or n_b < 2 or sd <= 0:
        return math.nan
    df, scale = n_a + n_b - 2, sd * math.sqrt(1 / n_a + 1 / n_b)
    critical = stats.t.ppf(1 - (1 - level) / 2, df)

    def achieved(delta: float) -> float:
        return stats.nct.sf(critical, df, delta / scale) + stats.nct.sf(critical, df, -delta / scale)  # both tails

    return optimize.brentq(lambda delta: achieved(delta) - power, 0.0, (critical + 8) * scale)  # power ~1 up there


def pooled_sd(a: Sequence[float], b: Sequence[float]) -> float:
    squares = (len(a) - 1) * statistics.variance(a) + (len(b) - 1) * statistics.variance(b)
    return math.sqrt(squares / (len(a) + len(b) - 2))


def bracket(estimate: tuple[float, float, float]) -> str:
    difference, low, high = estimate
    return f"{difference:+.2f} [{low:+.2f}, {high:+.2f}]" if math.isfinite(low) else f"{difference:+.2f} [-]"


def finished(run: dict) -> bool:
    """Evaluated past the start and, where its training metrics are kept, up to their last update (a run still being
    evaluated is not reported)."""
    if len(run["points"]) < 2:
        return False
    last = run["metrics"][-1]["update"] if run.get("metrics") else run["points"][-1].get("update")
    return run["points"][-1].get("update") == last


def arm_runs(results: dict, name: str) -> list[dict]:
    """The finished runs of arm `name`, by seed."""
    runs = [r for r in results["runs"].values() if r["algorithm"] == name and finished(r)]
    return sorted(runs, key=lambda r: r["seed"])


def arms_in(results: dict, reference: str = "grpo") -> list[str]:
    """Every arm with a finished run, the reference first."""
    names = sorted({r["algorithm"] for r in results["runs"].values() if finished(r)})
    return sorted(names, key=lambda name: name != reference)


def summarise(results: dict, arms: Sequence[str], reference: str = "grpo") -> str:
    """Per arm: seeds n, start, midpoint (the evaluation at half the run's updates) and end sampled success, the change
    from the start with Welch's t interval that counts the start's own episodes (change_interval_with_start), the
    difference from the reference arm's end with Welch's t interval (95%), its percentile bootstrap interval and the
    Mann-Whitney p-value (in brackets Holm's adjustment over the table's comparisons with the reference), the
    smallest difference Welch's test detects at 80% power at the pooled sd it states, greedy success, tokens (the
    actor's, with the critic's, and an oracle's continuations apart), and whether every run's provenance is
    recorded."""
    start = results["start"]
    s0 = success(start)
    arms = {name: runs for name in arms if (runs := arm_runs(results, name))}
    for name, runs in arms.items():
        check_poolable(name, runs)
    ends = {name: [success(r["points"][-1]) for r in runs] for name, runs in arms.items()}
    ref_runs, ref_finals = arms.get(reference), ends.get(reference, [])
    ref_mean = statistics.fmean(ref_finals) if ref_finals else None
    ref_tokens = statistics.fmean(r["points"][-1]["tokens"] for r in ref_runs) if ref_runs else None
    compared = [n for n, finals in ends.items() if n != reference and len(finals) > 1 and len(ref_finals) > 1]
    rank_ps = {name: rank_test_p(ends[name], ref_finals) for name in compared}
    adjusted = dict(zip(rank_ps, holm(list(rank_ps.values()))))
    lines = [
        "| arm | n (seeds) | start | mid | end (mean ± std) | change [95% Welch t, start's episodes counted] | "
        f"end - {reference} [95% Welch t] | [percentile bootstrap, nominal 95%] | Mann-Whitney p (Holm) | "
        "detectable at 80% power (at sd) | "
        "end greedy | actor tokens | actor + critic tokens | oracle continuation tokens | "
        f"tokens to reach {reference}'s end (% of its tokens) | provenance |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in arms.items():
        finals = ends[name]
        mids = [success(p) for r in runs for p in r["points"] if p.get("update") == r["points"][-1]["update"] // 2]
        tokens = statistics.fmean(r["points"][-1]["tokens"] for r in runs)
        critic_tokens, oracle_tokens = (
            statistics.fmean(tokens_until(r, r["points"][-1].get("update", 0), metric) for r in runs)
            for metric in ("critic/generated_tokens", "td/oracle_generated_tokens")
        )
        mean_end = statistics.fmean(finals)
        change = bracket(change_interval_with_start(finals, start)) if len(finals) > 1 else f"{mean_end - s0:+.2f}"
        reach = vs_reference = boot = rank_p = detectable = "-"
        if ref_runs:
            if ref_mean <= s0:  # every run starts at the reference's final level: nothing to reach
                reach = f"- ({reference} ended at or below the start)"
            else:
                hit = next((t for t, m, _ in mean_curve(runs) if m >= ref_mean), None)
                reach = f"{hit:,.0f} ({hit / ref_tokens:.0%})" if hit is not None else "not reached"
            if name in rank_ps:
                vs_reference = bracket(difference_interval(finals, ref_finals))
                _, low, high = bootstrap_interval(finals, ref_finals)
                boot = f"[{low:+.2f}, {high:+.2f}]"
                rank_p = f"{rank_ps[name]:.2f} ({adjusted[name]:.2f})"
                spread = pooled_sd(finals, ref_finals)
                detectable = f"{detectable_difference(len(finals), len(ref_finals), spread):.2f} ({spread:.2f})"
        std = statistics.stdev(finals) if len(finals) > 1 else 0.0
        mid = f"{statistics.fmean(mids):.2f}" if len(mids) == len(runs) else "-"
        greedy = statistics.fmean(success(r["points"][-1], "greedy") for r in runs)
        recorded = sum(bool(r.get("provenance")) for r in runs)
        lines.append(
            f"| {name} | {len(runs)} | {s0:.2f} | {mid} | {mean_end:.2f} ± {std:.2f} | {change} | {vs_reference} | "
            f"{boot} | {rank_p} | {detectable} | {greedy:.2f} | {tokens:,.0f} | {tokens + critic_tokens:,.0f} | "
            f"{oracle_tokens:,.0f} | {reach} | "
            f"{'recorded' if recorded == len(runs) else f'{len(runs) - recorded} of {len(runs)} runs lack it'} |"
        )
    return "\n".join(lines) + "\n"


def heldout_summary(results: dict, arms: Sequence[str]) -> str:
    """Success on games no run trains on (--heldout-episodes: the valid_seen and valid_unseen games of the setting's
    task types), at the start and at each arm's end, means over the seeds evaluated there: sampled (wins / episodes)
    and greedy (games won / games)."""
    start = results["start"]
    splits = [split for split in agents.HELDOUT_SPLITS if split in start]
    if not splits:
        return ""

    def cell(points: list[dict], split: str) -> str:
        if not points:
            return "-"
        first = points[0][split]
        sampled = statistics.fmean(success(p[split]) for p in points)
        greedy = statistics.fmean(success(p[split], "greedy") for p in points)
        return f"{sampled:.2f} / {greedy:.2f} ({len(first['sampled'])} games x {first['episodes']})"

    header = " | ".join(f"{split} sampled / greedy" for split in splits)
    lines = [f"| arm | n (seeds) | {header} |", "|---|---|" + "---|" * len(splits)]
    lines.append("| (the start) | - | " + " | ".join(cell([start], split) for split in splits) + " |")
    for name in arms:
        ends = [r["points"][-1] for r in arm_runs(results, name)]
        ends = [p for p in ends if all(split in p for split in splits)]
        if ends:
            lines.append(f"| {name} | {len(ends)} | " + " | ".join(cell(ends, split) for split in splits) + " |")
    return "\n".join(lines) + "\n"


# Fields of a run's config.json that name the run or where it ran, not what it trains: runs of one arm may differ only
# in these (sampler_url: each compare.py process starts its server on a free port)
RUN_IDENTITY_FIELDS = ("seed", "exp_name", "output_dir", "resume", "threads", "sampler_url")


def check_poolable(name: str, runs: Sequence[dict]) -> None:
    """Refuse to pool runs under one arm name whose recorded flags differ beyond the run's identity (the seed, its
    names and folders), or that started from different warm starts; runs without provenance are not checked (the
    table says they lack it)."""
    recorded = [r["provenance"] for r in runs if r.get("provenance")]
    configs = [{k: v for k, v in p["config"].items() if k not in RUN_IDENTITY_FIELDS} for p in recorded]
    differing = sorted({k for c in configs for k in c if any(c.get(k) != other.get(k) for other in configs)})
    if len({p["warm_start_sha256"] for p in recorded}) > 1:
        differing.append("warm_start_sha256")
    if differing:
        raise ValueError(f"arm {name!r}: its runs differ beyond the seed in {differing}; give them different arm names")


def run_provenance(run: Path, warm_sha256: str) -> dict:
    """What a results entry records of how its run was made: the flags the script resolved (config.json), each start
    or resume of it (provenance.jsonl: commit, dirty tree, packages, command line) and the warm start's hash."""
    sessions = [json.loads(line) for line in (run / "provenance.jsonl").read_text().splitlines() if line.strip()]
    config = json.loads((run / "config.json").read_text())
    return {"config": config, "sessions": sessions, "warm_start_sha256": warm_sha256}


def directory_sha256(path: Path) -> str:
    """One hash over a model directory's files (names and bytes, in name order)."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def tokens_until(run: dict, update: int, metric: str) -> float:
    """The tokens counted in `metric` up to `update`: TEMPO's critic's (critic/generated_tokens) or its oracle's
    continuations (td/oracle_generated_tokens); 0 for a run that logs none."""
    return sum(m.get(metric, 0.0) for m in run.get("metrics", ()) if m["update"] <= update)


# Per-update signals, means over a run's updates (TEMPO's actor/ and td/: TD updates only), then over seeds
SIGNALS = (
    "train/tokens", "gigpo/step_group_size_mean", "gigpo/singleton_step_share", "actor/degenerate_group_rate",
    "actor/trained_tokens", "actor/value_gap_zero_reward", "td/segment_success_rate", "td/macro_index_mean",
    "td/store_macro_index_mean", "td/start_value_mean", "td/fresh_states", "critic/td_target_corr",
)  # fmt: skip


def signals_summary(results: dict, arms: Sequence[str], late: bool = False) -> str:
    """The signals each algorithm's updates saw (late: only the second half of each run's updates, TEMPO's TD updates),
    and TEMPO's critic tokens apart from the actor's."""
    rows = []
    for name in arms:
        runs = [r for r in results["runs"].values() if r["algorithm"] == name and r.get("metrics")]
        if not runs:
            continue
        cells = []
        for key in SIGNALS:
            per_run = []
            for r in runs:
                updates = [m for m in r["metrics"] if m.get("phase", "td") == "td"]
                updates = updates[len(updates) // 2 :] if late else updates
                if values := [m[key] for m in updates if key in m]:
                    per_run.append(statistics.fmean(values))
            cells.append(f"{statistics.fmean(per_run):.3g}" if per_run else "-")
        critic_tokens = [sum(m.get("critic/generated_tokens", 0) for m in r["metrics"]) for r in runs]
        cells.append(f"{statistics.fmean(critic_tokens):,.0f}" if any(critic_tokens) else "-")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    header = "| algorithm | " + " | ".join(f"`{k}`" for k in SIGNALS) + " | critic generated tokens |"
    return "\n".join([header, "|---|" + "---|" * (len(SIGNALS) + 1), *rows]) + "\n" if rows else ""


def critic_summary(results: dict, arms: Sequence[str]) -> str:
    """TEMPO's critic on the held-out states per evaluation point, means over seeds: r and MAE of each critic, and r
    of the warm start's generative critic, untrained, against the point's true V (what training the critic bought)."""
    critics = ("generative", "value_head", "constant", "nothing_count")
    lines = [
        "| algorithm | update | seeds | states | true V mean (std) | "
        + " | ".join(f"{c} r / MAE" for c in critics)
        + " | parse rate | warm start's generative r |",
        "|---|---|---|---|---|" + "---|" * len(critics) + "---|---|",
    ]
    warm = results["start"].get("critic", {}).get("generative", {}).get("predictions")

    def mean(values):
        values = [v for v in values if v is not None]
        return f"{statistics.fmean(values):+.2f}" if values else "n/a"

    def row(name, update, points):
        scores = [p["critic"] for p in points]
        values = [s["values"] for s in scores]
        cells = [
            f"{mean(s[c]['r'] for s in scores)} / {statistics.fmean(s[c]['mae'] for s in scores):.3f}" for c in critics
        ]
        parse = statistics.fmean(s["generative"]["parse_rate"] for s in scores)
        v_mean, v_std = statistics.fmean(v["mean"] for v in values), statistics.fmean(v["std"] for v in values)
        untrained = mean(critic.pearson(warm, v["values"]) for v in values) if warm else "n/a"
        return f"| {name} | {update} | {len(points)} | {values[0]['n']} | {v_mean:.2f} ({v_std:.2f}) | " + (
            " | ".join(cells) + f" | {parse:.2f} | {untrained} |"
        )

    if "critic" in results["start"]:
        lines.append(row("(warm start)", 0, [results["start"]]))
    for name in (n for n in arms if n.startswith("tempo")):
        runs = [r for r in results["runs"].values() if r["algorithm"] == name]
        updates = sorted({p["update"] for r in runs for p in r["points"] if "critic" in p and "update" in p})
        for update in updates:
            points = [p for r in runs for p in r["points"] if p.get("update") == update and "critic" in p]
            lines.append(row(name, update, points))
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def value_head_summary(results: dict, arms: Sequence[str]) -> str:
    """PPO's value head on the held-out states per evaluation point, means over seeds: r (None: constant) and MAE."""
    lines = ["| algorithm | update | seeds | true V mean | value head r / MAE |", "|---|---|---|---|---|"]
    for name in (n for n in arms if n.startswith("ppo")):
        points = [p for r in results["runs"].values() if r["algorithm"] == name for p in r["points"]]
        for update in sorted({p["update"] for p in points if "value_head" in p}):
            scores = [p["value_head"] for p in points if p.get("update") == update and "value_head" in p]
            rs = [s["r"] for s in scores if s["r"] is not None]
            r = f"{statistics.fmean(rs):+.2f}" if rs else "n/a"
            v_mean = statistics.fmean(s["values"]["mean"] for s in scores)
            mae = statistics.fmean(s["mae"] for s in scores)
            lines.append(f"| {name} | {update} | {len(scores)} | {v_mean:.2f} | {r} / {mae:.3f} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def mean_curve(runs: list[dict], with_critic: bool = False) -> list[tuple[float, float, float]]:
    """(mean generated tokens of the actor, and with_critic of TEMPO's critic too; mean success, std) per evaluation
    point that every seed has (points aligned by update: a seed may have been evaluated more often)."""
    curve = []
    for update in sorted({p.get("update") or 0 for p in runs[0]["points"]}):
        points = [next((p for p in r["points"] if (p.get("update") or 0) == update), None) for r in runs]
        if None in points:
            continue
        values = [success(p) for p in points]
        tokens = statistics.fmean(
            p["tokens"] + (tokens_until(r, update, "critic/generated_tokens") if with_critic else 0)
            for r, p in zip(runs, points)
        )
        curve.append((tokens, statistics.fmean(values), statistics.pstdev(values)))
    return curve


def plot(results: dict, out: Path, arms: Sequence[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, with_critic in zip(axes, (False, True)):
        for name in arms:
            runs = [r for r in results["runs"].values() if r["algorithm"] == name and r["points"]]
            if runs:
                tokens, mean, std = zip(*mean_curve(runs, with_critic))
                ax.plot(tokens, mean, marker="o", label=f"{name} ({len(runs)} seeds)")
                low, high = [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)]
                ax.fill_between(tokens, low, high, alpha=0.2)
        ax.set_xlabel("generated tokens (actor + TEMPO's critic)" if with_critic else "generated tokens (actor)")
        ax.set_ylabel("sampled success (T=1)")
        ax.set_title("Success on the training games, mean ± std over seeds", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "learning.png", dpi=120)
    plt.close(fig)

    critic_panel(results, out, arms)
    tempo_runs = [r for r in results["runs"].values() if r["algorithm"].startswith("tempo")]
    if tempo_runs:
        keys = (  # the critic's warm-up targets, then the README's four TD-phase signals
            "critic/parse_failure_rate", "critic/abs_error_mean", "critic/value_corr", "critic/td_target_corr",
            "actor/value_gap_zero_reward", "td/fresh_states", "td/restore_failures", "actor/degenerate_group_rate",
        )  # fmt: skip
        fig, axes = plt.subplots(2, 4, figsize=(16, 6.4))
        axes = axes.flatten()
        for ax, key in zip(axes, keys):
            for r in tempo_runs:
                rows = [m for m in r["metrics"] if key in m]
                ax.plot(
                    [m["update"] for m in rows],
                    [m[key] for m in rows],
                    marker=".",
                    label=f"{r['algorithm']} s{r['seed']}",
                )
            ax.set_title(key, fontsize=9)
            ax.set_xlabel("update")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "tempo_critic.png", dpi=120)
        plt.close(fig)


def critic_panel(results: dict, out: Path, arms: Sequence[str]) -> None:
    """critic_panel.png: each TEMPO arm's generative critic against true V of the held-out states (Pearson r, mean over
    seeds) at each evaluation point, beside the "Nothing happens." count's r on the same states, the reference line a
    critic should beat (--critic-eval points only)."""
    import matplotlib.pyplot as plt

    def r_at(points: list[dict], critic_name: str) -> float | None:
        rs = [p["critic"][critic_name]["r"] for p in points if p["critic"][critic_name]["r"] is not None]
        return statistics.fmean(rs) if rs else None

    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for name in (n for n in arms if n.startswith("tempo")):
        points = [p for r in results["runs"].values() if r["algorithm"] == name for p in r["points"] if "critic" in p]
        updates = sorted({p.get("update", 0) for p in points})
        color = None
        for critic_name, style in (("generative", "-o"), ("nothing_count", ":x")):
            curve = [(u, r_at([p for p in points if p.get("update", 0) == u], critic_name)) for u in updates]
            curve = [(u, r) for u, r in curve if r is not None]
            if curve:
                (line,) = ax.plot(*zip(*curve), style, color=color, label=f"{name}: {critic_name.replace('_', ' ')}")
                color, drawn = line.get_color(), True
    if drawn:
        ax.set_xlabel("update (0: the warm start)")
        ax.set_ylabel("r against true V (held-out states)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "critic_panel.png", dpi=120)
    plt.close(fig)


def shared_start(results: dict, source: Path) -> dict:
    """The warm start's evaluation in source (another folder's results.json) as results' start: processes filling
    folders side by side share one evaluation of one warm start (tables.pooled refuses folders whose starts differ).
    Refuses a results whose own start is another evaluation."""
    if not source.is_file():
        raise FileNotFoundError(f"--start-from: no {source} (evaluate its warm start there first)")
    start = json.loads(source.read_text())["start"]
    own = results.get("start", start)
    if any(own.get(key) != start.get(key) for key in ("sampled", "greedy", "episodes", "warm_start_sha256")):
        raise ValueError(f"--start-from: this folder's start is another evaluation than {source}'s: not poolable")
    return own


def save(results_file: Path, results: dict, ours: set[str]) -> None:
    """Write results (with its warm start's "start") to results_file, merged with what the file holds: the runs of
    other algorithms or seeds (keys not in ours) and the warm start's entries (its critic panel) that a parallel
    process wrote are kept."""
    stored = json.loads(results_file.read_text()) if results_file.is_file() else {"runs": {}}
    results["runs"] = {**stored["runs"], **{key: results["runs"][key] for key in ours if key in results["runs"]}}
    for key, value in stored.get("start", {}).items():
        results["start"].setdefault(key, value)
    tmp = results_file.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, results_file)


# =============================================================================================
# Main
# =============================================================================================
def main(args: Args) -> None:
    from tqdm import tqdm

    for name in (*args.algorithms, args.reference):
        algorithm(name)  # an unknown name fails before anything runs
    if args.eval_every < 1 or args.updates < 1:
        raise ValueError("--updates and --eval-every must be >= 1")
    mode = "quick" if args.quick else "full"
    mode = mode if args.setting == "short" else f"{args.setting}-{mode}"
    mode += f"-{Path(args.warm_start).name}" if args.warm_start else ""
    out, cache = Path(args.out) / mode, Path(args.cache)
    out.mkdir(parents=True, exist_ok=True)
    seeds = args.seeds[:1] if args.quick else args.seeds
    updates = args.quick_updates if args.quick else args.updates
    td_updates = 0 if args.quick else args.tempo_td_updates  # TEMPO's, when set (runs.run_updates)
    if args.quick:
        args = dataclasses.replace(args, eval_every=updates)
    results_file = out / "results.json"
    if args.report_only:
        return report(json.loads(results_file.read_text()), out, args)
    agent = SETTINGS[args.setting][0]
    warm, games = agents.build(cache, args.threads, agent)
    warm = Path(args.warm_start) if args.warm_start else warm
    task_types = agents.RECIPES[agent].task_types
    game_files = common.discover_games(games, "train", task_types)
    evaluate = Evaluator(warm, game_files, args)
    heldout = {
        split: Evaluator(warm, common.discover_games(games, split, task_types), args) for split in agents.HELDOUT_SPLITS
    } if args.heldout_episodes else {}  # fmt: skip

    def evaluate_heldout(point: dict, checkpoint: Path | None) -> bool:
        """Add the held-out splits' evaluations the point lacks; whether it added any."""
        missing = [split for split in heldout if split not in point]
        for split in missing:
            log(f"{'the warm start' if checkpoint is None else checkpoint}: {split}")
            point[split] = heldout[split](checkpoint, args.heldout_episodes)
        return bool(missing)

    results = json.loads(results_file.read_text()) if results_file.is_file() else {"runs": {}}
    results["config"] = {**dataclasses.asdict(args), "games": game_files, "updates": updates, "seeds": list(seeds)}

    arms = args.algorithms or MAIN_ARMS
    jobs = [(name, seed) for seed in seeds for name in arms]
    ours = {f"{name}-s{seed}" for name, seed in jobs}

    warm_sha256 = directory_sha256(warm)
    if args.start_from:  # then checked against this warm start's hash below
        results["start"] = shared_start(results, Path(args.start_from) / mode / "results.json")
    if "start" not in results:
        log("evaluating the warm start")
        results["start"] = {**evaluate(None, args.start_eval_episodes), "tokens": 0, "warm_start_sha256": warm_sha256}
        save(results_file, results, ours)
    elif results["start"].get("warm_start_sha256") is None:  # evaluated before hashes were kept: evaluate it again
        log("the warm start's evaluation has no hash: evaluating it again to check it is the same warm start")
        again = evaluate(None, results["start"]["episodes"])
        if any(again[mode] != results["start"][mode] for mode in ("sampled", "greedy")):
            raise ValueError(f"{warm}: its evaluation differs from {results_file}'s start; another warm start?")
        results["start"]["warm_start_sha256"] = warm_sha256
        save(results_file, results, ours)
    elif results["start"]["warm_start_sha256"] != warm_sha256:
        raise ValueError(f"{warm} is not the warm start {results_file} was made from (its sha256 differs)")
    if evaluate_heldout(results["start"], None):
        save(results_file, results, ours)
    log(f"warm start: sampled {success(results['start']):.2f}, greedy {success(results['start'], 'greedy'):.2f}")
    probe = None

    def held_out_probe():
        nonlocal probe
        probe = probe or critic.Probe(critic.Args(cache=str(cache), setting=args.setting, threads=args.threads))
        return probe

    def critic_point(checkpoint: Path | None) -> dict:
        probe = held_out_probe()
        # the held-out states of the setting's tiny agent; V under the policy scored (the tiny agent's: its states')
        wins = probe.warm_wins if checkpoint is None and warm == probe.warm else None
        return probe.evaluate(probe.runtime(warm, checkpoint), wins)

    tempo_runs = any(name.startswith("tempo") for name in arms)
    if args.critic_eval and tempo_runs and "critic" not in results["start"]:
        log("the warm start's critic against true V")
        results["start"]["critic"] = critic_point(None)
        save(results_file, results, ours)
    runs_root = cache / f"runs-{mode}"
    runs_root.mkdir(parents=True, exist_ok=True)

    def kept(name: str, seed: int) -> bool:
        """Finished and evaluated in results.json, its run directory not in this cache (another machine's run)."""
        entry = results["runs"].get(f"{name}-s{seed}")
        return entry is not None and finished(entry) and run_dir(runs_root, name, seed) is None

    jobs = [(name, seed) for name, seed in jobs if not kept(name, seed)]
    pending = [name for name, seed in jobs if not trained(runs_root, name, seed, updates, td_updates)]
    with sampler_server(args, warm, pending, runs_root / "vllm-server.log") as (sampler_url, cores):
        for name, seed in tqdm(jobs, desc="runs", unit="run", dynamic_ncols=True):
            key = f"{name}-s{seed}"
            if not trained(runs_root, name, seed, updates, td_updates):
                log(f"{key}: training")
                command = algorithm_command(
                    name, seed, updates, warm, games, runs_root, args.setting, args.eval_every, td_updates,
                    sampler_url if needs_server(name) else "", args.clip,
                )  # fmt: skip
                run(command, args.threads, cores)
            rdir = run_dir(runs_root, name, seed)
            metrics = metrics_rows(rdir)
            entry = results["runs"].setdefault(key, {"algorithm": name, "seed": seed, "points": []})
            entry["metrics"] = metrics
            entry["provenance"] = run_provenance(rdir, warm_sha256)
            if not entry["points"]:
                entry["points"].append(results["start"])
            for checkpoint in sorted((rdir / "checkpoints").glob("update_*")):
                update = int(checkpoint.name.split("_")[-1])
                if any(p.get("update") == update for p in entry["points"]):
                    continue
                log(f"{key}: evaluating update {update}")
                tokens = sum(m.get("rollout/generated_tokens", 0.0) for m in metrics if m["update"] <= update)
                entry["points"].append({**evaluate(checkpoint, args.eval_episodes), "update": update, "tokens": tokens})
                save(results_file, results, ours)
                log(f"{key}: update {update}: sampled {success(entry['points'][-1]):.2f}")
            last = entry["points"][-1]
            if len(entry["points"]) > 1 and last.get("update") == run_updates(name, updates, td_updates):
                checkpoint = rdir / "checkpoints" / f"update_{last['update']:06d}"
                if evaluate_heldout(last, checkpoint):
                    save(results_file, results, ours)
            for point in entry["points"][1:] if args.critic_eval and name.startswith("tempo") else []:
                if "critic" not in point:
                    log(f"{key}: update {point['update']}: the critic against true V")
                    point["critic"] = critic_point(rdir / "checkpoints" / f"update_{point['update']:06d}")
                    save(results_file, results, ours)
            for point in entry["points"][1:] if args.critic_eval and name.startswith("ppo") else []:
                if "value_head" not in point:
                    log(f"{key}: update {point['update']}: the value head against true V")
                    checkpoint = rdir / "checkpoints" / f"update_{point['update']:06d}"
                    point["value_head"] = critic.ppo_value_head(held_out_probe(), warm, checkpoint)
                    save(results_file, results, ours)
    report(results, out, args)


def report(results: dict, out: Path, args: Args) -> None:
    arms = args.algorithms or arms_in(results, args.reference)
    table = summarise(results, arms, args.reference)
    heldout = heldout_summary(results, arms)
    if heldout:
        table += "\nOn games no run trains on (valid_seen, valid_unseen of the same task types):\n\n" + heldout
    signals = signals_summary(results, arms)
    if signals:
        table += "\nWhat the updates saw (means over updates, then seeds; TEMPO's actor/ and td/: TD updates):\n\n"
        table += signals
        table += "\nThe same over the second half of each run's (TD) updates:\n\n" + signals_summary(results, arms, True)
    critic_table = critic_summary(results, arms)
    if critic_table:
        table += (
            "\nTEMPO's critic against true V of held-out states (benchmarks/learning/critic.py), means over seeds:\n\n"
        )
        table += critic_table
    value_table = value_head_summary(results, arms)
    if value_table:
        table += "\nPPO's value head against true V of the same held-out states, means over seeds:\n\n" + value_table
    plot(results, out, arms)
    (out / "learning.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main(tyro.cli(Args))
