"""Behaviour cloning on the games' planner walkthroughs: the warm start before RL.

Every example is an episode played through the same `common.rollout` and `common.ChatProtocol` as the RL
scripts, by a scripted policy that calls the alfworld_step tool with the planner's next action, so the prompts
are token-exact what the policy sees during RL. The loss is the token mean cross-entropy on the generated
(assistant) tokens only. With `--noise-eps` the expert takes a random admissible action with that probability and
the planner replans from wherever that leads (the data shows recovery, not only perfect paths; the random
actions are played but not trained). With `--critic-examples` TEMPO's critic prompt at every macro boundary is
answered with `<value>x</value>`, x the Monte-Carlo return (1 won, 0 not) of the rest of that noisy-expert episode.
`--critic-states` adds TEMPO critic prompts on given saved states (e.g. a policy's own, from
benchmarks/learning/critic.py) answered with each state's estimated V: the expert nearly always wins, so its returns
teach "always 1". Full fine-tune (`--lora-rank 0`) or LoRA merged into the weights; the output directory is a plain
HF model that `tempo.py --model` and `adca_grpo.py --model` take.

    python sft.py --model Qwen/Qwen2.5-0.5B-Instruct --output-dir runs/sft-qwen
    python sft.py --model tiny --num-games 8 --episodes-per-game 4 --noise-eps 0.2 --critic-examples
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro

import common
import samplers


@dataclass
class Args:
    model: str = "Qwen/Qwen3-4B-Instruct-2507"
    """HF model id or local directory (`tiny`: the offline test model)"""
    chat_template: str = ""
    """a Jinja chat template file that replaces the model's own (saved with the fine-tuned model); "" = the model's"""
    enable_thinking: bool = True
    """passed to the chat template; --no-enable-thinking: Qwen3 hybrid models answer without reasoning (train the RL
    runs on the result with it too)"""
    output_dir: str = "runs/sft"
    """where the fine-tuned model (weights, tokenizer, sft.json) is written"""
    data_root: str | None = None
    """ALFWorld data directory (holds json_2.1.1/); unset: the generated offline games (--model tiny-agent: its games)"""
    split: Literal["train", "valid_seen", "valid_unseen"] = "train"
    """split whose walkthroughs are cloned"""
    task_types: tuple[str, ...] | None = None
    """restrict to these task types (default: all six)"""
    num_games: int = 0
    """use the first N games of the split in sorted order (0: all)"""
    episodes_per_game: int = 1
    """expert episodes rendered per game (more than 1 only makes sense with --noise-eps > 0)"""
    noise_eps: float = 0.0
    """per step, probability of a random admissible action instead of the planner's (not trained on)"""
    max_turns: int = 30
    """episode cap of the rendered episodes (as the RL scripts' --max-turns)"""
    critic_examples: bool = False
    """add TEMPO critic prompts at macro boundaries answered with <value>MC return</value>"""
    macro_rounds: int = 10
    """macro-boundary spacing of the critic examples (TEMPO's --macro-rounds)"""
    critic_step_chars: int = 1000
    """characters per step of the critic's condensed history (TEMPO's --critic-step-chars)"""
    critic_states: str = ""
    """JSON lines of saved states with a V target each (benchmarks/learning/critic.py writes them): add TEMPO critic
    examples on these, answered <value>V</value>"""
    show_admissible: bool = True
    """list admissible actions in the prompts (as the RL scripts do)"""
    lora_rank: int = 0
    """LoRA rank; 0 = full fine-tune. The adapter is merged into the saved weights"""
    lora_alpha: int = 64
    """LoRA alpha"""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """modules that get a LoRA adapter"""
    learning_rate: float = 1e-4
    """AdamW learning rate (constant)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    num_epochs: float = 3.0
    """passes over the examples (fractions allowed)"""
    batch_tokens: int = 16384
    """padded tokens per optimizer step (rows x longest row; a longer example goes alone)"""
    target_loss: float = 0.0
    """stop once the mean loss of the last epoch's worth of steps falls below this (0: never)"""
    seed: int = 1
    """seed of the noise, the shuffling and torch"""


