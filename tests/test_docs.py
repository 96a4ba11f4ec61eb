"""Every command in README.md and docs/*.md runs as written: each line of a ```bash block is parsed by the script's
own command line (`python SCRIPT.py` or `python -m benchmarks.PACKAGE.MODULE` of this repository, found by what it
is: an algorithm script (it names its ALGORITHM) by harness.cli + validate_args, a tyro script by tyro with its Args,
an argparse script by its parser), every relative link points to a file (and heading) that exists, and the README
stays short. A command of a tool not listed here fails until someone decides how to check it."""

import argparse
import dataclasses
import importlib
import json
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import tyro

import harness
import plan

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Commands of other tools: shown for the reader, not checked here (their first word, or first two words).
OTHER_TOOLS = {
    "pip install",
    "python3.11 -m",
    "python3 -m",
    "pip uninstall",
    ".",
    "export",
    "vllm serve",
    "alfworld-download",
    "wandb sync",
    "python -m",  # a module not of this repository (pytest, pip)
}
ACCELERATE_FLAGS_WITH_VALUE = {
    "--num_processes",
    "--num_machines",
    "--mixed_precision",
    "--dynamo_backend",
    "--config_file",
    "--machine_rank",
    "--main_process_ip",
    "--main_process_port",
}
# Variables the reader provides (their own data, their own key): set to placeholders.
READER_ENV = {"ALFWORLD_DATA": "/placeholder/alfworld", "DASHSCOPE_API_KEY": "placeholder"}
RUN_DIR = re.compile(r"^runs/[\w.-]+__\d+__\d+")


def bash_commands(page: Path) -> list[str]:
    """The command lines of the page's ```bash blocks: continuations joined, comments dropped, split at && and ;."""
    commands, block = [], None
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            if block is not None:
                text = "\n".join(block).replace("\\\n", " ")
                for command_line in text.splitlines():
                    tokens = shlex.split(command_line, comments=True)
                    command: list[str] = []
                    for token in [*tokens, ";"]:
                        ends = token in ("&&", ";", "&") or token.endswith((";", "&"))
                        if token.rstrip(";&"):
                            command.append(token.rstrip(";&") if ends else token)
                        if ends and command:
                            commands.append(shlex.join(command))
                            command = []
                block = None
            elif line.strip() == "```bash":
                block = []
        elif block is not None:
            block.append(line)
    return commands


ALL_COMMANDS = [(page.relative_to(ROOT).as_posix(), command) for page in PAGES for command in bash_commands(page)]


ASSIGNMENT = re.compile(r"([A-Z_][A-Z0-9_]*)=(\S*)")


def strip_prefix(tokens: list[str], env: dict) -> list[str]:
    """Drop leading VAR=value assignments (into env) and `timeout N`."""
    while tokens and (ASSIGNMENT.fullmatch(tokens[0]) or tokens[0] == "timeout"):
        if tokens[0] == "timeout":
            tokens = tokens[2:]
        else:
            env.update([ASSIGNMENT.fullmatch(tokens[0]).groups()])
            tokens = tokens[1:]
    return tokens


def page_exports(page: str) -> dict:
    """`export VAR=value` lines of a page: a later command of the page runs with them."""
    exports = {}
    for command in bash_commands(ROOT / page):
        tokens = shlex.split(command)
        if tokens[0] == "export":
            exports.update(ASSIGNMENT.fullmatch(token).groups() for token in tokens[1:] if ASSIGNMENT.fullmatch(token))
    return exports


def script_and_argv(tokens: list[str]) -> tuple[str | None, list[str]]:
    """(script, its argv) of `python SCRIPT ...`, `python -m MODULE ...` (a module of this repository: its file) or
    `accelerate launch [its flags] SCRIPT ...`; (None, []) else."""
    if tokens[:1] == ["python"] and len(tokens) > 1 and tokens[1].endswith(".py"):
        return tokens[1], tokens[2:]
    if tokens[:2] == ["python", "-m"] and len(tokens) > 2 and (ROOT / module_file(tokens[2])).is_file():
        return module_file(tokens[2]), tokens[3:]
    if tokens[:2] == ["accelerate", "launch"]:
        rest = tokens[2:]
        while rest and rest[0].startswith("--"):
            rest = rest[2:] if rest[0] in ACCELERATE_FLAGS_WITH_VALUE else rest[1:]
        assert rest and rest[0].endswith(".py"), f"accelerate launch without a script: {tokens}"
        return rest[0], rest[1:]
    return None, []


def substituted(argv: list[str], tmp_path: Path, module=None) -> list[str]:
    """$VARS and globs -> a placeholder dir; a run dir (runs/NAME__SEED__TIME) -> a placeholder run of the script
    (config.json of its defaults, one checkpoint), so --eval-only, --resume and --config on it parse."""
    out = []
    for token in argv:
        if "$" in token or "*" in token or token.startswith("~"):
            token = str(tmp_path / "placeholder")
        elif RUN_DIR.match(token) and module is not None:
            run_dir = tmp_path / RUN_DIR.match(token).group(0)
            (run_dir / "checkpoints" / "update_000020").mkdir(parents=True, exist_ok=True)
            (run_dir / "checkpoints" / "update_000020" / "trainer_state.json").write_text("{}")
            (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(module.Args())))
            token = str(tmp_path / token)
        out.append(token)
    return out


class Parsed(Exception):
    pass


def module_file(module: str) -> str:
    return module.replace(".", "/") + ".py"


