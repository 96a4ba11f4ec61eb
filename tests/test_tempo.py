"""TEMPO: signal functions, value parsing, prompts, datums, the update, and end-to-end runs of main() on the
tiny model and generated games (real engine, CPU)."""

import json
import math
import random
import shutil

import pytest

import common
import tempo

TOOL = '<tool_call>\n{"name": "alfworld_step", "arguments": {"action": "%s"}}\n</tool_call>'


def small_args(games_root, tiny_model_dir, output_dir, **overrides) -> tempo.Args:
    """Tiny budgets: T=4 turns in macro steps of H=2, 2 branches, short replies."""
    settings = dict(
        model=str(tiny_model_dir),
        data_root=str(games_root),
        output_dir=str(output_dir),
        seed=0,
        macro_rounds=2,
        max_episode_steps=4,
        branches=2,
        critic_samples=2,
        endpoint_samples=1,
        states_per_batch=2,
        warmup_updates=1,
        warmup_games_per_batch=1,
        td_updates=2,
        max_turn_tokens=24,
        max_critic_tokens=24,
        max_trajectory_tokens=4096,
        micro_batch_tokens=4096,
        sample_batch_size=16,
        lora_rank=4,
        lora_alpha=8,
        save_every=0,
        eval_every=0,
        eval_games=1,
    )
    settings.update(overrides)
    return tempo.Args(**settings)


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------------------------
# parse_value
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("<value>0.4</value>", 0.4),
        ("<value>.4</value>", 0.4),
        ("<value>1</value>", 1.0),
        ("<value>1.0</value>", 1.0),
        ("<value>0</value>", 0.0),
        ("<VALUE> 0.25 </Value>", 0.25),
        ("<value>\n0.7\n</value>", 0.7),
        ("first <value>0.1</value>, on reflection <value>0.8</value>", 0.8),
        ("<value>1.7</value>", 1.0),
        ("<value>-0.3</value>", 0.0),
        ("<value>5e-1</value>", 0.5),
        ("<value>0.3</value> then <value>high</value>", 0.3),
        ("I think <value>0.6</value>.<think></think>", 0.6),
    ],
)
def test_parse_value(text, expected):
    assert parse_equal(tempo.parse_value(text), expected)


def parse_equal(value, expected):
    return value is not None and math.isclose(value, expected)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0.5",
        "value: 0.5",
        "<value></value>",
        "<value>high</value>",
        "<value>0.5",
        "0.5</value>",
        "<value>1e999</value>",
        "<value>nan</value>",
        "<value>inf</value>",
        "<value>0.5.5</value>",
        "<value>--1</value>",
        None,
        0.5,
        b"<value>0.5</value>",
    ],
)
def test_parse_value_rejects(text):
    assert tempo.parse_value(text) is None


def test_parse_value_huge_input_returns():
    assert tempo.parse_value("<value>" * 200_000 + "0.2" + "</value>" * 200_000) == 0.2
    assert tempo.parse_value("<value>" + "9" * 100_000 + "</value>") is None  # overflows to inf: not finite


# --------------------------------------------------------------------------------------------
# Signals (hand-computed)
# --------------------------------------------------------------------------------------------
def test_actor_signals_terminal_branches_are_worth_zero():
    # branch 1 won in the segment (terminal), branch 3 hit T (terminal, its value is ignored)
    returns, target, advantages = tempo.actor_signals(
        [0.0, 1.0, 0.0, 0.0], [0.5, None, 0.2, 0.9], [False, True, False, True]
    )
    assert returns == pytest.approx([0.5, 1.0, 0.2, 0.0])
    assert target == pytest.approx(0.425)
    assert advantages == pytest.approx([0.075, 0.575, -0.225, -0.425])
    assert sum(advantages) == pytest.approx(0.0)


def test_actor_signals_degenerate_group():
    _, target, advantages = tempo.actor_signals([0.0, 0.0, 0.0], [0.3, 0.3, 0.3], [False, False, False])
    assert target == pytest.approx(0.3)
    assert tempo.is_degenerate(advantages)
    _, _, advantages = tempo.actor_signals([0.0, 0.0], [None, 0.7], [True, True])  # all terminal, no reward
    assert tempo.is_degenerate(advantages)
    assert not tempo.is_degenerate(tempo.actor_signals([1.0, 0.0], [None, 0.2], [True, False])[2])


