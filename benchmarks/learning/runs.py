"""The learning benchmark's runs of the algorithm scripts, shared by compare.py and critic.py: the settings, the
algorithms (a script and the flags added to its `learning` / `learning-long` preset) and each run's command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import adca_grpo
from benchmarks.vllm_cpu import on_cores

ROOT = Path(__file__).resolve().parents[2]
UPDATES, SAVE_EVERY = 12, 6  # a run's updates and its checkpoint interval (compare.py's defaults)

# setting -> (the tiny agent every run starts from, the scripts' preset of the setting's recipe)
# rank (issue 53): agents.RANK_AGENT, 32 training games of the short task types (agents.rank_games), the short recipe
SETTINGS = {
    "short": ("tiny-agent", "learning"),
    "long": ("tiny-agent-long", "learning-long"),
    "rank": ("rank-agent", "learning"),
}


def recipe(setting: str):
    """The setting's episode cap and token budgets, which every evaluation shares (adca_grpo.py's preset)."""
    return adca_grpo.PRESETS[SETTINGS[setting][1]][1]


# tempo_band's store rule (below), shared by the variants that combine it with another flag
UNCERTAIN_BAND = ["--state-selection", "uncertain", "--uncertain-band", "0.05", "0.95", "--uncertain-floor", "0"]

# name -> (script, flags added to its `learning` preset: the benchmark's recipe, written in the script)
ALGORITHMS = {
    "grpo": ("adca_grpo.py", ["--no-attribution"]),
    # GRPO sampling through a CPU vLLM server that compare.py starts (the baseline of grpo_async1: the same sampler)
    "grpo_vllm": ("adca_grpo.py", ["--no-attribution", "--sampler", "vllm"]),
    # grpo_vllm with the batch of the next update sampled while the current one trains (one version behind)
    "grpo_async1": ("adca_grpo.py", ["--no-attribution", "--sampler", "vllm", "--async-steps", "1"]),
    "adca_oracle": ("adca_grpo.py", []),
    "gigpo": ("gigpo.py", []),
    "ppo": ("ppo.py", []),  # a linear value head on the policy's trunk, turn-level GAE
    # --state-selection outcome, the default since 2026-12-02 (before: uncertain; the variants below without their
    # own --state-selection ran with the default of their day); in the long setting at lr 3e-4 (the preset's): rows
    # there named tempo* without @LR measured before then ran at 1e-3
    "tempo": ("tempo.py", []),
    # --state-selection uncertain: endpoints valued below 0.05 left out, draws weighted with floor 0.05 (the default
    # from the lower edge's day until outcome's)
    "tempo_uncertain": ("tempo.py", ["--state-selection", "uncertain"]),
    # uncertain with every endpoint stored (the default until the lower edge: the rows named `tempo` measured before)
    "tempo_floor": ("tempo.py", ["--state-selection", "uncertain", "--uncertain-band", "0", "1"]),
    # uncertain with a store filter: endpoints valued outside [0.05, 0.95] left out, no floor (the rule's first
    # default; it starves a critic that answers only 0 or 1)
    "tempo_band": ("tempo.py", UNCERTAIN_BAND),
    # every endpoint whose critic prompt fits kept, drawn uniformly, a drawn state removed (called "the source's store"
    # until 2026-12-03; the source keeps drawn states: tempo_source)
    "tempo_uniform": ("tempo.py", ["--state-selection", "uniform"]),
    # 09-tempo's own store: FIFO of 256, every endpoint with room kept, distinct uniform draws, drawn states kept
    "tempo_source": ("tempo.py", ["--state-selection", "source"]),
    # the ablation of the critic: each endpoint valued by the mean return of one continuation of the episode by the
    # current policy (never trained), the critic still trained on the start states as in the preset
    "tempo_oracle": ("tempo.py", ["--endpoint-values", "rollout"]),
    # the exact oracle (issue 53): each endpoint valued by 16 continuations, whose standard error (at most 0.125,
    # logged as td/oracle_value_se_mean) is to be small against the spread of the values across endpoints
    # (td/oracle_value_sd)
    "tempo_oracle16": ("tempo.py", ["--endpoint-values", "rollout", "--endpoint-samples", "16"]),
    # the critic rewarded by the squared error (best answer: the mean of its targets, not their median)
    "tempo_squared": ("tempo.py", ["--critic-error", "squared"]),
    "tempo_band_squared": (  # tempo_band and tempo_squared together
        "tempo.py",
        [*UNCERTAIN_BAND, "--critic-error", "squared"],
    ),
    # PPO clipping at lr 1e-4 against tempo.py's default IS loss at the shared lr (docs/does-it-learn.md); with one
    # optimizer step per update the clip never acts (the ratio is 1), so this is the IS loss at lr 1e-4
    "tempo_ppo": ("tempo.py", ["--learning-rate", "1e-4", "--clip-eps", "0.2", "--clip-eps-high", "0.28"]),
    # PPO clipping where it acts: 4 optimizer steps per update (mini-batches), at the shared lr
    "tempo_ppo4": ("tempo.py", ["--clip-eps", "0.2", "--clip-eps-high", "0.28", "--mini-batches", "4"]),
    # Removed with their flags, which lost (docs/does-it-learn.md keeps their figures; tempo.py at commit 3d8e148 has
    # them): tempo_replay (--critic-replay 8), tempo_squared_replay (--critic-error squared --critic-replay 8),
    # tempo_slow_critic (--critic-coef 0.3), tempo_batch_critic and tempo_band_batch_critic (--critic-baseline batch)
    # the band's lower edge only: endpoints the critic calls hopeless (< 0.05) left out, the floor kept, so sure
    # states (a 0/1 critic's 1s) are still drawn; the default from 2026-12-02 until outcome (measured under this name)
    "tempo_lower_band": ("tempo.py", ["--state-selection", "uncertain", "--uncertain-band", "0.05", "1.0"]),
    # the default with the critic left as phase 1 trained it (no TD critic datums): it kept its ranking of held-out
    # states, which TD training lowered; success no better (docs/does-it-learn.md)
    "tempo_no_td_critic": ("tempo.py", ["--no-td-critic"]),
    # the critic exactly as the warm start's SFT left it: no Monte-Carlo warm-up (its 0/1 targets taught "0") and no TD
    # critic datums, so its 3 warm-up updates become TD updates (the same 24 updates, more of them the actor's)
    "tempo_fixed_critic": ("tempo.py", ["--no-td-critic", "--warmup-updates", "0"]),
    # tempo_uniform's store, half of each TD update's starts fresh games
    "tempo_fresh": ("tempo.py", ["--state-selection", "uniform", "--fresh-state-share", "0.5"]),
    # the store by what the branches did: a start whose group had a gradient is drawn again and its endpoints stored;
    # a degenerate group's lineage ends (the critic's values play no part); the default since 2026-12-02
    "tempo_outcome": ("tempo.py", ["--state-selection", "outcome"]),
    # 8 branch groups per TD update (the preset's 4): run with half the TD updates (--tempo-td-updates 11), about the
    # same generated tokens, each step's gradient from twice the tokens (the lr diagnosis: small batches, noisy steps)
    "tempo_wide": ("tempo.py", ["--groups-per-update", "8"]),
    # each endpoint valued by the mean of 8 critic samples (the benchmark's preset: 1): less of the critic's sampling
    # noise in the branches' returns
    "tempo_endpoint8": ("tempo.py", ["--endpoint-samples", "8"]),
    # the confirmatory comparison's TEMPO at GRPO's trained tokens (benchmarks/learning/confirmatory.py): each TD update
    # 7 times the start states (4 -> 28 groups), the 3 warm-up and 9 TD updates kept, so its actor trains on ~27k tokens
    # a run as GRPO does (3.8k at 4 groups: the ranking setting's held-out seeds, confirmatory.token_scale)
    "tempo_matched": ("tempo.py", ["--groups-per-update", "28"]),
}


MAIN_ARMS = ("grpo", "adca_oracle", "gigpo", "ppo", "tempo")  # compare.py's runs when --algorithms names none


def algorithm(name: str) -> tuple[str, list[str]]:
    """(script, flags) of `name`: a key of ALGORITHMS, or KEY@LR, the same at learning rate LR (an lr sweep)."""
    key, _, lr = name.partition("@")
    if key not in ALGORITHMS:
        raise ValueError(f"--algorithms: unknown {name!r}; expected some of {list(ALGORITHMS)}, each maybe @LR")
    script, flags = ALGORITHMS[key]
    if lr:
        try:
            float(lr)
        except ValueError:
            raise ValueError(f"--algorithms {name!r}: {lr!r} after '@' is not a learning rate") from None
        flags = [*flags, "--learning-rate", lr]  # after the variant's own --learning-rate: the later flag wins
    return script, flags


def needs_server(name: str) -> bool:
    """Whether arm `name` samples through a vLLM server (--sampler vllm): its command needs the server's URL."""
    flags = algorithm(name)[1]
    return "--sampler" in flags and flags[flags.index("--sampler") + 1] == "vllm"


