"""Offline stand-ins for what this machine cannot download, under common.py (it imports no module of this project):
ALFWorld-format games generated from what the `alfworld` package ships, the tiny random Qwen2 chat model of tests and
smoke runs (`--model tiny`), and the tiny agents (`--model tiny-agent`, `tiny-agent-long`): their recipes, their 12
games and their weights, shipped in assets/ or built by benchmarks/learning/agents.py.

    python offline.py make-games --out data/offline --n 300 --seed 0
    python offline.py make-tiny-model --out /tmp/tiny
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import json
import multiprocessing
import os
import random
import shutil
import sys
import time
import types
from pathlib import Path
from typing import Sequence

import alfworld
import alfworld.gen.constants as alfred_constants
import alfworld.gen.goal_library as goal_library
import numpy as np
import textworld
import textworld.gym
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
from textworld.envs import PddlEnv

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
DEFAULT_CACHE_DIR = Path(os.environ.get("ALFWORLD_OFFLINE_CACHE", Path.home() / ".cache" / "cleanrl-agents"))


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


def stored_walkthrough(game_file) -> list[str]:
    """The walkthrough a generated game file stores (replayed in the stock engine to check that it wins)."""
    return json.loads(Path(game_file).read_text()).get("walkthrough") or []


def replay_games(game_files, max_steps=200) -> dict[str, bool]:
    """Play each game's stored walkthrough in the stock engine; returns {game_file: won}.
    One env for all: each env loads its own copy of libdownward.so."""
    argv, env, results = sys.argv, stock_alfworld_env(game_files, max_steps), {}
    try:
        for _ in game_files:  # the env's first cycle visits each game once, in a shuffled order
            _, info = env.reset()
            game_file, won = info["extra.gamefile"][0], False
            for command in stored_walkthrough(game_file):
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


class _InlineExecutor(concurrent.futures.Executor):
    """workers=1: each call runs at submit, in this process."""

    def submit(self, fn, /, *args):
        future = concurrent.futures.Future()
        future.set_result(fn(*args))
        return future


_PLANNER = None  # one per process: Fast Downward keeps its state in globals


def _plan(game):
    global _PLANNER
    if _PLANNER is None:
        _PLANNER = AlfredDemangler(PddlEnv(textworld.EnvInfos(policy_commands=True)))
    return plan_walkthrough(_PLANNER, game)


def make_games(
    out_dir, n: int, seed: int = 0, max_receptacles: int = 15, log=print, workers: int | None = None
) -> list[str]:
    """Write n solvable games (round-robin over TASK_TYPES; ~80/10/10 train/valid_seen/valid_unseen) in
    ALFWorld's download layout under out_dir/json_2.1.1; returns the game files written. workers (default: every
    core) processes plan and replay them; the bytes written do not depend on it."""
    rng = random.Random(seed)
    with open(os.path.join(ALFWORLD_DIR, "data", "alfred.pddl")) as f:
        domain = f.read()
    with open(os.path.join(ALFWORLD_DIR, "data", "alfred.twl2")) as f:
        grammar = f.read()
    scenes = sorted(int(f[9:-13]) for f in os.listdir(LAYOUTS_DIR) if f.endswith("-objects.json"))
    workers = workers or os.cpu_count() or 1

    n_valid = round(n / 10)  # per valid split; the last games, so each split cycles through all task types

    def draw(i, first_attempt):  # game i's next candidate from the rng; None when out of attempts
        task_type = TASK_TYPES[i % len(TASK_TYPES)]
        split = "train" if i < n - 2 * n_valid else "valid_seen" if i < n - n_valid else "valid_unseen"
        pool = [
            s
            for s in scenes
            if (s in UNSEEN_SCENES) == (split == "valid_unseen")
            and ROOM_OF_SCENE[s] in alfred_constants.GOALS_VALID[task_type]
        ]
        for attempt in range(first_attempt, 100):
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
            game_dir = os.path.join(
                out_dir, "json_2.1.1", split, "%s-%s-None-%s-%d" % (task_type, obj, parent or toggle, scene), trial
            )
            traj_data = {
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
            }  # templated, not human-written
            return types.SimpleNamespace(
                i=i, attempt=attempt, task=task, scene=scene, game=game, problem=problem, dir=game_dir, traj=traj_data
            )
        return None

    def write(c, walkthrough):
        os.makedirs(c.dir, exist_ok=True)
        c.game.update(pddl_problem=c.problem, solvable=True, walkthrough=walkthrough)
        _write_json(os.path.join(c.dir, "game.tw-pddl"), c.game)
        _write_json(os.path.join(c.dir, "traj_data.json"), c.traj)
        return os.path.join(c.dir, "game.tw-pddl")

    def generate(todo, executor):
        """Plan candidates ahead in parallel, drawn as if each were solvable (the rng's state after a draw does
        not depend on that); accept them in order. An unsolvable one discards those drawn after it and draws
        again from the rng state right after it: the sequential draws, whatever the number of workers."""
        lookahead = 1 if workers == 1 else 2 * workers
        pending = collections.deque()  # (position in todo, candidate, planning future, rng state after the draw)
        k, attempt, t0 = 0, 0, time.time()
        while pending or k < len(todo):
            while k < len(todo) and len(pending) < lookahead:
                c = draw(todo[k], attempt)
                pending.append((k, c, c and executor.submit(_plan, c.game), rng.getstate()))
                k, attempt = k + 1, 0
            k_head, c, future, state = pending.popleft()
            if c is None:
                raise RuntimeError("could not generate a %s game" % TASK_TYPES[todo[k_head] % len(TASK_TYPES)])
            walkthrough = future.result()
            if walkthrough:
                files[c.i] = write(c, walkthrough)
                log("game %d/%d: %s (%d steps, %.2fs)" % (c.i + 1, n, c.dir, len(walkthrough), time.time() - t0))
                t0 = time.time()
                continue
            log("  unsolvable: %s in FloorPlan%d" % (c.task, c.scene))
            while pending:
                later = pending.pop()[2]
                if later:
                    later.cancel()  # not started yet: free its worker
            rng.setstate(state)
            k, attempt = k_head, c.attempt + 1

    files = [None] * n
    executor = (
        _InlineExecutor()
        if workers == 1
        else concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    )
    with executor:
        for _ in range(10):  # generate, then replay every new game to won in the real engine
            todo = [i for i in range(n) if files[i] is None]
            if not todo:
                return files
            generate(todo, executor)
            t0, results = time.time(), {}
            chunks = [[files[i] for i in todo[w::workers]] for w in range(min(workers, len(todo)))]
            for chunk_results in executor.map(replay_games, chunks):  # replay: most of the time, 1-2 s a game
                results.update(chunk_results)
            log("replayed %d games in %.1fs" % (len(todo), time.time() - t0))
            for i in todo:
                if not results[files[i]]:
                    log("  discarded, walkthrough did not win: " + files[i])
                    shutil.rmtree(os.path.dirname(files[i]))
                    files[i] = None
    raise RuntimeError("games keep failing their replay")


DEFAULT_GAMES, DEFAULT_GAMES_SEED = 240, 0


def generation_time(n: int) -> str:
    """How long make_games takes for n games on this machine's idle cores: ~2.2 s of a core a game (n=240 on 2 idle
    cores, 2026-12-01: 268 s wall, 528 s CPU), most of it replaying the game in the stock engine."""
    cores = os.cpu_count() or 1
    minutes = n * 2.2 / cores / 60
    return f"{'under a minute' if minutes < 1 else f'about {round(minutes * 2) / 2:g} min'} on {cores} idle cores"


def publish(tmp: Path, final: Path) -> None:
    """Move a finished cache folder into place atomically; where a concurrent maker got there first (same bytes), drop
    this copy."""
    try:
        os.replace(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def default_data_root(
    n: int = DEFAULT_GAMES, seed: int = DEFAULT_GAMES_SEED, cache_dir: str | Path | None = None
) -> Path:
    """The generated offline game set: made once into the cache (~4.5 min on 2 cores, with a progress bar), reused
    after."""
    from tqdm import tqdm

    root = Path(cache_dir or DEFAULT_CACHE_DIR) / f"offline-games-n{n}-seed{seed}"
    if not (root / "json_2.1.1").is_dir():
        tmp = root.with_name(f"{root.name}.tmp{os.getpid()}")
        desc = f"generating offline games into {root} (once, {generation_time(n)})"
        with tqdm(total=n, desc=desc, unit="game", file=sys.stderr) as bar:
            make_games(tmp, n, seed, log=lambda line: bar.update(line.startswith("game ")))
        publish(tmp, root)
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


# =============================================================================================
# The tiny agents (`--model tiny-agent`, `tiny-agent-long`): small models warm-started on a few games, that RL
# improves on CPU
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class TinyAgentRecipe:
    """sft.py stages from a random 0.9M-parameter Qwen2 on noisy-expert episodes (eps 0.2, 8 per game) of the 12
    offline games' training games of `task_types`, with TEMPO critic examples."""

    task_types: tuple[str, ...]
    stages: tuple[tuple[tuple[str, ...], int], ...]  # (extra sft.py flags, seed) per stage
    dir_prefix: str  # stage k is built into <root>/<dir_prefix>-stage<k>


