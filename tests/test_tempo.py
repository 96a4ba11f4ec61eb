"""TEMPO: signal functions, value parsing, prompts, datums, the update, and end-to-end runs of main() on the
tiny model and generated games (real engine, CPU)."""

import json
import math
import random
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed

import common
import harness
import tempo
import training

ROOT = Path(__file__).resolve().parents[1]

TOOL = '<tool_call>\n{"name": "alfworld_step", "arguments": {"action": "%s"}}\n</tool_call>'


def small_args(games_root, tiny_model_dir, output_dir, **overrides) -> tempo.Args:
    """Tiny budgets: T=4 turns in macro steps of H=2, 2 branches, short replies."""
    settings = dict(
        model=str(tiny_model_dir),
        data_root=str(games_root),
        output_dir=str(output_dir),
        seed=0,
        macro_rounds=2,
        max_turns=4,
        group_size=2,
        critic_samples=2,
        endpoint_samples=1,
        groups_per_update=2,
        warmup_updates=1,
        warmup_groups_per_update=1,
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


def train(rt, datums: list[training.Datum]) -> dict:
    """One training call as tempo.py's updates make it: old logprobs refreshed where needed, then ppo_update."""
    metrics = training.refresh_old_logprobs(rt, datums, always=rt.args.ppo_epochs * rt.args.mini_batches > 1)
    return metrics | tempo.ppo_update(rt, datums)


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
    assert rewards == pytest.approx([-0.15, -0.5])


def test_the_squared_critic_reward_is_best_at_the_mean_and_the_absolute_one_at_the_median():
    rewards, advantages = tempo.critic_signals([0.2, None, 0.8, 0.5], 0.5, 1.0, squared=True)
    assert rewards == pytest.approx([-0.09, -1.0, -0.09, 0.0])
    assert advantages == pytest.approx([0.205, -0.705, 0.205, 0.295])
    # a state won 3 times in 10 (V = 0.3): the constant answer with the best mean reward over its 0/1 outcomes
    outcomes = [1.0] * 3 + [0.0] * 7
    answers = [i / 20 for i in range(21)]

    def best(squared):
        mean_reward = [sum(tempo.critic_signals([v], g, 1.0, squared)[0][0] for g in outcomes) for v in answers]
        return answers[max(range(len(answers)), key=mean_reward.__getitem__)]

    assert best(squared=True) == pytest.approx(0.3)  # the value
    assert best(squared=False) == 0.0  # the median outcome: the diagnosis of "always 1" / "always 0"


@pytest.mark.parametrize("r_max", [0.5, 1.0, 2.0])
def test_a_parse_failure_scores_exactly_like_the_worst_parsed_answer(r_max):
    # the worst parsed answer: 1 when the outcome was 0, and 0 when it was 1
    for target, worst in [(0.0, 1.0), (1.0, 0.0)]:
        rewards, _ = tempo.critic_signals([None, worst, target], target, r_max)
        assert rewards == pytest.approx([-1 / r_max, -1 / r_max, 0.0])
    _, advantages = tempo.critic_signals([None, None, None], 0.5, 1.0)
    assert tempo.is_degenerate(advantages)
    _, advantages = tempo.critic_signals([0.3, 0.7], 0.5, 1.0)  # equally wrong: no preference
    assert tempo.is_degenerate(advantages)


def test_a_state_whose_answers_agree_teaches_nothing():
    """The source's baseline: a state whose K answers are all "0" while its target is 0.5 gets no datum (its rewards
    are centred within the K); the other state's answers train; the metric still counts the agreeing state."""

    def replies(*answers):
        return [common.Completion([7], [-0.5], f"<value>{a}</value>") for a in answers]

    prompts, targets = [[1, 2], [3, 4]], [0.5, 0.0]
    answers = [replies(0, 0, 0), replies(0, 0, 0.2)]
    values, datums = tempo.score_critic(prompts, answers, targets, 1.0)
    assert values == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.2]]
    assert [d.tokens[:2] for d in datums] == [[3, 4]] * 3  # the agreeing state teaches nothing
    mean = statistics.fmean([0.0, 0.0, -0.2])
    assert [trained_advantages(d)[0] for d in datums] == pytest.approx([r - mean for r in [0.0, 0.0, -0.2]])
    metrics = tempo.critic_metrics(values, targets, "critic/value_corr")
    assert metrics["critic/degenerate_group_rate"] == 0.5


# --------------------------------------------------------------------------------------------
# Flags, store, prompts
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(max_turns=45), "--max-turns"),
        (dict(macro_rounds=0), "--macro-rounds"),
        (dict(group_size=1), "--group-size"),
        (dict(critic_samples=1), "--critic-samples"),  # allowed with --critic-baseline batch
        (dict(endpoint_samples=0), "--endpoint-samples"),
        (dict(state_store_capacity=2, groups_per_update=4), "--state-store-capacity"),
        (dict(r_max=0.0), "--r-max"),
        (dict(clip_eps=1.5), "--clip-eps"),
        (dict(clip_eps=0.2, clip_eps_high=0.0), "--clip-eps-high"),
        (dict(mini_batches=0), "--mini-batches"),
        (dict(fresh_state_share=1.5), "--fresh-state-share"),
        (dict(max_trajectory_tokens=512, max_turn_tokens=512), "--max-trajectory-tokens"),
        (dict(max_critic_tokens=24576), "--max-critic-tokens"),
        (dict(critic_step_chars=0), "--critic-step-chars"),
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
    states = [common.game_start(all_games[0], protocol, seed=i) for i in range(5)]
    store = tempo.StateStore(capacity=3, selection="uniform")
    for state in states:
        assert store.add(state, 0.0)  # uniform keeps every state, whatever its value
    assert [s.seed for s, _ in store.entries] == [2, 3, 4]  # the two oldest fell out
    taken = store.take(2, random.Random(0))
    assert len(taken) == 2 and len({s.seed for s, _ in taken}) == 2 and len(store) == 1
    assert {s.seed for s, _ in taken} | {store.entries[0][0].seed} == {2, 3, 4}
    assert len(store.take(5, random.Random(0))) == 1 and len(store) == 0


