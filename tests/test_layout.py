"""How the project is laid out: the shared code in layer files, each with one job and importing only the layers below
it; each algorithm script holds its algorithm and imports only those layers; the places a fork changes are marked the
same way in every script; the shared flags are declared once, in harness.SharedArgs (and PPOArgs), which every Args
extends. Every script found (a fork too) is held to these; the shipped scripts, in addition, share no long run of
lines with each other (a whole copy of one, the common fork, is no shipped script: tests/algorithm_scripts.py)."""

import ast
import dataclasses
import difflib
import re
import runpy
import sys
from pathlib import Path

import pytest
from algorithm_scripts import MODULES, NAMES, SHIPPED_SCRIPTS

import harness

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [f"{name}.py" for name in NAMES]  # found by algorithm_scripts.py: the shipped ones and any fork
SHIPPED = [f"{name}.py" for name in SHIPPED_SCRIPTS]
PROJECT_MODULES = {p.stem for p in ROOT.glob("*.py")} | {"benchmarks", "tests"}
FORK_MARK = re.compile(r"^# fork (\d): (.*)$", re.M)
MAX_UPDATE_LINES = 70  # an update function read in one screen
MAX_LINES = 1500  # every file of the project: a layer that outgrows it is two layers
# The shared code, bottom layer first, and each file's job (the first line of its docstring). A file imports only the
# files before it (offline.py none of them); a block that two scripts share goes to the lowest layer it can live in:
# common.py if it needs only games, envs and rollouts, samplers.py if it needs the model, training.py if it trains,
# harness.py if it is part of the job around the update loop.
LAYERS = {
    "offline.py": (
        "Offline stand-ins for what this machine cannot download, under common.py (it imports no module of this project):"
    ),
    "common.py": (
        "The env/replay helper: ALFWorld games, the fast env, saved states and replay restore, the chat protocol, rollouts."
    ),
    "samplers.py": (
        "The policy and its samplers: load_model (LoRA), generate() in this process or a vLLM server, each a SampleFn."
    ),
    "training.py": (
        "The training step: teacher-forced logprobs, Datum, train_step, PPO-clip, the metrics reduced over processes."
    ),
    "plan.py": "What a run needs before it starts: each process's share of the run's counts, and --plan's memory, disk and tokens.",
    "evaluation.py": (
        "Evaluation: a policy's success on its training games and on the held-out splits, with n and an interval per split."
    ),
    "harness.py": (
        "The job around a script's update loop: flags, start-up checks, Runtime, Run, evaluation, logging, checkpoints, cli."
    ),
}
MAX_SHARED_RUN = 25  # identical lines in a row two shipped scripts may share (more goes to a layer, as LAYERS says)


