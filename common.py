"""What every algorithm script shares: everything an algorithm would copy unchanged (the scripts import only this).

Sections, in the order a reader needs them (search for the section's title):
  Games                      discovery in ALFWorld's layout, walkthroughs, safe grammar evaluation
  Fast ALFWorld environment  parsed and translated once per process; snapshots and replay restore
  Saved states, env groups   SavedState (a mid-episode state), EnvGroup (N branches from one state)
  Chat protocol              token-in, token-out prompts, append-only across turns
  Batched multi-turn rollouts  rollout(): N branches per start state, H turns, through a SampleFn
  Model and samplers         load_model (LoRA), generate() or a vLLM server, both a SampleFn
  Training step              teacher-forced logprobs, Datum, trajectory_datums, train_step(rt, datums, loss_fn),
                             ppo_update (the shared PPO-clip step)
  Job harness                the shared flags (SharedArgs, PPOArgs), start-up checks, Runtime, Run (the pieces of
                             main()'s update loop), evaluate, RunLogger, checkpoints and resume, cli
  The scripts' offline defaults  `--model tiny` / `tiny-agent`, the generated games without --data-root, the
                             learning presets' shared settings (offline.py, the layer below, makes the games and models)
"""

from __future__ import annotations

import ast
import asyncio
import collections
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import importlib.metadata
import io
import json
import math
import os
import queue
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import typing
import zipfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Literal, Sequence

import fast_downward
import numpy as np
import openai
import textworld
import textworld.gym
import textworld.logic
import torch
import tyro
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
from torch.distributed.tensor import DTensor

import offline
from offline import DEFAULT_CACHE_DIR, TASK_TYPES  # the cache of generated games and built models

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


# =============================================================================================
# Model and samplers: LoRA policy, generate() in the training process or a vLLM server (both SampleFn)
# =============================================================================================
def load_tokenizer(path: str, chat_template: str = "", **kwargs):
    """The model's tokenizer (its EOS pads when it has no pad token); --chat-template's Jinja file, when given,
    replaces its chat template (as `vllm serve --chat-template`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if chat_template:
        try:
            tokenizer.chat_template = Path(chat_template).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--chat-template {chat_template}: cannot read it ({error})") from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def chat_protocol(args, tokenizer=None) -> ChatProtocol:
    """The run's ChatProtocol (--chat-template, --enable-thinking); a template it cannot extend is refused here."""
    if tokenizer is None:
        tokenizer = load_tokenizer(resolve_model(args.model), args.chat_template)
    return ChatProtocol(tokenizer, enable_thinking=args.enable_thinking)


def load_model(args, accelerator, heads: torch.nn.Module | None = None):
    """Tokenizer (left padding), base model + one LoRA adapter (--lora-rank 0: no adapter, every weight trained),
    AdamW on what is trained, prepared by accelerate. `heads`: an algorithm's own modules (Runtime.make_heads), moved
    to the device, made rank 0's on every process, and stepped by the same optimizer after the model's parameters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path, args.chat_template, padding_side="left")
    on_gpu = accelerator.device.type == "cuda"
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if on_gpu else torch.float32)
    if on_gpu:  # long multi-turn sequences: activations would not fit otherwise
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_rank:
        lora = LoraConfig(
            r=args.lora_rank,
            lora_alpha=args.lora_alpha,
            target_modules=list(args.lora_targets),
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, lora)
    else:
        model = base.train()
    heads = torch.nn.ModuleDict() if heads is None else heads.to(accelerator.device)
    if accelerator.num_processes > 1:
        for tensor in heads.state_dict().values():
            torch.distributed.broadcast(tensor, 0)
    if args.fsdp:
        shard(model.to(accelerator.device), accelerator)
    optimizer = torch.optim.AdamW(
        trained_parameters(model, heads),  # under --fsdp the policy's are its shards (DTensors)
        lr=args.learning_rate,
        betas=tuple(args.adam_betas),
        weight_decay=args.weight_decay,
    )
    if args.fsdp:  # not DDP-wrapped: FSDP2 already reduces the gradients
        optimizer = accelerator.prepare(optimizer)
        gather_weights(model)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    return tokenizer, model, optimizer


def causal_lm(policy):
    """The transformers model inside a peft model (the policy itself with --lora-rank 0): what generate() runs."""
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


def shard(policy, accelerator) -> None:
    """--fsdp: PyTorch's FSDP2 (fully_shard) on the process group accelerate set up: each transformer block is one
    unit, then the causal LM (embeddings, final norm, lm_head) the root, so that generate(), which calls the causal LM,
    enters through the root. Every weight, gradient and AdamW state is split over the processes; gradients are summed
    (not averaged: the loss is already a mean over every process's tokens), with plain sums, which gloo also has."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root = causal_lm(policy)
    layers = getattr(root.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"--fsdp: {type(root).__name__} keeps no list of transformer blocks at .layers to shard")
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    for module in [*layers, root]:
        fully_shard(module, mesh=mesh)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


def fsdp_modules(policy) -> list:
    """The policy's FSDP2 units (none without --fsdp): the root first, then the blocks."""
    from torch.distributed.fsdp import FSDPModule

    return [module for module in policy.modules() if isinstance(module, FSDPModule)]


def gather_weights(policy) -> None:
    """--fsdp: every process all-gathers the whole weights and keeps them until the next training step, so sampling,
    no-grad logprob passes, checkpoints and the vLLM adapter sync run in each process alone as without FSDP (their
    forward passes differ in number per process, and a sharded forward is a collective). A collective itself: called
    where every process is (start, after each optimizer step, after a checkpoint load). No-op without --fsdp."""
    units = fsdp_modules(policy)
    for module in units:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    if units:  # the gathered copies' own write counters stay put: weights_version counts gathers
        policy.weights_gathered = getattr(policy, "weights_gathered", 0) + 1


def weights_version(policy) -> int:
    """A number that changes whenever the weights do: torch counts in-place writes per tensor (optimizer steps,
    checkpoint loads), and gather_weights counts the gathers that bring a sharded update in."""
    return getattr(policy, "weights_gathered", 0) + sum(p._version for p in policy.parameters())


def model_config(model: str):
    """The model's transformers config (--model as load_model resolves it)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model(model))


class SampledTokenLogprobs:
    """A generate() logits processor that records log_softmax(raw logits / temperature) of each sampled token.
    generate() runs it before temperature/top-p and hands it the tokens sampled so far, so it keeps one step's
    distribution at a time instead of the [steps, batch, vocab] logits that output_logits would hold."""

    def __init__(self, temperature: float):
        self.temperature, self.previous, self.steps = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.steps.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def logprobs(self, sequences: torch.Tensor) -> torch.Tensor:
        """[batch, new tokens] once generate() has returned `sequences`."""
        return torch.stack(self.steps + [self.previous.gather(-1, sequences[:, -1:]).squeeze(-1)], dim=1)


def stop_token_ids(tokenizer, model) -> list[int]:
    """The tokens that end a reply: the tokenizer's EOS and every eos_token_id of the model's generation_config
    (vLLM stops on all of them; Qwen's instruct models list two)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return sorted({tokenizer.eos_token_id, *configured} - {None})


def reply(tokens: list[int], logprobs: list[float], stops: Sequence[int], tokenizer) -> Completion:
    """A sampled reply cut after its first stop token (a reply that ends in any of them has ended)."""
    end = next((i + 1 for i, token in enumerate(tokens) if token in stops), len(tokens))
    return Completion(tokens[:end], logprobs[:end], tokenizer.decode(tokens[:end], skip_special_tokens=True))


def make_sampler(model, tokenizer, accelerator, args, greedy: bool = False) -> SampleFn:
    """SampleFn over generate() in this process (GenerateSampler), or with --sampler vllm from the server
    (ServerSampler)."""
    if args.sampler == "vllm":
        return ServerSampler(model, tokenizer, accelerator, args, greedy)
    return GenerateSampler(model, tokenizer, accelerator, args, greedy)


# The KV cache of one token sequence: per layer (keys, values), each [kv heads, tokens, head dim].
RowCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]


class GenerateSampler:
    """SampleFn over generate(): chunks of --sample-batch-size prompts, left-padded. A token's logprob is
    log_softmax(raw logits / temperature), which equals a teacher-forced pass at that temperature.

    KV reuse (--kv-cache-mb > 0): the chat protocol is append-only, so a branch's next prompt starts with the
    sequence this sampler produced for it the turn before (prompt + reply). Each call keeps the KV cache of every
    sequence it produces; a prompt that starts with a kept sequence prefills only the tokens added since (the reply's
    closing, the tool message, the next header). Caches are matched by their tokens, so one only ever serves a prompt
    it is exactly a prefix of (no branch identity crosses the SampleFn seam). They are dropped at the next call (a
    branch not in it has stopped), when the weights change, at the end of a rollout (end_rollout) and past the budget
    (that branch re-prefills its history next turn: slower, never different). A prompt that starts with no kept
    sequence (a fresh or restored state) is prefilled once per chunk, however many branches share it. Off for models
    with sliding-window or linear-attention layers, whose caches do not hold every token."""

    def __init__(self, model, tokenizer, accelerator, args, greedy: bool = False):
        self.model, self.tokenizer, self.accelerator, self.args = model, tokenizer, accelerator, args
        self.greedy, self.pad_id = greedy, tokenizer.pad_token_id
        self.stops = stop_token_ids(tokenizer, accelerator.unwrap_model(model))
        config = accelerator.unwrap_model(model).config.get_text_config(decoder=True)
        full_attention = set(getattr(config, "layer_types", None) or ["full_attention"]) == {"full_attention"}
        if args.kv_cache_mb > 0 and not full_attention:
            print(
                "[sampler] the model has non-full-attention layers: no KV reuse, every turn re-prefills",
                file=sys.stderr,
            )
        self.budget_bytes = args.kv_cache_mb * 2**20 if full_attention else 0
        self.kept: list[tuple[list[int], RowCache]] = []
        self.kept_bytes, self.weights_version = 0, None
        self.stats = Counter()  # prompt tokens "prefilled" and "reused" (from a kept cache), sequences "not_kept"

    def end_rollout(self) -> None:
        """Free the kept caches: no prompt will extend them (rollout() calls it when every branch has stopped)."""
        self.kept, self.kept_bytes = [], 0

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[Completion]:
        policy = self.accelerator.unwrap_model(self.model)
        was_training = policy.training
        policy.eval()
        version = weights_version(policy)
        kept = self.kept if version == self.weights_version else []
        self.kept, self.kept_bytes = [], 0  # a cache this call does not extend is freed: its branch has stopped
        self.weights_version = version
        completions = []
        for first in range(0, len(prompts), self.args.sample_batch_size):
            chunk = [list(p) for p in prompts[first : first + self.args.sample_batch_size]]
            cached, cache = [0] * len(chunk), None
            if self.budget_bytes and min(map(len, chunk)) > 1:  # a 1-token prompt has nothing to cache
                cached, cache = self._prompt_caches(policy, chunk, max_new_tokens, kept)
            new_tokens, logprobs = self._generate(policy, chunk, cached, cache, max_new_tokens)
            replies = [
                reply(row_tokens, row_logprobs, self.stops, self.tokenizer)
                for row_tokens, row_logprobs in zip(new_tokens.tolist(), logprobs.tolist())
            ]
            if cache is not None:
                self._keep(chunk, cached, replies, cache, new_tokens.shape[1])
            completions += replies
        policy.train(was_training)
        return completions

    @staticmethod
    def _widths(chunk: list[list[int]], cached: list[int]) -> tuple[int, int]:
        """Columns of the cached parts (right-aligned) and of the rest of the prompts (right-aligned after them)."""
        return max(cached), max(len(p) - c for p, c in zip(chunk, cached))

    def _generate(self, policy, chunk, cached: list[int], cache, max_new_tokens: int):
        """New tokens [rows, steps] and their logprobs. Row i's first cached[i] tokens are in `cache` (None: all 0);
        each part is left-padded, so a row with a shorter cache has padding in the middle (masked out; positions
        follow the mask)."""
        from transformers import LogitsProcessorList

        width_cached, width_new = self._widths(chunk, cached)
        padded = [
            ([self.pad_id] * (width_cached - c) + p[:c] + [self.pad_id] * (width_new - len(p) + c) + p[c:],
             [0] * (width_cached - c) + [1] * c + [0] * (width_new - len(p) + c) + [1] * (len(p) - c))
            for p, c in zip(chunk, cached)
        ]  # fmt: skip
        input_ids, attention_mask = (torch.tensor(rows, device=self.accelerator.device) for rows in zip(*padded))
        recorder = SampledTokenLogprobs(self.args.temperature)
        # Every sampling field is passed: the model's own generation_config would otherwise apply.
        sequences = policy.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            disable_compile=True,  # a static cache would compile on GPU, once per shape
            do_sample=not self.greedy,
            temperature=self.args.temperature,
            top_p=self.args.top_p,
            top_k=0,
            repetition_penalty=1.0,
            max_new_tokens=max_new_tokens,
            logits_processor=LogitsProcessorList([recorder]),
            pad_token_id=self.pad_id,
            eos_token_id=self.stops,
            synced_gpus=False,  # under --fsdp the weights are gathered (gather_weights): each process samples alone
        )
        return sequences[:, input_ids.shape[1] :], recorder.logprobs(sequences)

    def _prompt_caches(self, policy, chunk: list[list[int]], max_new_tokens: int, kept) -> tuple[list[int], object]:
        """Per prompt the number of its tokens cached, and a StaticCache holding them (right-aligned) with room for
        the rest and the reply: the longest kept sequence the prompt starts with, or else all its tokens but the last,
        prefilled once per distinct prompt."""
        from transformers import StaticCache

        rows: list[RowCache | None] = []
        cold: dict[tuple[int, ...], list[int]] = {}  # distinct prompt -> its rows
        used = set()
        for i, prompt in enumerate(chunk):
            hits = [
                entry
                for entry in kept
                if len(tokens := entry[0]) < len(prompt)
                and prompt[len(tokens) - 1] == tokens[-1]  # cheap first: siblings differ there
                and prompt[: len(tokens)] == tokens
            ]
            if hits:
                tokens, row_cache = entry = max(hits, key=lambda hit: len(hit[0]))
                rows.append(row_cache)
                used.add(id(entry))
                self.stats["reused"] += len(tokens)
            else:
                rows.append(None)
                cold.setdefault(tuple(prompt[:-1]), []).append(i)
        # Copied into this chunk's cache: freed now (a prompt of a later chunk extending one again re-prefills).
        kept[:] = [entry for entry in kept if id(entry) not in used]
        if cold:
            for row_ids, row_cache in zip(cold.values(), self._prefill(policy, [list(p) for p in cold])):
                for i in row_ids:
                    rows[i] = row_cache
        cached = [row_cache[0][0].shape[1] for row_cache in rows]
        self.stats["prefilled"] += sum(len(p) - c for p, c in zip(chunk, cached))
        width_cached, width_new = self._widths(chunk, cached)
        # generate() feeds the prompts' other tokens and all but the last token it samples
        cache = StaticCache(config=policy.config, max_cache_len=width_cached + width_new + max_new_tokens - 1)
        for layer, (keys0, _) in enumerate(rows[0]):
            keys = keys0.new_zeros(len(chunk), keys0.shape[0], width_cached, keys0.shape[-1])
            values = torch.zeros_like(keys)
            for i, (row_cache, c) in enumerate(zip(rows, cached)):
                keys[i, :, width_cached - c :], values[i, :, width_cached - c :] = row_cache[layer]
            cache.update(keys, values, layer)
        return cached, cache

    def _prefill(self, policy, prompts: list[list[int]]) -> list[RowCache]:
        """Each prompt's keys and values (views into one batch cache): one forward, right-padded."""
        from transformers import DynamicCache

        width, cache = max(map(len, prompts)), DynamicCache()
        self.stats["prefilled"] += sum(map(len, prompts))
        policy(
            input_ids=torch.tensor(
                [p + [self.pad_id] * (width - len(p)) for p in prompts], device=self.accelerator.device
            ),
            attention_mask=torch.tensor(
                [[1] * len(p) + [0] * (width - len(p)) for p in prompts], device=self.accelerator.device
            ),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # the cache is all that is wanted: no [rows, tokens, vocab] logits
        )
        return [
            tuple((layer.keys[i, :, : len(p)], layer.values[i, :, : len(p)]) for layer in cache.layers)
            for i, p in enumerate(prompts)
        ]

    def _keep(self, chunk, cached: list[int], replies: list[Completion], cache, generated: int) -> None:
        """Keep each row's cache of its prompt + the reply tokens generate() fed back (all but the last it sampled),
        the padding left out, in order while they fit in the budget."""
        width_cached, width_new = self._widths(chunk, cached)
        token_bytes = sum(layer.keys[0, :, :1].nbytes + layer.values[0, :, :1].nbytes for layer in cache.layers)
        for i, (prompt, c, completion) in enumerate(zip(chunk, cached, replies)):
            fed = min(len(completion.tokens), generated - 1)
            size = (len(prompt) + fed) * token_bytes
            if self.kept_bytes + size > self.budget_bytes:
                self.stats["not_kept"] += 1
                continue
            self.kept_bytes += size
            parts = (
                slice(width_cached - c, width_cached),
                slice(width_cached + width_new - len(prompt) + c, width_cached + width_new + fed),
            )
            row_cache = tuple(
                (
                    torch.cat([layer.keys[i, :, part] for part in parts], 1),
                    torch.cat([layer.values[i, :, part] for part in parts], 1),
                )
                for layer in cache.layers
            )
            self.kept.append((prompt + completion.tokens[:fed], row_cache))


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vllm serve's --max-lora-rank takes