def test_source_store_is_fifo_draws_distinct_states_uniformly_and_keeps_them(all_games, protocol):
    """--state-selection source, 09-tempo's states.py: FIFO eviction at capacity, every state added kept whatever its
    value, n distinct states drawn uniformly, drawn states stay in the store."""
    states = [common.game_start(all_games[0], protocol, seed=i) for i in range(5)]
    store = tempo.StateStore(capacity=3, selection="source")
    assert all(store.add(state, value) for state, value in zip(states, (0.0, 1.0, 0.0, 0.5, 1.0)))
    assert [s.seed for s, _ in store.entries] == [2, 3, 4]  # the two oldest fell out
    rng = random.Random(0)
    taken = store.take(2, rng)
    assert len({s.seed for s, _ in taken}) == 2 and [s.seed for s, _ in store.entries] == [2, 3, 4]
    assert sorted(s.seed for s, _ in store.take(5, rng)) == [2, 3, 4] and len(store) == 3  # all, each once
    first = [store.take(1, rng)[0][0].seed for _ in range(3000)]
    assert all(first.count(seed) / 3000 == pytest.approx(1 / 3, abs=0.03) for seed in (2, 3, 4))


def test_uncertain_store_keeps_states_inside_the_band_and_draws_where_branches_disagree(all_games, protocol):
    state = common.game_start(all_games[0], protocol)
    store = tempo.StateStore(capacity=8, selection="uncertain", band=(0.05, 0.95), group_size=4)
    assert [store.add(state, v) for v in (0.0, 0.04, 1.0, 0.5, 0.1, 0.96)] == [False, False, False, True, True, False]
    informative = {v: 1 - v**4 - (1 - v) ** 4 for v in (0.5, 0.1)}  # the chance that 4 branches do not all agree

    def first_draws(selection, n=3000):
        rng, values = random.Random(0), []
        for _ in range(n):
            draw = tempo.StateStore(8, selection, (0.05, 0.95), 4)
            draw.entries.extend(store.entries)
            values.append(draw.take(1, rng)[0][1])
        return values

    expected = informative[0.5] / sum(informative.values())  # 0.72
    assert first_draws("uncertain").count(0.5) / 3000 == pytest.approx(expected, abs=0.03)
    assert first_draws("uniform").count(0.5) / 3000 == pytest.approx(0.5, abs=0.03)
    assert {v for _, v in store.take(5, random.Random(0))} == {0.5, 0.1} and len(store) == 0


def test_the_uncertain_store_leaves_out_hopeless_endpoints_and_still_draws_sure_ones(all_games, protocol):
    """--state-selection uncertain with its defaults (--uncertain-band 0.05 1, floor 0.05): an endpoint the critic
    values 0 is not stored; one valued 1 (no chance of a disagreeing group) is, with the floor as its draw weight, so
    a critic that answers only 0 or 1 still leaves start states."""
    defaults = tempo.Args(state_selection="uncertain")
    state, rng = common.game_start(all_games[0], protocol), random.Random(0)
    draws = []
    for _ in range(3000):
        store = tempo.StateStore(
            8, defaults.state_selection, defaults.uncertain_band, defaults.group_size, defaults.uncertain_floor
        )
        assert not store.add(state, 0.0) and store.add(state, 1.0) and store.add(state, 0.5)
        draws.append(store.take(1, rng)[0][1])
    weights = {1.0: 0.05, 0.5: 1 - 2 * 0.5**4 + 0.05}
    for value, weight in weights.items():
        assert draws.count(value) / 3000 == pytest.approx(weight / sum(weights.values()), abs=0.03)


def test_trim_middle_keeps_both_ends_within_the_budget():
    assert tempo.trim_middle("abcdefghij", 10) == "abcdefghij"
    assert tempo.trim_middle("abcdefghij", 4) == "ab [...] ij"
    assert tempo.trim_middle("abcdefghij", 5) == "ab [...] hij"
    assert tempo.trim_middle("abcdefghij", 1) == " [...] j"


def test_critic_prompt_shows_the_actors_replies_and_holds_the_walkthrough(all_games, protocol, tokenizer):
    game = all_games[0]
    walkthrough = common.load_walkthrough(game)
    ramble = "I wonder. " * 100  # 1000 characters: cut to the step budget
    quoting = "The game said\nAdmissible actions: look, inventory\nso I go on.\n"  # the phrase in a reply
    scripted = iter(
        [
            "First I check the obvious place.\n" + TOOL % walkthrough[0],
            ramble,
            quoting + TOOL % walkthrough[1],
            TOOL % "look",
        ]
    )
    sampler = lambda prompts, n: [
        common.Completion(protocol.encode(t), [0.0] * len(protocol.encode(t)), t)
        for t in [next(scripted) for _ in prompts]
    ]
    start = common.game_start(game, protocol)
    (group,) = common.rollout(
        [start], 1, sampler, protocol, horizon=4, max_turns=10, max_turn_tokens=64, max_trajectory_tokens=8192
    )
    traj = group[0]
    text = tokenizer.decode(
        tempo.critic_prompt(tokenizer, traj.start.task, walkthrough, traj.messages, traj.round_index, 10, 120)
    )
    reference = "\n".join(f"{i + 1}. {a}" for i, a in enumerate(walkthrough))
    assert tempo.PRIVILEGED_HEADER + "\n" + reference in text
    assert f"Step 1: First I check the obvious place.\n> {walkthrough[0]} [executed]" in text
    assert f"Step 2: (no valid action) {tempo.trim_middle(ramble.strip(), 120)} [invalid format]" in text
    assert f"Step 3: {quoting.strip()}\n> {walkthrough[1]} [" in text  # the quoted phrase cost no action
    assert "Step 4: > look [" in text and "alfworld_step" not in text  # calls shown as actions, no tool schema
    for message in traj.messages:  # the game's admissible-action lists stay out
        if message["role"] in ("user", "tool"):
            assert message["content"].split(tempo.ADMISSIBLE_SEPARATOR)[1] not in text
    assert "Steps taken: 4 of 10 (6 left)" in text and traj.start.task in text
    actor_text = tokenizer.decode(traj.tokens)
    assert tempo.PRIVILEGED_HEADER not in actor_text and reference not in actor_text


