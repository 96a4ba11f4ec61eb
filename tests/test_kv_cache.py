"""KV reuse across turns in the generate() sampler (--kv-cache-mb): on real games with the tiny model and a nonzero
LoRA adapter, multi-turn rollouts equal the re-prefill sampler's (greedy replies; logprobs within 1e-4, fp32) and
sampled logprobs equal a teacher-forced pass; a restored state, a stopped branch, an exceeded budget and changed
weights fall back to prefilling."""

from pathlib import Path

import pytest
import torch

import common
import harness
import samplers
import tempo
import training

BUDGETS = dict(horizon=5, max_turns=8, max_turn_tokens=24, max_trajectory_tokens=8192)


@pytest.fixture(scope="module")
def games(all_games) -> list[str]:
    """The generator's first two games (a look_at and a pick_and_place one)."""
    return [game for game in all_games if Path(game).parent.name in ("trial_T0_00000_00", "trial_T0_00001_00")]


@pytest.fixture(scope="module")
def policy(tiny_model_dir, tmp_path_factory):
    """Tokenizer, LoRA model and accelerator; sample_batch_size 3 splits a turn's prompts across chunks."""
    args = tempo.Args(
        model=str(tiny_model_dir),
        lora_rank=4,
        lora_alpha=8,
        sample_batch_size=3,
        output_dir=str(tmp_path_factory.mktemp("out")),
    )
    accelerator = harness.make_accelerator()
    tokenizer, model, _ = samplers.load_model(args, accelerator)
    perturb_adapter(model, seed=0)
    return args, accelerator, tokenizer, model