class ServerSampler:
    """SampleFn through a vLLM server's OpenAI API, as vLLM 0.20 serves it (vllm/entrypoints/openai:
    /v1/models, /v1/completions, /v1/load_lora_adapter, /v1/unload_lora_adapter). Prompts go as token ids and the
    sampled ids come back with their logprobs (return_tokens_as_token_ids), so nothing is re-tokenised. The server
    samples with the current adapter, named after its weights: whenever the LoRA parameters have changed (an
    optimizer step, a resumed checkpoint) the main process saves them and loads them under the new name, unloading
    the one loaded --async-steps + 1 names before (rollouts in flight may still use the others); the other processes
    wait until the server lists the new name. pinned(name) samples with one loaded name whatever the weights are now."""

    def __init__(self, model, tokenizer, accelerator, args, greedy: bool = False):
        self.model, self.tokenizer, self.accelerator, self.args = model, tokenizer, accelerator, args
        self.url, self.greedy = args.sampler_url.rstrip("/"), greedy
        self.adapter_dir = Path(args.sampler_adapter_dir or Path(args.output_dir) / "sampler_adapters").resolve()
        self.adapter_name, self.weights_version, self.started = None, None, False
        self.loaded: list[str] = []  # the names this sampler loaded and keeps, oldest first
        self.stops = stop_token_ids(tokenizer, accelerator.unwrap_model(model))
        served = self._served_models()
        base = next((c for c in served if c.get("parent") is None and serves(c, args.model)), None)
        if base is None:
            raise ValueError(
                f"--model {args.model}, but the server at --sampler-url {self.url} serves "
                f"{sorted(c['id'] for c in served)}: start `vllm serve {args.model}` there"
            )
        self.max_model_len = base.get("max_model_len") or math.inf
        if args.max_trajectory_tokens > self.max_model_len:
            raise ValueError(
                f"--max-trajectory-tokens {args.max_trajectory_tokens} does not fit the server's context "
                f"(--max-model-len {self.max_model_len}): restart vllm serve with --max-model-len >= "
                f"{args.max_trajectory_tokens}, or lower --max-trajectory-tokens"
            )
        if not args.recompute_logprobs and (args.temperature != 1.0 or args.top_p < 1.0):
            print(
                "[start] WARNING: --no-recompute-logprobs at --temperature / --top-p other than 1: the server's "
                "logprobs are the loss's old logprobs only if vllm serve runs with --logprobs-mode "
                "processed_logprobs (no route reports its mode)",
                file=sys.stderr,
            )
        self.sync_adapter()  # the first load proves that runtime LoRA loading works and that the rank fits
        if args.async_steps and not greedy:
            self._check_max_loras()
        self.started = True

    def _check_max_loras(self) -> None:
        """--async-steps: the episodes sampled ahead use an older adapter while evaluation and the self labeller use
        the current one, so the server must run two adapters in one batch (--max-loras 2; with 1 they would take
        turns). No route reports it; GET /metrics (the server's root) does, in vllm:lora_requests_info's max_lora
        label, once a request has run: one one-token completion first."""
        asyncio.run(self._complete_all([[self.stops[0]]], 1, self.adapter_name))
        import httpx

        response = httpx.get(self.url.removesuffix("/v1") + "/metrics", timeout=self.args.sampler_timeout_s)
        found = re.findall(r'vllm:lora_requests_info\{[^}]*max_lora="(\d+)"', response.text)
        flag = f"--async-steps {self.args.async_steps}"
        if response.status_code != 200 or not found:
            raise ValueError(
                f"{flag}: the server's --max-loras is not in GET /metrics (vllm:lora_requests_info; was it started "
                f"with --disable-log-stats?): start vllm serve with --max-loras 2 and its metrics on"
            )
        if int(found[0]) < 2:
            raise ValueError(
                f"{flag}: the server runs --max-loras {found[0]}: restart vllm serve with --max-loras 2 (the "
                "episodes sampled ahead use an older adapter while evaluation and the self labeller use the current one)"
            )

    def _control(self, method: str, path: str, body: dict | None = None):
        """One call to a control route. At start, no answer fails the run at once (start vLLM first); mid-run the
        server may be restarting: the call is repeated (backoff 0.5 s doubling, at most 8 s) until
        --sampler-deadline-s."""
        import httpx

        deadline, wait = time.monotonic() + self.args.sampler_deadline_s, 0.5
        while True:
            try:
                return httpx.request(method, self.url + path, json=body, timeout=self.args.sampler_timeout_s)
            except httpx.TransportError as error:
                problem = f"no server answers {method} {path} ({type(error).__name__}: {error})"
                if not self.started:
                    raise ValueError(
                        f"--sampler-url {self.url}: {problem}; start vLLM first (README: Sampling through vLLM)"
                    ) from error
                if time.monotonic() + wait > deadline:
                    raise RuntimeError(
                        f"--sampler-url {self.url}: {problem} within --sampler-deadline-s "
                        f"{self.args.sampler_deadline_s} s (retries included)"
                    ) from error
            time.sleep(wait)
            wait = min(2 * wait, 8.0)

    def _served_models(self) -> list[dict]:
        response = self._control("GET", "/models")
        if response.status_code != 200:
            raise ValueError(
                f"--sampler-url {self.url}: GET /models answered {response.status_code} "
                f"({error_message(response)}); the URL must be the OpenAI API root, ending in /v1"
            )
        return response.json()["data"]

    def sync_adapter(self) -> None:
        """Make the server's copy of the adapter the current one, if the LoRA parameters changed in place since
        the last call (torch counts in-place writes per tensor: optimizer steps, checkpoint loads) or the server
        no longer serves it (it was restarted)."""
        policy = self.accelerator.unwrap_model(self.model)
        version = weights_version(policy)
        served = {card["id"] for card in self._served_models()}
        if version == self.weights_version and self.adapter_name in served:
            return
        digest = adapter_sha256(trained_weights(policy))
        name = f"{self.args.exp_name}-{self.args.lora_alpha}-{digest[:16]}"
        if self.accelerator.is_main_process:
            if name not in served:
                save_adapter(policy, self.adapter_dir / name)
                self._load_adapter(name)
            self.loaded = [kept for kept in self.loaded if kept != name] + [name]
            while len(self.loaded) > self.args.async_steps + 1:
                old = self.loaded.pop(0)
                self._control("POST", "/unload_lora_adapter", {"lora_name": old})  # 404: already gone
                shutil.rmtree(self.adapter_dir / old, ignore_errors=True)
        else:
            self._wait_until_served(name)
        self.adapter_name, self.weights_version = name, version

    def _load_adapter(self, name: str) -> None:
        path = self.adapter_dir / name
        response = self._control("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        if response.status_code == 200 or (
            response.status_code == 400 and name in {card["id"] for card in self._served_models()}
        ):
            return  # (400: another process or thread loaded it first)
        message = error_message(response)
        if response.status_code == 404 and '"error"' not in response.text:  # FastAPI's own 404: no such route
            problem = (
                "the server does not allow runtime LoRA loading: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"
            )
        elif "max_lora_rank" in message:
            fitting = [rank for rank in VLLM_LORA_RANKS if rank >= self.args.lora_rank]
            problem = f"--lora-rank {self.args.lora_rank} is above the server's --max-lora-rank; " + (
                f"restart vllm serve with --max-lora-rank {fitting[0]}"
                if fitting
                else f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}"
            )
        elif "not enabled" in message.lower():
            problem = "the server was started without LoRA: start vllm serve with --enable-lora"
        elif response.status_code == 404:
            problem = f"the server cannot read {path}: --sampler-adapter-dir must be a directory the server sees"
        else:
            problem = "loading the adapter failed"
        raise ValueError(
            f"--sampler-url {self.url}: {problem} (POST /load_lora_adapter: {response.status_code} {message})"
        )

    def _wait_until_served(self, name: str) -> None:
        deadline = time.monotonic() + self.args.sampler_deadline_s
        while name not in {card["id"] for card in self._served_models()}:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"--sampler-url {self.url}: the main process did not load adapter {name} within "
                    f"--sampler-deadline-s {self.args.sampler_deadline_s} s"
                )
            time.sleep(0.5)

    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[Completion]:
        self.sync_adapter()
        return asyncio.run(self._complete_all(prompts, max_new_tokens, self.adapter_name)) if prompts else []

    def pinned(self, adapter: str) -> SampleFn:
        """A SampleFn that samples with the loaded adapter `adapter`, whatever the weights are now (AsyncRollouts'
        thread: one version per episode). It never syncs: the trainer's thread loads the adapters."""

        def sample(prompts: list[list[int]], max_new_tokens: int) -> list[Completion]:
            return asyncio.run(self._complete_all(prompts, max_new_tokens, adapter)) if prompts else []

        return sample

    def _restore(self, adapter: str) -> None:
        """The server no longer serves `adapter` (it was restarted): loaded again from its saved directory, by
        whichever process or thread needs it first."""
        if adapter not in {card["id"] for card in self._served_models()}:
            self._load_adapter(adapter)

    async def _complete_all(self, prompts: list[list[int]], max_new_tokens: int, adapter: str) -> list[Completion]:
        """One burst with adapter `adapter`: at most --sampler-concurrency requests in flight, all answered by
        --sampler-deadline-s. openai's client retries lost connections, timeouts, 408/409/429 and 5xx answers with
        exponential backoff (until the deadline: max_retries is its own cap); a request the server refuses (another
        4xx) fails at once, except a first 404: a server restarted during the burst no longer has the adapter (loaded
        again, once)."""
        args = self.args
        semaphore, reload = asyncio.Semaphore(args.sampler_concurrency), asyncio.Lock()
        client = openai.AsyncOpenAI(
            base_url=self.url, api_key="EMPTY", timeout=args.sampler_timeout_s, max_retries=1000
        )
        try:
            async with client, asyncio.timeout(args.sampler_deadline_s):
                return list(
                    await asyncio.gather(
                        *(self._complete(client, p, max_new_tokens, adapter, semaphore, reload) for p in prompts)
                    )
                )
        except TimeoutError:
            raise RuntimeError(
                f"--sampler-url {self.url}: a completion was not answered within --sampler-deadline-s "
                f"{args.sampler_deadline_s} s (retries included)"
            ) from None

    async def _complete(self, client, prompt: list[int], max_new_tokens: int, adapter, semaphore, reload):
        try:
            async with semaphore:
                try:
                    response = await self._create(client, prompt, max_new_tokens, adapter)
                except openai.NotFoundError:  # the adapter is gone (a restarted server): load it, ask once more
                    async with reload:  # one reload per burst: the next holder finds the adapter served
                        await asyncio.to_thread(self._restore, adapter)
                    response = await self._create(client, prompt, max_new_tokens, adapter)
        except openai.APIStatusError as error:
            raise RuntimeError(
                f"--sampler-url {self.url}: the server refused a completion request "
                f"({error.status_code} {error_message(error.response)})"
            ) from error
        return self._completion(response.model_dump())

    def _create(self, client, prompt: list[int], max_new_tokens: int, adapter: str):
        args = self.args
        return client.completions.create(  # every sampling field is sent: the server's defaults
            model=adapter,  # come from the model's generation_config
            prompt=list(prompt),
            max_tokens=min(max_new_tokens, self.max_model_len - len(prompt)),  # >= 1: --max-trajectory-tokens
            temperature=0.0 if self.greedy else args.temperature,
            top_p=1.0 if self.greedy else args.top_p,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            logprobs=0,
            extra_body={
                "top_k": 0,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "return_tokens_as_token_ids": True,
                "stop_token_ids": self.stops,
            },
        )

    def _completion(self, payload: dict) -> Completion:
        logprobs = payload["choices"][0].get("logprobs") or {}
        names, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
        if len(names) != len(values) or None in values or not all(str(n).startswith("token_id:") for n in names):
            raise RuntimeError(
                f"--sampler-url {self.url}: the completion came back without token ids and logprobs "
                "(return_tokens_as_token_ids, logprobs); is it a vLLM server?"
            )
        tokens = [int(n.removeprefix("token_id:")) for n in names]
        return reply(tokens, [float(x) for x in values], self.stops, self.tokenizer)


