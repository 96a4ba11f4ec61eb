"""Does TEMPO's critic rank states? Its values against true V(s) on the learning benchmark's games (CPU scale).

Everything runs in-process on tempo.py's own runtime (model + LoRA, sampler, critic prompt, critic reward and update),
with the benchmark's TEMPO flags (benchmarks/learning/compare.py's `algorithm_command`):
  1. states: the warm start's own episodes, played to the first macro boundary (turn H), split by episode into a
     training pool (its turn-0 and turn-H states) and held-out turn-H states (never trained on);
  2. true V(s): the mean success of --continuations rollouts of the current policy from each state (one verified
     replay per state, then every branch restarts from the same EnvGroup snapshot), with its standard error;
  3. the critics on the held-out states, Pearson r and mean |V_hat - V|: generative (the mean of --critic-samples
     parsed `<value>` answers to tempo.py's critic prompt; 0 when none parses, as TEMPO values an endpoint), the
     constant (the pool's mean V), a linear value head on the policy's last hidden state of the critic prompt (MSE:
     ridge, fitted on the pool), and the "Nothing happens." count of the state's history (a line fitted on the pool),
     a reference of what is easy;
  4. warm-ups of the generative critic on the pool with TEMPO's phase-1 reward and update (tempo.py's score_critic
     and Runtime.train), a value head trained on the same batches and targets alongside, then step 3 again (V
     re-estimated: the warm-up moves the adapter the actor shares);
  5. the fix at the source: sft.py --critic-states, critic examples on the pool answered with the states' V, on the
     warm start (--fix extra-stage) or in place of the Monte-Carlo critic examples of its last stage (--fix
     last-stage); steps 3-4 again for that policy.

    python -m benchmarks.learning.critic        # results.json and critic_table.md in --out
    python -m benchmarks.learning.critic --setting long --fix last-stage --warmups recipe --out benchmarks/results/critic-long

Stages are cached under --cache (states and values, the fixed warm start, a score per policy and warm-up): rerun to
resume. benchmarks/learning/compare.py uses Probe to score TEMPO's checkpoints on the same held-out states.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import tyro

import common
import harness
import offline
import training
from benchmarks.learning import agents, runs

NOTHING = "Nothing happens."


@dataclass(frozen=True)
class Warmup:
    """One critic warm-up on the training pool."""

    name: str
    updates: int
    critic_samples: int  # K per state
    targets: str  # "mc": the episode's 0/1 outcome (TEMPO's phase 1); "v": the state's estimated V
    learning_rate: float
    critic_error: str = "abs"  # tempo.py --critic-error: the reward -|V - G| (the source) or -(V - G)^2


# The benchmark's TEMPO warm-up (3 updates of 16 episodes, K = 4, lr 1e-3, MC targets), then longer ones.
WARMUPS = (
    Warmup("recipe", 3, 4, "mc", 1e-3),
    Warmup("long_mc", 16, 4, "mc", 1e-3),
    Warmup("long_v_k8", 16, 8, "v", 1e-3),
    Warmup("long_mc_squared", 16, 4, "mc", 1e-3, "squared"),  # the median of 0/1 outcomes is 0 or 1; their mean is V
)


@dataclass
class Args:
    out: str = "benchmarks/results/critic"
    """results directory (results.json, critic.md): committed"""
    setting: Literal["short", "long"] = "short"
    """the learning benchmark's setting (benchmarks/learning/compare.py --setting) whose warm start and TEMPO flags are used"""
    cache: str = str(agents.CACHE)
    """the learning benchmark's cache (games, warm start); this benchmark's stages go to its critic/ folder"""
    train_episodes: int = 16
    """episodes per game whose boundary states form the training pool"""
    heldout_episodes: int = 8
    """episodes per game whose boundary states are held out (never trained on)"""
    continuations: int = 16
    """rollouts of the policy from each state that estimate its V"""
    critic_samples: int = 8
    """critic answers per held-out state when scoring"""
    warmups: tuple[str, ...] = tuple(w.name for w in WARMUPS)
    """warm-ups of WARMUPS run from the warm start and scored"""
    fix: Literal["extra-stage", "last-stage"] = "extra-stage"
    """the fix, critic examples on the warm start's own pool answered with V (sft.py --critic-states): extra-stage:
    --fix-epochs of sft.py on the warm start with them, beside noisy-expert actor examples; last-stage: the warm
    start's last sft.py stage redone with them in place of its Monte-Carlo critic examples (the same actor data)"""
    fix_epochs: float | None = None
    """epochs of the fix's sft.py run; None: extra-stage's 10 (critic examples alone: the actor never won) or the redone
    last stage's own (8 in the long setting); set, the fixed warm start's folder is named after it (last-stage-critic-e16)"""
    fix_warmups: tuple[str, ...] = ("recipe",)
    """warm-ups of WARMUPS run from the fixed warm start and scored"""
    seed: int = 1
    """seed of the rollouts, the sampling and the warm-up batches"""
    threads: int = 1
    """torch CPU threads"""


