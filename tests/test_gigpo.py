"""GiGPO: the advantages against an independent torch computation of verl-agent's formulas on hand-made cases,
exact-state and observation anchors on real games (the real TextWorld engine), one update whose advantages move the
tiny model's logprobs, and main() end to end with a resume."""

import json
import math

import pytest
import torch
from accelerate.utils import set_seed

import common
import gigpo
import harness
import training

EPS = 1e-6


# =============================================================================================
# gigpo_advantages against an independent computation
# =============================================================================================
def reference_advantages(scores, groups, rewards, anchors, gamma, w, normalize_std, penalties=None):
    """verl-agent's GiGPO on one batch row per step, re-derived with torch (float64): returns R = U r with U[t, k] =
    gamma^(k - t) for k >= t, group statistics with torch.mean / torch.std (unbiased) over the rows of each label."""
    penalties = penalties or [[0.0] * len(r) for r in rewards]
    rows = [(i, t) for i, r in enumerate(rewards) for t in range(len(r))]
    returns = []
    for r in rewards:
        k = torch.arange(len(r), dtype=torch.float64)
        upper = (k[None, :] >= k[:, None]).double() * gamma ** (k[None, :] - k[:, None]).clamp(min=0)
        returns.append(upper @ torch.tensor(r, dtype=torch.float64))
    score = torch.tensor([scores[i] - penalties[i][t] for i, t in rows], dtype=torch.float64)
    step_return = torch.stack([returns[i][t] - penalties[i][t] for i, t in rows])

    def normalise(x, labels, singleton_mean_zero):
        out = torch.empty_like(x)
        for label in set(labels):
            members = torch.tensor([j for j, other in enumerate(labels) if other == label])
            values = x[members]
            if len(members) == 1:
                mean, std = (x.new_tensor(0.0) if singleton_mean_zero else values.mean()), x.new_tensor(1.0)
            else:
                mean, std = values.mean(), values.std()
            out[members] = (values - mean) / (std + EPS) if normalize_std else values - mean
        return out

    episode = normalise(score, [groups[i] for i, _ in rows], singleton_mean_zero=True)
    step = normalise(step_return, [(groups[i], anchors[i][t]) for i, t in rows], singleton_mean_zero=False)
    total = (episode + w * step).tolist()
    advantages = [[0.0] * len(r) for r in rewards]
    for (i, t), value in zip(rows, total):
        advantages[i][t] = value
    return advantages


def assert_rows(got, expected, tol=1e-9):
    assert len(got) == len(expected)
    for row, want in zip(got, expected):
        assert row == pytest.approx(want, abs=tol)


# Episode group "g": T0 wins in 4 steps and comes back to state a (a recurring anchor within one episode); T1 and T2
# lose; T1 shares a, b with T0, T2 visits a state nobody else does (a singleton); T2 and T3 fail once (penalty).
# Group "h": T3, one episode of one step (a group of one row). Anchor "a" in group "h" is not group "g"'s "a".
CASE = dict(
    scores=[1.0, 0.0, 0.0, 1.0],
    groups=["g", "g", "g", "h"],
    rewards=[[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0], [1.0]],
    anchors=[["a", "b", "a", "c"], ["a", "b", "d"], ["a", "e"], ["a"]],
    penalties=[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.1], [0.1]],
)


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("penalised", [False, True])
@pytest.mark.parametrize("gamma, w", [(0.95, 1.0), (0.5, 0.3), (1.0, 0.0)])
def test_gigpo_advantages_match_an_independent_computation(normalize_std, penalised, gamma, w):
    case = {**CASE, "penalties": CASE["penalties"] if penalised else None}
    got = gigpo.gigpo_advantages(
        case["scores"], case["groups"], case["rewards"], case["anchors"], gamma, w, normalize_std, case["penalties"]
    )
    expected = reference_advantages(
        case["scores"], case["groups"], case["rewards"], case["anchors"], gamma, w, normalize_std, case["penalties"]
    )
    assert_rows(got, expected)


