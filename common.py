"""Shared environment and replay side of the algorithms (everything that is not the model).

Sections, in the order a reader needs them: games (discovery, walkthroughs), safe grammar evaluation,
fast ALFWorld environments with snapshot and replay restore, the chat protocol, the batched
multi-turn rollout driver; then support, not the seam: the offline game generator and the tiny
offline model used by tests and smoke runs.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import dataclasses
import functools
import io
import json
import os
import random
import re
import shutil
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Sequence

import alfworld
import alfworld.gen.constants as alfred_constants
import alfworld.gen.goal_library as goal_library
import fast_downward
import numpy as np
import textworld
import textworld.gym
import textworld.logic
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
from alfworld.agents.utils.misc import Demangler
from textworld.envs import PddlEnv
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

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
SPLITS = ("train", "valid_seen", "valid_unseen")
DEFAULT_CACHE_DIR = Path(os.environ.get("ALFWORLD_OFFLINE_CACHE", Path.home() / ".cache" / "cleanrl-agents"))


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


def eval_subset(data_root: str | Path, split: str, task_types: Sequence[str] | None, n: int) -> list[str]:
    """The n evaluation games of a split: the same in every run and script (a fixed seed, not the run's), every task
    type covered (n permitting) and in proportion: each type's games shuffled, then the i-th game of a type with
    m games ranked at i / m."""
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


class _Game:
    """Everything about one game file that does not change while playing it (shared by branches)."""

    def __init__(self, game_file: str):
        self.game_file = game_file
        data = read_game_json(game_file)
        self.walkthrough = list(data.get("walkthrough") or [])
        self.logic = pddl_logic.GameLogic(domain=data["pddl_domain"], grammar=data["grammar"])
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
        argv = sys.argv  # the translator overwrites sys.argv
        try:
            self.task, self.sas = fast_downward.pddl2sas(self.logic.domain, data["pddl_problem"])
            _, self.sas_replan = fast_downward.pddl2sas(self.logic.domain, data["pddl_problem"], optimize=True)
        finally:
            sys.argv = argv
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
        return Turn(feedback, sorted(actions), won, moves, actions, self._state._operators)

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
    """The chat template re-renders earlier turns differently once later turns are added."""


class ChatProtocol:
    """Renders the agent's chat as token deltas: prompt(t+1) = prompt(t) + completion tokens as sampled
    + the template's assistant closing + the tool message + the generation prompt. History is never
    re-tokenised, so extending a prompt costs the same at turn 1 and turn 500."""

    _ASSISTANT, _TOOL = "\x1eASSISTANT\x1e", "\x1eTOOL\x1e"

    def __init__(self, tokenizer, show_admissible: bool = True, system_prompt: str = SYSTEM_PROMPT):
        self.tokenizer, self.show_admissible, self.system_prompt = tokenizer, show_admissible, system_prompt
        self.eos_token_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token or ""
        head = [{"role": "system", "content": system_prompt}, {"role": "user", "content": "U"}]
        p0 = self.render(head, add_generation_prompt=True)
        p1 = self.render(head + [{"role": "assistant", "content": self._ASSISTANT}])
        p2 = self.render(
            head + [{"role": "assistant", "content": self._ASSISTANT}, {"role": "tool", "content": self._TOOL}], True
        )
        if not (p1.startswith(p0) and p1[len(p0) :].startswith(self._ASSISTANT) and p2.startswith(p1)):
            raise TemplateNotAppendOnlyError(
                "the chat template does not render the assistant turn as an append-only suffix"
            )
        self.closing = p1[len(p0) + len(self._ASSISTANT) :]
        delta = p2[len(p1) :]
        if delta.count(self._TOOL) != 1:
            raise TemplateNotAppendOnlyError("the chat template does not render tool messages verbatim")
        self.tool_head, self.tool_tail = delta.split(self._TOOL)
        self._check_append_only(head)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=[ALFWORLD_TOOL], tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _check_append_only(self, head: list[dict]):
        """Multi-turn chats with reasoning blocks must render exactly as the deltas build them
        (templates that drop old <think> blocks fail here, at start-up)."""
        replies = ["<think>\nfirst\n</think>\n\nA1", "<think>\nsecond\n</think>\n\nA2", "A3"]
        messages, text = list(head), self.render(head, add_generation_prompt=True)
        for turn, reply in enumerate(replies):
            messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": f"T{turn}"}]
            text += reply + self.closing + self.tool_head + f"T{turn}" + self.tool_tail
        if self.render(messages, add_generation_prompt=True) != text:
            raise TemplateNotAppendOnlyError(
                "the chat template rewrites earlier turns (e.g. drops old <think> blocks), so prompts cannot "
                "be extended token by token; use a template that renders history verbatim"
            )

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
        closing = self.closing
        if completion_tokens and completion_tokens[-1] == self.eos_token_id and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text) :]  # the model already emitted the end-of-turn token
        return self.encode(closing + self.tool_head + tool_content + self.tool_tail)

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


SampleFn = Callable[[list[list[int]], int], list[Completion]]
# ALFWorld's env is done exactly when the game is won (TextWorld never reports a loss), so "won" is its done.
STOP_WON, STOP_MAX_STEPS, STOP_HORIZON, STOP_TOKEN_BUDGET = "won", "max_steps", "horizon", "token_budget"


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


def fresh_state(game_file: str | Path, protocol: ChatProtocol, seed: int = 0) -> SavedState:
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
    num_branches: int,
    sample_fn: SampleFn,
    protocol: ChatProtocol,
    *,
    horizon: int,
    max_episode_steps: int,
    max_turn_tokens: int,
    max_trajectory_tokens: int,
    on_turn: Callable[[int, int], None] | None = None,
) -> list[list[Trajectory]]:
    """Run `num_branches` branches from every start state for up to `horizon` turns.

    Each turn makes ONE `sample_fn` call with the prompts of all live branches of all groups.
    A branch stops when it wins (the env's done), the episode reaches `max_episode_steps`, the
    segment reaches `horizon`, or the next turn would not fit in `max_trajectory_tokens`.
    A saved state that fails to restore gives an empty group (the caller counts it)."""
    groups, trajectories = [], []
    try:
        for index, start in enumerate(starts):
            try:
                group = EnvGroup(start.game_file, num_branches)
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
                    for b in range(num_branches)
                ]
            )

        for branch_list in trajectories:
            for traj in branch_list:
                _check_stop(traj, horizon, max_episode_steps, max_turn_tokens, max_trajectory_tokens)
        turn_index = 0
        while live := [t for branch_list in trajectories for t in branch_list if t.stop_reason is None]:
            completions = sample_fn([t.tokens for t in live], max_turn_tokens)
            if len(completions) != len(live):
                raise RuntimeError(f"sample_fn returned {len(completions)} completions for {len(live)} prompts")
            actions = [parse_action(completion.text) for completion in completions]
            commands_by_group: dict[int, list[str | None]] = {}
            for traj, action in zip(live, actions):
                commands_by_group.setdefault(traj.group, [None] * num_branches)[traj.branch] = action
            turns_by_group = {g: groups[g].step(commands) for g, commands in commands_by_group.items()}
            for traj, completion, action in zip(live, completions, actions):
                _record_step(traj, completion, action, turns_by_group[traj.group][traj.branch], protocol)
                _check_stop(traj, horizon, max_episode_steps, max_turn_tokens, max_trajectory_tokens)
            turn_index += 1
            if on_turn is not None:
                on_turn(turn_index, len(live))
        return trajectories
    finally:
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
        )
    )
    if won:
        status = STATUS_WON
    elif not valid:
        status = STATUS_INVALID + ": end your reply with exactly one alfworld_step tool call"
    elif not admissible:
        status = STATUS_NOT_ADMISSIBLE
    else:
        status = STATUS_EXECUTED
    content = protocol.tool_message(status, traj.turn.observation, traj.turn.admissible)
    traj.messages += [{"role": "assistant", "content": completion.text}, {"role": "tool", "content": content}]
    delta = protocol.delta(completion.tokens, content)
    traj.tokens.extend(delta)
    traj.step_ids.extend([-1] * len(delta))
    traj.logprobs.extend([0.0] * len(delta))


def _check_stop(
    traj: Trajectory, horizon: int, max_episode_steps: int, max_turn_tokens: int, max_trajectory_tokens: int
):
    if traj.steps and traj.steps[-1].won:
        traj.stop_reason = STOP_WON
    elif traj.round_index >= max_episode_steps:
        traj.stop_reason = STOP_MAX_STEPS
    elif len(traj.steps) >= horizon:
        traj.stop_reason = STOP_HORIZON
    elif len(traj.tokens) + max_turn_tokens > max_trajectory_tokens:
        traj.stop_reason = STOP_TOKEN_BUDGET


# =============================================================================================
# Offline games: ALFWorld-format games generated from what the `alfworld` package ships
# =============================================================================================
ALFWORLD_DIR = os.path.dirname(alfworld.__file__)
LAYOUTS_DIR = os.path.join(ALFWORLD_DIR, "gen", "layouts")
UNSEEN_SCENES = (10, 219, 308, 424)  # ALFRED's valid_unseen floor plans: never used for train/valid_seen
ROOM_OF_SCENE = {n: room for room, nums in alfred_constants.SCENE_TYPE.items() for n in nums}
STATIC_RECEPS = set(alfred_constants.VAL_RECEPTACLE_OBJECTS) - alfred_constants.MOVABLE_RECEPTACLES_SET
PICKUPABLE = {o for objs in alfred_constants.VAL_RECEPTACLE_OBJECTS.values() for o in objs if "Sliced" not in o}
LAMPS = ("DeskLamp", "FloorLamp")
LAMP_HOSTS = ("Desk", "SideTable", "Dresser", "Shelf", "CoffeeTable", "DiningTable", "TVStand")
TOOL_RECEP = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
TASK_PROP = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
# Receptacle types the domain's actions name: they must always be declared.
ALWAYS_RTYPES = ("SinkBasin", "Microwave", "Fridge")
ALWAYS_OTYPES = ("Knife", "ButterKnife")
# Scenes list these receptacles but the layouts have no pose for them: add them at a reachable point.
SYNTH_RECEPS = {"StoveBurner": 4}
PDDL_CHARS = {"-": "_minus_", "|": "_bar_", "+": "_plus_", ".": "_dot_", ",": "_comma_"}


def _mangle(name):
    return "".join(PDDL_CHARS.get(c, c) for c in name)


def _loc(x, z, rot, horizon):
    return "loc|%d|%d|%d|%d" % (
        round(x / alfred_constants.AGENT_STEP_SIZE),
        round(z / alfred_constants.AGENT_STEP_SIZE),
        rot // 90,
        horizon,
    )


def _recep_type(rid):
    parts = rid.split("|")
    return parts[4] if len(parts) == 5 else parts[0]  # "Sink|x|y|z|SinkBasin" is a SinkBasin


@functools.lru_cache(maxsize=None)
def load_scene(num):
    """Receptacles [(id, type, loc)], pickupable classes, lamps and reachable floor points of FloorPlan<num>."""
    path = os.path.join(LAYOUTS_DIR, "FloorPlan%d-%s")
    with open(path % (num, "objects.json")) as f:
        classes = set(json.load(f))
    with open(path % (num, "openable.json")) as f:
        poses = json.load(f)
    points = [tuple(p) for p in np.load(path % (num, "layout.npy")).tolist()]
    receps = [(rid, _recep_type(rid), _loc(*poses[rid])) for rid in sorted(poses) if _recep_type(rid) in STATIC_RECEPS]
    rng = random.Random(num)  # synthetic receptacles are a fixed part of the scene
    for rtype in sorted(classes & STATIC_RECEPS - {t for _, t, _ in receps}):
        for x, z in rng.sample(points, SYNTH_RECEPS.get(rtype, 1)):
            rid = "%s|%+06.2f|%+06.2f|%+06.2f" % (rtype, x, 0.9, z)
            receps.append((rid, rtype, _loc(x, z, 90 * rng.randrange(4), 30)))
    return sorted(receps), sorted(classes & PICKUPABLE), sorted(classes & set(LAMPS)), points


def _holds(rtype, otype):
    return otype in alfred_constants.VAL_RECEPTACLE_OBJECTS.get(rtype, ())


def sample_task(rng, task_type, scene_num):
    """Pick (object, parent receptacle, lamp) for a task in a scene, or None when the scene can't host it."""
    receps, objs, lamps, _ = load_scene(scene_num)
    rtypes = sorted({t for _, t, _ in receps})
    if task_type in TOOL_RECEP:
        if TOOL_RECEP[task_type] not in rtypes:
            return None
        objs = [o for o in objs if o in alfred_constants.VAL_ACTION_OBJECTS[TASK_PROP[task_type]]]
    if task_type == "look_at_obj_in_light":
        objs = [o for o in objs if any(_holds(t, o) for t in rtypes)]
        if not (objs and lamps and set(rtypes) & set(LAMP_HOSTS)):
            return None
        return rng.choice(objs), None, rng.choice(lamps)
    # The object must start somewhere other than a receptacle of the goal's type.
    combos = [
        (o, r)
        for o in objs
        for r in rtypes
        if _holds(r, o) and r != TOOL_RECEP.get(task_type) and any(_holds(t, o) for t in rtypes if t != r)
    ]
    return (*rng.choice(combos), None) if combos else None


def _obj_id(rng, cls, rid, taken):
    _, x, y, z = rid.split("|")[:4]
    while True:
        oid = "%s|%+06.2f|%+06.2f|%+06.2f" % (
            cls,
            float(x) + rng.uniform(-0.3, 0.3),
            float(y) + rng.uniform(0, 0.2),
            float(z) + rng.uniform(-0.3, 0.3),
        )
        if oid not in taken:
            taken.add(oid)
            return oid


def build_problem(rng, task_type, scene_num, obj, parent, toggle, max_receptacles, name):
    """ALFWorld-style PDDL problem with receptacles capped at max_receptacles. Also returns the same problem
    without distractor objects: its optimal plan is valid in the full game (same ids, so the same names)
    and far cheaper to search."""
    receps, objs, lamps, points = load_scene(scene_num)
    shuffled = rng.sample(receps, len(receps))
    needed = [t for t in (parent, TOOL_RECEP.get(task_type)) if t]
    if toggle:
        needed.append(next(t for _, t, _ in shuffled if t in LAMP_HOSTS))
    keep = [next(r for r in shuffled if r[1] == t) for t in dict.fromkeys(needed)]
    keep.append(next(r for r in shuffled if _holds(r[1], obj) and r[1] != parent))  # a start for the object
    keep = list(dict.fromkeys(keep))
    keep = sorted(keep + [r for r in shuffled if r not in keep][: max(0, max_receptacles - len(keep))])

    # Place objects: targets never start in a goal-type receptacle; distractors anywhere they fit.
    taken, placed = set(), []  # placed: (object id, class, receptacle id)
    n_target = rng.randint(2, 3) if task_type == "pick_two_obj_and_place" else rng.randint(1, 2)
    others = [o for o in objs if o != obj]
    classes = [obj] * n_target + [
        o for o in rng.sample(others, min(len(others), len(keep))) for _ in range(rng.randint(1, 2))
    ]
    for cls in classes + lamps:
        hosts = [
            r
            for r, t, _ in keep
            if (t in LAMP_HOSTS if cls in LAMPS else _holds(t, cls)) and not (cls == obj and t == parent)
        ]
        if hosts:
            rid = rng.choice(hosts)
            placed.append((_obj_id(rng, cls, rid, taken), cls, rid))
    start = None
    while start is None or start in {l for _, _, l in keep}:  # start where no receptacle is: "middle of a room"
        start = _loc(*rng.choice(points), 90 * rng.randrange(4), 30)
    goal = goal_library.gdict[task_type]["pddl"].format(obj=obj, recep=parent, toggle=toggle).replace("#", "-")
    return (
        _problem_text(name, keep, sorted(placed), start, goal),
        _problem_text(name, keep, sorted(p for p in placed if p[1] in (obj, toggle)), start, goal),
    )


def _problem_text(name, keep, placed, start, goal):
    m = _mangle  # PDDL-safe ids, as in ALFWorld's files
    loc_of = {rid: loc for rid, _, loc in keep}
    otypes = sorted({c for _, c, _ in placed} | set(ALWAYS_OTYPES))
    rtypes = sorted({t for _, t, _ in keep} | set(ALWAYS_RTYPES))
    objects = (
        ["agent1 - agent"]
        + ["%s - object" % m(o) for o, _, _ in placed]
        + ["%s - receptacle" % m(r) for r, _, _ in keep]
        + ["%s - location" % m(l) for l in sorted(set(loc_of.values()) | {start})]
        + ["%sType - otype" % t for t in otypes]
        + ["%sType - rtype" % t for t in rtypes]
    )
    init = ["(atLocation agent1 %s)" % m(start)]
    for rid, rtype, loc in keep:
        init += ["(receptacleType %s %sType)" % (m(rid), rtype), "(receptacleAtLocation %s %s)" % (m(rid), m(loc))]
        if rtype in alfred_constants.OPENABLE_CLASS_SET:
            init.append("(openable %s)" % m(rid))
    for oid, cls, rid in placed:
        init += [
            "(objectType %s %sType)" % (m(oid), cls),
            "(inReceptacle %s %s)" % (m(oid), m(rid)),
            "(objectAtLocation %s %s)" % (m(oid), m(loc_of[rid])),
            "(%s %s)" % ("toggleable" if cls in LAMPS else "pickupable", m(oid)),
        ]
        init += [
            "(%s %s)" % (prop.lower(), m(oid))
            for prop in ("Cleanable", "Heatable", "Coolable", "Sliceable")
            if cls in alfred_constants.VAL_ACTION_OBJECTS[prop]
        ]
        if cls in alfred_constants.MOVABLE_RECEPTACLES_SET:
            init.append("(isReceptacleObject %s)" % m(oid))
    init += ["(canContain %sType %sType)" % (r, o) for r in rtypes for o in otypes if _holds(r, o)]
    return "(define (problem plan_%s)\n(:domain alfred)\n(:objects\n%s\n)\n(:init\n%s\n)\n%s" % (
        name,
        "\n".join(objects),
        "\n".join(init),
        goal.strip(),
    )


def plan_walkthrough(planner, game):
    """Fast Downward's optimal plan as ALFWorld commands; [] when the goal is unreachable.
    planner: AlfredDemangler(PddlEnv(textworld.EnvInfos(policy_commands=True))), reused across games."""
    argv = sys.argv  # fast_downward's translator overwrites sys.argv
    try:
        planner.load(game)
        return planner.reset()["policy_commands"]
    except KeyError:  # the translator's KeyError('val1'): goal unreachable even when relaxed
        return []
    finally:
        sys.argv = argv


def stock_alfworld_env(game_files: Sequence[str], max_episode_steps: int = 1000):
    """Stock TextWorld with ALFWorld's wrappers, as ALFWorld trains on it (batch of 1): the reference engine
    for generation and for tests and benchmarks. It eval()s grammar code: only for trusted games."""
    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    env_id = textworld.gym.register_games(
        list(game_files),
        infos,
        batch_size=1,
        asynchronous=False,
        max_episode_steps=max_episode_steps,
        wrappers=[AlfredDemangler, AlfredInfos],
    )
    return textworld.gym.make(env_id)


def replay_games(game_files, max_steps=200) -> dict[str, bool]:
    """Play each game's stored walkthrough in the stock engine; returns {game_file: won}.
    One env for all: each env loads its own copy of libdownward.so."""
    argv, env, results = sys.argv, stock_alfworld_env(game_files, max_steps), {}
    try:
        for _ in game_files:  # the env's first cycle visits each game once, in a shuffled order
            _, info = env.reset()
            game_file, won = info["extra.gamefile"][0], False
            for command in load_walkthrough(game_file):
                _, _, _, info = env.step([command])
                won = info["won"][0]
            results[game_file] = bool(won)
    finally:
        env.close()
        sys.argv = argv  # the translator overwrites it
    return results


def _write_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f)


def make_games(out_dir, n: int, seed: int = 0, max_receptacles: int = 15, log=print) -> list[str]:
    """Write n solvable games (round-robin over TASK_TYPES; ~80/10/10 train/valid_seen/valid_unseen) in
    ALFWorld's download layout under out_dir/json_2.1.1; returns the game files written."""
    rng = random.Random(seed)
    with open(os.path.join(ALFWORLD_DIR, "data", "alfred.pddl")) as f:
        domain = f.read()
    with open(os.path.join(ALFWORLD_DIR, "data", "alfred.twl2")) as f:
        grammar = f.read()
    scenes = sorted(int(f[9:-13]) for f in os.listdir(LAYOUTS_DIR) if f.endswith("-objects.json"))
    planner = AlfredDemangler(PddlEnv(textworld.EnvInfos(policy_commands=True)))

    n_valid = round(n / 10)  # per valid split; the last games, so each split cycles through all task types

    def new_game(i):  # sample until the planner solves one; write it; return its game file
        task_type = TASK_TYPES[i % len(TASK_TYPES)]
        split = "train" if i < n - 2 * n_valid else "valid_seen" if i < n - n_valid else "valid_unseen"
        pool = [
            s
            for s in scenes
            if (s in UNSEEN_SCENES) == (split == "valid_unseen")
            and ROOM_OF_SCENE[s] in alfred_constants.GOALS_VALID[task_type]
        ]
        t0 = time.time()
        for attempt in range(100):
            scene = rng.choice(pool)
            task = sample_task(rng, task_type, scene)
            if task is None:
                continue
            obj, parent, toggle = task
            trial = "trial_T%d_%05d_%02d" % (seed, i, attempt)
            task_desc = rng.choice(goal_library.gdict[task_type]["templates"]).format(
                obj=obj.lower(), recep=(parent or "").lower(), toggle=(toggle or "").lower()
            )
            problem, planning_problem = build_problem(
                rng, task_type, scene, obj, parent, toggle, max_receptacles, trial
            )
            game = {
                "pddl_domain": domain,
                "grammar": grammar.replace("UNKNOWN GOAL", task_desc),
                "pddl_problem": planning_problem,
            }
            walkthrough = plan_walkthrough(planner, game)
            if not walkthrough:
                log("  unsolvable: %s in FloorPlan%d" % (task, scene))
                continue
            game_dir = os.path.join(
                out_dir, "json_2.1.1", split, "%s-%s-None-%s-%d" % (task_type, obj, parent or toggle, scene), trial
            )
            os.makedirs(game_dir, exist_ok=True)
            game.update(pddl_problem=problem, solvable=True, walkthrough=walkthrough)
            _write_json(os.path.join(game_dir, "game.tw-pddl"), game)
            _write_json(
                os.path.join(game_dir, "traj_data.json"),
                {
                    "task_id": trial,
                    "task_type": task_type,
                    "split": split,
                    "pddl_params": {
                        "object_target": obj,
                        "parent_target": parent or "",
                        "toggle_target": toggle or "",
                        "mrecep_target": "",
                        "object_sliced": False,
                    },
                    "scene": {"floor_plan": "FloorPlan%d" % scene, "scene_num": scene},
                    "turk_annotations": {"anns": [{"task_desc": task_desc}]},
                },
            )  # templated, not human-written
            log("game %d/%d: %s (%d steps, %.2fs)" % (i + 1, n, game_dir, len(walkthrough), time.time() - t0))
            return os.path.join(game_dir, "game.tw-pddl")
        raise RuntimeError("could not generate a %s game" % task_type)

    files = [None] * n
    for _ in range(10):  # generate, then replay every new game to won in the real engine
        todo = [i for i in range(n) if files[i] is None]
        if not todo:
            return files
        for i in todo:
            files[i] = new_game(i)
        t0 = time.time()
        results = replay_games([files[i] for i in todo])
        log("replayed %d games in %.1fs" % (len(todo), time.time() - t0))
        for i in todo:
            if not results[files[i]]:
                log("  discarded, walkthrough did not win: " + files[i])
                shutil.rmtree(os.path.dirname(files[i]))
                files[i] = None
    raise RuntimeError("games keep failing their replay")


DEFAULT_GAMES, DEFAULT_GAMES_SEED = 240, 0


def default_data_root(
    n: int = DEFAULT_GAMES, seed: int = DEFAULT_GAMES_SEED, cache_dir: str | Path | None = None
) -> Path:
    """The generated offline game set: made once into the cache (a few minutes, with a progress bar), reused after."""
    from tqdm import tqdm

    root = Path(cache_dir or DEFAULT_CACHE_DIR) / f"offline-games-n{n}-seed{seed}"
    if not (root / "json_2.1.1").is_dir():
        tmp = root.with_name(f"{root.name}.tmp{os.getpid()}")
        with tqdm(total=n, desc=f"generating offline games into {root} (once)", unit="game", file=sys.stderr) as bar:
            make_games(tmp, n, seed, log=lambda line: bar.update(line.startswith("game ")))
        try:
            os.replace(tmp, root)  # atomic; a concurrent generator wrote the same bytes
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return root


# =============================================================================================
# The tiny offline model (tests and smoke runs: `--model tiny`)
# =============================================================================================
# Qwen2.5-Instruct's chat template (tools block, grouped `role: tool` turns, tool_calls), written out
# here so tests can render chats against an independent implementation without a download.
QWEN25_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def _tiny_corpus(rng: random.Random) -> list[str]:
    """Game-like text (ALFWorld observations, actions, tool calls, judge/value outputs) for BPE training."""
    recs = [
        "cabinet",
        "countertop",
        "drawer",
        "fridge",
        "microwave",
        "sinkbasin",
        "stoveburner",
        "shelf",
        "garbagecan",
        "coffeemachine",
        "toaster",
        "diningtable",
        "coffeetable",
        "sidetable",
        "desk",
        "bed",
        "sofa",
        "armchair",
        "dresser",
        "safe",
        "bathtubbasin",
        "toilet",
        "towelholder",
        "handtowelholder",
        "ottoman",
        "cart",
        "laundryhamper",
        "toiletpaperhanger",
    ]
    objs = [
        "alarmclock",
        "apple",
        "baseballbat",
        "basketball",
        "book",
        "bowl",
        "box",
        "bread",
        "butterknife",
        "candle",
        "cd",
        "cellphone",
        "cloth",
        "creditcard",
        "cup",
        "desklamp",
        "dishsponge",
        "egg",
        "floorlamp",
        "fork",
        "glassbottle",
        "handtowel",
        "houseplant",
        "kettle",
        "keychain",
        "knife",
        "ladle",
        "laptop",
        "lettuce",
        "mug",
        "newspaper",
        "pan",
        "papertowelroll",
        "pen",
        "pencil",
        "peppershaker",
        "pillow",
        "plate",
        "plunger",
        "pot",
        "potato",
        "remotecontrol",
        "saltshaker",
        "scrubbrush",
        "soapbar",
        "soapbottle",
        "spatula",
        "spoon",
        "spraybottle",
        "statue",
        "teddybear",
        "tennisracket",
        "tissuebox",
        "toiletpaper",
        "tomato",
        "towel",
        "vase",
        "watch",
        "wateringcan",
        "winebottle",
    ]
    tasks = [
        "put a {a} in {r}.",
        "put a clean {a} in {r}.",
        "put a hot {a} in {r}.",
        "put a cool {a} in {r}.",
        "put two {a} in {r}.",
        "look at {a} under the desklamp.",
        "heat some {a} and put it in {r}.",
        "clean some {a} and put it in {r}.",
        "cool some {a} and put it in {r}.",
        "find two {a} and put them in {r}.",
    ]
    texts = []
    for _ in range(400):
        seen = ", ".join(f"a {rng.choice(recs)} {rng.randint(1, 12)}" for _ in range(rng.randint(3, 12)))
        o, r = rng.choice(objs), rng.choice(recs)
        n, m, k = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 30)
        task = rng.choice(tasks).format(a=o, r=r)
        action = rng.choice(
            [
                f"go to {r} {n}",
                f"take {o} {n} from {r} {m}",
                f"move {o} {n} to {r} {m}",
                f"put {o} {n} in/on {r} {m}",
                f"open {r} {n}",
                f"close {r} {n}",
                f"heat {o} {n} with microwave {m}",
                f"cool {o} {n} with fridge {m}",
                f"clean {o} {n} with sinkbasin {m}",
                f"slice {o} {n} with knife {m}",
                f"use desklamp {n}",
                f"examine {r} {n}",
                "look",
                "inventory",
            ]
        )
        texts += [
            f"-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, "
            f"you see {seen}.\n\nYour task is to: {task}",
            f"> {action}\n",
            rng.choice(
                [
                    f"You arrive at {r} {n}. On the {r} {n}, you see a {o} {m}, and a {rng.choice(objs)} {k}.",
                    f"You pick up the {o} {n} from the {r} {m}.",
                    f"You put the {o} {n} in/on the {r} {m}.",
                    f"You open the {r} {n}. The {r} {n} is open. In it, you see nothing.",
                    f"You close the {r} {n}.",
                    f"You heat the {o} {n} using the microwave {m}.",
                    f"You cool the {o} {n} using the fridge {m}.",
                    f"You clean the {o} {n} using the sinkbasin {m}.",
                    f"You are carrying: a {o} {n}.",
                    "You are not carrying anything.",
                    "Nothing happens.",
                ]
            ),
            '<tool_call>\n{"name": "alfworld_step", "arguments": ' + json.dumps({"action": action}) + "}\n</tool_call>",
            f'<tool_response>\nObservation: Nothing happens. Admissible actions: ["{action}", "look"]\n'
            "</tool_response>",
            f"<action>{action}</action> <value>{rng.random():.{rng.randint(1, 3)}f}</value> "
            f"<think>I need to find the {o} first.</think>",
            f"Step {k} Judgment: {rng.choice(['GOOD', 'BAD', 'NEUTRAL'])}. "
            f"Reward: {rng.choice(['0', '1', '-1', '0.5'])}",
            '{"type": "function", "function": {"name": "alfworld_step", "description": "Take one action in the '
            'game.", "parameters": {"type": "object", "properties": {"action": {"type": "string"}}, '
            '"required": ["action"]}}}',
        ]
    prose = (
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\nYou may call one or "
        "more functions to assist with the user query. You are an expert agent operating in a household. "
        "Think step by step about what you have seen, where the object could be, and which action brings you "
        "closer to the goal. Respond with exactly one action from the list of admissible actions. Rate how "
        "promising the last step was, and estimate the probability of success between 0 and 1. Your previous "
        "steps were: none. Current observation and history follow. Answer with your reasoning, then the final "
        "answer. The episode ended: you won, you lost, out of steps, invalid format, unknown command."
    )
    return texts + [prose, " ".join(str(i) for i in range(100))]


