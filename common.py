"""Shared environment and replay side of the algorithms (everything that is not the model).

Sections: games (discovery, walkthroughs, the offline generator), safe grammar evaluation,
fast ALFWorld environments with snapshot and replay restore, the chat protocol, the batched
multi-turn rollout driver, and the tiny offline model used by tests and smoke runs.
"""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import random
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Sequence

import fast_downward
import textworld.logic
from textworld.generator.game import EntityInfo
from alfworld.agents.utils.misc import Demangler
from textworld.envs.pddl import logic as pddl_logic
from textworld.envs.pddl.textgen import (
    ConditionalSymbol,
    EvalSymbol,
    ListSymbol,
    NonterminalSymbol,
    TerminalSymbol,
    _parse_and_convert as _parse_symbols_uncached,
)

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
        task_type = json.loads(traj_file.read_text())["task_type"]
        if task_type not in wanted:
            continue
        if not json.loads(game_file.read_text()).get("solvable", False):
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


def load_walkthrough(game_file: str | Path) -> list[str]:
    """The expert actions stored in the game file: privileged information, never shown to the actor."""
    return list(json.loads(Path(game_file).read_text()).get("walkthrough") or [])


def load_task_type(game_file: str | Path) -> str:
    return json.loads((Path(game_file).parent / "traj_data.json").read_text())["task_type"]


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


class _Game:
    """Everything about one game file that does not change while playing it (shared by branches)."""

    def __init__(self, game_file: str):
        self.game_file = game_file
        data = json.loads(Path(game_file).read_text())
        self.walkthrough = list(data.get("walkthrough") or [])
        self.logic = pddl_logic.GameLogic(domain=data["pddl_domain"], grammar=data["grammar"])
        self.rules = {name: rules for name, rules in self.logic.grammar._rules.items()}
        self.conditions = {id(rule): _parse_query(rule.condition) for rules in self.rules.values() for rule in rules if rule.condition}
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
                stack.extend((s, mapping, variables) for s in reversed(self._choose_rule(symbol.symbol, state, mapping)))
            elif isinstance(symbol, ConditionalSymbol):
                stack.extend((symbol.expression, m, v) for m, v in reversed(self._query(symbol, state, mapping, variables)))
            elif isinstance(symbol, EvalSymbol):
                out.append(str(self._evaluate(symbol.expression, variables)))
            elif isinstance(symbol, ListSymbol):
                items = [(symbol.symbol.expression, m, v) for m, v in self._query(symbol.symbol, state, mapping, variables)]
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


@functools.lru_cache(maxsize=64)
def _load_game(game_file: str, mtime_ns: int) -> _Game:
    return _Game(game_file)


def load_game(game_file: str | Path) -> _Game:
    """Parsed and translated game, cached per process (keyed by path and modification time)."""
    game_file = str(game_file)
    return _load_game(game_file, os.stat(game_file).st_mtime_ns)



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
    turn: Turn | None


class AlfredEnv:
    """One ALFWorld game played on Fast Downward + TextWorld's grammar, with O(1) snapshot/restore."""

    def __init__(self, game_file: str | Path):
        self.game = load_game(game_file)
        self.game_file = self.game.game_file
        self._lib = fast_downward.load_lib()  # a private copy: the library keeps its state in globals
        self._lib.get_state_id.restype = ctypes.c_int
        self._lib.set_state_id.argtypes = [ctypes.c_int]
        self._lib.load_sas(self.game.sas.encode("utf-8"))
        self._lib.load_sas_replan(self.game.sas_replan.encode("utf-8"))
        self._state = self._initial_pddl_state()
        if self.game.entity_infos is None:
            self.game.entity_infos = self._entity_infos()
        self.turn: Turn | None = None
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
            elif isinstance(atom, fast_downward.translate.pddl.f_expression.Assign) and atom.fluent.symbol != "total-cost":
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
        if snapshot.turn is None:  # the initial snapshot is taken before the intro text exists
            snapshot.turn = self._gather(self._derive("#intro#", {}), 0)
        self.turn = snapshot.turn
        state._operators = self.turn.operators
        return self.turn

    def close(self):
        if self._lib is not None:
            fast_downward.close_lib(self._lib)
            self._lib = None


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
    snapshot that is restored (O(1)) before it steps, so branches are independent copies."""

    def __init__(self, game_file: str | Path, num_branches: int):
        if num_branches < 1:
            raise ValueError(f"num_branches must be >= 1, got {num_branches}")
        self.env = AlfredEnv(game_file)
        self.game_file = self.env.game_file
        self.turns = [self.env.reset()] * num_branches
        self._branches = [self.env.snapshot()] * num_branches

    @property
    def num_branches(self) -> int:
        return len(self._branches)

    def reset(self) -> list[Turn]:
        turn = self.env.reset()
        self._branches = [self.env.snapshot()] * self.num_branches
        self.turns = [turn] * self.num_branches
        return list(self.turns)

    def step(self, commands: Sequence[str | None]) -> list[Turn]:
        """One command per branch; None leaves that branch where it is."""
        if len(commands) != self.num_branches:
            raise ValueError(f"expected {self.num_branches} commands, got {len(commands)}")
        for branch, command in enumerate(commands):
            if command is not None:
                self.env.restore(self._branches[branch])
                self.turns[branch] = self.env.step(command)
                self._branches[branch] = self.env.snapshot()
        return list(self.turns)

    def snapshot(self, branch: int) -> EnvSnapshot:
        return self._branches[branch]

    def restore_snapshot(self, branch: int, snapshot: EnvSnapshot) -> Turn:
        """O(1) in-process restore of a snapshot taken from this group."""
        self._branches[branch], self.turns[branch] = snapshot, snapshot.turn
        return snapshot.turn

    def restore(self, state: SavedState) -> Turn:
        """Portable restore: replay the action history from reset into every branch and check the
        observation and admissible commands word for word. Raises ReplayMismatchError."""
        if Path(state.game_file).resolve() != Path(self.game_file).resolve():
            raise ValueError(f"state is for {state.game_file}, this group plays {self.game_file}")
        turn = self.env.reset()
        for command in state.actions:
            turn = self.env.step(command)
        if turn.observation != state.observation or turn.admissible != state.admissible:
            raise ReplayMismatchError(
                f"{self.game_file}: replaying {len(state.actions)} actions gave observation {turn.observation!r} "
                f"(saved: {state.observation!r}); admissible lists {'match' if turn.admissible == state.admissible else 'differ'}"
            )
        snapshot = self.env.snapshot()
        self._branches = [snapshot] * self.num_branches
        self.turns = [turn] * self.num_branches
        return turn

    def close(self):
        self.env.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
