"""ADCA-GRPO: the decouple math against hand-computed cases, the judgment parser, the labeller against a
real local OpenAI-compatible HTTP server (through the real `openai` client), the self labeller on the
tiny model, one PPO-clip update, and smoke runs of main() with each backend."""

import json
import math
import time

import pytest
import torch
from accelerate.utils import set_seed
from chat_server import ScriptedEndpoint

import adca_grpo
import common
import harness
import training

SECRET = "sk-adca-test-SECRET-0123456789"
DECOUPLE = dict(
    fix_base=0.2, alpha=0.1, orm_distribution="last_step", equal_trajectory_weight=True, length_normalization=False
)


def approx(rows, expected, tol=1e-9):
    assert len(rows) == len(expected)
    for row, exp in zip(rows, expected):
        assert row == pytest.approx(exp, abs=tol)


# =============================================================================================
# decouple math
# =============================================================================================
# Group 0: A = [GOOD, BAD] won, B = [BAD] lost. Group 1: C = [GOOD] lost, alone in its group.
ORM, FLAGS, GROUPS = [1.0, 0.0, 0.0], [[True, False], [False], [True]], [0, 0, 1]


def test_decouple_equal_trajectory_weight_last_step():
    # raw: A = [.2, -.2], B = [-.2]; mu = mean of trajectory means = (0 - .2) / 2 = -.1
    # var = mean over trajectories of mean (r - mu)^2 = ((.09 + .01) / 2 + .01) / 2 = .03
    sd = math.sqrt(0.03 + 1e-8)
    z_a, z_b = [0.3 / sd, -0.1 / sd], [-0.1 / sd]
    # outcomes 1, 0: mean .5, std .5 -> +1, -1; group 1 (one trajectory, std 0): 0 - 0 = 0; its z is 0 (all equal)
    expected = [[0.1 * z_a[0], 0.1 * z_a[1] + 1.0], [0.1 * z_b[0] - 1.0], [0.0]]
    approx(adca_grpo.decouple_step_rewards(ORM, FLAGS, GROUPS, **DECOUPLE), expected, 1e-6)


def test_decouple_flattened_all_steps_length_normalised():
    # flattened group 0 steps [.2, -.2, -.2]: mean -1/15, population var 24/675
    mu, sd = -1 / 15, math.sqrt(24 / 675)
    z = [(0.2 - mu) / sd, (-0.2 - mu) / sd, (-0.2 - mu) / sd]
    expected = [[(0.1 * z[0] + 1) / math.sqrt(2), (0.1 * z[1] + 1) / math.sqrt(2)], [0.1 * z[2] - 1], [0.0]]
    config = dict(DECOUPLE, orm_distribution="all_steps", equal_trajectory_weight=False, length_normalization=True)
    approx(adca_grpo.decouple_step_rewards(ORM, FLAGS, GROUPS, **config), expected, 1e-6)


def test_decouple_degenerate_groups():
    # all won, mixed labels: outcome term 0 everywhere, labels alone shift credit between steps
    rewards = adca_grpo.decouple_step_rewards([1.0, 1.0], [[True, True], [False, False]], [0, 0], **DECOUPLE)
    sd = math.sqrt(0.04 + 1e-8)  # mu 0, every step .2 away from it
    approx(rewards, [[0.1 * 0.2 / sd] * 2, [-0.1 * 0.2 / sd] * 2], 1e-6)
    # all GOOD, mixed outcomes: the labels carry nothing (z = 0), only the outcome remains
    for equal in (True, False):
        rewards = adca_grpo.decouple_step_rewards(
            [1.0, 0.0, 0.0, 1.0],
            [[True] * 3, [True], [True] * 2, [True]],
            [0] * 4,
            **dict(DECOUPLE, equal_trajectory_weight=equal),
        )
        approx(rewards, [[0.0, 0.0, 1.0], [-1.0], [0.0, -1.0], [1.0]])
    # everything identical: exactly zero (the formula alone would leave rounding noise / sqrt(eps))
    assert adca_grpo.decouple_step_rewards([0.0] * 3, [[False] * 3] * 3, [7] * 3, **DECOUPLE) == [[0.0] * 3] * 3
    # a trajectory without steps gets no rewards and does not disturb its group
    rewards = adca_grpo.decouple_step_rewards([1.0, 0.0, 0.0], [[True], [], [False]], [0, 0, 0], **DECOUPLE)
    assert rewards[1] == []


def test_decouple_rejects_bad_input():
    with pytest.raises(ValueError, match="length"):
        adca_grpo.decouple_step_rewards([1.0], [[True], [False]], [0, 0], **DECOUPLE)
    with pytest.raises(ValueError, match="orm_distribution"):
        adca_grpo.decouple_step_rewards([1.0], [[True]], [0], **dict(DECOUPLE, orm_distribution="first_step"))


def verl_grpo(orm, groups):
    """veRL's GRPO outcome advantage, computed independently with torch: unbiased std, +1e-6."""
    out = [0.0] * len(orm)
    for g in set(groups):
        idxs = [i for i, x in enumerate(groups) if x == g]
        scores = torch.tensor([orm[i] for i in idxs], dtype=torch.float64)
        mean, std = (scores.mean(), scores.std()) if len(idxs) > 1 else (0.0, 1.0)
        for i, value in zip(idxs, ((scores - mean) / (std + 1e-6)).tolist()):
            out[i] = value
    return out


