"""Models for ``ulysses-sp train``: built-in demo configs, loading, and wrapping with FSDP2 or DDP.

``--model`` is a Hugging Face hub id, a local directory, or a shape of :data:`ulysses_sp.shapes.SHAPES` (built
from a config with random weights, seeded by ``--seed``; the demo Llamas sized for the embedded tokenizer).

FSDP2 (the default, the ZeRO-3 equivalent): rank 0 materialises the full model on CPU (pretrained weights
or the seeded random init); every rank builds the same architecture on the ``meta`` device (no memory),
parallelizes it, turns on the memory features (tiled loss, tiled MLP, activation checkpointing or
offload) and shards it with ``fully_shard`` per decoder layer and
then at the root, over a 1-D mesh of ALL ranks (dp x sp: the loss's gradient convention wants the average
over the whole world). The shards are then allocated and filled from rank 0 by broadcast, so at most one
full copy ever exists, on rank 0's CPU. Buffers that are not in the state dict (RoPE frequencies) are
broadcast from rank 0 too.

DDP: every rank builds the full model (same files or same seed) and DDP over the world broadcasts rank 0's
state when it wraps the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ulysses_sp.attention import check_ring_core
from ulysses_sp.cores import check_core_trains, get_core
from ulysses_sp.features import apply_features, bf16_error, bf16_missing, cli_switch
from ulysses_sp.fsdp import fully_shard_layers
from ulysses_sp.head_split import check_head_chunks, uneven_kv_chunks
from ulysses_sp.hf import head_counts, layer_kv_heads, layer_values
from ulysses_sp.layout import ParallelLayout, choose_layout, resolve_ring_degree
from ulysses_sp.model import parallelize
from ulysses_sp.shapes import EMBEDDED_VOCAB_SIZE, SHAPES, TOKENIZER_SIZED_SHAPES, random_model, shape_config
from ulysses_sp.train.config import TrainConfig
from ulysses_sp.train.errors import first_line
from ulysses_sp.train.hub import HubProbe

__all__ = [
    "build_model",
    "hf_model_config",
    "choose_run_layout",
    "resolve_dtype",
    "resolve_ring",
    "tokenizer_source",
    "training_flops_per_token",
]

_CORE_NAMES = {"sdpa": "sdpa", "eager": "eager", "flex": "flex_attention", "flash": "flash_attention_2"}


def tokenizer_source(config: TrainConfig) -> str | None:
    """What to pass to ``load_tokenizer``: ``--tokenizer``, else the model's own, else None (embedded)."""
    if config.tokenizer is not None:
        return config.tokenizer
    return None if config.model in SHAPES else config.model


def _check_shape_vocab(name: str, tokenizer: Any) -> None:
    """A built-in shape whose fixed vocabulary is smaller than the tokenizer (a benchmark shape): ValueError naming
    the shapes that fit (before its config is built with token ids outside that vocabulary)."""
    vocab = SHAPES[name]["vocab_size"]
    if tokenizer is None or name in TOKENIZER_SIZED_SHAPES or vocab >= len(tokenizer):
        return
    tokens = len(tokenizer)
    fits = [shape for shape in SHAPES if shape in TOKENIZER_SIZED_SHAPES or SHAPES[shape]["vocab_size"] >= tokens]
    raise ValueError(
        f"--model {name!r} is a built-in shape with a vocabulary of {vocab}, smaller than the tokenizer's {tokens} "
        f"tokens (--tokenizer); train a built-in shape that fits it ({', '.join(fits)}), or give a --tokenizer of "
        f"at most {vocab} tokens"
    )


def check_model_reachable(name: str, hub: HubProbe | None = None) -> None:
    """ValueError naming ``--model`` when ``name`` is a path that does not exist, or an id that is neither cached nor
    servable by an unreachable Hub (in seconds: not after the hub client's retries). ``hub``: the run's probe of
    the Hub (its answer for ``name`` reused); None = ask afresh."""
    if name.startswith((".", "/", "~")) and not Path(name).expanduser().exists():
        raise ValueError(f"--model {name!r}: no such directory; give a model directory, a hub id or a built-in name")
    offline = (hub or HubProbe()).unreachable(name)
    if offline is not None:
        raise ValueError(
            f"--model: {offline}; give a local model directory, download it first, or a built-in name: "
            f"{', '.join(SHAPES)}"
        )


