"""What a run needs before it starts: each process's share of the run's counts, and --plan's memory, disk and tokens.

Between training.py and harness.py: harness checks the shares at start and prints the plan; nothing here loads
weights (the model's config only).
"""

from __future__ import annotations

import dataclasses
import sys


def process_shares(args, processes: int) -> dict[str, int]:
    """Each count of the run in its Args' GLOBAL_COUNTS (games per update, ...) -> this process's share: the counts
    are the run's, whatever the process count; one that does not divide among the processes is refused, with the fix."""
    shares = {}
    for name in type(args).GLOBAL_COUNTS:
        count = getattr(args, name)
        if count % processes:
            lower, upper = processes * (count // processes), processes * (count // processes + 1)
            fits = f"{lower} or {upper}" if lower else str(upper)
            raise ValueError(
                f"--{name.replace('_', '-')} {count} is the run's count, split among {processes} processes, and does "
                f"not divide: pass a multiple of {processes} ({fits}) or launch a process count that divides it"
            )
        shares[name] = count // processes
    return shares


GIB = 2**30
ENGINE_RESERVE_GIB = 2.0  # assumed: what a vLLM engine holds beside weights and KV cache (CUDA graphs, activations)
LOGITS_CHUNK = 256  # positions whose logits the training step holds at once (training.forward_logprobs)


@dataclasses.dataclass
class Shape:
    """What the plan reads of a model's config: its sizes, and its parameters counted on the meta device."""

    parameters: int
    lora_parameters: int  # of an adapter of --lora-rank on --lora-targets
    layers: int
    attention_layers: int  # layers that keep a KV cache (full attention)
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    targeted_inputs: int  # per layer: the input features of the Linear modules LoRA targets (peft casts them to fp32)


def model_shape(config, lora_rank: int, lora_targets) -> Shape:
    """The Shape of a transformers config: the model built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config(decoder=True)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    targeted = [m for n, m in linears if n.split(".")[-1] in lora_targets and ".layers." in n]
    heads = text.num_attention_heads
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return Shape(
        parameters=sum(p.numel() for p in model.parameters()),
        lora_parameters=sum(lora_rank * (m.in_features + m.out_features) for m in targeted),
        layers=text.num_hidden_layers,
        attention_layers=sum(kind == "full_attention" for kind in layer_types),
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab=text.vocab_size,
        targeted_inputs=sum(m.in_features for m in targeted) // text.num_hidden_layers,
    )


def activation_bytes(shape: Shape, tokens: int, lora: bool, checkpointing: bool, width: int = 2) -> float:
    """Activations a forward pass keeps for its backward, for `tokens` tokens. Per token and layer, in the compute
    dtype (`width` bytes): the layer input and its norm, q, k, v, the attention output, the residual and its norm, and
    the MLP's gate, up, act(gate) and product: 4h + 2 q + 2 kv + 4 I values (flash/SDPA attention keeps no score
    matrix); LoRA adds the fp32 copy of every targeted module's input (peft casts it to the adapter's dtype). With
    checkpointing each layer keeps only its input, and one layer's activations are rebuilt at a time. Plus the logits
    of LOGITS_CHUNK positions in fp32 (and their log-softmax)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    layer = width * (4 * shape.hidden + 2 * q + 2 * kv + 4 * shape.intermediate) + 4 * shape.targeted_inputs * lora
    logits = LOGITS_CHUNK * shape.vocab * 4 * 2
    if checkpointing:
        return tokens * (width * shape.hidden * shape.layers + layer) + logits
    return tokens * layer * shape.layers + logits


def run_updates(args) -> int:
    """The run's updates: the sum of its Args' UPDATE_COUNTS (--num-updates; tempo.py: warm-up and TD updates)."""
    return sum(getattr(args, name) for name in type(args).UPDATE_COUNTS)


