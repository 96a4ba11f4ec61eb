"""The algorithm scripts: the ones the library ships, listed, and every script, found: each top-level *.py of the
repository that names its ALGORITHM. A fork (a whole copy of gigpo.py, or only the idea: docs/new-algorithm.md) joins
every test that takes NAMES from here; the rules that keep the library's own scripts apart from each other (no long
run of shared lines) hold between SHIPPED_SCRIPTS only."""

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_SCRIPTS = ("adca_grpo", "gigpo", "ppo", "tempo")  # a new algorithm of the library joins here
NAMES = sorted(p.stem for p in ROOT.glob("*.py") if re.search(r"^ALGORITHM = ", p.read_text(), re.M))
MODULES = {name: importlib.import_module(name) for name in NAMES}
