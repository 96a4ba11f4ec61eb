"""Chat protocol, parse_action and the batched rollout driver (scripted samplers, real engine)."""

import pytest

import common
import harness
import training

TOOL = '<tool_call>\n{"name": "alfworld_step", "arguments": {"action": "%s"}}\n</tool_call>'


# --------------------------------------------------------------------------------------------
# parse_action
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        (TOOL % "go to cabinet 1", "go to cabinet 1"),
        ("I should look.\n" + TOOL % "Take  Mug 1 from\tcountertop 2" + "\n  ", "take mug 1 from countertop 2"),
        (
            '<tool_call>{"name": "alfworld_step", "arguments": "{\\"action\\": \\"open fridge 1\\"}"}</tool_call>',
            "open fridge 1",
        ),
        (
            "<think>hmm</think><tool_call>\n<function=alfworld_step>\n<parameter=action>\ngo to shelf 2\n</parameter>\n"
            "</function>\n</tool_call>",
            "go to shelf 2",
        ),
    ],
)
def test_parse_action_valid(text, expected):
    assert common.parse_action(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "go to cabinet 1",
        TOOL % "look" + " ok",
        TOOL % "look" + TOOL % "look",
        '<tool_call>{"name": "other_tool", "arguments": {"action": "look"}}</tool_call>',
        TOOL % "",
        TOOL % "   ",
        TOOL % "go to\\ncabinet 1",
        '<tool_call>{"name": "alfworld_step"}</tool_call>',
        '<tool_call>{"name": "alfworld_step", "arguments": {"action": 3}}</tool_call>',
        "<tool_call>{not json</tool_call>",
        "<tool_call><function=alfworld_step><parameter=action>a\nb</parameter></function></tool_call>",
        "<tool_call><function=alfworld_step><parameter=action>a</parameter><parameter=x>b</parameter></function></tool_call>",
        "<tool_call><function=shell><parameter=action>rm</parameter></function></tool_call>",
        "</tool_call>",
        "<tool_call>",
        None,
        42,
        b"<tool_call></tool_call>",
    ],
)
def test_parse_action_rejects(text):
    assert common.parse_action(text) is None


def test_parse_action_hostile_inputs_return():
    huge = "<tool_call>" * 300_000 + "</tool_call>"
    assert common.parse_action(huge) is None
    assert common.parse_action("{" * 2_000_000) is None
    nested = "<tool_call>" + '{"name": "alfworld_step", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"
    assert common.parse_action(nested) is None
    long_action = TOOL % ("x" * 1_000_000)
    assert common.parse_action(long_action) == "x" * 1_000_000
    xml = "<tool_call><function=alfworld_step><parameter=action>" + "</parameter>" * 200_000 + "</function></tool_call>"
    assert common.parse_action(xml) is None


def test_admissible_list_is_optional(tokenizer):
    hidden = common.ChatProtocol(tokenizer, show_admissible=False)
    assert "Admissible" not in hidden.tool_message("executed", "obs", ["look"])
    assert "Admissible actions: look" in common.ChatProtocol(tokenizer).tool_message("executed", "obs", ["look"])


# --------------------------------------------------------------------------------------------
# rollouts with scripted samplers
# --------------------------------------------------------------------------------------------
class Scripted:
    """A sample_fn that answers from a script keyed by (task, turn) and counts its calls."""

    def __init__(self, protocol, reply_fn):
        self.protocol, self.reply_fn, self.calls, self.batch_sizes = protocol, reply_fn, 0, []

    def __call__(self, prompts, max_new_tokens):
        self.calls += 1
        self.batch_sizes.append(len(prompts))
        out = []
        for prompt in prompts:
            text = self.protocol.tokenizer.decode(prompt)
            turn = text.count("<|im_start|>assistant") - 1
            reply = self.reply_fn(common.extract_task(text), turn)
            tokens = (self.protocol.encode(reply) + [self.protocol.eos_token_id])[:max_new_tokens]
            text = self.protocol.tokenizer.decode(tokens, skip_special_tokens=True)
            out.append(common.Completion(tokens, [-0.5] * len(tokens), text))
        return out


def play(
    starts,
    branches,
    sampler,
    protocol,
    horizon=50,
    max_turns=50,
    max_turn_tokens=64,
    max_trajectory_tokens=100_000,
):
    return common.rollout(
        starts,
        branches,
        sampler,
        protocol,
        horizon=horizon,
        max_turns=max_turns,
        max_turn_tokens=max_turn_tokens,
        max_trajectory_tokens=max_trajectory_tokens,
    )


def _distinct_task_games(all_games, protocol, k):
    chosen, tasks = [], set()
    for game_file in all_games:
        state = common.game_start(game_file, protocol)
        if state.task not in tasks:
            tasks.add(state.task)
            chosen.append(state)
    return chosen[:k]


