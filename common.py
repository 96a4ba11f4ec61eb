"""The env/replay helper: ALFWorld games, the fast env, saved states and replay restore, the chat protocol, rollouts.

Sections, in the order a reader needs them (search for the section's title):
  Games                      discovery in ALFWorld's layout, walkthroughs, the games without --data-root
                             (resolve_data_root), safe grammar evaluation
  Fast ALFWorld environment  parsed and translated once per process; snapshots and replay restore
  Saved states, env groups   SavedState (a mid-episode state), EnvGroup (N branches from one state)
  Chat protocol              token-in, token-out prompts, append-only across turns
  Batched multi-turn rollouts  rollout(): N branches per start state, H turns, through a SampleFn

The layers above it, each importing only those below: samplers.py (the model and the samplers, a SampleFn each),
training.py (the training step), harness.py (the job around a script's update loop); offline.py, below, makes the
games and models this machine cannot download.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import importlib.metadata
import io
import json
import os
import pickle
import random
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Sequence

import fast_downward
import textworld
import textworld.gym
import textworld.logic
from alfworld.agents.utils.misc import Demangler
from textworld.envs.pddl import logic as pddl_logic
from textworld.envs.pddl.textgen import (
    ConditionalSymbol,
    EvalSymbol,
    ListSymbol,
    NonterminalSymbol,
    TerminalSymbol,
)
from textworld.envs.pddl.textgen import (
    _parse_and_convert as _parse_symbols_uncached,
)
from textworld.generator.game import EntityInfo

import offline
from offline import TASK_TYPES

SPLITS = ("train", "valid_seen", "valid_unseen")


# =============================================================================================
# Games: discovery in ALFWorld's download layout, walkthroughs
# =============================================================================================
def discover_games(
    data_root: str | Path, split: str = "train", task_types: Sequence[str] | None = None, seed: int | None = None
) -> list[str]:
    """Game files of one split under `data_root/json_2.1.1/<split>/<task>/<trial>/game.tw-pddl`.

    Skips movable/Sliced tasks, unsolvable games and unknown task types. Sorted, then shuffled
    with `seed` when one is given (never with the global random state)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    unknown = set(task_types or ()) - set(TASK_TYPES)
    if unknown:
        raise ValueError(f"unknown task types {sorted(unknown)}; expected some of {TASK_TYPES}")
    split_dir = Path(data_root) / "json_2.1.1" / split
    if not split_dir.is_dir():
        raise FileNotFoundError(
            f"no ALFWorld games at {split_dir}. Download them with `alfworld-download` and pass its data "
            f"directory (the one holding json_2.1.1/, usually ~/.cache/alfworld) as --data-root, or leave "
            f"--data-root unset to use the generated offline games."
        )
    wanted = set(task_types or TASK_TYPES)
    games = []
    for game_file in sorted(split_dir.glob("*/*/game.tw-pddl")):
        task_dir = game_file.parent.parent.name
        if "movable" in task_dir or "Sliced" in task_dir:
            continue
        traj_file = game_file.parent / "traj_data.json"
        if not traj_file.is_file():
            continue
        if load_task_type(game_file) not in wanted:
            continue
        if not read_game_json(game_file).get("solvable", False):
            continue
        games.append(str(game_file))
    if not games:
        raise FileNotFoundError(
            f"no playable games found in {split_dir} for task types {sorted(wanted)}; is this an "
            f"`alfworld-download` data directory?"
        )
    if seed is not None:
        random.Random(seed).shuffle(games)
    return games


def eval_subset(data_root: str | Path, split: str, task_types: Sequence[str] | None, n: int | None) -> list[str]:
    """The n evaluation games of a split (None: all of them, in this order): the same in every run and script (a
    fixed seed, not the run's), every task type covered (n permitting) and in proportion: each type's games shuffled,
    then the i-th game of a type with m games ranked at i / m."""
    rng, by_type = random.Random(0), defaultdict(list)
    for game_file in discover_games(data_root, split, task_types):
        by_type[load_task_type(game_file)].append(game_file)
    types = sorted(by_type)
    rng.shuffle(types)  # who goes first among equal ranks
    ranked = []
    for order, task_type in enumerate(types):
        games = by_type[task_type]
        rng.shuffle(games)
        ranked += [(i / len(games), order, game) for i, game in enumerate(games)]
    return [game for *_, game in sorted(ranked)[:n]]


class BadGameError(ValueError):
    """A game file (or its traj_data.json) that cannot be read, parsed or loaded; the message names the file."""