# =============================================================================================
# Data: expert episodes rendered through the RL scripts' own rollout and chat protocol
# =============================================================================================
class NoisyExpert:
    """A scripted common.SampleFn for ONE episode: the planner's next action from the current state, or with
    probability eps a random admissible one. It mirrors the episode on its own env to know the state."""

    def __init__(self, game_file: str, protocol: common.ChatProtocol, eps: float, rng: random.Random):
        self.env, self.protocol, self.eps, self.rng = common.AlfredEnv(game_file), protocol, eps, rng
        self.env.reset()
        self.expert_steps: list[bool] = []  # per step: the planner's action (trained) or a random one (not)

    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[common.Completion]:
        if len(prompts) != 1:
            raise RuntimeError("NoisyExpert plays one episode: one prompt per turn")
        plan = self.env.expert_plan()
        random_step = not plan or self.rng.random() < self.eps
        action = self.rng.choice(self.env.turn.admissible) if random_step else plan[0]
        self.env.step(action)
        self.expert_steps.append(not random_step)
        text = common.tool_call(action)
        tokens = self.protocol.encode(text) + [self.protocol.eos_token_id]
        return [common.Completion(tokens, [0.0] * len(tokens), text)]

    def close(self):
        self.env.close()


@dataclass
class Example:
    tokens: list[int]
    mask: list[float]  # 1 on the tokens the loss is taken on


def expert_episode(game_file: str, protocol, args: Args, rng: random.Random) -> tuple[common.Trajectory, list[bool]]:
    expert = NoisyExpert(game_file, protocol, args.noise_eps, rng)
    try:
        start = common.game_start(game_file, protocol)
        [[traj]] = common.rollout(
            [start],
            1,
            expert,
            protocol,
            horizon=args.max_turns,
            max_turns=args.max_turns,
            max_turn_tokens=64,
            max_trajectory_tokens=1 << 30,
        )
    finally:
        expert.close()
    return traj, expert.expert_steps


def actor_example(traj: common.Trajectory, expert_steps: list[bool]) -> Example:
    tokens, _, step_ids = traj.sequence()
    return Example(tokens, [1.0 if k >= 0 and expert_steps[k] else 0.0 for k in step_ids])


def critic_example(tokenizer, game_file: str, task: str, messages, round_index: int, target: float, args: Args):
    """TEMPO's critic prompt of a state (from tempo.py itself, so the two stay in sync), answered <value>target</value>."""
    import tempo

    walkthrough = common.load_game(game_file).walkthrough
    prompt = tempo.critic_prompt(
        tokenizer, task, walkthrough, messages, round_index, args.max_turns, args.critic_step_chars,
        args.enable_thinking,
    )  # fmt: skip
    reply = tokenizer.encode(f"<value>{target:.1f}</value>", add_special_tokens=False)
    reply.append(tokenizer.eos_token_id)
    return Example(prompt + reply, [0.0] * len(prompt) + [1.0] * len(reply))


def critic_examples(traj: common.Trajectory, tokenizer, args: Args) -> list[Example]:
    """TEMPO's critic prompt at each macro boundary the episode passed (turn 0 included), answered with the
    Monte-Carlo return of the rest of the episode."""
    messages = list(traj.messages)
    return [
        # history: system + first observation, then (assistant, tool) per turn
        critic_example(
            tokenizer, traj.start.game_file, traj.start.task, messages[: 2 + 2 * i], i, float(traj.won), args
        )
        for i in range(0, len(traj.steps), args.macro_rounds)
    ]