def perturb_adapter(model, seed: int) -> None:
    """Nonzero LoRA B matrices (a fresh adapter leaves the base model), written in place as an optimizer step is."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def make(policy, kv_cache_mb: int = 64, greedy: bool = True, **overrides) -> samplers.GenerateSampler:
    args, accelerator, tokenizer, model = policy
    settings = {**vars(args), "kv_cache_mb": kv_cache_mb, **overrides}
    return samplers.make_sampler(model, tokenizer, accelerator, tempo.Args(**settings), greedy=greedy)


def play(policy, sampler, starts, branches: int, **overrides):
    protocol = common.ChatProtocol(policy[2])
    return common.rollout(starts, branches, sampler, protocol, **{**BUDGETS, **overrides})


def assert_same_rollouts(groups, expected):
    for group, other in zip(groups, expected, strict=True):
        for traj, ref in zip(group, other, strict=True):
            assert traj.tokens == ref.tokens and traj.stop_reason == ref.stop_reason
            assert traj.logprobs == pytest.approx(ref.logprobs, abs=1e-4)


@pytest.mark.slow
def test_greedy_rollouts_with_reuse_equal_re_prefill_ones(policy, games):
    protocol = common.ChatProtocol(policy[2])
    starts = [common.game_start(game, protocol) for game in games]
    reuse = make(policy, sample_batch_size=4)  # one chunk a turn: prompts are shared within a chunk
    groups = play(policy, reuse, starts, 2)
    assert_same_rollouts(groups, play(policy, make(policy, kv_cache_mb=0), starts, 2))
    assert all(len(traj.steps) == BUDGETS["horizon"] for group in groups for traj in group)
    trajectories = [traj for group in groups for traj in group]
    shared = sum(len(start.prefix_tokens) - 1 for start in starts)  # turn 0: each game's prompt once, not per branch
    # every prompt token of every turn is either taken from a kept cache or computed, and computed at most once
    assert (
        reuse.stats["reused"] + reuse.stats["prefilled"]
        == sum(step.prompt_length for traj in trajectories for step in traj.steps) - shared
    )
    # later turns compute only the tokens added since the reply (and the reply's last token if it was never fed)
    added = sum(
        step.prompt_length - before.prompt_length - len(before.completion_tokens) + 1
        for traj in trajectories
        for before, step in zip(traj.steps, traj.steps[1:])
    )
    assert reuse.stats["prefilled"] <= shared + len(trajectories) + added
    assert reuse.stats["reused"] > 3 * reuse.stats["prefilled"]
    assert reuse.kept == []  # dropped at the rollout's end


@pytest.mark.slow
def test_sampled_logprobs_equal_a_teacher_forced_pass(policy, games):
    args, accelerator, tokenizer, model = policy
    protocol = common.ChatProtocol(tokenizer)
    starts = [common.game_start(game, protocol) for game in games]
    reuse = make(policy, greedy=False)
    torch.manual_seed(0)
    trajectories = [traj for group in play(policy, reuse, starts, 3) for traj in group]
    assert len({tuple(traj.tokens) for traj in trajectories}) == 6  # branches diverged: rows of different lengths
    assert reuse.stats["reused"] > 0
    sequences = [traj.sequence() for traj in trajectories]
    forced = training.sequence_logprobs(
        model, accelerator, [tokens for tokens, _, _ in sequences], 1.0, tokenizer.pad_token_id, 16384
    )
    for (tokens, logprobs, step_ids), teacher in zip(sequences, forced):
        generated = [i for i, k in enumerate(step_ids) if k >= 0]
        assert [logprobs[i] for i in generated] == pytest.approx([teacher[i] for i in generated], abs=1e-4)


@pytest.mark.slow
def test_a_restored_state_prefills_once_then_reuses(policy, games):
    protocol = common.ChatProtocol(policy[2])
    (first,) = play(policy, make(policy), [common.game_start(games[0], protocol)], 1, horizon=3)
    saved = first[0].saved_state()  # mid-episode: its prefix holds replies generated before
    reuse, after_turn = make(policy, sample_batch_size=4), []
    groups = play(policy, reuse, [saved], 4, on_turn=lambda turn, live: after_turn.append(reuse.stats.copy()))
    assert_same_rollouts(groups, play(policy, make(policy, kv_cache_mb=0), [saved], 4))
    prefix = len(saved.prefix_tokens)
    # once all tokens but the last, then each branch's last token as generate() feeds it
    assert after_turn[0]["prefilled"] == prefix - 1 + 4 and after_turn[0]["reused"] == 0
    assert after_turn[1]["reused"] >= 4 * prefix


@pytest.mark.slow
def test_stopped_branches_are_dropped_and_the_rest_continue(policy, games):
    protocol = common.ChatProtocol(policy[2])
    (first,) = play(policy, make(policy), [common.game_start(games[1], protocol)], 1, horizon=3)
    starts = [common.game_start(games[0], protocol), first[0].saved_state()]  # the second stops after 2 turns
    reuse, kept = make(policy), []
    groups = play(policy, reuse, starts, 2, max_turns=5, on_turn=lambda turn, live: kept.append(list(reuse.kept)))
    assert_same_rollouts(groups, play(policy, make(policy, kv_cache_mb=0), starts, 2, max_turns=5))
    assert [len(k) for k in kept] == [4, 4, 2, 2, 2]  # a call keeps only the sequences it produced
    for traj, (tokens, _) in zip(groups[0], kept[-1]):
        assert traj.tokens[: len(tokens)] == tokens
    assert reuse.kept == []


@pytest.mark.slow
def test_a_branch_past_the_budget_re_prefills(policy, games):
    protocol = common.ChatProtocol(policy[2])
    starts = [common.game_start(games[0], protocol)]
    reuse = make(policy, kv_cache_mb=1)  # 512 bytes a token here: about two ~900-token sequences
    groups = play(policy, reuse, starts, 4)
    assert_same_rollouts(groups, play(policy, make(policy, kv_cache_mb=0), starts, 4))
    assert reuse.stats["not_kept"] > 0 and reuse.stats["reused"] > 0


@pytest.mark.slow
def test_caches_are_dropped_when_the_weights_change(policy, games):
    args, accelerator, tokenizer, model = policy
    protocol = common.ChatProtocol(tokenizer)
    prompt = common.game_start(games[0], protocol).prefix_tokens
    reuse = make(policy)
    (reply,) = reuse([prompt], 8)
    extended = prompt + reply.tokens + protocol.delta(reply.tokens, "Status: executed")
    reused = reuse.stats["reused"]
    try:
        perturb_adapter(model, seed=1)
        (got,), (expected,) = reuse([extended], 8), make(policy, kv_cache_mb=0)([extended], 8)
        assert got.tokens == expected.tokens and got.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
        assert reuse.stats["reused"] == reused  # the kept cache was made with the old weights
    finally:
        perturb_adapter(model, seed=0)


@pytest.mark.slow
def test_the_static_cache_stays_within_the_budget(policy, games):
    """A chunk whose StaticCache (rows x (cached + new prompt tokens + reply)) would pass --kv-cache-mb is sampled
    without one, as generate() alone samples it (the same greedy replies); at a budget that holds it, it reuses."""
    protocol = common.ChatProtocol(policy[2])
    (start,) = [common.game_start(games[0], protocol)]
    prompt = list(start.prefix_tokens)
    chunk = [prompt] * 8  # 8 rows of a ~1k-token prompt: the static cache is ~8 x 1k x the tiny model's KV a token
    new_tokens = 16
    probe = make(policy, kv_cache_mb=64, sample_batch_size=8)
    size = len(chunk) * (len(prompt) - 1 + 1 + new_tokens - 1) * probe.token_bytes
    below, above = size // 2**20, size // 2**20 + 1  # MB: the last that cannot hold it, the first that can
    assert below >= 1, size
    expected = make(policy, kv_cache_mb=0, sample_batch_size=8)(chunk, new_tokens)
    for mb, over in ((below, 1), (above, 0)):
        sampler = make(policy, kv_cache_mb=mb, sample_batch_size=8)
        replies = sampler(chunk, new_tokens)
        assert sampler.stats["over_budget"] == over and (sampler.stats["prefilled"] > 0) == (not over), sampler.stats
        assert [r.tokens for r in replies] == [r.tokens for r in expected]
