"""benchmarks/behaviour.py's comparison: identical runs compare equal whatever their timings; a changed value, a metric
only one side has, a missing row, a changed hash or a run only one file has are each reported."""

import copy

from benchmarks import behaviour


def runs() -> dict:
    row = {"update": 1, "rollout/success_rate": 0.5, "train/loss": 0.1, "time/update_s": 3.0, "prm/latency_p50": 0.07}
    return {"gigpo smoke": {"metrics": [row, {**row, "update": 2}], "hashes": {"adapter_sha256": "ab"}}}


def test_identical_runs_compare_equal_whatever_their_timings():
    after = runs()
    for row in after["gigpo smoke"]["metrics"]:
        row.update({"time/update_s": 9.0, "prm/latency_p50": 0.2})
    assert behaviour.compare(runs(), after) == []


def test_each_kind_of_difference_is_reported():
    after = copy.deepcopy(runs())
    after["gigpo smoke"]["metrics"][1]["train/loss"] = 0.2
    after["gigpo smoke"]["metrics"][0]["rollout/new_metric"] = 1.0
    after["gigpo smoke"]["hashes"]["adapter_sha256"] = "cd"
    after["ppo smoke"] = runs()["gigpo smoke"]
    differences = behaviour.compare(runs(), after)
    assert differences == [
        "ppo smoke: only in one file",
        "gigpo smoke: hashes {'adapter_sha256': 'ab'} != {'adapter_sha256': 'cd'}",
        "gigpo smoke update 1: rollout/new_metric (absent) != 1.0",
        "gigpo smoke update 2: train/loss 0.1 != 0.2",
    ]
    after["gigpo smoke"]["metrics"].pop()
    assert "gigpo smoke: 2 metric rows != 1" in behaviour.compare(runs(), after)