def state_critic_examples(path: str, tokenizer, args: Args) -> tuple[list[Example], dict]:
    """--critic-states: a critic example per saved state, answered with its V target."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    examples = []
    for row in rows:
        state = common.SavedState.from_json(row["state"])
        examples.append(
            critic_example(
                tokenizer, state.game_file, state.task, state.messages, state.round_index, row["value"], args
            )
        )
    targets = [row["value"] for row in rows]
    stats = {
        "data/examples": len(examples),
        "data/critic_target_mean": sum(targets) / max(1, len(targets)),
        "data/trained_tokens": sum(sum(e.mask) for e in examples),
        "data/tokens": sum(len(e.tokens) for e in examples),
    }
    return examples, stats


def build_examples(games: list[str], protocol: common.ChatProtocol, args: Args) -> tuple[list[Example], dict]:
    from tqdm import tqdm

    rng = random.Random(args.seed)
    examples, won, expert_steps, all_steps = [], 0, 0, 0
    for game_file in tqdm(games, desc="render", unit="game", dynamic_ncols=True):
        for _ in range(args.episodes_per_game):
            traj, experts = expert_episode(game_file, protocol, args, rng)
            examples.append(actor_example(traj, experts))
            if args.critic_examples:
                examples += critic_examples(traj, protocol.tokenizer, args)
            won += traj.won
            expert_steps += sum(experts)
            all_steps += len(experts)
    episodes = len(games) * args.episodes_per_game
    stats = {
        "data/episodes": episodes,
        "data/examples": len(examples),
        "data/won_rate": won / episodes,
        "data/expert_step_rate": expert_steps / max(1, all_steps),
        "data/trained_tokens": sum(sum(e.mask) for e in examples),
        "data/tokens": sum(len(e.tokens) for e in examples),
    }
    return examples, stats


# =============================================================================================
# Training: token-mean cross-entropy on the trained tokens, then save a plain HF model
# =============================================================================================
def batches(examples: list[Example], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of similar-length examples with rows x longest row <= batch_tokens."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].tokens), rng.random()))
    out, current = [], []
    for i in order:
        if current and (len(current) + 1) * len(examples[i].tokens) > batch_tokens:
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    rng.shuffle(out)
    return out


def batch_loss(model, rows: list[Example], pad_id: int) -> tuple[torch.Tensor, float, float]:
    """(mean cross-entropy over trained tokens, trained tokens, correctly predicted trained tokens)."""
    width = max(len(e.tokens) for e in rows)
    input_ids = torch.tensor([e.tokens + [pad_id] * (width - len(e.tokens)) for e in rows])
    attention = torch.tensor([[1] * len(e.tokens) + [0] * (width - len(e.tokens)) for e in rows])
    mask = torch.tensor([e.mask + [0.0] * (width - len(e.tokens)) for e in rows])[:, 1:]
    logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits[:, :-1].float()
    targets = input_ids[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    n = mask.sum()
    correct = ((logits.argmax(-1) == targets).float() * mask).sum().item()
    return (nll * mask).sum() / n.clamp(min=1), n.item(), correct


def main(args: Args) -> Path:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    if not 0 <= args.noise_eps <= 1:
        raise ValueError(f"--noise-eps must lie in [0, 1], got {args.noise_eps}")
    for flag, value in (("--episodes-per-game", args.episodes_per_game), ("--max-turns", args.max_turns)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.lora_rank < 0 or args.num_games < 0 or args.num_epochs <= 0 or args.macro_rounds < 1:
        raise ValueError("--lora-rank and --num-games must be >= 0, --num-epochs > 0, --macro-rounds >= 1")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    data_root = common.resolve_data_root(args.data_root, args.model)
    try:
        games = common.discover_games(data_root, args.split, args.task_types)
    except FileNotFoundError as error:
        raise ValueError(f"--data-root {data_root}: {error}") from error
    games = games[: args.num_games] if args.num_games else games
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    path = samplers.resolve_model(args.model)
    tokenizer = samplers.load_tokenizer(path, args.chat_template)
    protocol = common.ChatProtocol(tokenizer, args.show_admissible, enable_thinking=args.enable_thinking)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=list(args.lora_targets), task_type="CAUSAL_LM"
        )
        model = get_peft_model(model, lora)

    # ---- data: expert episodes (and critic examples) rendered exactly as the RL prompts
    t0 = time.time()
    examples, stats = build_examples(games, protocol, args)
    if args.critic_states:  # trained beside the actor examples: alone, they wrecked the actor the critic shares
        state_examples, state_stats = state_critic_examples(args.critic_states, tokenizer, args)
        examples += state_examples
        stats |= {f"{key}_critic_states": value for key, value in state_stats.items()}
    print(json.dumps(stats), file=sys.stderr)

    # ---- training: shuffled token-budget batches, one optimizer step each
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.learning_rate, weight_decay=args.weight_decay
    )
    rng = random.Random(args.seed)
    steps_per_epoch = len(batches(examples, args.batch_tokens, random.Random(0)))
    total_steps = max(1, math.ceil(args.num_epochs * steps_per_epoch))
    model.train()
    log, recent = [], []
    bar = tqdm(total=total_steps, desc="sft", unit="step", dynamic_ncols=True)
    step, plan = 0, []
    while step < total_steps:
        if not plan:
            plan = batches(examples, args.batch_tokens, rng)
        rows = [examples[i] for i in plan.pop()]
        loss, n, correct = batch_loss(model, rows, tokenizer.pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
        optimizer.step()
        step += 1
        recent = (recent + [loss.item()])[-steps_per_epoch:]
        log.append(
            {
                "step": step,
                "train/loss": loss.item(),
                "train/token_accuracy": correct / max(1, n),
                "train/grad_norm": grad_norm,
            }
        )
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{correct / max(1, n):.2f}")
        if args.target_loss and len(recent) == steps_per_epoch and sum(recent) / len(recent) < args.target_loss:
            break
    bar.close()

    # ---- save: LoRA merged into the weights, so both RL scripts load a plain model
    if args.lora_rank:
        model = model.merge_and_unload()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    summary = {
        "args": dataclasses.asdict(args),
        "games": games,
        **stats,
        "steps": step,
        "final_loss": sum(recent) / max(1, len(recent)),
        "seconds": time.time() - t0,
    }
    (out_dir / "sft.json").write_text(json.dumps(summary, indent=2))
    (out_dir / "sft_log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in log))
    return out_dir


if __name__ == "__main__":
    main(tyro.cli(Args))
