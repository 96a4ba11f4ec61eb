"""ppo.py: turn-level GAE against an independent computation, the value head read at the same positions in the rollout
and in the training step, an update that moves the policy and the head the right way, the warm-up, --lora-rank 0 and
a corrupt or foreign head. The job itself (smoke preset, SIGKILL and resume with the head and optimizer state exact,
2-process `accelerate launch` with the head identical on both ranks, --eval-only) is test_training_job's, which finds
ppo.py as it finds every algorithm script."""

import pytest
import torch
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file
from test_training_job import SHARED

import common
import harness
import ppo
import training


# =============================================================================================
# gae_advantages against an independent computation
# =============================================================================================
def gae_by_sums(rewards, values, gamma, lam, last_value):
    """A_t = sum_k (gamma lam)^k delta_{t+k}, each delta from its definition; returns = A + V."""
    following = list(values[1:]) + [last_value]
    deltas = [r + gamma * v_next - v for r, v, v_next in zip(rewards, values, following)]
    advantages = [sum((gamma * lam) ** k * deltas[t + k] for k in range(len(deltas) - t)) for t in range(len(deltas))]
    return advantages, [a + v for a, v in zip(advantages, values)]


CASES = {
    "terminal win": ([0.0, 0.0, 1.0], [0.2, 0.5, 0.7], 0.0),
    "cut episode": ([0.0, -0.01, 0.0], [0.3, 0.1, 0.4], 0.6),
    "one turn": ([1.0], [0.25], 0.0),
    "one turn, cut": ([0.0], [0.25], 0.5),
    "penalised loss": ([-0.01, -0.01, 0.0, -0.01], [0.1, 0.0, -0.2, 0.3], 0.0),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gamma, lam", [(0.95, 0.9), (1.0, 1.0), (0.0, 0.9), (0.95, 0.0), (1.0, 0.0), (0.0, 1.0)])
def test_gae_matches_an_independent_computation(case, gamma, lam):
    rewards, values, last_value = CASES[case]
    advantages, returns = ppo.gae_advantages(rewards, values, gamma, lam, last_value)
    expected_advantages, expected_returns = gae_by_sums(rewards, values, gamma, lam, last_value)
    assert advantages == pytest.approx(expected_advantages, abs=1e-12)
    assert returns == pytest.approx(expected_returns, abs=1e-12)


def test_gae_at_lambda_one_and_zero():
    rewards, values, last_value = CASES["cut episode"]
    _, returns = ppo.gae_advantages(rewards, values, 0.9, 1.0, last_value)  # lam 1: the discounted return
    assert returns == pytest.approx([0.0 + 0.9 * -0.01 + 0.81 * 0.0 + 0.729 * 0.6, -0.01 + 0.81 * 0.6, 0.9 * 0.6])
    advantages, _ = ppo.gae_advantages(rewards, values, 0.9, 0.0, last_value)  # lam 0: one-step TD errors
    assert advantages == pytest.approx([0.0 + 0.9 * 0.1 - 0.3, -0.01 + 0.9 * 0.4 - 0.1, 0.9 * 0.6 - 0.4])
    assert ppo.gae_advantages([1.0], [0.25], 0.5, 0.5) == ([0.75], [1.0])  # an ended episode bootstraps 0
    assert ppo.gae_advantages([], [], 0.9, 0.9) == ([], [])
    with pytest.raises(ValueError, match="2 rewards but 1 values"):
        ppo.gae_advantages([0.0, 1.0], [0.5], 0.9, 0.9)


def test_explained_variance():
    assert ppo.explained_variance([0.0, 1.0, 0.5], [0.0, 1.0, 0.5]) == 1.0
    assert ppo.explained_variance([0.3, 0.3], [0.0, 1.0]) == pytest.approx(0.0)
    assert ppo.explained_variance([1.0, 0.0], [0.0, 1.0]) == pytest.approx(-3.0)


# =============================================================================================
# The value head in the rollout and in the training step
# =============================================================================================
def small_args(games_root, tiny_model_dir, tmp_path, **overrides) -> ppo.Args:
    settings = dict(
        SHARED,  # the training-job tests' small budgets
        model=str(tiny_model_dir),
        data_root=str(games_root),
        output_dir=str(tmp_path / "runs"),
        num_updates=2,
        groups_per_update=2,
        group_size=2,
        max_turns=2,
    )
    return ppo.Args(**{**settings, **overrides})


@pytest.mark.slow
def test_the_training_step_reads_the_values_the_rollout_read(games_root, tiny_model_dir, tmp_path):
    """With targets = the rollout's V(s_t), the first step's value loss is 0: the training forward reads the head at
    the same positions and gets the same values; with targets V + 1 it is exactly 0.5 (0.5 x 1^2, token-weighted)."""
    args = small_args(games_root, tiny_model_dir, tmp_path, micro_batch_tokens=300, vf_clip=None, learning_rate=0.0)
    set_seed(0)
    rt = ppo.Runtime(args, harness.make_accelerator())
    with torch.no_grad():  # a head that is not zero, so the values differ between positions
        rt.heads["value"].weight.normal_(0, 1.0)
    groups = rt.play([rt.next_game_start() for _ in range(2)], 2, horizon=2, max_turns=2)
    trajectories = [traj for group in groups for traj in group]
    values = ppo.state_values(rt, trajectories)
    assert values[0][0] == values[1][0] and values[2][0] == values[3][0]  # two branches from one start state
    assert len({v for row in values for v in row}) > 4  # the head reads different states differently
    zeros = [[0.0] * len(row) for row in values]
    loss_fn = ppo.functools.partial(ppo.policy_loss, value_head=rt.heads["value"], vf_clip=None)
    for shift, expected in ((0.0, 0.0), (1.0, 0.5)):
        targets = [[v + shift for v in row] for row in values]
        metrics = training.train_step(rt, ppo.value_datums(trajectories, zeros, values, targets), loss_fn)
        assert metrics["train/value_loss"] == pytest.approx(expected, abs=1e-6)  # float32 values


def scripted_runtime(games_root, tiny_model_dir, tmp_path, **overrides):
    """One look_at game, 3 branches whose replies are scripted with the policy's own logprobs: the walkthrough (won),
    the walkthrough with a wrong last step, and no tool call at all (penalised)."""
    accelerator = harness.make_accelerator()
    settings = dict(task_types=("look_at_obj_in_light",), groups_per_update=1, group_size=3)
    game = harness.training_games(small_args(games_root, tiny_model_dir, tmp_path, **settings), accelerator)[0]
    walkthrough = common.load_walkthrough(game)
    turns = len(walkthrough)
    args = small_args(games_root, tiny_model_dir, tmp_path, **settings, max_turns=turns, **overrides)
    set_seed(0)
    rt = ppo.Runtime(args, accelerator)
    replies = [
        [common.tool_call(a) for a in walkthrough],
        [common.tool_call(a) for a in walkthrough[:-1]] + [common.tool_call("look")],
        ["I will not call a tool."] * turns,
    ]

    def sample(prompts, max_new_tokens):
        turn, sample.turn = sample.turn, sample.turn + 1
        completions = []
        for prompt, texts in zip(prompts, replies):
            tokens = rt.protocol.encode(texts[turn]) + [rt.protocol.eos_token_id]
            (logprobs,) = training.sequence_logprobs(
                rt.model, rt.accelerator, [prompt + tokens], 1.0, rt.tokenizer.pad_token_id, 8192
            )
            completions.append(common.Completion(tokens, logprobs[len(prompt) :], texts[turn]))
        return completions

    sample.turn = 0
    rt.sample_fn = sample
    return rt, sample


@pytest.mark.slow
def test_update_raises_the_won_branch_and_trains_the_value_head(games_root, tiny_model_dir, tmp_path):
    rt, sample = scripted_runtime(games_root, tiny_model_dir, tmp_path, invalid_action_penalty=0.1, lam=0.95)
    lora = {n: p.detach().clone() for n, p in rt.model.named_parameters() if p.requires_grad}
    metrics, samples = ppo.gae_update(rt)
    assert metrics["rollout/success_rate"] == pytest.approx(1 / 3) and metrics["train/grad_norm"] > 0
    assert metrics["train/ratio_max"] == pytest.approx(1.0, abs=1e-4)  # the scripted logprobs are the policy's
    assert metrics["value/mean"] == 0.0 and metrics["value/loss"] > 0  # the head starts at 0
    won, wrong_end = samples
    turns = len(won["turn_rewards"])  # V = 0 everywhere: the lambda-returns of the won branch are 0.95^(turns left)
    assert won["turn_rewards"][-1] == 1.0
    assert won["turn_returns"] == pytest.approx([0.95 ** (turns - 1 - t) for t in range(turns)])
    assert all(a > 0 for a in won["turn_advantages"]) and all(a < 0 for a in wrong_end["turn_advantages"])
    assert rt.heads["value"].weight.abs().sum() > 0  # the optimizer stepped the head
    assert any(not torch.equal(lora[n], p) for n, p in rt.model.named_parameters() if p.requires_grad)

    sample.turn = 0  # the same episodes again: the head has moved towards their returns
    (group,) = rt.play([common.game_start(rt.games[0], rt.protocol)], 3, horizon=turns, max_turns=turns)
    values = ppo.state_values(rt, group[:2])
    returns = [won["turn_returns"], wrong_end["turn_returns"]]
    error = sum((v - r) ** 2 for row, targets in zip(values, returns) for v, r in zip(row, targets))
    assert error < 0.75 * sum(r**2 for targets in returns for r in targets)  # the squared error at V = 0


@pytest.mark.slow
def test_value_warmup_trains_the_value_on_monte_carlo_returns(games_root, tiny_model_dir, tmp_path):
    """Warm-up updates on the same scripted episodes: the policy's tokens get advantage 0 (the shared trunk still
    moves with the value loss) and the value loss on the Monte-Carlo returns (1 on the won branch, 0 on the others)
    falls. (The random tiny model's hidden state at the last prompt token hardly depends on the history: its head
    learns the mean return, not which state wins; benchmarks/critic.py measures heads on a trained agent.)"""
    rt, sample = scripted_runtime(games_root, tiny_model_dir, tmp_path, learning_rate=3e-3)
    rows = []
    for _ in range(3):
        sample.turn, rt.game_cursor = 0, 0  # the scripted game again
        metrics, samples = ppo.gae_update(rt, warmup=True)
        assert metrics["value/warmup"] == 1.0 and metrics["value/clip_frac"] == 0.0  # unclipped
        assert all(a == 0.0 for s in samples for a in s["turn_advantages"])
        assert samples[0]["turn_returns"] == [1.0] * len(samples[0]["turn_returns"])  # lam 1, gamma 1: the outcome
        rows.append(metrics)
    assert rows[0]["value/mean"] == 0.0 < rows[1]["value/mean"]
    assert rows[-1]["value/loss"] < 0.75 * rows[0]["value/loss"]


# =============================================================================================
# Checkpoints: --lora-rank 0, a corrupt or foreign head
# =============================================================================================
@pytest.mark.slow
def test_full_weights_and_a_corrupt_or_foreign_head(games_root, tiny_model_dir, tmp_path):
    """--lora-rank 0: every weight trained and saved beside the head; a head file that does not match its checksum,
    or holds another algorithm's heads, is refused."""
    args = small_args(games_root, tiny_model_dir, tmp_path, num_updates=1, lora_rank=0)
    checkpoint = sorted((ppo.main(args) / "checkpoints").glob("update_*"))[-1]
    assert (checkpoint / "model.safetensors").is_file() and not (checkpoint / "adapter_model.safetensors").exists()
    heads = load_file(checkpoint / "heads.safetensors")
    harness.check_checkpoint(checkpoint, args, "ppo", "--resume", 1)
    heads["value.weight"] += 1
    save_file(heads, checkpoint / "heads.safetensors")
    with pytest.raises(ValueError, match="heads.safetensors does not match the sha256"):
        harness.check_checkpoint(checkpoint, args, "ppo", "--resume", 1)
    save_file({"value.weight": torch.zeros(1, 3), "value.bias": torch.zeros(1)}, checkpoint / "heads.safetensors")
    rt = ppo.Runtime(args, harness.make_accelerator())
    with pytest.raises(ValueError, match="heads .* are not this algorithm's"):
        harness.load_checkpoint(checkpoint, rt.model, None, rt.accelerator, rt.heads)


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(lam=1.5), "--lam"),
        (dict(gamma=-0.1), "--gamma"),
        (dict(vf_coef=-1.0), "--vf-coef"),
        (dict(vf_clip=0.0), "--vf-clip"),
        (dict(num_updates=5, value_warmup_updates=5), "--value-warmup-updates"),
        (dict(group_size=0), "--group-size"),
        (dict(kl_loss_coef=0.01, lora_rank=0), "--kl-loss-coef needs --lora-rank"),
    ],
)
def test_invalid_flags_fail_at_start_naming_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        ppo.main(ppo.Args(model="/nonexistent", **overrides))  # fails before any model loads