def read_game_json(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise BadGameError(f"{path}: unreadable ({type(error).__name__}: {error})") from error
    if not isinstance(data, dict):
        raise BadGameError(f"{path}: expected a JSON object")
    return data


def check_games(game_files: Sequence[str | Path]) -> None:
    """Read and parse every game (JSON, task type, PDDL domain and problem: ~2 ms a game) so that a bad one fails
    at start, named; translating (0.4 s a game) waits for the game's first use."""
    argv = sys.argv  # importing the translator parses sys.argv
    try:
        sys.argv = ["translate.py", "domain", "task"]
        from fast_downward.translate.pddl_parser import lisp_parser, parsing_functions
    finally:
        sys.argv = argv
    for game_file in game_files:
        load_task_type(game_file)
        data = read_game_json(game_file)
        missing = [key for key in ("pddl_domain", "pddl_problem", "grammar") if not isinstance(data.get(key), str)]
        if missing:
            raise BadGameError(f"{game_file}: bad game (no {', '.join(missing)})")
        try:
            domain = lisp_parser.parse_nested_list(data["pddl_domain"].split("\n"))
            problem = lisp_parser.parse_nested_list(data["pddl_problem"].split("\n"))
            with contextlib.redirect_stdout(io.StringIO()):
                parsing_functions.parse_task(domain, problem)
        except Exception as error:  # the parser raises bare exceptions of many kinds
            raise BadGameError(f"{game_file}: bad game ({type(error).__name__}: {error})") from error


def load_walkthrough(game_file: str | Path) -> list[str]:
    """The expert actions stored in the game file: privileged information, never shown to the actor."""
    return list(read_game_json(game_file).get("walkthrough") or [])


def load_task_type(game_file: str | Path) -> str:
    traj_file = Path(game_file).parent / "traj_data.json"
    task_type = read_game_json(traj_file).get("task_type")
    if not isinstance(task_type, str):
        raise BadGameError(f"{traj_file}: no task_type")
    return task_type


def resolve_data_root(data_root: str | None, model: str) -> str:
    """--data-root as given; unset: a tiny agent's own games (--model tiny-agent..., or the path to its shipped
    weights), else the offline game set."""
    if data_root:
        return data_root
    agent = offline.tiny_agent_name(model)
    return str(offline.tiny_agent_games(name=agent) if agent else offline.default_data_root())


# =============================================================================================
# Safe evaluation of grammar expressions
# =============================================================================================
class UnsafeGrammarError(ValueError):
    """A game file's grammar holds an expression outside the safe subset; nothing of it was run."""


def _compile_grammar_expression(expression: str, game_file: str) -> Callable[[dict], object]:
    """Compile `{...}` grammar code into a closure over the context variables.

    TextWorld runs these with `eval()` and full builtins. Grammars only use variable names,
    attributes without underscores, string literals, `+` and `or`; anything else is refused."""

    def refuse(why: str):
        raise UnsafeGrammarError(f"{game_file}: grammar expression {expression!r} refused ({why})")

    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError as error:
        refuse(f"not an expression: {error.msg}")

    def build(node):
        if isinstance(node, ast.Name):
            if "_" in node.id:
                refuse(f"name {node.id!r} contains an underscore")
            name = node.id
            return lambda variables: variables[name]
        if isinstance(node, ast.Attribute):
            if "_" in node.attr:
                refuse(f"attribute {node.attr!r} contains an underscore")
            inner, attr = build(node.value), node.attr
            return lambda variables: getattr(inner(variables), attr)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            return lambda variables: value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = build(node.left), build(node.right)
            return lambda variables: left(variables) + right(variables)
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            parts = [build(value) for value in node.values]

            def either(variables):
                for part in parts[:-1]:
                    value = part(variables)
                    if value:
                        return value
                return parts[-1](variables)

            return either
        refuse(f"{type(node).__name__} is not allowed")

    return build(tree)


# =============================================================================================
# Fast ALFWorld environment
#
# TextWorld's PddlEnv re-runs Fast Downward's translator twice on every reset, re-parses every
# grammar string with TatSu on every step, and deep-copies the text-generation context per symbol.
# Here a game is parsed and translated once per process, strings are parsed once, contexts are
# shared (never mutated), and a reset is a restore of the initial state. Text out is identical.
# =============================================================================================
@functools.lru_cache(maxsize=4096)
def _parse_symbols(text: str) -> tuple:
    return tuple(_parse_symbols_uncached(text, rule_name="symbols"))


@functools.lru_cache(maxsize=4096)
def _parse_query(expression: str) -> textworld.logic.Rule:
    return textworld.logic.Rule.parse_conjunctive_query(expression)


PLAN_CACHE_SIZE = 4096  # planner results kept per parsed game (AlfredEnv.expert_plan)


TRANSLATIONS = offline.DEFAULT_CACHE_DIR / "translations"
TRANSLATED_BY = "\0".join(importlib.metadata.version(n) for n in ("textworld", "fast_downward_textworld"))


def translated(data: dict) -> tuple:
    """(GameLogic, task, sas, sas_replan) of a game: TatSu's parse of its domain and grammar and Fast Downward's
    translations of its problem, ~1.5 s a game and the same in every process, so kept in the cache (pickled, ~2 ms
    to read back) keyed by their texts and the two packages' versions. A file that cannot be read back is remade."""
    texts = (data["pddl_domain"], data["grammar"], data["pddl_problem"], TRANSLATED_BY)
    path = TRANSLATIONS / f"{hashlib.sha256(chr(0).join(texts).encode()).hexdigest()[:32]}.pickle"
    with contextlib.suppress(Exception):  # missing, torn or made by another version of a class: remade below
        return pickle.loads(path.read_bytes())
    logic = pddl_logic.GameLogic(domain=data["pddl_domain"], grammar=data["grammar"])
    argv = sys.argv  # the translator overwrites sys.argv
    try:
        task, sas = fast_downward.pddl2sas(logic.domain, data["pddl_problem"])
        _, sas_replan = fast_downward.pddl2sas(logic.domain, data["pddl_problem"], optimize=True)
    finally:
        sys.argv = argv
    with contextlib.suppress(OSError):  # a read-only cache costs only the time
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_bytes(pickle.dumps((logic, task, sas, sas_replan), protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(tmp, path)
    return logic, task, sas, sas_replan


class _Game:
    """Everything about one game file that does not change while playing it (shared by branches)."""

    def __init__(self, game_file: str):
        self.game_file = game_file
        data = read_game_json(game_file)
        self.walkthrough = list(data.get("walkthrough") or [])
        self.logic, self.task, self.sas, self.sas_replan = translated(data)
        self.rules = dict(self.logic.grammar._rules)
        self.conditions = {
            id(rule): _parse_query(rule.condition) for rules in self.rules.values() for rule in rules if rule.condition
        }
        self.expressions: dict[str, Callable] = {}
        for rules in self.rules.values():
            for rule in rules:
                self._compile_symbols(rule.rhs)
        for action in self.logic.actions.values():
            self._compile_symbols(_parse_symbols(action.template))
        self.problem = data["pddl_problem"]
        self.actions = {action.name: action for action in self.task.actions}
        self.name2type = {obj.name: obj.type_name for obj in self.task.objects}
        for type_ in self.task.types:
            try:
                self.logic.types.add(textworld.logic.Type(type_.name, type_.supertype_names))
            except ValueError:
                pass
        self.entity_infos = None  # filled from the first state (needs the planner library)
        self.plans: dict[frozenset, list[str]] = {}  # state facts -> optimal plan (AlfredEnv.expert_plan)

    def _compile_symbols(self, symbols):
        for symbol in symbols:
            if isinstance(symbol, ListSymbol):
                self._compile_symbols([symbol.symbol])
            elif isinstance(symbol, ConditionalSymbol):
                self._compile_symbols([symbol.expression])
            elif isinstance(symbol, EvalSymbol) and symbol.expression not in self.expressions:
                self.expressions[symbol.expression] = _compile_grammar_expression(symbol.expression, self.game_file)

    def derive(self, start: str, state, mapping: dict, variables: dict) -> str:
        """Expand a grammar string exactly like TextWorld's ContextSensitiveGrammar.derive."""
        stack = [(symbol, mapping, variables) for symbol in reversed(_parse_symbols(start))]
        out = []
        while stack:
            symbol, mapping, variables = stack.pop()
            if isinstance(symbol, TerminalSymbol):
                out.append(str(symbol.symbol))
            elif isinstance(symbol, NonterminalSymbol):
                stack.extend(
                    (s, mapping, variables) for s in reversed(self._choose_rule(symbol.symbol, state, mapping))
                )
            elif isinstance(symbol, ConditionalSymbol):
                stack.extend(
                    (symbol.expression, m, v) for m, v in reversed(self._query(symbol, state, mapping, variables))
                )
            elif isinstance(symbol, EvalSymbol):
                out.append(str(self._evaluate(symbol.expression, variables)))
            elif isinstance(symbol, ListSymbol):
                items = [
                    (symbol.symbol.expression, m, v) for m, v in self._query(symbol.symbol, state, mapping, variables)
                ]
                if not items:
                    items = [(NonterminalSymbol("list_empty"), mapping, variables)]
                elif len(items) > 1:
                    separator = (NonterminalSymbol("list_separator"), mapping, variables)
                    last = (NonterminalSymbol("list_last_separator"), mapping, variables)
                    joined = []
                    for item in items[:-1]:
                        joined += [item, separator]
                    items = joined[:-1] + [last, items[-1]]
                stack.extend(reversed(items))
            else:
                raise TypeError(f"unknown grammar symbol {symbol!r} in {self.game_file}")
        return "".join(out)

    def _evaluate(self, expression: str, variables: dict):
        if expression not in self.expressions:  # e.g. an action template never seen at load
            self.expressions[expression] = _compile_grammar_expression(expression, self.game_file)
        return self.expressions[expression](variables)

    def _choose_rule(self, name: str, state, mapping: dict) -> list:
        rules = self.rules.get(name)
        if not rules:
            raise KeyError(f"grammar symbol #{name}# missing in {self.game_file}")
        for rule in rules:
            condition = self.conditions.get(id(rule))
            if condition is None or next(iter(state.all_assignments(condition, mapping)), None) is not None:
                return rule.rhs
        raise IndexError(f"no applicable rule for #{name}# in {self.game_file}")

    def _query(self, symbol: ConditionalSymbol, state, mapping: dict, variables: dict) -> list[tuple[dict, dict]]:
        if not symbol.given:
            return [(mapping, variables)]
        contexts = []
        for assignment in state.all_assignments(_parse_query(symbol.given), mapping):
            new_variables = {ph.name: self.entity_infos[var.name] for ph, var in assignment.items()}
            contexts.append(({**mapping, **assignment}, {**variables, **new_variables}))
        return contexts


@functools.lru_cache(maxsize=256)
def _load_game(game_file: str, mtime_ns: int) -> _Game:
    return _Game(game_file)


def load_game(game_file: str | Path) -> _Game:
    """Parsed and translated game, cached per process (keyed by path and modification time)."""
    game_file = str(game_file)
    try:
        return _load_game(game_file, os.stat(game_file).st_mtime_ns)
    except (BadGameError, UnsafeGrammarError):
        raise
    except Exception as error:  # parser and translator errors come in many kinds; say which game
        raise BadGameError(f"{game_file}: cannot load the game ({type(error).__name__}: {error})") from error


_FREE_PLANNER_LIBRARIES: list = []


def _acquire_planner_library():
    """A private copy of Fast Downward's library (it keeps its state in globals). Closed envs return
    theirs for reuse: unloading a library that has loaded a task crashes the next load."""
    if _FREE_PLANNER_LIBRARIES:
        return _FREE_PLANNER_LIBRARIES.pop()
    lib = fast_downward.load_lib()
    lib.get_state_id.restype = ctypes.c_int
    lib.set_state_id.argtypes = [ctypes.c_int]
    return lib


@dataclasses.dataclass
class Turn:
    """What the game shows after a reset or a step."""

    observation: str
    admissible: list[str]
    won: bool
    moves: int
    actions: dict = dataclasses.field(default_factory=dict, repr=False)  # command -> planner action
    operators: dict = dataclasses.field(default_factory=dict, repr=False)
    state: frozenset = dataclasses.field(default=frozenset(), repr=False)  # the facts that hold: equal iff same state


@dataclasses.dataclass
class EnvSnapshot:
    """In-process state of an AlfredEnv: valid only for the env that made it, in this process."""

    state_id: int
    facts: dict
    vars_by_name: dict
    vars_by_type: dict
    var_counts: Counter
    turn: Turn
    actions: tuple[str, ...] = ()  # commands since reset (filled in by EnvGroup: its rebuild replays them)


class AlfredEnv:
    """One ALFWorld game played on Fast Downward + TextWorld's grammar, with O(1) snapshot/restore."""

    def __init__(self, game_file: str | Path):
        self.game = load_game(game_file)
        self.game_file = self.game.game_file
        self._lib = _acquire_planner_library()
        self._lib.load_sas(self.game.sas.encode("utf-8"))
        self._lib.load_sas_replan(self.game.sas_replan.encode("utf-8"))
        self._state = self._initial_pddl_state()
        if self.game.entity_infos is None:
            self.game.entity_infos = self._entity_infos()
        self.turn = self._gather(self._derive("#intro#", {}), 0)
        self._initial = self.snapshot()

    def _initial_pddl_state(self):
        """PddlState.__init__ without re-running the translator."""
        game, state = self.game, pddl_logic.PddlState.__new__(pddl_logic.PddlState)
        state._facts, state._vars_by_name = defaultdict(set), {}
        state._vars_by_type, state._var_counts = defaultdict(set), Counter()
        state._logic, state.downward_lib, state.pddl_problem = game.logic, self._lib, game.problem
        state.task, state.sas, state.sas_replan = game.task, game.sas, game.sas_replan
        state._actions, state.name2type = game.actions, game.name2type

        def proposition(name, args):
            return textworld.logic.Proposition(name, [textworld.logic.Variable(a, game.name2type[a]) for a in args])

        for atom in game.task.init:
            if isinstance(atom, fast_downward.translate.pddl.conditions.Atom) and atom.predicate != "=":
                state.add_fact(proposition(atom.predicate, atom.args))
            elif (
                isinstance(atom, fast_downward.translate.pddl.f_expression.Assign)
                and atom.fluent.symbol != "total-cost"
            ):
                if not str(atom.expression.value).isdigit():  # distances are not facts
                    state.add_fact(proposition(str(atom.expression.value), atom.fluent.args))
        atoms = (pddl_logic.Atom * self._lib.get_state_size())()
        self._lib.get_state(atoms)
        state.add_facts(fact for fact in (atom.get_fact(game.name2type) for atom in atoms) if not fact.is_negation)
        return state

    def _entity_infos(self) -> dict:
        infos = {}
        for fact in self._state.facts:
            for var in fact.arguments:
                info = EntityInfo(var.name, var.type)
                info.name, info.definite, info.indefinite = var.name, "the", "a"
                infos[var.name] = info
        demangler = Demangler(game_infos=infos, shuffle=False)  # as ALFWorld's AlfredDemangler
        for info in infos.values():
            info.name = demangler.demangle_alfred_name(info.id)
        return infos

    def reset(self) -> Turn:
        return self.restore(self._initial)

    def step(self, command: str) -> Turn:
        """Apply a command; one that is not admissible gives "Nothing happens." and changes nothing."""
        action = self.turn.actions.get(command.strip())
        if action is None:
            self.turn = self._gather("Nothing happens.", self.turn.moves)
        else:
            self._state.apply(action)
            self.turn = self._gather(self._derive(action.feedback_rule, action.mapping), self.turn.moves + 1)
        return self.turn

    def expert_plan(self) -> list[str]:
        """Fast Downward's optimal plan from the current state, as commands ([] once won or when the goal is
        unreachable). Privileged: for scripted experts and oracle labels, never for the actor. Cached per game
        and state, so replaying a known state costs a lookup."""
        key = frozenset(self._state.facts)
        if key not in self.game.plans:
            argv = sys.argv  # the planner's translator may overwrite sys.argv
            try:
                self.game.plans[key] = [] if self.turn.won else self._state.replan(self.game.entity_infos)
            finally:
                sys.argv = argv
            if len(self.game.plans) > PLAN_CACHE_SIZE:  # oldest first: a long oracle-labelled run visits many states
                del self.game.plans[next(iter(self.game.plans))]
        return list(self.game.plans[key])

    def _derive(self, start: str, mapping: dict) -> str:
        variables = {ph.name: self.game.entity_infos[var.name] for ph, var in mapping.items()}
        return self.game.derive(start, self._state, mapping, variables)

    def _gather(self, feedback: str, moves: int) -> Turn:
        names = {key: info.name for key, info in self.game.entity_infos.items()}
        actions = {}
        for action in self._state.all_applicable_actions():
            action.command_template = self._derive(action.command_template, action.mapping)
            actions.setdefault(action.format_command(names), action)
        won = bool(self._state.check_goal())
        state = frozenset(fact for fact in self._state.facts if not fact.is_negation)  # not_* facts record the path
        return Turn(feedback, sorted(actions), won, moves, actions, self._state._operators, state)

    def snapshot(self) -> EnvSnapshot:
        state = self._state
        return EnvSnapshot(
            state_id=self._lib.get_state_id(),
            facts={sig: set(facts) for sig, facts in state._facts.items()},
            vars_by_name=dict(state._vars_by_name),
            vars_by_type={t: set(v) for t, v in state._vars_by_type.items()},
            var_counts=Counter(state._var_counts),
            turn=self.turn,
        )

    def restore(self, snapshot: EnvSnapshot) -> Turn:
        state = self._state
        self._lib.set_state_id(snapshot.state_id)
        state._facts = defaultdict(set, {sig: set(facts) for sig, facts in snapshot.facts.items()})
        state._vars_by_name = dict(snapshot.vars_by_name)
        state._vars_by_type = defaultdict(set, {t: set(v) for t, v in snapshot.vars_by_type.items()})
        state._var_counts = Counter(snapshot.var_counts)
        self.turn = snapshot.turn
        state._operators = self.turn.operators
        return self.turn

    def close(self, reuse_library: bool = True):
        if self._lib is not None and reuse_library:
            _FREE_PLANNER_LIBRARIES.append(self._lib)
        self._lib = None


def oracle_step_flags(traj: Trajectory) -> list[bool]:
    """Privileged judgment of every step: GOOD when it shortened the planner's optimal remaining plan (the winning
    step included), BAD otherwise (an invalid, inadmissible, useless or harmful step)."""
    env = AlfredEnv(traj.start.game_file)
    try:
        env.reset()
        for action in traj.start.actions:
            env.step(action)

        def remaining() -> float:
            plan = env.expert_plan()
            return 0 if env.turn.won else len(plan) or float("inf")  # [] and not won: the goal became unreachable

        before, flags = remaining(), []
        for step in traj.steps:
            if step.action is not None:
                env.step(step.action)
            after = remaining()
            flags.append(after < before)
            before = after
        return flags
    finally:
        env.close()


# =============================================================================================
# Saved states, env groups, replay restore
# =============================================================================================
class ReplayMismatchError(RuntimeError):
    """Replaying a saved action history did not reproduce the saved observation."""


@dataclasses.dataclass
class SavedState:
    """A point in an episode, as plain data (JSON-serialisable, valid in any process)."""

    game_file: str
    seed: int
    actions: list[str]  # commands sent to the env since reset (invalid-format turns send none)
    messages: list[dict]  # the chat so far, for reading; the model consumes `prefix_tokens`
    prefix_tokens: list[int]  # prompt for the next turn, token-exact
    round_index: int  # turns taken since reset (invalid-format turns count)
    observation: str
    admissible: list[str]
    task: str = ""
    prefix_step_ids: list[int] = dataclasses.field(default_factory=list)  # -1 context, k = turn k's tokens
    prefix_logprobs: list[float] = dataclasses.field(default_factory=list)  # sampling logprobs (0 on context)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "SavedState":
        return cls(**json.loads(text))


class EnvGroup:
    """N branches of one game. They share one planner library but never state: each branch is a
    snapshot that is restored (O(1)) before it steps, so branches are independent copies. If the
    engine fails, the group rebuilds itself from the branches' action histories and carries on."""

    def __init__(self, game_file: str | Path, num_branches: int):
        if num_branches < 1:
            raise ValueError(f"num_branches must be >= 1, got {num_branches}")
        self.env = AlfredEnv(game_file)
        self.game_file = self.env.game_file
        self.recoveries = 0
        self.env.reset()
        self._branches = [self.env.snapshot()] * num_branches

    @property
    def num_branches(self) -> int:
        return len(self._branches)

    @property
    def turns(self) -> list[Turn]:
        return [snapshot.turn for snapshot in self._branches]

    def reset(self) -> list[Turn]:
        self.env.reset()
        self._branches = [self.env.snapshot()] * self.num_branches
        return self.turns

    def step(self, commands: Sequence[str | None]) -> list[Turn]:
        """One command per branch; None leaves that branch where it is."""
        if len(commands) != self.num_branches:
            raise ValueError(f"expected {self.num_branches} commands, got {len(commands)}")
        for branch, command in enumerate(commands):
            if command is None:
                continue
            try:
                self._step_branch(branch, command)
            except ReplayMismatchError:
                raise
            except Exception as error:  # the engine broke: rebuild it, then retry once
                print(
                    f"[EnvGroup] {self.game_file}: engine failed ({error!r}); rebuilding from action histories",
                    file=sys.stderr,
                )
                self._rebuild()
                self._step_branch(branch, command)
        return self.turns

    def _step_branch(self, branch: int, command: str):
        before = self._branches[branch]
        self.env.restore(before)
        self.env.step(command)
        self._branches[branch] = dataclasses.replace(self.env.snapshot(), actions=before.actions + (command,))

    def _rebuild(self):
        """A fresh env (the failed planner library is dropped, never reused); every branch replayed."""
        self.env.close(reuse_library=False)
        self.env = AlfredEnv(self.game_file)
        self._branches = [self._replay(b.actions, b.turn.observation, b.turn.admissible) for b in self._branches]
        self.recoveries += 1

    def _replay(self, actions: Sequence[str], observation: str, admissible: Sequence[str]) -> EnvSnapshot:
        turn = self.env.reset()
        for command in actions:
            turn = self.env.step(command)
        if turn.observation != observation or turn.admissible != list(admissible):
            raise ReplayMismatchError(
                f"{self.game_file}: replaying {len(actions)} actions gave observation {turn.observation!r} "
                f"(saved: {observation!r}); admissible lists {'match' if turn.admissible == list(admissible) else 'differ'}"
            )
        return dataclasses.replace(self.env.snapshot(), actions=tuple(actions))

    def snapshot(self, branch: int) -> EnvSnapshot:
        return self._branches[branch]

    def restore_snapshot(self, branch: int, snapshot: EnvSnapshot) -> Turn:
        """O(1) in-process restore of a snapshot taken from this group."""
        self._branches[branch] = snapshot
        return snapshot.turn

    def restore(self, state: SavedState) -> Turn:
        """Portable restore: replay the action history from reset into every branch and check the
        observation and admissible commands word for word. Raises ReplayMismatchError."""
        if Path(state.game_file).resolve() != Path(self.game_file).resolve():
            raise ValueError(f"state is for {state.game_file}, this group plays {self.game_file}")
        self._branches = [self._replay(state.actions, state.observation, state.admissible)] * self.num_branches
        return self._branches[0].turn

    def close(self):
        self.env.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# =============================================================================================
# Chat protocol: token-in, token-out
# =============================================================================================
SYSTEM_PROMPT = (
    "You are an agent in a household text game (ALFWorld). Each turn, reason briefly if it helps, then end "
    "your reply with exactly one call of the alfworld_step tool carrying the single action to take."
)
ALFWORLD_TOOL = {
    "type": "function",
    "function": {
        "name": "alfworld_step",
        "description": "Take one action in the game, e.g. 'go to cabinet 1' or 'take mug 1 from countertop 2'.",
        "parameters": {
            "type": "object",
            "properties": {"action": {"type": "string", "description": "The action, as a short command."}},
            "required": ["action"],
        },
    },
}
STATUS_EXECUTED, STATUS_NOT_ADMISSIBLE, STATUS_INVALID = "executed", "not admissible", "invalid format"
STATUS_WON, STATUS_OVER = "won", "episode over"


def tool_call(action: str) -> str:
    """The reply that calls alfworld_step with `action` in Qwen2.5's tool-call format (what parse_action reads):
    scripted experts and tests write replies with it."""
    return '<tool_call>\n{"name": "alfworld_step", "arguments": ' + json.dumps({"action": action}) + "}\n</tool_call>"


def parse_action(text: str) -> str | None:
    """The action of the single alfworld_step tool call that ends `text`, lowercased with whitespace
    collapsed; None for zero or several calls, text after the call, another tool, or an empty or
    multi-line action. JSON (Qwen2.5/3) and XML (Qwen3.5) forms. Linear time; never raises."""
    if not isinstance(text, str):
        return None
    body = text.rstrip()
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    if not body.endswith(close_tag) or body.count(open_tag) != 1 or body.count(close_tag) != 1:
        return None
    inner = body[body.find(open_tag) + len(open_tag) : -len(close_tag)].strip()
    action = None
    if inner.startswith("{"):
        try:
            call = json.loads(inner, strict=False)  # models emit raw tabs inside strings
            arguments = (
                call.get("arguments") if isinstance(call, dict) and call.get("name") == "alfworld_step" else None
            )
            if isinstance(arguments, str):
                arguments = json.loads(arguments, strict=False)
            if isinstance(arguments, dict) and isinstance(arguments.get("action"), str):
                action = arguments["action"]
        except (ValueError, RecursionError):
            return None
    else:
        head, param_open = "<function=alfworld_step>", "<parameter=action>"
        if inner.startswith(head) and inner.endswith("</function>"):
            params = inner[len(head) : -len("</function>")].strip()
            single = params.count("<parameter=") == 1 and params.count("</parameter>") == 1
            if single and params.startswith(param_open) and params.endswith("</parameter>"):
                action = params[len(param_open) : -len("</parameter>")]
    if action is None:
        return None
    action = action.strip()
    if not action or "\n" in action or "\r" in action:
        return None
    return " ".join(action.split()).lower()


def extract_task(observation: str) -> str:
    """The task sentence of ALFWorld's first observation ("Your task is to: ...")."""
    match = re.search(r"Your task is to: (.*)", observation)
    return match.group(1).strip() if match else ""


class TemplateNotAppendOnlyError(ValueError):
    """The chat template re-renders turns it already showed the model, so prompts cannot grow token by token."""


class ChatProtocol:
    """Renders the agent's chat as token deltas: prompt(t+1) = prompt(t) + completion tokens as sampled
    + the template's assistant closing + the tool message + the generation prompt. History is never
    re-tokenised, so extending a prompt costs the same at turn 1 and turn 500.

    The deltas come from renders where the reply is not the last message, as in the chat: a template may render a
    last reply differently (Qwen3's empty think block). Every prompt is what the model was shown; it equals the
    template's full render of the chat except that each earlier reply follows the generation prompt the model saw
    (Qwen3 with enable_thinking=False: an empty think block that full renders drop). A template that rewrites other
    history (e.g. drops old <think> blocks) is refused at start."""

    _ASSISTANT, _TOOL = "[[assistant reply]]", "[[tool result]]"  # markers no template trims or escapes

    def __init__(
        self,
        tokenizer,
        show_admissible: bool = True,
        system_prompt: str = SYSTEM_PROMPT,
        enable_thinking: bool = True,
    ):
        from jinja2 import TemplateError

        self.tokenizer, self.show_admissible, self.system_prompt = tokenizer, show_admissible, system_prompt
        self.enable_thinking = enable_thinking
        self.eos_token_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token or ""
        head = [{"role": "system", "content": system_prompt}, {"role": "user", "content": "U"}]
        turn = [{"role": "assistant", "content": self._ASSISTANT}, {"role": "tool", "content": self._TOOL}]
        try:
            before, after = self.render(head), self.render(head + turn)
            prompt, next_prompt = self.render(head, True), self.render(head + turn, True)
            switch_ignored = not enable_thinking and prompt == self.render(head, True, enable_thinking=True)
        except (TemplateError, TypeError, ValueError) as error:
            raise ValueError(
                f"the chat template cannot render a chat of system, user, assistant and tool messages ({error}); "
                "pass --chat-template FILE with one that can"
            ) from error
        if switch_ignored:
            raise ValueError("--no-enable-thinking: the chat template has no enable_thinking switch")
        self.generation_prompt = prompt[len(before) :]
        turn_text = after[len(before) :]
        if not (
            prompt.startswith(before)
            and next_prompt == after + self.generation_prompt
            and after.startswith(before)
            and turn_text.count(self._ASSISTANT) == 1
            and turn_text.count(self._TOOL) == 1
            and turn_text.index(self._ASSISTANT) < turn_text.index(self._TOOL)
        ):
            self._refuse("does not render a reply and a tool message after the earlier turns, each verbatim")
        self.opening, rest = turn_text.split(self._ASSISTANT)
        self.tool_head, tool_tail = rest.split(self._TOOL)  # tool_head: the assistant closing + the tool turn's head
        self.tool_tail = tool_tail + self.generation_prompt
        self._check_history(head)

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **kwargs) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=[ALFWORLD_TOOL],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **{"enable_thinking": self.enable_thinking, **kwargs},
        )

    def _refuse(self, what: str):
        raise TemplateNotAppendOnlyError(
            f"the chat template {what}, so prompts cannot be extended token by token; pass --chat-template FILE "
            "with a template that renders history as the model was shown it (docs/environment.md#chat-templates)"
        )

    def _check_history(self, head: list[dict]):
        """A multi-turn chat with reasoning blocks, built by the deltas, must be the template's full render with each
        reply after the generation prompt the model saw (templates that drop old <think> blocks fail here)."""
        replies = ["<think>\nfirst\n</think>\n\nA1", "<think>\nsecond\n</think>\n\nA2", "A3"]
        messages, shown = list(head), self.render(head, add_generation_prompt=True)
        for turn, reply in enumerate(replies):
            messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": f"T{turn}"}]
            shown += reply + self.tool_head + f"T{turn}" + self.tool_tail
        full = self.render(messages, add_generation_prompt=True)
        for reply in replies:
            full = full.replace(self.opening + reply, self.generation_prompt + reply)
        if full != shown:
            self._refuse("rewrites turns it already showed the model (e.g. drops old <think> blocks)")

    def user_message(self, observation: str, admissible: Sequence[str]) -> str:
        return observation + self._admissible_text(admissible)

    def tool_message(self, status: str, observation: str, admissible: Sequence[str]) -> str:
        return f"Status: {status}\nObservation: {observation}" + self._admissible_text(admissible)

    def _admissible_text(self, admissible: Sequence[str]) -> str:
        return "\nAdmissible actions: " + ", ".join(admissible) if self.show_admissible else ""

    def initial(self, observation: str, admissible: Sequence[str]) -> tuple[list[int], list[dict]]:
        """Prompt tokens and messages of the first turn."""
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": self.user_message(observation, admissible)},
        ]
        return self.encode(self.render(messages, add_generation_prompt=True)), messages

    def delta(self, completion_tokens: Sequence[int], tool_content: str) -> list[int]:
        """Tokens that follow a sampled completion: assistant closing + tool message + generation prompt."""
        head = self.tool_head
        if completion_tokens and completion_tokens[-1] == self.eos_token_id and head.startswith(self.eos_text):
            head = head[len(self.eos_text) :]  # the model already emitted the end-of-turn token
        return self.encode(head + tool_content + self.tool_tail)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