# --------------------------------------------------------------------------------------------
# Datums and the update (real tiny model + LoRA)
# --------------------------------------------------------------------------------------------
@pytest.fixture
def runtime(games_root, tiny_model_dir, tmp_path):
    def build(**overrides):
        args = small_args(games_root, tiny_model_dir, tmp_path, **overrides)
        set_seed(args.seed)
        return tempo.Runtime(args, harness.make_accelerator())

    return build


@pytest.mark.slow
def test_actor_loss_mask_covers_only_the_segments_generated_tokens(runtime):
    rt = runtime()

    def segment(start):
        budgets = dict(horizon=2, max_turns=4, max_turn_tokens=24, max_trajectory_tokens=4096)
        (group,) = common.rollout([start], 1, rt.sample_fn, rt.protocol, **budgets)
        return group

    first = segment(rt.next_game_start())
    saved = first[0].saved_state()
    assert any(k >= 0 for k in saved.prefix_step_ids)  # the prefix holds generated tokens of turns 0-1
    second = segment(saved)
    traj = second[0]
    (datum,) = training.trajectory_datums([traj], [[0.5] * len(traj.steps)])
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


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_logprobs_equal_a_teacher_forced_pass_per_token(runtime, temperature, top_p):
    rt = runtime(temperature=temperature, top_p=top_p, sample_batch_size=2)
    prompts = [rt.next_game_start().prefix_tokens, rt.next_game_start().prefix_tokens[:40], [1, 2, 3]]
    replies = rt.sample_fn(prompts, 24)
    sequences = [p + r.tokens for p, r in zip(prompts, replies)]
    forced = training.sequence_logprobs(
        rt.model, rt.accelerator, sequences, temperature, rt.tokenizer.pad_token_id, rt.args.micro_batch_tokens
    )
    for prompt, reply, logprobs in zip(prompts, replies, forced):
        assert len(reply.tokens) == len(reply.logprobs) >= 1
        assert reply.logprobs == pytest.approx(logprobs[len(prompt) :], abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_update_moves_logprob_with_the_advantage_sign(runtime, sign):
    rt = runtime(learning_rate=1e-2)
    prompt = rt.next_game_start().prefix_tokens
    (reply,) = rt.sample_fn([prompt], 16)
    datum = tempo.critic_datum(prompt, reply, sign)
    masked = [i for i, m in enumerate(datum.mask) if m]

    def logprob_sum():
        (logprobs,) = training.sequence_logprobs(
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
    metrics = train(rt, [datum])
    assert metrics["train/tokens"] == len(reply.tokens) and metrics["train/nonfinite_skipped"] == 0
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-3) and metrics["train/grad_norm"] > 0
    after = logprob_sum()
    assert (after - before) * sign > 1e-4


@pytest.mark.slow
def test_clip_eps_stops_the_gradient_outside_the_band(runtime):
    rt = runtime(learning_rate=1e-2, clip_eps=0.2)
    prompt = rt.next_game_start().prefix_tokens
    (reply,) = rt.sample_fn([prompt], 16)
    stale = [lp - 1.0 for lp in reply.logprobs]  # ratio = e > 1.2 on every trained token
    clipped = tempo.critic_datum(prompt, common.Completion(reply.tokens, stale, reply.text), 1.0)
    metrics = train(rt, [clipped])
    assert metrics["train/clip_frac"] == 1.0 and metrics["train/grad_norm"] == 0.0
    assert metrics["train/ratio_mean"] == pytest.approx(math.e, rel=1e-3)
    metrics = train(rt, [tempo.critic_datum(prompt, common.Completion(reply.tokens, stale, reply.text), -1.0)])
    assert metrics["train/clip_frac"] == 0.0 and metrics["train/grad_norm"] > 0  # pessimistic side: not clipped


@pytest.mark.slow
def test_fresh_state_share_starts_some_td_updates_at_the_beginning(runtime):
    # every endpoint stored (uniform), so the second update has states to draw from
    rt = runtime(critic_samples=2, endpoint_samples=1, fresh_state_share=0.5, state_selection="uniform")
    rt.sample_fn, _ = scored_script(rt, patterns=PARSED_PATTERNS)
    first, _ = tempo.td_update(rt)
    assert first["td/fresh_states"] == 2 and first["td/store_size"] == 4  # an empty store: all fresh
    second, _ = tempo.td_update(rt)
    assert second["td/fresh_states"] == 1 and second["td/macro_index_mean"] == 0.5  # 1 of 2 stored, 1 fresh


@pytest.mark.slow
def test_ppo_epochs_let_the_clip_act_from_the_second_optimizer_step(runtime):
    rt = runtime(learning_rate=1e-2, clip_eps=1e-3, ppo_epochs=2)
    prompt = rt.next_game_start().prefix_tokens
    (reply,) = rt.sample_fn([prompt], 16)
    metrics = train(rt, [tempo.critic_datum(prompt, reply, 1.0)])
    assert metrics["train/optimizer_steps"] == 2
    # the mean over the two steps: the first at ratio 1 (nothing clipped), the second after the first moved the policy
    assert 0.0 < metrics["train/clip_frac"] <= 0.5


def test_token_budget_batches():
    batches = training.token_budget_batches([10, 50, 20, 30, 200], 60)
    assert batches == [[4], [1], [3, 2], [0]]  # longest first; rows x longest <= budget, an oversize row alone


# --------------------------------------------------------------------------------------------
# TD updates with a scripted policy scored by the real model
# --------------------------------------------------------------------------------------------
# Critic replies per distinct critic prompt, cycled in the order the prompts first appear: the two entries are
# the replies to that prompt's 1st, 3rd, ... and 2nd, 4th, ... occurrence in one sample_fn call (so with 2 samples
# per endpoint each endpoint gets both). Means of the parsed values differ, "no idea" fails to parse.
PATTERNS = [
    ("Looks good. <value>0.9</value>", "<value>0.5</value>"),  # 0.7
    ("no idea", "<value>0.2</value>"),  # one failure: 0.2
    ("<value>0.4</value>", "<value>.6</value>"),  # 0.5
    ("no idea", "no idea either"),  # all failed: 0
    ("<value>0.1</value>", "<value>0.8</value>"),  # 0.45
]
PARSED_PATTERNS = [p for p in PATTERNS if all(tempo.parse_value(r) is not None for r in p)]


def scored_script(rt, seed=0, patterns=PATTERNS, pick=None):
    """A sample_fn whose replies are scripted and whose logprobs are the real tiny model's, so the groups carry
    signal (the untrained tiny model itself never emits a parsable reply). Actor: `pick(prompt_text,
    admissible, rng)` (default: a random admissible action) as a tool call. Critic: `patterns` as above.
    Records every prompt it sees and the pattern each critic prompt got."""
    rng, tokenizer = random.Random(seed), rt.tokenizer
    pick = pick or (lambda text, admissible, rng: rng.choice(admissible))
    seen = {"actor": [], "critic": [], "pattern": {}}

    def sample(prompts, max_new_tokens):
        replies, occurrences = [], {}
        for prompt in prompts:
            text = tokenizer.decode(prompt)
            if tempo.CRITIC_SYSTEM_PROMPT in text:
                seen["critic"].append(text)
                pattern = seen["pattern"].setdefault(text, patterns[len(seen["pattern"]) % len(patterns)])
                occurrences[text] = occurrences.get(text, -1) + 1
                replies.append(pattern[occurrences[text] % 2])
            else:
                seen["actor"].append(text)
                admissible = text.rsplit("Admissible actions: ", 1)[1].split("\n")[0].split(", ")
                replies.append(TOOL % pick(text, admissible, rng))
        tokens = [tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id] for r in replies]
        logprobs = training.sequence_logprobs(
            rt.model,
            rt.accelerator,
            [p + t for p, t in zip(prompts, tokens)],
            rt.args.temperature,
            tokenizer.pad_token_id,
            rt.args.micro_batch_tokens,
        )
        return [common.Completion(t, lp[len(p) :], r) for p, t, lp, r in zip(prompts, tokens, logprobs, replies)]

    return sample, seen


