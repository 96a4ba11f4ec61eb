"""--plan: what a run needs per GPU, from the model's config alone (no weights), against figures worked out by hand for
Qwen2.5-1.5B and Qwen3-4B (their configs built here from the published hyperparameters: nothing is downloaded)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen3Config

import gigpo
import harness
import plan

GIB = 2**30
# Published shapes: Qwen2.5-1.5B-Instruct (1.54B parameters) and Qwen3-4B (4.02B), both with tied embeddings.
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
# By hand, per model: parameters (published), LoRA r32 parameters on the 7 projections (r x (in + out) per module and
# layer), activation bytes per token and layer (2 bytes x (4h + 2 q + 2 kv + 4 I); LoRA: + 4 bytes x the targeted
# modules' inputs, 6h + I), KV bytes per token (2 x layers x kv heads x 128 x 2 bytes).
HAND = {
    "qwen2.5-1.5b": dict(
        parameters=1.54e9,
        lora=28 * 32 * (2 * (1536 + 1536) + 2 * (1536 + 256) + 3 * (1536 + 8960)),  # 36.9M
        layer=2 * (4 * 1536 + 2 * 1536 + 2 * 256 + 4 * 8960),  # 91,136 bytes
        lora_layer=4 * (6 * 1536 + 8960),  # 72,704 bytes
        hidden=1536,
        layers=28,
        kv=2 * 28 * 2 * 128 * 2,  # 28,672 bytes
    ),
    "qwen3-4b": dict(
        parameters=4.02e9,
        lora=36 * 32 * (2 * (2560 + 4096) + 2 * (2560 + 1024) + 3 * (2560 + 9728)),  # 66.1M
        layer=2 * (4 * 2560 + 2 * 4096 + 2 * 1024 + 4 * 9728),  # 118,784 bytes
        lora_layer=4 * (6 * 2560 + 9728),  # 100,352 bytes
        hidden=2560,
        layers=36,
        kv=2 * 36 * 8 * 128 * 2,  # 147,456 bytes
    ),
}
CONFIGS = {"qwen2.5-1.5b": lambda: Qwen2Config(**QWEN25_15B), "qwen3-4b": lambda: Qwen3Config(**QWEN3_4B)}
LOGITS = 256 * 151936 * 8  # the training step's logits chunk, fp32, and its log-softmax


def run_args(**overrides) -> gigpo.Args:
    return gigpo.Args(micro_batch_tokens=16384, max_trajectory_tokens=8192, **overrides)


@pytest.mark.parametrize("name", HAND)
@pytest.mark.parametrize("lora_rank", [32, 0])
def test_the_plan_matches_the_memory_worked_out_by_hand(name, lora_rank):
    hand, args = HAND[name], run_args(lora_rank=lora_rank)
    shape = plan.model_shape(CONFIGS[name](), args.lora_rank, args.lora_targets)
    figures = plan.memory_plan(args, shape, processes=1, gpu_gib=80)
    n, lora = hand["parameters"], hand["lora"]
    assert shape.parameters == pytest.approx(n, rel=0.01) and shape.lora_parameters == (lora if lora_rank else 0)
    if lora_rank:  # bf16 base weights, an fp32 adapter, its gradients and AdamW's two fp32 moments
        want = dict(weights=(2 * n + 4 * lora) / GIB, gradients=4 * lora / GIB, adamw=8 * lora / GIB)
    else:  # bf16 weights and their fp32 master copy, fp32 gradients, AdamW
        want = dict(weights=6 * n / GIB, gradients=4 * n / GIB, adamw=8 * n / GIB)
    layer = hand["layer"] + (hand["lora_layer"] if lora_rank else 0)
    want["activations_kept"] = (16384 * layer * hand["layers"] + LOGITS) / GIB
    want["activations_checkpointed"] = (16384 * (2 * hand["hidden"] * hand["layers"] + layer) + LOGITS) / GIB
    want["engine_kv_tokens"] = (0.3 * 80 * GIB - 2 * n - 2 * GIB) / hand["kv"]  # the engine's share less its weights
    for key, value in want.items():
        assert figures[key] == pytest.approx(value, rel=0.1), key
    assert figures["kv_bytes_per_token"] == hand["kv"]
    checkpoint = lora * (4 + 8) if lora_rank else n * (2 + 8 + 4)
    assert figures["checkpoint"] == pytest.approx(checkpoint / GIB, rel=0.1)


def test_a_plan_that_does_not_fit_names_the_flag_to_change():
    shape = plan.model_shape(Qwen3Config(**QWEN3_4B), 0, harness.SharedArgs().lora_targets)
    full = run_args(lora_rank=0, kl_loss_coef=0.0)
    figures = plan.memory_plan(full, shape, processes=1, gpu_gib=40)  # 72 GB of weights and AdamW alone
    assert figures["fits"] is False
    assert "--fsdp" in plan.advice(full, figures, 40) and "LoRA" in plan.advice(full, figures, 40)
    unchecked = dataclasses.replace(full, gradient_checkpointing="off")
    assert plan.advice(unchecked, plan.memory_plan(unchecked, shape, 1, 40), 40) == "--gradient-checkpointing on"
    small = dataclasses.replace(full, lora_rank=32, vllm_gpu_memory_utilization=0.1)  # 8 GiB: the weights alone
    figures = plan.memory_plan(small, plan.model_shape(Qwen3Config(**QWEN3_4B), 32, small.lora_targets), 1, 80)
    assert figures["episodes_at_once"] < 1 and not figures["fits"]  # the engine cannot hold one whole episode
    assert "raise --vllm-gpu-memory-utilization" in plan.advice(small, figures, 80)


def test_the_plan_counts_the_runs_tokens_and_checkpoints_at_any_process_count():
    args = run_args(groups_per_update=16, group_size=8, max_turns=50, num_updates=150, save_every=10)
    shape = plan.model_shape(Qwen2Config(**QWEN25_15B), args.lora_rank, args.lora_targets)
    one, eight = (plan.memory_plan(args, shape, processes, 80) for processes in (1, 8))
    assert one["episodes_per_update"] == eight["episodes_per_update"] == 128  # the run's, not a process's
    assert one["sampled_tokens_per_update"] == 128 * min(50 * 512, 8192)
    assert (one["checkpoints_saved"], one["checkpoints_on_disk"]) == (15, 15)  # every 10 of 150 updates, all kept
    kept = plan.memory_plan(dataclasses.replace(args, keep_checkpoints=3), shape, 8, 80)
    assert kept["checkpoints_on_disk"] == 4 and kept["disk"] == pytest.approx(4 * kept["checkpoint"])
    with pytest.raises(ValueError, match="--groups-per-update 16 .* 3 processes"):
        plan.process_shares(args, 3)


def test_plan_prints_the_plan_and_exits_before_anything_loads(tmp_path, capsys):
    Qwen2Config(**QWEN25_15B).save_pretrained(tmp_path / "model")  # a config, no weights
    argv = ["--model", str(tmp_path / "model"), "--output-dir", str(tmp_path / "runs"), "--plan", "--plan-processes",
            "8", "--plan-gpu-memory-gb", "80", "--groups-per-update", "16", "--keep-checkpoints", "3"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        harness.cli(gigpo.Args, gigpo.main, argv=argv)
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and not (tmp_path / "runs").exists()
    assert "1.54B parameters" in out and "8 process(es), one a GPU of 80 GiB" in out and out.rstrip().endswith("fits")
    assert "(--keep-checkpoints 3)" in out and "KV cache for" in out


def test_on_cuda_a_plan_that_does_not_fit_warns_at_start_and_one_that_fits_says_nothing(tmp_path, monkeypatch, capsys):
    """What harness runs on CUDA before the model loads: the visible device's memory (here a 40 GiB GPU, as
    torch.cuda reports it) against the plan, one warning with the plan and its fix when it does not fit."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=40 * GIB))
    Qwen3Config(**QWEN3_4B).save_pretrained(tmp_path / "qwen3-4b")  # full weights: 72 GB with AdamW alone
    plan.warn_if_it_does_not_fit(run_args(model=str(tmp_path / "qwen3-4b"), lora_rank=0, kl_loss_coef=0.0), 1)
    err = capsys.readouterr().err
    assert "[start] WARNING: by --plan's estimate the run does not fit the GPU" in err
    assert "one a GPU of 40 GiB" in err and "does NOT fit: " in err and "--fsdp" in err
    Qwen2Config(**QWEN25_15B).save_pretrained(tmp_path / "qwen2.5-1.5b")  # LoRA r32: a few GiB
    plan.warn_if_it_does_not_fit(run_args(model=str(tmp_path / "qwen2.5-1.5b")), 1)
    assert capsys.readouterr().err == ""