# =============================================================================================
# Batched multi-turn rollouts
# =============================================================================================
@dataclasses.dataclass
class Completion:
    """What `sample_fn` returns per prompt: the sampled tokens, their logprobs, the decoded text."""

    tokens: list[int]
    logprobs: list[float]
    text: str


# The sampler seam: prompts (token ids) and a new-token budget in, one Completion per prompt out. A sampler may also
# have end_rollout(): rollout() calls it when every branch has stopped (GenerateSampler frees its kept KV caches).
SampleFn = Callable[[list[list[int]], int], list[Completion]]


def completion_cut_at_stop(tokens: list[int], logprobs: list[float], stops: Sequence[int], tokenizer) -> Completion:
    """A sampled reply cut after its first stop token (a reply that ends in any of them has ended)."""
    end = next((i + 1 for i, token in enumerate(tokens) if token in stops), len(tokens))
    return Completion(tokens[:end], logprobs[:end], tokenizer.decode(tokens[:end], skip_special_tokens=True))
# ALFWorld's env is done exactly when the game is won (TextWorld never reports a loss), so "won" is its done.
STOP_WON, STOP_MAX_STEPS, STOP_HORIZON, STOP_TOKEN_BUDGET = "won", "max_steps", "horizon", "token_budget"
STOP_REASONS = (STOP_WON, STOP_MAX_STEPS, STOP_HORIZON, STOP_TOKEN_BUDGET)