def hf_model_config(
    config: TrainConfig, tokenizer: Any = None, source: str | None = None, hub: HubProbe | None = None
) -> Any:
    """The transformers config of the model to train.

    ``source`` (a checkpoint when resuming) wins; else ``--model``: a built-in name (sized for
    ``tokenizer``, the embedded GPT-2 BPE when None) or anything ``AutoConfig`` loads. Raises ValueError
    naming ``--model`` when it cannot be loaded. ``hub``: the run's probe of the Hub (:func:`check_model_reachable`).
    """
    if source is None and config.model in SHAPES:
        _check_shape_vocab(config.model, tokenizer)
        special = {"bos_token_id": None, "eos_token_id": EMBEDDED_VOCAB_SIZE - 1, "pad_token_id": None}
        if tokenizer is not None:
            special = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}
        sized = tokenizer is not None and config.model in TOKENIZER_SIZED_SHAPES
        sized = {"vocab_size": len(tokenizer)} if sized else {}
        return shape_config(
            config.model,
            **special,
            **sized,
            max_position_embeddings=max(config.schedule().max_seq_len, 2048),
        )
    from transformers import AutoConfig

    from ..hf import config_size_problem

    name = source or config.model
    check_model_reachable(name, hub)
    try:
        loaded = AutoConfig.from_pretrained(name)
    except Exception as error:  # noqa: BLE001 (a file's content: transformers' validators raise their own types)
        builtins, cause = ", ".join(SHAPES), first_line(error, innermost=False)
        raise ValueError(
            f"--model {source or config.model!r} cannot be loaded ({cause}); give a Hugging Face id that is cached "
            f"or reachable, a local model directory, or a built-in name: {builtins}"
        ) from None
    problem = config_size_problem(loaded)
    if problem is not None:
        raise ValueError(f"--model {source or config.model!r}: {problem}")
    return loaded