def test_the_shipped_scripts_are_found_and_installed():
    """Each listed script exists, names its ALGORITHM and is in pyproject.toml's py-modules (an install needs it)."""
    assert set(SHIPPED) <= set(SCRIPTS)
    modules = re.search(r"^py-modules = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert set(SHIPPED_SCRIPTS) <= {name.strip(' "') for name in modules.split(",")}


def longest_identical_run(a: list[str], b: list[str]) -> int:
    """Longest run of consecutive lines (blank lines included) that appears in both."""
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return max((block.size for block in matcher.get_matching_blocks()), default=0)


def test_longest_identical_run_counts_lines_in_a_row():
    assert longest_identical_run(list("xabcdy"), list("zabcqd")) == 3


@pytest.mark.parametrize("pair", [(a, b) for i, a in enumerate(SHIPPED) for b in SHIPPED[i + 1 :]], ids="-".join)
def test_no_long_run_of_identical_lines_between_shipped_scripts(pair):
    first, second = ((ROOT / name).read_text().splitlines() for name in pair)
    assert longest_identical_run(first, second) <= MAX_SHARED_RUN, "move the shared block to a layer (see LAYERS)"


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_script_imports_no_project_module_but_the_shared_layers(name):
    assert project_imports(ROOT / name) <= {"common", "samplers", "training", "harness"}
    assert "harness" in project_imports(ROOT / name)


def project_imports(path: Path) -> set[str]:
    """The modules of this project that a file imports (anywhere in it, functions included)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    return imported & PROJECT_MODULES


def test_the_layers_import_only_downwards():
    """Each layer file imports only the files before it in LAYERS (a lazy import inside a function counts: it would
    be a cycle all the same); sft.py and plot.py sit beside the scripts; benchmarks/ on top."""
    order = [name.removesuffix(".py") for name in LAYERS]
    for i, name in enumerate(LAYERS):
        assert project_imports(ROOT / name) <= set(order[:i]), f"{name} imports a layer above it"
    assert project_imports(ROOT / "common.py") == {"offline"}
    for path in (ROOT / "benchmarks").rglob("*.py"):
        assert "tests" not in project_imports(path), path


def test_project_imports_counts_the_imports_inside_functions(tmp_path):
    path = tmp_path / "lazy.py"
    path.write_text("import json\n\n\ndef f():\n    from harness import cli\n    import training.x\n")
    assert project_imports(path) == {"harness", "training"}


@pytest.mark.parametrize("name", LAYERS)
def test_every_layer_states_its_job_in_its_first_line(name):
    (first, *_) = ast.get_docstring(ast.parse((ROOT / name).read_text())).splitlines()
    assert first == LAYERS[name]


def test_every_top_level_module_is_a_layer_or_beside_the_scripts():
    """A new shared file joins LAYERS (and pyproject.toml's py-modules, which an install needs)."""
    beside = {f"{name}.py" for name in ("sft", "plot", *NAMES)}
    assert {p.name for p in ROOT.glob("*.py")} == set(LAYERS) | beside
    modules = re.search(r"^py-modules = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert {name.strip(' "') for name in modules.split(",")} >= {name.removesuffix(".py") for name in LAYERS}


def test_no_file_of_the_project_is_over_the_bound():
    files = [*ROOT.glob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    lengths = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in files}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


def fork_marks(name: str) -> list[tuple[int, str]]:
    return [(int(k), text) for k, text in FORK_MARK.findall((ROOT / name).read_text())]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_marks_the_same_fork_places_in_order(name):
    first = fork_marks("gigpo.py")  # the script docs/new-algorithm.md forks
    assert [k for k, _ in first] == list(range(1, 7))
    assert fork_marks(name) == first
    page = (ROOT / "docs" / "new-algorithm.md").read_text()
    section = page[page.index("# To make a new algorithm") :].split("\n## ")[0]
    assert re.findall(r"^(\d)\. ", section, re.M) == [str(k) for k, _ in first], (
        "docs/new-algorithm.md lists every fork place"
    )


def fork_sections(name: str) -> dict[int, list[ast.stmt]]:
    """Fork place -> the top-level statements written under its mark (up to the next mark)."""
    text = (ROOT / name).read_text()
    starts = {text[: m.start()].count("\n") + 1: int(m.group(1)) for m in FORK_MARK.finditer(text)}
    sections = {k: [] for k in starts.values()}
    for node in ast.parse(text).body:
        above = [line for line in starts if line < node.lineno]
        if above:
            sections[starts[max(above)]].append(node)
    return sections


def defined(nodes: list[ast.stmt]) -> set[str]:
    names = {n.name for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return names | {t.id for n in nodes if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}


def takes_rt(node) -> bool:
    return isinstance(node, ast.FunctionDef) and [a.arg for a in node.args.args[:1]] == ["rt"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_fork_place_holds_the_same_kinds_of_things(name):
    """What the marks say, checked on what is written under them: 1 the name and constants, 2 Args and
    validate_args, 3 functions of trajectories and flags (nothing that takes the Runtime), 4 Runtime, the script's own
    policy_loss and ppo_update if it changes training.ppo_update's (and what else takes the Runtime to train), 5 the
    updates (`*_update(rt, ...) -> (metrics, samples)`) and their helpers, 6 main and its constants."""
    sections = fork_sections(name)
    assert not [n for n in sections[1] if isinstance(n, (ast.FunctionDef, ast.ClassDef))] and "ALGORITHM" in defined(
        sections[1]
    )
    assert defined(sections[2]) == {"Args", "validate_args"}
    assert not [n.name for n in sections[3] if takes_rt(n) or getattr(n, "name", "").endswith("_update")]
    assert "Runtime" in defined(sections[4])
    own_step = {"policy_loss", "ppo_update"} & defined(sections[4])
    assert own_step in (set(), {"policy_loss", "ppo_update"}), "a script that changes the training call writes both"
    assert own_step or "training.ppo_update(rt, " in (ROOT / name).read_text()
    assert all(takes_rt(n) for n in sections[4] if isinstance(n, ast.FunctionDef) and n.name != "policy_loss")
    updates = [n for n in sections[5] if isinstance(n, ast.FunctionDef) and n.name.endswith("_update")]
    assert updates and all(takes_rt(n) and ast.unparse(n.returns) == "tuple[dict, list[dict]]" for n in updates)
    assert not defined(sections[5]) & {"Runtime", "policy_loss", "ppo_update", "main"}
    assert defined(sections[6]) == {"RESUME_MAY_CHANGE", "POSTFIX_KEYS", "PRESETS", "main"}


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_speaks_the_one_vocabulary(name):
    """The shared concepts under their one name (docs/new-algorithm.md: Vocabulary); no flag keeps a renamed one."""
    fields = {field.name for field in dataclasses.fields(MODULES[name.removesuffix(".py")].Args)}
    assert {"max_turns", "group_size", "groups_per_update", "clip_eps", "clip_eps_high", "ppo_epochs"} <= fields
    assert not fields & set(harness.RENAMED_FLAGS)


def args_fields(tree: ast.Module, class_name: str) -> dict[str, tuple[str, str]]:
    """Field -> (type annotation, default) as written in the class."""
    (args,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    return {
        node.target.id: (ast.unparse(node.annotation), ast.unparse(node.value))
        for node in args.body
        if isinstance(node, ast.AnnAssign)
    }


def flags_the_layers_read() -> set[str]:
    """Every `args.<name>` (also `rt.args.<name>`, `self.args.<name>`) that the shared layers read."""

    def is_args(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "args") or (
            isinstance(node, ast.Attribute) and node.attr == "args"
        )

    trees = [ast.parse((ROOT / name).read_text()) for name in LAYERS]
    nodes = [node for tree in trees for node in ast.walk(tree)]
    return {node.attr for node in nodes if isinstance(node, ast.Attribute) and is_args(node.value)}


def test_every_flag_the_layers_read_is_declared_once_in_the_harness():
    shared = {field.name for field in dataclasses.fields(harness.PPOArgs)}  # SharedArgs' and PPOArgs' own
    read = flags_the_layers_read()
    assert {"model", "learning_rate", "sampler_url", "eval_only", "max_turn_tokens", "clip_eps"} <= read
    assert read <= shared


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_script_declares_only_its_algorithm_flags(name):
    """Its Args extends harness.SharedArgs (or PPOArgs); a shared flag it declares again changes only the default,
    with the same type (exp_name: the script's ALGORITHM)."""
    module = MODULES[name.removesuffix(".py")]
    assert issubclass(module.Args, harness.SharedArgs)
    harness_tree = ast.parse((ROOT / "harness.py").read_text())
    shared = args_fields(harness_tree, "SharedArgs") | args_fields(harness_tree, "PPOArgs")
    if not issubclass(module.Args, harness.PPOArgs):
        shared = args_fields(harness_tree, "SharedArgs")
    fields = args_fields(ast.parse((ROOT / name).read_text()), "Args")
    assert fields["exp_name"] == ("str", "ALGORITHM") and module.Args().exp_name == module.ALGORITHM
    for field in sorted(set(fields) & set(shared)):
        assert fields[field][0] == shared[field][0] and fields[field][1] != shared[field][1], (
            f"{name} declares the shared flag {field} as harness.py does: leave it to harness.py"
        )


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_update_function_reads_in_one_screen(name):
    tree = ast.parse((ROOT / name).read_text())
    updates = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {k: v for k, v in updates.items() if k.endswith("_update") and v > MAX_UPDATE_LINES} == {}


@pytest.mark.parametrize("name", SCRIPTS)
def test_main_holds_the_update_loop(name):
    tree = ast.parse((ROOT / name).read_text())
    (main,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    loops = [n for n in ast.walk(main) if isinstance(n, ast.For) and ast.unparse(n.iter) == "run.updates()"]
    assert len(loops) == 1
    body = ast.unparse(loops[0])
    assert all(call in body for call in ("run.gather(", "harness.evaluate(", "run.log(", "run.checkpoint("))


BENCHMARKS = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in (ROOT / "benchmarks").rglob("*.py")
    if '__name__ == "__main__"' in p.read_text() and p.stem != "confirmatory"  # it takes no flags: test_confirmatory
)


def test_the_benchmarks_with_a_command_line_are_found():
    assert {"benchmarks.speed.gpu", "benchmarks.speed.fsdp_memory", "benchmarks.learning.compare"} <= set(BENCHMARKS)


@pytest.mark.parametrize("module", BENCHMARKS)
def test_every_benchmark_imports_and_its_command_line_answers_help(module, monkeypatch, capsys):
    """The fast tier imports every file of the project: a benchmark whose own run is slow (or needs a GPU) still
    imports, and its flags parse, here."""
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # tyro reads __main__'s hints
    assert stop.value.code == 0 and "usage:" in capsys.readouterr().out