def log(message: str) -> None:
    print(f"[critic {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# =============================================================================================
# The benchmark's TEMPO runtime, in-process
# =============================================================================================
def tempo_args(model: str | Path, games: Path, seed: int = 1, setting: str = "short", **overrides):
    """tempo.Args exactly as benchmarks/learning/compare.py runs tempo.py (its flags parsed by tyro), on `model`."""
    import tempo

    command = runs.algorithm_command(
        "tempo", seed, runs.UPDATES, Path(model), games, Path("runs"), setting, runs.SAVE_EVERY
    )
    parsed = harness.cli(tempo.Args, lambda args: args, tempo.PRESETS, argv=command[1:])
    return dataclasses.replace(parsed, threads=1, **overrides)


def make_runtime(args, checkpoint: Path | None = None):
    """tempo.py's Runtime on args.model (a fresh LoRA), with a checkpoint's adapter loaded when given."""
    import torch

    import tempo

    torch.set_num_threads(args.threads)
    rt = tempo.Runtime(args, harness.make_accelerator())
    if checkpoint is not None:
        harness.load_checkpoint(checkpoint, rt.model, None, rt.accelerator)
    return rt


# =============================================================================================
# States and their true values
# =============================================================================================
@dataclass
class Episode:
    """One episode of the policy's own, played to the first macro boundary."""

    game: str
    index: int  # per game
    start: common.SavedState  # turn 0
    boundary: common.SavedState | None  # turn H; None when the episode ended before it (won, out of tokens)
    won_early: bool


def play_to_boundary(rt, games: Sequence[str], episodes_per_game: int) -> list[Episode]:
    """`episodes_per_game` sampled episodes of every game, each played for the first H turns."""

    args = rt.args
    starts = [common.game_start(game, rt.protocol) for game in games]
    groups = rt.play(starts, episodes_per_game, horizon=args.macro_rounds, max_turns=args.max_turns)
    return [
        Episode(
            start.game_file,
            traj.branch,
            start,
            traj.saved_state() if traj.stop_reason == common.STOP_HORIZON else None,
            traj.won,
        )
        for start, group in zip(starts, groups)
        for traj in group
    ]


def continuation_wins(rt, states: Sequence[common.SavedState], n: int) -> list[list[bool]]:
    """n rollouts of the policy from each state to the episode's end: who won."""

    T = rt.args.max_turns
    return [[t.won for t in group] for group in rt.play(states, n, horizon=T, max_turns=T)]


def value(wins: Sequence[bool]) -> tuple[float, float]:
    """(mean success, its standard error sqrt(p (1 - p) / (n - 1)))."""
    p = sum(wins) / len(wins)
    return p, math.sqrt(p * (1 - p) / max(1, len(wins) - 1))


def nothing_count(state: common.SavedState) -> int:
    """Turns of the state's history that the game answered with "Nothing happens." (an inadmissible action)."""
    return sum(m["role"] == "tool" and f"Observation: {NOTHING}" in m["content"] for m in state.messages)


# =============================================================================================
# Critics and their scores
# =============================================================================================
def pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Pearson r; None when either side is constant (a constant predictor ranks nothing)."""
    if len(x) < 2 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    return statistics.correlation(x, y)


def score(predictions: Sequence[float], values: Sequence[float], novel: Sequence[bool] | None = None) -> dict:
    """r, MAE and spread of a critic's predictions against true values; with `novel`, also on those states only
    (held-out states whose critic prompt is in no training example: the rest repeat a pool state word for word)."""
    result = {
        "r": pearson(predictions, values),
        "mae": statistics.fmean(abs(p - v) for p, v in zip(predictions, values)),
        "prediction_std": statistics.pstdev(predictions),
        "n": len(values),
    }
    if novel is None:
        return result
    subset = [(p, v) for p, v, new in zip(predictions, values, novel) if new]
    return result | {"novel": score(*zip(*subset)) if subset else None, "predictions": list(predictions)}


def critic_prompts(rt, states: Sequence[common.SavedState]) -> list[list[int]]:
    prompts = [rt.critic_prompt(s.game_file, s.task, s.messages, s.round_index) for s in states]
    if any(p is None for p in prompts):
        raise ValueError("a critic prompt is over --max-trajectory-tokens: raise it")
    return prompts


def generative_values(rt, prompts: Sequence[list[int]], k: int) -> list[list[float | None]]:
    """k sampled critic answers per prompt, parsed (None: no `<value>`)."""
    import tempo

    replies = tempo.sample_critic(rt, [(p, k) for p in prompts])
    return [[tempo.parse_value(r.text) for r in group] for group in replies]


def generative_estimate(values: Sequence[float | None]) -> float:
    """The mean parsed value; 0 when none parses (how TEMPO values an endpoint)."""
    parsed = [v for v in values if v is not None]
    return statistics.fmean(parsed) if parsed else 0.0


def last_hidden_states(rt, prompts: Sequence[list[int]]):
    """[n, hidden] the policy's last-layer hidden state at the last token of each prompt (the value head's input)."""
    import torch

    policy = rt.accelerator.unwrap_model(rt.model)
    was_training = policy.training
    policy.eval()
    with torch.no_grad():
        rows = [
            policy(input_ids=torch.tensor([p]), output_hidden_states=True, use_cache=False).hidden_states[-1][0, -1]
            for p in prompts
        ]
    policy.train(was_training)
    return torch.stack(rows).float()


HEAD_LEARNING_RATE = 1e-2  # the value head's Adam lr when it is trained alongside a warm-up (one step per update)
RIDGE_PENALTIES = (0.1, 1.0, 10.0, 100.0, 1000.0)


class ValueHead:
    """A linear head on frozen features, trained with MSE by Adam (one step per warm-up update)."""

    def __init__(self, width: int, learning_rate: float = HEAD_LEARNING_RATE):
        import torch

        self.weight = torch.nn.Parameter(torch.zeros(width))
        self.bias = torch.nn.Parameter(torch.zeros(()))
        self.optimizer = torch.optim.Adam([self.weight, self.bias], lr=learning_rate)

    def step(self, features, targets: Sequence[float]) -> float:
        import torch

        loss = torch.nn.functional.mse_loss(features @ self.weight + self.bias, torch.tensor(targets))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def predict(self, features) -> list[float]:
        import torch

        with torch.no_grad():
            return (features @ self.weight + self.bias).clamp(0, 1).tolist()


def fit_ridge(features, targets: Sequence[float], groups: Sequence[int], folds: int = 4):
    """The converged MSE linear head: ridge regression on standardised features, its penalty chosen from
    RIDGE_PENALTIES by cross-validation over `folds` folds of `groups` (episodes). Returns predict(features)."""
    import torch

    y = torch.tensor(targets, dtype=torch.float64)
    x = features.double()
    fold = torch.tensor([g % folds for g in groups])

    def fit(x, y, penalty):
        mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
        z = (x - mean) / std
        w = torch.linalg.solve(z.T @ z + penalty * torch.eye(z.shape[1], dtype=z.dtype), z.T @ (y - y.mean()))
        return lambda f: ((f.double() - mean) / std @ w + y.mean()).clamp(0, 1)

    def cv_error(penalty):
        errors = [
            ((fit(x[fold != k], y[fold != k], penalty)(x[fold == k]) - y[fold == k]) ** 2).sum() for k in range(folds)
        ]
        return sum(errors).item()

    best = min(RIDGE_PENALTIES, key=cv_error)
    predict = fit(x, y, best)
    return lambda f: predict(f).tolist()


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept); slope 0 when x is constant."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx if sxx else 0.0
    return slope, my - slope * mx


@dataclass
class Pool:
    """Critic training examples: a state, its prompt and its targets (MC return of its episode, estimated V)."""

    states: list[common.SavedState]
    prompts: list[list[int]]
    mc: list[float]
    v: list[float]
    episode: list[int]  # which episode (turn 0 and turn H of one episode share it; batches are drawn by episode)


def score_critics(rt, pool: Pool, heldout: Sequence[common.SavedState], values: Sequence[float], k: int) -> dict:
    """Every critic on the held-out states against their true values: generative (k samples per state), the
    value head (ridge, fitted on the pool's features and V targets), the constant (the pool's mean V target) and the
    "Nothing happens." count (a line fitted on the pool's V targets); each also on the novel states alone."""
    prompts = critic_prompts(rt, heldout)
    novel = novel_states(pool, prompts)
    samples = generative_values(rt, prompts, k)
    parsed = [v for group in samples for v in group if v is not None]
    head = fit_ridge(last_hidden_states(rt, pool.prompts), pool.v, pool.episode)
    slope, intercept = fit_line([nothing_count(s) for s in pool.states], pool.v)
    counts = [nothing_count(s) for s in heldout]
    constant = statistics.fmean(pool.v)
    return {
        "generative": score([generative_estimate(group) for group in samples], values, novel)
        | {
            "parse_rate": len(parsed) / max(1, sum(len(g) for g in samples)),
            "answers": answer_counts(parsed),
            "states_all_same": sum(len(set(g)) == 1 for g in samples),
            "samples_per_state": k,
        },
        "value_head": score(head(last_hidden_states(rt, prompts)), values, novel),
        "constant": score([constant] * len(values), values, novel) | {"value": constant},
        "nothing_count": score([min(1.0, max(0.0, slope * c + intercept)) for c in counts], values, novel)
        | {"r_raw": pearson([-c for c in counts], values)},
        "novel_states": sum(novel),
    }


def novel_states(pool: Pool, prompts: Sequence[list[int]]) -> list[bool]:
    """Per prompt: in no training example (the policy often repeats an episode's first turns exactly)."""
    seen = {tuple(p) for p in pool.prompts}
    return [tuple(p) not in seen for p in prompts]


def answer_counts(values: Sequence[float]) -> dict[str, int]:
    """How often each parsed value was answered, most frequent first."""
    counts: dict[str, int] = {}
    for v in values:
        counts[f"{v:g}"] = counts.get(f"{v:g}", 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


# =============================================================================================
# Warm-up: TEMPO's phase-1 reward and update on the training pool
# =============================================================================================
def warm_up(rt, pool: Pool, warmup: Warmup, episodes_per_update: int, seed: int) -> tuple[list[dict], ValueHead]:
    """`warmup.updates` updates, each on the states of `episodes_per_update` training episodes (drawn by epoch
    without replacement): K critic samples per state, tempo.score_critic's centred -|V - target| rewards,
    Runtime.train's one optimizer step; the value head takes one MSE step on the same states and targets."""
    import tempo

    for group in rt.optimizer.param_groups:
        group["lr"] = warmup.learning_rate
    targets = pool.mc if warmup.targets == "mc" else pool.v
    episodes = sorted(set(pool.episode))
    head = ValueHead(last_hidden_states(rt, pool.prompts[:1]).shape[1])
    rng, order, rows = random.Random(seed), [], []
    for update in range(1, warmup.updates + 1):
        while len(order) < episodes_per_update:
            order += rng.sample(episodes, len(episodes))
        batch, order = set(order[:episodes_per_update]), order[episodes_per_update:]
        index = [i for i, e in enumerate(pool.episode) if e in batch]
        prompts, batch_targets = [pool.prompts[i] for i in index], [targets[i] for i in index]
        replies = tempo.sample_critic(rt, [(p, warmup.critic_samples) for p in prompts])
        values, datums = tempo.score_critic(
            prompts, replies, batch_targets, rt.args.r_max, warmup.critic_error == "squared"
        )
        metrics = training.refresh_old_logprobs(rt, datums) | tempo.ppo_update(rt, datums)  # one optimizer step
        metrics |= tempo.critic_metrics(values, batch_targets, "critic/value_corr")
        metrics["head/mse"] = head.step(last_hidden_states(rt, prompts), batch_targets)
        rows.append({"update": update, "states": len(index), "datums": len(datums), **metrics})
        log(
            f"{warmup.name} {update}/{warmup.updates}: abs error {metrics.get('critic/abs_error_mean', 0):.3f}, "
            f"corr {metrics.get('critic/value_corr', float('nan')):.2f}, datums {len(datums)}"
        )
    return rows, head


# =============================================================================================
# Main
# =============================================================================================
def cached(path: Path, build):
    if path.is_file():
        return json.loads(path.read_text())
    result = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return result


def collect(rt, games: Sequence[str], args: Args) -> dict:
    """Training pool and held-out states of the policy `rt` (by episode), every boundary state's continuations."""
    import torch

    torch.manual_seed(args.seed)
    log(f"playing {args.train_episodes} + {args.heldout_episodes} episodes per game to turn {rt.args.macro_rounds}")
    episodes = play_to_boundary(rt, games, args.train_episodes + args.heldout_episodes)
    boundary = [e.boundary for e in episodes if e.boundary is not None]
    log(f"{len(boundary)} boundary states: {args.continuations} continuations each")
    wins = iter(continuation_wins(rt, boundary, args.continuations))
    return {
        "episodes": [
            {
                "game": e.game,
                "index": e.index,
                "split": "train" if e.index < args.train_episodes else "heldout",
                "start": e.start.to_json(),
                "boundary": e.boundary.to_json() if e.boundary is not None else None,
                "won_early": e.won_early,
                "wins": next(wins) if e.boundary is not None else None,
            }
            for e in episodes
        ]
    }


def make_pool(rt, episodes: list[dict]) -> Pool:
    """The training episodes' turn-0 and boundary states. MC target: the episode's outcome (its first continuation's,
    as the episode would have gone on); V target: the boundary's estimated V, and at turn 0 the game's mean of its
    episodes' outcomes estimated the same way."""
    states, mc, v, episode = [], [], [], []
    start_value: dict[str, list[float]] = {}
    for e in episodes:
        start_value.setdefault(e["game"], []).append(
            1.0 if e["won_early"] else value(e["wins"])[0] if e["wins"] else 0.0
        )
    for i, e in enumerate(episodes):
        outcome = 1.0 if e["won_early"] else float(e["wins"][0]) if e["wins"] else 0.0
        states.append(common.SavedState.from_json(e["start"]))
        mc.append(outcome)
        v.append(statistics.fmean(start_value[e["game"]]))
        episode.append(i)
        if e["boundary"] is not None:
            states.append(common.SavedState.from_json(e["boundary"]))
            mc.append(outcome)
            v.append(value(e["wins"])[0])
            episode.append(i)
    return Pool(states, critic_prompts(rt, states), mc, v, episode)


CRITICS = ("generative", "value_head", "value_head_same_updates", "constant", "nothing_count")


def table(results: dict) -> str:
    lines = [
        "| policy | stage | critic | n | r | MAE | prediction std | novel states: n, r, MAE | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    values = []
    for policy, result in results["policies"].items():
        for stage, entry in result["scores"].items():
            for critic in (c for c in CRITICS if c in entry):
                s = entry[critic]
                r = "n/a" if s["r"] is None else f"{s['r']:+.2f}"
                note = ""
                if critic == "generative":
                    note = f"K={s['samples_per_state']}, parse rate {s['parse_rate']:.2f}, answers {s['answers']}, "
                    note += f"{s['states_all_same']} states with K equal answers"
                elif critic == "constant":
                    note = f"value {s['value']:.2f}"
                elif critic == "nothing_count":
                    note = "r of -count: " + ("n/a" if s["r_raw"] is None else f"{s['r_raw']:+.2f}")
                novel = s.get("novel") or {"n": 0, "r": None, "mae": float("nan")}
                novel_r = "n/a" if novel["r"] is None else f"{novel['r']:+.2f}"
                cells = f"{s['n']} | {r} | {s['mae']:.3f} | {s['prediction_std']:.2f} | "
                cells += f"{novel['n']}, {novel_r}, {novel['mae']:.3f} | {note}"
                lines.append(f"| {policy} | {stage} | {critic} | {cells} |")
            v = entry["values"]
            ceiling = "n/a" if v["ceiling_r"] is None else f"{v['ceiling_r']:.2f}"
            values.append(
                f"| {policy} | {stage} | {v['n']} | {v['mean']:.2f} | {v['std']:.2f} | {v['zero']} | "
                f"{v['se_mean']:.3f} | {ceiling} |"
            )
    header = "| policy | stage | n | mean | std | states at 0 | mean SE | r ceiling (split-half) |\n|---|---|---|---|---|---|---|---|"
    return (
        "\n".join(lines)
        + "\n\nTrue V of the held-out states under each policy:\n\n"
        + header
        + "\n"
        + "\n".join(values)
        + "\n"
    )


def value_summary(wins: Sequence[Sequence[bool]]) -> dict:
    """The held-out states' V estimates: values, standard errors, spread and the split-half ceiling of r."""
    values, errors = zip(*(value(w) for w in wins))
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "zero": sum(v == 0 for v in values),
        "se_mean": statistics.fmean(errors),
        "ceiling_r": split_half_ceiling(wins),
        "values": list(values),
        "standard_errors": list(errors),
    }


def split_half_ceiling(wins: Sequence[Sequence[bool]]) -> float | None:
    """What a perfect critic's r against these n-continuation estimates would be: the split-half correlation of the
    estimates (first vs second half of the continuations), Spearman-Brown corrected."""
    half = len(wins[0]) // 2
    r = pearson([statistics.fmean(w[:half]) for w in wins], [statistics.fmean(w[half:]) for w in wins])
    return None if r is None else 2 * r / (1 + r)


class Probe:
    """The warm start's training pool and held-out states (collected once, cached under --cache), and the scoring
    of any policy on them: a model directory, or a checkpoint of a TEMPO run of the learning benchmark."""

    def __init__(self, args: Args):
        import torch

        self.args, cache = args, Path(args.cache)
        agent = runs.SETTINGS[args.setting][0]
        self.warm, self.games_dir = agents.build(cache, args.threads, agent)
        self.games = common.discover_games(self.games_dir, "train", offline.TINY_AGENTS[agent].task_types)
        key = f"{self.warm.resolve()}|{args.train_episodes}|{args.heldout_episodes}|{args.continuations}|{args.seed}"
        self.dir = cache / "critic" / f"states-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        rt = self.runtime()
        torch.manual_seed(args.seed)
        data = cached(self.dir / "states.json", lambda: collect(rt, self.games, args))
        self.pool = make_pool(rt, [e for e in data["episodes"] if e["split"] == "train"])
        rows = [e for e in data["episodes"] if e["split"] == "heldout" and e["boundary"] is not None]
        self.heldout = [common.SavedState.from_json(e["boundary"]) for e in rows]
        self.warm_wins = [e["wins"] for e in rows]
        write_critic_states(self.pool, self.dir / "critic_states.jsonl")

    def runtime(self, model: Path | None = None, checkpoint: Path | None = None):
        """TEMPO's runtime on `model` (default: the warm start) with the benchmark's flags, a checkpoint loaded."""
        return make_runtime(
            tempo_args(model or self.warm, self.games_dir, self.args.seed, self.args.setting), checkpoint
        )

    def evaluate(self, rt, wins: list[list[bool]] | None = None) -> dict:
        """Every critic of `rt` against the held-out states' true V under `rt`'s own policy (re-estimated by
        continuations unless `wins` are given), with the values' summary."""
        import torch

        torch.manual_seed(self.args.seed)
        if wins is None:
            log(f"true V of {len(self.heldout)} held-out states: {self.args.continuations} continuations each")
            wins = continuation_wins(rt, self.heldout, self.args.continuations)
        summary = value_summary(wins)
        return score_critics(rt, self.pool, self.heldout, summary["values"], self.args.critic_samples) | {
            "values": summary
        }

    def pool_summary(self) -> dict:
        return {
            "states": len(self.pool.states),
            "mc_mean": statistics.fmean(self.pool.mc),
            "v_mean": statistics.fmean(self.pool.v),
        }


def fixed_warm_start(probe: Probe, args: Args) -> Path:
    """The fix at the source (--fix): TEMPO critic examples of the warm start's own training pool answered with the
    states' estimated V (sft.py --critic-states), beside noisy-expert actor examples (cached)."""
    name = "warm-start-critic" if args.fix == "extra-stage" else "last-stage-critic"
    path = probe.dir / (name if args.fix_epochs is None else f"{name}-e{args.fix_epochs:g}")
    if (path / "sft.json").is_file():
        return path
    agent, states = runs.SETTINGS[args.setting][0], str(probe.dir / "critic_states.jsonl")
    recipe = offline.TINY_AGENTS[agent]
    last = len(recipe.stages)
    if args.fix == "extra-stage":
        epochs = 10.0 if args.fix_epochs is None else args.fix_epochs
        log(f"the fix: sft.py --critic-states on the warm start, {epochs:g} epochs")
        model, extra = probe.warm, ["--num-epochs", f"{epochs:g}", "--seed", str(args.seed)]
    else:
        log(f"the fix: the warm start's stage {last} redone with --critic-states instead of --critic-examples")
        agents.build(args.cache, args.threads, agent, shipped=False)  # its stages, built once if missing
        model = Path(args.cache) / f"{recipe.dir_prefix}-stage{last - 1}"
        extra = [] if args.fix_epochs is None else ["--num-epochs", f"{args.fix_epochs:g}"]  # after the stage's own
    # the last stage's data and flags (T, H, lr, noisy expert), its Monte-Carlo critic examples swapped for V's
    command = agents.stage_command(agent, last, model, path, probe.games_dir, critic_examples=False)
    command += ["--critic-states", states, *extra]
    runs.run(command, args.threads)
    return path


def score_policy(probe: Probe, policy: Path, warmups: Sequence[str], args: Args) -> dict:
    """The policy's critics as they are, then after each warm-up (cached per policy and warm-up)."""
    import torch

    policy_dir = probe.dir / hashlib.sha256(str(policy.resolve()).encode()).hexdigest()[:12]
    wins = probe.warm_wins if policy == probe.warm else None  # the warm start's V: the continuations of collect()
    result = {"scores": {}, "warmups": {}}
    result["scores"]["as is"] = cached(policy_dir / "score.json", lambda: probe.evaluate(probe.runtime(policy), wins))
    for warmup in (w for w in WARMUPS if w.name in warmups):

        def run_warmup(warmup=warmup):
            rt = probe.runtime(policy)
            torch.manual_seed(args.seed)
            episodes = rt.args.warmup_groups_per_update * rt.args.group_size  # TEMPO's warm-up batch
            metrics, head = warm_up(rt, probe.pool, warmup, episodes, args.seed)
            entry = probe.evaluate(rt)  # the warm-up moved the shared adapter: V of the policy as it is now
            prompts = critic_prompts(rt, probe.heldout)
            same = head.predict(last_hidden_states(rt, prompts))
            entry["value_head_same_updates"] = score(same, entry["values"]["values"], novel_states(probe.pool, prompts))
            return {"scores": entry, "metrics": metrics, "warmup": dataclasses.asdict(warmup)}

        entry = cached(policy_dir / f"warmup_{warmup.name}.json", run_warmup)
        result["scores"][f"warm-up {warmup.name}"] = entry["scores"]
        result["warmups"][warmup.name] = {"warmup": entry["warmup"], "metrics": entry["metrics"]}
    return result


def main(args: Args) -> dict:
    names = {w.name for w in WARMUPS}
    unknown = (set(args.warmups) | set(args.fix_warmups)) - names
    if unknown:
        raise ValueError(f"--warmups / --fix-warmups: unknown {sorted(unknown)}; expected some of {sorted(names)}")
    probe = Probe(args)
    policies = (
        ("warm start", probe.warm, args.warmups),
        ("warm start + own-state critic examples", fixed_warm_start(probe, args), args.fix_warmups),
    )
    results = {
        "config": {**dataclasses.asdict(args), "warm_start": str(probe.warm), "games": probe.games},
        "pool": probe.pool_summary(),
        "policies": {name: score_policy(probe, policy, warmups, args) for name, policy, warmups in policies},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (out / "critic_table.md").write_text(text)
    print(text)
    return results


def write_critic_states(pool: Pool, path: Path) -> None:
    """The training pool as sft.py --critic-states reads it: one JSON object per line, a state and its V target."""
    path.write_text("".join(json.dumps({"state": s.to_json(), "value": v}) + "\n" for s, v in zip(pool.states, pool.v)))


if __name__ == "__main__":
    main(tyro.cli(Args))


# =============================================================================================
# PPO's trained value head on the same held-out states (benchmarks/learning/compare.py --critic-eval, ppo runs)
# =============================================================================================
def ppo_value_head(probe: Probe, model: Path, checkpoint: Path) -> dict:
    """r and MAE of a ppo.py checkpoint's value head (its adapter on `model`, the run's warm start, and its
    heads.safetensors, with the benchmark's ppo flags) on the probe's held-out states against their true V under that checkpoint's policy: V(s) as ppo.py reads
    it, at the last token of the state's next policy prompt."""
    import torch

    import ppo

    seed, setting = probe.args.seed, probe.args.setting
    command = runs.algorithm_command(
        "ppo", seed, runs.UPDATES, model, probe.games_dir, Path("runs"), setting, runs.SAVE_EVERY
    )
    args = dataclasses.replace(harness.cli(ppo.Args, lambda a: a, ppo.PRESETS, argv=command[1:]), threads=1)
    torch.set_num_threads(args.threads)
    rt = ppo.Runtime(args, harness.make_accelerator())
    harness.load_checkpoint(checkpoint, rt.model, None, rt.accelerator, rt.heads)
    torch.manual_seed(probe.args.seed)
    log(f"true V of {len(probe.heldout)} held-out states under {checkpoint}: {probe.args.continuations} continuations")
    turns = args.max_turns
    groups = rt.play(probe.heldout, probe.args.continuations, horizon=turns, max_turns=turns)
    summary = value_summary([[t.won for t in group] for group in groups])
    prompts = [state.prefix_tokens for state in probe.heldout]
    hidden = training.hidden_states_at(rt, prompts, [[len(p) - 1] for p in prompts])
    with torch.no_grad():
        predictions = [rt.heads["value"](states).item() for states in hidden]
    return score(predictions, summary["values"]) | {"values": summary}