def test_plain_grpo_for_every_flag_combination():
    import itertools
    import random

    rng = random.Random(0)
    orm = [float(rng.random() < 0.4) for _ in range(25)]
    groups = [min(i // 6, 3) for i in range(24)] + [4]  # a group of one at the end
    flags = [[rng.random() < 0.5 for _ in range(rng.randint(1, 7))] for _ in range(25)]
    reference = verl_grpo(orm, groups)
    assert reference[0] != 0 and reference[24] == pytest.approx(orm[24] / (1 + 1e-6))
    attributed = 0
    for distribution, length_norm, equal, schedule in itertools.product(
        adca_grpo.ORM_DISTRIBUTIONS, (False, True), (False, True), ("constant", "cosine")
    ):
        for attribution, alpha, metrics_only in itertools.product((False, True), (0.0, 0.1), (False, True)):
            args = adca_grpo.Args(
                attribution=attribution,
                alpha=alpha,
                alpha_schedule=schedule,
                prm_steps=2,
                prm_metrics_only=metrics_only,
                orm_distribution=distribution,
                length_normalization=length_norm,
                equal_trajectory_weight=equal,
            )
            for update in (1, 2, 3):
                decouple = adca_grpo.trained_decouple(args, update)
                advantages = adca_grpo.step_advantages(orm, flags, groups, decouple)
                if (
                    attribution
                    and alpha > 0
                    and update <= 2
                    and not metrics_only
                    and (schedule, update) != ("cosine", 2)
                ):
                    assert decouple is not None  # labels shape this update (cosine reaches alpha-min 0 at update 2)
                    attributed += 1
                    continue
                assert decouple is None
                for row, expected, steps in zip(advantages, reference, flags):
                    assert row == pytest.approx([expected] * len(steps), abs=1e-12)
    assert attributed == 3 * 2 * 2 * (2 + 1)


def test_only_prm_leaves_out_the_outcome():
    rewards = adca_grpo.decouple_step_rewards(ORM, FLAGS, GROUPS, **dict(DECOUPLE, orm_distribution="only_prm"))
    sd = math.sqrt(0.03 + 1e-8)
    approx(rewards, [[0.1 * 0.3 / sd, -0.1 * 0.1 / sd], [-0.1 * 0.1 / sd], [0.0]], 1e-6)


def test_suffix_sum_and_broadcast():
    assert adca_grpo.suffix_sum([[1.0, 2.0, 3.0], [], [-1.0]]) == [[6.0, 5.0, 3.0], [], [-1.0]]
    step_ids = torch.tensor([[-1, -1, 0, 0, -1, 1, 1, -1], [-1, 0, 0, -1, -1, -1, -1, -1], [-1] * 8])
    out = training.broadcast_to_tokens([[2.0, 3.0], [5.0], []], step_ids)
    assert out.dtype == torch.float32 and out.shape == (3, 8)
    assert out.tolist() == [[0, 0, 2, 2, 0, 3, 3, 0], [0, 5, 5, 0, 0, 0, 0, 0], [0] * 8]
    with pytest.raises(ValueError, match="beyond"):
        training.broadcast_to_tokens([[1.0]], torch.tensor([[0, 1]]))


def test_health_metrics():
    m = adca_grpo.decouple_health_metrics(ORM, FLAGS, GROUPS, **DECOUPLE)
    assert m["prm/decouple/out_mean"] == pytest.approx(0.0)  # outcome advantages +1, -1, 0
    assert m["prm/decouple/out_std"] == pytest.approx(math.sqrt(2 / 3))
    assert m["prm/decouple/pos_traj_prm_good_majority_rate"] == 0.0  # A: 1 GOOD of 2 is no majority
    assert m["prm/decouple/neg_traj_prm_bad_majority_rate"] == 0.5  # B all BAD, C all GOOD
    assert m["prm/decouple/sum_step_reward_sign_agree"] == 1.0  # C sums to 0: not > 0, like its outcome
    assert 0.0 < m["prm/decouple/outcome_share_last_mean"] < 1.0
    sd = math.sqrt(0.03 + 1e-8)
    assert m["prm/decouple/alpha_effective"] == pytest.approx(
        (0.1 * 0.4 / sd + 0.1 * 0.1 / sd + 0.0 / 1e-12) / 3, rel=1e-6
    )


def test_alpha_schedule_decays_over_the_labelled_updates():
    args = adca_grpo.Args(alpha=0.3, alpha_min=0.1, alpha_schedule="cosine", num_updates=200, prm_steps=11)
    assert adca_grpo.alpha_at(0, args) == pytest.approx(0.3)
    assert adca_grpo.alpha_at(5, args) == pytest.approx(0.2)
    assert adca_grpo.alpha_at(10, args) == pytest.approx(0.1)
    assert adca_grpo.alpha_at(50, args) == pytest.approx(0.1)
    assert adca_grpo.alpha_at(3, adca_grpo.Args(alpha=0.3)) == 0.3
    assert adca_grpo.alpha_at(0, adca_grpo.Args(attribution=False)) == 0.0


# =============================================================================================
# judgment parser
# =============================================================================================
def test_parse_judgments():
    parse = adca_grpo.parse_judgments
    reply = (
        "Step 1 Analysis: went to the fridge.\nStep 1 Judgment: GOOD\nStep 2 Analysis: looked.\nStep 2 Judgment: BAD\n"
    )
    assert parse(reply, 2) == [True, False]
    assert parse("step 2 judgment: good\nSTEP 1 JUDGEMENT: bad", 2) == [False, True]  # any case, either spelling
    assert parse("**Step 1 Judgment:** **GOOD**\n### Step 2 Judgment: BAD", 2) == [True, False]  # markdown
    assert parse("Step 1 Judgment: GOOD\nStep 1 Judgment: BAD", 1) == [False]  # last judgment wins
    assert parse("Step 1 Judgment: GOOD\nStep 7 Judgment: BAD\nStep 0 Judgment: BAD", 1) == [
        True
    ]  # out of range ignored
    assert parse("Step 1 Judgment: GOOD", 2) is None  # step 2 missing
    assert parse("Step 1 Judgment: NEUTRAL", 1) is None
    assert parse("Step 1 Judgment: GOODNESS", 1) is None
    assert parse("GOOD BAD GOOD", 3) is None  # bare words are not judgments
    assert parse("Step " + "9" * 5000 + " Judgment: GOOD", 1) is None  # huge numbers do not raise
    assert parse(None, 1) is None and parse(b"Step 1 Judgment: GOOD", 1) is None and parse("x", -1) is None
    assert parse("", 0) == []


def test_label_prompt_shows_the_room_the_whole_replies_and_the_outcome():
    room = "You are in the middle of a room. You see a fridge 1 and a countertop 1.\n\nYour task is to: put a mug in fridge."
    reply = "I should look in the fridge first.\n" + common.tool_call("go to fridge 1")
    messages = adca_grpo.build_label_messages(room, [(reply, "You arrive."), ("look", "x" * 5000)], 1.0, 2000)
    system, user = messages[0]["content"], messages[1]["content"]
    assert messages[0]["role"] == "system" and "own merit" in system and "never used" in system
    assert room in user and f"Step 1\nAgent: {reply}\nGame: You arrive." in user and "Step 2\n" in user
    assert "Step 3" not in user and "x" * 2000 + " ...[cut]" in user and "x" * 2001 not in user
    assert "OUTCOME: +1.0000 (positive)" in user
    assert adca_grpo.outcome_score(1.0) == 1.0 and adca_grpo.outcome_score(0.0) == -1.0


# =============================================================================================
# the api labeller against a real local OpenAI-compatible server
# =============================================================================================
def judgments(n, good=lambda j: j % 2 == 0):
    return "\n".join(
        f"Step {j + 1} Analysis: fine.\nStep {j + 1} Judgment: {'GOOD' if good(j) else 'BAD'}" for j in range(n)
    )


RATE_LIMITED = {
    "error": {"message": "Rate limit reached for requests", "type": "requests", "code": "rate_limit_exceeded"}
}
SERVER_ERROR = {"error": {"message": "internal error", "type": "server_error"}}
REFUSED = {"error": {"code": "data_inspection_failed", "message": "Input data may contain inappropriate content."}}


def api_args(url, **overrides):
    config = dict(
        labeler_backend="api",
        labeler_base_url=url,
        labeler_api_key_env="ADCA_TEST_KEY",
        labeler_model="judge",
        labeler_concurrency=3,
        labeler_timeout_s=5.0,
        labeler_deadline_s=20.0,
        labeler_rate_limit_backoff_s=0.2,
        labeler_error_backoff_s=0.1,
        labeler_max_new_tokens=256,
    )
    return adca_grpo.Args(**{**config, **overrides})


def request(name, num_steps=2):
    return adca_grpo.LabelRequest(
        name, [{"role": "system", "content": "judge"}, {"role": "user", "content": name}], num_steps
    )


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv("ADCA_TEST_KEY", SECRET)


def test_api_labeler_bounded_concurrency_and_retries(api_key):
    def behave(content, attempt):
        if content.startswith("limited") and attempt <= 2:
            return 429, RATE_LIMITED, 0.0
        if content.startswith("broken") and attempt <= 2:
            return 500, SERVER_ERROR, 0.0
        return 200, judgments(2), 0.15

    names = [f"plain{i}" for i in range(9)] + ["limited", "broken"]
    with ScriptedEndpoint(behave) as server:
        replies = adca_grpo.ApiLabeler(api_args(server.url))([request(n) for n in names])
    assert all(adca_grpo.parse_judgments(r.text, 2) == [True, False] for r in replies)
    assert server.max_in_flight == 3  # bounded, and the bound is used
    assert server.auth_headers == {f"Bearer {SECRET}"}
    assert [r.attempts for r in replies[-2:]] == [3, 3]
    limited, broken = (server.attempt_times[n] for n in ("limited", "broken"))
    # 429: exponential from 0.2 s (x1.5, +0-25% jitter); other errors: linear 0.1 s x attempt. Waits are lower
    # bounds; the upper bounds only rule out a wrong policy, with seconds of slack for a loaded machine.
    assert 0.2 <= limited[1] - limited[0] < 2.0 and 0.3 <= limited[2] - limited[1] < 2.0
    assert 0.1 <= broken[1] - broken[0] < 2.0 and 0.2 <= broken[2] - broken[1] < 2.0


def test_api_labeler_refusals_timeouts_and_the_deadline(api_key):
    def behave(content, attempt):
        if content.startswith("refused"):
            return 400, REFUSED, 0.0
        if content.startswith("slow"):
            return 200, judgments(2), 30.0
        if content.startswith("mangled") and attempt == 1:
            return 200, b"<html>502 Bad Gateway</html>", 0.0
        return 200, judgments(2), 0.0

    with ScriptedEndpoint(behave) as server:
        args = api_args(server.url, labeler_timeout_s=0.3, labeler_deadline_s=1.5, labeler_error_backoff_s=0.05)
        start = time.monotonic()
        refused, slow, mangled, fine = adca_grpo.ApiLabeler(args)(
            [request(n) for n in ("refused", "slow", "mangled", "fine")]
        )
        elapsed = time.monotonic() - start
    assert refused.text is None and refused.attempts == 1 and "BadRequestError" in refused.error  # 400: not retried
    assert (
        slow.text is None and slow.attempts >= 2 and "deadline" in slow.error
    )  # per-request timeouts, then the deadline
    assert mangled.attempts == 2 and adca_grpo.parse_judgments(mangled.text, 2) == [
        True,
        False,
    ]  # a garbage body is retried
    assert fine.text is not None and fine.attempts == 1
    assert elapsed < 1.5 + 1.0  # a dead endpoint never stalls past the deadline


@pytest.mark.parametrize("status", adca_grpo.PERMANENT_HTTP_ERRORS)
def test_api_labeler_does_not_retry_permanent_errors(api_key, status):
    with ScriptedEndpoint(lambda content, attempt: (status, {"error": {"message": "no"}}, 0.0)) as server:
        start = time.monotonic()
        (reply,) = adca_grpo.ApiLabeler(api_args(server.url, labeler_error_backoff_s=5.0))([request("x")])
        assert reply.text is None and reply.attempts == 1 and len(server.attempt_times["x"]) == 1
        assert time.monotonic() - start < 5.0  # no wait either


def test_api_labeler_does_not_sleep_after_the_last_attempt(api_key):
    with ScriptedEndpoint(lambda content, attempt: (429, RATE_LIMITED, 0.0)) as server:
        args = api_args(server.url, labeler_max_attempts=2, labeler_rate_limit_backoff_s=1.0)
        start = time.monotonic()
        (reply,) = adca_grpo.ApiLabeler(args)([request("x")])
        elapsed = time.monotonic() - start
    # one wait of 1-1.25 s between the two attempts; a wait after the last would add at least 1.5 s more
    assert reply.attempts == 2 and 1.0 <= elapsed < 1.0 * 1.25 + 1.5


def test_circuit_opens_on_connection_failures_and_ends_the_wait(api_key):
    with ScriptedEndpoint(lambda content, attempt: (200, None, 0.0)) as server:  # every request: connection dropped
        labeler = adca_grpo.ApiLabeler(
            api_args(server.url, labeler_circuit_failures=3, labeler_error_backoff_s=30.0, labeler_deadline_s=60.0)
        )
        start = time.monotonic()
        replies = labeler([request(f"r{i}") for i in range(6)])
        elapsed = time.monotonic() - start
    assert labeler.circuit_opened and all(r.text is None for r in replies)
    assert all(r.error.startswith("circuit open") for r in replies)
    # sent: the 3 failures that opened it, plus at most concurrency - 1 started as the first failures freed a slot
    sent = sum(len(times) for times in server.attempt_times.values())
    assert 3 <= sent <= 3 + 2 and sum(r.attempts for r in replies) == sent and max(r.attempts for r in replies) == 1
    assert elapsed < 10.0  # not one 30 s backoff was waited out


def test_endpoint_check_at_start(api_key):
    def behave(content, attempt):
        return (401, {"error": {"message": "bad key"}}, 0.0) if content == "Reply with OK." else (200, "x", 0.0)

    with ScriptedEndpoint(lambda content, attempt: (200, "OK", 0.0)) as server:
        adca_grpo.ApiLabeler(api_args(server.url)).check_endpoint()  # serves judge, answers: fine
        closed_url = server.url
    with pytest.raises(ValueError, match="--labeler-base-url .* cannot reach"):
        adca_grpo.ApiLabeler(api_args(closed_url)).check_endpoint()
    with ScriptedEndpoint(lambda content, attempt: (200, "OK", 0.0), models=("other-model",)) as server:
        with pytest.raises(ValueError, match=r"--labeler-model judge is not served .*other-model"):
            adca_grpo.ApiLabeler(api_args(server.url)).check_endpoint()
    with ScriptedEndpoint(behave, models=None) as server:  # no /models route: the test request decides
        with pytest.raises(ValueError, match="one-token test request .* failed .AuthenticationError"):
            adca_grpo.ApiLabeler(api_args(server.url)).check_endpoint()


def test_api_labeler_needs_the_key_variable(monkeypatch):
    monkeypatch.delenv("ADCA_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="--labeler-api-key-env"):
        adca_grpo.ApiLabeler(api_args("http://127.0.0.1:9/v1"))


# =============================================================================================
# labelling real trajectories
# =============================================================================================
@pytest.fixture(scope="module")
def look_trajectories(all_games, protocol):
    """Four real 2-step trajectories (2 games x 2 branches) of an agent that only looks around."""

    def look(prompts, max_new_tokens):
        tokens = protocol.encode(common.tool_call("look")) + [protocol.eos_token_id]
        return [common.Completion(tokens, [0.0] * len(tokens), common.tool_call("look")) for _ in prompts]

    starts = [common.game_start(game, protocol) for game in all_games[:2]]
    groups = common.rollout(
        starts, 2, look, protocol, horizon=2, max_turns=2, max_turn_tokens=48, max_trajectory_tokens=4096
    )
    return [traj for group in groups for traj in group]


@pytest.mark.slow
def test_label_trajectories_through_the_api(api_key, look_trajectories, tmp_path):
    room_of = [traj.start.observation.strip() for traj in look_trajectories]  # 2 games x 2 branches
    assert room_of[0] == room_of[1] != room_of[3]

    def behave(content, attempt):
        lost = "OUTCOME: -1.0000 (negative)" in content
        if lost and room_of[1] in content:
            return 500, SERVER_ERROR, 0.0
        if lost and room_of[3] in content:
            return 200, "I think the agent did fine overall.", 0.0  # no judgments: unparsable
        return 200, judgments(2), 0.0

    advantages, orm = [0.8, -0.8, 0.0, -0.5], [1.0, 0.0, 1.0, 0.0]
    with ScriptedEndpoint(behave) as server:
        args = api_args(server.url, labeler_max_attempts=2, labeler_error_backoff_s=0.05, labeler_log_dir=str(tmp_path))
        flags, metrics = adca_grpo.label_trajectories(
            look_trajectories,
            advantages,
            orm,
            adca_grpo.ApiLabeler(args),
            args,
            update=3,
            log_file=tmp_path / "labels.jsonl",
        )
    # parsed; failed -> uniform by outcome (lost); skipped (|advantage| < 1e-8) -> uniform (won); unparsable -> lost
    assert flags == [[True, False], [False, False], [True, True], [False, False]]
    assert (
        metrics["prm/label_requests"] == 3 and metrics["prm/label_failures"] == 1 and metrics["prm/parse_failures"] == 1
    )
    assert metrics["prm/skipped"] == 1 and metrics["prm/good_rate"] == 0.5 and metrics["prm/circuit_open"] == 0
    assert metrics["prm/pos_traj_good_rate"] == 0.5 and metrics["prm/neg_traj_bad_rate"] == 0.0  # parsed labels only
    assert metrics["prm/latency_p95"] >= metrics["prm/latency_p50"]
    records = [json.loads(line) for line in (tmp_path / "labels.jsonl").read_text().splitlines()]
    assert len(records) == 3 and {r["update"] for r in records} == {3} and records[0]["model"] == "judge"
    assert {"trajectory_id", "messages", "reply", "flags", "latency_s", "error"} <= set(records[0])
    user = records[0]["messages"][1]["content"]
    assert records[0]["flags"] == [True, False] and f"Step 2\nAgent: {common.tool_call('look')}" in user
    assert room_of[0] in user and "OUTCOME: +1.0000 (positive)" in user
    assert "OUTCOME: -1.0000 (negative)" in records[1]["messages"][1]["content"]
    assert records[1]["reply"] is None and "InternalServerError" in records[1]["error"]
    for path in tmp_path.rglob("*"):
        assert SECRET not in path.read_text()


def test_skip_all_neg(look_trajectories):
    asked = []

    def labeler(requests):
        asked.extend(requests)
        return [adca_grpo.LabelReply(judgments(r.num_steps, good=lambda j: True), None, 0.01, 1) for r in requests]

    labeler.model_name = "scripted"
    args = adca_grpo.Args(skip_type="skip_all_neg")
    flags, metrics = adca_grpo.label_trajectories(
        look_trajectories, [0.5, -0.5, 0.0, -0.5], [1.0, 0.0, 1.0, 0.0], labeler, args, update=0
    )
    assert len(asked) == 2 and metrics["prm/skipped"] == 2  # the two lost trajectories were not asked about
    assert flags == [[True, True], [False, False], [True, True], [False, False]]


# =============================================================================================
# the model side: self labeller, one PPO-clip update, main() end to end (tiny model, CPU)
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
        skip_type="none",
        labeler_max_new_tokens=24,
    )
    return adca_grpo.Args(**{**settings, **overrides})


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def runtime(games_root, tiny_model_dir, tmp_path):
    def build(**overrides):
        args = small_args(games_root, tiny_model_dir, tmp_path, **overrides)
        set_seed(args.seed)
        return adca_grpo.Runtime(args, harness.make_accelerator())

    return build


@pytest.mark.slow
def test_self_labeler_on_the_tiny_model(runtime, look_trajectories):
    rt = runtime(labeler_backend="self")
    assert isinstance(rt.labeler, adca_grpo.PolicyLabeler)
    flags, metrics = adca_grpo.label_trajectories(
        look_trajectories, [0.5, -0.5, 0.5, -0.5], [1.0, 0.0, 1.0, 0.0], rt.labeler, rt.args, 1
    )
    assert metrics["prm/label_requests"] == 4 and metrics["prm/label_failures"] == 0 and metrics["prm/latency_p50"] > 0
    # a random tiny model does not write judgments: every reply is counted and falls back to uniform flags
    assert metrics["prm/parse_failures"] == 4 and flags == [[True, True], [False, False]] * 2
    assert runtime(attribution=False).labeler is None and runtime(alpha=0.0).labeler is None


@pytest.mark.slow
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_update_moves_logprob_with_the_advantage_sign(runtime, sign):
    rt = runtime(learning_rate=1e-2)
    (group,) = common.rollout(
        [rt.next_game_start()],
        1,
        rt.sample_fn,
        rt.protocol,
        horizon=2,
        max_turns=2,
        max_turn_tokens=16,
        max_trajectory_tokens=4096,
    )
    tokens, old_logprobs, step_ids = group[0].sequence()
    advantages = training.broadcast_to_tokens([[sign] * len(group[0].steps)], torch.tensor([step_ids]))[0].tolist()
    mask = [float(k >= 0) for k in step_ids]
    datum = training.Datum(tokens, old_logprobs, advantages, mask)

    def generated_logprob():
        (logprobs,) = training.sequence_logprobs(
            rt.model, rt.accelerator, [tokens], rt.args.temperature, rt.tokenizer.pad_token_id, 8192
        )
        return sum(lp for lp, m in zip(logprobs, mask) if m)

    before = generated_logprob()
    assert before == pytest.approx(sum(old_logprobs), abs=1e-3)  # sampling logprobs = teacher-forced ones
    metrics = training.train_step(rt, [datum], training.ppo_clip_loss)
    assert (
        metrics["train/tokens"] == sum(mask)
        and metrics["train/clip_frac"] == 0
        and metrics["train/nonfinite_skipped"] == 0
    )
    assert (generated_logprob() - before) * sign > 1e-4


def loss_and_grad(logprobs, old, advantages, ref=None, **config):
    logprobs = torch.tensor([logprobs], dtype=torch.float64, requires_grad=True)
    batch = {
        "old_logprobs": torch.tensor([old], dtype=torch.float64),
        "advantages": torch.tensor([advantages], dtype=torch.float64),
        "mask": torch.ones(1, len(old), dtype=torch.float64),
    }
    if ref is not None:
        batch["ref_logprobs"] = torch.tensor([ref], dtype=torch.float64)
    loss, stats = training.ppo_clip_loss(logprobs, batch, float(len(old)), **config)
    loss.backward()
    return loss.item(), logprobs.grad[0].tolist(), stats


def test_policy_loss_clip_higher_and_dual_clip():
    up, down = math.log(1.25), math.log(0.5)  # ratios 1.25 and 0.5
    # A > 0, ratio 1.25: clipped at 1.2 (no gradient), but not with clip-higher 0.28
    assert loss_and_grad([up], [0.0], [1.0])[1] == [0.0]
    loss, grad, stats = loss_and_grad([up], [0.0], [1.0], clip_eps_high=0.28)
    assert loss == pytest.approx(-1.25) and grad[0] == pytest.approx(-1.25) and stats["clip_frac"] == 0
    # A < 0, ratio 0.5: clipped at 0.8
    loss, grad, stats = loss_and_grad([down], [0.0], [-1.0])
    assert loss == pytest.approx(0.8) and grad == [0.0] and stats["clip_frac"] == 1
    # A < 0, ratio e^3 = 20: PPO's loss is 20 |A|; dual clip caps it at 3 |A| and stops the gradient
    loss, grad, _ = loss_and_grad([3.0], [0.0], [-2.0])
    assert loss == pytest.approx(2 * math.exp(3)) and grad[0] == pytest.approx(2 * math.exp(3))
    loss, grad, stats = loss_and_grad([3.0], [0.0], [-2.0], dual_clip_c=3.0)
    assert loss == pytest.approx(6.0) and grad == [0.0] and stats["dual_clip_frac"] == 1
    # dual clip leaves positive advantages and small ratios alone
    assert loss_and_grad([3.0], [0.0], [2.0], dual_clip_c=3.0)[0] == pytest.approx(-2 * 1.2)
    assert loss_and_grad([0.1], [0.0], [-1.0], dual_clip_c=3.0)[0] == pytest.approx(math.exp(0.1))


@pytest.mark.parametrize("offset", [0.5, -0.5])
def test_kl_loss_term_pulls_toward_the_base_model(offset):
    # no advantage: the only gradient is the k3 KL's, and descending it moves logp toward the reference
    loss, grad, stats = loss_and_grad([-1.0 + offset], [-1.0 + offset], [0.0], ref=[-1.0], kl_loss_coef=0.5)
    k3 = math.exp(-offset) + offset - 1
    assert loss == pytest.approx(0.5 * k3) and stats["kl_k3"] == pytest.approx(k3)
    assert grad[0] * offset > 0  # positive gradient where logp > ref: a descent step lowers logp
    assert loss_and_grad([-1.0], [-1.0], [0.0], ref=[-1.0], kl_loss_coef=0.5)[1] == [0.0]


@pytest.mark.slow
def test_kl_to_the_base_model(runtime):
    rt = runtime(kl_beta=0.5, attribution=False)
    metrics, _ = adca_grpo.adca_update(rt, 1)
    assert metrics["train/kl"] == pytest.approx(0.0, abs=1e-5)  # a fresh LoRA adapter is the base model
    with torch.no_grad():  # move the adapter away from the base model
        for name, param in rt.accelerator.unwrap_model(rt.model).named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    metrics, _ = adca_grpo.adca_update(rt, 2)
    assert metrics["train/kl"] > 1e-3 and metrics["train/tokens"] == metrics["rollout/generated_tokens"]
    rt.args.kl_beta, rt.args.kl_loss_coef = 0.0, 0.001  # the loss form: k3 >= 0, > 0 away from the base model
    metrics, _ = adca_grpo.adca_update(rt, 3)
    assert metrics["train/kl_k3"] > 1e-4 and metrics["train/kl"] > 1e-3


@pytest.mark.slow
def test_ppo_epochs_and_mini_batches(runtime):
    rt = runtime(attribution=False, ppo_epochs=2, mini_batches=2, learning_rate=1e-2, kl_loss_coef=1.0)
    with torch.no_grad():  # away from the base model, so that the KL term moves the policy even with zero advantages
        for name, param in rt.accelerator.unwrap_model(rt.model).named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    metrics, _ = adca_grpo.adca_update(rt, 1)
    assert metrics["train/optimizer_steps"] == 4 and metrics["train/tokens"] == metrics["rollout/generated_tokens"]
    # the ratio starts at 1 (old logprobs = the policy's before the first step); later steps see the policy move
    assert metrics["train/ratio_max"] > 1.0 + 1e-4 and metrics["train/nonfinite_skipped"] == 0


def scripted_labeler(requests):
    """Labels like a judge that calls every odd step GOOD and every even one BAD."""
    return [adca_grpo.LabelReply(judgments(r.num_steps), None, 0.01, 1) for r in requests]


scripted_labeler.model_name = "scripted"


@pytest.mark.slow
@pytest.mark.parametrize("metrics_only", [False, True])
def test_labels_reach_the_trained_advantages_unless_metrics_only(runtime, metrics_only):
    rt = runtime(prm_metrics_only=metrics_only, labeler_backend="self")
    rt.labeler = scripted_labeler
    metrics, samples = adca_grpo.adca_update(rt, 1)
    assert metrics["prm/label_requests"] == 4 and metrics["prm/good_rate"] == 0.5  # labelled either way
    assert "prm/decouple/alpha_effective" in metrics and "prm/neg_traj_bad_rate" in metrics
    for sample in samples:
        assert sample["step_flags"] == [True, False][: len(sample["step_flags"])]
        distinct = len(set(sample["step_advantages"]))
        assert distinct == (1 if metrics_only or len(sample["step_flags"]) < 2 else len(sample["step_flags"]))


@pytest.mark.slow
def test_skip_small_adv_through_an_update(runtime):
    rt = runtime(skip_type="skip_small_adv", labeler_backend="self")
    asked = []
    rt.labeler = lambda requests: asked.extend(requests) or scripted_labeler(requests)
    rt.labeler.model_name = "scripted"
    metrics, _ = adca_grpo.adca_update(rt, 1)
    uniform_groups = metrics["rollout/groups_all_won"] + metrics["rollout/groups_all_lost"]
    assert metrics["prm/skipped"] == 2 * uniform_groups and len(asked) == 4 - 2 * uniform_groups
    assert metrics["prm/label_requests"] == len(asked) and metrics["train/tokens"] > 0


@pytest.mark.slow
def test_labeller_down_inside_an_update_then_back(runtime, api_key):
    healthy = {"now": True}

    def behave(content, attempt):
        if content == "Reply with OK.":  # the start-up check
            return 200, "OK", 0.0
        if healthy["now"]:
            return 200, judgments(int(content.split("STEPS (")[1].split(" ")[0])), 0.0
        return 200, None, 0.0  # connection dropped

    with ScriptedEndpoint(behave) as server:
        endpoint = {k: v for k, v in vars(api_args(server.url)).items() if k.startswith("labeler_")}
        rt = runtime(**{**endpoint, "labeler_circuit_failures": 2, "labeler_error_backoff_s": 30.0})
        healthy["now"] = False
        metrics, samples = adca_grpo.adca_update(rt, 1)
        assert metrics["prm/circuit_open"] == 1 and metrics["prm/label_failures"] == 4 and metrics["time/label"] < 10
        assert metrics["train/tokens"] == metrics["rollout/generated_tokens"]  # trained on the fallback labels
        assert all(len(set(s["step_flags"])) <= 1 for s in samples)
        healthy["now"] = True  # the next update tries again
        metrics, _ = adca_grpo.adca_update(rt, 2)
        assert metrics["prm/circuit_open"] == 0 and metrics["prm/label_failures"] == 0
        assert metrics["prm/label_requests"] == 4


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(group_size=1), "--group-size"),
        (dict(clip_eps=0.0), "--clip-eps"),
        (dict(dual_clip_c=1.0), "--dual-clip-c"),
        (dict(kl_loss_coef=-1.0), "--kl-loss-coef"),
        (dict(ppo_epochs=0), "--ppo-epochs"),
        (dict(mini_batches=0), "--mini-batches"),
        (dict(labeler_circuit_failures=0), "--labeler-circuit-failures"),
        (dict(alpha=-0.1), "--alpha"),
        (dict(alpha_schedule="cosine", alpha=0.1, alpha_min=0.2), "--alpha-min"),
        (dict(labeler_backend="api"), "--labeler-base-url"),
        (dict(labeler_concurrency=0), "--labeler-concurrency"),
        (dict(max_trajectory_tokens=24, max_turn_tokens=24), "--max-trajectory-tokens"),
        (dict(labeler_base_url="http://127.0.0.1:9/v1", labeler_api_key_env="ADCA_UNSET_KEY"), "--labeler-api-key-env"),
    ],
)
def test_invalid_flags_fail_at_start_naming_the_flag(overrides, flag, monkeypatch):
    monkeypatch.delenv("ADCA_UNSET_KEY", raising=False)
    with pytest.raises(ValueError, match=flag):
        adca_grpo.main(adca_grpo.Args(model="/nonexistent", **overrides))  # fails before any model loads


