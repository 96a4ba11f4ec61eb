"""benchmarks/learning/critic.py: true state values from snapshot continuations, critic scores, the warm-up, and sft.py's
--critic-states (the real engine, the tiny model, scripted policies and critics)."""

import json
import random
import statistics

import pytest
from accelerate.utils import set_seed

import common
import sft
import tempo
import training
from benchmarks.learning import compare, critic

TOOL = '<tool_call>\n{"name": "alfworld_step", "arguments": {"action": "%s"}}\n</tool_call>'
T, H = 4, 2  # 4-step walkthroughs: a state at turn 2 wins within the 2 turns left iff it has done 2 of them


@pytest.fixture
def runtime(games_root, tiny_model_dir, tmp_path):
    args = tempo.Args(
        model=str(tiny_model_dir),
        data_root=str(games_root),
        task_types=("look_at_obj_in_light", "pick_and_place_simple"),
        output_dir=str(tmp_path),
        macro_rounds=H,
        max_turns=T,
        critic_samples=2,
        max_turn_tokens=24,
        max_critic_tokens=8,
        max_trajectory_tokens=4096,
        lora_rank=4,
        lora_alpha=8,
        learning_rate=1e-2,
        threads=1,
    )
    set_seed(0)
    return critic.make_runtime(args)


def teacher_forced(rt, prompts, texts) -> list[common.Completion]:
    """Scripted replies as Completions, their logprobs from the real model (as a sampler would report them)."""
    tokens = [rt.tokenizer.encode(t, add_special_tokens=False) + [rt.tokenizer.eos_token_id] for t in texts]
    rows = [p + t for p, t in zip(prompts, tokens)]
    logprobs = training.sequence_logprobs(rt.model, rt.accelerator, rows, 1.0, rt.tokenizer.pad_token_id, 1 << 16)
    return [common.Completion(t, lp[len(p) :], text) for p, t, lp, text in zip(prompts, tokens, logprobs, texts)]


def walkthrough_policy(rt, seed: int):
    """Before turn H: the walkthrough's next action or `look` (a seeded coin); from turn H on: always the next
    walkthrough action not yet done. So V at the boundary is 1 iff enough walkthrough actions were done."""
    rng = random.Random(seed)
    walkthroughs = {common.game_start(g, rt.protocol).task: common.load_walkthrough(g) for g in rt.games}

    def sample(prompts, max_new_tokens):
        texts = []
        for prompt in prompts:
            text = rt.tokenizer.decode(prompt)
            task = common.extract_task(text.split("<|im_start|>user\n", 1)[1])
            walkthrough, done = walkthroughs[task], done_count(text, walkthroughs[task])
            turn = text.count("<|im_start|>assistant") - 1  # the last one is the generation prompt
            action = "look" if turn < H and rng.random() < 0.5 else walkthrough[min(done, len(walkthrough) - 1)]
            texts.append(TOOL % action)
        return teacher_forced(rt, prompts, texts)

    return sample


def done_count(text: str, walkthrough) -> int:
    """Walkthrough actions done in order in a chat's history."""
    done = 0
    for reply in text.split("<|im_start|>assistant\n")[1:]:
        action = common.parse_action(reply.split("<|im_end|>")[0])
        if done < len(walkthrough) and action == walkthrough[done]:
            done += 1
    return done


@pytest.mark.slow
def test_values_from_snapshot_continuations_equal_a_replayed_engines(runtime):
    rt = runtime
    rt.sample_fn = walkthrough_policy(rt, seed=3)
    episodes = critic.play_to_boundary(rt, rt.games, 4)
    states = [e.boundary for e in episodes]
    assert all(s is not None and s.round_index == H for s in states)
    wins = critic.continuation_wins(rt, states, 3)
    for state, state_wins in zip(states, wins):
        # the same continuation on a fresh engine, restored by replaying the state's actions
        env = common.AlfredEnv(state.game_file)
        env.reset()
        for action in state.actions:
            env.step(action)
        assert env.turn.observation == state.observation
        walkthrough = common.load_walkthrough(state.game_file)
        done = done_count(rt.tokenizer.decode(state.prefix_tokens), walkthrough)
        for action in walkthrough[done : done + T - H]:
            env.step(action)
        env.close()
        assert state_wins == [env.turn.won] * 3
    values = [critic.value(w)[0] for w in wins]
    assert 0 < sum(values) < len(values)  # both outcomes occur: the check above compared wins and losses