def record_rollouts_and_updates(rt, monkeypatch):
    """The groups common.rollout returned and the datums tempo.ppo_update got (both still run for real)."""
    rollouts, updates = [], []
    real_rollout, real_update = common.rollout, tempo.ppo_update
    monkeypatch.setattr(common, "rollout", lambda *a, **k: rollouts.append(real_rollout(*a, **k)) or rollouts[-1])
    monkeypatch.setattr(tempo, "ppo_update", lambda rt, datums: updates.append(datums) or real_update(rt, datums))
    return rollouts, updates


def critic_text(rt, start, messages, round_index) -> tuple[list[int], str]:
    prompt = rt.critic_prompt(start.game_file, start.task, messages, round_index)
    return prompt, rt.tokenizer.decode(prompt)


def pattern_values(seen, text, n):
    """The parsed values of the n critic samples one prompt got (None: failed)."""
    return [tempo.parse_value(seen["pattern"][text][i % 2]) for i in range(n)]


def trained_advantages(datum) -> list[float]:
    return [a for a, m in zip(datum.advantages, datum.mask) if m]


def check_td_wiring(rt, seen, groups, datums, weight=1.0) -> dict:
    """Recompute every number of one TD update from the rollout and the scripted critic, and check each datum:
    actor = (R_n - G) * weight on the segment's tokens, critic = -|V_k - G| / r_max centred by --critic-baseline, times
    --critic-coef.
    Returns the expected metrics."""
    by_tokens = {tuple(d.tokens): d for d in datums}
    E, K = rt.args.endpoint_samples, rt.args.critic_samples
    assert E == 2  # the scripted critic gives each endpoint both replies of its pattern
    expected = {"endpoint_values": [], "endpoint_failures": 0, "gaps": [], "critic": [], "actor_datums": 0}
    critic_states = []  # (the datums trained on a start state's critic prompt, its K rewards)
    for group in (g for g in groups if g):
        start = group[0].start
        values = []
        for traj in group:
            if traj.stop_reason != common.STOP_HORIZON:
                values.append(None)  # terminal: worth 0
                continue
            samples = pattern_values(seen, critic_text(rt, start, traj.messages, traj.round_index)[1], E)
            parsed = [v for v in samples if v is not None]
            values.append(statistics.fmean(parsed) if parsed else 0.0)
            expected["endpoint_values"].append(values[-1])
            expected["endpoint_failures"] += E - len(parsed)
        returns = [t.reward + (v or 0.0) for t, v in zip(group, values)]
        target = statistics.fmean(returns)
        zero = [v for t, v in zip(group, values) if v is not None and t.reward == 0]
        expected["gaps"].append(statistics.pstdev(zero) if len(zero) >= 2 else 0.0)
        for traj, ret in zip(group, returns):
            datum = by_tokens.get(tuple(traj.sequence()[0]))
            if tempo.is_degenerate([r - target for r in returns]):
                assert datum is None
                continue
            expected["actor_datums"] += 1
            n = sum(len(step.completion_tokens) for step in traj.steps)
            assert trained_advantages(datum) == pytest.approx([(ret - target) * weight] * n, abs=1e-6)
        start_tokens, start_text = critic_text(rt, start, start.messages, start.round_index)
        start_values = pattern_values(seen, start_text, K)
        expected["critic"].append((start_values, target))
        rewards = [-e / rt.args.r_max for e in tempo.critic_errors(start_values, target)]
        critic_states.append(([d for d in datums if d.tokens[: len(start_tokens)] == start_tokens], rewards))
    for critic_datums, rewards in critic_states:
        baseline = statistics.fmean(rewards)
        if tempo.is_degenerate([r - baseline for r in rewards]):
            assert not critic_datums
        else:
            assert [trained_advantages(d)[0] for d in critic_datums] == pytest.approx([r - baseline for r in rewards])
    return expected


