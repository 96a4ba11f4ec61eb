"""Peer benchmark: the same multi-turn GRPO job through adca_grpo.py and through TRL's GRPOTrainer, side by side.

Ours is `adca_grpo.py learning --no-attribution` itself (its preset: the tiny agent, its 4 games, 4 groups x 4
episodes, <= 6 turns of <= 48 new tokens, LoRA r16 / alpha 32 on every projection, lr 1e-3, no KL). TRL's is
`GRPOTrainer(environment_factory=..., peft_config=...)` playing the same games through the repo's AlfredEnv, with
every setting of that run mapped onto GRPOConfig field by field (trl_settings; UNMATCHED says what cannot be and
why). Each runs in its own process on one thread; the two take turns update by update (ours first on odd updates,
TRL first on even ones), so whatever else loads the machine hits both alike.

Printed: per update (median over updates 2..N; update 1 holds the start-up costs and the token check) wall time,
generation and training time, generated and trained tokens/s, the update's sequence tokens per wall second, prompt
tokens prefilled, peak RSS, TRL / ours; the sampled success of every update; and the check that each trained on exactly
the tokens it sampled (update 1).

With --sampler vllm ours samples through a CPU vLLM server started here (benchmarks/vllm_cpu.py; on one core, each
side's trainer on the other), and with --async-steps K >= 1 samples the next batches while it trains. Its generation
time is then the sampling of its batch (in the background, overlapping the update before), its prefilled tokens the
server's (vllm:prompt_tokens_by_source, local_compute: what its prefix cache did not hold), and it runs all its updates
before TRL runs any: taking turns, its sampling thread would go on sampling during TRL's.

    pip install -e '.[peer]'
    python -m benchmarks.speed.trl_peer                            # 12 updates each
    python -m benchmarks.speed.trl_peer --setting learning-long    # the 20-turn games, where re-feeding costs TRL most
    python -m benchmarks.speed.trl_peer --trl-gradient-checkpointing   # TRL's default: less memory, slower
    python -m benchmarks.speed.trl_peer --setting learning-long --num-updates 4 --sampler vllm --async-steps 1
                                                                 # ours one step ahead through vLLM, 20 turns
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import multiprocessing
import os
import platform
import re
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil
import torch
import tyro

import adca_grpo
import common
import harness
import samplers
import training
from benchmarks.vllm_cpu import VllmServer, split_cores

# (our flag = value, what TRL does instead, why it cannot be matched)
UNMATCHED = (
    ("--kv-cache-mb 8192", "every turn re-prefills the whole history",
     "the mechanism under test: TRL's generate() path keeps no cache between the turns of an episode"),
    ("--micro-batch-tokens 16384", "per_device_train_batch_size = all episodes of the update in one micro-batch",
     "TRL splits an update by rows, ours by a token budget; the gradient is the same, the memory is not"),
    ("--max-trajectory-tokens", "max_completion_length = the budget - the longest first prompt",
     "TRL bounds the tokens after the first prompt and truncates; ours stops before a turn that could overflow "
     "(neither binds at these settings)"),
    ("an invalid reply", "ends the episode (TRL stops at a reply without a tool call)",
     "ours answers \"invalid format\" and the episode goes on (a call TRL parses with an action parse_action "
     "refuses, e.g. an empty one, gets \"invalid format\" in both)"),
    ("a win or the last turn ends the episode", "the environment answers with a reply longer than "
     "max_completion_length, which TRL drops before it ends the episode",
     "TRL gives an environment no way to end an episode"),
    ("GRPO advantage (r - mean) / (std + 1e-6)", "(r - mean) / (std + 1e-4)", "TRL's constant"),
    ("old logprobs from the sampler", "old logprobs = the training forward (detached)",
     "TRL's generate() path returns no logprobs; at one optimizer step per rollout both make the ratio 1"),
)  # fmt: skip


@dataclass
class Args:
    setting: Literal["learning", "learning-long"] = "learning"
    """adca_grpo.py's preset of the job (learning-long: tiny-agent-long, 20 turns)"""
    num_updates: int = 12
    """updates of each (the medians are over updates 2..N)"""
    groups_per_update: int | None = None
    """groups (games) per update (None: the preset's)"""
    group_size: int | None = None
    """episodes per group (None: the preset's)"""
    max_turns: int | None = None
    """turns per episode (None: the preset's)"""
    seed: int = 1
    """seed of both runs"""
    trl_gradient_checkpointing: bool = False
    """TRL with its default gradient checkpointing (ours has none on CPU)"""
    output_dir: str = "runs/trl-peer"
    """where the workers' logs, our run directory and results.json go"""
    sampler: Literal["generate", "vllm"] = "generate"
    """how ours samples: generate (in its process, as TRL) or vllm (a CPU vLLM server started here, on its own core)"""
    async_steps: int = 0
    """ours' --async-steps (>= 1 needs --sampler vllm): its next batches sampled while it trains"""
    sampler_url: str = ""
    """with --sampler vllm: a running server of the setting's tiny agent to use instead of starting one"""