def run(command: list[str], threads: int, cores: list[int] | None = None) -> None:
    """A script's command line (`script.py ...`) as a subprocess from the repository root, on `threads` threads (and
    only on `cores`, if given)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    subprocess.run([sys.executable, *command], cwd=ROOT, env=env, check=True, preexec_fn=on_cores(cores))


def algorithm_command(
    name: str, seed: int, updates: int, warm: Path, games: Path, runs: Path, setting: str, save_every: int,
    tempo_td_updates: int = 0, sampler_url: str = "", clip: tuple[float, float] | None = None,
) -> list[str]:  # fmt: skip
    """`script.py learning`: the script's own preset of the setting's recipe, at this run's seed and updates (TEMPO:
    run_updates, of which the variant's --warmup-updates or else a quarter warm-up), a checkpoint every save_every
    updates; an arm that samples through a vLLM server (needs_server) at sampler_url, a server of the warm start;
    clip (low, high): the PPO clip range, after the variant's own (the later flag wins)."""
    script, flags = algorithm(name)
    if clip is not None:
        flags = [*flags, "--clip-eps", str(clip[0]), "--clip-eps-high", str(clip[1])]
    if needs_server(name):
        if not sampler_url:
            raise ValueError(f"arm {name!r} samples through a vLLM server: its command needs the server's URL")
        flags = [*flags, "--sampler-url", sampler_url]
    if script == "tempo.py":
        if "--warmup-updates" in flags:  # the variant's own warm-up
            warmup = int(flags[flags.index("--warmup-updates") + 1])
        else:
            warmup = max(1, updates // 4)
            flags = [*flags, "--warmup-updates", str(warmup)]
        flags = [*flags, "--td-updates", str(run_updates(name, updates, tempo_td_updates) - warmup)]
    else:
        flags = [*flags, "--num-updates", str(updates)] + (
            ["--prm-steps", str(updates)] if name.partition("@")[0] == "adca_oracle" else []
        )
    return [
        script, SETTINGS[setting][1], *flags, "--model", str(warm), "--data-root", str(games), "--seed", str(seed),
        "--save-every", str(save_every), "--eval-every", "0", "--output-dir", str(runs),
        "--exp-name", f"{name}-s{seed}",
        "--resume", "auto",
    ]  # fmt: skip


def run_updates(name: str, updates: int, tempo_td_updates: int = 0) -> int:
    """A run's updates: `updates`; TEMPO's: a quarter of them warm-up, then tempo_td_updates TD updates if set."""
    if algorithm(name)[0] != "tempo.py" or not tempo_td_updates:
        return updates
    return max(1, updates // 4) + tempo_td_updates