@pytest.mark.slow
def test_td_updates_train_actor_and_critic_from_stored_states(runtime):
    # uncertain: the store holds exactly the endpoints (outcome would add the start states whose group had a gradient)
    rt = runtime(
        critic_samples=4, endpoint_samples=2, prefix_is_correction=True, learning_rate=1e-3, state_selection="uncertain"
    )
    rt.sample_fn, seen = scored_script(rt, patterns=PARSED_PATTERNS)
    first, _ = tempo.td_update(rt)
    assert first["td/fresh_states"] == 2 and first["td/macro_index_mean"] == 0
    assert first["td/new_endpoints"] == 4 and first["td/store_size"] == 4 and first["actor/macro_boundary_rate"] == 1
    assert first["actor/degenerate_group_rate"] < 1 and first["critic/degenerate_group_rate"] < 1
    assert first["critic/parse_failure_rate"] == 0 and first["train/tokens"] > 0
    assert first["actor/value_gap_zero_reward"] > 0  # the critic tells zero-reward branches apart
    assert 0 < first["actor/trained_tokens"] < first["train/tokens"]  # the rest are the critic's
    assert first["td/store_macro_index_1_share"] == 1 and first["td/store_macro_index_mean"] == 1
    assert "rollout/success_rate" not in first and "td/segment_success_rate" in first  # a segment is not an episode
    assert "td/prefix_is_weight_mean" not in first  # fresh games have no generated prefix

    second, _ = tempo.td_update(rt)
    assert second["td/fresh_states"] == 0 and second["td/restore_failures"] == 0  # restored from the store
    assert second["td/macro_index_mean"] == 1 and second["td/store_size"] == 2
    assert 0.05 < second["td/start_value_mean"] < 0.95  # drawn from the values the critic gave the endpoints
    assert second["actor/macro_boundary_rate"] == 0  # T reached: every branch is terminal
    max_weight = rt.args.prefix_is_max_weight
    # within the clip (exact clipping: test_prefix_is_weight_is_clipped_both_ways...); the first step moved the prefix
    assert 1 / max_weight <= second["td/prefix_is_weight_mean"] <= second["td/prefix_is_weight_max"] <= max_weight
    assert second["td/prefix_is_weight_max"] != 1.0
    assert second["train/tokens"] > 0

    # The walkthrough is in every critic prompt and in no actor prompt.
    references = ["\n".join(f"{i + 1}. {a}" for i, a in enumerate(common.load_walkthrough(g))) for g in rt.games]
    assert seen["critic"] and seen["actor"]
    for text in seen["critic"]:
        assert tempo.PRIVILEGED_HEADER in text and any(ref in text for ref in references)
        assert "Admissible actions" not in text
    for text in seen["actor"]:
        assert tempo.PRIVILEGED_HEADER not in text and not any(ref in text for ref in references)


@pytest.mark.slow
def test_td_update_drops_a_state_that_fails_to_restore(runtime):
    rt = runtime()
    rt.sample_fn, _ = scored_script(rt, patterns=PARSED_PATTERNS)  # every endpoint valued inside the band: stored
    tampered = rt.next_game_start()
    tampered.actions, tampered.round_index = ["go to nowhere 9"], 2
    tampered.observation = "You are on the moon."
    rt.store.add(tampered, 0.5)
    metrics, _ = tempo.td_update(rt)
    assert metrics["td/restore_failures"] == 1 and metrics["td/fresh_states"] == 1
    assert metrics["td/new_endpoints"] == 2  # the other start state's branches still ran and were stored


@pytest.mark.slow
def test_warmup_values_every_boundary_state_against_its_trajectorys_outcome(runtime, monkeypatch, all_games):
    """Boundary states at turns 0, H, ... before each trajectory's end, target = that trajectory's 0/1 outcome,
    K samples each with centred rewards; value_corr correlates each state's mean estimate with the outcome."""
    game = min(all_games, key=lambda g: len(common.load_walkthrough(g)))
    walkthrough = common.load_walkthrough(game)
    rt = runtime(critic_samples=4, warmup_groups_per_update=2, group_size=2, learning_rate=1e-3)
    rt.games = [game]

    def mostly_walkthrough(text, admissible, rng):
        turn = text.count("\nObservation: ")
        return walkthrough[turn] if turn < len(walkthrough) and rng.random() < 0.8 else rng.choice(admissible)

    rt.sample_fn, seen = scored_script(rt, pick=mostly_walkthrough)
    rollouts, updates = record_rollouts_and_updates(rt, monkeypatch)
    metrics, samples = tempo.warmup_update(rt)
    (groups,), (datums,) = rollouts, updates
    states = []
    for traj in (t for group in groups for t in group):
        for turns in range(0, traj.round_index, rt.args.macro_rounds):
            _, text = critic_text(rt, traj.start, traj.messages[: 2 + 2 * turns], turns)  # system, user, 2 per turn
            assert text.count("\nStep ") == turns
            states.append((text, 1.0 if traj.won else 0.0))
    assert {target for _, target in states} == {0.0, 1.0}  # won and lost trajectories
    assert sorted(seen["critic"]) == sorted(text for text, _ in states for _ in range(4))

    expected_advantages, estimates = [], []
    for text, target in states:
        values = pattern_values(seen, text, 4)
        rewards = [-e / rt.args.r_max for e in tempo.critic_errors(values, target)]
        advantages = [r - statistics.fmean(rewards) for r in rewards]
        if not tempo.is_degenerate(advantages):
            expected_advantages += advantages
        if any(v is not None for v in values):
            estimates.append((statistics.fmean(v for v in values if v is not None), target))
    assert [trained_advantages(d)[0] for d in datums] == pytest.approx(expected_advantages)
    corr = statistics.correlation([v for v, _ in estimates], [g for _, g in estimates])
    assert metrics["critic/value_corr"] == pytest.approx(corr)
    assert metrics["warmup/boundary_states"] == len(states) and metrics["critic/prompt_too_long_rate"] == 0
    assert metrics["critic/value_target_mean"] == pytest.approx(statistics.fmean(g for _, g in states))
    assert samples and samples[0]["critic_reply"]


