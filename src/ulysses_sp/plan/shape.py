"""The sizes the memory model needs, read from a transformers config (or a named shape, a config.json, a directory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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

    @classmethod
    def from_config(cls, config: Any, name: str = "") -> ModelShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=text.intermediate_size,
            vocab_size=text.vocab_size,
            tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
            qk_norm=getattr(text, "model_type", "") in ("qwen3", "gemma3_text", "gemma3"),
            attention_bias=bool(getattr(text, "attention_bias", False)),
            logit_softcap=bool(getattr(text, "final_logit_softcapping", None)),
            name=name or getattr(config, "_name_or_path", "") or getattr(text, "model_type", ""),
        )

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q/k/v/o, gated MLP, two RMSNorms (+ q/k norms, biases)."""
        h, d = self.hidden_size, self.head_dim
        qkv_width = (self.num_heads + 2 * self.num_kv_heads) * d
        attention = h * qkv_width + self.num_heads * d * h + (qkv_width if self.attention_bias else 0)
        return attention + 3 * h * self.intermediate_size + 2 * h + (2 * d if self.qk_norm else 0)

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embedding, final norm, lm_head unless tied."""
        embedding = self.vocab_size * self.hidden_size
        return embedding * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @property
    def params(self) -> int:
        return self.num_layers * self.layer_params + self.root_params


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
        raise ValueError(
            f"model {model!r} cannot be loaded ({type(error).__name__}: {error}); give a built-in shape "
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
