"""The tiny offline model: builds deterministically, reloads, renders chats with tools, generates; samplers.pretrained's
attention gives transformers' logits without copying its KV heads."""

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
import offline
import samplers


def _digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def test_tiny_model_builds_reloads_and_renders_offline(tmp_path, tiny_model_dir):
    again = offline.build_tiny_model(tmp_path / "again")
    assert _digest(again) == _digest(tiny_model_dir)  # deterministic, byte for byte
    other_seed = offline.build_tiny_model(tmp_path / "seed1", seed=1)
    assert _digest(other_seed)["model.safetensors"] != _digest(tiny_model_dir)["model.safetensors"]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2" and sum(p.numel() for p in model.parameters()) < 1_000_000
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert all(
        len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in ("<tool_call>", "</tool_call>", "<think>")
    )

    text = "You arrive at countertop 2. On the countertop 2, you see a mug 1.\n\tÉtagère ✓"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Your task is to: put a mug in shelf."},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "alfworld_step", "arguments": {"action": "look"}}\n</tool_call>',
        },
        {"role": "tool", "content": "Nothing happens."},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, tools=[common.ALFWORLD_TOOL], tokenize=False, add_generation_prompt=True
    )
    assert rendered.startswith("<|im_start|>system\nsys\n\n# Tools\n")
    assert '"name": "alfworld_step"' in rendered
    assert "<|im_start|>user\n<tool_response>\nNothing happens.\n</tool_response><|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")

    ids = torch.tensor([tokenizer.encode(rendered, add_special_tokens=False)])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        top_k=0,
        max_new_tokens=8,
        pad_token_id=tokenizer.pad_token_id,
    )
    assert out.shape[1] > ids.shape[1]


def test_resolve_model_builds_tiny_once(tmp_path):
    path = samplers.resolve_model("tiny", cache_dir=tmp_path)
    assert (tmp_path / "tiny-model" / "model.safetensors").is_file()
    mtime = (tmp_path / "tiny-model" / "model.safetensors").stat().st_mtime_ns
    assert samplers.resolve_model("tiny", cache_dir=tmp_path) == path
    assert (tmp_path / "tiny-model" / "model.safetensors").stat().st_mtime_ns == mtime
    assert samplers.resolve_model("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"


def test_tiny_agent_is_shipped_and_its_readme_names_its_digest():
    """--model tiny-agent needs no build: the shipped weights, whose sha256 assets/tiny-agent/README.md records (the
    digest `python -m benchmarks.learning.agents` compares a rebuild with)."""
    path = Path(samplers.resolve_model("tiny-agent"))
    assert path == offline.SHIPPED_AGENTS_DIR / "tiny-agent"
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert digest in (path / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) == 929_280  # hidden 128, 4 layers, the 2k-token vocabulary


def test_a_tiny_agent_not_shipped_is_found_once_built_and_named_with_its_build_command_before(tmp_path):
    recipe = offline.TINY_AGENTS["tiny-agent-long"]
    with pytest.raises(ValueError, match="python -m benchmarks.learning.agents --name tiny-agent-long"):
        offline.tiny_agent_weights("tiny-agent-long", tmp_path)
    last = tmp_path / f"{recipe.dir_prefix}-stage{len(recipe.stages)}"
    last.mkdir()
    (last / "sft.json").write_text("{}")  # what the build's last stage writes when it is done
    assert offline.tiny_agent_weights("tiny-agent-long", tmp_path) == last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_kv_attention_gives_sdpas_logits_without_copying_the_kv_heads(tiny_model_dir, dtype, monkeypatch):
    """samplers.pretrained's attention on a left-padded batch (fp32; bf16 compute as load_model sets it): without
    gradients, transformers' "sdpa" logits and sampled tokens bit for bit with its KV heads never copied per query head
    (repeat_kv not called; "sdpa" calls it); with gradients, transformers' own path (the same gradients bit for bit)."""
    from transformers.integrations import sdpa_attention

    copies = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: copies.append(1) or repeat_kv(*a))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # transformers' "sdpa"
    models = [plain, samplers.pretrained(str(tiny_model_dir), torch.float32)]
    for model in models:
        if dtype != torch.float32:
            samplers.compute_in(model, dtype, torch.device("cpu"))
    assert models[0].config.num_key_value_heads < models[0].config.num_attention_heads  # grouped: what is shared
    texts = [f"go to desk {i} " * (1 + i % 5) for i in range(6)]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    valid = batch["attention_mask"].bool()
    logits, sampled, used = [], [], []
    for model in models:
        copies.clear()
        with torch.no_grad():
            logits.append(model(**batch).logits[valid])
            torch.manual_seed(0)
            sampled.append(model.generate(**batch, max_new_tokens=12, do_sample=True, top_k=0, pad_token_id=0))
        used.append(len(copies))
    assert torch.equal(logits[0], logits[1]) and torch.equal(sampled[0], sampled[1])
    assert used[0] > 0 and used[1] == 0
    gradients = []
    for model in models:
        loss = model(**batch).logits[valid].float().logsumexp(-1).sum()
        gradients.append(torch.autograd.grad(loss, list(model.parameters())))
    assert all(torch.equal(a, b) for a, b in zip(*gradients))