@pytest.mark.slow
def test_smoke_self_labeler(games_root, tiny_model_dir, tmp_path):
    run_dir = adca_grpo.main(
        small_args(
            games_root,
            tiny_model_dir,
            tmp_path,
            labeler_backend="self",
            eval_every=2,
            labeler_log_dir=str(tmp_path / "labels"),
        )
    )
    start, *rows = read_metrics(run_dir)
    assert start["update"] == 0 and "eval/train/success_rate" in start  # the start's evaluation, before update 1
    assert [r["update"] for r in rows] == [1, 2] and {r["labeler"] for r in rows} == {"self"}
    for row in rows:
        assert row["prm/label_requests"] == 4 and row["prm/label_failures"] == 0
        assert row["train/tokens"] == row["rollout/generated_tokens"]  # the labeller's replies are never trained on
        for key in (
            "prm/decouple/alpha_effective",
            "prm/decouple/outcome_share_last_mean",
            "prm/good_rate",
            "rollout/success_rate",
            "train/grad_norm",
            "time/label",
        ):
            assert key in row, key
    assert "eval/valid_seen/success_rate" in rows[1] and "eval/valid_unseen/invalid_action_rate" in rows[1]
    assert len((tmp_path / "labels" / "labels_rank0.jsonl").read_text().splitlines()) == 8
    assert (run_dir / "checkpoints" / "update_000002" / "adapter_model.safetensors").is_file()


