"""The environment half of common.py, on the real TextWorld / Fast Downward engine."""

import json
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import psutil
import pytest

import common
import offline


def play(group_or_env, commands):
    return [group_or_env.step(c) for c in commands]


def test_generated_games_cover_every_task_type_and_play_to_won(all_games):
    task_types = {common.load_task_type(g) for g in all_games}
    assert task_types == set(common.TASK_TYPES)
    for game_file in all_games:
        walkthrough = common.load_walkthrough(game_file)
        assert walkthrough, game_file
        env = common.AlfredEnv(game_file)
        turn = env.reset()
        assert "Your task is to: " in turn.observation
        assert not turn.won
        for command in walkthrough:
            assert command in turn.admissible, (game_file, command)
            turn = env.step(command)
        assert turn.won, game_file
        env.close()


def test_fast_env_text_equals_stock_textworld(all_games):
    """Same observations, admissible commands and won flags as ALFWorld's stock TextWorld setup."""
    for game_file in all_games[:: len(all_games) // 4]:
        stock = offline.stock_alfworld_env([game_file])
        fast = common.AlfredEnv(game_file)
        obs, info = stock.reset()
        turn = fast.reset()
        assert (obs[0], info["admissible_commands"][0]) == (turn.observation, turn.admissible)
        commands = ["look", "bogus command", turn.admissible[0], "inventory"] + common.load_walkthrough(game_file)
        for command in commands:
            obs, _, _, info = stock.step([command])
            turn = fast.step(command)
            assert obs[0] == turn.observation, command
            assert info["admissible_commands"][0] == turn.admissible, command
            assert info["won"][0] == turn.won
        stock.close()
        fast.close()


def test_a_game_read_back_from_the_translation_cache_plays_as_a_fresh_translation(all_games, tmp_path, monkeypatch):
    """common.translated keeps each game's parse and translation in the cache: a new process reads it back instead of
    translating again (the translator is not called), and the game plays exactly the same, the expert's plan too."""
    monkeypatch.setattr(common, "TRANSLATIONS", tmp_path)
    game_file = next(g for g in all_games if "pick_clean" in g)

    def played() -> list:
        common._load_game.cache_clear()  # as a new process finds it
        env = common.AlfredEnv(game_file)
        turns = [env.reset(), *play(env, ["look", "bogus command", *common.load_walkthrough(game_file)[:2]])]
        plan = env.expert_plan()
        env.close()
        return [(t.observation, t.admissible, t.won, t.state) for t in turns] + [plan]

    fresh = played()
    assert len(list(tmp_path.glob("*.pickle"))) == 1
    monkeypatch.setattr(common.fast_downward, "pddl2sas", lambda *a, **k: pytest.fail("translated again"))
    assert played() == fresh
    common._load_game.cache_clear()  # the other tests' games from the real cache again


def _make_download_layout(root: Path, all_games):
    """A fake `alfworld-download` tree with the cases discovery must skip."""
    for game_file in all_games[:6]:
        src = Path(game_file).parent
        for split in ("train", "valid_seen"):
            shutil.copytree(src, root / "json_2.1.1" / split / src.parent.name / src.name)
    src = Path(all_games[0]).parent
    shutil.copytree(src, root / "json_2.1.1/train/pick_and_place_simple-Mug-None-movable-Shelf-1/trial_X")
    shutil.copytree(src, root / "json_2.1.1/train/pick_and_place_simple-AppleSliced-None-Shelf-1/trial_X")
    unsolvable = root / "json_2.1.1/train/pick_and_place_simple-Unsolvable-None-Shelf-1/trial_X"
    shutil.copytree(src, unsolvable)
    data = json.loads((unsolvable / "game.tw-pddl").read_text())
    (unsolvable / "game.tw-pddl").write_text(json.dumps({**data, "solvable": False}))
    unknown = root / "json_2.1.1/train/pick_two_obj_and_slice-X-None-Shelf-1/trial_X"
    shutil.copytree(src, unknown)
    traj = json.loads((unknown / "traj_data.json").read_text())
    (unknown / "traj_data.json").write_text(json.dumps({**traj, "task_type": "slice_and_dance"}))


def test_discover_games_download_layout(tmp_path, all_games):
    _make_download_layout(tmp_path, all_games)
    games = common.discover_games(tmp_path, "train")
    assert len(games) == 6
    assert all("movable" not in g and "Sliced" not in g and "Unsolvable" not in g and "slice" not in g for g in games)
    assert games == sorted(games)
    shuffled = common.discover_games(tmp_path, "train", seed=3)
    assert sorted(shuffled) == games and shuffled == common.discover_games(tmp_path, "train", seed=3)
    assert shuffled != common.discover_games(tmp_path, "train", seed=4) or len(games) < 3
    only = common.discover_games(tmp_path, "valid_seen", task_types=["look_at_obj_in_light"])
    assert only and all(common.load_task_type(g) == "look_at_obj_in_light" for g in only)
    with pytest.raises(FileNotFoundError, match="alfworld-download"):
        common.discover_games(tmp_path / "nowhere", "train")
    (tmp_path / "json_2.1.1/valid_unseen").mkdir()
    with pytest.raises(FileNotFoundError, match="no playable games"):
        common.discover_games(tmp_path, "valid_unseen")
    with pytest.raises(ValueError, match="unknown task types"):
        common.discover_games(tmp_path, "train", task_types=["fly"])


def _walk_with_detours(game_file):
    """A long action list: the walkthrough with inadmissible and idle commands mixed in."""
    commands = []
    for i, command in enumerate(common.load_walkthrough(game_file)):
        commands += ["inventory", "jump around", "look"] if i % 2 == 0 else []
        commands.append(command)
    return commands


def test_restore_by_snapshot_and_by_replay_reproduce_the_next_steps(all_games):
    game_file = next(g for g in all_games if "pick_two" in g)
    commands = _walk_with_detours(game_file)
    cut = len(commands) // 2
    prefix, suffix = commands[:cut], commands[cut : cut + 10]
    with common.EnvGroup(game_file, 1) as group:
        for command in prefix:
            turn = group.step([command])[0]
        snapshot = group.snapshot(0)
        expected = [(t.observation, t.admissible, t.won) for t in (group.step([c])[0] for c in suffix)]
        restored = group.restore_snapshot(0, snapshot)
        assert (restored.observation, restored.admissible) == (turn.observation, turn.admissible)
        again = [(t.observation, t.admissible, t.won) for t in (group.step([c])[0] for c in suffix)]
        assert again == expected

    state = common.SavedState(
        game_file,
        0,
        prefix,
        [{"role": "user", "content": "x"}],
        [1, 2, 3],
        cut,
        turn.observation,
        turn.admissible,
        task="t",
    )
    state = common.SavedState.from_json(state.to_json())
    with common.EnvGroup(game_file, 2) as fresh:
        restored = fresh.restore(state)
        assert (restored.observation, restored.admissible) == (turn.observation, turn.admissible)
        replayed = [(t.observation, t.admissible, t.won) for t in (fresh.step([c, c])[1] for c in suffix)]
        assert replayed == expected


def test_tampered_history_raises_mismatch(all_games):
    game_file = all_games[0]
    walkthrough = common.load_walkthrough(game_file)
    with common.EnvGroup(game_file, 1) as group:
        turn = play(group, [[c] for c in walkthrough[:2]])[-1][0]
        state = common.SavedState(game_file, 0, walkthrough[:2], [], [], 2, turn.observation, turn.admissible)
        tampered = common.SavedState(**{**state.__dict__, "actions": [walkthrough[0], "look"]})
        with pytest.raises(common.ReplayMismatchError, match="replaying 2 actions"):
            group.restore(tampered)
        assert group.restore(state).observation == turn.observation


def test_branches_never_share_state(all_games):
    game_file = all_games[0]
    walkthrough = common.load_walkthrough(game_file)
    with common.EnvGroup(game_file, 3) as group:
        first = group.turns[0]
        others = [a for a in first.admissible if a != walkthrough[0] and a.startswith("go to")]
        plans = [walkthrough, [others[0]] * len(walkthrough), [None] * len(walkthrough)]
        for step in range(len(walkthrough)):
            turns = group.step([plan[step] for plan in plans])
        assert turns[0].won and not turns[1].won
        assert turns[2] is first  # never stepped
        for plan, turn in zip(plans[:2], turns):
            solo = common.AlfredEnv(game_file)
            solo.reset()
            solo_turn = play(solo, plan)[-1]
            assert (solo_turn.observation, solo_turn.admissible) == (turn.observation, turn.admissible)
            solo.close()


def test_closing_leaves_no_child_process_or_file_handle(all_games):
    process = psutil.Process()
    fds_before = process.num_fds()
    others = {child.pid for child in process.children(recursive=True)}  # the session's vLLM servers, if started
    groups = [common.EnvGroup(g, 4) for g in all_games[:3]]
    for group in groups:
        group.step([common.load_walkthrough(group.game_file)[0]] * 4)
        group.close()
    assert [child for child in process.children(recursive=True) if child.pid not in others] == []
    assert process.num_fds() <= fds_before
    assert all(group.env._lib is None for group in groups)


def test_saved_state_survives_json():
    state = common.SavedState(
        "g.tw-pddl",
        7,
        ["go to shelf 1"],
        [{"role": "tool", "content": 'é\n"q"'}],
        [5, 6],
        1,
        "obs",
        ["look"],
        task="t",
        prefix_step_ids=[-1, 0],
        prefix_logprobs=[0.0, -0.5],
    )
    assert common.SavedState.from_json(state.to_json()) == state


def test_grammar_code_cannot_run(tmp_path, all_games):
    marker = tmp_path / "pwned"
    src = Path(all_games[0]).parent
    bad = tmp_path / "json_2.1.1/train/pick_and_place_simple-Evil-None-Shelf-1/trial_X"
    shutil.copytree(src, bad)
    data = json.loads((bad / "game.tw-pddl").read_text())
    payload = f"{{__import__('os').system('touch {marker}')}}"
    assert "#intro#" in data["grammar"] or "intro" in data["grammar"]
    data["grammar"] = data["grammar"].replace("-= Welcome to TextWorld, ALFRED! =-", payload, 1)
    assert payload in data["grammar"]
    (bad / "game.tw-pddl").write_text(json.dumps(data))
    with pytest.raises(common.UnsafeGrammarError, match=str(bad / "game.tw-pddl")):
        common.AlfredEnv(bad / "game.tw-pddl")
    assert not marker.exists()
    for refused in ["o.__class__", "().__class__", "open('x')", "[1][0]", "o.name if o else o.id", "f(o)"]:
        with pytest.raises(common.UnsafeGrammarError):
            common._compile_grammar_expression(refused, "g.tw-pddl")

    class Info:
        name, id, indefinite = "", "mug_bar_1", "a"

    compiled = common._compile_grammar_expression("o.indefinite + ' ' + (o.name or o.id)", "g")
    assert compiled({"o": Info()}) == "a mug_bar_1"


def test_group_rebuilds_itself_when_the_engine_fails(all_games):
    game_file = all_games[0]
    walkthrough = common.load_walkthrough(game_file)
    with common.EnvGroup(game_file, 2) as healthy, common.EnvGroup(game_file, 2) as failing:
        detour = [c for c in healthy.turns[0].admissible if c.startswith("go to") and c != walkthrough[0]][0]
        plans = [walkthrough, [detour, "look"] + walkthrough]
        for step in range(len(walkthrough)):
            commands = [plan[step] for plan in plans]
            expected = healthy.step(commands)
            if step == 2:
                broken_library = failing.env._lib
                failing.env.close(reuse_library=False)  # the engine dies under the group
            got = failing.step(commands)
            assert [(t.observation, t.admissible, t.won) for t in got] == [
                (t.observation, t.admissible, t.won) for t in expected
            ]
        assert failing.recoveries == 1 and failing.env._lib is not broken_library
        assert got[0].won


@pytest.mark.slow
def test_make_games_is_deterministic_and_has_a_cli(tmp_path):
    import subprocess
    import sys

    files = offline.make_games(tmp_path / "direct", n=2, seed=5, log=lambda *a: None)
    assert len(files) == 2 and all(Path(f).is_file() for f in files)
    subprocess.run(
        [
            sys.executable,
            str(Path(offline.__file__)),
            "make-games",
            "--out",
            str(tmp_path / "cli"),
            "--n",
            "2",
            "--seed",
            "5",
        ],
        check=True,
        capture_output=True,
    )
    direct = sorted(p.relative_to(tmp_path / "direct") for p in (tmp_path / "direct").rglob("*") if p.is_file())
    cli = sorted(p.relative_to(tmp_path / "cli") for p in (tmp_path / "cli").rglob("*") if p.is_file())
    assert direct == cli and len(direct) == 4
    assert all((tmp_path / "direct" / p).read_bytes() == (tmp_path / "cli" / p).read_bytes() for p in direct)


@pytest.mark.slow
def test_parallel_make_games_writes_the_sequential_bytes(tmp_path, monkeypatch):
    """Workers plan candidates ahead of the sequential rng stream: an unsolvable candidate, or a walkthrough that
    fails its replay, must lead to the same redraws as with one worker. Neither happens naturally in small sets,
    so both are forced (forked workers inherit the patches)."""
    plan, load = offline.plan_walkthrough, offline.stored_walkthrough

    def plan_failing(planner, game):  # game 1's first two candidates (its attempt 0 draws none) and game 4's first
        unsolvable = ("plan_trial_T7_00001_01", "plan_trial_T7_00001_02", "plan_trial_T7_00004_00")
        return [] if any(name + ")" in game["pddl_problem"] for name in unsolvable) else plan(planner, game)

    def replayed_walkthrough(game_file):  # game 2's first walkthrough does not win its replay
        failed_once = tmp_path / ("replay-failed-" + Path(game_file).parents[4].name)
        if "trial_T7_00002_" in str(game_file) and not failed_once.exists():
            failed_once.touch()
            return []
        return load(game_file)

    monkeypatch.setattr(offline, "plan_walkthrough", plan_failing)
    monkeypatch.setattr(offline, "stored_walkthrough", replayed_walkthrough)
    trees, logs = [], []
    for workers in (1, 2):
        out, log = tmp_path / f"workers{workers}", []
        files = offline.make_games(out, n=6, seed=7, max_receptacles=5, log=log.append, workers=workers)
        assert all(Path(f).is_file() for f in files)
        trees.append({p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()})
        logs.append([line.replace(str(out), "") for line in log if line.startswith("  ")])  # the redraws
    assert len(logs[0]) == 4 and sum("unsolvable:" in line for line in logs[0]) == 3, logs[0]
    assert logs[0] == logs[1]
    assert len(trees[0]) == 12 and trees[0] == trees[1]


def _broken_copy(tmp_path, game_file, breaks: str) -> Path:
    """A copy of one game (in the download layout) with one of its files broken."""
    game_dir = tmp_path / "json_2.1.1/train/pick_and_place_simple-Mug-None-Shelf-1/trial_X"
    shutil.copytree(Path(game_file).parent, game_dir)
    bad = game_dir / "game.tw-pddl"
    if breaks == "truncated game":
        bad.write_text(bad.read_text()[:500])
    elif breaks == "corrupt traj_data":
        bad = game_dir / "traj_data.json"
        bad.write_text('{"task_type": "pick_and')
    else:  # valid JSON, PDDL missing a parenthesis
        data = json.loads(bad.read_text())
        bad.write_text(json.dumps({**data, "pddl_problem": data["pddl_problem"].rstrip().removesuffix(")")}))
    return bad


@pytest.mark.parametrize("breaks", ["truncated game", "corrupt traj_data", "broken PDDL"])
def test_bad_game_errors_name_the_file(tmp_path, all_games, breaks):
    bad = _broken_copy(tmp_path, all_games[0], breaks)
    game_file = bad.parent / "game.tw-pddl"
    if breaks == "broken PDDL":  # discovery reads the JSON only: the parse check and loading catch it
        assert common.discover_games(tmp_path, "train") == [str(game_file)]
        with pytest.raises(common.BadGameError, match=re.escape(str(game_file)) + ".*Missing"):
            common.load_game(game_file)
    else:
        with pytest.raises(common.BadGameError, match=re.escape(str(bad)) + ": unreadable"):
            common.discover_games(tmp_path, "train")
    with pytest.raises(common.BadGameError, match=re.escape(str(bad))):
        common.check_games([all_games[0], game_file])
    common.check_games(all_games)  # the good ones pass


def test_eval_subset_covers_every_task_type_in_proportion(games_root):
    train = common.discover_games(games_root, "train")
    counts = Counter(common.load_task_type(g) for g in train)
    assert len(counts) == 6 and sorted(counts.values()) == [1, 1, 2, 2, 2, 2]
    random.seed(123)  # the subset ignores the global random state
    six = common.eval_subset(games_root, "train", None, 6)
    random.seed(456)
    assert common.eval_subset(games_root, "train", None, 6) == six
    assert sorted(common.load_task_type(g) for g in six) == sorted(common.TASK_TYPES)  # each type once
    two = common.eval_subset(games_root, "train", None, 2)
    assert two == six[:2] and len({common.load_task_type(g) for g in two}) == 2
    assert sorted(common.eval_subset(games_root, "train", None, 100)) == sorted(train)
    eight = Counter(common.load_task_type(g) for g in common.eval_subset(games_root, "train", None, 8))
    assert all(eight[t] <= counts[t] for t in counts) and set(eight.values()) == {1, 2}
    only = common.eval_subset(games_root, "train", ["pick_two_obj_and_place"], 5)
    assert {common.load_task_type(g) for g in only} == {"pick_two_obj_and_place"}


def test_first_generation_shows_progress(tmp_path, capfd):
    root = offline.default_data_root(n=1, seed=5, cache_dir=tmp_path)
    assert root == tmp_path / "offline-games-n1-seed5" and len(list(root.glob("json_2.1.1/*/*/*/game.tw-pddl"))) == 1
    err = capfd.readouterr().err
    assert "generating offline games" in err and "1/1" in err  # a tqdm bar over the games


def test_expert_plan_from_start_matches_walkthrough_and_replans_after_a_detour(all_games):
    for game_file in [g for g in all_games if "pick_two" not in g]:  # pick_two plans take seconds each
        env = common.AlfredEnv(game_file)
        try:
            walkthrough = common.load_walkthrough(game_file)
            plan = env.expert_plan()
            assert len(plan) == len(walkthrough)  # optimal: same length (ties may order steps differently)
            for action in plan:
                assert action in env.turn.admissible
                env.step(action)
            assert env.turn.won and env.expert_plan() == []
            env.reset()
            assert env.expert_plan() == plan  # the cached plan of the start state
            env.step(walkthrough[0])
            assert len(env.expert_plan()) == len(walkthrough) - 1
            detour = next(a for a in env.turn.admissible if a.startswith("go to") and a != walkthrough[1])
            env.step(detour)  # a step away: the replan from here still wins
            for action in env.expert_plan():
                env.step(action)
            assert env.turn.won
        finally:
            env.close()
