"""Published shapes of the models that the planner and the benchmarks talk about, as plain dicts.

Each entry holds the fields of a transformers config (``model_type`` picks the config class) with the
published values of the real model: layer count, widths, heads, vocabulary, tied embeddings, RoPE. Weights
are not part of it: :func:`shape_config` builds a config that ``AutoModelForCausalLM.from_config`` turns
into a model of the real size with random weights, with no hub access. ``train.model_factory`` can reuse
these dicts for its built-in model names.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODEL_SHAPES", "shape_config"]

MODEL_SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-4B config.json: about 4.02B parameters, tied embeddings, q/k RMSNorm per head.
    "qwen3-4b": dict(
        model_type="qwen3",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    # meta-llama/Llama-3.1-8B config.json: about 8.03B parameters, untied lm_head, llama3 RoPE scaling.
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
}


def shape_config(name: str) -> Any:
    """The transformers config of built-in shape ``name`` (random-weight models of the real size)."""
    from transformers import AutoConfig

    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; built-in shapes: {', '.join(MODEL_SHAPES)}")
    fields = dict(MODEL_SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
