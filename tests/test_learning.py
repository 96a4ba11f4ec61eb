"""The algorithm learns: a short plain-GRPO run raises the sampled success of a warm-started policy on its games."""

import dataclasses
import json
import math
import statistics

import pytest

import adca_grpo
import common
import offline
from benchmarks.learning import compare

UPDATES = 12
EPISODES_PER_GAME = 32  # x 4 games = 128 sampled episodes per measurement


@pytest.mark.slow
def test_grpo_raises_sampled_success_from_a_warm_start(tmp_path):
    """From the learning benchmark's warm start (`--model tiny-agent`, cached in ~/.cache/cleanrl-agents/
    learning-benchmark; built by benchmarks/learning/agents.py when missing, ~6 min once), 12 plain-GRPO updates through adca_grpo.py's own
    main() raise sampled (T=1) success on the 4 training games by more than 3 standard errors (128 episodes before
    and after). It fails when the advantage sign is flipped (tried once: grpo_advantages returning
    -advantage took the success from 0.21 to 0.09 and failed), or when the update does not reach the policy."""
    warm, games = offline.tiny_agent()
    evaluate = compare.Evaluator(
        warm, common.discover_games(games, "train", offline.TINY_AGENT_TASK_TYPES), compare.Args()
    )
    before = compare.success(evaluate(None, EPISODES_PER_GAME))

    args = dataclasses.replace(  # the benchmark's recipe (the `learning` preset), plain GRPO
        adca_grpo.PRESETS["learning"][1],
        model=str(warm),
        data_root=str(games),
        attribution=False,
        num_updates=UPDATES,
        save_every=UPDATES,
        eval_every=0,
        output_dir=str(tmp_path),
        seed=1,
    )
    run_dir = adca_grpo.main(args)
    after = compare.success(evaluate(run_dir / "checkpoints" / f"update_{UPDATES:06d}", EPISODES_PER_GAME))

    n = 4 * EPISODES_PER_GAME
    standard_error = math.sqrt((before * (1 - before) + after * (1 - after)) / n)
    summary = f"sampled success {before:.2f} -> {after:.2f} (se {standard_error:.3f})"
    print(summary)  # shown with pytest -rA
    assert after - before > 3 * standard_error, summary


def test_summary_reports_midpoint_tokens_and_the_difference_from_grpo():
    """The table's numbers from two algorithms x two seeds: the midpoint, actor + critic tokens and the 95% interval
    of the difference from GRPO's end (seed spread or binomial noise, whichever is larger)."""

    def point(update, wins, tokens):
        return {"update": update, "sampled": [wins, 0, 0, 0], "greedy": [1, 0, 0, 0], "episodes": 8, "tokens": tokens}

    start = {"sampled": [8, 0, 0, 0], "greedy": [1, 0, 0, 0], "episodes": 16, "tokens": 0}  # 8 of 64: 0.125
    runs = {}
    for seed, (grpo_end, tempo_mid, tempo_end) in enumerate([(8, 4, 6), (16, 8, 10)], 1):
        runs[f"grpo-s{seed}"] = {"algorithm": "grpo", "points": [start, point(12, grpo_end, 1000)], "metrics": []}
        runs[f"tempo-s{seed}"] = {
            "algorithm": "tempo",
            "points": [start, point(12, tempo_mid, 400), point(24, tempo_end, 900)],
            "metrics": [{"update": u, "critic/generated_tokens": 10.0} for u in range(1, 25)],
        }
    table = compare.summarise({"start": start, "runs": runs}, compare.Args(algorithms=("grpo", "tempo")))
    grpo_row, tempo_row = table.splitlines()[2:4]
    assert grpo_row.startswith("| grpo | 2 | 0.12 | - | 0.38 ± 0.18 |")  # ends 0.25 and 0.50 of 32 episodes
    arms = grpo, tempo = [0.25, 0.5], [6 / 32, 10 / 32]
    variance = sum(max(statistics.variance(v) / 2, statistics.fmean(v) * (1 - statistics.fmean(v)) / 64) for v in arms)
    difference = statistics.fmean(tempo) - statistics.fmean(grpo)
    half = 1.96 * math.sqrt(variance)
    assert tempo_row.startswith(f"| tempo | 2 | 0.12 | {(4 + 8) / 64:.2f} | 0.25 ± 0.09 |")
    assert f"| {difference:+.2f} [{difference - half:+.2f}, {difference + half:+.2f}] |" in tempo_row
    assert "| 900 | 1,140 |" in tempo_row  # actor tokens, then + 24 updates x 10 critic tokens
    assert tempo_row.endswith("| not reached |")  # TEMPO's best mean, (6 + 10) / 64, is below GRPO's 0.38

    for seed in (1, 2):  # GRPO ends below the start: no token count reaches "its level" (the start would, at 0)
        runs[f"grpo-s{seed}"]["points"][-1]["sampled"] = [1, 0, 0, 0]
    table = compare.summarise({"start": start, "runs": runs}, compare.Args(algorithms=("grpo", "tempo")))
    assert all(row.endswith("| - (GRPO ended at or below the start) |") for row in table.splitlines()[2:4])


def test_parallel_saves_keep_each_others_runs_and_the_warm_starts_critic(tmp_path):
    """Two compare.py processes on one results.json, each holding what it read at its start: the second one's save
    keeps the first one's run and the warm start's critic panel that only the first one computed."""
    results_file = tmp_path / "results.json"
    start = {"sampled": [8, 0, 0, 0], "greedy": [1, 0, 0, 0], "episodes": 16, "tokens": 0}
    compare.save(results_file, {"runs": {}, "start": start}, set())
    first, second = (json.loads(results_file.read_text()) for _ in range(2))
    first["start"]["critic"] = {"generative": {"r": 0.6}}
    first["runs"]["tempo-s1"] = {"algorithm": "tempo", "seed": 1, "points": [first["start"]]}
    compare.save(results_file, first, {"tempo-s1"})
    second["runs"]["grpo-s1"] = {"algorithm": "grpo", "seed": 1, "points": [second["start"]]}
    compare.save(results_file, second, {"grpo-s1"})
    stored = json.loads(results_file.read_text())
    assert set(stored["runs"]) == {"tempo-s1", "grpo-s1"}
    assert stored["start"] == {**start, "critic": {"generative": {"r": 0.6}}}
    assert stored["runs"]["tempo-s1"]["points"][0]["critic"] == {"generative": {"r": 0.6}}
