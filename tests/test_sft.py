"""sft.py: expert episodes rendered by the RL scripts' own rollout, the trained-token mask, critic examples, and a
saved model that loads as a plain HF model."""

import json
import random

import pytest
import torch

import common
import sft
import tempo


def short_game(all_games):
    return next(g for g in all_games if "look_at_obj" in g and "/train/" in g)


def test_clean_expert_episode_is_the_walkthrough_and_every_generated_token_is_trained(all_games, protocol):
    game_file = short_game(all_games)
    args = sft.Args(max_turns=10)
    traj, expert_steps = sft.expert_episode(game_file, protocol, args, random.Random(0))
    assert traj.won and traj.actions == common.load_walkthrough(game_file) and all(expert_steps)
    example = sft.actor_example(traj, expert_steps)
    tokens, _, step_ids = traj.sequence()
    assert example.tokens == tokens
    assert [m == 1.0 for m in example.mask] == [k >= 0 for k in step_ids]
    assert tokens[: len(traj.start.prefix_tokens)] == common.game_start(game_file, protocol).prefix_tokens
    for step in traj.steps:  # the trained tokens are exactly the replies, ending with the end-of-turn token
        assert step.completion_tokens[-1] == protocol.eos_token_id
        assert common.parse_action(step.text) == step.action


def test_noisy_expert_recovers_and_random_steps_are_not_trained(all_games, protocol):
    game_file = short_game(all_games)
    args = sft.Args(noise_eps=0.5, max_turns=30)
    traj, expert_steps = sft.expert_episode(game_file, protocol, args, random.Random(3))
    assert traj.won and not all(expert_steps) and any(expert_steps)  # it strayed, then the replan won
    example = sft.actor_example(traj, expert_steps)
    _, _, step_ids = traj.sequence()
    for k, expert in enumerate(expert_steps):
        trained = {example.mask[i] for i, s in enumerate(step_ids) if s == k}
        assert trained == {1.0 if expert else 0.0}
    assert all(m == 0.0 for m, s in zip(example.mask, step_ids) if s < 0)


def test_critic_examples_use_tempos_prompt_and_answer_the_monte_carlo_return(all_games, protocol, tokenizer):
    game_file = short_game(all_games)
    args = sft.Args(max_turns=6, macro_rounds=2)
    traj, _ = sft.expert_episode(game_file, protocol, args, random.Random(0))
    examples = sft.critic_examples(traj, tokenizer, args)
    assert len(examples) == len(range(0, len(traj.steps), 2))
    walkthrough = common.load_walkthrough(game_file)
    for j, example in enumerate(examples):
        round_index = 2 * j
        prompt = tempo.critic_prompt(
            tokenizer,
            traj.start.task,
            walkthrough,
            traj.messages[: 2 + 2 * round_index],
            round_index,
            6,
            args.critic_step_chars,
        )
        assert example.tokens[: len(prompt)] == prompt and not any(example.mask[: len(prompt)])
        reply = tokenizer.decode(example.tokens[len(prompt) :], skip_special_tokens=True)
        assert tempo.parse_value(reply) == float(traj.won) and all(example.mask[len(prompt) :])


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_training_lowers_the_loss_and_saves_a_plain_model(games_root, tiny_model_dir, tmp_path, lora_rank):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sft"
    args = sft.Args(
        model=str(tiny_model_dir),
        output_dir=str(out),
        data_root=str(games_root),
        task_types=("look_at_obj_in_light",),
        num_games=1,
        episodes_per_game=2,
        noise_eps=0.2,
        critic_examples=True,
        macro_rounds=2,
        max_turns=8,
        lora_rank=lora_rank,
        learning_rate=1e-2,
        num_epochs=6,
        batch_tokens=1 << 16,  # one batch: the same examples every step
    )
    sft.main(args)
    log = [json.loads(line) for line in (out / "sft_log.jsonl").read_text().splitlines()]
    assert len(log) == 6 and log[-1]["train/loss"] < log[0]["train/loss"] - 0.1
    model = AutoModelForCausalLM.from_pretrained(out)  # a plain model: no adapter files needed
    assert not (out / "adapter_config.json").exists()
    summary = json.loads((out / "sft.json").read_text())
    assert summary["data/episodes"] == 2 and summary["steps"] == 6
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    moved = [not torch.equal(a, b) for a, b in zip(model.parameters(), base.parameters())]
    assert any(moved)


def test_bad_flags_fail_naming_the_flag(games_root, tmp_path):
    with pytest.raises(ValueError, match="--noise-eps"):
        sft.main(sft.Args(model="tiny", data_root=str(games_root), output_dir=str(tmp_path), noise_eps=1.5))
    with pytest.raises(ValueError, match="--data-root"):
        sft.main(sft.Args(model="tiny", data_root=str(tmp_path / "none"), output_dir=str(tmp_path)))
