"""Memory model of one training step on one rank.

:func:`plan_memory` predicts the peak bytes one GPU holds during a training step of a Llama-style decoder
(pre-norm RMSNorm, q/k/v/o projections with optional per-head q/k norms, gated MLP; mixture-of-experts blocks,
:mod:`.moe`, and multi-head latent attention, :func:`.attention.latent_terms`) trained the way this
library trains it: Ulysses attention over ``sp`` ranks, FSDP2 (or DDP) over the whole world ``dp x sp``,
AdamW, bf16 autocast with fp32 master weights (or fp32 throughout), and the long-sequence
:class:`~ulysses_sp.features.Features`. It counts tensors, term by term, at the moments a step can peak
(loss forward, loss backward, the backward of the last decoder layer's MLP and of its attention, under FSDP2
also of layers L-2, 1 and 0, :mod:`.earlier_layers`; the optimizer step) and returns the breakdown of the highest
one in a :class:`MemoryPlan`. Every term says where it comes from; ``tests/unit/test_plan.py`` and ``tests/dist``
hold it against measured peaks (:mod:`..simulate`).

Notation: P = sp, N = full sequence, t = micro_batch x ceil(N / P) tokens on this rank, h = hidden size,
H / Hkv = query / kv heads, d = head dim, I = MLP width, V = vocabulary, L = layers, c = bytes of the
compute dtype (2 for bf16, 4 for fp32), W = dp x sp ranks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..features import Features
from ..head_split import uneven_kv_chunks
from ..layout import choose_layout, resolve_ring_degree
from ..ring import ring_bytes_per_layer
from ..tiled_loss import chunk_bytes_per_logit, loss_chunk_tokens
from ..traffic import ulysses_bytes_per_layer
from .attention import LayerMemory, attention_backward, attention_terms, choose_head_chunks, latent_terms, norm_terms
from .earlier_layers import add_earlier_layers, unsharded_layers
from .host import host_terms
from .mlp import mlp_by_layer, mlp_terms
from .placement import choose_placement, placement_is_chosen
from .shape import ModelShape, model_shape
from .units import GiB

__all__ = ["MemoryPlan", "plan_memory", "planned_layer", "usable_gpu_bytes"]

# What the CUDA context, cuBLAS/NCCL workspaces and the caching allocator's fragmentation take from a GPU:
# usable = memory x (1 - FRAGMENTATION) - CONTEXT_BYTES (on an 80 GiB GPU: 75 GiB).
FRAGMENTATION = 0.05
CONTEXT_BYTES = 1 * GiB


# ---------------------------------------------------------------------------------------------- the plan
_COMPONENTS = (
    "weights",
    "gradients",
    "optimizer",
    "checkpoints",
    "layer_activations",
    "attention",
    "mlp",
    "logits_loss",
    "all_to_all",
    "ring_buffers",
    "rope",
)


@dataclass
class MemoryPlan:
    """Predicted per-GPU bytes at the step's peak, by component, and whether it fits.

    Components (bytes on one GPU at the peak moment ``phase``): ``weights`` (sharded fp32 masters + the
    unsharded compute copies FSDP2 gathers), ``gradients``, ``optimizer`` (AdamW states and step
    temporaries), ``checkpoints`` (the layer inputs kept for recompute), ``layer_activations`` (what the
    layers being held save besides attention and MLP: norms, projection inputs, the gradient stream),
    ``attention`` (q/k/v over the full sequence for H/P heads, output, log-sum-exp, gradients),
    ``mlp``, ``logits_loss``, ``all_to_all`` (Ulysses send/receive buffers), ``ring`` (the ring's k/v blocks in
    flight and fp32 accumulators, hybrid layouts only), ``rope`` (cos/sin). ``comm_bytes_per_layer``: what one
    rank sends per attention layer, forward + backward (Ulysses all-to-all, ring point-to-point).
    """

    model: str
    seq_len: int
    sp: int
    dp: int
    ring: int
    layout_reason: str
    micro_batch: int
    tokens_per_rank: int
    features: Features
    phase: str
    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    checkpoints: int = 0
    layer_activations: int = 0
    attention: int = 0
    mlp: int = 0
    logits_loss: int = 0
    all_to_all: int = 0
    ring_buffers: int = 0
    rope: int = 0
    head_chunks: int = 1  # C, as the attention chooses it (:func:`ulysses_sp.plan.attention.choose_head_chunks`)
    core_slices: int = 1  # the unchunked core's slices of heads (:func:`ulysses_sp.plan.attention.planned_core_slices`)
    comm_bytes_per_layer: dict[str, int] = field(default_factory=dict)
    gpu_memory_bytes: int = 0
    usable_bytes: int = 0
    host_bytes_per_node: int = 0
    host_memory_bytes: int = 0
    host_bytes_per_rank: dict[str, int] = field(default_factory=dict)  # plan/host.py's components, one rank
    phases: dict[str, dict[str, int]] = field(default_factory=dict)  # every moment's breakdown
    checkpoint_choice: str = ""  # where the planner put the checkpoints and why (placement.py), if it chose

    @property
    def peak_bytes(self) -> int:
        return sum(getattr(self, name) for name in _COMPONENTS)

    @property
    def fits_gpu(self) -> bool:
        return self.peak_bytes <= self.usable_bytes

    @property
    def fits_host(self) -> bool:
        return self.host_memory_bytes <= 0 or self.host_bytes_per_node <= self.host_memory_bytes

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    def breakdown(self) -> dict[str, int]:
        """Component -> bytes at the peak (they add up to ``peak_bytes``)."""
        return {name: getattr(self, name) for name in _COMPONENTS}

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "seq_len": self.seq_len,
            "sp": self.sp,
            "ulysses": self.sp // self.ring,
            "ring": self.ring,
            "layout_reason": self.layout_reason,
            "dp": self.dp,
            "micro_batch": self.micro_batch,
            "tokens_per_rank": self.tokens_per_rank,
            "features": asdict(self.features),
            "head_chunks": self.head_chunks,
            "core_slices": self.core_slices,
            "phase": self.phase,
            "breakdown_bytes": self.breakdown(),
            "comm_bytes_per_layer": self.comm_bytes_per_layer,
            "peak_bytes": self.peak_bytes,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "usable_bytes": self.usable_bytes,
            "host_bytes_per_node": self.host_bytes_per_node,
            "host_memory_bytes": self.host_memory_bytes,
            "host_breakdown_bytes": self.host_bytes_per_rank,
            "fits_gpu": self.fits_gpu,
            "fits_host": self.fits_host,
            "fits": self.fits,
            "checkpoint_choice": self.checkpoint_choice,
            "phases_bytes": {name: sum(parts.values()) for name, parts in self.phases.items()},
        }


def usable_gpu_bytes(gpu_memory_bytes: int) -> int:
    """What the tensors of a step may use on a GPU of this size (see FRAGMENTATION / CONTEXT_BYTES)."""
    return max(0, int(gpu_memory_bytes * (1 - FRAGMENTATION)) - CONTEXT_BYTES)


def planned_layer(shape: ModelShape, features: Features) -> tuple[int, LayerMemory]:
    """c and the decoder layer around the attention, for ``shape`` under resolved ``features``, as the attention reads
    it at each call (:mod:`ulysses_sp.head_chunk_choice`): checkpointed unless ``activation_checkpointing`` is "none",
    the model's layers, tiled norms, and under FSDP2 the layer's unsharded gradients (c a parameter: this library's
    FSDP2 casts the unsharded parameters to the compute dtype)."""
    c = 2 if features.dtype == "bf16" else 4
    grads = c * shape.layer_params if features.parallel == "fsdp2" else 0
    return c, LayerMemory(features.activation_checkpointing != "none", shape.num_layers, features.tiled_norms, grads)


def _terms(
    shape: ModelShape, *, seq_len: int, sp: int, ring: int, dp: int, features: Features, micro_batch: int, device: str
):
    """Per-moment component dicts (bytes on this rank), this rank's host bytes by component (plan/host.py), its
    tokens, the head chunks and the core's slices of heads."""
    c, layer = planned_layer(shape, features)  # the layer around the attention, as it reads it at run time
    u = 4 if c < 4 else 0  # an fp32 upcast is a separate tensor only when computing in bf16
    h, d = shape.hidden_size, shape.head_dim
    vocab, layers = shape.vocab_size, shape.num_layers
    heads, kv_heads = shape.num_heads, shape.num_kv_heads
    world = sp * dp
    ulysses = sp // ring
    multiple = sp if ring == 1 else math.lcm(sp, 2 * ring)  # shard_batch pads to it (zigzag with a ring)
    t = micro_batch * math.ceil(seq_len / multiple) * multiple // sp  # tokens on this rank
    params, layer_params, root_params = shape.params, shape.layer_params, shape.root_params
    fsdp = features.parallel == "fsdp2"
    offload_states = features.cpu_offload_optimizer and device == "cuda"

    # --- parameters, gradients, AdamW (FSDP2 over all W ranks; DDP: full replicas) -------------------
    if fsdp:
        # fp32 master shards (1/W of every parameter) + the compute-dtype copies FSDP2 all-gathers: the
        # root (embedding, final norm, untied lm_head) stays unsharded from its forward to the end of
        # backward (FSDP2 does not reshard the root after forward), decoder layers one at a time plus the
        # next one prefetched (below: earlier_layers.unsharded_layers).
        master = 0 if offload_states else 4 * params // world
        weights = master + c * root_params
        # Sharded fp32 grads exist after the reduce-scatters (all of them at the optimizer step). The layer
        # being back-propagated holds its unsharded grads in the compute dtype as they are made: during its
        # MLP's backward the MLP's (plan/mlp.py), during its attention's the MLP's and the attention's. Their fp32
        # copy for the reduce-scatter comes after the layer's activations are freed.
        sharded_grads = 0 if offload_states else 4 * params // world
        layer_grads = layer.grad_bytes  # c * layer_params
        # AdamW exp_avg + exp_avg_sq (fp32, sharded); its foreach step on CUDA makes one more state-sized
        # temporary (sqrt of exp_avg_sq); the CPU for-loop step one per parameter.
        states = 0 if offload_states else 8 * params // world
        step_temp = 0 if offload_states else (4 * params // world if device == "cuda" else 4 * layer_params // world)
    else:
        # DDP: fp32 params everywhere; autocast caches a compute-dtype copy of every weight for the step.
        master = 4 * params
        weights = master + (c * params if c < 4 else 0)
        sharded_grads = 4 * params + 4 * params  # .grad + DDP's gradient buckets
        layer_grads = 0
        states = 8 * params
        step_temp = 4 * params if device == "cuda" else 4 * layer_params
    head_grad = c * vocab * h  # the unsharded lm_head (or tied embedding) gradient, from loss backward on

    # --- activations of one decoder layer, bytes per local token ----------------------------------------
    # Backward runs the layer in reverse: MLP, post-attention norm, o_proj, attention, q/k/v, input norm;
    # what each part saved is freed once its backward is done, so the MLP side and the attention side
    # peak at different moments.
    # The attention block and its exchanges (:mod:`ulysses_sp.plan.attention`), its heads in C chunks.
    requested = uneven_kv_chunks(features.head_chunks, shape.layer_kv_heads)  # 1 where kv heads vary per layer
    chunks = choose_head_chunks(heads, kv_heads, ulysses, tokens=t * ulysses, head_dim=d, element_size=c, hidden=h,
                                ring=ring, device=device, requested=requested, layer=layer)  # fmt: skip
    # the norms' saved tensors and the input norm's output alive through the (re)compute only (plan/attention.py)
    norm_in, norm_post, recomputed_norm_out = norm_terms(c, h, features.tiled_norms)
    if shape.qk_norm:  # per-head q/k norms: fp32 input + normalised copy (their output feeds RoPE, not saved)
        norm_in += (4 + c) * (heads + kv_heads) * d
    latent = latent_terms(shape, c, exchange=ulysses > 1)  # MLA's (plan/attention.py; none for other attention)
    norm_in += latent.saved
    attn = attention_terms(
        heads, kv_heads, d, h, ulysses=ulysses, ring=ring, c=c, device=device, chunks=chunks, tokens=t * ulysses
    )
    slices = attn.slices
    attention_saved, o_proj_input, exchange = attn.saved, attn.o_proj_input, ulysses > 1
    o_proj_input -= latent.o_proj_padding if o_proj_input else 0
    mlp = mlp_terms(shape, features, c=c, u=u, t=t, fsdp=fsdp)  # a gated MLP's or an MoE block's (plan/mlp.py)
    mlp_saved, mlp_backward, mlp_grads = mlp.saved, mlp.backward, mlp.grads
    layer_input = c * h  # a layer's input: the checkpoint, or (fp32 or a tiled norm, no checkpointing) its norm's
    input_saved = layer_input if c == 4 or features.tiled_norms else 0
    per_layer = norm_in + attention_saved + o_proj_input + norm_post + mlp_saved + input_saved
    # The residual stream's gradient and, in the MLP's backward, that of the MLP's input being made. In the
    # attention's backward only the stream's: the output projection's output gradient is that same tensor, and
    # the input's gradient is made after the core's backward and the exchange (measured, C = 1, 2 and 4).
    grad_stream = 2 * c * h
    attention_stream = c * h
    waiting = attention_stream if features.activation_checkpointing != "none" else 0
    rope = 2 * c * (shape.rope_dim or d) * t  # cos and sin [t, d] (MLA: its rotary part), shared by every layer

    # --- what the other layers hold while the last one runs its backward ---------------------------------
    mode, stride = features.activation_checkpointing, min(features.checkpoint_stride or 1, layers)
    kept, regrown = -(-layers // stride), (stride - 1) * layer_input * t  # heads' inputs; a group's recomputed
    if mode == "none":  # every layer keeps everything (and under fp32 its input, saved by its norm)
        checkpoints, others, own_input = 0, ((layers - 1) * per_layer + mlp.others_extra) * t, input_saved * t
    elif mode == "checkpoint" or device == "cpu":  # every kept input stays on the GPU (a CPU's one memory)
        checkpoints, others, own_input = kept * layer_input * t + regrown, 0, 0
    else:  # offload: the input being recomputed (or, in a group, the k - 1 rebuilt from its head) is on the GPU;
        # the next one is fetched once the attention's backward is done (ulysses_sp.offload), after these phases
        checkpoints, others, own_input = max(1, stride - 1) * layer_input * t, 0, 0

    # --- logits and loss --------------------------------------------------------------------------------
    final_norm = (4 + 2 * c) * h * t  # final norm: saved input (fp32: the last layer's output), normalised, output
    norm_after_loss = final_norm  # what of it is left once the loss forward has returned
    if features.tiled_loss:
        chunk = features.loss_chunk_tokens or loss_chunk_tokens(vocab, features.loss_budget_bytes)
        chunk = min(chunk, t)
        # Forward (tiled_loss.kernel: each chunk's gradient made in the forward): the hidden-state gradient
        # [t, h] and the fp32 weight-gradient accumulator [V, h] live from its start, and one chunk's working
        # set on top of them (the blocked weight-gradient product needs less).
        buffers = c * h * t + 4 * vocab * h
        loss_forward = buffers + chunk_bytes_per_logit(c, shape.logit_softcap) * chunk * vocab
        # Backward only scales the buffers in place and, but under fp32, casts the accumulator to the
        # weight's compute dtype. Nothing saved the norm's output: it was freed with the loss forward.
        loss_backward = buffers + (head_grad if c < 4 else 0)
        norm_after_loss = final_norm - c * h * t
    else:
        # lm_head's [t, V] logits, their fp32 copy (a no-op under fp32), log_softmax's saved fp32 output;
        # backward holds three fp32 [t, V] tensors at once (saved log-probs, their gradient, the logits').
        loss_forward = (c + u + 4) * t * vocab
        loss_backward = 12 * t * vocab

    layer = c * layer_params * fsdp  # a decoder layer FSDP2 gathers (DDP's copies are all in `weights`)
    base = {"weights": weights + unsharded_layers(world) * layer, "optimizer": states, "rope": rope}
    base["checkpoints"] = checkpoints
    loss_base = {**base, "weights": weights + layer}  # FSDP2: one layer unsharded (the last)
    all_layers = others + per_layer * t if mode == "none" else 0
    phases = {
        "loss forward": {**loss_base, "layer_activations": all_layers + final_norm, "logits_loss": loss_forward},
        "loss backward": {
            **base,
            # FSDP2 gathers the last layer again once the gradient reaches the model's output: the plain loss's
            # logits, after this moment (measured: only the root is gathered at the log-softmax's backward)
            **({} if features.tiled_loss else {"weights": weights}),
            "gradients": 0 if features.tiled_loss else head_grad,  # tiled: made at its end (in logits_loss)
            "layer_activations": all_layers + norm_after_loss,
            "logits_loss": loss_backward,
        },
        "backward: last layer's MLP": {
            **base,
            "gradients": head_grad + mlp_grads,
            "layer_activations": others + own_input + (norm_in + o_proj_input + norm_post + grad_stream) * t,
            "attention": attention_saved * t,
            "mlp": (mlp_saved + mlp_backward) * t,
        },
        "recompute: last layer's attention": {
            **base,
            "gradients": head_grad,
            # checkpointed: the residual stream's gradient (the layer output's) waits through the recompute for
            # the attention's backward to add to it (measured alive: MLA, sp 2); without, this is the forward
            "layer_activations": others + own_input + (norm_in + recomputed_norm_out + waiting) * t,
            "attention": (attn.forward + latent.forward) * t,
        },
        "backward: last layer's attention": {
            **base,
            "gradients": head_grad + layer_grads,
            "layer_activations": others + own_input + (norm_in + attention_stream) * t,
            "attention": attention_backward(attn, mode, ring) * t,
            "ring_buffers": attn.ring_backward * t,  # the ring's backward instead of the core's
        },
        **(
            {
                "backward: last layer's exchange": {
                    **base,
                    "gradients": head_grad + layer_grads,
                    "layer_activations": others + own_input + (norm_in + attention_stream) * t,
                    "all_to_all": attn.exchange * t,
                }
            }
            if exchange
            else {}
        ),
        "optimizer step": {"weights": master, "gradients": sharded_grads, "optimizer": states + step_temp},
    }
    freed = (per_layer if mode == "none" else layer_input) * t if mode != "offload" or device == "cpu" else 0
    if fsdp:  # the same phases in layers back-propagated later (FSDP2's gradients and reduce-scatter)
        add_earlier_layers(phases, layers=layers, layer_params=layer_params, world=world, c=c,
                           offload_states=offload_states, freed=freed, mode=mode, stride=stride)  # fmt: skip
        mlp_by_layer(phases, mlp, t)  # a layer whose MLP differs from the last one's (an MoE model's dense ones)
    offloaded = kept if mode == "offload" and device == "cuda" else 0  # host: states, checkpoints (.host: pinned)
    host = host_terms(shape, world=world, offload_states=offload_states, checkpoint_bytes=layer_input * t,
                      checkpoints=offloaded)  # fmt: skip
    return phases, host, t, chunks, slices


def _comm_bytes(
    shape: ModelShape, seq_len: int, batch: int, ulysses: int, ring: int, features: Features, chunks: int
) -> dict[str, int]:
    """Bytes one rank sends per attention layer, forward + backward, in the compute dtype (heads in ``chunks``)."""
    c = 2 if features.dtype == "bf16" else 4
    heads = dict(kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, element_size=c, chunks=chunks, fused=ring == 1)
    all_to_all = ulysses_bytes_per_layer(
        batch=batch, seq_len=seq_len // ring, sp=ulysses, heads=shape.num_heads, **heads
    )
    kv_heads = max(shape.num_kv_heads // ulysses, 1)
    forward, backward = ring_bytes_per_layer(
        batch=batch, kv_heads=kv_heads, block_len=seq_len // ring, head_dim=shape.head_dim, ring=ring, element_size=c
    )
    return {"all_to_all": all_to_all, "ring_p2p": forward + backward}


def plan_memory(
    model_config: Any,
    *,
    seq_len: int,
    sp: int = 1,
    dp: int = 1,
    ring: int | None = None,
    gpu_memory_bytes: int = 80 * GiB,
    host_memory_bytes: int = 0,
    gpus_per_node: int | None = None,
    features: Features | None = None,
    micro_batch: int = 1,
    device: str = "cuda",
) -> MemoryPlan:
    """Predict one rank's peak memory for a training step of ``seq_len`` tokens split over ``sp`` ranks.

    Args:
        model_config: a transformers config, a :class:`ModelShape`, or anything :func:`load_model_config`
            accepts (a built-in shape name such as ``"qwen3-4b"``, a config.json, a directory, a hub id).
        seq_len: tokens per sequence (the full sequence, before the split over ``sp``).
        sp, dp: sequence- and data-parallel degrees; FSDP2 shards over ``dp x sp`` ranks.
        ring: the ring degree inside ``sp`` (``sp = ulysses x ring``); None: chosen from the heads and
            ``gpus_per_node`` as ``ulysses-sp train`` does (:func:`ulysses_sp.layout.choose_layout`).
        gpu_memory_bytes: memory of one GPU (the plan fits if its peak is within the usable part).
        host_memory_bytes: host memory per node (0 = unchecked); ``gpus_per_node`` ranks share it
            (default: ``min(dp x sp, 8)``).
        features: :class:`Features` (default: ``Features()``, what ``ulysses-sp train`` runs); ``auto``
            values are resolved for ``device``.
        micro_batch: sequences per micro-batch on each SP group.
        device: "cuda" or "cpu": where the step runs (optimizer temporaries and CPU offload differ).
    """
    shape = model_shape(model_config)
    for name, value in (("seq_len", seq_len), ("sp", sp), ("dp", dp), ("micro_batch", micro_batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if seq_len < sp:
        raise ValueError(f"seq_len ({seq_len}) must be >= sp ({sp}) so that every rank holds a token")
    if gpu_memory_bytes <= 0 or host_memory_bytes < 0:
        raise ValueError(
            f"gpu_memory_bytes must be > 0 and host_memory_bytes >= 0, got {gpu_memory_bytes}, {host_memory_bytes}"
        )
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if ring is None:
        ulysses, ring, reason = choose_layout(sp, shape.num_heads, shape.num_kv_heads, gpus_per_node)
    else:
        ring = resolve_ring_degree(sp, ring, shape.num_heads, shape.num_kv_heads)
        ulysses, reason = sp // ring, f"ulysses {sp // ring} x ring {ring} for sp={sp}: as given"
    features = features or Features()
    if placement_is_chosen(features, device, host_memory_bytes):  # where the checkpoints live, from both budgets
        args = dict(seq_len=seq_len, sp=sp, dp=dp, ring=ring, gpus_per_node=gpus_per_node, micro_batch=micro_batch)
        args.update(gpu_memory_bytes=gpu_memory_bytes, host_memory_bytes=host_memory_bytes, device=device)
        return choose_placement(features, shape.num_layers, functools.partial(plan_memory, shape, **args))
    features = features.resolve(device)
    phases, host, tokens, chunks, slices = _terms(
        shape, seq_len=seq_len, sp=sp, ring=ring, dp=dp, features=features, micro_batch=micro_batch, device=device
    )
    breakdowns = {name: {k: int(v) for k, v in parts.items()} for name, parts in phases.items()}
    phase = max(breakdowns, key=lambda name: sum(breakdowns[name].values()))
    ranks_on_node = gpus_per_node or min(sp * dp, 8)
    return MemoryPlan(
        model=shape.name,
        seq_len=seq_len,
        sp=sp,
        dp=dp,
        ring=ring,
        layout_reason=reason,
        micro_batch=micro_batch,
        tokens_per_rank=tokens,
        head_chunks=chunks,
        core_slices=slices,
        comm_bytes_per_layer=_comm_bytes(
            shape, tokens * sp // micro_batch, micro_batch, ulysses, ring, features, chunks
        ),
        features=features,
        phase=phase,
        gpu_memory_bytes=gpu_memory_bytes,
        usable_bytes=usable_gpu_bytes(gpu_memory_bytes) if device == "cuda" else gpu_memory_bytes,
        host_bytes_per_node=sum(host.values()) * min(ranks_on_node, sp * dp),
        host_memory_bytes=host_memory_bytes,
        host_bytes_per_rank=host,
        phases=breakdowns,
        **breakdowns[phase],
    )