def test_value_and_standard_error():
    assert critic.value([True, False, False, False]) == pytest.approx((0.25, (0.25 * 0.75 / 3) ** 0.5))
    assert critic.value([False] * 16) == (0.0, 0.0)


@pytest.mark.slow
def test_scores_of_a_perfect_critic_the_constant_and_the_count(runtime):
    """A scripted critic that answers each state's true V gets r = 1 and MAE 0; the constant gets MAE = mean |V - c|
    and no r; the count predictor is a line fitted on the pool."""
    rt = runtime
    rt.sample_fn = walkthrough_policy(rt, seed=5)
    episodes = critic.play_to_boundary(rt, rt.games, 6)
    states = [e.boundary for e in episodes]
    values = [critic.value(w)[0] for w in critic.continuation_wins(rt, states, 2)]
    prompts = critic.critic_prompts(rt, states)
    true_value = {tuple(p): v for p, v in zip(prompts, values)}
    rt.sample_fn = lambda batch, n: teacher_forced(rt, batch, [f"<value>{true_value[tuple(p)]}</value>" for p in batch])

    half = len(states) // 2
    pool = critic.Pool(states[:half], prompts[:half], values[:half], values[:half], list(range(half)))
    scores = critic.score_critics(rt, pool, states[half:], values[half:], k=2)
    held = values[half:]
    assert len(set(held)) > 1
    assert scores["generative"]["r"] == pytest.approx(1.0)
    assert scores["generative"]["mae"] == pytest.approx(0.0)
    assert scores["generative"]["parse_rate"] == 1.0 and scores["generative"]["states_all_same"] == len(held)
    constant = statistics.fmean(values[:half])
    assert scores["constant"]["r"] is None
    assert scores["constant"]["mae"] == pytest.approx(statistics.fmean(abs(v - constant) for v in held))
    assert scores["value_head"]["n"] == len(held) and 0 <= scores["value_head"]["mae"] <= 1
    novel = [tuple(p) not in {tuple(q) for q in prompts[:half]} for p in prompts[half:]]
    assert scores["novel_states"] == sum(novel)
    if any(novel):  # the same scores on the held-out states that repeat no training prompt
        estimates = [v for v, new in zip(scores["value_head"]["predictions"], novel) if new]
        assert scores["value_head"]["novel"] == critic.score(estimates, [v for v, new in zip(held, novel) if new])
    counts = [critic.nothing_count(s) for s in states]
    slope, intercept = critic.fit_line(counts[:half], values[:half])
    expected = [min(1.0, max(0.0, slope * c + intercept)) for c in counts[half:]]
    assert scores["nothing_count"]["mae"] == pytest.approx(statistics.fmean(abs(e - v) for e, v in zip(expected, held)))


@pytest.mark.slow
def test_nothing_count_counts_inadmissible_turns(runtime):
    rt = runtime
    rt.sample_fn = lambda prompts, n: teacher_forced(rt, prompts, [TOOL % "fly to the moon"] * len(prompts))
    (episode,) = critic.play_to_boundary(rt, rt.games[:1], 1)
    assert critic.nothing_count(episode.boundary) == H
    assert critic.nothing_count(common.game_start(rt.games[0], rt.protocol)) == 0


def test_pearson_and_ridge_head():
    assert critic.pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(statistics.correlation([1, 2, 3], [2, 4, 7]))
    assert critic.pearson([1, 1, 1], [0, 1, 2]) is None
    import torch

    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    y = (0.5 + 0.1 * x[:, 0]).tolist()  # linear in the features: the fitted head recovers it
    predict = critic.fit_ridge(x, y, list(range(40)))
    assert critic.score(predict(x), y)["r"] > 0.95