@pytest.mark.slow
def test_td_update_wiring_numbers(runtime, monkeypatch):
    """Each actor datum's advantage is R_n - G of its group; an endpoint's value is the mean of its parsed
    samples (0 when all fail); critic datums carry their rewards centred within the state's K; the metrics are these
    numbers."""
    sizes = dict(groups_per_update=3, group_size=3, critic_samples=4, endpoint_samples=2)
    rt = runtime(state_selection="uncertain", uncertain_band=(0.05, 0.95), **sizes)
    rt.sample_fn, seen = scored_script(rt)
    budgets = dict(horizon=2, max_turns=4, max_turn_tokens=24, max_trajectory_tokens=4096)
    (segment,) = common.rollout([rt.next_game_start()], 1, rt.sample_fn, rt.protocol, **budgets)
    rt.store.add(segment[0].saved_state(), 0.5)  # at turn 2 of T = 4: its branches end terminal, worth 0
    rollouts, updates = record_rollouts_and_updates(rt, monkeypatch)
    metrics, _ = tempo.td_update(rt)
    (groups,), (datums,) = rollouts, updates
    expected = check_td_wiring(rt, seen, groups, datums)
    assert expected["actor_datums"] > 0 and expected["endpoint_failures"] > 0
    assert 0.0 in expected["endpoint_values"]  # an endpoint whose samples all failed is worth 0
    assert expected["gaps"][0] == 0 and max(expected["gaps"]) > 0  # the gap is averaged over every group
    assert metrics["critic/endpoint_parse_failures"] == expected["endpoint_failures"]
    assert metrics["critic/endpoint_value_mean"] == pytest.approx(statistics.fmean(expected["endpoint_values"]))
    assert metrics["actor/value_gap_zero_reward"] == pytest.approx(statistics.fmean(expected["gaps"]))
    errors = [e for values, g in expected["critic"] for e in tempo.critic_errors(values, g)]
    parsed = [abs(v - g) for values, g in expected["critic"] for v in values if v is not None]
    assert metrics["critic/abs_error_mean"] == pytest.approx(statistics.fmean(errors))
    assert metrics["critic/abs_error_parsed_mean"] == pytest.approx(statistics.fmean(parsed))
    estimates = [
        (statistics.fmean(v for v in vs if v is not None), g)
        for vs, g in expected["critic"]
        if any(v is not None for v in vs)
    ]  # a state whose samples all failed has no estimate
    corr = statistics.correlation([v for v, _ in estimates], [g for _, g in estimates])
    assert metrics["critic/td_target_corr"] == pytest.approx(corr) and "critic/value_corr" not in metrics
    # --state-selection uncertain stores the endpoints valued inside --uncertain-band, not the one valued 0
    in_band = sum(0.05 <= v <= 0.95 for v in expected["endpoint_values"])
    assert metrics["critic/prompt_too_long_rate"] == 0 and metrics["td/new_endpoints"] == len(rt.store) == in_band
    assert metrics["td/endpoints_left_out"] == len(expected["endpoint_values"]) - in_band > 0
    assert metrics["td/store_value_mean"] == pytest.approx(statistics.fmean(v for _, v in rt.store.entries))


@pytest.mark.slow
def test_outcome_store_keeps_only_the_lineages_whose_branches_disagreed(runtime, monkeypatch):
    """--state-selection outcome: a start state whose group had a gradient goes back into the store (valued its
    target G) with its endpoints; a degenerate group's start state and endpoints are dropped, whatever the critic
    says of them."""
    rt = runtime(state_selection="outcome", groups_per_update=3, group_size=3, critic_samples=4, endpoint_samples=2)
    rt.sample_fn, seen = scored_script(rt)
    budgets = dict(horizon=2, max_turns=4, max_turn_tokens=24, max_trajectory_tokens=4096)
    (segment,) = common.rollout([rt.next_game_start()], 1, rt.sample_fn, rt.protocol, **budgets)
    rt.store.add(segment[0].saved_state(), 0.5)  # at turn 2 of T = 4: its branches end terminal, all worth 0
    rollouts, updates = record_rollouts_and_updates(rt, monkeypatch)
    metrics, _ = tempo.td_update(rt)
    (groups,), (datums,) = rollouts, updates
    expected = check_td_wiring(rt, seen, groups, datums)  # a group has actor datums exactly when it has a gradient
    trained = {tuple(d.tokens) for d in datums}
    with_gradient = [g for g in groups if any(tuple(t.sequence()[0]) in trained for t in g)]
    degenerate = [g for g in groups if g not in with_gradient]
    assert with_gradient and degenerate  # both kinds are in this update (the stored state's group is degenerate)

    def key(state):
        return json.dumps(state.to_json(), sort_keys=True)

    def endpoints(group_list):
        return [key(t.saved_state()) for g in group_list for t in g if t.stop_reason == common.STOP_HORIZON]

    live = [g for g in groups if g]  # check_td_wiring's order: one (start values, target G) per live group
    targets = {key(g[0].start): target for g, (_, target) in zip(live, expected["critic"], strict=True)}
    stored = {key(state): value for state, value in rt.store.entries}
    kept = [key(g[0].start) for g in with_gradient]
    assert sorted(stored) == sorted(kept + endpoints(with_gradient)) and endpoints(with_gradient)
    assert all(stored[k] == pytest.approx(targets[k]) for k in kept)
    assert not set(stored) & ({key(g[0].start) for g in degenerate} | set(endpoints(degenerate)))
    assert metrics["td/starts_kept"] == len(kept) and metrics["td/new_endpoints"] == len(endpoints(with_gradient))
    assert metrics["td/endpoints_left_out"] == len(endpoints(degenerate))


@pytest.mark.slow
def test_source_store_keeps_the_drawn_state_and_stores_every_endpoint_with_room(runtime, monkeypatch):
    """A TD update under --state-selection source: the drawn start state stays in the store, and every branch that
    stopped at the macro boundary with room for another turn is stored, whatever its group's gradient or value."""
    rt = runtime(state_selection="source", groups_per_update=2, group_size=3, max_turns=6)
    rt.sample_fn, _ = scored_script(rt)
    budgets = dict(horizon=2, max_turns=6, max_turn_tokens=24, max_trajectory_tokens=4096)
    (segment,) = common.rollout([rt.next_game_start()], 1, rt.sample_fn, rt.protocol, **budgets)
    drawn = segment[0].saved_state()
    rt.store.add(drawn, 0.5)  # at turn 2 of 6: its branches stop at the next boundary too
    rollouts, _ = record_rollouts_and_updates(rt, monkeypatch)
    metrics, _ = tempo.td_update(rt)
    (groups,) = rollouts
    endpoints = [t for g in groups for t in g if t.stop_reason == common.STOP_HORIZON and tempo.has_room(t, rt.args)]
    assert endpoints and metrics["td/new_endpoints"] == len(endpoints)

    def key(state):
        return json.dumps(state.to_json(), sort_keys=True)

    assert [key(s) for s, _ in rt.store.entries] == [key(drawn)] + [key(t.saved_state()) for t in endpoints]