def test_actor_signals_bad_input():
    with pytest.raises(ValueError):
        tempo.actor_signals([0.0], [None], [False])  # a live branch without a value
    with pytest.raises(ValueError):
        tempo.actor_signals([0.0, 1.0], [0.1], [False, True])
    with pytest.raises(ValueError):
        tempo.actor_signals([], [], [])


def test_critic_signals_with_parse_failures():
    rewards, advantages = tempo.critic_signals([0.2, None, 0.8, 0.5], 0.5, 1.0)
    assert rewards == pytest.approx([-0.3, -1.0, -0.3, 0.0])
    assert advantages == pytest.approx([0.1, -0.6, 0.1, 0.4])
    rewards, _ = tempo.critic_signals([0.2, None], 0.5, 2.0)
    assert rewards == pytest.approx([-0.15, -2.0])  # a failure stays the worst reward
    _, advantages = tempo.critic_signals([None, None, None], 0.5, 1.0)
    assert tempo.is_degenerate(advantages)
    _, advantages = tempo.critic_signals([0.3, 0.7], 0.5, 1.0)  # equally wrong: no preference
    assert tempo.is_degenerate(advantages)


# --------------------------------------------------------------------------------------------
# Flags, store, prompts
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(max_episode_steps=45), "--max-episode-steps"),
        (dict(macro_rounds=0), "--macro-rounds"),
        (dict(branches=1), "--branches"),
        (dict(critic_samples=1), "--critic-samples"),
        (dict(endpoint_samples=0), "--endpoint-samples"),
        (dict(state_store_capacity=2, states_per_batch=4), "--state-store-capacity"),
        (dict(r_max=0.0), "--r-max"),
        (dict(ppo_clip=(1.5, 0.2)), "--ppo-clip"),
        (dict(max_trajectory_tokens=512, max_turn_tokens=512), "--max-trajectory-tokens"),
        (dict(temperature=0.0), "--temperature"),
        (dict(top_p=1.5), "--top-p"),
        (dict(task_types=("pick_and_fly",)), "--task-types"),
        (dict(resume="auto", eval_only="x"), "--resume"),
        (dict(exp_name="a__b"), "--exp-name"),
    ],
)
def test_invalid_flags_fail_at_start_naming_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        tempo.main(tempo.Args(**overrides))


def test_state_store_is_fifo_and_take_removes(all_games, protocol):
    states = [common.fresh_state(all_games[0], protocol, seed=i) for i in range(5)]
    store = tempo.StateStore(capacity=3)
    for state in states:
        store.add(state)
    assert [s.seed for s in store.states] == [2, 3, 4]  # the two oldest fell out
    taken = store.take(2, random.Random(0))
    assert len(taken) == 2 and len({s.seed for s in taken}) == 2 and len(store) == 1
    assert {s.seed for s in taken} | {store.states[0].seed} == {2, 3, 4}
    assert len(store.take(5, random.Random(0))) == 1 and len(store) == 0


def test_critic_prompt_condenses_history_and_holds_the_walkthrough(all_games, protocol, tokenizer):
    game = all_games[0]
    walkthrough = common.load_walkthrough(game)
    scripted = iter([TOOL % walkthrough[0], "no tool call here"])
    sampler = lambda prompts, n: [
        common.Completion(protocol.encode(t), [0.0] * len(protocol.encode(t)), t)
        for t in [next(scripted) for _ in prompts]
    ]
    start = common.fresh_state(game, protocol)
    (group,) = common.rollout(
        [start], 1, sampler, protocol, horizon=2, max_episode_steps=10, max_turn_tokens=64, max_trajectory_tokens=8192
    )
    traj = group[0]
    text = tokenizer.decode(
        tempo.critic_prompt(tokenizer, traj.start.task, walkthrough, traj.messages, traj.round_index, 10)
    )
    reference = "\n".join(f"{i + 1}. {a}" for i, a in enumerate(walkthrough))
    assert tempo.PRIVILEGED_HEADER + "\n" + reference in text
    assert "Admissible actions" not in text and "alfworld_step" not in text  # no action lists, no tools
    assert f"Step 1: > {walkthrough[0]} [executed]" in text and "Step 2: (no valid action) [invalid format" in text
    assert "Steps taken: 2 of 10 (8 left)" in text and traj.start.task in text
    actor_text = tokenizer.decode(traj.tokens)
    assert tempo.PRIVILEGED_HEADER not in actor_text and reference not in actor_text