def serves(card: dict, model: str) -> bool:
    """Whether a base model's card in /v1/models is --model: by name, or as the same local directory (`tiny-agent`
    is served by its path; vLLM reports the path as it was given, relative to the server's directory)."""
    path = Path(resolve_model(model))
    for name in filter(None, (card["id"], card.get("root"))):
        if name in (model, str(path)) or (path.is_dir() and Path(name).resolve() == path.resolve()):
            return True
    return False


def error_message(response) -> str:
    """The message of an error response: vLLM's {"error": {"message"}} (older: {"message"}), FastAPI's {"detail"}."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else body.get("message") or body.get("detail")
        if message:
            return str(message)
    return response.text[:500]


# =============================================================================================
# Training step: teacher-forced logprobs, datums, the micro-batched optimizer step, metrics over processes
# =============================================================================================
def token_budget_batches(lengths: Sequence[int], micro_batch_tokens: int) -> list[list[int]]:
    """Indices grouped so that rows x longest row <= micro_batch_tokens (a longer row goes alone).
    Sorted by length so that padding stays small."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > micro_batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


LOGIT_CHUNK = 256  # positions whose fp32 vocabulary logits exist at once, in the forward and the backward pass


def teacher_forced(
    policy, rows: list[list[int]], temperature: float, pad_id: int, device, needed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, hidden states) of a right-padded batch: the teacher-forced logprob of each token given the ones
    before it, at `temperature`, at the `needed` positions ([rows, width] bools; None: every token), and the policy's
    last hidden states [rows, width, d] (state t has read token t: it predicts token t + 1, and a head may read it).
    The transformer runs once over the whole batch; the lm_head, the temperature and the log-softmax run only at the
    needed positions, LOGIT_CHUNK at a time (recomputed in the backward pass), so no [width, vocabulary] fp32 logits
    ever exist. Column 0 has no prediction; it and every position not needed are 0. The model's logits must be
    lm_head(last hidden state) (check_model refuses others)."""
    from torch.utils.checkpoint import checkpoint

    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], device=device)
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    wanted = attention_mask.bool() if needed is None else needed.to(device).bool() & attention_mask.bool()
    wanted[:, 0] = False
    model = causal_lm(policy)  # peft: LoRA layers inside
    # Called through the causal LM (under --fsdp its root, which manages the embeddings' and lm_head's shards) with
    # logits at one position only; the decoder's last hidden states are taken on the way (not every layer's).
    decoded = []
    hook = model.get_decoder().register_forward_hook(lambda module, args, out: decoded.append(out.last_hidden_state))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    (hidden,) = decoded
    row_index, column = wanted.nonzero(as_tuple=True)
    states, targets = hidden[row_index, column - 1], input_ids[row_index, column]  # state t-1 predicts token t
    head = model.get_output_embeddings()

    def chunk_logprobs(chunk_states: torch.Tensor, chunk_targets: torch.Tensor) -> torch.Tensor:
        logits = head(chunk_states).float() / temperature
        return logits.gather(-1, chunk_targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    chunks = []
    for first in range(0, len(targets), LOGIT_CHUNK):
        part = (states[first : first + LOGIT_CHUNK], targets[first : first + LOGIT_CHUNK])
        grads = torch.is_grad_enabled() and part[0].requires_grad
        chunks.append(checkpoint(chunk_logprobs, *part, use_reentrant=False) if grads else chunk_logprobs(*part))
    logprobs = torch.zeros(input_ids.shape, dtype=torch.float32, device=device)
    if chunks:
        logprobs = logprobs.index_put((row_index, column), torch.cat(chunks))
    return logprobs, hidden


def forward_logprobs(
    policy, rows: list[list[int]], temperature: float, pad_id: int, device, needed: torch.Tensor | None = None
) -> torch.Tensor:
    """teacher_forced's logprobs alone."""
    return teacher_forced(policy, rows, temperature, pad_id, device, needed)[0]


@torch.no_grad()
def sequence_logprobs(
    model,
    accelerator,
    sequences: list[list[int]],
    temperature: float,
    pad_id: int,
    micro_batch_tokens: int,
    needed: Sequence[Sequence[bool]] | None = None,
) -> list[list[float]]:
    """Per-token logprobs of whole sequences under the current policy (no gradient), at the needed positions (per
    sequence, one bool per token; None: all); 0 elsewhere."""
    policy = accelerator.unwrap_model(model)
    was_training = policy.training
    policy.eval()
    result: list[list[float]] = [[] for _ in sequences]
    for batch in token_budget_batches([len(s) for s in sequences], micro_batch_tokens):
        width = max(len(sequences[i]) for i in batch)
        wanted = None
        if needed is not None:
            wanted = torch.tensor([list(needed[i]) + [False] * (width - len(needed[i])) for i in batch])
        logprobs = forward_logprobs(
            policy, [list(sequences[i]) for i in batch], temperature, pad_id, accelerator.device, wanted
        )
        for row, i in enumerate(batch):
            result[i] = logprobs[row, : len(sequences[i])].tolist()
    policy.train(was_training)
    return result


@torch.no_grad()
def hidden_states_at(rt, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The policy's last hidden states (no gradient) of each sequence at its given token positions, [positions, d] per
    sequence, for an algorithm's head to read (state t has read token t). Token-budget micro-batches; no lm_head."""
    args, policy = rt.args, rt.accelerator.unwrap_model(rt.model)
    was_training = policy.training
    policy.eval()
    result: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    for batch in token_budget_batches([len(s) for s in sequences], args.micro_batch_tokens):
        rows = [list(sequences[i]) for i in batch]
        no_logprobs = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.bool)
        _, hidden = teacher_forced(
            policy, rows, args.temperature, rt.tokenizer.pad_token_id, rt.accelerator.device, no_logprobs
        )
        for row, i in enumerate(batch):
            result[i] = hidden[row, list(positions[i])]
    policy.train(was_training)
    return result


@dataclasses.dataclass
class Datum:
    """One training sequence: per token the old (sampling) logprob, the advantage and whether it is trained;
    ref_logprobs (the base model's, for a KL loss term) when the loss needs them; `extra`: an algorithm's own per-token
    fields (name -> one float per token, e.g. a value head's targets), padded and handed to the loss by name."""

    tokens: list[int]
    old_logprobs: list[float]
    advantages: list[float]
    mask: list[float]
    ref_logprobs: list[float] | None = None
    extra: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    version: int = 0  # --async-steps: the weights whose adapter sampled it (its trajectory's version)

    def __post_init__(self):
        n = len(self.tokens)
        if not (len(self.old_logprobs) == len(self.advantages) == len(self.mask) == n) or n < 2:
            raise ValueError(f"datum fields must have one entry per token (>= 2 tokens), got {n} tokens")
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"ref_logprobs must have one entry per token ({n}), got {len(self.ref_logprobs)}")
        for name, values in self.extra.items():
            if name in DATUM_FIELDS or len(values) != n:
                raise ValueError(
                    f"extra field {name!r} must have one entry per token ({n}, got {len(values)}) and a name other "
                    f"than {DATUM_FIELDS}"
                )
        if self.mask[0]:
            raise ValueError("the first token of a datum has no prediction and cannot be trained")


DATUM_FIELDS = ("old_logprobs", "advantages", "mask", "ref_logprobs", "hidden_states")  # names the loss's batch uses


def trained_logprobs(rt, datums: Sequence[Datum], reference: bool = False) -> list[list[float]]:
    """Per-token logprobs of the datums' trained tokens (0 elsewhere; no gradient) under the current policy, or with
    reference=True under the base model (the LoRA adapter disabled: a KL term's reference)."""
    args, policy = rt.args, rt.accelerator.unwrap_model(rt.model)
    tokens, trained = [d.tokens for d in datums], [[m > 0 for m in d.mask] for d in datums]
    with policy.disable_adapter() if reference else contextlib.nullcontext():
        return sequence_logprobs(
            rt.model,
            rt.accelerator,
            tokens,
            args.temperature,
            rt.tokenizer.pad_token_id,
            args.micro_batch_tokens,
            trained,
        )


def refresh_old_logprobs(rt, datums: list[Datum], always: bool = False) -> dict:
    """The datums' old logprobs become the trainer's own: always (an update of several optimizer steps measures its
    ratios from the policy before the first, as veRL does), or with --sampler vllm and --recompute-logprobs (the
    server's kernels and precision differ). With the server, the drift |server - trainer| over the trained tokens is
    reported. With --async-steps the data is off-policy: behaviour_logprobs."""
    args = rt.args
    if datums and args.async_steps:
        return behaviour_logprobs(rt, datums)
    if not datums or not (always or (args.sampler == "vllm" and args.recompute_logprobs)):
        return {}
    drift = replace_old_logprobs(datums, trained_logprobs(rt, datums))
    if args.sampler != "vllm":
        return {}
    return drift_metrics(drift)


def replace_old_logprobs(datums: list[Datum], logprobs: list[list[float]]) -> list[float]:
    """The datums' old logprobs of their trained tokens become `logprobs`; returns |old - new| of every one."""
    drift = []
    for datum, fresh in zip(datums, logprobs):
        drift += [abs(old - new) for old, new, m in zip(datum.old_logprobs, fresh, datum.mask) if m]
        datum.old_logprobs = [new if m else old for old, new, m in zip(datum.old_logprobs, fresh, datum.mask)]
    return drift


def drift_metrics(drift: list[float]) -> dict:
    return {
        "rollout/logprob_drift_mean": math.fsum(drift) / max(1, len(drift)),
        "rollout/logprob_drift_max": Max(max(drift, default=0.0)),
    }


def behaviour_logprobs(rt, datums: list[Datum]) -> dict:
    """--async-steps: the ratio's old logprobs stay the behaviour policy's, the adapter version that sampled each datum
    (the server's, or with --recompute-logprobs the trainer's under that version's weights, which AsyncRollouts keeps:
    the drift against the server is reported as in the synchronous loop), whatever --ppo-epochs and --mini-batches.
    --off-policy-loss decoupled then makes the old logprobs the weights' before this update (the proximal policy) and
    gives every trained token the behaviour weight min(exp(proximal - behaviour), --behaviour-weight-cap)."""
    args, metrics = rt.args, {}
    if args.recompute_logprobs:
        drift = []
        for version in sorted({datum.version for datum in datums}):
            rows = [datum for datum in datums if datum.version == version]
            with rt.rollouts.weights_of(version):
                drift += replace_old_logprobs(rows, trained_logprobs(rt, rows))
        metrics |= drift_metrics(drift)
    if args.off_policy_loss == "decoupled":
        weights = []
        for datum, proximal in zip(datums, trained_logprobs(rt, datums)):
            datum.extra["behaviour_weight"] = [
                min(math.exp(p - b), args.behaviour_weight_cap) if m else 0.0
                for p, b, m in zip(proximal, datum.old_logprobs, datum.mask)
            ]
            weights += [w for w, m in zip(datum.extra["behaviour_weight"], datum.mask) if m]
            datum.old_logprobs = [p if m else b for p, b, m in zip(proximal, datum.old_logprobs, datum.mask)]
        metrics["train/behaviour_weight_mean"] = math.fsum(weights) / max(1, len(weights))
        metrics["train/behaviour_weight_capped"] = sum(w >= args.behaviour_weight_cap for w in weights) / max(
            1, len(weights)
        )
    return metrics


def broadcast_to_tokens(step_advantages: Sequence[Sequence[float]], step_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) step ids (-1 = context) -> (B, L) float advantages: every token generated at step k
    gets its row's step_advantages[k]; context tokens get 0."""
    if step_ids.dim() != 2 or len(step_advantages) != step_ids.shape[0]:
        raise ValueError(
            f"step_ids must be (B, L) with B = {len(step_advantages)} rows, got shape {tuple(step_ids.shape)}"
        )
    width = max((len(row) for row in step_advantages), default=0)
    table = torch.zeros(len(step_advantages), width + 1, dtype=torch.float32)  # last column: 0 for context
    for i, row in enumerate(step_advantages):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    lengths = torch.tensor([len(row) for row in step_advantages]).unsqueeze(1)
    ids = step_ids.long().cpu()
    if bool((ids >= lengths).any()):
        raise ValueError("step_ids refer to a step beyond the advantages given for that row")
    index = torch.where(ids >= 0, ids, torch.full_like(ids, width))
    return table.gather(1, index).to(step_ids.device)


def trajectory_datums(trajectories: Sequence[Trajectory], step_advantages: Sequence[Sequence[float]]):
    """One datum per trajectory (its saved prefix and its steps): every token generated at its step k is trained with
    its step_advantages[k]; the prompts and the saved prefix are context."""
    sequences = [traj.sequence() for traj in trajectories]
    width = max((len(tokens) for tokens, _, _ in sequences), default=0)
    step_ids = torch.tensor([ids + [-1] * (width - len(ids)) for _, _, ids in sequences], dtype=torch.long)
    token_advantages = broadcast_to_tokens(step_advantages, step_ids.view(len(sequences), width)).tolist()
    return [
        Datum(
            list(tokens),
            list(old_logprobs),
            advantages[: len(tokens)],
            [1.0 if k >= 0 else 0.0 for k in ids],
            version=traj.version,
        )
        for (tokens, old_logprobs, ids), advantages, traj in zip(sequences, token_advantages, trajectories)
    ]


def trained_parameters(policy, heads: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer steps, in its order: the policy's trainable parameters, then the algorithm's heads'."""
    return [p for module in (policy, heads) for p in module.parameters() if p.requires_grad]


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """clip_grad_norm_ over the trained parameters; returns the norm before clipping. Under --fsdp the policy's
    gradients are shards (DTensors, their norm a collective) and the heads' whole on every process: one norm of both."""
    shards = [p.grad for p in params if p.grad is not None and isinstance(p.grad, DTensor)]
    if not shards:
        return torch.nn.utils.clip_grad_norm_(params, max_norm).item()
    replicated = [p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
    norms = [torch.nn.utils.get_total_norm(shards).full_tensor()]
    norms += [torch.nn.utils.get_total_norm(replicated)] if replicated else []
    norm = torch.linalg.vector_norm(torch.stack(norms)).item()
    coefficient = min(max_norm / (norm + 1e-6), 1.0)  # clip_grad_norm_'s
    for grad in shards + replicated:
        grad.mul_(coefficient)
    return norm


# loss_fn(logprobs, batch, total_tokens) -> (loss, stats); see train_step
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], float], tuple[torch.Tensor, dict[str, float]]]