@pytest.mark.slow
def test_rollout_endpoint_values_are_the_mean_return_of_continuations_and_never_trained(runtime, monkeypatch):
    """--endpoint-values rollout (the critic's ablation): each endpoint's value is the mean return of E continuations
    of its episode to T by the current policy; the critic is sampled on start states only, the continuations' tokens
    are counted in td/oracle_generated_tokens and train nothing."""
    rt = runtime(endpoint_values="rollout", endpoint_samples=2, groups_per_update=2, group_size=3, max_turns=6)
    rt.sample_fn, seen = scored_script(rt)
    rollouts, updates = record_rollouts_and_updates(rt, monkeypatch)
    metrics, _ = tempo.td_update(rt)
    groups, continuations = rollouts
    endpoints = [t for g in groups for t in g if t.stop_reason == common.STOP_HORIZON]
    assert len(continuations) == len(endpoints) > 0 and all(len(c) == 2 for c in continuations)
    assert all(t.start.round_index == 2 and t.stop_reason != common.STOP_HORIZON for c in continuations for t in c)
    values = iter(statistics.fmean(t.reward for t in c) for c in continuations)
    starts = {critic_text(rt, g[0].start, g[0].start.messages, 0)[1] for g in groups}
    assert set(seen["critic"]) == starts  # no endpoint sent to the critic
    trained = {tuple(d.tokens): trained_advantages(d) for d in updates[0]}
    for group in groups:
        returns = [t.reward + (next(values) if t.stop_reason == common.STOP_HORIZON else 0.0) for t in group]
        for traj, ret in zip(group, returns):
            if tuple(traj.sequence()[0]) in trained:
                n = sum(len(step.completion_tokens) for step in traj.steps)
                assert trained[tuple(traj.sequence()[0])] == pytest.approx([ret - statistics.fmean(returns)] * n)
    continued = {tuple(t.sequence()[0]) for c in continuations for t in c}
    assert not continued & set(trained)
    generated = sum(len(s.completion_tokens) for c in continuations for t in c for s in t.steps)
    assert metrics["td/oracle_generated_tokens"] == generated > 0
    values = [statistics.fmean(t.reward for t in c) for c in continuations]
    errors = [statistics.stdev(t.reward for t in c) / math.sqrt(2) for c in continuations]
    assert metrics["td/oracle_value_se_mean"] == pytest.approx(statistics.fmean(errors))
    assert metrics["td/oracle_value_sd"] == pytest.approx(statistics.stdev(values))


@pytest.mark.slow
def test_no_td_critic_values_endpoints_and_trains_only_the_actor(runtime, monkeypatch):
    """--no-td-critic: the TD update values the endpoints as before and trains the same actor datums, but samples
    the critic on no start state and trains no critic datum."""
    sizes = dict(groups_per_update=2, group_size=3, critic_samples=4, endpoint_samples=2)
    budgets = dict(horizon=2, max_turns=4, max_turn_tokens=24, max_trajectory_tokens=4096)
    runs = {}
    for td_critic in (True, False):
        rt = runtime(td_critic=td_critic, **sizes)
        rt.sample_fn, seen = scored_script(rt)
        (segment,) = common.rollout([rt.next_game_start()], 1, rt.sample_fn, rt.protocol, **budgets)
        rt.store.add(segment[0].saved_state(), 0.5)
        rollouts, updates = record_rollouts_and_updates(rt, monkeypatch)
        metrics, _ = tempo.td_update(rt)
        is_critic = [tempo.CRITIC_SYSTEM_PROMPT in rt.tokenizer.decode(d.tokens) for d in updates[0]]
        actor = {tuple(d.tokens): trained_advantages(d) for d, c in zip(updates[0], is_critic) if not c}
        starts = {critic_text(rt, g[0].start, g[0].start.messages, g[0].start.round_index)[1] for g in rollouts[-1]}
        runs[td_critic] = (metrics, actor, sum(is_critic), len(starts & set(seen["critic"])), len(seen["critic"]))
    (trained, trained_actor, trained_critic, trained_starts, trained_samples) = runs[True]
    (frozen, frozen_actor, frozen_critic, frozen_starts, frozen_samples) = runs[False]
    assert trained_actor and frozen_actor.keys() == trained_actor.keys()
    assert all(frozen_actor[k] == pytest.approx(trained_actor[k]) for k in trained_actor)
    assert trained_critic > 0 and trained_starts == 2 and frozen_critic == 0 and frozen_starts == 0
    assert frozen_samples == trained_samples - 2 * 4  # K = 4 on each of the 2 start states, no more
    assert frozen["critic/endpoint_value_mean"] == pytest.approx(trained["critic/endpoint_value_mean"])
    assert frozen["critic/value_target_mean"] == pytest.approx(trained["critic/value_target_mean"])
    assert "critic/degenerate_group_rate" in trained and "critic/degenerate_group_rate" not in frozen


@pytest.mark.slow
@pytest.mark.parametrize(
    "log_ratio, weight", [(math.log(1.5), 1.5), (-math.log(1.5), 1 / 1.5), (3.0, 2.0), (-3.0, 0.5)]
)
def test_prefix_is_weight_is_clipped_both_ways_and_scales_the_actor_advantages(runtime, monkeypatch, log_ratio, weight):
    rt = runtime(groups_per_update=1, group_size=3, endpoint_samples=2, max_turns=6, prefix_is_correction=True)
    rt.sample_fn, seen = scored_script(rt)
    budgets = dict(horizon=2, max_turns=6, max_turn_tokens=24, max_trajectory_tokens=4096)
    (first,) = common.rollout([rt.next_game_start()], 1, rt.sample_fn, rt.protocol, **budgets)
    state = first[0].saved_state()
    generated = sum(k >= 0 for k in state.prefix_step_ids)
    # the sampling logprobs are the current policy's: shifting them sets log p_now - log p_old = log_ratio
    state.prefix_logprobs = [
        lp - log_ratio / generated if k >= 0 else lp for lp, k in zip(state.prefix_logprobs, state.prefix_step_ids)
    ]
    rt.store.add(state, 0.5)
    rollouts, updates = record_rollouts_and_updates(rt, monkeypatch)
    metrics, _ = tempo.td_update(rt)
    assert metrics["td/fresh_states"] == 0
    assert metrics["td/prefix_is_weight_mean"] == pytest.approx(weight, rel=1e-3)
    expected = check_td_wiring(rt, seen, rollouts[0], updates[0], weight=metrics["td/prefix_is_weight_mean"])
    assert expected["actor_datums"] == 3