def test_gigpo_advantages_by_hand():
    """Group of two: T0 = [a, b] won, T1 = [a] lost, gamma 0.5. Rows' scores [1, 1, 0]: mean 2/3, unbiased std
    sqrt(1/3). Step group a holds returns [0.5, 0]: mean 0.25, std sqrt(1/8); b is alone: 0."""
    args = ([1.0, 0.0], [0, 0], [[0.0, 1.0], [0.0]], [["a", "b"], ["a"]], 0.5, 1.0)
    a_e = [(1 / 3) / (math.sqrt(1 / 3) + EPS), (-2 / 3) / (math.sqrt(1 / 3) + EPS)]
    a_s = 0.25 / (math.sqrt(1 / 8) + EPS)
    assert_rows(gigpo.gigpo_advantages(*args, True), [[a_e[0] + a_s, a_e[0]], [a_e[1] - a_s]])
    assert_rows(gigpo.gigpo_advantages(*args, False), [[1 / 3 + 0.25, 1 / 3], [-2 / 3 - 0.25]])


def test_gigpo_advantages_edge_cases():
    # a group of one row: mean 0, std 1 (the score stays, / (1 + 1e-6)); its step is alone: 0
    assert gigpo.gigpo_advantages([1.0], [0], [[1.0]], [["s"]], 0.95, 1.0, True) == [[1.0 / (1.0 + EPS)]]
    assert gigpo.gigpo_advantages([1.0], [0], [[1.0]], [["s"]], 0.95, 1.0, False) == [[1.0]]
    # one trajectory of two steps is a group of two rows with equal scores; every anchor distinct: all exactly 0
    assert gigpo.gigpo_advantages([1.0], [0], [[0.0, 1.0]], [["s", "t"]], 0.95, 1.0, True) == [[0.0, 0.0]]
    # equal outcomes, every step from one state: only the discounting separates the steps
    got = gigpo.gigpo_advantages([0.0, 0.0], [0, 0], [[0.0, 0.0], [0.0]], [["s", "s"], ["s"]], 0.95, 1.0, True)
    assert got == [[0.0, 0.0], [0.0]]
    # a trajectory without steps has no rows and gets no advantages
    assert gigpo.gigpo_advantages([1.0, 0.0], [0, 0], [[1.0], []], [["s"], []], 0.95, 1.0, True)[1] == []


def test_the_penalty_is_taken_off_after_discounting():
    """As verl-agent subtracts it from its step returns: a penalty of step 1 does not reach step 0's return."""
    rewards, anchors = [[0.0, 0.0], [0.0, 0.0]], [["s", "t"], ["s", "t"]]
    got = gigpo.gigpo_advantages([0.0, 0.0], [0, 0], rewards, anchors, 0.5, 1.0, False, [[0.0, 0.4], [0.0, 0.0]])
    # scores [0, -0.4, 0, 0] (mean -0.1); step group s: returns [0, 0] -> 0; t: [-0.4, 0] -> -0.2, +0.2
    assert_rows(got, [[0.1, -0.3 - 0.2], [0.1, 0.1 + 0.2]])


def test_gigpo_advantages_reject_misshapen_input():
    with pytest.raises(ValueError, match="differ in length"):
        gigpo.gigpo_advantages([1.0], [0, 0], [[1.0]], [["s"]], 0.95, 1.0, True)
    with pytest.raises(ValueError, match="one entry per step"):
        gigpo.gigpo_advantages([1.0], [0], [[1.0, 0.0]], [["s"]], 0.95, 1.0, True)


# =============================================================================================
# anchors on real games
# =============================================================================================
def scripted_rollout(game_file, protocol, replies, sample_logprobs=None):
    """One group of len(replies) branches; branch b replies replies[b][k] at turn k (every branch plays every turn,
    the last turn included). sample_logprobs(prompt, tokens) gives the completion's logprobs (else 0)."""

    def play(prompts, max_new_tokens):
        assert len(prompts) == len(replies), "a branch stopped early"
        turn, play.turns = play.turns, play.turns + 1
        completions = []
        for prompt, branch in zip(prompts, replies):
            tokens = protocol.encode(branch[turn]) + [protocol.eos_token_id]
            logprobs = sample_logprobs(prompt, tokens) if sample_logprobs else [0.0] * len(tokens)
            completions.append(common.Completion(tokens, logprobs, branch[turn]))
        return completions

    play.turns = 0
    turns = len(replies[0])
    (group,) = common.rollout(
        [common.game_start(game_file, protocol)],
        len(replies),
        play,
        protocol,
        horizon=turns,
        max_turns=turns,
        max_turn_tokens=64,
        max_trajectory_tokens=1 << 20,
    )
    return group


