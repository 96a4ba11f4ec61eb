"""The recipe of docs/new-algorithm.md, proven: RLOO, written by following the recipe alone (tests/fork/rloo.py and
its page tests/fork/rloo.md), goes into a copy of the repository as rloo.py and docs/rloo.md, no other file changed,
and the tests that every script gets (`python -m pytest -q tests --script rloo`: layout, presets and config files, its
page's commands, the training jobs) pass there. The vLLM case (tests/test_vllm.py) is left to the full suite."""

import difflib
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORK = ROOT / "tests" / "fork"
MAX_LINES = 150  # a policy-gradient script that reuses the shared PPO step
MAX_COPIED = 20  # its lines of code copied unchanged from gigpo.py, the script the recipe starts from
JOB_TESTS = ["tests/test_layout.py", "tests/test_config.py", "tests/test_docs.py", "tests/test_training_job.py"]


def repository_files() -> list[Path]:
    """The repository as a clone has it: tracked files and new ones not ignored (relative paths)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [Path(name) for name in listed.split("\0") if name and (ROOT / name).is_file()]


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

    repo = tmp_path / "repo"
    for path in repository_files():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, repo / path)
    assert not (repo / "rloo.py").exists() and not (repo / "docs" / "rloo.md").exists()
    shutil.copy(FORK / "rloo.py", repo / "rloo.py")  # the recipe's two new files; nothing else is edited
    shutil.copy(FORK / "rloo.md", repo / "docs" / "rloo.md")

    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--script", "rloo", *JOB_TESTS]
    result = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=1800)
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in summary and "failed" not in summary and "skipped" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 30, summary  # the job tests ran, not just the layout