def train_step(rt, datums: list[Datum], loss_fn: LossFn) -> dict:
    """One optimizer step of rt.model on all datums (token-budget micro-batches, gradient accumulation).

    The algorithm's loss_fn gets the policy's teacher-forced logprobs of one micro-batch [rows, width], the
    micro-batch's right-padded datum fields (old_logprobs, advantages, mask; ref_logprobs when every datum has them;
    each `extra` field by its name) with hidden_states, the policy's last hidden states [rows, width, d] (with their
    gradient: a head of rt.heads may read them where it needs), and the number of trained tokens of the whole update on
    all processes; it returns the micro-batch's share of the update's loss and per-token sums, logged as train/{name}
    means. The step moves the policy and rt.heads. A non-finite loss or gradient norm skips the step."""
    from accelerate.utils import gather_object

    args, accelerator, optimizer, pad_id = rt.args, rt.accelerator, rt.optimizer, rt.tokenizer.pad_token_id
    policy = accelerator.unwrap_model(rt.model)  # gradients are summed across processes by hand below
    policy.train()
    params = [p for group in optimizer.param_groups for p in group["params"]]  # --fsdp: the shards
    device = accelerator.device
    local = [sum(sum(d.mask) for d in datums), sum(len(d.tokens) for d in datums)]
    total_tokens, sequence_tokens = accelerator.reduce(torch.tensor(local, dtype=torch.float64, device=device)).tolist()
    optimizer.zero_grad(set_to_none=True)
    if total_tokens == 0:
        return {"train/tokens": 0.0, "train/sequence_tokens": 0.0, "train/nonfinite_skipped": 0.0}
    loss_sum = ratio_sum = ratio_max = 0.0
    stat_sums: dict[str, float] = {}
    batches = token_budget_batches([len(d.tokens) for d in datums], args.micro_batch_tokens)
    units = fsdp_modules(policy)
    for module in units[1:]:  # --fsdp: a block's whole weights are freed after its forward (the root's are kept)
        module.set_reshard_after_forward(True, recurse=False)
    if units:  # every sharded forward and backward is a collective: each process runs as many micro-batches
        most = accelerator.reduce(torch.tensor([len(batches)], device=device), "max").item()
        for _ in range(most - len(batches)):  # a no-op pass: zero gradients
            idle, _ = teacher_forced(policy, [[pad_id, pad_id]], args.temperature, pad_id, device)
            (idle.sum() * 0.0).backward()
    for batch in batches:
        rows = [datums[i] for i in batch]
        width = max(len(d.tokens) for d in rows)
        fields = {name: [getattr(d, name) for d in rows] for name in ("old_logprobs", "advantages", "mask")}
        if all(d.ref_logprobs is not None for d in rows):
            fields["ref_logprobs"] = [d.ref_logprobs for d in rows]
        if len(names := {tuple(sorted(d.extra)) for d in rows}) > 1:
            raise ValueError(f"the datums of one micro-batch carry different extra fields: {sorted(names)}")
        fields |= {name: [d.extra[name] for d in rows] for name in rows[0].extra}
        padded = {
            name: torch.tensor([row + [0.0] * (width - len(row)) for row in values], device=device)
            for name, values in fields.items()
        }
        trained = padded["mask"] > 0
        logprobs, padded["hidden_states"] = teacher_forced(
            policy, [d.tokens for d in rows], args.temperature, pad_id, device, trained
        )
        logprobs = torch.where(trained, logprobs, padded["old_logprobs"])  # ratio 1 where nothing is trained
        loss, stats = loss_fn(logprobs, padded, total_tokens)
        loss.backward()
        loss_sum += loss.item()
        ratio = torch.exp(logprobs.detach() - padded["old_logprobs"]) * padded["mask"]
        ratio_sum += ratio.sum().item()
        ratio_max = max(ratio_max, ratio.max().item())
        for name, value in stats.items():
            stat_sums[name] = stat_sums.get(name, 0.0) + float(value)
    names = sorted(stat_sums)
    replicated = [p for p in params if not isinstance(p, DTensor)]  # --fsdp: the shards' gradients are summed already
    if accelerator.num_processes > 1 and replicated:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in replicated])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p in replicated:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
    if accelerator.num_processes > 1:
        names = sorted({name for rank_names in gather_object([names]) for name in rank_names})
    grad_norm = clip_gradients(params, args.max_grad_norm)
    sums = [loss_sum, ratio_sum] + [stat_sums.get(name, 0.0) for name in names]
    loss_total, ratio_total, *stat_totals = accelerator.reduce(
        torch.tensor(sums, dtype=torch.float64, device=device), "sum"
    ).tolist()
    ratio_max = (
        accelerator.reduce(torch.tensor([ratio_max], device=device), "max").item()
        if accelerator.num_processes > 1
        else ratio_max
    )
    finite = math.isfinite(loss_total) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    elif accelerator.is_main_process:
        print(f"[train] non-finite loss {loss_total} or gradient norm {grad_norm}: step skipped", file=sys.stderr)
    optimizer.zero_grad(set_to_none=True)
    gather_weights(policy)
    return {
        "train/loss": loss_total,
        "train/tokens": total_tokens,
        "train/sequence_tokens": sequence_tokens,  # the forward pass's tokens, context included (all processes)
        "train/grad_norm": grad_norm,
        "train/ratio_mean": ratio_total / total_tokens,
        "train/ratio_max": ratio_max,
        **{f"train/{name}": total / total_tokens for name, total in zip(names, stat_totals)},
        "train/nonfinite_skipped": 0.0 if finite else 1.0,
    }


def ppo_clip_loss(
    logprobs: torch.Tensor,
    batch: dict[str, torch.Tensor],
    total_tokens: float,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    kl_loss_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A train_step loss (ppo_update's; ppo.py's policy_loss adds its value loss): PPO-clip per generated token, token
    mean over the whole update (veRL's token-mean).

    ratio = exp(logp - old_logp), loss = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high)) (clip-higher when
    eps_high > eps); dual clip caps the loss of a token with A < 0 at -A * c, so a huge ratio on a bad token cannot
    dominate; a batch with a behaviour_weight field (--off-policy-loss decoupled: behaviour_logprobs) multiplies it in;
    the KL term is k3 = exp(ref - logp) - (ref - logp) - 1 (clamped to [-10, 10] as veRL's low_var_kl)."""
    mask, advantages = batch["mask"], batch["advantages"]
    ratio = torch.exp(logprobs - batch["old_logprobs"])
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    stats = {"clip_frac": ((clipped > unclipped).float() * mask).sum().item()}
    if dual_clip_c is not None:
        capped = torch.minimum(per_token, -advantages * dual_clip_c)
        dual_clipped = (advantages < 0) & (capped < per_token)
        per_token = torch.where(advantages < 0, capped, per_token)
        stats["dual_clip_frac"] = (dual_clipped.float() * mask).sum().item()
    if "behaviour_weight" in batch:
        per_token = per_token * batch["behaviour_weight"]
    if kl_loss_coef > 0:
        log_ratio = batch["ref_logprobs"] - logprobs
        kl = (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)
        per_token = per_token + kl_loss_coef * kl
        stats["kl_k3"] = (kl.detach() * mask).sum().item()
    return (per_token * mask).sum() / total_tokens, stats


def ppo_steps(rt, datums: list[Datum], loss_fn: LossFn, epochs: int, mini_batches: int) -> dict:
    """`epochs` passes over the datums, each split at random into `mini_batches` train_steps (with more than one, the
    caller has made the old logprobs the policy's own first: refresh_old_logprobs(always=True)). Returns train_step's
    metrics averaged over the steps (tokens: per pass), train/optimizer_steps and the skipped steps summed."""
    per_step = []
    for _ in range(epochs):
        order = random.sample(range(len(datums)), len(datums)) if mini_batches > 1 else range(len(datums))
        for part in range(mini_batches):
            per_step.append(train_step(rt, [datums[i] for i in order[part::mini_batches]], loss_fn))
    merged = {key: math.fsum(m.get(key, 0.0) for m in per_step) / len(per_step) for key in per_step[0]}
    for key in ("train/tokens", "train/sequence_tokens"):
        merged[key] = math.fsum(m.get(key, 0.0) for m in per_step) / epochs
    merged["train/nonfinite_skipped"] = math.fsum(m["train/nonfinite_skipped"] for m in per_step)
    merged["train/optimizer_steps"] = float(len(per_step))
    return merged


def ppo_update(rt, datums: list[Datum]) -> dict:
    """The training call of a script that keeps PPO-clip (ppo_clip_loss) as it is: the loss with the run's clip,
    dual-clip and KL settings (PPOArgs), over --ppo-epochs x --mini-batches steps. A script that changes the loss
    writes its own policy_loss and ppo_update (tempo.py, ppo.py)."""
    args = rt.args
    loss_fn = functools.partial(
        ppo_clip_loss,
        clip_eps=args.clip_eps,
        clip_eps_high=args.clip_eps_high,
        dual_clip_c=args.dual_clip_c,
        kl_loss_coef=args.kl_loss_coef,
    )
    return ppo_steps(rt, datums, loss_fn, args.ppo_epochs, args.mini_batches)


def add_reference_logprobs(rt, datums: list[Datum]) -> None:
    """The base model's logprobs on the datums (the LoRA adapter disabled), for ppo_clip_loss's k3 KL term."""
    reference = trained_logprobs(rt, datums, reference=True)
    for datum, ref in zip(datums, reference):
        datum.ref_logprobs = ref


def group_metrics(groups: Sequence[Sequence[Trajectory]]) -> dict:
    """Groups whose episodes all won or all lost (nothing to compare within them), and games that did not restore."""
    outcomes = [{traj.won for traj in group} for group in groups if group]
    return {
        "rollout/groups_all_won": Count(sum(o == {True} for o in outcomes)),
        "rollout/groups_all_lost": Count(sum(o == {False} for o in outcomes)),
        "rollout/restore_failures": Count(sum(not group for group in groups)),
    }


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict:
    """rollout/ metrics of a batch of trajectories; {} for none."""
    steps = [step for traj in trajectories for step in traj.steps]
    if not trajectories:
        return {}
    return {
        "rollout/valid_format_rate": sum(s.valid for s in steps) / max(1, len(steps)),
        "rollout/admissible_rate": sum(s.admissible for s in steps) / max(1, len(steps)),
        "rollout/steps": len(steps) / len(trajectories),
        "rollout/success_rate": sum(t.won for t in trajectories) / len(trajectories),
        "rollout/generated_tokens": Count(sum(len(s.completion_tokens) for s in steps)),
    }


class Count(float):
    """A metric that counts something: summed over the processes, where every other metric is averaged."""


class Max(float):
    """A metric that is a maximum: the largest over the processes (a bound it is checked against holds on each)."""


def reduce_metrics(accelerator, metrics: dict) -> dict:
    """Metrics of all processes: a Count is summed, a Max is the largest, everything else averaged over the processes
    that report it. An int (or bool) metric is refused: a count must say that it is one, or it would be averaged
    silently."""
    from accelerate.utils import gather_object

    for key, value in metrics.items():
        if isinstance(value, int):
            raise TypeError(f"metric {key} is an int: make it Count(...) (summed over processes) or a float (averaged)")
    per_rank = gather_object([metrics]) if accelerator.num_processes > 1 else [metrics]
    merged = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):
        values = [m[key] for m in per_rank if key in m]
        if isinstance(values[0], Count):
            merged[key] = sum(values)
        elif isinstance(values[0], Max):
            merged[key] = max(values)
        else:
            merged[key] = sum(values) / len(values)
    return merged


# =============================================================================================
# Job harness: start-up checks, runtime, the run around main()'s update loop, evaluation, logging, checkpoints
# =============================================================================================
class StartupError(ValueError):
    """A bad flag, game, checkpoint or endpoint, found before training (the CLI prints it as one line, exits 2)."""


@contextlib.contextmanager
def startup_errors():
    """A ValueError raised inside is a StartupError."""
    try:
        yield
    except ValueError as error:
        raise StartupError(str(error)) from error


def check(*conditions: tuple[bool, str]) -> None:
    """A ValueError with the message of the first condition that does not hold (at start: a start-up error)."""
    for ok, message in conditions:
        if not ok:
            raise ValueError(message)


def check_bounds(args, bound: str, *names: str) -> None:
    """Every named flag must be `bound` (">= 1", "> 0", ">= 0"; None passes); the error names the flag and value."""
    op, limit = bound.split()
    for name in names:
        value = getattr(args, name)
        if value is not None and not (value > float(limit) if op == ">" else value >= float(limit)):
            raise ValueError(f"--{name.replace('_', '-')} must be {bound}, got {value}")


def check_choices(args) -> None:
    """Every Literal flag holds one of its choices (tyro checks them on the command line, not in Args(...))."""
    for name, hint in typing.get_type_hints(type(args)).items():
        if typing.get_origin(hint) is Literal and getattr(args, name) not in typing.get_args(hint):
            raise ValueError(
                f"--{name.replace('_', '-')} must be one of {typing.get_args(hint)}, got {getattr(args, name)!r}"
            )