def choose_run_layout(
    config: TrainConfig, hf_config: Any | None = None, gpus_per_node: int | None = None
) -> tuple[int, str]:
    """``(ring degree, reason)`` of the run: ``--ring``, or chosen from the model's heads and the node size
    (:func:`ulysses_sp.layout.choose_layout`: the all-to-alls inside a node, the ring across nodes; pure Ulysses
    whenever the heads allow it). ValueError naming the flags when the heads do not fit the layout or
    ``--head-chunks``.
    ``gpus_per_node``: ``--gpus-per-node`` when given; None = no topology limit."""
    text_config = (hf_config if hf_config is not None else hf_model_config(config)).get_text_config()
    num_heads = getattr(text_config, "num_attention_heads", None)
    if num_heads is None:
        raise ValueError(f"--model {config.model!r}: its config has no num_attention_heads; is it a decoder LM?")
    node = config.gpus_per_node or gpus_per_node
    kv_heads = head_counts(text_config)[1]  # the fewest of any layer where they vary per layer (Gemma-4)
    try:
        if config.ring is None:
            _, ring, reason = choose_layout(config.sp, num_heads, kv_heads, node)
        else:
            ring = resolve_ring_degree(config.sp, config.ring, num_heads, kv_heads)
            reason = f"ulysses {config.sp // ring} x ring {ring} for sp={config.sp}: --ring {ring}"
    except ValueError as error:
        flags = f"--sp {config.sp}" + (f" --ring {config.ring}" if config.ring is not None else "")
        raise ValueError(f"{flags} does not fit --model {config.model!r}: {error}") from None
    try:
        check_ring_core(_CORE_NAMES[config.attn_core], ring)
    except ValueError as error:
        chosen = "--ring" if config.ring is not None else f"the ring chosen from the heads ({num_heads} heads, --sp)"
        raise ValueError(f"--attn-core {config.attn_core}: {error} (the ring comes from {chosen})") from None
    try:
        check_head_chunks(config.head_chunks, num_heads, kv_heads, config.sp // ring)
        uneven_kv_chunks(config.head_chunks, layer_kv_heads(text_config))  # (as parallelize will: before any rank)
    except ValueError as error:
        raise ValueError(f"--head-chunks {config.head_chunks} with --sp {config.sp}: {error}") from None
    return ring, reason


def check_attn_core(config: TrainConfig) -> None:
    """ValueError naming ``--attn-core`` when its core cannot train on this machine, before any rank starts: a flash
    core without its package or a GPU, and flex without a GPU (:func:`ulysses_sp.cores.check_core_trains`)."""
    name, device_type = _CORE_NAMES[config.attn_core], "cuda" if torch.cuda.is_available() else "cpu"
    try:
        get_core(name, instead="--attn-core sdpa")
        check_core_trains(name, device_type, instead="--attn-core sdpa")
    except ValueError as error:
        raise ValueError(f"--attn-core {config.attn_core}: {error}") from None


def resolve_ring(config: TrainConfig, hf_config: Any | None = None, gpus_per_node: int | None = None) -> int:
    """The ring degree of the run (see :func:`choose_run_layout`)."""
    return choose_run_layout(config, hf_config, gpus_per_node)[0]


def training_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward, no recompute): ``6 N + 6 L H d T``.

    ``N`` counts the parameters that multiply activations (the embedding table only when tied to the
    output layer, where it does the lm_head matmul); the second term is causal attention over a sequence
    of ``T = seq_len`` tokens (an upper bound for packed documents, which attend within themselves).
    """
    text_config = model.config.get_text_config()
    params = {id(p): p.numel() for p in model.parameters()}
    matmul_params = sum(params.values())
    embedding = model.get_input_embeddings().weight
    if getattr(text_config, "tie_word_embeddings", False) is False:
        matmul_params -= embedding.numel()
    heads = text_config.num_attention_heads
    layers = text_config.num_hidden_layers
    head_dims = layer_values(text_config, "head_dim") or [getattr(text_config, "head_dim", None)] * layers
    attention = 6 * heads * sum(d or text_config.hidden_size // heads for d in head_dims) * seq_len
    return float(6 * matmul_params + attention)


def place_checkpoints(
    config: TrainConfig, hf_config: Any, *, layout: ParallelLayout, gpu_memory_bytes: int, gpus_per_node: int
) -> tuple[TrainConfig, str]:
    """``config`` with the checkpoints' place and stride the planner chooses for GPUs of ``gpu_memory_bytes``
    and ``--host-memory`` (:mod:`ulysses_sp.plan.placement`), and the line that reports it; ``config``
    unchanged and "" where it does not choose (a CPU, no ``--host-memory``, or the place or stride given)."""
    from ulysses_sp.plan import plan_memory
    from ulysses_sp.plan.placement import placement_is_chosen

    if not placement_is_chosen(config, layout.device.type, config.host_memory_bytes):
        return config, ""
    plan = plan_memory(
        hf_config,
        seq_len=max(length for length, _ in config.schedule().stages),
        sp=layout.sp,
        dp=layout.dp,
        ring=layout.ring,
        gpu_memory_bytes=gpu_memory_bytes,
        host_memory_bytes=config.host_memory_bytes,
        gpus_per_node=gpus_per_node,
        features=config.features(),
        micro_batch=config.batch_size,
    )
    chosen = plan.features
    placed = dataclasses.replace(
        config, activation_checkpointing=chosen.activation_checkpointing, checkpoint_stride=chosen.checkpoint_stride
    )
    return placed, f"checkpoints: {plan.checkpoint_choice}"


def resolve_dtype(config: TrainConfig, layout: ParallelLayout) -> tuple[TrainConfig, str]:
    """``config`` with ``--dtype`` made concrete for the world's GPUs, and the line that reports it. One dtype for
    every rank (FSDP2 gathers in it): 'auto' is fp32 on a CPU or when any rank's GPU has no native bf16
    (:func:`ulysses_sp.features.bf16_missing`), bf16 otherwise; ``--dtype bf16`` on such a GPU is a ValueError
    on every rank naming it. Called by every rank."""
    missing = bf16_missing(layout.device) if config.dtype != "fp32" else None
    if layout.device.type == "cuda" and config.dtype != "fp32" and layout.world_size > 1:
        found: list[str | None] = [None] * layout.world_size
        dist.all_gather_object(found, missing)
        rank = next((rank for rank, gpu in enumerate(found) if gpu), None)
        missing = None if rank is None else f"rank {rank}'s GPU, {found[rank]},"
    if config.dtype == "bf16" and missing:
        raise ValueError(bf16_error(missing))
    if config.dtype != "auto":
        return config, f"dtype: {config.dtype} (--dtype {config.dtype})"
    dtype = "fp32" if missing or layout.device.type == "cpu" else "bf16"  # (as Features.resolve, for the world)
    why = f"{missing} has no native bf16" if missing else ("on CPU" if dtype == "fp32" else "GPUs with native bf16")
    return dataclasses.replace(config, dtype=dtype), f"dtype: {dtype} (--dtype auto: {why})"


def smallest_gpu_memory(layout: ParallelLayout) -> int:
    """The memory of the smallest GPU in the world (every rank must choose alike); 0 on a CPU."""
    if layout.device.type != "cuda":
        return 0
    memory = torch.tensor([torch.cuda.get_device_properties(layout.device).total_memory], device=layout.device)
    dist.all_reduce(memory, op=dist.ReduceOp.MIN)
    return int(memory.item())


def _full_model(config: TrainConfig, hf_config: Any, source: str | None) -> nn.Module:
    """The full fp32 model on CPU: from ``source`` (pretrained files) or a seeded random init."""
    from transformers import AutoModelForCausalLM

    if source is not None:  # the config the run resolved (not read again from the files)
        return AutoModelForCausalLM.from_pretrained(
            source, config=hf_config, dtype=torch.float32, attn_implementation="sdpa"
        )
    return random_model(hf_config, seed=config.seed)


def _prepare(model: nn.Module, config: TrainConfig, layout: ParallelLayout) -> None:
    """Ulysses attention and the long-sequence memory features, before any wrapping."""
    model.config.use_cache = False
    parallelize(model, layout, core=_CORE_NAMES[config.attn_core], head_chunks=config.head_chunks)
    apply_features(model, config, layout.device.type, switch=cli_switch)


def build_model(
    config: TrainConfig,
    layout: ParallelLayout,
    hf_config: Any,
    source: str | None,
    *,
    wait: Callable[[], None] | None = None,
) -> tuple[nn.Module, nn.Module]:
    """Build, parallelize and wrap the model; returns ``(wrapped, hf_model)``.

    ``source`` is a directory or hub id with pretrained weights (a checkpoint when resuming), or None for a
    random init; ``hf_config`` is its config (see :func:`hf_model_config`). ``hf_model`` is the
    transformers model inside the wrapper (the same object under FSDP2), whose ``save_pretrained`` writes
    the checkpoints. ``wait`` (a barrier with a long timeout) is called once rank 0 holds the full model,
    so slow loading on rank 0 never runs into the collective timeout of the other ranks.
    """
    device = layout.device
    compute_dtype = config.torch_dtype(device)
    if config.parallel == "ddp":
        model = _full_model(config, hf_config, source).to(device)
        _prepare(model, config, layout)
        if layout.world_size == 1:
            return model, model
        device_ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids), model

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = _full_model(config, hf_config, source) if layout.is_main else None
    if wait is not None:
        wait()
    model = random_model(hf_config, device="meta")
    _prepare(model, config, layout)
    offload = config.cpu_offload_optimizer and device.type == "cuda"
    fully_shard_layers(model, device, layout.world_size, compute_dtype=compute_dtype, offload_to_cpu=offload)
    model.to_empty(device="cpu" if offload else device)
    set_model_state_dict(
        model,
        full.state_dict() if full is not None else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    _broadcast_buffers(model, full, device, layout)
    return model, model


def _broadcast_buffers(model: nn.Module, full: nn.Module | None, device: torch.device, layout: ParallelLayout) -> None:
    """Give every rank rank 0's buffers (e.g. RoPE ``inv_freq``, which no state dict holds), on ``device``."""
    source = dict(full.named_buffers()) if full is not None else {}
    for module_name, module in model.named_modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is None:
                continue
            qualified = f"{module_name}.{name}" if module_name else name
            value = source[qualified].to(device) if full is not None else torch.empty_like(buffer, device=device)
            if layout.world_size > 1:
                dist.broadcast(value, src=0)
            module._buffers[name] = value