@pytest.fixture(scope="module")
def detours(all_games, protocol):
    """A look_at game: branch 0 goes to X then to Y, branch 1 straight to Y (one state, two paths), branch 2 sends an
    inadmissible command at the start and branch 3 one at Y (both answered "Nothing happens.", from two states)."""
    game = next(g for g in all_games if "look_at_obj" in g and "/train/" in g)
    goto = [a for a in common.game_start(game, protocol).admissible if a.startswith("go to")]
    x, y = goto[0], goto[1]
    call = common.tool_call
    replies = [
        [call(x), call(y), call("look"), call("inventory")],
        [call(y), call("look"), call("inventory"), call("look")],
        [call("fly away"), call("look"), call("look"), call("look")],
        [call(y), call("fly away"), call("look"), call("look")],
    ]
    return game, x, y, scripted_rollout(game, protocol, replies)


def test_exact_state_anchors_join_paths_and_split_equal_text(detours):
    _, x, y, group = detours
    state = [gigpo.step_anchors(traj, "state") for traj in group]
    text = [gigpo.step_anchors(traj, "observation") for traj in group]
    # at Y after X -> Y (branch 0, step 2) and after -> Y (branch 1, step 1): one state, one anchor
    assert state[0][2] == state[1][1] and state[0][2] != state[0][1] != state[0][0]
    assert text[0][2] == text[1][1] and text[0][2].startswith(f"You arrive at {y.removeprefix('go to ')}")
    # the start, reached again after an inadmissible command (branch 2, step 1), is the start state
    assert state[2][1] == state[2][0] == state[0][0]
    # "Nothing happens." at the start (branch 2, step 1) and at Y (branch 3, step 2): one text, two states
    assert text[2][1] == text[3][2] == "Nothing happens."
    assert state[2][1] != state[3][2] and state[3][2] == state[1][1]
    # a state anchor is the set of facts that hold, nothing else: it does not depend on the path (no not_* facts)
    assert all(not fact.is_negation for anchors in state for anchor in anchors for fact in anchor)


def test_step_group_metrics_count_aliasing_only_with_observation_anchors(detours):
    _, _, _, group = detours
    by_state = gigpo.step_groups(group, [gigpo.step_anchors(traj, "state") for traj in group])
    by_text = gigpo.step_groups(group, [gigpo.step_anchors(traj, "observation") for traj in group])
    assert {len({step.state for step in steps}) for steps in by_state.values()} == {1}
    assert any(len({step.state for step in steps}) > 1 for steps in by_text.values())  # "Nothing happens."
    metrics = gigpo.step_group_metrics(by_text, "observation")
    sizes = [len(steps) for steps in by_text.values()]
    assert metrics["gigpo/step_groups"] == len(by_text) and metrics["gigpo/step_group_size_mean"] == 16 / len(sizes)
    assert metrics["gigpo/singleton_step_share"] == sum(s == 1 for s in sizes) / 16
    aliased = sum(len({step.state for step in steps}) > 1 for steps in by_text.values())
    assert metrics["gigpo/aliased_group_share"] == aliased / len(sizes) > 0
    assert "gigpo/aliased_group_share" not in gigpo.step_group_metrics(by_state, "state")


