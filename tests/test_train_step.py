"""The training step computes the lm_head and the log-softmax only where the loss uses a logprob: the same logprobs,
loss, gradients, metrics and weights as the straightforward full-vocabulary computation, kept here as the reference;
and the seam an algorithm's heads and extra datum fields go through changes nothing for a loss that does not use it."""

import dataclasses
import functools
import importlib
import random
import types

import pytest
import torch
from accelerate.utils import set_seed

import harness
import samplers
import tempo
import training


def full_logits_logprobs(policy, rows, temperature, pad_id, device, needed=None):
    """The reference: fp32 logits of every position, /temperature, full logsumexp (`needed` ignored)."""
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], device=device)
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    logits = policy(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    logits = logits / temperature
    logprobs = logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(logprobs, (1, 0))


@pytest.fixture
def trainer(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(training, "LOGIT_CHUNK", 7)  # several chunks per micro-batch, boundaries inside rows
    args = tempo.Args(model=str(tiny_model_dir), lora_rank=4, lora_alpha=8, temperature=0.7, micro_batch_tokens=150)
    accelerator = harness.make_accelerator()
    set_seed(0)
    tokenizer, model, optimizer = samplers.load_model(args, accelerator)
    with torch.no_grad():  # a LoRA that is not zero, so its gradients flow through both factors
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return types.SimpleNamespace(
        args=args,
        accelerator=accelerator,
        tokenizer=tokenizer,
        model=model,
        optimizer=optimizer,
        heads=torch.nn.ModuleDict(),
    )


def batch(vocab: int, seed: int = 0):
    """Rows of random tokens, about a third of them trained."""
    rng = random.Random(seed)
    rows = [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 23, 57, 9)]
    needed = [[t > 0 and rng.random() < 0.35 for t in range(len(r))] for r in rows]
    return rows, needed


def test_logprobs_at_the_needed_positions_equal_the_full_computation(trainer):
    rows, needed = batch(len(trainer.tokenizer))
    policy, pad, device = trainer.model, trainer.tokenizer.pad_token_id, trainer.accelerator.device
    width = max(map(len, rows))
    wanted = torch.tensor([n + [False] * (width - len(n)) for n in needed])
    with torch.no_grad():
        reference = full_logits_logprobs(policy, rows, 0.7, pad, device)
        everywhere = training.forward_logprobs(policy, rows, 0.7, pad, device)
        selected = training.forward_logprobs(policy, rows, 0.7, pad, device, wanted)
    lengths = torch.tensor([[t < len(r) for t in range(width)] for r in rows])
    assert torch.allclose(everywhere[lengths], reference[lengths], atol=1e-5)
    assert torch.allclose(selected[wanted], reference[wanted], atol=1e-5)
    assert wanted.sum() > 10 and bool((selected[~wanted] == 0).all())


def test_gradients_equal_the_full_computation(trainer):
    rows, needed = batch(len(trainer.tokenizer), seed=1)
    policy, pad, device = trainer.model, trainer.tokenizer.pad_token_id, trainer.accelerator.device
    width = max(map(len, rows))
    wanted = torch.tensor([n + [False] * (width - len(n)) for n in needed])
    weights = torch.randn(wanted.shape, generator=torch.Generator().manual_seed(0)) * wanted
    params = [p for p in policy.parameters() if p.requires_grad]

    def grads(forward):
        policy.zero_grad()
        (forward(policy, rows, 0.7, pad, device, wanted) * weights).sum().backward()
        return [p.grad.clone() for p in params]

    for ours, theirs in zip(grads(training.forward_logprobs), grads(full_logits_logprobs)):
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads(training.forward_logprobs))


def train_once(trainer, forward, datums, monkeypatch):
    """One train_step from the same weights and optimizer state (with `forward`'s logprobs instead of common's when
    given); its metrics and the weights after it."""
    state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    optimizer_state = trainer.optimizer.state_dict()
    if forward is not None:  # the loss reads no hidden states
        monkeypatch.setattr(training, "teacher_forced", lambda *forward_args: (forward(*forward_args), None))
    loss = functools.partial(tempo.policy_loss, clip_eps=0.2, clip_eps_high=0.28)
    metrics = training.train_step(trainer, [training.Datum(**vars(d)) for d in datums], loss)
    after = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.model.load_state_dict(state)
    trainer.optimizer.load_state_dict(optimizer_state)
    return metrics, after


def random_datums(trainer, seed: int) -> tuple[list[training.Datum], list[list[bool]]]:
    """Datums of random rows, their old logprobs near the policy's and random advantages on the trained tokens."""
    rows, needed = batch(len(trainer.tokenizer), seed=seed)
    with torch.no_grad():
        policy_logprobs = [
            full_logits_logprobs(trainer.model, [r], 0.7, 0, trainer.accelerator.device)[0].tolist() for r in rows
        ]
    rng = random.Random(3)
    datums = [
        training.Datum(
            tokens=r,
            old_logprobs=[lp + rng.gauss(0, 0.3) if n else -100.0 for lp, n in zip(logprobs, mask)],  # context: any
            advantages=[rng.gauss(0, 1) * n for n in mask],
            mask=[float(n) for n in mask],
        )
        for r, logprobs, mask in zip(rows, policy_logprobs, needed)
    ]
    return datums, needed