# =============================================================================================
# The job: our script's own arguments, and TRL's settings mapped from them
# =============================================================================================
def script_args(args: Args) -> adca_grpo.Args:
    """adca_grpo.Args as `adca_grpo.py SETTING --no-attribution ...` parses them (one thread, checkpoint at the end)."""
    argv = [args.setting, "--no-attribution", "--num-updates", str(args.num_updates), "--seed", str(args.seed),
            "--threads", "1", "--save-every", "0", "--output-dir", str(Path(args.output_dir) / "ours"),
            "--async-steps", str(args.async_steps)]  # fmt: skip
    if args.sampler == "vllm":  # no evaluation: every play is a training batch, and no untimed play to sample ahead in
        argv += ["--sampler", "vllm", "--sampler-url", args.sampler_url, "--eval-every", "0"]
    for flag, value in (
        ("--groups-per-update", args.groups_per_update),
        ("--group-size", args.group_size),
        ("--max-turns", args.max_turns),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return harness.cli(adca_grpo.Args, lambda parsed: parsed, adca_grpo.PRESETS, argv)


def trl_settings(a: adca_grpo.Args, first_prompt_tokens: int, output_dir: str, gradient_checkpointing: bool):
    """(GRPOConfig keyword arguments, LoraConfig) of the same job, field by field from our run's arguments."""
    from peft import LoraConfig

    harness.require_all(
        (a.kl_beta == 0, "trl_peer: TRL has no KL reward shaping (--kl-beta)"),
        (a.mini_batches == 1, "trl_peer: TRL splits a rollout into optimizer steps differently (--mini-batches)"),
    )
    config = dict(
        output_dir=output_dir,
        seed=a.seed,
        data_seed=a.seed,
        max_steps=a.num_updates,  # one rollout and one optimizer step per update, as ours
        num_generations=a.group_size,  # the group size
        per_device_train_batch_size=a.groups_per_update * a.group_size,  # the whole rollout...
        gradient_accumulation_steps=1,  # ...in one optimizer step
        num_iterations=a.ppo_epochs,
        learning_rate=a.learning_rate,
        lr_scheduler_type="constant",  # ours has no schedule
        warmup_steps=0,
        optim="adamw_torch",  # torch.optim.AdamW, as ours
        adam_beta1=a.adam_betas[0],
        adam_beta2=a.adam_betas[1],
        weight_decay=a.weight_decay,
        max_grad_norm=a.max_grad_norm,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=0,  # ours samples from the whole distribution
        repetition_penalty=1.0,
        generation_kwargs={"max_new_tokens": a.max_turn_tokens},  # per turn; max_completion_length bounds the rest
        max_completion_length=a.max_trajectory_tokens - first_prompt_tokens,
        max_tool_calling_iterations=a.max_turns,  # a safety net: the environment ends the episode at turn T
        loss_type="dapo",  # token mean over the whole update, as ours
        scale_rewards="group",  # the GRPO z-score within the group
        epsilon=a.clip_eps,
        epsilon_high=a.clip_eps if a.clip_eps_high is None else a.clip_eps_high,
        delta=a.dual_clip_c,  # TRL's two-sided clip caps the ratio at delta: dual clip for A < 0, no effect for A > 0
        beta=a.kl_loss_coef,  # both a k3 KL loss term
        mask_truncated_completions=False,  # ours trains truncated replies too
        bf16=False,  # ours is fp32 on CPU
        gradient_checkpointing=gradient_checkpointing,  # ours: none on CPU
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
    )
    lora = LoraConfig(
        r=a.lora_rank,
        lora_alpha=a.lora_alpha,
        target_modules=list(a.lora_targets),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    return config, lora


# =============================================================================================
# The check: each side trains on exactly the tokens it sampled, in the context it sampled them in
# =============================================================================================
class SampleLog:
    """What the sampler returned, per prompt (a multiset: a group's episodes share their first prompt)."""

    def __init__(self):
        self.recording = False
        self.samples: dict[tuple[int, ...], list[tuple[int, ...]]] = collections.defaultdict(list)

    def add(self, prompts, completions) -> None:
        if self.recording:
            for prompt, completion in zip(prompts, completions):
                self.samples[tuple(prompt)].append(tuple(completion))

    def trained_as_sampled(self, tokens: list[int], trained: list[bool]) -> bool:
        """Whether every run of trained tokens is exactly a reply the sampler returned for all the tokens before it
        (each reply used once)."""
        for start, end in trained_runs(trained):
            replies = self.samples.get(tuple(tokens[:start]), [])
            if tuple(tokens[start:end]) not in replies:
                return False
            replies.remove(tuple(tokens[start:end]))
        return True


def trained_runs(trained: list[bool]) -> list[tuple[int, int]]:
    """(start, end) of each run of trained positions."""
    runs, start = [], None
    for i, flag in enumerate(trained + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_rss_tree_gb(pid: int) -> float:
    """The sum of each process's peak RSS (VmHWM) over `pid` and its children: an upper bound on their joint peak."""
    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    status = [Path(f"/proc/{process.pid}/status").read_text() for process in processes]
    return sum(int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) for text in status) / 2**20


def server_prefilled(url: str) -> float:
    """The prompt tokens the vLLM server at url computed so far, those its prefix cache held left out (GET /metrics:
    vllm:prompt_tokens_by_source, source local_compute)."""
    import httpx

    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=60).text
    counter = "vllm:prompt_tokens_by_source_total{"
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(counter) and 'source="local_compute"' in line]  # fmt: skip
    if not values:
        raise RuntimeError(f"{url}: GET /metrics has no vllm:prompt_tokens_by_source_total{{source=\"local_compute\"}}")
    return sum(values)