def kind(script: str) -> str:
    """What a script of this repository is, read from its text: an algorithm script, or by its `__main__` block a tyro
    or an argparse CLI."""
    text = (ROOT / script).read_text()
    if re.search(r"^ALGORITHM = ", text, re.M):
        return "algorithm"
    main = text[text.index('if __name__ == "__main__":') :] if 'if __name__ == "__main__":' in text else ""
    return "tyro" if "tyro.cli(" in main else "argparse" if "argparse" in text else "unknown"


def check_argparse(script: str, argv: list[str], monkeypatch) -> None:
    """Run the script's own argparse parser on argv (the script stops right after parsing)."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(Parsed):
        runpy.run_module(module_name(script), run_name="__main__")


def module_name(script: str) -> str:
    return script.removesuffix(".py").replace("/", ".")


def module_of(script: str):
    return importlib.import_module(module_name(script))


def test_docs_have_commands():
    pages = {page for page, _ in ALL_COMMANDS}
    assert "README.md" in pages and len(ALL_COMMANDS) > 40


@pytest.mark.parametrize("page, command", ALL_COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in ALL_COMMANDS])
def test_command_parses(page, command, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # relative paths (configs/...) as a reader runs them, from the repository root
    env = {**READER_ENV, **page_exports(page)}
    tokens = strip_prefix(shlex.split(command), env)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    script, argv = script_and_argv(tokens)
    if script is None:
        assert " ".join(tokens[:2]) in OTHER_TOOLS or tokens[0] in OTHER_TOOLS, (
            f"{page}: `{command}` is neither an algorithm/tool script of this repo nor an allowed other tool"
        )
        return
    assert (ROOT / script).is_file(), f"{page}: `{command}`: no {script}"
    if kind(script) == "algorithm":
        module = module_of(script)
        args = harness.cli(module.Args, lambda a: a, module.PRESETS, argv=substituted(argv, tmp_path, module))
        assert isinstance(args, module.Args)
        module.validate_args(args)
        if "--num_processes" in tokens:  # the run's counts divide among the processes it launches
            plan.process_shares(args, int(tokens[tokens.index("--num_processes") + 1]))
    elif kind(script) == "tyro":
        module = module_of(script)
        assert isinstance(tyro.cli(module.Args, args=substituted(argv, tmp_path)), module.Args)
    elif kind(script) == "argparse":
        check_argparse(script, substituted(argv, tmp_path), monkeypatch)
    else:
        pytest.fail(f"{page}: `{command}`: {script} is not a script this test knows how to check")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_exist():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md":
                anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)}
                if anchor not in anchors:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_learning_tables_in_the_docs_are_what_the_committed_results_give():
    """Every table between `<!-- table: NAME -->` markers equals what `python -m benchmarks.learning.tables` prints
    from benchmarks/results (run it to rewrite them)."""
    from benchmarks.learning import tables

    assert tables.regenerate(check=True) == [], "stale tables: run `python -m benchmarks.learning.tables`"


def test_the_ranking_table_holds_each_arm_at_the_lr_its_grid_chose():
    """The protocol: each ranking arm's held-out runs are at the lr of the highest mean end on the tuning seeds."""
    from benchmarks.learning import tables

    held_out = [name for name, _ in tables.TABLES["rank-held-out"].arms]
    for arm in tables.RANK_ARMS:
        assert tables.chosen_lr(tables.TABLES["rank-tuning"], arm) in held_out, arm


ALGORITHM_PAGES = {"tempo": "tempo.md", "adca_grpo": "adca_grpo.md", "gigpo": "gigpo.md", "ppo": "ppo.md"}
DESCRIBED = {"-", "off", "all", "offline set", "all attention + MLP projections", "{output_dir}/sampler_adapters"}


def shown(value) -> str:
    """A flag's default as the pages write it: on / off, None, numbers as numbers, sequences space-separated."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return " ".join(map(shown, value))
    return "None" if value is None else str(value)


def same_default(written: str, value) -> bool:
    written = written.strip().strip("`").split(" (")[0]
    if written in DESCRIBED and (value in (None, "") or isinstance(value, tuple)):
        return True  # a default described in words: none, empty or the standard list
    if written in ('""', "''"):
        return value == ""
    if isinstance(value, tuple):
        return len(written.split()) == len(value) and all(map(same_default, written.split(), value))
    if isinstance(value, (bool, str)) or value is None:
        return written == shown(value)
    try:
        return float(written) == float(value)
    except ValueError:
        return False


@pytest.mark.parametrize("name", ALGORITHM_PAGES)
def test_each_algorithm_pages_flag_table_gives_the_scripts_defaults(name):
    """The `| flag | default | meaning |` table of docs/<script>.md: every default is the script's Args default."""
    module, text = module_of(f"{name}.py"), (ROOT / "docs" / ALGORITHM_PAGES[name]).read_text()
    table = text[text.index("| flag | default | meaning |") :].split("\n\n")[0].splitlines()[2:]
    wrong = []
    for row in table:
        flag_cell, default_cell = (cell.strip() for cell in row.strip("|").split(" | ")[:2])
        flags = [f for f in re.findall(r"`--([\w-]+)", flag_cell) if not f.startswith("no-")]
        defaults = re.split(r" / |, ", default_cell) if len(flags) > 1 else [default_cell]
        defaults = defaults * len(flags) if len(defaults) == 1 else defaults  # one default for all of them
        assert len(defaults) == len(flags), row
        for flag, written in zip(flags, defaults):
            value = getattr(module.Args(), flag.replace("-", "_"))
            if not same_default(written, value):
                wrong.append(f"--{flag}: the page says {written.strip()}, Args() has {shown(value)}")
    assert not wrong, f"docs/{ALGORITHM_PAGES[name]}: {wrong}"
