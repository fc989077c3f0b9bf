"""The sizes the memory model needs, read from a transformers config (or a named shape, a config.json, a directory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .moe import MoeShape

__all__ = ["ModelShape", "load_model_config", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes the memory model needs, read from a transformers config."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma3)
    attention_bias: bool = False
    logit_softcap: bool = False  # final_logit_softcapping (Gemma 2/3): the tiled loss holds its slope too
    name: str = ""
    # counted on the model built on the meta device for MoE and MLA models (None: the dense formulas below): every
    # parameter, and the largest decoder layer's (an MoE layer's experts, MLA's projections)
    counted_params: int | None = None
    counted_layer_params: int | None = None
    counted_root_params: int | None = None  # outside the decoder layers
    counted_tensors: tuple[tuple[int, int, int], ...] | None = None  # (rows, row elements, count): param_tensors
    notes: tuple[str, ...] = ()  # where this shape only approximates the model (printed by plan)
    layer_kv_heads: tuple[int, ...] = ()  # the distinct kv head counts where they vary per layer (run unchunked)
    moe: MoeShape | None = None  # the MoE blocks' sizes (None: every layer a dense MLP of intermediate_size)
    # multi-head latent attention (DeepSeek-V2/V3): the q and kv low-rank widths (q 0: a full q_proj), the rotary
    # part of a q/k head and the v head width (0: head_dim)
    q_rank: int = 0
    kv_rank: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0

    @classmethod
    def from_config(cls, config: Any, name: str = "") -> ModelShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        from ..hf import layer_kv_heads, layer_values  # (imports torch: not for `plan --help`)

        heads = text.num_attention_heads
        head_dim = _widest(text, "head_dim") or text.hidden_size // heads
        notes = []
        varying = [name for name in ("head_dim", "num_key_value_heads") if layer_values(text, name) is not None]
        if varying:  # Gemma-4: its global layers' heads are wider and fewer than its sliding ones'
            notes.append(
                f"{' and '.join(varying)} vary per layer: every layer modelled with the largest (head_dim "
                f"{head_dim}, {_widest(text, 'num_key_value_heads') or heads} kv heads), parameters counted on the "
                "model (approximate)"
            )
        qk_width = (getattr(text, "qk_nope_head_dim", None) or 0) + (getattr(text, "qk_rope_head_dim", None) or 0)
        v_width = getattr(text, "v_head_dim", None) or 0
        if qk_width:  # MLA: q/k heads of nope + rope dims (config.head_dim is the rope part); v padded to them
            head_dim = max(qk_width, v_width)
            notes.append(
                f"multi-head latent attention: its heads modelled as q/k/v of width {head_dim} (the q/k head; v is "
                "padded to it in the exchange), its low-rank projections' activations as its RMSNorms keep them"
            )
        mlp = _mlp_width(text)
        # the dense formulas fit a dense decoder (plan then imports no model code); MoE and MLA layers are counted
        counted = _counted_params(config, text.num_hidden_layers, mlp) if mlp.note or qk_width or varying else None
        moe = counted[4] if counted else None
        if counted is not None and counted[5] is False:  # experts configured, but every layer runs a dense MLP
            mlp = _MlpWidth(mlp.dense)
        if mlp.note:
            notes.append(mlp.note + (_moe_modelled(text) if moe is not None else _MOE_APPROXIMATE.format(mlp.width)))
        if counted is None and mlp.note:
            notes.append("parameters from a dense layer's formula (one expert's MLP): the model could not be built")
        return cls(
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=_widest(text, "num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=mlp.width,
            vocab_size=text.vocab_size,
            tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
            qk_norm=getattr(text, "model_type", "") in ("qwen3", "qwen3_moe", "gemma3_text", "gemma3"),
            attention_bias=bool(getattr(text, "attention_bias", False)),
            logit_softcap=bool(getattr(text, "final_logit_softcapping", None)),
            name=name or getattr(config, "_name_or_path", "") or getattr(text, "model_type", ""),
            counted_params=counted[0] if counted else None,
            counted_layer_params=counted[1] if counted else None,
            counted_root_params=counted[2] if counted else None,
            counted_tensors=counted[3] if counted else None,
            layer_kv_heads=tuple(layer_kv_heads(text)),
            notes=tuple(notes),
            moe=moe,
            q_rank=(getattr(text, "q_lora_rank", None) or 0) if qk_width else 0,
            kv_rank=(getattr(text, "kv_lora_rank", None) or 0) if qk_width else 0,
            rope_dim=(getattr(text, "qk_rope_head_dim", None) or 0) if qk_width else 0,
            v_head_dim=v_width if qk_width else 0,
        )

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (the largest): counted, or q/k/v/o, gated MLP, two RMSNorms (+ q/k norms,
        biases)."""
        if self.counted_layer_params is not None:
            return self.counted_layer_params
        h, d = self.hidden_size, self.head_dim
        qkv_width = (self.num_heads + 2 * self.num_kv_heads) * d
        attention = h * qkv_width + self.num_heads * d * h + (qkv_width if self.attention_bias else 0)
        return attention + 3 * h * self.intermediate_size + 2 * h + (2 * d if self.qk_norm else 0)

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embedding, final norm, lm_head unless tied."""
        if self.counted_root_params is not None:
            return self.counted_root_params
        embedding = self.vocab_size * self.hidden_size
        return embedding * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @property
    def params(self) -> int:
        if self.counted_params is not None:
            return self.counted_params
        return self.num_layers * self.layer_params + self.root_params

    @property
    def param_tensors(self) -> tuple[tuple[int, int, int], ...]:
        """Every parameter tensor as ``(rows, row_elements, count)``: its dim 0 (what FSDP2 shards), the elements
        of one row, and how many tensors have that shape; counted, or the tensors the formulas above add up."""
        if self.counted_tensors is not None:
            return self.counted_tensors
        h, d, inter = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        layer = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter), (h, 1), (h, 1)]
        layer += [(q, 1), (kv, 1), (kv, 1)] if self.attention_bias else []
        layer += [(d, 1), (d, 1)] if self.qk_norm else []
        root = [(self.vocab_size, h)] * (1 if self.tie_word_embeddings else 2) + [(h, 1)]
        return _tally([(rows, row, self.num_layers) for rows, row in layer] + [(rows, row, 1) for rows, row in root])


def _tally(tensors: Any) -> tuple[tuple[int, int, int], ...]:
    """``(rows, row_elements, count)`` triples with equal shapes merged, sorted."""
    counts: dict[tuple[int, int], int] = {}
    for rows, row, count in tensors:
        counts[rows, row] = counts.get((rows, row), 0) + count
    return tuple(sorted((rows, row, count) for (rows, row), count in counts.items()))


@dataclass(frozen=True)
class _MlpWidth:
    width: int  # the MLP width per token a dense formula would use (a mixture of experts: k experts + shared ones)
    note: str = ""  # for a mixture of experts
    per_token: int = 0  # k
    expert: int = 0  # one expert's width
    shared: int = 0  # the shared experts' width together
    dense: int = 0  # a dense layer's MLP width


def _mlp_width(text: Any) -> _MlpWidth:
    """The MLP width per token and, for a mixture of experts, its experts' sizes and a note: there each token goes
    through ``num_experts_per_tok`` experts (and any shared ones)."""
    experts = next(
        (n for key in ("num_local_experts", "num_experts", "n_routed_experts") if (n := getattr(text, key, None))), 0
    )
    # GPT-2's n_inner (None: 4 x hidden), OPT's ffn_dim
    dense = next((w for key in _MLP_WIDTH_KEYS if (w := getattr(text, key, None))), None) or 4 * text.hidden_size
    if not experts or experts <= 1:
        return _MlpWidth(dense)
    per_token = getattr(text, "num_experts_per_tok", None) or 1
    expert = getattr(text, "moe_intermediate_size", None) or dense
    shared_count = next((n for key in _SHARED_EXPERT_KEYS if (n := getattr(text, key, None))), 0)
    shared = next((w for key in _SHARED_WIDTH_KEYS if (w := getattr(text, key, None))), None) or shared_count * expert
    width = per_token * expert + shared
    dense_layers = getattr(text, "first_k_dense_replace", 0) or getattr(text, "mlp_only_layers", None)
    width = max(width, dense) if dense_layers else width
    note = f"mixture of experts ({experts} experts, {per_token} per token)"
    return _MlpWidth(width, note, per_token, expert, shared, dense)


# where the model could not be built on the meta device
_MOE_APPROXIMATE = ": its activations modelled as one gated MLP {:,} wide, its routing buffers left out (approximate)"


def _moe_modelled(text: Any) -> str:
    """The note's end where the MoE blocks are modelled (plan/moe.py) for the experts' implementation that runs."""
    implementation = getattr(text, "_experts_implementation", None) or "grouped_mm"
    if implementation in ("grouped_mm", "eager"):
        return ": its router, routed rows and shared experts modelled as transformers runs them"
    return f": modelled as the grouped_mm experts run, not {implementation}'s (approximate: --simulate measures)"


_MLP_WIDTH_KEYS = ("intermediate_size", "n_inner", "ffn_dim")
_SHARED_WIDTH_KEYS = ("shared_expert_intermediate_size", "shared_intermediate_size")  # Qwen2-MoE, GraniteMoeShared
_SHARED_EXPERT_KEYS = ("n_shared_experts", "moe_num_shared_experts")  # DeepSeek, Ernie 4.5: experts of its width


def _widest(text: Any, name: str) -> Any:
    """``text.<name>``, or its largest value over the layers where the config varies it per layer (None if unset)."""
    from ..hf import layer_values

    per_layer = layer_values(text, name)
    if per_layer is None:
        return getattr(text, name, None)
    return max((value for value in per_layer if value), default=None)


def _counted_params(
    config: Any, layers: int, mlp: _MlpWidth
) -> tuple[int, int, int, tuple[tuple[int, int, int], ...], MoeShape | None, bool] | None:
    """(every parameter, the largest decoder layer's, those outside the decoder layers, the parameter tensors as
    :attr:`ModelShape.param_tensors` lists them, the MoE blocks' sizes, whether any layer holds experts) of the causal
    LM of ``config`` built on the meta device (no memory), or None where it cannot be built."""
    import copy

    import torch

    from ..shapes import random_model
    from .moe import has_experts, moe_shape

    try:
        with torch.random.fork_rng(devices=[]):  # random_model seeds torch: the caller's RNG is left as it was
            model = random_model(copy.deepcopy(config), device="meta")  # (from_config writes into its config)
    except Exception:  # noqa: BLE001 (any config transformers cannot build: the formulas stand in)
        return None
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
    if not stacks:
        return None
    per_layer = [sum(p.numel() for p in block.parameters()) for block in stacks[0]]
    total = sum(p.numel() for p in model.parameters())
    rows = [(p.shape[0] if p.dim() else 1, p) for p in model.parameters() if p.numel()]
    tensors = _tally((n, p.numel() // n, 1) for n, p in rows)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = dict(per_token=mlp.per_token, width=mlp.expert, shared=mlp.shared, dense=mlp.dense)
    moe = moe_shape(text, list(stacks[0]), **sizes) if mlp.note else None
    return total, max(per_layer), total - sum(per_layer), tensors, moe, has_experts(list(stacks[0]))


def load_model_config(model: Any) -> tuple[Any, str]:
    """A transformers config from a built-in shape name, a config.json, a model directory or a hub id.

    Returns ``(config, name)``. Raises ValueError naming ``model`` and what is accepted when it cannot load.
    """
    from pathlib import Path

    from ..shapes import SHAPES, shape_config

    if not isinstance(model, str):  # already a config
        return model, getattr(model, "_name_or_path", "") or type(model).__name__
    key = model.strip().lower()
    if key in SHAPES:
        return shape_config(key), key
    from transformers import AutoConfig

    from ..hf import config_size_problem

    path = Path(model)
    try:
        if path.is_file():
            config = AutoConfig.from_pretrained(str(path.parent) if path.name == "config.json" else str(path))
        else:
            config = AutoConfig.from_pretrained(model, local_files_only=True)  # no network retries
    except Exception as error:  # noqa: BLE001 (a file's content: transformers' validators raise their own types)
        from ..train.errors import first_line  # (one line: the hub's errors run over several)

        raise ValueError(
            f"model {model!r} cannot be loaded ({first_line(error, innermost=False)}); give a built-in shape "
            f"({', '.join(SHAPES)}), a config.json or model directory, or a Hugging Face id that is in the local cache"
        ) from None
    problem = config_size_problem(config)
    if problem is not None:
        raise ValueError(f"model {model!r}: {problem}")
    return config, model


def model_shape(model_config: Any) -> ModelShape:
    """A :class:`ModelShape` from a shape, a transformers config or anything :func:`load_model_config` accepts."""
    return (
        model_config
        if isinstance(model_config, ModelShape)
        else ModelShape.from_config(*load_model_config(model_config))
    )