def test_rollout_walkthrough_replayer_wins(all_games, protocol):
    starts = _distinct_task_games(all_games, protocol, 3)
    walkthroughs = {s.task: common.load_walkthrough(s.game_file) for s in starts}
    sampler = Scripted(protocol, lambda task, turn: "Going.\n" + TOOL % walkthroughs[task][turn])
    groups = play(starts, 2, sampler, protocol)
    lengths = [len(w) for w in walkthroughs.values()]
    assert sampler.calls == max(lengths)
    assert sampler.batch_sizes[0] == 6 and sorted(sampler.batch_sizes, reverse=True) == sampler.batch_sizes
    for start, group in zip(starts, groups):
        assert len(group) == 2
        for traj in group:
            assert traj.stop_reason == common.STOP_WON and traj.won and traj.reward == 1.0
            assert traj.actions == walkthroughs[start.task]
            assert [s.reward for s in traj.steps] == [0.0] * (len(traj.steps) - 1) + [1.0]
            assert all(s.valid and s.admissible for s in traj.steps)
            tokens, logprobs, step_ids = traj.sequence()
            assert tokens[: len(start.prefix_tokens)] == start.prefix_tokens
            assert len(tokens) == len(logprobs) == len(step_ids) == traj.sequence_end
            assert tokens[-1] == protocol.eos_token_id  # ends with the last completion
            for k, step in enumerate(traj.steps):
                positions = [i for i, s in enumerate(step_ids) if s == k]
                assert positions == list(range(step.prompt_length, step.prompt_length + len(step.completion_tokens)))
                assert [tokens[i] for i in positions] == step.completion_tokens
            assert all(lp == 0.0 for lp, s in zip(logprobs, step_ids) if s == -1)
            assert all(lp == -0.5 for lp, s in zip(logprobs, step_ids) if s >= 0)


def test_rollout_garbage_is_invalid_and_env_not_advanced(all_games, protocol):
    starts = _distinct_task_games(all_games, protocol, 2)
    sampler = Scripted(protocol, lambda task, turn: "I refuse to use tools.")
    groups = play(starts, 3, sampler, protocol, horizon=4, max_turn_tokens=32)
    assert sampler.calls == 4 and sampler.batch_sizes == [6] * 4
    for start, group in zip(starts, groups):
        for traj in group:
            assert traj.stop_reason == common.STOP_HORIZON
            assert traj.actions == [] and traj.turn.observation == start.observation
            assert all(not s.valid and s.action is None for s in traj.steps)
            assert "Status: invalid format" in traj.messages[-1]["content"]


def test_rollout_not_admissible_is_sent_and_marked(all_games, protocol):
    start = _distinct_task_games(all_games, protocol, 1)[0]
    sampler = Scripted(protocol, lambda task, turn: TOOL % "dance wildly")
    (group,) = play([start], 1, sampler, protocol, horizon=2)
    (traj,) = group
    assert traj.actions == ["dance wildly"] * 2
    assert all(s.valid and not s.admissible and s.observation == "Nothing happens." for s in traj.steps)
    assert traj.messages[-1]["content"].startswith("Status: not admissible")


def test_rollout_token_budget_and_max_steps(all_games, protocol):
    start = _distinct_task_games(all_games, protocol, 1)[0]
    sampler = Scripted(protocol, lambda task, turn: "x " * 200 + TOOL % "look")
    budget = len(start.prefix_tokens) + 3 * 64
    (group,) = play([start], 2, sampler, protocol, max_trajectory_tokens=budget)
    for traj in group:
        assert traj.stop_reason == common.STOP_TOKEN_BUDGET
        assert len(traj.tokens) + 64 > budget and 1 <= len(traj.steps) <= 3
        assert all(len(s.completion_tokens) == 64 and not s.valid for s in traj.steps)  # truncated: no call

    sampler = Scripted(protocol, lambda task, turn: TOOL % "look")
    (turn_limit,) = play([start], 1, sampler, protocol, horizon=10, max_turns=4)
    assert turn_limit[0].stop_reason == common.STOP_MAX_STEPS and len(turn_limit[0].steps) == 4

    # rollout/ metrics: each stop reason's share, and a warning when the token budget stops more than a few
    metrics = training.rollout_metrics([*group, *turn_limit])
    assert metrics["rollout/episodes"] == 3 and metrics["rollout/stopped/won"] == 0
    assert metrics["rollout/stopped/token_budget"] == 2 / 3 and metrics["rollout/stopped/max_steps"] == 1 / 3
    warning = harness.token_budget_warning(metrics, harness.SharedArgs(max_trajectory_tokens=budget))
    assert f"67% of the update's episodes stopped on --max-trajectory-tokens ({budget})" in warning
    assert harness.token_budget_warning(training.rollout_metrics(turn_limit), harness.SharedArgs()) is None


def test_rollout_continues_from_saved_state_and_drops_bad_ones(all_games, protocol):
    start = _distinct_task_games(all_games, protocol, 1)[0]
    walkthrough = common.load_walkthrough(start.game_file)
    sampler = Scripted(protocol, lambda task, turn: TOOL % walkthrough[turn])
    (first,) = play([start], 1, sampler, protocol, horizon=2)
    saved = common.SavedState.from_json(first[0].saved_state().to_json())
    assert saved.round_index == 2 and saved.actions == walkthrough[:2]
    assert len(saved.prefix_step_ids) == len(saved.prefix_tokens) == len(saved.prefix_logprobs)
    assert set(saved.prefix_step_ids) == {-1, 0, 1}
    tampered = common.SavedState(**{**saved.__dict__, "actions": ["look", "look"]})
    second, dropped = play([saved, tampered], 2, sampler, protocol)
    assert dropped == []
    for traj in second:
        assert traj.won and traj.actions == walkthrough and len(traj.steps) == len(walkthrough) - 2
        tokens, _, step_ids = traj.sequence()
        assert tokens[: len(saved.prefix_tokens)] == saved.prefix_tokens
        assert set(step_ids[: len(saved.prefix_tokens)]) == {-1}  # only this segment is trainable