def _qwen2_pipeline(tok) -> None:
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # Same normalizer/pre-tokenizer/decoder that Qwen2Tokenizer rebuilds on load; any other would shift ids on reload.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()


def build_tiny_model(
    out_dir: str | Path, seed: int = 0, hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2
) -> Path:
    """Build a tiny random Qwen2 chat model + trained BPE tokenizer offline, deterministically, into `out_dir`
    (the sizes: bigger ones for CPU learning benchmarks)."""
    import torch
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2Tokenizer,
    )

    out_dir = Path(out_dir)
    bpe = Tokenizer(models.BPE())
    _qwen2_pipeline(bpe)
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_tiny_corpus(random.Random(0)), trainer=trainer)  # tokenizer fixed across seeds
    model_json = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=model_json["vocab"],
        merges=[tuple(m) for m in model_json["merges"]],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=32768,
    )
    # Like Qwen2.5: tool/think tags are single ids but not special, so decode(skip_special_tokens=True) keeps them.
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer.chat_template = QWEN25_CHAT_TEMPLATE

    pad, eos = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG state
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).float()
    # Minimal on purpose: any sampling field here would silently override the caller's generate() settings.
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def resolve_model(model: str, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> str:
    """`tiny` -> the offline tiny model (built once into the cache); anything else is passed through."""
    if model != "tiny":
        return model
    path = Path(cache_dir) / "tiny-model"
    if not (path / "model.safetensors").is_file():
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        build_tiny_model(tmp)
        try:
            os.replace(tmp, path)  # atomic: a concurrent builder's copy is identical
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


if __name__ == "__main__":
    import argparse

    cli = argparse.ArgumentParser(description="common.py tools")
    commands = cli.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make-games", help="generate ALFWorld-format games offline (download layout)")
    make.add_argument("--out", required=True, help="output directory (gets json_2.1.1/<split>/...)")
    make.add_argument("--n", type=int, default=DEFAULT_GAMES, help="number of games")
    make.add_argument("--seed", type=int, default=0, help="same seed, same bytes")
    make.add_argument("--max-receptacles", type=int, default=15, help="cap per game (bigger is slower to plan)")
    tiny = commands.add_parser("make-tiny-model", help="build the tiny offline model")
    tiny.add_argument("--out", required=True)
    cli_args = cli.parse_args()
    if cli_args.command == "make-games":
        files = make_games(cli_args.out, cli_args.n, cli_args.seed, cli_args.max_receptacles)
        print(f"wrote {len(files)} games under {cli_args.out}")
    else:
        print(build_tiny_model(cli_args.out))