# --------------------------------------------------------------------------------------------
# Datums and the update (real tiny model + LoRA)
# --------------------------------------------------------------------------------------------
@pytest.fixture
def runtime(games_root, tiny_model_dir, tmp_path):
    def build(**overrides):
        args = small_args(games_root, tiny_model_dir, tmp_path, **overrides)
        tempo.seed_everything(args.seed)
        return tempo.make_runtime(args, tempo.make_accelerator())

    return build


def test_actor_loss_mask_covers_only_the_segments_generated_tokens(runtime):
    rt = runtime()

    def segment(start):
        budgets = dict(horizon=2, max_episode_steps=4, max_turn_tokens=24, max_trajectory_tokens=4096)
        (group,) = common.rollout([start], 1, rt.sample_fn, rt.protocol, **budgets)
        return group

    first = segment(rt.fresh_state())
    saved = first[0].saved_state()
    assert any(k >= 0 for k in saved.prefix_step_ids)  # the prefix holds generated tokens of turns 0-1
    second = segment(saved)
    traj = second[0]
    datum = tempo.actor_datum(traj, 0.5)
    expected = [0.0] * len(datum.tokens)
    for step in traj.steps:
        expected[step.prompt_length : step.prompt_length + len(step.completion_tokens)] = [1.0] * len(
            step.completion_tokens
        )
    assert datum.mask == expected
    assert not any(datum.mask[: len(saved.prefix_tokens)])  # the saved prefix's own generated tokens are context
    assert datum.advantages == [0.5 * m for m in datum.mask]
    assert datum.tokens[-1] == traj.steps[-1].completion_tokens[-1]  # ends with the last completion
    assert datum.old_logprobs[traj.steps[0].prompt_length] == traj.steps[0].logprobs[0]


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_logprobs_equal_a_teacher_forced_pass_per_token(runtime, temperature, top_p):
    rt = runtime(temperature=temperature, top_p=top_p, sample_batch_size=2)
    prompts = [rt.fresh_state().prefix_tokens, rt.fresh_state().prefix_tokens[:40], [1, 2, 3]]
    replies = rt.sample_fn(prompts, 24)
    sequences = [p + r.tokens for p, r in zip(prompts, replies)]
    forced = tempo.sequence_logprobs(
        rt.model, rt.accelerator, sequences, temperature, rt.tokenizer.pad_token_id, rt.args.micro_batch_tokens
    )
    for prompt, reply, logprobs in zip(prompts, replies, forced):
        assert len(reply.tokens) == len(reply.logprobs) >= 1
        assert reply.logprobs == pytest.approx(logprobs[len(prompt) :], abs=1e-4)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_update_moves_logprob_with_the_advantage_sign(runtime, sign):
    rt = runtime(learning_rate=1e-2)
    prompt = rt.fresh_state().prefix_tokens
    (reply,) = rt.sample_fn([prompt], 16)
    datum = tempo.critic_datum(prompt, reply, sign)
    masked = [i for i, m in enumerate(datum.mask) if m]

    def logprob_sum():
        (logprobs,) = tempo.sequence_logprobs(
            rt.model,
            rt.accelerator,
            [datum.tokens],
            rt.args.temperature,
            rt.tokenizer.pad_token_id,
            rt.args.micro_batch_tokens,
        )
        return sum(logprobs[i] for i in masked)

    before = logprob_sum()
    assert before == pytest.approx(sum(reply.logprobs), abs=1e-3)  # sampling logprobs = teacher-forced ones
    metrics = rt.train([datum])
    assert metrics["train/tokens"] == len(reply.tokens) and metrics["train/nonfinite_skipped"] == 0
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-3) and metrics["train/grad_norm"] > 0
    after = logprob_sum()
    assert (after - before) * sign > 1e-4


