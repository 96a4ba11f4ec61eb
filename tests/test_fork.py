"""The two ways to fork of docs/new-algorithm.md, proven in one copy of the repository that holds both forks.

Only the idea: RLOO, written by following the recipe alone (tests/fork/rloo.py and its page tests/fork/rloo.md), goes
into the copy as rloo.py and docs/rloo.md, no other file changed.

The whole script: `cp gigpo.py mygigpo.py`, its name and one line of its advantage changed, as a researcher forks;
`python mygigpo.py smoke` trains, and the rules that depend on which scripts exist (tests/test_layout.py: a fork's
marked places and contracts, the shipped scripts kept apart; tests/test_config.py: every script's presets;
tests/test_docs.py) pass with the copy beside the shipped scripts.

For both, `python -m pytest tests --script rloo --script mygigpo` runs once in the copy: every case each fork joins
(layout, presets and config files, its page's commands, the smoke preset, the training jobs) must pass. The vLLM
modules' cases (tests/test_vllm.py, tests/test_vllm_colocate.py: the sampler, which neither fork changes, behind a
real server and engine) are left to the shipped scripts' run of the full suite."""

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

pytestmark = pytest.mark.slow  # one nested run of the suite's script cases, shared by both tests
ROOT = Path(__file__).resolve().parents[1]
FORK = ROOT / "tests" / "fork"
MAX_LINES = 150  # a policy-gradient script that reuses the shared PPO step
MAX_COPIED = 20  # its lines of code copied unchanged from gigpo.py, the script the recipe starts from
FORKS = ("rloo", "mygigpo")
VLLM_MODULES = ("tests/test_vllm.py", "tests/test_vllm_colocate.py")
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


def whole_copy_of_gigpo(text: str) -> str:
    fork = edited(text, 'ALGORITHM = "gigpo"', 'ALGORITHM = "mygigpo"')
    return edited(  # the idea: only a won episode's A_E counts
        fork,
        "advantages[i][t] = a_e + step_weight * a_s  # Eq. 8",
        "advantages[i][t] = max(a_e, 0.0) + step_weight * a_s",
    )


def outcomes(stdout: str) -> dict[str, str]:
    """`pytest -v`'s outcome of each test id."""
    return dict(re.findall(r"^(tests/\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", stdout, re.M))


@pytest.fixture(scope="module")
def forked(tmp_path_factory) -> tuple[Path, dict[str, str], str]:
    """The copy with both forks in it, and the outcome of each case of `pytest tests --script rloo --script mygigpo`
    there (the vLLM modules deselected), with its output."""
    repo = repository_copy(tmp_path_factory.mktemp("forked"))
    assert not any((repo / f"{name}.py").exists() or (repo / "docs" / f"{name}.md").exists() for name in FORKS)
    shutil.copy(FORK / "rloo.py", repo / "rloo.py")  # the recipe's two new files; nothing else is edited
    shutil.copy(FORK / "rloo.md", repo / "docs" / "rloo.md")
    (repo / "mygigpo.py").write_text(whole_copy_of_gigpo((repo / "gigpo.py").read_text()))

    scripts = [flag for name in FORKS for flag in ("--script", name)]
    ignored = [flag for module in VLLM_MODULES for flag in ("--ignore", module)]
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *scripts, *ignored, "tests"]
    result = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=2400)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    return repo, outcomes(result.stdout), result.stdout


def cases_of(name: str, ran: dict[str, str]) -> dict[str, str]:
    """The cases a fork joined (parametrized with its name, its script or its page), each of which passed."""
    named = re.compile(rf"\[(.*[^\w])?{name}(\.py|\.md)?([^\w].*)?\]$")
    cases = {test: outcome for test, outcome in ran.items() if named.search(test)}
    assert set(cases.values()) == {"PASSED"}, {test: outcome for test, outcome in cases.items() if outcome != "PASSED"}
    return cases


def test_a_new_algorithm_written_from_the_recipe_passes_every_script_test(forked):
    script = (FORK / "rloo.py").read_text().splitlines()
    copied = copied_code_lines(script, (ROOT / "gigpo.py").read_text().splitlines())
    assert len(script) <= MAX_LINES and len(copied) <= MAX_COPIED, copied

    _, ran, stdout = forked
    cases = cases_of("rloo", ran)
    assert len(cases) >= 30, stdout[-3000:]  # the job tests ran, not just the layout
    assert any("test_training_job.py::test_killed_job_resumes_exactly" in test for test in cases)


def test_a_whole_copy_of_gigpo_with_one_line_changed_is_a_valid_fork(forked, games_root, tmp_path, monkeypatch):
    repo, ran, stdout = forked
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

    # `pytest tests --script mygigpo`: every case gigpo.py gets outside the vLLM modules, under the fork's name
    cases = cases_of("mygigpo", ran)
    assert len(cases) >= 30, stdout[-3000:]
    assert {
        "test_every_script_marks_the_same_fork_places_in_order",
        "test_every_fork_place_holds_the_same_kinds_of_things",
        "test_every_update_function_reads_in_one_screen",
        "test_every_script_has_the_shared_presets_and_every_preset_is_valid",
        "test_smoke_preset_trains",
        "test_killed_job_resumes_exactly",
    } <= {test.split("::")[1].split("[")[0] for test in cases}

    # the rules that read which scripts exist, unfiltered, with both forks beside the shipped scripts
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *RULES, "--deselect", UNAFFECTED]
    result = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    kept_apart = [test for test in outcomes(result.stdout) if "test_no_long_run_of_identical_lines_between" in test]
    assert len(kept_apart) == len(SHIPPED_SCRIPTS) * (len(SHIPPED_SCRIPTS) - 1) // 2  # each pair, no fork in any
    assert not [test for test in kept_apart if any(name in test for name in FORKS)]