class Turns:
    """A worker's side of the alternation: say it is ready, wait for its turn, run one update, send its figures."""

    def __init__(self, conn):
        self.conn, self.ready, self.started = conn, False, None

    def wait(self) -> float:
        """Waits for the update's turn and returns when it began (at once if it has already begun)."""
        if self.started is None:
            if not self.ready:
                self.conn.send({"ready": True})
                self.ready = True
            self.conn.recv()
            self.started = time.perf_counter()
        return self.started

    def report(self, figures: dict) -> None:
        self.started = None
        self.conn.send(figures | {"peak_rss_gb": peak_rss_gb()})


def log_to(path: Path) -> None:
    """This process's stdout and stderr into `path` (the parent prints the table)."""
    log = open(path, "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)


# =============================================================================================
# Ours: adca_grpo.main itself, each update run when the parent says so
# =============================================================================================
def ours_worker(conn, args: Args, cores: list[int] | None) -> None:
    log_to(Path(args.output_dir) / "ours.log")
    if cores:
        os.sched_setaffinity(0, cores)
    turns, log, check = Turns(conn), SampleLog(), {}
    log.recording = True  # until update 1's check: with --async-steps its batch is sampled before the update begins
    sample, train_step, update_fn = samplers.GenerateSampler.__call__, training.train_step, adca_grpo.adca_update
    complete_all, start_rollouts = samplers.ServerSampler._complete_all, harness.AsyncRollouts.__init__
    play = harness.Runtime.play
    batches = []  # --sampler vllm: (seconds, tokens the server prefilled) of each training batch's play, in order

    def recorded_sample(sampler, prompts, max_new_tokens):
        completions = sample(sampler, prompts, max_new_tokens)
        log.add(prompts, [c.tokens for c in completions])
        return completions

    async def recorded_complete_all(sampler, prompts, max_new_tokens, adapter):
        completions = await complete_all(sampler, prompts, max_new_tokens, adapter)
        log.add(prompts, [c.tokens for c in completions])
        return completions

    def timed_play(rt, *play_args, **play_kwargs):
        prefilled, start = server_prefilled(rt.args.sampler_url), time.perf_counter()
        groups = play(rt, *play_args, **play_kwargs)
        batches.append((time.perf_counter() - start, server_prefilled(rt.args.sampler_url) - prefilled))
        return groups

    def rollouts_from_turn_1(rollouts, *init_args):  # the sampling thread starts with update 1's turn, not before
        turns.wait()
        start_rollouts(rollouts, *init_args)

    def checked_train_step(rt, datums, loss_fn):
        if log.recording:  # update 1: the datums hold the sampled tokens, and the trainer gives them their logprobs
            log.recording = False
            check.update(
                sequences=len(datums),
                as_sampled=sum(log.trained_as_sampled(d.tokens, [m > 0 for m in d.mask]) for d in datums),
            )
            if args.sampler == "generate":  # through the server they are the trainer's already: see timed_update
                fresh = training.trained_logprobs(rt, datums)
                check["max_logprob_diff"] = max(abs(new - old) for d, f in zip(datums, fresh)
                                                for new, old, m in zip(f, d.old_logprobs, d.mask) if m)  # fmt: skip
        return train_step(rt, datums, loss_fn)

    def timed_update(rt, update):
        start = turns.wait()
        prefilled = 0 if args.sampler == "vllm" else rt.sample_fn.stats["prefilled"]
        metrics, samples = update_fn(rt, update)
        wall = time.perf_counter() - start
        if args.sampler == "vllm":  # at K >= 1 the batch was sampled in the background, during the update before
            generation_s, prefilled = batches[update - 1]
            if update == 1:  # the trainer recomputed the old logprobs: the check is the server's drift from them
                check["max_logprob_diff"] = metrics["rollout/logprob_drift_max"]
        else:
            generation_s, prefilled = metrics["time/rollout"], rt.sample_fn.stats["prefilled"] - prefilled
        turns.report(
            dict(
                update=update,
                wall_s=wall,
                generation_s=generation_s,
                training_s=wall - metrics["time/rollout"],  # at K >= 1 time/rollout is the wait for the batch
                generated_tokens=metrics["rollout/generated_tokens"],
                sequence_tokens=metrics["train/sequence_tokens"],
                prefilled_tokens=prefilled,
                success=metrics["rollout/success_rate"],
            )
        )
        return metrics, samples

    samplers.GenerateSampler.__call__, training.train_step = recorded_sample, checked_train_step
    samplers.ServerSampler._complete_all, harness.AsyncRollouts.__init__ = recorded_complete_all, rollouts_from_turn_1
    if args.sampler == "vllm":
        harness.Runtime.play = timed_play
    adca_grpo.adca_update = timed_update  # main() looks it up at each update
    adca_grpo.main(script_args(args))
    conn.send({"done": True, "check": check, "peak_rss_gb": peak_rss_gb()})


# =============================================================================================
# TRL: GRPOTrainer with an environment_factory on AlfredEnv, each optimizer step run when the parent says so
# =============================================================================================
class AlfworldEnvironment:
    """One TRL rollout's game: `alfworld_step` is its tool (TRL builds the tool schema from its signature and
    docstring: the same as common.ALFWORLD_TOOL, checked at start) and answers as our rollout's tool messages do.
    TRL ends an episode only at a reply without a tool call, so a win and the last turn answer `end_reply`, longer
    than TRL's completion budget: TRL drops it and ends the episode, as ours ends it after the reply."""

    _idle: dict[str, list[common.AlfredEnv]] = collections.defaultdict(list)  # envs of ended episodes, per game

    def __init__(self, protocol: common.ChatProtocol, max_turns: int, end_reply: str):
        self.protocol, self.max_turns, self.end_reply = protocol, max_turns, end_reply
        self._env, self.won, self.replies = None, False, []

    def reset(self, game: str, **_) -> str:
        """A fresh episode of `game`; the first observation is appended to the (empty) user message."""
        if self._env is not None:
            self._idle[self._env.game_file].append(self._env)
        self._env = self._idle[game].pop() if self._idle[game] else common.AlfredEnv(game)
        self._turn, self.won, self.replies = self._env.reset(), False, []
        return self.protocol.user_message(self._turn.observation, self._turn.admissible)

    def alfworld_step(self, action: str):  # no return annotation: it would add a "return" field to the schema
        previous = self._turn
        command = common.parse_action(common.tool_call(action)) if isinstance(action, str) else None
        if command is not None:  # normalised as ours (lowercase, one space); empty or multi-line: invalid
            self._turn = self._env.step(command)
        self.won = self._turn.won
        if self.won or len(self.replies) + 1 >= self.max_turns:
            return self.end_reply
        reply = self.protocol.tool_message(
            common.step_status(command, previous, self._turn), self._turn.observation, self._turn.admissible
        )
        self.replies.append(reply)
        return reply

    def get_reward(self) -> float:
        return float(self.won)


_tool = common.ALFWORLD_TOOL["function"]
AlfworldEnvironment.alfworld_step.__doc__ = (
    f"{_tool['description']}\n\nArgs:\n    action: {_tool['parameters']['properties']['action']['description']}\n"
)


def trl_worker(conn, args: Args, cores: list[int] | None) -> None:
    log_to(Path(args.output_dir) / "trl.log")
    if cores:
        os.sched_setaffinity(0, cores)
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from transformers.utils import get_json_schema
    from trl import GRPOConfig, GRPOTrainer

    a = script_args(args)
    torch.set_num_threads(1)
    set_seed(a.seed)
    model_dir, data_root = samplers.resolve_model(a.model), common.resolve_data_root(a.data_root, a.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    protocol = common.ChatProtocol(tokenizer)
    games = common.discover_games(data_root, a.split, a.task_types, seed=a.seed)
    first_prompts = {game: common.game_start(game, protocol).prefix_tokens for game in games}
    settings, lora = trl_settings(
        a, max(map(len, first_prompts.values())), str(Path(args.output_dir) / "trl"), args.trl_gradient_checkpointing
    )
    end_reply = "~" * (settings["max_completion_length"] + 1)  # one token a character: cheap to render
    environment = functools.partial(AlfworldEnvironment, protocol, a.max_turns, end_reply)
    harness.require_all(
        (get_json_schema(environment().alfworld_step) == common.ALFWORLD_TOOL, "trl_peer: the tool schemas differ"),
        (len(protocol.encode(end_reply)) > settings["max_completion_length"], "trl_peer: the end reply is too short"),
    )
    turns, log, check = Turns(conn), SampleLog(), {}
    step: dict = {}

    class Trainer(GRPOTrainer):
        """GRPOTrainer, timed: the rollout (generation, tools, rewards) apart from the rest of the step."""

        def _generate_single_turn(self, prompt_ids, *rest, **kwargs):
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *rest, **kwargs)
            step["prefilled_tokens"] += sum(map(len, prompt_ids))  # generate() prefills every prompt whole
            log.add(prompt_ids, completion_ids)
            return completion_ids, logprobs

        def _get_tool_suffix_ids(self, tool_messages):
            start = time.perf_counter()
            suffix = super()._get_tool_suffix_ids(tool_messages)
            if tool_messages[-1]["content"] == end_reply:  # the workaround's own cost
                step["end_reply_s"] += time.perf_counter() - start
            return suffix

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            batch = super()._generate_and_score_completions(inputs)
            step["generation_s"] = time.perf_counter() - start
            trained = batch["completion_mask"] * batch["tool_mask"]
            step["generated_tokens"] = int(trained.sum())
            step["sequence_tokens"] = int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
            step["success"] = sum(env.won for env in self.environments) / len(self.environments)
            if log.recording:
                log.recording = False
                check.update(trl_check(batch, self.environments, log, protocol, first_prompts, inputs))
            return batch

    class Alternate(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kwargs):
            log.recording = state.global_step == 0
            step.clear()
            step.update(prefilled_tokens=0, end_reply_s=0.0, start=turns.wait())

        def on_step_end(self, args_, state, control, **kwargs):
            wall = time.perf_counter() - step.pop("start")
            turns.report(step | {"update": state.global_step, "wall_s": wall, "training_s": wall - step["generation_s"]})

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = [{"role": "system", "content": protocol.system_prompt}, {"role": "user", "content": ""}]
    trainer = Trainer(
        model=model,
        args=GRPOConfig(**settings),
        train_dataset=Dataset.from_dict({"prompt": [prompt] * len(games), "game": games}),
        processing_class=tokenizer,
        peft_config=lora,
        environment_factory=environment,
        callbacks=[Alternate()],
    )
    trainer.train()
    conn.send({"done": True, "check": check, "peak_rss_gb": peak_rss_gb()})


def trl_check(batch: dict, environments, log: SampleLog, protocol, first_prompts: dict, inputs) -> dict:
    """TRL's trained sequences: each trained run is a reply generate() returned for exactly the tokens before it,
    and the whole sequence is token for token what our protocol renders for the same episode (first prompt, then
    each reply, its closing and the tool message)."""
    as_sampled = same_as_ours = tool_errors = 0
    for i, env in enumerate(environments):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        keep = batch["completion_mask"][i].bool()
        completion = batch["completion_ids"][i][keep].tolist()
        trained = [False] * len(prompt) + (batch["tool_mask"][i][keep] > 0).tolist()
        tokens = prompt + completion
        as_sampled += log.trained_as_sampled(tokens, trained)
        replies = [tokens[start:end] for start, end in trained_runs(trained)]
        if len(env.replies) != len(replies) - 1:  # TRL answered a call itself: arguments alfworld_step does not take
            tool_errors += 1
            continue
        ours = list(first_prompts[inputs[i]["game"]])
        for reply, tool_reply in zip(replies, env.replies):
            ours += reply + protocol.delta(reply, tool_reply)
        same_as_ours += ours + replies[-1] == tokens
    return dict(sequences=len(environments), as_sampled=as_sampled, same_as_our_protocol=same_as_ours,
                tool_errors=tool_errors)  # fmt: skip


# =============================================================================================
# Main: both workers, turn by turn; the table
# =============================================================================================
def after_first(reports: list[dict], key) -> list[float]:
    """key(report) of updates 2..N (of update 1 when it is the only one)."""
    return [key(r) for r in reports[1:]] or [key(r) for r in reports]


COLUMNS = (  # (name, per-update value)
    ("wall s / update", lambda r: r["wall_s"]),
    ("generation s", lambda r: r["generation_s"]),
    ("training s", lambda r: r["training_s"]),
    ("generated tok/s", lambda r: r["generated_tokens"] / r["generation_s"]),
    ("trained tok/s (sequence)", lambda r: r["sequence_tokens"] / r["training_s"]),
    ("sequence tok / wall s", lambda r: r["sequence_tokens"] / r["wall_s"]),
    ("prompt tokens prefilled", lambda r: r["prefilled_tokens"]),
    ("generated tokens", lambda r: r["generated_tokens"]),
)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "peft", "accelerate", "trl"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def main(args: Args) -> dict:
    harness.require_all(
        (args.num_updates >= 1, "--num-updates must be >= 1"),
        *((value is None or value >= 1, f"--{name} must be >= 1") for name, value in (
            ("groups-per-update", args.groups_per_update), ("group-size", args.group_size),
            ("max-turns", args.max_turns))),
        (args.async_steps >= 0, "--async-steps must be >= 0"),
        (args.sampler == "vllm" or not (args.async_steps or args.sampler_url),
         "--async-steps and --sampler-url need --sampler vllm"),
    )  # fmt: skip
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("trl_peer needs TRL: pip install -e '.[peer]'") from None
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    a = script_args(args)
    model = samplers.resolve_model(a.model)  # a tiny agent and its games are made (once) here, not by both workers
    common.resolve_data_root(a.data_root, a.model)
    with contextlib.ExitStack() as stack:
        server, trainer_cores = None, None
        if args.sampler == "vllm" and not args.sampler_url:
            server_cores, trainer_cores = split_cores()
            print(f"a vLLM server of {model} for ours on cores {server_cores}, the trainers on {trainer_cores}")
            log_file, context = out / "vllm-server.log", a.max_trajectory_tokens
            server = VllmServer(model, log_file, max_model_len=context, cores=server_cores)
            args = dataclasses.replace(args, sampler_url=stack.enter_context(server).url)
        sampler = f"through vLLM at --async-steps {args.async_steps}" if args.sampler == "vllm" else "in-process"
        print(f"`adca_grpo.py {args.setting} --no-attribution` ({sampler}) vs TRL's GRPOTrainer: {a.num_updates} "
              f"updates of {a.groups_per_update} groups x {a.group_size}, <= {a.max_turns} turns of <= "
              f"{a.max_turn_tokens} tokens, one thread each, "
              f"{'ours first, then TRL' if args.async_steps else 'taking turns'}; logs in {out}/")  # fmt: skip
        results = run_both(args, trainer_cores)
        if server is not None:
            results["server_peak_rss_gb"] = peak_rss_tree_gb(server.process.pid)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print_table(results)
    return results


def run_both(args: Args, trainer_cores: list[int] | None) -> dict:
    """Both workers' updates (taking turns; with --async-steps, ours all first: its sampling thread would otherwise
    sample during TRL's turns) and what they reported."""
    context = multiprocessing.get_context("spawn")
    workers = {}
    for name, target in (("ours", ours_worker), ("trl", trl_worker)):
        parent, child = context.Pipe()
        process = context.Process(target=target, args=(child, args, trainer_cores), name=name, daemon=True)
        process.start()
        workers[name] = (process, parent)
    updates = range(1, args.num_updates + 1)
    if args.async_steps:
        schedule = [(update, name) for name in ("ours", "trl") for update in updates]
    else:
        turns = {update: ("ours", "trl") if update % 2 else ("trl", "ours") for update in updates}
        schedule = [(update, name) for update in updates for name in turns[update]]
    reports = {name: [] for name in workers}
    loads, finals = [], {}
    try:
        for name, (process, conn) in workers.items():
            receive(name, process, conn)  # loaded: ready for update 1
        for update, name in schedule:
            process, conn = workers[name]
            loads.append(os.getloadavg()[0])
            conn.send("go")
            reports[name].append(receive(name, process, conn))
            print(f"update {update:3d} {name:4s} " + "  ".join(f"{k} {v:.3g}" for k, v in reports[name][-1].items()
                                                                if k != "update"), flush=True)  # fmt: skip
        for name, (process, conn) in workers.items():
            finals[name] = receive(name, process, conn)
            process.join()
    finally:
        for process, _ in workers.values():
            if process.is_alive():
                process.terminate()
    return {
        "args": dataclasses.asdict(args),
        "versions": versions(),
        "cores": len(os.sched_getaffinity(0)),
        "load_average_at_updates": loads,
        "reports": reports,
        "checks": {name: finals[name]["check"] for name in workers},
        "peak_rss_gb": {name: finals[name]["peak_rss_gb"] for name in workers},
    }


def receive(name: str, process, conn) -> dict:
    """The worker's next message; a worker that died is named with its log."""
    while not conn.poll(1.0):
        if not process.is_alive():
            raise RuntimeError(f"the {name} worker exited ({process.exitcode}); see its log")
    return conn.recv()


def print_table(results: dict) -> None:
    reports, n = results["reports"], len(results["reports"]["ours"])
    span = "updates 2.." + str(n) if n > 1 else "update 1"
    print(f"\nmedian (min-max) over {span}; load average {min(results['load_average_at_updates']):.1f}-"
          f"{max(results['load_average_at_updates']):.1f} on {results['cores']} cores; "
          + ", ".join(f"{k} {v}" for k, v in results["versions"].items()))  # fmt: skip
    print("| | ours | TRL | TRL / ours |\n|---|---|---|---|")
    for name, key in COLUMNS:
        ours, trl = (after_first(reports[side], key) for side in ("ours", "trl"))
        cells = [f"{statistics.median(v):.3g} ({min(v):.3g}-{max(v):.3g})" for v in (ours, trl)]
        print(f"| {name} | {cells[0]} | {cells[1]} | {statistics.median(trl) / statistics.median(ours):.2f} |")
    rss = results["peak_rss_gb"]
    print(f"| peak RSS GB | {rss['ours']:.2f} | {rss['trl']:.2f} | {rss['trl'] / rss['ours']:.2f} |")
    if "server_peak_rss_gb" in results:
        ours = rss["ours"] + results["server_peak_rss_gb"]
        print(f"| peak RSS GB, ours + its vLLM server | {ours:.2f} | {rss['trl']:.2f} | {rss['trl'] / ours:.2f} |")
    ours, trl = (statistics.median(after_first(reports[side], dict(COLUMNS)["sequence tok / wall s"]))
                 for side in ("ours", "trl"))  # fmt: skip
    print(f"ours / TRL, sequence tokens per wall second: {ours / trl:.2f}x")
    if results["args"]["sampler"] == "vllm":
        print(f"ours sampled through a vLLM server at --async-steps {results['args']['async_steps']}: its generation s "
              "is its play of the update's batch (at K >= 1 in the background, during the update before), its "
              "prefilled tokens the server's own (its prefix cache's hits left out)")  # fmt: skip
    for side in ("ours", "trl"):
        print(f"sampled success per update, {side}: " + " ".join(f"{r['success']:.2f}" for r in reports[side]))
    checks = results["checks"]
    print(f"trained on the sampled tokens (update 1): ours {checks['ours']['as_sampled']}/{checks['ours']['sequences']}"
          f" (trainer vs sampler logprobs: max |diff| {checks['ours']['max_logprob_diff']:.1e}); TRL "
          f"{checks['trl']['as_sampled']}/{checks['trl']['sequences']}, of which token for token our protocol's "
          f"stream: {checks['trl']['same_as_our_protocol']}/{checks['trl']['sequences']} ({checks['trl']['tool_errors']}"
          " with a call TRL answered itself: arguments alfworld_step does not take)")  # fmt: skip
    end_reply = statistics.median(after_first(reports["trl"], lambda r: r["end_reply_s"]))
    print(f"TRL's generation time includes {end_reply:.3f} s per update of building the over-long replies that end "
          "its episodes (this benchmark's workaround, not TRL's own cost)")
    print("not matched: " + "; ".join(f"{ours} -> TRL: {trl}" for ours, trl, _ in UNMATCHED))


if __name__ == "__main__":
    main(tyro.cli(Args))