def read_samples(run_dir):
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_smoke_api_labeler_prm_steps_then_resume(games_root, tiny_model_dir, tmp_path, api_key):
    def behave(content, attempt):
        if content == "Reply with OK.":  # the start-up check
            return 200, "OK", 0.0
        if attempt == 1 and "Step 2\n" in content:
            return 429, RATE_LIMITED, 0.0
        return 200, judgments(int(content.split("STEPS (")[1].split(" ")[0])), 0.0

    with ScriptedEndpoint(behave) as server:
        endpoint = {
            k: v
            for k, v in vars(api_args(server.url)).items()
            if k.startswith("labeler_") and k != "labeler_max_new_tokens"
        }
        args = small_args(
            games_root,
            tiny_model_dir,
            tmp_path,
            **{**endpoint, "labeler_log_dir": str(tmp_path / "labels"), "prm_steps": 1},
        )
        run_dir = adca_grpo.main(args)
        # plain GRPO is another algorithm setting: not a continuation of this run
        with pytest.raises(harness.StartupError, match=r"--attribution False \(the run: True\)"):
            adca_grpo.main(adca_grpo.Args(**{**vars(args), "resume": "auto", "attribution": False}))
        resumed = adca_grpo.main(adca_grpo.Args(**{**vars(args), "num_updates": 3, "resume": "auto"}))
    rows = read_metrics(run_dir)
    assert resumed == run_dir and [r["update"] for r in rows] == [1, 2, 3]
    assert {r["labeler"] for r in rows} == {"api"} and [r["prm/labelling"] for r in rows] == [1.0, 0.0, 0.0]
    assert rows[0]["prm/label_requests"] == 4 and not any("prm/label_requests" in r for r in rows[1:])  # --prm-steps 1
    assert rows[0]["prm/label_failures"] == 0 and rows[0]["prm/parse_failures"] == 0
    assert rows[0]["prm/good_rate"] > 0 and rows[0]["prm/decouple/attr_std"] > 0
    samples = read_samples(run_dir)
    # update 1: the labels (GOOD, BAD, ...) reach the trained step advantages; updates 2-3: plain GRPO, one per episode
    labelled = [s for s in samples if s["update"] == 1 and len(s["step_flags"]) >= 2]
    assert labelled and all(len(set(s["step_advantages"])) == len(s["step_flags"]) for s in labelled)
    assert all(len(set(s["step_advantages"])) == 1 for s in samples if s["update"] >= 2 and s["step_flags"])
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.suffix in (".jsonl", ".json"):
            assert SECRET not in path.read_text()
    state = json.loads((run_dir / "checkpoints" / "update_000003" / "trainer_state.json").read_text())
    assert state["algorithm"] == "adca_grpo" and state["update"] == 3