TINY_AGENTS = {
    # 4 games with 4-step walkthroughs, 6-turn episodes. Found by hand: the sampled success of a clone does not rise
    # monotonically with training, and these stages land at ~0.25 (stage 2 alone: ~0.1; 16 epochs instead of 5 in
    # stage 3: ~0.6), where RL has room to show.
    "tiny-agent": TinyAgentRecipe(
        task_types=("look_at_obj_in_light", "pick_and_place_simple"),
        stages=(
            (("--max-turns", "8", "--macro-rounds", "4", "--num-epochs", "40", "--target-loss", "0.15"), 1),
            (("--max-turns", "8", "--macro-rounds", "4", "--num-epochs", "40", "--target-loss", "0.04"), 1),
            (("--max-turns", "6", "--macro-rounds", "3", "--num-epochs", "5"), 2),
        ),
        dir_prefix="warm-start",
    ),
    # 4 games with 6-10-step walkthroughs (pick two, clean, cool), 20-turn episodes in macro steps of 5.
    "tiny-agent-long": TinyAgentRecipe(
        task_types=("pick_two_obj_and_place", "pick_clean_then_place_in_recep", "pick_cool_then_place_in_recep"),
        stages=(
            (("--max-turns", "20", "--macro-rounds", "5", "--num-epochs", "40", "--target-loss", "0.15"), 1),
            (("--max-turns", "20", "--macro-rounds", "5", "--num-epochs", "40", "--target-loss", "0.04"), 1),
            (("--max-turns", "20", "--macro-rounds", "5", "--num-epochs", "8"), 2),
        ),
        dir_prefix="long-warm-start",
    ),
}
TINY_AGENT = "tiny-agent"
TINY_AGENT_TASK_TYPES = TINY_AGENTS[TINY_AGENT].task_types
# tiny-agent's weights ship with the repo (3.7 MB), so a first run waits only for its games; `python -m
# benchmarks.learning.agents --out DIR` rebuilds them (~7 min on one CPU thread) and compares
SHIPPED_AGENTS_DIR = Path(__file__).resolve().parent / "assets"


