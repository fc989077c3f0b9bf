"""The model shapes the benchmarks run: small Llamas for the CPU, real model shapes for the GPU mode.

All models get random weights (no hub access is needed): speed and memory depend on the shapes only.
``QWEN3_4B`` and ``LLAMA31_8B`` copy the shapes of the published configs of Qwen/Qwen3-4B and
meta-llama/Llama-3.1-8B (the models of the HF blog's SP benchmark and of the ALST paper).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["CPU_MODELS", "GPU_MODELS", "build_model", "model_config"]

# CPU benchmark Llamas (GQA: 2 query heads per kv head), sized for a 2-core machine.
CPU_MODELS: dict[str, dict[str, Any]] = {
    "llama-bench-tiny": dict(
        arch="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
    ),
    "llama-bench-small": dict(
        arch="llama",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        vocab_size=4096,
    ),
}

QWEN3_4B = dict(
    arch="qwen3",
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
LLAMA31_8B = dict(
    arch="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    rope_theta=500_000.0,
    rms_norm_eps=1e-5,
    rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    ),
    tie_word_embeddings=False,
)
GPU_MODELS: dict[str, dict[str, Any]] = {"Qwen3-4B": QWEN3_4B, "Llama-3.1-8B": LLAMA31_8B}


def model_config(shape: dict[str, Any], max_positions: int) -> Any:
    """The transformers config of ``shape`` (a dict of :data:`CPU_MODELS` / :data:`GPU_MODELS`)."""
    from transformers import LlamaConfig, Qwen3Config

    fields = {k: v for k, v in shape.items() if k != "arch"}
    fields.setdefault("tie_word_embeddings", False)
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[shape["arch"]]
    return cls(
        **fields,
        max_position_embeddings=max(max_positions, 2048),
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        use_cache=False,
    )


def build_model(
    shape: dict[str, Any],
    *,
    max_positions: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """A causal LM of ``shape`` with seeded random weights (the same on every rank for the same seed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            model_config(shape, max_positions), dtype=dtype, attn_implementation="sdpa"
        )
    return model