def memory_plan(args, shape: Shape, processes: int, gpu_gib: float | None) -> dict:
    """The run's figures per GPU (one process each, on CUDA), in GiB unless named otherwise: trainer weights, gradients
    and AdamW state, activations with and without checkpointing, the engine's share and the KV tokens it holds, the
    peaks while training and while sampling, checkpoint size and disk, tokens per update. Full weights train with fp32
    master weights under bf16 compute (--dtype auto): 2 + 4 bytes a parameter, 4 of gradients, 8 of AdamW; a LoRA
    adapter is fp32 (peft's default) over bf16 base weights. --fsdp shards all but the bf16 weights (gathered whole
    between updates, for sampling). --sampler auto is the vLLM engine (CUDA with vLLM installed)."""
    bf16 = args.dtype != "float32"
    width, lora = (2 if bf16 else 4), args.lora_rank > 0
    trained = shape.lora_parameters if lora else shape.parameters
    shard = processes if args.fsdp else 1
    master = 4 if bf16 and not lora else 0  # fp32 copy of weights trained in bf16
    plan = {
        "weights": (shape.parameters * width + trained * ((4 if lora else 0) + master) / shard) / GIB,
        "gradients": trained * 4 / shard / GIB,
        "adamw": trained * 8 / shard / GIB,
    }
    tokens = max(args.micro_batch_tokens, args.max_trajectory_tokens)  # a longer episode is a micro-batch alone
    plan["micro_batch_tokens"] = tokens
    for name, on in (("activations_checkpointed", True), ("activations_kept", False)):
        plan[name] = activation_bytes(shape, tokens, lora, on, width) / GIB
    checkpointing = args.gradient_checkpointing != "off"
    activations = plan["activations_checkpointed" if checkpointing else "activations_kept"]
    plan["training_peak"] = plan["weights"] + plan["gradients"] + plan["adamw"] + activations
    kv_token = 2 * shape.attention_layers * shape.kv_heads * shape.head_dim * width  # bytes: keys and values
    plan["kv_bytes_per_token"] = kv_token
    resident = plan["weights"] + plan["adamw"]
    if args.sampler in ("auto", "vllm-colocate"):
        share = args.vllm_gpu_memory_utilization * (gpu_gib or 0.0)
        plan["engine"] = share
        free = share - shape.parameters * width / GIB - ENGINE_RESERVE_GIB  # the engine's KV cache
        plan["engine_kv_tokens"] = max(0.0, free) * GIB / kv_token
        plan["sampling_peak"] = resident + share
    elif args.sampler == "vllm":
        plan["engine"], plan["engine_kv_tokens"], plan["sampling_peak"] = 0.0, 0.0, resident
    else:  # generate(): one batch of prompts at the budget, and the KV caches kept between turns
        kv = args.sample_batch_size * args.max_trajectory_tokens * kv_token / GIB + args.kv_cache_mb / 1024
        plan["engine"], plan["engine_kv_tokens"], plan["sampling_peak"] = kv, kv * GIB / kv_token, resident + kv
    plan["episodes_at_once"] = plan["engine_kv_tokens"] / args.max_trajectory_tokens
    episodes = args.groups_per_update * args.group_size
    turns = getattr(args, "macro_rounds", args.max_turns)  # tempo.py's TD update plays one macro step
    plan["episodes_per_update"] = episodes
    plan["sampled_tokens_per_update"] = episodes * min(turns * args.max_turn_tokens, args.max_trajectory_tokens)
    plan["trained_tokens_per_update"] = episodes * args.max_trajectory_tokens
    saved_width = 4 if lora else width
    plan["checkpoint"] = trained * (saved_width + 8 + master) / GIB
    updates = run_updates(args)
    saved = updates // args.save_every + bool(updates % args.save_every) if args.save_every else 1
    keep = args.keep_checkpoints
    plan["checkpoints_saved"], plan["checkpoints_on_disk"] = saved, min(saved, keep + 1) if keep else saved
    plan["disk"] = plan["checkpoint"] * plan["checkpoints_on_disk"]
    if gpu_gib:
        plan["fits"] = max(plan["training_peak"], plan["sampling_peak"]) <= gpu_gib and (
            plan["episodes_at_once"] >= 1 or args.sampler == "vllm"
        )
    return plan


def advice(args, plan: dict, gpu_gib: float) -> str:
    """What to change when the plan does not fit: the flag that bounds the part that overflows."""
    if plan["training_peak"] > gpu_gib:
        if args.gradient_checkpointing == "off":
            return "--gradient-checkpointing on"
        fixes = "lower --micro-batch-tokens (and --max-trajectory-tokens, a micro-batch's floor)"
        return fixes + ("" if args.fsdp else ", --fsdp over several GPUs") + ("" if args.lora_rank else ", or LoRA")
    if plan["sampling_peak"] > gpu_gib:
        return "lower --vllm-gpu-memory-utilization" if plan["engine"] else "lower --sample-batch-size / --kv-cache-mb"
    return "raise --vllm-gpu-memory-utilization or lower --max-trajectory-tokens (the engine holds no whole episode)"