@dataclasses.dataclass
class StepRecord:
    prompt_length: int  # tokens before this step's completion
    completion_tokens: list[int]
    logprobs: list[float]
    text: str
    action: str | None  # None: invalid format, env not advanced
    observation: str
    reward: float
    won: bool
    valid: bool
    admissible: bool
    admissible_actions: list[str]
    state: frozenset = frozenset()  # the engine state the step was taken from (Turn.state)


@dataclasses.dataclass
class Trajectory:
    """One branch of one rollout group, from its start state to its stop."""

    start: SavedState
    group: int
    branch: int
    tokens: list[int]  # the next turn's prompt: start prefix + everything since
    step_ids: list[int]  # per token: -1 context (start prefix included), k = generated at step k
    logprobs: list[float]  # per token: sampling logprob, 0 on context
    messages: list[dict]
    actions: list[str]
    turn: Turn
    steps: list[StepRecord] = dataclasses.field(default_factory=list)
    stop_reason: str | None = None
    sequence_end: int = 0  # end of the last completion
    version: int = 0  # --async-steps: the weights (updates trained) whose adapter sampled every turn of it

    @property
    def round_index(self) -> int:
        return self.start.round_index + len(self.steps)

    @property
    def won(self) -> bool:
        return bool(self.steps) and self.steps[-1].won

    @property
    def reward(self) -> float:
        return sum(step.reward for step in self.steps)

    def sequence(self) -> tuple[list[int], list[float], list[int]]:
        """(tokens, old_logprobs, step_ids) up to the end of the last completion: the training datum."""
        end = self.sequence_end
        return self.tokens[:end], self.logprobs[:end], self.step_ids[:end]

    def saved_state(self) -> SavedState:
        """Where this branch stands now, as plain data (the next turn's prompt included)."""
        base = self.start.round_index
        prefix_step_ids = self.start.prefix_step_ids + [
            k + base if k >= 0 else -1 for k in self.step_ids[len(self.start.prefix_tokens) :]
        ]
        prefix_logprobs = self.start.prefix_logprobs + self.logprobs[len(self.start.prefix_tokens) :]
        return SavedState(
            game_file=self.start.game_file,
            seed=self.start.seed,
            actions=list(self.actions),
            messages=list(self.messages),
            prefix_tokens=list(self.tokens),
            round_index=self.round_index,
            observation=self.turn.observation,
            admissible=list(self.turn.admissible),
            task=self.start.task,
            prefix_step_ids=prefix_step_ids,
            prefix_logprobs=prefix_logprobs,
        )