@dataclasses.dataclass
class SharedArgs:
    """The flags every script shares, declared once: each script's Args extends this (or PPOArgs) with its
    algorithm's flags, and may give a shared flag a default of its own by declaring it again (exp_name: ALGORITHM)."""

    # ---- model and optimisation ----
    model: str = "Qwen/Qwen3-4B-Instruct-2507"
    """HF model id or local path; `tiny` = the offline tiny model (tests, smoke runs)"""
    chat_template: str = ""
    """a Jinja chat template file that replaces the model's own (as `vllm serve --chat-template`); "" = the model's"""
    enable_thinking: bool = True
    """passed to the chat template; --no-enable-thinking: Qwen3 hybrid models answer without reasoning (refused for
    a template without the switch)"""
    lora_rank: int = 32
    """LoRA rank; 0 = no adapter, every weight is trained"""
    lora_alpha: int = 64
    """LoRA alpha (scale = alpha / rank)"""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """module names that get LoRA adapters"""
    learning_rate: float = 1e-6
    """AdamW learning rate"""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold (global L2 norm)"""
    temperature: float = 1.0
    """sampling temperature (logprobs are taken at this temperature too)"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    micro_batch_tokens: int = 16384
    """token budget of one forward/backward micro-batch (rows x padded length); gradients accumulate"""
    sample_batch_size: int = 32
    """prompts per generate() call"""
    fsdp: bool = False
    """shard the weights, gradients and AdamW state over the processes (PyTorch FSDP2, 2+ processes); the weights are
    gathered whole on every process between updates, for sampling (docs/training-jobs.md: Sharding)"""
    # ---- data ----
    data_root: str | None = None
    """ALFWorld data dir holding json_2.1.1/ (None = the generated offline game set; --model tiny-agent: its games)"""
    split: Literal["train", "valid_seen", "valid_unseen"] = "train"
    """split the training games come from"""
    task_types: tuple[str, ...] | None = None
    """ALFWorld task types to train on (None = all six)"""
    seed: int = 1
    """seed of the game order and of sampling"""
    # ---- token budgets ----
    max_turn_tokens: int = 512
    """new tokens per turn"""
    max_trajectory_tokens: int = 24576
    """token budget of one episode (an episode stops before overflowing it)"""
    # ---- runs ----
    exp_name: str = "run"
    """run name prefix: runs/{exp_name}__{seed}__{time} (each script's Args: its ALGORITHM)"""
    output_dir: str = "runs"
    """where run directories go"""
    track: bool = False
    """log to Weights & Biases (mode from WANDB_MODE)"""
    wandb_project: str = "cleanrl-agents"
    """W&B project"""
    save_every: int = 10
    """checkpoint every this many updates (and at the end); 0 = only at the end"""
    eval_every: int = 10
    """greedy evaluation every this many updates and at the end; 0 = never"""
    eval_games: int = 20
    """games per evaluation split (valid_seen, valid_unseen)"""
    resume: str = ""
    """"" = new run, "auto" = newest checkpoint of the latest run named exp_name with this seed, or a checkpoint/run
    path; flags that change what the run is must equal its config.json"""
    eval_only: str = ""
    """evaluate a checkpoint (its dir, a run dir = its newest, or "auto") into a new run dir's metrics.jsonl, and exit;
    every flag not passed takes the run's value"""
    threads: int = 0
    """torch CPU threads per process (0 = OMP_NUM_THREADS if set, else the cores / the processes on this machine)"""
    preset: str = ""
    """named settings that become the defaults (`script.py NAME --flags`; --help lists them); flags override them"""
    config: str = ""
    """a JSON or YAML file of flag values that become the defaults (a run's config.json reruns it); flags override it"""
    # ---- sampler ----
    sampler: Literal["generate", "vllm"] = "generate"
    """generate: model.generate() in the training process; vllm: a vLLM server you start (README: Sampling through vLLM)"""
    kv_cache_mb: int = 8192
    """--sampler generate: MB of KV caches kept between a branch's turns, so that a turn prefills only the tokens added
    since the last (a branch past the budget re-prefills its history; 0 = every turn re-prefills)"""
    sampler_url: str = ""
    """with --sampler vllm: the server's OpenAI API root, e.g. http://localhost:8000/v1"""
    sampler_adapter_dir: str = ""
    """where the adapter is saved for the server to load after each update ("" = {output_dir}/sampler_adapters)"""
    sampler_concurrency: int = 64
    """completion requests in flight per process"""
    sampler_timeout_s: float = 600.0
    """one completion request's timeout (it is retried after that)"""
    sampler_deadline_s: float = 1800.0
    """one turn's burst of requests, retries included, must finish by then or the update fails"""
    recompute_logprobs: bool = True
    """with --sampler vllm: the loss's old logprobs come from a trainer forward pass, not from the server"""
    async_steps: int = 0
    """K: with --sampler vllm, a background thread samples the next updates' rollouts through the server while the
    current update trains; no datum trains on weights more than K updates newer than the adapter that sampled it
    (0 = synchronous: sample, then train; docs/vllm.md: Rollouts ahead of training)"""

@dataclasses.dataclass
class PPOArgs(SharedArgs):
    """SharedArgs and the flags of a policy-gradient script that trains with the shared PPO-clip step (ppo_update):
    its update loop's sizes and the loss's settings."""

    # ---- the update loop and the shared PPO-clip step (ppo_update) ----
    num_updates: int = 200
    """policy updates (one rollout each)"""
    groups_per_update: int = 8
    """G: games per update (per process), one episode group each"""
    group_size: int = 8
    """N: episodes sampled per game (the group size)"""
    max_turns: int = 50
    """T: turns per episode (the rollout horizon)"""
    clip_eps: float = 0.2
    """PPO clip range below 1 (and above, unless --clip-eps-high is set)"""
    clip_eps_high: float | None = None
    """PPO clip range above 1 (clip-higher); None = --clip-eps"""
    dual_clip_c: float | None = 3.0
    """dual-clip PPO: the loss of a token with a negative advantage is capped at c * |A| (veRL: 3); None = off"""
    kl_loss_coef: float = 0.0
    """weight of the k3 KL to the base model (the adapter disabled) as a loss term (verl-agent: 0.01); 0 = off"""
    ppo_epochs: int = 1
    """passes over each rollout's data (old logprobs are recomputed by the policy when this or --mini-batches > 1)"""
    mini_batches: int = 1
    """optimizer steps per pass (the rollout's trajectories split at random)"""
    off_policy_loss: Literal["ppo", "decoupled"] = "ppo"
    """with --async-steps >= 1: ppo = PPO-clip of the ratio to the behaviour policy (the adapter that sampled the
    episode); decoupled = AReaL's: PPO-clip of the ratio to the weights before this update, times the behaviour weight
    min(pi_before / pi_behaviour, --behaviour-weight-cap)"""
    behaviour_weight_cap: float = 2.0
    """--off-policy-loss decoupled: the truncation of the behaviour weight"""


def validate_model_args(args) -> None:
    """Fail at start, naming the flag, on any shared setting that cannot work."""
    check_choices(args)
    check_bounds(args, ">= 1", "micro_batch_tokens", "sample_batch_size", "sampler_concurrency", "max_turn_tokens")
    check_bounds(args, ">= 0", "lora_rank")
    check_bounds(args, "> 0", "lora_alpha", "learning_rate", "max_grad_norm", "temperature", "sampler_timeout_s")
    check_bounds(args, "> 0", "sampler_deadline_s")
    check_bounds(args, ">= 0", "weight_decay", "seed", "save_every", "eval_every", "eval_games", "threads")
    check_bounds(args, ">= 0", "async_steps")
    check(
        (bool(args.model), "--model must not be empty"),
        (len(args.lora_targets) >= 1 and all(args.lora_targets), "--lora-targets must name at least one module"),
        (all(0 <= b < 1 for b in args.adam_betas), f"--adam-betas must lie in [0, 1), got {args.adam_betas}"),
        (0 < args.top_p <= 1, f"--top-p must lie in (0, 1], got {args.top_p}"),
        (args.data_root != "", "--data-root must not be empty (leave it unset for the offline games)"),
        (
            args.task_types is None or (len(args.task_types) >= 1 and set(args.task_types) <= set(TASK_TYPES)),
            f"--task-types must be among {TASK_TYPES}, got {args.task_types}",
        ),
        (
            bool(args.exp_name) and "__" not in args.exp_name and "/" not in args.exp_name,
            f"--exp-name must be non-empty without '__' or '/', got {args.exp_name!r}",
        ),
        (bool(args.output_dir), "--output-dir must not be empty"),
        (not args.track or bool(args.wandb_project), "--wandb-project must not be empty with --track"),
        (not (args.resume and args.eval_only), "--resume and --eval-only cannot be combined"),
        (not args.eval_only or args.eval_games >= 1, "--eval-only needs --eval-games >= 1"),
        (
            args.sampler == "generate" or args.sampler_url.startswith(("http://", "https://")),
            f"--sampler vllm needs --sampler-url http://HOST:PORT/v1, got {args.sampler_url!r}",
        ),
        (
            args.sampler == "generate" or args.lora_rank > 0,
            "--sampler vllm needs a LoRA adapter (--lora-rank >= 1): pushing full weights to the server is not "
            "implemented",
        ),
        (
            args.sampler == "vllm" or not args.sampler_url,
            "--sampler-url is only used with --sampler vllm (the default sampler is generate)",
        ),
        (
            args.sampler == "vllm" or args.async_steps == 0,
            "--async-steps needs --sampler vllm: generate() runs in the training process, on the weights being "
            "trained and on the cores training uses, so there is nothing to overlap it with",
        ),
        (
            not (args.fsdp and args.async_steps),
            "--async-steps with --fsdp is not supported: a datum's logprobs are recomputed under the weights of the "
            "version that sampled it, and under --fsdp forward passes run on weights gathered by a collective, which "
            "processes holding data of different versions cannot join",
        ),
        (
            args.max_trajectory_tokens > args.max_turn_tokens,
            f"--max-trajectory-tokens ({args.max_trajectory_tokens}) must exceed --max-turn-tokens ({args.max_turn_tokens})",
        ),
    )


def validate_ppo_args(args: PPOArgs) -> None:
    """validate_model_args, then PPOArgs' flags: the update loop's sizes and the PPO-clip step's settings."""
    validate_model_args(args)
    check_bounds(args, ">= 1", "num_updates", "groups_per_update", "max_turns", "ppo_epochs")
    check_bounds(args, ">= 1", "mini_batches")
    check_bounds(args, "> 0", "clip_eps_high")
    check_bounds(args, ">= 0", "kl_loss_coef")
    check_bounds(args, ">= 1", "behaviour_weight_cap")
    check(
        (
            args.off_policy_loss == "ppo" or args.async_steps >= 1,
            "--off-policy-loss decoupled needs --async-steps >= 1 (synchronous data is on-policy)",
        ),
        (0 < args.clip_eps < 1, f"--clip-eps must lie in (0, 1), got {args.clip_eps}"),
        (
            args.lora_rank > 0 or args.kl_loss_coef == 0,
            "--kl-loss-coef needs --lora-rank >= 1 (the reference is the model with its adapter disabled)",
        ),
        (
            args.dual_clip_c is None or args.dual_clip_c > 1,
            f"--dual-clip-c must be > 1 (the loss cap is c * |A|), got {args.dual_clip_c}",
        ),
    )


# Flags a resumed run may change: where and how fast it runs and what it logs, not what it trains.
RESUME_FREE_FLAGS = tuple(
    "preset config resume eval_only output_dir track wandb_project save_every eval_every eval_games threads micro_batch_tokens "
    "sample_batch_size fsdp sampler sampler_url sampler_adapter_dir sampler_concurrency sampler_timeout_s "
    "sampler_deadline_s kv_cache_mb".split()
)


def make_accelerator():
    """CPU or CUDA; DDP when launched on several processes (--fsdp: sharded by the scripts themselves, load_model).
    accelerate's own FSDP, DeepSpeed and Megatron plugins are refused: they would wrap the model a second time."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise ValueError(
            f"accelerate config: {accelerator.distributed_type} is not supported; launch with "
            "`accelerate launch --multi_gpu` and pass --fsdp to shard the model (docs/training-jobs.md: Sharding)"
        )
    if os.environ.get("MASTER_PORT") and accelerator.num_processes == 1:  # `accelerate launch --num_processes N`
        print(
            "[start] WARNING: launched for several processes but running ONE: on CPU, accelerate needs "
            "`accelerate launch --multi_gpu --num_processes N ...` (see the README)",
            file=sys.stderr,
        )
    return accelerator


def set_threads(args, local_processes: int) -> int:
    """torch's CPU threads: --threads, else OMP_NUM_THREADS when set, else the cores shared by the local processes.
    Warns when the machine is already busy: threads fighting over cores made runs 20x slower."""
    cores = len(os.sched_getaffinity(0))
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, cores // local_processes)
    torch.set_num_threads(threads)
    load = os.getloadavg()[0]
    if load + threads * local_processes > cores + 0.5:
        print(
            f"[start] WARNING: load average {load:.1f} on {cores} cores before this run's "
            f"{local_processes} x {threads} thread(s): oversubscribed, expect a large slowdown"
            + (" (try --threads 1)" if threads > 1 else ""),
            file=sys.stderr,
        )
    return threads


def require_writable_dir(path, flag: str) -> Path:
    """Create `path` if needed and prove a file can be written there; the error names the flag."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"{flag} {path} is not a writable directory: {error}") from error
    return path


def check_model(model: str) -> None:
    """The model's config must be readable (a local dir with config.json, the HF cache, or the hub) before
    anything loads; `tiny` and `tiny-agent` are always there (built on first use)."""
    from transformers import AutoConfig

    if model == "tiny":
        return
    if model in offline.TINY_AGENTS:
        offline.tiny_agent_weights(model)  # shipped, or built by benchmarks/learning/agents.py
        return
    looks_local = os.path.isabs(model) or model.startswith(".") or os.path.exists(model)
    if looks_local and not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"--model {model}: no such model directory (expected a config.json there)")
    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        raise ValueError(f"--model {model}: cannot load its config ({error})") from error
    text_config = getattr(config, "text_config", None) or config
    for name in ("final_logit_softcapping", "logit_scale"):  # logits that are not lm_head(hidden): forward_logprobs
        if getattr(text_config, name, None) not in (None, 1.0):
            raise ValueError(
                f"--model {model}: its config sets {name}; the training step supports plain lm_head logits"
            )


def training_games(args, accelerator) -> list[str]:
    """This process's shard of the training games, shuffled with the seed; fails naming --data-root."""
    try:
        games = discover_games(args.data_root, args.split, args.task_types, seed=args.seed)
    except FileNotFoundError as error:
        raise ValueError(f"--data-root {args.data_root}: {error}") from error
    return games[accelerator.process_index :: accelerator.num_processes] or games


def startup_checks(args, algorithm: str, accelerator, validate_args, resume_may_change: Sequence[str] = ()):
    """Every check that can fail at start, before any model loads: flags, threads, model, chat template, output dir,
    checkpoint, games. Returns (args as the run uses them, checkpoint to load or None, its trainer state or None). The
    args: data root and chat template file resolved; --resume: flags that change what the run is (all but
    RESUME_FREE_FLAGS and resume_may_change) must equal the run's (with --eval-only the CLI has taken them from the
    run: cli())."""
    with startup_errors():
        validate_model_args(args)  # before looking the checkpoint up (--resume and --eval-only exclude each other)
        flag, spec = ("--eval-only", args.eval_only) if args.eval_only else ("--resume", args.resume)
        checkpoint = find_checkpoint(spec, args.output_dir, args.exp_name, args.seed, flag)
        config_file = checkpoint.parent.parent / "config.json" if checkpoint is not None else None
        config = json.loads(config_file.read_text()) if config_file is not None and config_file.is_file() else {}
        config = renamed_flags(config, str(config_file), note=not args.eval_only)  # --eval-only: cli() said it
        validate_args(args)
        check(
            (
                not args.fsdp or accelerator.num_processes > 1,
                "--fsdp shards over several processes, and this run has one: launch it with `accelerate launch "
                "--multi_gpu --num_processes N` (N >= 2), or drop --fsdp",
            ),
        )
        set_threads(args, int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)))
        check_model(args.model)
        require_writable_dir(args.output_dir, "--output-dir")
        if checkpoint is None and spec:
            if args.eval_only:
                raise ValueError(
                    f"--eval-only auto: no checkpoint of a run {args.exp_name}__{args.seed}__* in {args.output_dir}"
                )
            print(
                f"[start] --resume auto: no checkpoint of a run {args.exp_name}__{args.seed}__* in "
                f"{args.output_dir}; starting a new run",
                file=sys.stderr,
            )
        with accelerator.main_process_first():  # the offline games and the tiny agent are built once, not per process
            template = str(Path(args.chat_template).resolve()) if args.chat_template else ""
            args = dataclasses.replace(
                args, data_root=resolve_data_root(args.data_root, args.model), chat_template=template
            )
            chat_protocol(args)  # the chat template (the tokenizer only: no weights load)
        state = None
        if checkpoint is not None:
            state = check_checkpoint(
                checkpoint, args, algorithm, flag, None if args.eval_only else accelerator.num_processes
            )
            ours, free = json.loads(json.dumps(dataclasses.asdict(args))), (*RESUME_FREE_FLAGS, *resume_may_change)
            differences = [
                f"--{key.replace('_', '-')} {ours[key]} (the run: {config[key]})"
                for key in ours
                if not args.eval_only and key in config and key not in free and ours[key] != config[key]
            ]
            if differences:
                raise ValueError(
                    f"--resume {checkpoint}: these flags change what the run is, and differ from its "
                    f"{config_file}: {'; '.join(differences)}. Pass the run's values, or start a new run"
                )
        games = [] if args.eval_only else training_games(args, accelerator)
        for split in ("valid_seen", "valid_unseen") if args.eval_only or args.eval_every else ():
            try:
                games += eval_subset(args.data_root, split, args.task_types, args.eval_games)
            except FileNotFoundError:
                pass  # evaluate() says so
        check_games(games)
        return args, checkpoint, state


