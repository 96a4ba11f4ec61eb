"""The two ways to fork of docs/new-algorithm.md, proven in a copy of the repository.

Only the idea: RLOO, written by following the recipe alone (tests/fork/rloo.py and its page tests/fork/rloo.md), goes
into the copy as rloo.py and docs/rloo.md, no other file changed, and the tests that every script gets (`python -m
pytest -q tests --script rloo`: layout, presets and config files, its page's commands, the training jobs) pass there.
The vLLM case (tests/test_vllm.py) is left to the full suite.

The whole script: `cp gigpo.py mygigpo.py`, its name and one line of its advantage changed, as a researcher forks;
`python mygigpo.py smoke` trains, and the rules that depend on which scripts exist (tests/test_layout.py: a fork's
marked places and contracts, the shipped scripts kept apart; tests/test_config.py: every script's presets;
tests/test_docs.py) pass with the copy beside the shipped scripts. Its training-job cases are gigpo.py's code under
another name (the name's own path through them is what the RLOO test runs): `pytest tests --script mygigpo` is left to
a run by hand (docs/new-algorithm.md: Testing a new script)."""

import difflib
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from algorithm_scripts import SHIPPED_SCRIPTS

import gigpo

ROOT = Path(__file__).resolve().parents[1]
FORK = ROOT / "tests" / "fork"
MAX_LINES = 150  # a policy-gradient script that reuses the shared PPO step
MAX_COPIED = 20  # its lines of code copied unchanged from gigpo.py, the script the recipe starts from
JOB_TESTS = ["tests/test_layout.py", "tests/test_config.py", "tests/test_docs.py", "tests/test_training_job.py"]
RULES = ["tests/test_layout.py", "tests/test_config.py", "tests/test_docs.py"]  # those that read which scripts exist
# runs adca_grpo.py twice on games of its own (~25 s): the same whatever scripts exist
UNAFFECTED = "tests/test_config.py::test_a_runs_config_json_reruns_it_exactly"


def repository_files() -> list[Path]:
    """The repository as a clone has it: tracked files and new ones not ignored (relative paths)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [Path(name) for name in listed.split("\0") if name and (ROOT / name).is_file()]


def repository_copy(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for path in repository_files():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, repo / path)
    return repo


def copied_code_lines(new: list[str], source: list[str]) -> list[str]:
    """The lines of code of `new` in runs of 3+ lines identical to `source` (blank lines, comments, imports and
    closing brackets or quotes not counted: a fork keeps the marks and the imports on purpose)."""
    matcher = difflib.SequenceMatcher(None, new, source, autojunk=False)
    runs = [block for block in matcher.get_matching_blocks() if block.size >= 3]
    lines = [new[i] for block in runs for i in range(block.a, block.a + block.size)]
    skipped = ("#", "import ", "from ", ")", "}", '"""')
    return [line for line in lines if line.strip() and not line.strip().startswith(skipped)]


def test_a_new_algorithm_written_from_the_recipe_passes_every_script_test(tmp_path):
    script = (FORK / "rloo.py").read_text().splitlines()
    copied = copied_code_lines(script, (ROOT / "gigpo.py").read_text().splitlines())
    assert len(script) <= MAX_LINES and len(copied) <= MAX_COPIED, copied

    repo = repository_copy(tmp_path)
    assert not (repo / "rloo.py").exists() and not (repo / "docs" / "rloo.md").exists()
    shutil.copy(FORK / "rloo.py", repo / "rloo.py")  # the recipe's two new files; nothing else is edited
    shutil.copy(FORK / "rloo.md", repo / "docs" / "rloo.md")

    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--script", "rloo", *JOB_TESTS]
    result = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=1800)
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in summary and "failed" not in summary and "skipped" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 30, summary  # the job tests ran, not just the layout


def edited(text: str, line: str, new_line: str) -> str:
    assert text.count(line) == 1, f"gigpo.py no longer has {line!r} once: edit this test's fork"
    return text.replace(line, new_line)


def load_script(path: Path, monkeypatch):
    """The script at path imported under its name, for this test only."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_whole_copy_of_gigpo_with_one_line_changed_is_a_valid_fork(tmp_path, games_root, monkeypatch):
    repo = repository_copy(tmp_path)
    fork = edited((repo / "gigpo.py").read_text(), 'ALGORITHM = "gigpo"', 'ALGORITHM = "mygigpo"')
    fork = edited(  # the idea: only a won episode's A_E counts
        fork,
        "advantages[i][t] = a_e + step_weight * a_s  # Eq. 8",
        "advantages[i][t] = max(a_e, 0.0) + step_weight * a_s",
    )
    (repo / "mygigpo.py").write_text(fork)
    # a group of a lost and a won one-step episode, each step alone in its step group: the lost one's A is its A_E
    lost_and_won = ([0.0, 1.0], [0, 0], [[0.0], [1.0]], [["a"], ["b"]], 1.0, 1.0, True)
    assert load_script(repo / "mygigpo.py", monkeypatch).gigpo_advantages(*lost_and_won)[0] == [0.0]
    assert gigpo.gigpo_advantages(*lost_and_won)[0][0] < 0

    runs = tmp_path / "runs"  # on the session's game set: a first run's own set takes minutes to generate
    smoke = [sys.executable, "mygigpo.py", "smoke", "--data-root", str(games_root), "--output-dir", str(runs)]
    result = subprocess.run(smoke, cwd=repo, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    (run,) = runs.iterdir()
    (*_, last) = sorted((run / "checkpoints").glob("update_*"))
    assert run.name.startswith("mygigpo__") and '"algorithm": "mygigpo"' in (last / "trainer_state.json").read_text()

    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *RULES, "--deselect", UNAFFECTED]
    result = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    passed = re.findall(r"::(\w+)\[([^\]]*)\] PASSED", result.stdout)
    of_the_fork = {test for test, case in passed if "mygigpo" in case}
    assert {
        "test_every_script_marks_the_same_fork_places_in_order",
        "test_every_fork_place_holds_the_same_kinds_of_things",
        "test_every_update_function_reads_in_one_screen",
        "test_every_script_has_the_shared_presets_and_every_preset_is_valid",
    } <= of_the_fork
    kept_apart = [case for test, case in passed if test.startswith("test_no_long_run_of_identical_lines_between")]
    assert len(kept_apart) == len(SHIPPED_SCRIPTS) * (len(SHIPPED_SCRIPTS) - 1) // 2  # each pair, the fork in none
    assert not [case for case in kept_apart if "mygigpo" in case]