def game_start(game_file: str | Path, protocol: ChatProtocol, seed: int = 0) -> SavedState:
    """The start of an episode as a SavedState (turn 0, the first prompt rendered)."""
    with EnvGroup(game_file, 1) as group:
        turn = group.turns[0]
    tokens, messages = protocol.initial(turn.observation, turn.admissible)
    return SavedState(
        game_file=str(game_file),
        seed=seed,
        actions=[],
        messages=messages,
        prefix_tokens=tokens,
        round_index=0,
        observation=turn.observation,
        admissible=list(turn.admissible),
        task=extract_task(turn.observation),
        prefix_step_ids=[-1] * len(tokens),
        prefix_logprobs=[0.0] * len(tokens),
    )


def rollout(
    starts: Sequence[SavedState],
    group_size: int,
    sample_fn: SampleFn,
    protocol: ChatProtocol,
    *,
    horizon: int,
    max_turns: int,
    max_turn_tokens: int,
    max_trajectory_tokens: int,
    on_turn: Callable[[int, int], None] | None = None,
) -> list[list[Trajectory]]:
    """Run `group_size` branches (one group) from every start state for up to `horizon` turns.

    Each turn makes ONE `sample_fn` call with the prompts of all live branches of all groups.
    A branch stops when it wins (the env's done), the episode reaches `max_turns`, the
    segment reaches `horizon`, or the next turn would not fit in `max_trajectory_tokens`.
    A saved state that fails to restore gives an empty group (the caller counts it)."""
    groups, trajectories = [], []
    try:
        for index, start in enumerate(starts):
            try:
                group = EnvGroup(start.game_file, group_size)
                turn = group.restore(start)
            except (ReplayMismatchError, OSError, ValueError, KeyError) as error:
                print(f"[rollout] dropping start state of {start.game_file}: {error}", file=sys.stderr)
                groups.append(None)
                trajectories.append([])
                continue
            groups.append(group)
            n_prefix = len(start.prefix_tokens)
            trajectories.append(
                [
                    Trajectory(
                        start,
                        index,
                        b,
                        list(start.prefix_tokens),
                        [-1] * n_prefix,
                        [0.0] * n_prefix,
                        list(start.messages),
                        list(start.actions),
                        turn,
                        sequence_end=n_prefix,
                    )
                    for b in range(group_size)
                ]
            )

        for branch_list in trajectories:
            for traj in branch_list:
                _check_stop(traj, horizon, max_turns, max_turn_tokens, max_trajectory_tokens)
        turn_index = 0
        while live := [t for branch_list in trajectories for t in branch_list if t.stop_reason is None]:
            completions = sample_fn([t.tokens for t in live], max_turn_tokens)
            if len(completions) != len(live):
                raise RuntimeError(f"sample_fn returned {len(completions)} completions for {len(live)} prompts")
            actions = [parse_action(completion.text) for completion in completions]
            commands_by_group: dict[int, list[str | None]] = {}
            for traj, action in zip(live, actions):
                commands_by_group.setdefault(traj.group, [None] * group_size)[traj.branch] = action
            turns_by_group = {g: groups[g].step(commands) for g, commands in commands_by_group.items()}
            for traj, completion, action in zip(live, completions, actions):
                _record_step(traj, completion, action, turns_by_group[traj.group][traj.branch], protocol)
                _check_stop(traj, horizon, max_turns, max_turn_tokens, max_trajectory_tokens)
            turn_index += 1
            if on_turn is not None:
                on_turn(turn_index, len(live))
        return trajectories
    finally:
        if hasattr(sample_fn, "end_rollout"):  # the seam's optional call (SampleFn)
            sample_fn.end_rollout()
        for group in groups:
            if group is not None:
                group.close()