def plan_text(args, plan: dict, shape: Shape, processes: int, gpu_gib: float | None) -> str:
    """The plan as printed by --plan."""
    lora = f"LoRA r{args.lora_rank}: {shape.lora_parameters / 1e6:.1f}M trained" if args.lora_rank else "every weight"
    engine = {
        "generate": "generate(): --sample-batch-size prompts at the budget, and --kv-cache-mb",
        "vllm": "a vLLM server on other GPUs",
    }.get(args.sampler, f"vLLM engine, --vllm-gpu-memory-utilization {args.vllm_gpu_memory_utilization}")
    lines = [
        f"plan: {args.model}: {shape.parameters / 1e9:.2f}B parameters, {shape.layers} layers, hidden {shape.hidden}, "
        f"{shape.kv_heads} KV heads x {shape.head_dim}; {processes} process(es), one a GPU of "
        + (f"{gpu_gib:.0f} GiB" if gpu_gib else "? GiB (no GPU visible: pass --plan-gpu-memory-gb)"),
        f"  per update (the run's; each process 1/{processes}): {plan['episodes_per_update']} episodes; at most "
        f"{plan['sampled_tokens_per_update'] / 1e6:.2f}M tokens sampled, "
        f"{plan['trained_tokens_per_update'] / 1e6:.2f}M forwarded in training (whole episodes; the sampled ones train)",
        f"  trainer ({lora}): weights {plan['weights']:.1f} GiB, gradients {plan['gradients']:.2f}, "
        f"AdamW {plan['adamw']:.2f}",
        f"  activations of a {plan['micro_batch_tokens']:,}-token micro-batch: {plan['activations_checkpointed']:.1f} "
        f"GiB with gradient checkpointing, {plan['activations_kept']:.1f} without "
        f"(--gradient-checkpointing {args.gradient_checkpointing})",
        f"  sampler ({engine}): {plan['engine']:.1f} GiB, KV cache for {plan['engine_kv_tokens'] / 1e3:,.0f}k tokens "
        f"({plan['kv_bytes_per_token'] / 1024:.0f} KiB a token) = {plan['episodes_at_once']:.1f} episodes of "
        f"--max-trajectory-tokens {args.max_trajectory_tokens:,} at once",
        f"  peak per GPU: {plan['training_peak']:.1f} GiB while training, {plan['sampling_peak']:.1f} while sampling",
        f"  checkpoints: {plan['checkpoint']:.2f} GiB each, {plan['checkpoints_saved']} saved (--save-every "
        f"{args.save_every} over {run_updates(args)} updates), at most {plan['checkpoints_on_disk']} on disk "
        f"(--keep-checkpoints {args.keep_checkpoints}): {plan['disk']:.1f} GiB",
    ]
    if gpu_gib:
        lines.append("  fits" if plan["fits"] else f"  does NOT fit: {advice(args, plan, gpu_gib)}")
    return "\n".join(lines)


def run_plan(args, processes: int) -> tuple[dict, str]:
    """(the figures, the text) of the run's plan for `processes` GPUs of --plan-gpu-memory-gb (0: the visible
    device's; none visible: the fit is not judged), from the model's config."""
    import torch

    import samplers

    process_shares(args, processes)  # the counts must divide among them
    gpu_gib = args.plan_gpu_memory_gb or (
        torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None
    )
    shape = model_shape(samplers.model_config(args.model), args.lora_rank, args.lora_targets)
    figures = memory_plan(args, shape, processes, gpu_gib)
    return figures, plan_text(args, figures, shape, processes, gpu_gib)


def warn_if_it_does_not_fit(args, processes: int) -> None:
    """On CUDA, at start: one warning, with the plan, when the plan says the run does not fit the visible GPU (an
    estimate: it never stops a run); a model the plan cannot read is said, not fatal."""
    try:
        figures, text = run_plan(args, processes)
    except Exception as error:  # a config the meta-device build does not take: the run goes on without a plan
        print(f"[start] no memory plan ({type(error).__name__}: {error})", file=sys.stderr)
        return
    if figures.get("fits") is False:
        print(f"[start] WARNING: by --plan's estimate the run does not fit the GPU:\n{text}", file=sys.stderr)