@pytest.mark.slow
def test_a_branch_truncated_by_the_token_budget_at_the_boundary_is_valued_and_not_stored(runtime, monkeypatch):
    rt = runtime(groups_per_update=1, group_size=2, endpoint_samples=2)
    rt.sample_fn, seen = scored_script(rt, pick=lambda text, admissible, rng: admissible[0])  # deterministic
    start = rt.next_game_start()
    budgets = dict(horizon=2, max_turns=4, max_turn_tokens=24, max_trajectory_tokens=4096)
    (dry,) = common.rollout([start], 1, rt.sample_fn, rt.protocol, **budgets)
    rt.args.max_trajectory_tokens = len(dry[0].tokens) + rt.args.max_turn_tokens - 1  # room for turn 2, not 3
    rt.store.add(start, 0.5)
    rollouts, updates = record_rollouts_and_updates(rt, monkeypatch)
    metrics, samples = tempo.td_update(rt)
    ((a, b),) = rollouts[0]
    assert a.stop_reason == b.stop_reason == common.STOP_HORIZON and not tempo.has_room(a, rt.args)
    _, text = critic_text(rt, start, a.messages, a.round_index)
    assert text in seen["pattern"] and metrics["critic/prompt_too_long_rate"] == 0  # valued by the critic...
    value = statistics.fmean(pattern_values(seen, text, 2))
    assert value > 0 and samples[0]["endpoint_value"] == pytest.approx(value)
    assert metrics["critic/endpoint_value_mean"] == pytest.approx(value)
    assert samples[0]["value_target"] == pytest.approx(value)  # G = 0 reward + V for both branches
    assert metrics["actor/macro_boundary_rate"] == 1 and metrics["td/new_endpoints"] == 0 and len(rt.store) == 0


@pytest.mark.slow
def test_critic_prompts_over_budget_are_skipped_counted_and_never_sent(runtime):
    rt = runtime(max_critic_tokens=4000)  # 96 tokens left for a critic prompt: none fits
    rt.sample_fn, seen = scored_script(rt)
    warmup, _ = tempo.warmup_update(rt)
    assert warmup["critic/prompt_too_long_rate"] == 1 and warmup["warmup/boundary_states"] == 4
    assert warmup["train/tokens"] == 0 and "critic/abs_error_mean" not in warmup
    td, _ = tempo.td_update(rt)
    assert td["critic/prompt_too_long_rate"] == 1 and td["critic/endpoint_value_mean"] == 0
    assert td["critic/endpoint_parse_failures"] == 0 and td["td/new_endpoints"] == 0 and len(rt.store) == 0
    assert not seen["critic"] and seen["actor"]


# --------------------------------------------------------------------------------------------
# main() end to end: real tiny model sampling, checkpoint, resume, eval
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_run(games_root, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    # every endpoint stored: the untrained model's groups are all degenerate, so the default (outcome) would store none
    args = small_args(games_root, tiny_model_dir, out, eval_every=10, state_selection="uniform")
    run_dir = tempo.main(args)
    return args, run_dir


@pytest.mark.slow
def test_smoke_run_second_td_update_consumes_stored_states(smoke_run):
    args, run_dir = smoke_run
    start, *rows = read_metrics(run_dir)
    assert start["update"] == 0 and "eval/train/success_rate" in start  # the start's evaluation, before update 1
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
    assert "eval/train/success_rate" in td2 and "eval/train/success_rate" not in td1
    assert (run_dir / "checkpoints" / "update_000003" / "adapter_model.safetensors").is_file()
    assert json.loads((run_dir / "config.json").read_text())["td_updates"] == 2
    assert (run_dir / "samples.jsonl").read_text().strip()


@pytest.mark.slow
def test_resume_continues_the_run(smoke_run, tmp_path):
    args, run_dir = smoke_run
    args = tempo.Args(**{**vars(args), "td_updates": 3, "resume": "auto", "eval_every": 0})
    assert tempo.main(args) == run_dir
    rows = read_metrics(run_dir)
    assert [r["update"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[4]["td/fresh_states"] == 0  # the store came back with the checkpoint (2 states were left)
    # provenance.jsonl: a line per start of the run, with the code's commit and the installed packages
    sessions = [json.loads(line) for line in (run_dir / "provenance.jsonl").read_text().splitlines()]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert [s["updates_done"] for s in sessions] == [0, 3] and {s["commit"] for s in sessions} == {head or None}
    assert all(s["packages"]["torch"] == torch.__version__ and s["dirty"] in (True, False, None) for s in sessions)
    state = json.loads((run_dir / "checkpoints" / "update_000004" / "trainer_state.json").read_text())
    assert state["algorithm"] == "tempo" and state["update"] == 4

    other = tmp_path / "update_000004"
    shutil.copytree(run_dir / "checkpoints" / "update_000004", other)
    state["algorithm"] = "adca_grpo"
    (other / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="adca_grpo"):
        tempo.main(tempo.Args(**{**vars(args), "resume": str(other)}))


@pytest.mark.slow
def test_evaluation_samples_with_common_random_numbers_and_leaves_the_training_stream(runtime, monkeypatch):
    """eval/train/success_rate: the same sampled episodes at every evaluation of the same weights (the sampler seeded
    with harness.EVAL_SEED), and the run's own random stream as it was."""
    import torch

    rt = runtime(eval_games=1)
    rollouts, _ = record_rollouts_and_updates(rt, monkeypatch)
    before = torch.random.get_rng_state()
    first, second = harness.evaluate(rt, 4), harness.evaluate(rt, 4)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert "eval/train/success_rate" in first and first == second
    sampled = [[t.tokens for group in rollouts[i] for t in group] for i in (0, 3)]  # per evaluation: train, seen, unseen
    assert len(rollouts) == 6 and len(sampled[0]) == 1 and sampled[0] == sampled[1]
    budgets = dict(horizon=4, max_turns=4, max_turn_tokens=24, max_trajectory_tokens=4096)
    (unseeded,) = common.rollout([common.game_start(rt.games[0], rt.protocol)], 1, rt.sample_fn, rt.protocol, **budgets)
    assert unseeded[0].tokens != sampled[0][0]  # the same game's first episode: equal only through the seed
