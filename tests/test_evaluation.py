"""evaluation.py: success per split with n and its Wilson interval, and the held-out splits played at
--eval-temperature."""

import pytest

import evaluation
import gigpo
import harness


def test_the_wilson_interval_matches_the_hand_computed_one():
    # 3 of 10, z = 1.959964: (0.3 + z^2/20 -/+ z sqrt(0.021 + z^2/400)) / (1 + z^2/10) = (0.49207 -/+ 0.34287) / 1.38415
    assert evaluation.wilson_interval(3, 10) == pytest.approx((0.10779, 0.60322), abs=1e-5)
    # 0 of 128: the low end is 0, the high end (z^2/128) / (1 + z^2/128) = 0.030011 / 1.030011
    assert evaluation.wilson_interval(0, 128) == pytest.approx((0.0, 0.029137), abs=1e-6)
    low, high = evaluation.wilson_interval(128, 128)  # mirrored: 1 minus the interval of 0 of 128
    assert (low, high) == pytest.approx((1 - 0.029137, 1.0), abs=1e-6)
    assert evaluation.wilson_interval(0, 0) == (0.0, 1.0)  # nothing played: nothing known
    assert evaluation.success_metrics("eval/valid_unseen", [True, False, False, False]) == pytest.approx(
        {
            "eval/valid_unseen/success_rate": 0.25,
            "eval/valid_unseen/n": 4.0,
            "eval/valid_unseen/success_ci_low": evaluation.wilson_interval(1, 4)[0],
            "eval/valid_unseen/success_ci_high": evaluation.wilson_interval(1, 4)[1],
        }
    )


@pytest.mark.parametrize("temperature", [0.4, 0.0])
def test_the_held_out_splits_are_played_at_eval_temperature(temperature, games_root, tiny_model_dir, tmp_path):
    """eval/train samples with the run's sampler; valid_seen and valid_unseen with rt.eval_fn, a sampler at
    --eval-temperature (0: the greedy one)."""
    args = gigpo.Args(model=str(tiny_model_dir), data_root=str(games_root), output_dir=str(tmp_path), eval_games=1,
                      sampler="generate", eval_temperature=temperature)  # fmt: skip
    rt = gigpo.Runtime(args, harness.make_accelerator())
    played = []

    def play(starts, group_size, *, horizon, max_turns, sample_fn=None):
        played.append(sample_fn or rt.sample_fn)
        return []

    rt.play = play
    evaluation.evaluate(rt, max_turns=2)
    assert played == [rt.sample_fn, rt.eval_fn, rt.eval_fn]  # the training games, then the two splits
    if temperature:
        assert not rt.eval_fn.greedy and rt.eval_fn.args.temperature == 0.4 and rt.sample_fn.args.temperature == 1.0
    else:
        assert rt.eval_fn is rt.greedy_fn and rt.greedy_fn.greedy