def test_observation_anchors_group_steps_as_verl_agent(detours):
    """verl-agent's anchor of a step is the env's text observation before it (the reset text, then each step's
    feedback), clustered by identity within the episode group. Replayed here on a fresh env, independently of the
    rollout: the same step groups, and the same advantages as the reference computation on those anchors. The exact
    states come back equal from the fresh engine too (they are facts, not the planner's in-process state ids)."""
    game, _, _, group = detours
    env_text, env_states = [], []
    env = common.AlfredEnv(game)
    try:
        for traj in group:
            seen = [env.reset()]
            for step in traj.steps:
                seen.append(env.step(step.action))
            env_text.append([turn.observation for turn in seen[: len(traj.steps)]])
            env_states.append([turn.state for turn in seen[: len(traj.steps)]])
    finally:
        env.close()
    assert env_text == [gigpo.step_anchors(traj, "observation") for traj in group]
    assert env_states == [gigpo.step_anchors(traj, "state") for traj in group]

    def partition(groups):
        return sorted(sorted(members) for members in groups.values())

    rows = {}
    for i, traj in enumerate(group):
        for t, text in enumerate(env_text[i]):
            rows.setdefault(text, []).append((i, t))
    index = {id(step): (i, t) for i, traj in enumerate(group) for t, step in enumerate(traj.steps)}
    by_text = gigpo.step_groups(group, [gigpo.step_anchors(traj, "observation") for traj in group])
    ours = {key: [index[id(step)] for step in steps] for key, steps in by_text.items()}
    assert partition(ours) == partition(rows)

    scores, rewards = [traj.reward for traj in group], [[s.reward for s in traj.steps] for traj in group]
    scores[0], rewards[0][-1] = 1.0, 1.0  # as if branch 0 had won on its last step: both terms nonzero
    ids = [traj.group for traj in group]
    got = gigpo.gigpo_advantages(scores, ids, rewards, env_text, 0.95, 1.0, True)
    assert_rows(got, reference_advantages(scores, ids, rewards, env_text, 0.95, 1.0, True))
    assert any(a != 0 for a in got[1])


# =============================================================================================
# one update on the tiny model, main() end to end
# =============================================================================================
def small_args(games_root, tiny_model_dir, output_dir, **overrides):
    """Tiny budgets: 2 games x 2 episodes of at most 2 turns, short replies."""
    settings = dict(
        model=str(tiny_model_dir),
        data_root=str(games_root),
        output_dir=str(output_dir),
        seed=0,
        num_updates=2,
        groups_per_update=2,
        group_size=2,
        max_turns=2,
        max_turn_tokens=24,
        max_trajectory_tokens=4096,
        micro_batch_tokens=8192,
        sample_batch_size=16,
        lora_rank=4,
        lora_alpha=8,
        save_every=0,
        eval_every=0,
        eval_games=1,
    )
    return gigpo.Args(**{**settings, **overrides})