@dataclasses.dataclass
class Job:
    """What the start-up checks settled for a run: the args as it uses them, the accelerator, and the checkpoint to
    resume or evaluate (None: a new run) with its trainer state."""

    args: object
    accelerator: object
    algorithm: str
    checkpoint: Path | None
    trainer_state: dict | None


@contextlib.contextmanager
def training_job(args, algorithm: str, validate_args, resume_may_change: Sequence[str] = ()):
    """The accelerator, the start-up checks (start) and the seeds around a run; yields its Job."""
    from accelerate.utils import set_seed

    accelerator = make_accelerator()
    try:
        args, checkpoint, trainer_state = startup_checks(args, algorithm, accelerator, validate_args, resume_may_change)
        set_seed(args.seed + accelerator.process_index)
        yield Job(args, accelerator, algorithm, checkpoint, trainer_state)
    finally:
        close_distributed()


class Runtime:
    """What every algorithm's update needs: this process's shard of the training games (shuffled with the seed,
    found before the model loads), the model and its optimizer, the chat protocol, the samplers (T = --temperature,
    and greedy) and the cursor of the next fresh game. An algorithm subclasses it for its own state and extends
    state_dict / load_state_dict with what a checkpoint must keep of it."""

    def __init__(self, args, accelerator):
        self.args, self.accelerator = args, accelerator
        self.games = training_games(args, accelerator)
        self.heads = torch.nn.ModuleDict(self.make_heads(model_config(args.model)))
        self.tokenizer, self.model, self.optimizer = load_model(args, accelerator, self.heads)
        self.protocol = chat_protocol(args, self.tokenizer)
        self.sample_fn = make_sampler(self.model, self.tokenizer, accelerator, args)
        self.greedy_fn = make_sampler(self.model, self.tokenizer, accelerator, args, greedy=True)
        self.game_cursor = 0  # of the games in the updates trained (--async-steps: not those sampled ahead)
        self.bad_games = 0  # games skipped since the last metrics row (rollout/bad_games_skipped)
        self.on_turn: Callable[[int, int], None] | None = None  # rollout progress (the logger's turn bar)
        self.rollouts: AsyncRollouts | None = None  # --async-steps: the background sampler (Run starts it)

    def make_heads(self, config) -> dict[str, torch.nn.Module]:
        """The algorithm's own trainable modules on the policy (a value head reading its hidden states), by name, from
        the model's config: the optimizer steps them with the policy, every process starts from rank 0's, and
        checkpoints keep them (heads.safetensors, checked on load). None here."""
        return {}

    def next_game_start(self) -> SavedState:
        """The next training game from its start (games cycle in their shuffled order)."""
        (state,), self.game_cursor, skipped = self.game_starts(1, self.game_cursor)
        self.bad_games += skipped
        return state

    def game_starts(self, n: int, cursor: int) -> tuple[list[SavedState], int, int]:
        """n training games from their start, the first at `cursor` in the shuffled order (games cycle): (the starts,
        the cursor after them, the games skipped). A game that passed the start-up parse but does not load is skipped
        and named on stderr: a bad game never ends the run."""
        starts, skipped = [], 0
        while len(starts) < n:
            for _ in self.games:
                game = self.games[cursor % len(self.games)]
                cursor += 1
                if (state := game_start_or_skip(game, self.protocol, "games", seed=cursor)) is not None:
                    starts.append(state)
                    break
                skipped += 1
            else:
                raise RuntimeError(f"none of this process's {len(self.games)} training games loads")
        return starts, cursor, skipped

    def rollout_groups(self) -> list[list[Trajectory]]:
        """Step 1 of an update: --groups-per-update games from their start, --group-size episodes each, to --max-turns.
        --async-steps 0: played now, with the weights as they are. K >= 1: the batch AsyncRollouts sampled for this
        update, at most K versions behind these weights."""
        args = self.args
        if self.rollouts is not None:
            batch = self.rollouts.next_batch()
        else:
            starts, cursor, skipped = self.game_starts(args.groups_per_update, self.game_cursor)
            groups = self.play(starts, args.group_size, horizon=args.max_turns, max_turns=args.max_turns)
            batch = RolloutBatch(groups, 0, cursor, skipped)
        self.game_cursor = batch.game_cursor
        self.bad_games += batch.bad_games
        return batch.groups

    def play(self, starts, group_size: int, *, horizon: int, max_turns: int, sample_fn=None):
        """rollout() with the run's token budgets, progress bar and sampler (self.sample_fn unless given)."""
        return rollout(
            starts,
            group_size,
            sample_fn or self.sample_fn,
            self.protocol,
            horizon=horizon,
            max_turns=max_turns,
            max_turn_tokens=self.args.max_turn_tokens,
            max_trajectory_tokens=self.args.max_trajectory_tokens,
            on_turn=self.on_turn,
        )

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this process."""
        return {"game_cursor": self.game_cursor}

    def load_state_dict(self, state: dict) -> None:
        self.game_cursor = state["game_cursor"]


def game_start_or_skip(game: str, protocol, stage: str, seed: int = 0) -> SavedState | None:
    """The game's start state; None, with a warning naming it, for a game that passed the start-up parse but does
    not load (a broken grammar: grammars are parsed at first use)."""
    try:
        return game_start(game, protocol, seed=seed)
    except BadGameError as error:
        print(f"[{stage}] WARNING: skipped a game that does not load: {error}", file=sys.stderr)
        return None


@dataclasses.dataclass
class RolloutBatch:
    """One update's rollout: its groups, the weights version that sampled them, the game cursor after its games and
    the games it skipped."""

    groups: list[list[Trajectory]]
    version: int
    game_cursor: int
    bad_games: int


class RolloutsStopped(Exception):
    """AsyncRollouts.close() ended a rollout in flight (its next turn)."""


class AsyncRollouts:
    """--async-steps K: a background thread plays the rollouts of the coming updates through the vLLM server while the
    current update trains. The trainer's thread keeps the model (it alone reads and writes the weights and loads
    adapters); this thread drives the server and the games.

    Version v = the weights after v updates. Before it takes the batch of update u, the trainer publishes version u - 1:
    its adapter loaded into the server (ServerSampler.sync_adapter, which keeps the K + 1 newest loaded and on disk)
    and its trained tensors kept here (weights_of: the behaviour logprobs). The rule: the batch of update u is begun
    only once version u - 1 - K is published, with the newest published adapter, and every turn of every episode in it
    is sampled with that one adapter. Update u trains version u - 1, so each datum is at most K versions behind the
    weights it updates (staleness = u - 1 - its version); no batch can go stale past the bound, so none is requeued or
    dropped. The thread samples no batch past the run's last update. A batch not yet trained is lost with the process
    (kill, crash): the checkpoint's game cursor is that of the updates trained, so a resumed run samples those games
    again, with its own weights, and trains nothing twice."""

    def __init__(self, rt, done: int, total_updates: int):
        self.rt, self.bound, self.total_updates = rt, rt.args.async_steps, total_updates
        self.update = done  # the last update whose batch the trainer took
        self.cursor = rt.game_cursor  # the sampling thread's: games begun
        self.latest, self.versions = -1, {}  # version -> (adapter name, trained tensors), the K + 1 newest
        self.staleness: list[int] = []  # of the last batch taken, per episode
        self.ready: queue.Queue = queue.Queue()
        self.changed = threading.Condition()
        self.stopping = False
        self.publish(done)
        self.thread = threading.Thread(target=self._sample_ahead, args=(done + 1,), name="async-rollouts", daemon=True)
        self.thread.start()

    def publish(self, version: int) -> None:
        """The trainer's weights as `version`: their adapter served, their tensors kept; the oldest beyond K + 1 go."""
        rt = self.rt
        rt.sample_fn.sync_adapter()
        policy = rt.accelerator.unwrap_model(rt.model)
        tensors = [p.detach().clone() for p in policy.parameters() if p.requires_grad]
        with self.changed:
            self.versions[version] = (rt.sample_fn.adapter_name, tensors)
            for old in [v for v in self.versions if v < version - self.bound]:
                del self.versions[old]
            self.latest = version
            self.changed.notify_all()

    @contextlib.contextmanager
    def weights_of(self, version: int):
        """The policy's trained parameters set to `version`'s inside (the trainer's thread), restored after."""
        params = [p for p in self.rt.accelerator.unwrap_model(self.rt.model).parameters() if p.requires_grad]
        if version == self.latest:
            yield
            return
        current = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, saved in zip(params, self.versions[version][1]):
                p.copy_(saved)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, saved in zip(params, current):
                    p.copy_(saved)

    def _sample_ahead(self, first: int) -> None:
        """The batches of updates first.. to the last, in order, each begun within the bound."""
        args, rt = self.rt.args, self.rt
        try:
            for update in range(first, self.total_updates + 1):
                with self.changed:  # the bound: version update - 1 - K must be out
                    self.changed.wait_for(lambda: self.stopping or self.latest >= update - 1 - self.bound)
                    if self.stopping:
                        return
                    version, (adapter, _) = self.latest, self.versions[self.latest]
                sample = rt.sample_fn.pinned(adapter)

                def sample_fn(prompts, max_new_tokens):
                    if self.stopping:
                        raise RolloutsStopped
                    return sample(prompts, max_new_tokens)

                starts, self.cursor, skipped = rt.game_starts(args.groups_per_update, self.cursor)
                groups = rt.play(
                    starts, args.group_size, horizon=args.max_turns, max_turns=args.max_turns, sample_fn=sample_fn
                )
                for traj in (traj for group in groups for traj in group):
                    traj.version = version
                self.ready.put(RolloutBatch(groups, version, self.cursor, skipped))
        except RolloutsStopped:
            return
        except BaseException as error:  # the trainer raises it when it asks for the next batch
            self.ready.put(error)

    def next_batch(self) -> RolloutBatch:
        """The next update's batch (waits for it), after publishing the weights that update trains."""
        self.update += 1
        if self.update - 1 > self.latest:
            self.publish(self.update - 1)
        batch = self.ready.get()
        if isinstance(batch, BaseException):
            raise RuntimeError(f"--async-steps: sampling the rollouts ahead failed: {batch}") from batch
        self.staleness = [self.update - 1 - batch.version for group in batch.groups for _ in group]
        return batch

    def metrics(self) -> dict:
        """rollout/staleness_mean and _max: versions between the weights trained and the adapter that sampled."""
        return {
            "rollout/staleness_mean": math.fsum(self.staleness) / max(1, len(self.staleness)),
            "rollout/staleness_max": Max(max(self.staleness, default=0)),
        }

    def close(self) -> None:
        """Stops the thread (a rollout in flight ends at its next turn, its batch unused)."""
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        self.thread.join()


class Run:
    """The bookkeeping around the update loop that each script's main() writes out: the run directory (new, or the
    resumed run's), its logger, and on resume the runtime, model, optimizer and RNG states as they were saved."""

    def __init__(self, job: Job, rt: Runtime, total_updates: int, postfix_keys: Sequence[str] = ()):
        self.job, self.rt, self.total_updates = job, rt, total_updates
        resumed = job.checkpoint
        self.done = job.trainer_state["update"] if resumed is not None else 0
        self.dir = resumed.parent.parent if resumed is not None else new_run_dir(job.args)
        self.logger = RunLogger(job.args, self.dir, job.accelerator, total_updates, self.done, postfix_keys)
        rt.on_turn = self.logger.on_turn
        if resumed is not None:
            rt.load_state_dict(job.trainer_state["rank_states"][job.accelerator.process_index])
            load_checkpoint(resumed, rt.model, rt.optimizer, job.accelerator, rt.heads)  # last: the RNG states as saved
            if job.accelerator.is_main_process:
                print(f"resumed {resumed} (update {self.done} of {total_updates})", file=sys.stderr)
        elif self.evaluates(0):  # the policy a new run starts from, as row 0: its curves begin where training does
            self.log(0, evaluate(rt, job.args.max_turns))
        if job.args.async_steps:
            rt.rollouts = AsyncRollouts(rt, self.done, total_updates)  # samples ahead from now on

    def updates(self) -> range:
        """The updates still to run."""
        return range(self.done + 1, self.total_updates + 1)

    def gather(self, metrics: dict) -> dict:
        """An update's metrics, with the games skipped since the last row, over all processes (reduce_metrics)."""
        metrics["rollout/bad_games_skipped"], self.rt.bad_games = Count(self.rt.bad_games), 0
        if self.rt.rollouts is not None:
            metrics |= self.rt.rollouts.metrics()
        return reduce_metrics(self.job.accelerator, metrics)

    def evaluates(self, update: int) -> bool:
        """Whether an evaluation follows this update (0: before the first): every --eval-every and after the last
        (with --eval-games)."""
        args = self.job.args
        return bool(args.eval_every and args.eval_games) and (
            update == self.total_updates or update % args.eval_every == 0
        )

    def log(self, update: int, metrics: dict, samples: Sequence[dict] = ()) -> None:
        self.logger.log(update, metrics, samples)

    def checkpoint(self, update: int, tags: dict) -> None:
        """Every --save-every updates and after the last: a checkpoint with the tags and every process's
        rt.state_dict()."""
        args, rt = self.job.args, self.rt
        if update == self.total_updates or (args.save_every and update % args.save_every == 0):
            save_checkpoint(
                self.dir,
                update,
                rt.model,
                rt.optimizer,
                rt.accelerator,
                self.job.algorithm,
                tags,
                rt.state_dict(),
                rt.heads,
            )

    def close(self) -> Path:
        """Returns the run directory."""
        if self.rt.rollouts is not None:
            self.rt.rollouts.close()
        self.logger.close()
        return self.dir