def _record_step(traj: Trajectory, completion: Completion, action: str | None, turn: Turn, protocol: ChatProtocol):
    previous = traj.turn
    valid = action is not None
    admissible = valid and action in previous.admissible
    prompt_length, k = len(traj.tokens), len(traj.steps)
    traj.tokens.extend(completion.tokens)
    traj.step_ids.extend([k] * len(completion.tokens))
    traj.logprobs.extend(completion.logprobs)
    traj.sequence_end = len(traj.tokens)
    if valid:
        traj.actions.append(action)
        traj.turn = turn
    won = traj.turn.won
    reward = 1.0 if won and not previous.won else 0.0
    traj.steps.append(
        StepRecord(
            prompt_length,
            list(completion.tokens),
            list(completion.logprobs),
            completion.text,
            action,
            traj.turn.observation,
            reward,
            won,
            valid,
            admissible,
            list(previous.admissible),
            previous.state,
        )
    )
    status = step_status(action, previous, traj.turn)
    content = protocol.tool_message(status, traj.turn.observation, traj.turn.admissible)
    traj.messages += [{"role": "assistant", "content": completion.text}, {"role": "tool", "content": content}]
    delta = protocol.delta(completion.tokens, content)
    traj.tokens.extend(delta)
    traj.step_ids.extend([-1] * len(delta))
    traj.logprobs.extend([0.0] * len(delta))


