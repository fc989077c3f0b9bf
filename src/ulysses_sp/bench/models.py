"""The model shapes the benchmarks run: small Llamas for the CPU, real model shapes for the GPU mode.

All models get random weights (no hub access is needed): speed and memory depend on the shapes only.
:data:`GPU_MODELS` names the published shapes of Qwen/Qwen3-4B and meta-llama/Llama-3.1-8B in
:mod:`ulysses_sp.shapes` (the models of the HF blog's SP benchmark and of the ALST paper).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["CPU_MODELS", "GPU_MODELS", "build_gpu_model", "build_model", "model_config"]

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

# GPU mode: the published shapes of :mod:`ulysses_sp.shapes` (display name -> shape name).
GPU_MODELS: dict[str, str] = {"Qwen3-4B": "qwen3-4b", "Llama-3.1-8B": "llama-3.1-8b"}


def model_config(shape: dict[str, Any], max_positions: int) -> Any:
    """The transformers config of ``shape`` (a dict of :data:`CPU_MODELS`)."""
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


def build_gpu_model(name: str, *, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> nn.Module:
    """A model of :data:`GPU_MODELS` ``name`` (real size) with seeded random weights, on ``device``."""
    from transformers import AutoModelForCausalLM

    from ulysses_sp.shapes import shape_config

    config = shape_config(GPU_MODELS[name])
    config.use_cache = False
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