EVAL_SEED = 0  # the sampler's seed for every evaluation: common random numbers across checkpoints and runs


def evaluate(rt, max_turns: int) -> dict:
    """eval/train/success_rate: --eval-games sampled episodes (rt.sample_fn, the run's temperature) per process from the
    start of its training games, cycling through them, the sampler seeded with EVAL_SEED each time: episode success,
    the same measure in every script. Then greedy episodes (rt.greedy_fn) on --eval-games games (eval_subset) of
    valid_seen and valid_unseen, sharded over the processes. invalid_action_rate = turns whose reply was not an
    admissible action (bad format or not admissible)."""
    from accelerate.utils import gather_object

    args, accelerator, metrics = rt.args, rt.accelerator, {}
    with seeded_sampling(EVAL_SEED + accelerator.process_index):
        starts = [game_start_or_skip(rt.games[i % len(rt.games)], rt.protocol, "eval") for i in range(args.eval_games)]
        starts = [state for state in starts if state is not None]
        groups = rt.play(starts, 1, horizon=max_turns, max_turns=max_turns) if starts else []
    won = [traj.won for group in groups for traj in group]
    won = sum(gather_object([won]), []) if accelerator.num_processes > 1 else won
    if won:
        metrics["eval/train/success_rate"] = sum(won) / len(won)
    for split in ("valid_seen", "valid_unseen"):
        try:
            games = eval_subset(args.data_root, split, args.task_types, args.eval_games)
        except FileNotFoundError as error:
            print(f"[eval] skipping {split}: {error}", file=sys.stderr)
            continue
        mine = [
            game_start_or_skip(game, rt.protocol, "eval")
            for game in games[accelerator.process_index :: accelerator.num_processes]
        ]
        starts, skipped = [state for state in mine if state is not None], sum(state is None for state in mine)
        groups = rt.play(starts, 1, horizon=max_turns, max_turns=max_turns, sample_fn=rt.greedy_fn) if starts else []
        results = [
            {
                "task_type": load_task_type(traj.start.game_file),
                "won": traj.won,
                "steps": len(traj.steps),
                "inadmissible": sum(not step.admissible for step in traj.steps),
            }
            for group in groups
            for traj in group
        ]
        results = gather_object(results) if accelerator.num_processes > 1 else results
        skipped = sum(gather_object([skipped])) if accelerator.num_processes > 1 else skipped
        if skipped:
            metrics[f"eval/{split}/bad_games_skipped"] = float(skipped)
        if not results:
            continue
        won = [r for r in results if r["won"]]
        metrics[f"eval/{split}/success_rate"] = len(won) / len(results)
        if won:
            metrics[f"eval/{split}/mean_steps_to_success"] = sum(r["steps"] for r in won) / len(won)
        metrics[f"eval/{split}/invalid_action_rate"] = sum(r["inadmissible"] for r in results) / max(
            1, sum(r["steps"] for r in results)
        )
        for task_type in sorted({r["task_type"] for r in results}):
            of_type = [r["won"] for r in results if r["task_type"] == task_type]
            metrics[f"eval/{split}/success/{task_type}"] = sum(of_type) / len(of_type)
    return metrics


@contextlib.contextmanager
def seeded_sampling(seed: int):
    """torch's RNG (the sampler's) seeded with `seed` inside, restored after: the same random numbers for every
    checkpoint evaluated, the training run's own stream untouched."""
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


def evaluate_checkpoint(job: Job, rt: Runtime, max_turns: int) -> Path:
    """--eval-only: the checkpoint's adapter, one evaluation, one metrics row (update = the checkpoint's) in a new
    run directory, which is returned."""
    load_checkpoint(job.checkpoint, rt.model, None, job.accelerator, rt.heads)
    run_dir = new_run_dir(job.args)
    logger = RunLogger(job.args, run_dir, job.accelerator, 1, 0)
    rt.on_turn = logger.on_turn
    metrics = evaluate(rt, max_turns)
    logger.log(job.trainer_state["update"], {"checkpoint": str(job.checkpoint), **metrics})
    logger.close()
    if job.accelerator.is_main_process:
        print(json.dumps(metrics, indent=2))
    return run_dir


def new_run_dir(args) -> Path:
    return Path(args.output_dir) / f"{args.exp_name}__{args.seed}__{int(time.time())}"


def drop_rows_after(path: Path, update: int) -> None:
    """Keep only the JSONL rows of updates <= `update`: a run that died after logging an update but before
    checkpointing it repeats that update when resumed. A line cut short by the kill goes too."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["update"] <= update:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def provenance() -> dict:
    """What produced a run, besides its flags (config.json): the code's commit and whether the tree had uncommitted
    changes to tracked files, the command line, the Python and every installed package's version, the time."""

    def git(*command: str) -> str | None:
        try:
            done = subprocess.run(["git", *command], cwd=Path(__file__).parent, capture_output=True, text=True)
        except OSError:  # no git on the machine
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "argv": sys.argv,
        "python": sys.version.split()[0],
        "packages": {d.metadata["Name"]: d.version for d in importlib.metadata.distributions() if d.metadata["Name"]},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