def test_ppo_clip_option_stops_the_gradient_outside_the_band(runtime):
    rt = runtime(learning_rate=1e-2, ppo_clip=(0.2, 0.2))
    prompt = rt.fresh_state().prefix_tokens
    (reply,) = rt.sample_fn([prompt], 16)
    stale = [lp - 1.0 for lp in reply.logprobs]  # ratio = e > 1.2 on every trained token
    clipped = tempo.critic_datum(prompt, common.Completion(reply.tokens, stale, reply.text), 1.0)
    metrics = rt.train([clipped])
    assert metrics["train/clip_frac"] == 1.0 and metrics["train/grad_norm"] == 0.0
    assert metrics["train/ratio_mean"] == pytest.approx(math.e, rel=1e-3)
    metrics = rt.train([tempo.critic_datum(prompt, common.Completion(reply.tokens, stale, reply.text), -1.0)])
    assert metrics["train/clip_frac"] == 0.0 and metrics["train/grad_norm"] > 0  # pessimistic side: not clipped


def test_token_budget_batches():
    batches = tempo.token_budget_batches([10, 50, 20, 30, 200], 60)
    assert batches == [[4], [1], [3, 2], [0]]  # longest first; rows x longest <= budget, an oversize row alone
    assert sorted(i for b in batches for i in b) == list(range(5))


# --------------------------------------------------------------------------------------------
# TD updates with a scripted policy scored by the real model
# --------------------------------------------------------------------------------------------
def scored_script(rt, seed=0):
    """A sample_fn whose replies are scripted (random admissible tool calls for the actor, random <value>
    answers for the critic) and whose logprobs are the real tiny model's, so the groups carry signal. The
    untrained tiny model itself never emits a parsable reply. Records every prompt it sees."""
    rng, tokenizer = random.Random(seed), rt.tokenizer
    seen = {"actor": [], "critic": []}

    def sample(prompts, max_new_tokens):
        replies = []
        for prompt in prompts:
            text = tokenizer.decode(prompt)
            if tempo.CRITIC_SYSTEM_PROMPT in text:
                seen["critic"].append(text)
                replies.append(f"Hard to say. <value>{rng.choice(['0.1', '.5', '0.9', '1'])}</value>")
            else:
                seen["actor"].append(text)
                admissible = text.rsplit("Admissible actions: ", 1)[1].split("\n")[0].split(", ")
                replies.append(TOOL % rng.choice(admissible))
        tokens = [tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id] for r in replies]
        logprobs = tempo.sequence_logprobs(
            rt.model,
            rt.accelerator,
            [p + t for p, t in zip(prompts, tokens)],
            rt.args.temperature,
            tokenizer.pad_token_id,
            rt.args.micro_batch_tokens,
        )
        return [common.Completion(t, lp[len(p) :], r) for p, t, lp, r in zip(prompts, tokens, logprobs, replies)]

    return sample, seen


def test_td_updates_train_actor_and_critic_from_stored_states(runtime):
    rt = runtime(critic_samples=4, endpoint_samples=2, prefix_is_correction=True, learning_rate=1e-3)
    rt.sample_fn, seen = scored_script(rt)
    first, _ = tempo.td_update(rt)
    assert first["td/fresh_states"] == 2 and first["td/macro_index_mean"] == 0
    assert first["td/new_endpoints"] == 4 and first["td/store_size"] == 4 and first["actor/macro_boundary_rate"] == 1
    assert first["actor/degenerate_group_rate"] < 1 and first["critic/degenerate_group_rate"] < 1
    assert first["critic/parse_failure_rate"] == 0 and first["train/tokens"] > 0
    assert first["actor/value_gap_zero_reward"] > 0  # the critic tells zero-reward branches apart
    assert "td/prefix_is_weight_mean" not in first  # fresh games have no generated prefix

    second, _ = tempo.td_update(rt)
    assert second["td/fresh_states"] == 0 and second["td/restore_failures"] == 0  # restored from the store
    assert second["td/macro_index_mean"] == 1 and second["td/store_size"] == 2
    assert second["actor/macro_boundary_rate"] == 0  # T reached: every branch is terminal
    assert 0 < second["td/prefix_is_weight_mean"] <= second["td/prefix_is_weight_max"] <= rt.args.prefix_is_max_weight
    assert second["train/tokens"] > 0

    # The walkthrough is in every critic prompt and in no actor prompt.
    references = ["\n".join(f"{i + 1}. {a}" for i, a in enumerate(common.load_walkthrough(g))) for g in rt.games]
    assert seen["critic"] and seen["actor"]
    for text in seen["critic"]:
        assert tempo.PRIVILEGED_HEADER in text and any(ref in text for ref in references)
        assert "Admissible actions" not in text
    for text in seen["actor"]:
        assert tempo.PRIVILEGED_HEADER not in text and not any(ref in text for ref in references)