def step_status(action: str | None, previous: Turn, turn: Turn) -> str:
    """The status the tool message opens with after `action` (None: the reply had no valid call) moved the game from
    `previous` to `turn`."""
    if turn.won:
        return STATUS_WON
    if action is None:
        return STATUS_INVALID + ": end your reply with exactly one alfworld_step tool call"
    return STATUS_EXECUTED if action in previous.admissible else STATUS_NOT_ADMISSIBLE


def _check_stop(traj: Trajectory, horizon: int, max_turns: int, max_turn_tokens: int, max_trajectory_tokens: int):
    if traj.steps and traj.steps[-1].won:
        traj.stop_reason = STOP_WON
    elif traj.round_index >= max_turns:
        traj.stop_reason = STOP_MAX_STEPS
    elif len(traj.steps) >= horizon:
        traj.stop_reason = STOP_HORIZON
    elif len(traj.tokens) + max_turn_tokens > max_trajectory_tokens:
        traj.stop_reason = STOP_TOKEN_BUDGET


def game_start_or_skip(game: str, protocol, stage: str, seed: int = 0) -> SavedState | None:
    """The game's start state; None, with a warning naming it, for a game that passed the start-up parse but does
    not load (a broken grammar: grammars are parsed at first use)."""
    try:
        return game_start(game, protocol, seed=seed)
    except BadGameError as error:
        print(f"[{stage}] WARNING: skipped a game that does not load: {error}", file=sys.stderr)
        return None