def tiny_agent_name(model: str) -> str | None:
    """The tiny agent that --model names: `tiny-agent`..., or a path to its shipped weights (assets/tiny-agent)."""
    if model in TINY_AGENTS:
        return model
    shipped = {(SHIPPED_AGENTS_DIR / name).resolve(): name for name in TINY_AGENTS}
    return shipped.get(Path(model).resolve()) if os.path.isdir(model) else None


def tiny_agent_games(root: str | Path = DEFAULT_CACHE_DIR / "learning-benchmark", name: str = TINY_AGENT) -> Path:
    """The tiny agents' games root: the generator's first 12 games (seed 0), made once into root/games."""
    root = Path(root)
    games = root / "games"
    if not (games / "json_2.1.1").is_dir():
        print(f"[{name}] generating its 12 games into {games} (once, {generation_time(12)})", file=sys.stderr)
        tmp = root / f"games.tmp{os.getpid()}"
        make_games(tmp, n=12, seed=0, log=lambda *a: None)
        publish(tmp, games)
    return games


def tiny_agent_weights(name: str = TINY_AGENT, root: str | Path = DEFAULT_CACHE_DIR / "learning-benchmark") -> Path:
    """The model dir of the tiny agent `name`: shipped (assets/NAME), or built into root by
    benchmarks/learning/agents.py (its last sft.py stage); a ValueError naming the build command when neither."""
    if (SHIPPED_AGENTS_DIR / name / "model.safetensors").is_file():
        return SHIPPED_AGENTS_DIR / name
    recipe = TINY_AGENTS[name]
    built = Path(root) / f"{recipe.dir_prefix}-stage{len(recipe.stages)}"
    if not (built / "sft.json").is_file():
        raise ValueError(
            f"--model {name}: not built yet (its weights are not shipped); build it once (its sft.py stages, on CPU) "
            f"with `python -m benchmarks.learning.agents --name {name}` (into {root})"
        )
    return built


def tiny_agent(
    name: str = TINY_AGENT, root: str | Path = DEFAULT_CACHE_DIR / "learning-benchmark"
) -> tuple[Path, Path]:
    """(model dir, games root) of the tiny agent `name`: tiny_agent_weights and tiny_agent_games."""
    return tiny_agent_weights(name, root), tiny_agent_games(root, name)


if __name__ == "__main__":
    import argparse

    cli = argparse.ArgumentParser(description="offline.py tools")
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