def test_td_update_drops_a_state_that_fails_to_restore(runtime):
    rt = runtime()
    rt.sample_fn, _ = scored_script(rt)
    tampered = rt.fresh_state()
    tampered.actions, tampered.round_index = ["go to nowhere 9"], 2
    tampered.observation = "You are on the moon."
    rt.store.add(tampered)
    metrics, _ = tempo.td_update(rt)
    assert metrics["td/restore_failures"] == 1 and metrics["td/fresh_states"] == 1
    assert metrics["td/new_endpoints"] == 2  # the other start state's branches still ran and were stored


def test_warmup_update_trains_the_critic_on_boundary_states(runtime):
    rt = runtime(critic_samples=4, learning_rate=1e-3)
    rt.sample_fn, seen = scored_script(rt)
    metrics, samples = tempo.warmup_update(rt)
    assert metrics["warmup/boundary_states"] == 2 * 2  # 1 game x 2 branches x (T / H) boundaries
    assert metrics["critic/parse_failure_rate"] == 0 and metrics["train/tokens"] > 0
    assert metrics["critic/value_target_mean"] == metrics["warmup/success_rate"]
    assert len(seen["critic"]) == 4 * 4 and {"Steps taken: 0 of 4", "Steps taken: 2 of 4"} == {
        line.split(" (")[0] for text in seen["critic"] for line in text.splitlines() if line.startswith("Steps taken")
    }
    assert samples and samples[0]["critic_reply"]


# --------------------------------------------------------------------------------------------
# main() end to end: real tiny model sampling, checkpoint, resume, eval
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_run(games_root, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    args = small_args(games_root, tiny_model_dir, out, eval_every=10)
    run_dir = tempo.main(args)
    return args, run_dir


def test_smoke_run_second_td_update_consumes_stored_states(smoke_run):
    args, run_dir = smoke_run
    rows = read_metrics(run_dir)
    assert [r["update"] for r in rows] == [1, 2, 3] and [r["phase"] for r in rows] == ["warmup", "td", "td"]
    warmup, td1, td2 = rows
    assert warmup["warmup/boundary_states"] == 2 * 2 and "critic/parse_failure_rate" in warmup
    assert td1["td/fresh_states"] == 2 and td1["td/new_endpoints"] == 4 and td1["td/store_size"] == 4
    assert td2["td/fresh_states"] == 0 and td2["td/restore_failures"] == 0 and td2["td/macro_index_mean"] == 1
    for key in (
        "rollout/valid_format_rate",
        "rollout/admissible_rate",
        "rollout/steps",
        "critic/value_target_mean",
        "actor/degenerate_group_rate",
        "actor/macro_boundary_rate",
        "time/rollout",
        "time/critic",
        "time/update",
    ):
        assert key in td1, key
    assert "eval/valid_seen/success_rate" in td2 and "eval/valid_unseen/invalid_action_rate" in td2
    assert (run_dir / "checkpoints" / "update_000003" / "adapter_model.safetensors").is_file()
    assert json.loads((run_dir / "config.json").read_text())["td_updates"] == 2
    assert (run_dir / "samples.jsonl").read_text().strip()


def test_resume_continues_the_run(smoke_run, tmp_path):
    args, run_dir = smoke_run
    args = tempo.Args(**{**vars(args), "td_updates": 3, "resume": "auto", "eval_every": 0})
    assert tempo.main(args) == run_dir
    rows = read_metrics(run_dir)
    assert [r["update"] for r in rows] == [1, 2, 3, 4]
    assert rows[3]["td/fresh_states"] == 0  # the store came back with the checkpoint (2 states were left)
    state = json.loads((run_dir / "checkpoints" / "update_000004" / "trainer_state.json").read_text())
    assert state["algorithm"] == "tempo" and state["update"] == 4

    other = tmp_path / "update_000004"
    shutil.copytree(run_dir / "checkpoints" / "update_000004", other)
    state["algorithm"] = "adca_grpo"
    (other / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="adca_grpo"):
        tempo.main(tempo.Args(**{**vars(args), "resume": str(other)}))
