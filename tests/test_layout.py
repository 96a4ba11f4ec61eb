"""The two algorithm scripts share their plumbing as one block of text, byte-identical in both and last in the file
(after the algorithm, before only the `__main__` guard), so a reader meets the algorithm first."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "# ===== model side: identical in tempo.py and adca_grpo.py ====="
END = "# ===== end model side ====="


def plumbing(text: str) -> str:
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "one plumbing block, between its two markers"
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def test_the_plumbing_block_is_byte_identical_in_both_scripts():
    tempo, adca = ((ROOT / name).read_text() for name in ("tempo.py", "adca_grpo.py"))
    assert plumbing(tempo) == plumbing(adca)


@pytest.mark.parametrize("name", ["tempo.py", "adca_grpo.py"])
def test_the_plumbing_block_comes_last(name):
    text = (ROOT / name).read_text()
    after = text[text.index(END) + len(END) :]
    assert after.strip() == 'if __name__ == "__main__":\n    cli(Args, main)'
    assert text.index(BEGIN) > text.index("class Args")


def defined_lines(path: Path) -> dict[str, int]:
    """Top-level names of a module (functions, classes, assignments) -> the line they are defined on."""
    names = {}
    for node in ast.parse(path.read_text()).body:
        targets = [node] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else getattr(node, "targets", [])
        for target in targets:
            if hasattr(target, "name") or hasattr(target, "id"):
                names[getattr(target, "name", None) or target.id] = node.lineno
    return names


def layout_rows(section: str, heading: str) -> list[tuple[int, int, str]]:
    """(first, last, text) of each `| a-b | text |` row of the table under `| heading | part |`."""
    table = section[section.index(f"| {heading} | part |") :].split("\n\n")[0]
    return [(int(a), int(b), text) for a, b, text in re.findall(r"^\| (\d+)-(\d+) \| (.*) \|$", table, re.M)]


@pytest.mark.parametrize("name", ["tempo.py", "adca_grpo.py"])
def test_the_readme_layout_line_ranges_are_those_of_the_script(name):
    """The README's table of a script's parts covers it line by line, each name it quotes is defined inside its row's
    range, and the plumbing row is the plumbing block."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Layout") :].split("\n## ")[0]
    rows = layout_rows(section, f"`{name}`")
    text = (ROOT / name).read_text()
    lines = text.splitlines()
    assert rows and rows[0][0] == 1 and rows[-1][1] == len(lines)
    assert all(previous[1] + 1 == row[0] for previous, row in zip(rows, rows[1:])), "rows must be contiguous"
    begin = lines.index(BEGIN) + 1
    assert (rows[-2][1], rows[-1][0]) == (begin - 1, begin) and "plumbing" in rows[-1][2]
    defined = defined_lines(ROOT / name)
    for first, last, part in rows:
        for quoted in re.findall(r"`(\w+)`", part):
            if quoted in defined:
                assert first <= defined[quoted] <= last, (
                    f"`{quoted}` is on line {defined[quoted]}, not in {first}-{last}"
                )


@pytest.mark.parametrize("name", ["tempo.py", "common.py"])
def test_the_readme_layout_paragraphs_name_the_right_lines(name):
    """The prose ranges (`tempo.py`'s plumbing, `common.py`) hold the names they quote (of the plumbing's: those it
    defines; it also names the algorithm's `policy_loss`)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Layout") :].split("\n## ")[0]
    paragraph = next(
        p for p in section.split("\n\n") if p.startswith("The plumbing" if name == "tempo.py" else "`common.py`")
    )
    parts = re.findall(r"(\d+)-(\d+) ([^;]*)", paragraph.replace("\n", " "))
    defined = defined_lines(ROOT / name)
    if name == "tempo.py":
        begin = (ROOT / name).read_text().splitlines().index(BEGIN) + 1
        defined = {quoted: line for quoted, line in defined.items() if line > begin}
    assert len(parts) >= 5
    for first, last, part in parts:
        for quoted in re.findall(r"`(\w+)`", part):
            if quoted in defined:
                assert int(first) <= defined[quoted] <= int(last), (
                    f"`{quoted}` is on line {defined[quoted]}, not {first}-{last}"
                )
