"""The declared lower bounds of the packages whose APIs the scripts call most (torch, transformers, peft, accelerate),
read from pyproject.toml, and a venv that holds exactly them: made once into the cache (~2 min), keyed by what
pyproject declares, with the project's other dependencies and its test extra as pip resolves them beside the floors.
The project itself is not installed there: the tests run it from the repository (PYTHONPATH)."""

import fcntl
import hashlib
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from offline import DEFAULT_CACHE_DIR

ROOT = Path(__file__).resolve().parents[1]
FLOORED = ("torch", "transformers", "peft", "accelerate")


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def declared() -> dict[str, Requirement]:
    """The requirement pyproject declares for each floored package."""
    requirements = {r.name: r for r in map(Requirement, project()["dependencies"])}
    return {name: requirements[name] for name in FLOORED}


def floors() -> dict[str, str]:
    """Each floored package's lower bound (its `>=` version)."""
    return {name: next(s.version for s in r.specifier if s.operator == ">=") for name, r in declared().items()}


def floor_venv_python() -> Path:
    """The python of the floors' venv, made once (a lock lets one process build it; a marker says it is whole)."""
    wanted = [*project()["dependencies"], *project()["optional-dependencies"]["test"]]
    pins = [f"{name}=={version}" for name, version in floors().items()]
    venv = DEFAULT_CACHE_DIR / f"floor-venv-{hashlib.sha256(' '.join(wanted + pins).encode()).hexdigest()[:12]}"
    python, done = venv / "bin" / "python", venv / ".complete"
    if done.is_file():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            pip = [str(python), "-m", "pip", "-q", "install"]
            subprocess.run([*pip, pins[0]], check=True)  # torch alone first: the machine's CPU wheel where it has one
            constraints = venv / "floors.txt"
            constraints.write_text("\n".join(pins) + "\n")
            subprocess.run([*pip, "-c", str(constraints), *wanted], check=True)
            done.write_text("\n".join(pins))
    return python