class RunLogger:
    """config.json, provenance.jsonl (a line per start: commit, packages), metrics.jsonl (one line per update),
    samples.jsonl, optional W&B (metrics and a table of
    sample trajectories per update), and tqdm bars over updates and over the turns of the current rollout.
    Only the main process writes."""

    def __init__(self, args, run_dir: Path, accelerator, total_updates: int, done: int, postfix_keys=()):
        from tqdm import tqdm

        self.run_dir, self.postfix_keys = Path(run_dir), postfix_keys
        self.recent = {key: collections.deque(maxlen=4) for key in postfix_keys}  # the bar's last 4 updates
        self.active = accelerator.is_main_process
        self.wandb = None
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if done:
            for name in ("metrics.jsonl", "samples.jsonl"):
                drop_rows_after(self.run_dir / name, done)
        (self.run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
        with open(self.run_dir / "provenance.jsonl", "a") as f:  # one line per start or resume of the run
            f.write(json.dumps({"updates_done": done, **provenance()}) + "\n")
        self.metrics_file = open(self.run_dir / "metrics.jsonl", "a")
        self.samples_file = open(self.run_dir / "samples.jsonl", "a")
        if args.track:
            import wandb

            # The mode comes from WANDB_MODE, never forced online; without it and without credentials: offline.
            mode = None if os.environ.get("WANDB_MODE") or wandb.login(prompt=False, verify=False) else "offline"
            self.wandb = wandb.init(
                project=args.wandb_project,
                name=self.run_dir.name,
                id=self.run_dir.name,
                resume="allow",
                config=dataclasses.asdict(args),
                dir=None if os.environ.get("WANDB_DIR") else str(self.run_dir),
                mode=mode,
            )
        self.bar = tqdm(total=total_updates, initial=done, desc=self.run_dir.name, unit="update", dynamic_ncols=True)
        self.turns = tqdm(desc="rollout", unit="turn", position=1, leave=False, dynamic_ncols=True)

    def on_turn(self, turn_index: int, live_branches: int) -> None:
        """rollout's progress callback: turns done in the current rollout, branches still playing."""
        if not self.active:
            return
        if turn_index == 1:
            self.turns.reset()
        self.turns.update(1)
        self.turns.set_postfix(live=live_branches)

    def log(self, update: int, metrics: dict, samples: Sequence[dict] = ()):
        if not self.active:
            return
        self.metrics_file.write(json.dumps({"update": update, **metrics}) + "\n")
        self.metrics_file.flush()
        for sample in samples:
            self.samples_file.write(json.dumps({"update": update, **sample}) + "\n")
        self.samples_file.flush()
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.wandb is not None:
            import wandb

            rows = [
                [
                    update,
                    s.get("game", ""),
                    s.get("task", ""),
                    "\n\n".join(f"[{m['role']}] {m['content']}" for m in s.get("messages", ())),
                    json.dumps({k: v for k, v in s.items() if k not in ("game", "task", "messages")}),
                ]
                for s in samples
            ]
            table = (
                {"samples": wandb.Table(columns=["update", "game", "task", "messages", "details"], data=rows)}
                if rows
                else {}
            )
            self.wandb.log({**numeric, **table}, step=update)
        self.bar.update(1 if update else 0)  # row 0 (the start's evaluation) is no update
        for key in (k for k in self.postfix_keys if k in numeric):
            self.recent[key].append(numeric[key])
        # means over the last 4 updates: one update's 16 episodes are too noisy to show a trend
        self.bar.set_postfix({k.split("/")[-1]: f"{sum(v) / len(v):.3g}" for k, v in self.recent.items() if v})

    def close(self):
        if not self.active:
            return
        self.turns.close()
        self.bar.close()
        self.metrics_file.close()
        self.samples_file.close()
        if self.wandb is not None:
            self.wandb.finish()


def _rng_state() -> dict:
    python = random.getstate()
    numpy = np.random.get_state()
    return {
        "python": [python[0], list(python[1]), python[2]],
        "numpy": [numpy[0], numpy[1].tolist(), numpy[2], numpy[3], numpy[4]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: dict) -> None:
    python, numpy = state["python"], state["numpy"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    np.random.set_state((numpy[0], np.array(numpy[1], dtype=np.uint32), numpy[2], numpy[3], numpy[4]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def adapter_sha256(adapter: dict[str, torch.Tensor]) -> str:
    """Checksum of an adapter state dict (names and fp32 values), as saved in adapter_model.safetensors."""
    digest = hashlib.sha256()
    for name in sorted(adapter):
        digest.update(name.encode())
        # a copy: .numpy() would make the tensor's own storage unresizable, and FSDP frees gathered weights by resizing
        digest.update(adapter[name].detach().float().cpu().clone().numpy().tobytes())
    return digest.hexdigest()


def trained_weights(policy) -> dict[str, torch.Tensor]:
    """What training changes: the LoRA adapter's state dict, or (--lora-rank 0) every parameter, by name."""
    from peft import PeftModel, get_peft_model_state_dict

    # From the parameters, not state_dict(): under --fsdp that would reshard the weights gather_weights() gathered
    parameters = dict(policy.named_parameters())  # a tied weight appears once
    return get_peft_model_state_dict(policy, state_dict=parameters) if isinstance(policy, PeftModel) else parameters


def save_adapter(policy, path: Path) -> None:
    """A peft adapter directory (adapter_config.json, adapter_model.safetensors) of the policy's LoRA weights."""
    policy.save_pretrained(str(path), state_dict=dict(policy.named_parameters()))  # not state_dict(): trained_weights


def placed_like(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole saved tensor as `like` holds it: under --fsdp this process's shard (each process slices the whole
    tensor it read itself, no communication), else the tensor."""
    from torch.distributed.tensor import distribute_tensor

    if not isinstance(like, DTensor):
        return tensor
    return distribute_tensor(tensor.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def whole(tensor):
    """A shard (DTensor) gathered whole, on the CPU (a collective: every process calls it); other values as they are."""
    return tensor.full_tensor().cpu() if isinstance(tensor, DTensor) else tensor


HEADS_FILE = "heads.safetensors"  # an algorithm's own modules (Runtime.make_heads) in a checkpoint


def weights_file(lora: bool) -> str:
    return "adapter_model.safetensors" if lora else "model.safetensors"


def save_checkpoint(
    run_dir: Path,
    update: int,
    model,
    optimizer,
    accelerator,
    algorithm: str,
    trainer_state: dict,
    rank_state: dict,
    heads: torch.nn.Module | None = None,
) -> Path:
    """checkpoints/update_{n:06d}/: the trained weights (a peft adapter dir, or with --lora-rank 0 config.json and
    model.safetensors of every weight: both load with from_pretrained), the algorithm's heads (heads.safetensors, when
    it has any), optimizer, RNG states and trainer_state.json of every process, written by the main process into a
    temporary dir that is then renamed: a checkpoint dir is always complete, whenever the job dies. All processes call;
    they must hold the same weights and heads (checked, loudly). Not accelerate's save_state: it pickles, and keeps
    custom state of the main process only."""
    from accelerate.utils import gather_object
    from peft import PeftModel
    from safetensors.torch import save_file

    policy = accelerator.unwrap_model(model)
    weights = trained_weights(policy)
    checksum = adapter_sha256(weights)
    saved = optimizer.state_dict()  # --fsdp: every process gathers the shards (a collective), the main one writes
    saved["state"] = {i: {k: whole(v) for k, v in state.items()} for i, state in saved["state"].items()}
    head_weights = {k: v.detach().cpu().contiguous() for k, v in (heads.state_dict() if heads else {}).items()}
    checksums = {"adapter_sha256": checksum} | ({"heads_sha256": adapter_sha256(head_weights)} if head_weights else {})
    per_rank = [{"state": rank_state, "rng": _rng_state(), **checksums}]
    per_rank = gather_object(per_rank) if accelerator.num_processes > 1 else per_rank
    for key, what in (("adapter_sha256", "adapter"), ("heads_sha256", "heads")):
        if len({r.get(key) for r in per_rank}) > 1:
            raise RuntimeError(
                f"update {update}: the {what} differ(s) across processes (sha256 per rank: "
                f"{[r[key][:16] for r in per_rank]}); gradients were not synchronised"
            )
    checkpoints = Path(run_dir) / "checkpoints"
    final = checkpoints / f"update_{update:06d}"
    if accelerator.is_main_process:
        for stale in checkpoints.glob(".tmp_*"):  # left by a job killed while saving
            shutil.rmtree(stale, ignore_errors=True)
        tmp = checkpoints / f".tmp_{final.name}_{os.getpid()}"
        tmp.mkdir(parents=True)
        if isinstance(policy, PeftModel):
            save_adapter(policy, tmp)
        else:  # one file, the parameters' own names: from_pretrained reads it, load_checkpoint copies it back
            policy.config.save_pretrained(tmp)
            save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, tmp / weights_file(lora=False))
        if head_weights:
            save_file(head_weights, tmp / HEADS_FILE)
        torch.save(saved, tmp / "optimizer.pt")
        torch.save([r["rng"] for r in per_rank], tmp / "rng.pt")
        state = {
            "algorithm": algorithm,
            "update": update,
            **trainer_state,
            **checksums,
            "rank_states": [r["state"] for r in per_rank],
        }
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        if final.exists():  # saving an update again (resumed from an older checkpoint): move the old one aside first
            old = checkpoints / f".tmp_old_{final.name}_{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        heads_note = f", and heads sha256 {checksums['heads_sha256'][:16]}" if head_weights else ""
        print(
            f"[checkpoint] {final}: adapter sha256 {checksum[:16]} identical on {accelerator.num_processes} "
            f"process(es){heads_note}",
            file=sys.stderr,
        )
    accelerator.wait_for_everyone()
    return final


def _checkpoints_in(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary dirs of an interrupted save start with a dot)."""
    return sorted(p for p in (run_dir / "checkpoints").glob("update_*") if (p / "trainer_state.json").is_file())


def load_checkpoint(path: Path, model, optimizer, accelerator, heads: torch.nn.Module | None = None) -> None:
    """The trained weights and the algorithm's heads; with an optimizer (resuming) also its state and this process's
    RNG states, so call it right before the first update. Nothing is unpickled: safetensors, and
    torch.load(weights_only=True)."""
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    policy = accelerator.unwrap_model(model)
    lora = isinstance(policy, PeftModel)
    for unit in fsdp_modules(policy):  # --fsdp: the shards are the weights; gathered again below
        unit.reshard()
    ours = trained_weights(policy)
    weights = {
        name: placed_like(tensor, ours[name]) for name, tensor in load_file(str(path / weights_file(lora))).items()
    }
    if lora:
        set_peft_model_state_dict(policy, weights)
    else:
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                parameter.copy_(weights[name])
    gather_weights(policy)
    if heads:
        saved = load_file(str(path / HEADS_FILE)) if (path / HEADS_FILE).is_file() else {}
        ours = heads.state_dict()
        if {k: tuple(v.shape) for k, v in saved.items()} != {k: tuple(v.shape) for k, v in ours.items()}:
            raise ValueError(
                f"{path}: the checkpoint's heads ({ {k: tuple(v.shape) for k, v in saved.items()} }) are not this "
                f"algorithm's ({ {k: tuple(v.shape) for k, v in ours.items()} })"
            )
        heads.load_state_dict(saved)
    if optimizer is not None:
        # mmap: each process reads only what it keeps (its shard); load_state_dict moves the state to the parameters'
        saved = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu", mmap=True)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        saved["state"] = {
            i: {k: placed_like(v, params[i]) if v.shape == params[i].shape else v for k, v in state.items()}
            for i, state in saved["state"].items()
        }  # --fsdp: this process's shard of each moment; the step count as it is
        optimizer.load_state_dict(saved)
        _set_rng_state(torch.load(path / "rng.pt", weights_only=True)[accelerator.process_index])


def find_checkpoint(spec: str, output_dir: str, exp_name: str, seed: int, flag: str) -> Path | None:
    """`spec` of --resume / --eval-only: "" -> None; "auto" -> newest checkpoint of the latest run named exp_name
    with this seed (None if there is none); a checkpoint dir; or a run dir (its newest checkpoint)."""
    if not spec:
        return None
    if spec == "auto":
        runs = sorted(
            Path(output_dir).glob(f"{exp_name}__{seed}__*"),
            key=lambda p: (int(p.name.split("__")[-1]), p.name) if p.name.split("__")[-1].isdigit() else (0, p.name),
        )
        for run_dir in reversed(runs):
            if checkpoints := _checkpoints_in(run_dir):
                return checkpoints[-1]
        return None
    path = Path(spec)
    if (path / "trainer_state.json").is_file():
        return path
    if checkpoints := _checkpoints_in(path):
        return checkpoints[-1]
    raise ValueError(f"{flag} {spec}: no checkpoint there (expected trainer_state.json or checkpoints/update_*)")


def check_checkpoint(path: Path, args, algorithm: str, flag: str, num_processes: int | None) -> dict:
    """Open every file of a checkpoint and compare it with the flags, before anything loads; returns its
    trainer state. num_processes: resuming (optimizer and RNG states needed, one state per process)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    lora = (path / "adapter_config.json").is_file()  # else full weights (--lora-rank 0)
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        adapter_config = json.loads((path / "adapter_config.json").read_text()) if lora else {"r": 0}
        adapter = load_file(str(path / weights_file(lora)))
        heads = load_file(str(path / HEADS_FILE)) if isinstance(state, dict) and "heads_sha256" in state else None
        if num_processes is not None:
            for name in ("optimizer.pt", "rng.pt"):
                zipfile.ZipFile(path / name).close()  # a torch.save file is a zip; a truncated one has no directory
    except (OSError, ValueError, SafetensorError, zipfile.BadZipFile) as error:
        raise ValueError(
            f"{flag} {path}: corrupt or incomplete checkpoint ({type(error).__name__}: {error}); "
            "pass an older checkpoint dir"
        ) from error
    if (
        not isinstance(state, dict)
        or not isinstance(state.get("update"), int)
        or not isinstance(state.get("rank_states"), list)
    ):
        raise ValueError(f"{flag} {path}: corrupt checkpoint (trainer_state.json lacks update / rank_states)")
    if state.get("adapter_sha256") not in (None, adapter_sha256(adapter)):
        raise ValueError(
            f"{flag} {path}: corrupt checkpoint ({weights_file(lora)} does not match the sha256 in "
            "trainer_state.json); pass an older checkpoint dir"
        )
    if heads is not None and state["heads_sha256"] != adapter_sha256(heads):
        raise ValueError(
            f"{flag} {path}: corrupt checkpoint ({HEADS_FILE} does not match the sha256 in trainer_state.json); "
            "pass an older checkpoint dir"
        )
    if state.get("algorithm") != algorithm:
        raise ValueError(
            f"{flag} {path} is a checkpoint of {state.get('algorithm')!r}; this script trains {algorithm!r}"
        )
    if num_processes is not None and len(state["rank_states"]) != num_processes:
        raise ValueError(
            f"{flag} {path} was written by {len(state['rank_states'])} processes; resume it with the same "
            f"number (now {num_processes})"
        )
    saved = {"--lora-rank": adapter_config.get("r")}
    ours = {"--lora-rank": args.lora_rank}
    if lora and args.lora_rank:
        saved |= {
            "--lora-alpha": adapter_config.get("lora_alpha"),
            "--lora-targets": sorted(adapter_config.get("target_modules") or []),
        }
        ours |= {"--lora-alpha": args.lora_alpha, "--lora-targets": sorted(args.lora_targets)}
    for name, value in saved.items():
        if value != ours[name]:
            raise ValueError(f"{name} {ours[name]} does not match the checkpoint {path} ({value})")
    return state


def cli(args_type, main, presets: dict | None = None, argv: Sequence[str] | None = None):
    """tyro's CLI around main (argv: the command line's by default); returns what main returns. The parse's defaults
    are Args(), then a preset's values (`script.py NAME ...` or --preset NAME; presets: name -> (one line, Args)), then
    a --config file's, which --help shows; every flag given overrides them. With --eval-only every flag not given takes
    the evaluated run's value (its config.json). A StartupError prints just its message and exits 2, as tyro does for
    a bad flag."""
    presets = presets or {}
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in presets:
        argv = ["--preset", *argv]
    listing = "presets (`script.py NAME --flags`): " + "; ".join(f"{n}: {line}" for n, (line, _) in presets.items())
    description = f"{sys.modules[args_type.__module__].__doc__ or ''}\n{listing if presets else ''}"
    bare = [flag for flag in argv if flag not in ("-h", "--help")]  # --help shows the preset's or file's values
    args = tyro.cli(args_type, args=bare, description=description)
    try:
        if args.preset or args.config or bare != argv:
            args = tyro.cli(args_type, args=argv, default=configured_defaults(args, presets), description=description)
        if args.eval_only:
            args = tyro.cli(args_type, args=argv, default=evaluated_run_args(args), description=description)
        return main(args)
    except StartupError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def configured_defaults(args, presets: dict):
    """Args(), then --preset's values, then the --config file's (JSON or YAML: flag names as keys, a run's own
    config.json included); unknown keys, bad values and unknown presets are start-up errors naming them."""
    with startup_errors():
        check(
            (
                not args.preset or args.preset in presets,
                f"--preset must be one of {sorted(presets)}, got {args.preset!r}",
            )
        )
        default = presets[args.preset][1] if args.preset else type(args)()
        if args.config:
            default = config_file_args(args.config, default)
    return dataclasses.replace(default, preset=args.preset, config=args.config)


# Flags renamed when the scripts took one vocabulary (docs/new-algorithm.md): old name -> new name (or names, for a
# pair of values split in two). A --config file or a run's config.json written before still loads, with a note.
RENAMED_FLAGS = {
    "max_episode_steps": "max_turns",  # tempo.py
    "branches": "group_size",  # tempo.py
    "trajectories_per_game": "group_size",  # adca_grpo.py, gigpo.py
    "states_per_batch": "groups_per_update",  # tempo.py
    "games_per_update": "groups_per_update",  # adca_grpo.py, gigpo.py
    "warmup_games_per_batch": "warmup_groups_per_update",  # tempo.py
    "ppo_clip": ("clip_eps", "clip_eps_high"),  # tempo.py: [eps_low, eps_high], or null (the IS loss)
}


# Flags removed from a script because they lost (docs/does-it-learn.md keeps their figures): name -> (the value every
# run without the flag had, the commit that last had it). A file holding one at that value still loads (the key is
# dropped, with a note); at another value it is refused: that run needs the commit.
REMOVED_FLAGS = {
    "critic_replay": (0, "3d8e148"),  # tempo.py
    "critic_replay_capacity": (512, "3d8e148"),  # tempo.py
    "critic_coef": (1.0, "3d8e148"),  # tempo.py
    "critic_baseline": ("state", "3d8e148"),  # tempo.py
}


def renamed_flags(values: dict, source: str, note: bool = True) -> dict:
    """`values` (flag name -> value, from a file) with every old name of RENAMED_FLAGS read as its new one(s) and
    every REMOVED_FLAGS key at its old value dropped; a note on stderr names them. A file holding both a flag's old and
    new name, or a removed flag at another value, is refused."""
    renamed, notes = {}, []
    for key, value in values.items():
        if key in REMOVED_FLAGS:
            default, commit = REMOVED_FLAGS[key]
            check((value == default, f"{source}: {key} = {value!r} is no longer a flag; that run needs commit {commit}"))
            notes.append(f"{key} dropped (removed; it held its only value, {default!r})")
            continue
        new = RENAMED_FLAGS.get(key)
        if new is None:
            renamed[key] = value
            continue
        parts = dict(zip(new, (None, None) if value is None else value)) if isinstance(new, tuple) else {new: value}
        both = sorted(set(parts) & set(values))
        check((not both, f"{source}: holds both {key} and its new name {' and '.join(both)}; keep only the new"))
        renamed |= parts
        notes.append(f"{key} -> {' + '.join(parts)}")
    if notes and note:
        print(f"[config] {source}: old flag names read as the new ones: {'; '.join(notes)}", file=sys.stderr)
    return renamed


def config_file_args(path: str, default, keep: Sequence[str] = (), strict: bool = True):
    """`default` with the values of a JSON / YAML file of flags, parsed as the command line would parse them; the
    fields in `keep` stay default's; strict=False skips keys that are no flags of this script (an older run's)."""
    import yaml

    try:
        text = Path(path).read_text()
        values = yaml.safe_load(text) if path.endswith((".yaml", ".yml")) else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError) as error:
        raise ValueError(f"--config {path}: cannot read it ({type(error).__name__}: {error})") from error
    fields = {f.name: f for f in dataclasses.fields(default)}
    check((isinstance(values, dict), f"--config {path}: expected a mapping of flag names to values"))
    values = renamed_flags(values, f"--config {path}")
    unknown = sorted(set(values) - set(fields))
    check(
        (not strict or not unknown, f"--config {path}: unknown keys {unknown} (not flags of this script; see --help)")
    )
    flags = []
    for key, value in values.items():
        if key in ("preset", "config", *keep) or key not in fields:  # preset, config: where a run's values came from
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{key.replace('_', '-')}")
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, "None" if value is None else str(value)]
    try:
        return tyro.cli(type(default), args=flags, default=default)
    except SystemExit as error:  # tyro printed which value it refused
        raise ValueError(f"--config {path}: a value above is not valid for its flag") from error


def evaluated_run_args(args):
    """args with every field but resume, eval_only, output_dir, threads and fsdp (how this launch runs) taken from the
    config.json of the run that --eval-only names (args unchanged when it has none: startup_checks() then says what is
    missing)."""
    with startup_errors():
        checkpoint = find_checkpoint(args.eval_only, args.output_dir, args.exp_name, args.seed, "--eval-only")
    config_file = checkpoint.parent.parent / "config.json" if checkpoint is not None else None
    if config_file is None or not config_file.is_file():
        return args
    with startup_errors():
        return config_file_args(
            str(config_file), args, keep=("resume", "eval_only", "output_dir", "threads", "fsdp"), strict=False
        )


def close_distributed() -> None:
    """Two-process CPU runs have hung at exit without this."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# =============================================================================================
# The scripts' offline defaults: `--model tiny`, `--model tiny-agent`, the generated games when no --data-root
# (offline.py makes them)
# =============================================================================================
def resolve_model(model: str, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> str:
    """`tiny` -> the offline tiny model (built once into the cache), `tiny-agent` -> the warm-started agent (shipped,
    or built by benchmarks/learning/agents.py); anything else is passed through."""
    if model in offline.TINY_AGENTS:
        return str(offline.tiny_agent_weights(model, Path(cache_dir) / "learning-benchmark"))
    if model != "tiny":
        return model
    path = Path(cache_dir) / "tiny-model"
    if not (path / "model.safetensors").is_file():
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        offline.build_tiny_model(tmp)
        try:
            os.replace(tmp, path)  # atomic: a concurrent builder's copy is identical
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def resolve_data_root(data_root: str | None, model: str) -> str:
    """--data-root as given; unset: a tiny agent's own games (--model tiny-agent..., or the path to its shipped
    weights), else the offline game set."""
    if data_root:
        return data_root
    agent = offline.tiny_agent_name(model)
    return str(offline.tiny_agent_games(name=agent) if agent else offline.default_data_root())


# The CPU learning benchmarks' settings every script shares: its `learning` / `learning-long` presets add the rest
LEARNING_SETTINGS = {
    name: dict(
        model=agent,
        task_types=offline.TINY_AGENTS[agent].task_types,
        lora_rank=16,
        lora_alpha=32,
        learning_rate=1e-3,
        max_turn_tokens=48,
        max_trajectory_tokens=trajectory_tokens,
        sample_batch_size=64,
        save_every=6,
        eval_every=3,  # eval/train/success_rate, the quickstart's curve (benchmarks/learning/compare.py passes 0: it
        eval_games=16,  # evaluates each checkpoint on the training games itself, with more episodes)
    )
    for name, agent, trajectory_tokens in (
        ("learning", "tiny-agent", 8192),
        ("learning-long", "tiny-agent-long", 16384),
    )
}
