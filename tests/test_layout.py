"""The two algorithm scripts share their plumbing as one block of text, byte-identical in both and last in the file
(after the algorithm, before only the `__main__` guard), so a reader meets the algorithm first."""

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
