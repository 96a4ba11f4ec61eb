"""What a run settles before any weight loads: the card's command on a machine without the model names the offline way
in, once, without a traceback; `--sampler auto` falls back to generate() with the reason where the colocated engine
cannot be built, and an explicit `--sampler vllm-colocate` that cannot be built stops at start with that reason."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import samplers
import tempo
from benchmarks.speed.gpu import QWEN3_4B

ROOT = Path(__file__).resolve().parents[1]


def test_the_cards_command_without_the_model_names_the_offline_way_in_once(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "tempo.py"), "--td-updates", "40"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("error: --model Qwen/Qwen3-4B-Instruct-2507: cannot load its config") == 1
    assert "`python SCRIPT.py learning`" in result.stderr and "--model tiny-agent" in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") <= 3, result.stderr


@pytest.fixture(scope="module")
def qwen3_4b(tmp_path_factory) -> str:
    """A folder with Qwen3-4B's config.json only (its shape: 4.0B parameters, 144 KiB of bfloat16 KV a token)."""
    from transformers import Qwen3Config

    path = tmp_path_factory.mktemp("qwen3-4b")
    Qwen3Config(**QWEN3_4B).save_pretrained(path)
    return str(path)


def test_the_engine_problem_is_what_its_build_would_refuse(qwen3_4b, monkeypatch):
    args = tempo.Args(model=qwen3_4b, max_trajectory_tokens=24576)
    weights, kv_token = samplers.engine_bytes(args)
    assert weights == pytest.approx(2 * 4.02e9, rel=0.01) and kv_token == 2 * 36 * 8 * 128 * 2  # bf16 on CUDA
    cuda = torch.device("cuda")
    # 0.3 of 24 GiB (7.2) cannot hold 7.5 GiB of weights; 0.3 of 80 GiB (24) holds them and 3.4 GiB of KV
    problem = samplers.colocated_engine_problem(args, cuda, gpu_memory_bytes=24 * 2**30)
    assert "cannot hold the weights (7.5 GiB)" in problem and "--vllm-gpu-memory-utilization" in problem
    assert samplers.colocated_engine_problem(args, cuda, gpu_memory_bytes=80 * 2**30) is None
    long = dataclasses.replace(args, max_trajectory_tokens=131072)  # 18 GiB of KV for one episode
    assert "--max-trajectory-tokens 131072" in samplers.colocated_engine_problem(long, cuda, 80 * 2**30)
    assert "above vLLM's largest, 512" in samplers.colocated_engine_problem(
        dataclasses.replace(args, lora_rank=1024), cuda, 80 * 2**30
    )
    monkeypatch.setitem(sys.modules, "vllm", None)  # an install that does not import
    assert samplers.colocated_engine_problem(args, cuda, 80 * 2**30).startswith("vLLM does not import (ModuleNotFoundError")


def test_auto_falls_back_to_generate_with_the_reason(monkeypatch):
    """On a CUDA machine (as torch would report one) an engine that cannot be built is not picked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    sampler, reason = samplers.sampler_choice(tempo.Args(lora_rank=1024), torch.device("cuda"))
    assert sampler == "generate" and "--lora-rank 1024 is above vLLM's largest, 512" in reason


def test_an_explicit_colocated_engine_that_cannot_be_built_stops_at_start(tmp_path):
    args = tempo.Args(model="tiny", sampler="vllm-colocate", lora_rank=1024, lora_alpha=8, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="--sampler vllm-colocate: --lora-rank 1024 is above vLLM's largest, 512"):
        tempo.main(args)
    assert not list(tmp_path.glob("*/metrics.jsonl"))  # stopped before a run began
