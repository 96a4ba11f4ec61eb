import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
# vLLM's own default; importing trl (test_trl_peer.py, at collection) would otherwise set ERROR for every process the
# suite starts, and the vLLM tests read the engine's INFO lines (its start, the adapters a server loaded)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")

import torch  # noqa: E402

import common  # noqa: E402
import offline  # noqa: E402

TORCH_SET_NUM_THREADS = torch.set_num_threads


@pytest.fixture(autouse=True)
def restore_torch_set_num_threads():
    """An in-process vLLM CPU engine replaces torch.set_num_threads with a no-op for the rest of the process
    (vllm/v1/worker/cpu_worker.py, "doesn't allow ... after the thread binding"); give the next test the real one."""
    yield
    torch.set_num_threads = TORCH_SET_NUM_THREADS


def pytest_addoption(parser):
    parser.addoption(
        "--script",
        metavar="NAME",
        action="append",
        default=[],
        help="run only the tests of the algorithm script NAME.py: its own tests/test_NAME.py and the cases every "
        "script gets (layout, presets and config files, its docs page's commands, the training jobs), none of another "
        "script; given again, those of each NAME",
    )


def pytest_collection_modifyitems(config, items):
    """--script NAME: keep tests/test_NAME.py and the tests parametrized with that script (its name, NAME.py, its
    module, a pair holding it, or its docs page docs/NAME.md); deselect the rest."""
    names = config.getoption("--script")
    if not names:
        serve_together(items)
        return
    spellings = {spelling for name in names for spelling in (name, f"{name}.py", f"docs/{name}.md")}

    def names_it(value) -> bool:
        if isinstance(value, tuple):
            return any(names_it(v) for v in value)
        return (isinstance(value, str) and value in spellings) or getattr(value, "__name__", None) in names

    keep = [
        item
        for item in items
        if item.path.name in {f"test_{name}.py" for name in names}
        or (hasattr(item, "callspec") and any(map(names_it, item.callspec.params.values())))
    ]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
    serve_together(items)


def serve_together(items) -> None:
    """The tests that use the real vLLM server run one after the other, so that it is stopped after the last one
    (pytest_runtest_teardown) instead of idling through the rest of the session (its worker takes ~10% of a core):
    the modules that use it last, the one with the smallest share of such tests at the very end, and in each of them
    those tests first, otherwise in their order."""
    share = {}
    for item in items:
        share.setdefault(item.path, []).append(uses_the_server(item))
    share = {path: sum(flags) / len(flags) for path, flags in share.items()}
    modules = [path for path in share if not share[path]] + sorted(
        (p for p in share if share[p]), key=share.get, reverse=True
    )
    rank = {path: i for i, path in enumerate(modules)}
    items.sort(key=lambda item: (rank[item.path], not uses_the_server(item)))
    LAST_USER[:] = [item for item in items if uses_the_server(item)][-1:]


def uses_the_server(item) -> bool:
    """The `vllm` or `vllm_without_lora` fixture, asked for by name or (a test that needs it for one parameter only) by the
    vllm_server mark."""
    names = getattr(item, "fixturenames", ())
    return "vllm" in names or "vllm_without_lora" in names or item.get_closest_marker("vllm_server") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if LAST_USER and item is LAST_USER[0]:
        for server in SERVERS:  # the session fixtures' own stop at the end then has nothing left to do
            server.stop()


SERVERS = []  # the real vLLM servers the session started (the `vllm` fixture's and its companion's)
LAST_USER = []  # the last test of the session that uses them: they stop after it


@pytest.fixture(scope="session")
def games_root() -> Path:
    """A small generated game set in ALFWorld's download layout (every task type; tests copy it before they change
    it): the generator's first 12 games, made once into the home cache and shared with the suite's nested runs (the
    floors', the forks') and the learning test (offline.tiny_agent_games: the same games)."""
    return offline.tiny_agent_games()


@pytest.fixture(scope="session")
def all_games(games_root) -> list[str]:
    return sorted(str(p) for p in games_root.glob("json_2.1.1/*/*/*/game.tw-pddl"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return offline.build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def protocol(tokenizer):
    return common.ChatProtocol(tokenizer)


@pytest.fixture(scope="session")
def vllm_without_lora(tmp_path_factory):
    """The one extra real vLLM server (runtime loading allowed, --enable-lora missing), launched with `vllm` so that
    both come up at once (one core each); its test waits for it and stops it."""
    from benchmarks.vllm_cpu import VllmServer

    server = VllmServer("assets/tiny-agent", tmp_path_factory.mktemp("vllm") / "server.log", enable_lora=False)
    SERVERS.append(server)
    yield server.launch()
    server.stop()


@pytest.fixture(scope="session")
def vllm(tmp_path_factory, vllm_without_lora):
    """A real vLLM server (benchmarks/vllm_cpu.py: vllm-cpu in this venv, the one the trainer runs in) serving the tiny agent with runtime
    LoRA, started once per session (~1-2 min on 2 cores) and stopped with its children at the end. A path relative to
    the repo, as docs/vllm.md starts it; a 4k context: prefilling 8k tokens on CPU takes ~20 s."""
    from benchmarks.vllm_cpu import VllmServer

    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with VllmServer("assets/tiny-agent", log, max_model_len=4096) as server:
        SERVERS.append(server)
        yield server
