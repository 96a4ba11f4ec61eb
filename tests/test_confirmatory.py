"""The confirmatory comparison (benchmarks/learning/confirmatory.py) is run as its protocol says: the protocol's arms,
seeds and flags, and every run made at a commit that descends from the protocol's."""

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import tyro

import harness
from benchmarks.learning import compare, confirmatory, runs, tables

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / confirmatory.FOLDER / "results.json"
MASKED = ("--data-root", "--output-dir")  # the cache's paths: another machine's differ


def protocol_args() -> compare.Args:
    return tyro.cli(compare.Args, args=confirmatory.COMMAND[3:])


def git(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True)


def masked(argv: list[str]) -> list[str]:
    return [("<path>" if i and argv[i - 1] in MASKED else a) for i, a in enumerate(argv)]


def test_the_protocol_holds_the_chosen_arms_fresh_seeds_and_tempo_at_grpos_trained_tokens():
    """The arms are the ranking's chosen ones plus TEMPO at GRPO's trained tokens (its groups per TD update scaled by
    the committed token ratio, at TEMPO's chosen lr); no committed result used a seed or the evaluation seed; the
    command parses to the protocol's settings."""
    assert set(confirmatory.ARMS[:5]) == set(tables.RANK_CHOSEN)
    matched, tempo = confirmatory.ARMS[5], next(a for a in tables.RANK_CHOSEN if a.startswith("tempo@"))
    assert matched.partition("@") == ("tempo_matched", "@", tempo.partition("@")[2])
    _, flags = runs.algorithm(matched)
    scale = confirmatory.token_scale()[2]
    assert flags[flags.index("--groups-per-update") + 1] == str(4 * round(scale))

    earlier = [p for p in (ROOT / "benchmarks" / "results").rglob("results.json") if confirmatory.OUT not in str(p)]
    used = {run["seed"] for path in earlier for run in json.loads(path.read_text()).get("runs", {}).values()}
    assert used and not used & set(confirmatory.SEEDS)
    assert len(confirmatory.SEEDS) >= 12 and confirmatory.EVAL_SEED != harness.EVAL_SEED

    args = protocol_args()
    assert (args.eval_seed, args.eval_episodes, args.start_eval_episodes) == (confirmatory.EVAL_SEED, 16, 16)
    assert (args.clip, args.heldout_episodes, args.tempo_td_updates) == (confirmatory.CLIP, 0, 0)
    assert args.algorithms == confirmatory.ARMS  # seed-major, in this order: GRPO and GiGPO first in each seed
    assert args.algorithms[:2] == (confirmatory.REFERENCE, confirmatory.FIRST) == (args.reference, "gigpo@2e-3")


def test_every_confirmatory_run_used_the_protocols_flags_seeds_and_commit():
    """Each run in the results folder is one of ARMS x SEEDS, its script's command line is the one compare.py builds
    from the protocol's command (cache paths aside), its resolved config has the protocol's clip and the arm's lr,
    and each start or resume of it ran on a clean tree at a commit descending from the protocol's first commit."""
    if not RESULTS.is_file():
        pytest.skip(f"no {RESULTS.relative_to(ROOT)} yet: no confirmatory run has finished")
    results, args = json.loads(RESULTS.read_text()), protocol_args()
    config = json.loads(json.dumps(dataclasses.asdict(args)))  # tuples as JSON lists
    config.pop("cache")  # the home directory's cache: another user's differs
    assert {key: results["config"][key] for key in config} == config
    assert results["start"]["episodes"] == confirmatory.EPISODES and "valid_seen" not in results["start"]
    protocol_commit = git("log", "--diff-filter=A", "--format=%H", "--", "benchmarks/learning/confirmatory.py")
    protocol_commit = protocol_commit.stdout.split()[-1]

    expected = {f"{arm}-s{seed}": (arm, seed) for arm in confirmatory.ARMS for seed in confirmatory.SEEDS}
    assert results["runs"] and set(results["runs"]) <= set(expected)
    for key, run in results["runs"].items():
        arm, seed = expected[key]
        assert (run["algorithm"], run["seed"]) == (arm, seed)
        provenance = run["provenance"]
        resolved = provenance["config"]
        assert (resolved["seed"], resolved["clip_eps"], resolved["clip_eps_high"]) == (seed, *confirmatory.CLIP)
        assert resolved["learning_rate"] == float(arm.partition("@")[2])
        command = runs.algorithm_command(
            arm, seed, args.updates, Path(args.warm_start), Path(), Path(), args.setting, args.eval_every, 0, "",
            args.clip,
        )  # fmt: skip
        assert provenance["sessions"]
        for session in provenance["sessions"]:
            assert masked(session["argv"]) == masked(command), key
            assert session["dirty"] is False, f"{key}: run from a tree with uncommitted changes"
            assert git("merge-base", "--is-ancestor", protocol_commit, session["commit"]).returncode == 0, key


@pytest.mark.parametrize("arm", confirmatory.ARMS)
def test_each_arms_script_command_parses_to_the_protocols_clip_and_lr(arm, tmp_path):
    """The command compare.py gives each arm's script resolves (the script's preset and checks) to the protocol's clip,
    the arm's lr, 12 updates (TEMPO: 3 warm-up + 9 TD) and TEMPO_matched's 28 groups a TD update."""
    import importlib

    args = protocol_args()
    command = runs.algorithm_command(
        arm, 101, args.updates, Path(args.warm_start), tmp_path, tmp_path, args.setting, args.eval_every, 0, "",
        args.clip,
    )  # fmt: skip
    module = importlib.import_module(command[0].removesuffix(".py"))
    resolved = harness.cli(module.Args, lambda a: a, module.PRESETS, argv=command[1:])
    module.validate_args(resolved)
    assert (resolved.clip_eps, resolved.clip_eps_high) == confirmatory.CLIP
    assert resolved.learning_rate == float(arm.partition("@")[2]) and resolved.seed == 101
    if command[0] == "tempo.py":
        assert (resolved.warmup_updates, resolved.td_updates) == (3, 9)
        assert resolved.groups_per_update == (28 if arm.startswith("tempo_matched") else 4)
    else:
        assert resolved.num_updates == 12