@pytest.mark.slow
def test_update_raises_the_winning_branch_and_lowers_the_penalised_one(games_root, tiny_model_dir, tmp_path):
    """One group of three branches on a look_at game, the replies scripted with the tiny policy's own logprobs (the
    ratios start at 1): the walkthrough (won), the walkthrough with a wrong last step, and no tool call at all
    (penalised), with the k3 KL loss on. After one gigpo_update the won branch's replies are likelier and the
    penalised ones less likely; a second update measures a KL to the base model."""
    accelerator = harness.make_accelerator()
    settings = dict(task_types=("look_at_obj_in_light",), groups_per_update=1, group_size=3)
    game = harness.training_games(small_args(games_root, tiny_model_dir, tmp_path, **settings), accelerator)[0]
    walkthrough = common.load_walkthrough(game)
    turns = len(walkthrough)
    args = small_args(
        games_root,
        tiny_model_dir,
        tmp_path,
        **settings,
        max_turns=turns,
        learning_rate=1e-2,
        invalid_action_penalty=0.1,
        kl_loss_coef=0.01,
    )
    set_seed(0)
    rt = gigpo.Runtime(args, accelerator)
    assert rt.games[0] == game  # the game rt.next_game_start() starts next
    replies = [
        [common.tool_call(a) for a in walkthrough],
        [common.tool_call(a) for a in walkthrough[:-1]] + [common.tool_call("look")],
        ["I will not call a tool."] * turns,
    ]

    def sample(prompts, max_new_tokens):
        turn, sample.turns = sample.turns, sample.turns + 1
        completions = []
        for branch, (prompt, texts) in enumerate(zip(prompts, replies)):
            tokens = rt.protocol.encode(texts[turn]) + [rt.protocol.eos_token_id]
            (logprobs,) = training.sequence_logprobs(
                rt.model, rt.accelerator, [prompt + tokens], 1.0, rt.tokenizer.pad_token_id, 8192
            )
            sample.logprob[branch] += sum(logprobs[len(prompt) :])
            completions.append(common.Completion(tokens, logprobs[len(prompt) :], texts[turn]))
        return completions

    sample.turns, sample.logprob = 0, [0.0] * 3
    rt.sample_fn = sample
    metrics, samples = gigpo.gigpo_update(rt)
    before = sample.logprob
    assert metrics["rollout/success_rate"] == pytest.approx(1 / 3) and metrics["train/grad_norm"] > 0
    assert metrics["train/ratio_max"] == pytest.approx(1.0, abs=1e-4)  # the scripted logprobs are the policy's
    assert metrics["train/kl_k3"] == pytest.approx(0.0, abs=1e-9)  # the adapter starts as the identity
    won, wrong_end = samples
    assert won["won"] and all(a > 0 for a in won["step_advantages"])
    # branches 0 and 1 share every state; the penalised branch never leaves the start
    assert won["step_group_sizes"] == [2 + turns] + [2] * (turns - 1) and metrics["gigpo/singleton_step_share"] == 0
    assert wrong_end["step_advantages"][-1] < 0 and wrong_end["step_penalties"] == [0.0] * turns

    sample.turns, sample.logprob = 0, [0.0] * 3
    rt.play([common.game_start(game, rt.protocol)], 3, horizon=turns, max_turns=turns)
    after = sample.logprob
    assert after[0] > before[0] + 1e-3 and after[2] < before[2] - 1e-3
    sample.turns = 0  # a second update: the policy has left the base model, the KL loss term says by how much
    assert gigpo.gigpo_update(rt)[0]["train/kl_k3"] > 0


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_smoke_observation_anchors_then_resume(games_root, tiny_model_dir, tmp_path):
    args = small_args(
        games_root, tiny_model_dir, tmp_path, anchor="observation", invalid_action_penalty=0.01, eval_every=2
    )
    run_dir = gigpo.main(args)
    start, *rows = read_rows(run_dir / "metrics.jsonl")
    assert start["update"] == 0 and "eval/valid_seen/success_rate" in start  # the start's evaluation
    assert [r["update"] for r in rows] == [1, 2] and {r["anchor"] for r in rows} == {"observation"}
    for row in rows:
        assert row["train/tokens"] == row["rollout/generated_tokens"] > 0
        for key in ("gigpo/step_groups", "gigpo/step_group_size_mean", "gigpo/singleton_step_share"):
            assert key in row, key
        assert 0 <= row["gigpo/aliased_group_share"] <= 1
    assert "eval/valid_seen/success_rate" in rows[1] and "eval/valid_unseen/invalid_action_rate" in rows[1]
    samples = read_rows(run_dir / "samples.jsonl")
    assert samples and all(len(s["step_group_sizes"]) == len(s["step_advantages"]) for s in samples)
    # the random tiny model never writes a tool call: every step penalised alike, so every advantage is 0
    assert all(set(s["step_penalties"]) == {0.01} and set(s["step_advantages"]) == {0.0} for s in samples)

    with pytest.raises(harness.StartupError, match=r"--anchor state \(the run: observation\)"):
        gigpo.main(gigpo.Args(**{**vars(args), "resume": "auto", "anchor": "state"}))
    resumed = gigpo.main(gigpo.Args(**{**vars(args), "num_updates": 3, "resume": "auto"}))
    assert resumed == run_dir and [r["update"] for r in read_rows(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]
    state = json.loads((run_dir / "checkpoints" / "update_000003" / "trainer_state.json").read_text())
    assert state["algorithm"] == "gigpo" and state["update"] == 3 and state["anchor"] == "observation"


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(group_size=1), "--group-size"),
        (dict(gamma=1.5), "--gamma"),
        (dict(step_advantage_w=-1.0), "--step-advantage-w"),
        (dict(invalid_action_penalty=-0.1), "--invalid-action-penalty"),
        (dict(anchor="text"), "--anchor"),
        (dict(kl_loss_coef=-1.0), "--kl-loss-coef"),
        (dict(dual_clip_c=1.0), "--dual-clip-c"),
        (dict(kl_loss_coef=0.01, lora_rank=0), "--kl-loss-coef needs --lora-rank"),
    ],
)
def test_invalid_flags_fail_at_start_naming_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        gigpo.main(gigpo.Args(model="/nonexistent", **overrides))  # fails before any model loads