def test_smoke_api_labeler_fails_at_start_on_a_dead_endpoint(games_root, tiny_model_dir, tmp_path, api_key):
    with ScriptedEndpoint(lambda content, attempt: (200, "OK", 0.0)) as server:
        closed_url = server.url
    endpoint = {k: v for k, v in vars(api_args(closed_url)).items() if k.startswith("labeler_")}
    start = time.monotonic()
    with pytest.raises(ValueError, match="--labeler-base-url .* cannot reach"):
        adca_grpo.main(small_args(games_root, tiny_model_dir, tmp_path, **endpoint))
    assert time.monotonic() - start < 30 and not list(tmp_path.glob("adca_grpo__*"))  # before any run dir


def scripted_trajectory(game_file, protocol, replies):
    """One episode whose turn k replies with replies[k] (a tool call or free text)."""

    def play(prompts, max_new_tokens):
        text = replies[len(play.calls)]
        play.calls.append(text)
        tokens = protocol.encode(text) + [protocol.eos_token_id]
        return [common.Completion(tokens, [0.0] * len(tokens), text)]

    play.calls = []
    [[traj]] = common.rollout(
        [common.game_start(game_file, protocol)],
        1,
        play,
        protocol,
        horizon=len(replies),
        max_turns=len(replies),
        max_turn_tokens=64,
        max_trajectory_tokens=1 << 20,
    )
    return traj