@pytest.mark.slow
def test_warm_up_trains_the_critic_and_the_value_head(runtime):
    """A critic that answers 0.0 or 1.0 (a coin) on states whose target is 1: the warm-up's updates (tempo.py's
    critic reward and train step) raise the probability of the `1.0` answer, and the head's MSE falls."""
    rt = runtime
    rt.sample_fn = walkthrough_policy(rt, seed=1)
    states = [e.boundary for e in critic.play_to_boundary(rt, rt.games[:1], 2)]
    prompts = critic.critic_prompts(rt, states)
    pool = critic.Pool(states, prompts, [1.0, 1.0], [1.0, 1.0], [0, 1])
    coin = random.Random(0)
    rt.sample_fn = lambda batch, n: teacher_forced(rt, batch, [f"<value>{coin.choice('01')}.0</value>" for _ in batch])

    def logprob_of_one():
        (reply,) = teacher_forced(rt, prompts[:1], ["<value>1.0</value>"])
        return sum(reply.logprobs)

    before = logprob_of_one()
    warmup = critic.Warmup("test", updates=3, critic_samples=4, targets="mc", learning_rate=1e-2)
    rows, head = critic.warm_up(rt, pool, warmup, episodes_per_update=2, seed=0)
    assert [r["update"] for r in rows] == [1, 2, 3] and all(r["states"] == 2 for r in rows)
    assert any(r["datums"] > 0 for r in rows)
    assert logprob_of_one() > before
    assert rows[-1]["head/mse"] < rows[0]["head/mse"]


@pytest.mark.slow
def test_sft_critic_states_answer_each_state_with_its_value(runtime, tmp_path):
    rt = runtime
    rt.sample_fn = walkthrough_policy(rt, seed=2)
    states = [e.boundary for e in critic.play_to_boundary(rt, rt.games[:2], 1)]
    pool = critic.Pool(states, critic.critic_prompts(rt, states), [0.0, 1.0], [0.25, 0.75], [0, 1])
    path = tmp_path / "critic_states.jsonl"
    critic.write_critic_states(pool, path)
    assert [json.loads(line)["value"] for line in path.read_text().splitlines()] == [0.25, 0.75]
    examples, stats = sft.state_critic_examples(
        str(path), rt.tokenizer, sft.Args(max_turns=T, critic_step_chars=rt.args.critic_step_chars)
    )
    assert stats["data/examples"] == 2
    for example, prompt, target in zip(examples, pool.prompts, ("0.2", "0.8")):
        assert example.tokens[: len(prompt)] == prompt  # tempo.py's own critic prompt of the state
        reply = [t for t, m in zip(example.tokens, example.mask) if m]
        assert rt.tokenizer.decode(reply, skip_special_tokens=True) == f"<value>{target}</value>"


def test_learning_benchmark_tables_the_critic_per_evaluation_point():
    def point(update, r, mae, values):
        scores = {c: {"r": r, "mae": mae} for c in ("generative", "value_head", "constant", "nothing_count")}
        scores["constant"]["r"] = None
        scores["generative"] |= {"parse_rate": 1.0, "predictions": [0.1, 0.5, 0.9, 0.2]}
        return {"update": update, "critic": scores | {"values": {"n": 32, "mean": 0.2, "std": 0.3, "values": values}}}

    # the true V of the two checkpoints: the warm start's predictions rank the first perfectly, the second not
    seed_values = {1: [0.1, 0.5, 0.9, 0.2], 2: [0.9, 0.0, 0.4, 0.1]}
    results = {
        "start": {"critic": point(0, 0.0, 0.5, seed_values[1])["critic"]},
        "runs": {
            f"tempo-s{seed}": {"algorithm": "tempo", "points": [{}, point(6, r, 0.3, seed_values[seed])]}
            for seed, r in ((1, 0.2), (2, 0.4))
        },
    }
    lines = compare.critic_summary(results, ["grpo", "tempo"]).splitlines()
    assert lines[2].startswith("| (warm start) | 0 | 1 | 32 | 0.20 (0.30) | +0.00 / 0.500 |")
    assert lines[3].startswith("| tempo | 6 | 2 | 32 | 0.20 (0.30) | +0.30 / 0.300 |")
    assert "n/a / 0.300" in lines[3] and len(lines) == 4  # the constant has no r
    # the last column: the warm start's critic, untrained, against each checkpoint's true V (mean over seeds)
    untrained = statistics.fmean(statistics.correlation([0.1, 0.5, 0.9, 0.2], v) for v in seed_values.values())
    assert lines[2].endswith("| +1.00 |") and lines[3].endswith(f"| {untrained:+.2f} |")