def test_train_step_loss_metrics_and_weights_equal_the_full_computation(trainer, monkeypatch):
    datums, needed = random_datums(trainer, seed=2)
    ours, ours_after = train_once(trainer, None, datums, monkeypatch)
    theirs, theirs_after = train_once(trainer, full_logits_logprobs, datums, monkeypatch)
    assert set(ours) == set(theirs) and ours["train/clip_frac"] > 0 and ours["train/tokens"] == sum(map(sum, needed))
    for key in ours:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
    moved = [k for k in ours_after if "lora" in k and not torch.equal(ours_after[k], trainer.model.state_dict()[k])]
    assert moved
    for key in ours_after:
        assert torch.allclose(ours_after[key], theirs_after[key], atol=1e-6), key


@pytest.mark.parametrize("loss", ["tempo.policy_loss", "training.ppo_clip_loss"])
def test_the_training_seam_changes_nothing_for_a_loss_that_does_not_use_it(trainer, loss):
    """A loss without a head (tempo.py's, and training.ppo_update's that gigpo.py and adca_grpo.py train with) through
    train_step, once as the scripts run it (no head, no extra field) and once with a head in the optimizer and extra
    per-token fields on every datum that the loss ignores: the metrics and the weights after the step are
    bit-identical, and the unused head has not moved."""
    module, name = loss.split(".")
    loss_fn = getattr(importlib.import_module(module), name)
    datums, _ = random_datums(trainer, seed=4)
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    def step(heads: torch.nn.ModuleDict, extra: dict) -> tuple[dict, dict]:
        trainer.model.load_state_dict(start)
        trainer.heads = heads
        trainer.optimizer = torch.optim.AdamW(samplers.trained_parameters(trainer.model, heads), lr=1e-2)
        metrics = training.train_step(trainer, [dataclasses.replace(d, extra=extra(d)) for d in datums], loss_fn)
        return metrics, {k: v.clone() for k, v in trainer.model.state_dict().items()}

    plain, plain_after = step(torch.nn.ModuleDict(), lambda d: {})
    head = torch.nn.Linear(trainer.model.config.hidden_size, 1)
    untouched = head.weight.detach().clone()
    rng = random.Random(5)
    seam, seam_after = step(
        torch.nn.ModuleDict({"value": head}), lambda d: {"value_target": [rng.random() for _ in d.tokens]}
    )
    assert plain == seam and plain["train/grad_norm"] > 0
    assert all(torch.equal(plain_after[k], seam_after[k]) for k in plain_after)
    assert any(not torch.equal(plain_after[k], start[k]) for k in start)
    assert torch.equal(head.weight, untouched)


def test_full_weights_in_bfloat16_move_as_in_float32(tiny_model_dir):
    """--lora-rank 0 --dtype bfloat16 at the GiGPO config's lr 1e-6: one train_step moves the weights by what a float32
    step moves them (float32 master weights; bfloat16 weights would round almost every update away: ulp(0.02) is
    ~1.2e-4), while the forward passes compute in bfloat16."""
    moved = {}
    for dtype in ("float32", "bfloat16"):
        args = tempo.Args(model=str(tiny_model_dir), lora_rank=0, dtype=dtype, learning_rate=1e-6)
        accelerator = harness.make_accelerator()
        set_seed(0)
        tokenizer, model, optimizer = samplers.load_model(args, accelerator)
        trainer = types.SimpleNamespace(
            args=args, accelerator=accelerator, tokenizer=tokenizer, model=model, optimizer=optimizer,
            heads=torch.nn.ModuleDict(),
        )  # fmt: skip
        rows, needed = batch(len(tokenizer), seed=6)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([rows[0]])).logits
        assert logits.dtype == getattr(torch, dtype)  # the compute dtype
        datums = [
            training.Datum(tokens=r, old_logprobs=[0.0] * len(r), advantages=[1.0 * n for n in m], mask=[float(n) for n in m])
            for r, m in zip(rows, needed)
        ]
        before = [p.detach().clone() for p in model.parameters()]
        loss = functools.partial(tempo.policy_loss, clip_eps=0.2, clip_eps_high=0.28)
        training.train_step(trainer, datums, loss)
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the master weights
        moved[dtype] = torch.cat([(p.detach() - b).abs().flatten() for p, b in zip(model.parameters(), before)])
    # Adam's first step moves every weight with a gradient by ~lr: the same in both, far from 0
    assert (moved["bfloat16"] > 0).float().mean() > 0.9 * (moved["float32"] > 0).float().mean()
    assert moved["bfloat16"].mean() == pytest.approx(moved["float32"].mean().item(), rel=0.1)