def test_oracle_labels_good_exactly_when_a_step_shortens_the_optimal_plan(all_games, protocol):
    game_file = next(g for g in all_games if "look_at_obj" in g and "/train/" in g)
    walkthrough = common.load_walkthrough(game_file)
    expert = scripted_trajectory(game_file, protocol, [common.tool_call(a) for a in walkthrough])
    assert expert.won and common.oracle_step_flags(expert) == [True] * len(walkthrough)

    replies = [common.tool_call("look"), "no tool call", common.tool_call(walkthrough[0]), common.tool_call("fly away")]
    replies += [common.tool_call(a) for a in walkthrough[1:]]
    detours = scripted_trajectory(game_file, protocol, replies)
    assert detours.won
    assert common.oracle_step_flags(detours) == [False, False, True, False] + [True] * (len(walkthrough) - 1)

    args = adca_grpo.Args(skip_type="skip_small_adv")
    flags, metrics = adca_grpo.oracle_labeler([expert, detours], [0.0, 1.0], [1.0, 1.0], args)
    assert flags[0] == [True] * len(walkthrough)  # skipped (advantage 0), won: all GOOD, as for an LLM labeller
    assert flags[1] == common.oracle_step_flags(detours)
    assert metrics["prm/skipped"] == 1 and metrics["prm/label_requests"] == 1
