"""Tiny random-weight configs of real transformers architectures, and batches to feed them."""

from __future__ import annotations

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 128


def _common(heads: int, kv_heads: int, head_dim: int = 8) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=heads * head_dim,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def build(
    arch: str, *, heads: int = 4, kv_heads: int | None = None, seed: int = 0, attn: str = "sdpa", window: int = 6
):
    """A tiny model of ``arch`` with deterministic random weights (same on every rank for the same seed)."""
    kv_heads = heads if kv_heads is None else kv_heads
    common = _common(heads, kv_heads)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation=attn))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=window, attn_implementation=attn))
    elif arch == "qwen2":  # layer 0 full attention, layer 1 sliding window
        cfg = Qwen2Config(
            **common, use_sliding_window=True, sliding_window=window, max_window_layers=1, attn_implementation=attn
        )
        model = Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, attn_implementation=attn))
    elif arch == "gemma2":  # attention logit softcapping: eager only in transformers and here
        cfg = Gemma2Config(
            **common,
            sliding_window=window,
            attn_implementation=attn,
            layer_types=["sliding_attention", "full_attention"],
        )
        model = Gemma2ForCausalLM(cfg)
    elif arch == "gemma3":
        cfg = Gemma3TextConfig(
            **common,
            sliding_window=window,
            attn_implementation=attn,
            layer_types=["sliding_attention", "full_attention"],
        )
        model = Gemma3ForCausalLM(cfg)
    elif arch in MORE_ARCHS:
        model = MORE_ARCHS[arch](common, window, attn)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    return model.float()


def _more_archs() -> dict:
    """More decoder families: sliding windows (Phi-3, Cohere2), QK-norm after projection (OLMo-2), partial
    rotary and fused qkv (GPT-NeoX)."""
    import transformers as t

    def quiet(common):  # these configs default to special-token ids outside the tiny vocabulary
        return {**common, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}

    return {
        "phi3": lambda c, w, a: t.Phi3ForCausalLM(t.Phi3Config(**quiet(c), sliding_window=w, attn_implementation=a)),
        "olmo2": lambda c, w, a: t.Olmo2ForCausalLM(t.Olmo2Config(**quiet(c), attn_implementation=a)),
        "cohere2": lambda c, w, a: t.Cohere2ForCausalLM(
            t.Cohere2Config(
                **quiet(c), sliding_window=w, layer_types=["sliding_attention", "full_attention"], attn_implementation=a
            )
        ),
        "gpt_neox": lambda c, w, a: t.GPTNeoXForCausalLM(
            t.GPTNeoXConfig(
                vocab_size=c["vocab_size"],
                hidden_size=c["hidden_size"],
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=c["num_attention_heads"],
                rotary_pct=0.5,
                bos_token_id=0,
                eos_token_id=1,
                attn_implementation=a,
            )
        ),
    }


MORE_ARCHS = _more_archs()


def make_batch(
    batch: int,
    seq_len: int,
    *,
    seed: int = 1,
    packed: tuple[int, ...] | None = None,
    pad: str | None = None,
    pad_lengths: tuple[int, ...] = (0, 5),
) -> dict[str, torch.Tensor]:
    """Random tokens with labels; optionally packed documents (lengths per row) or right/left padding."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch, seq_len), generator=gen)
    out = {"input_ids": input_ids, "labels": input_ids.clone()}
    if packed is not None:
        assert sum(packed) == seq_len
        positions = torch.cat([torch.arange(n) for n in packed])
        out["position_ids"] = positions.unsqueeze(0).expand(batch, -1).clone()
    if pad is not None:
        mask = torch.ones(batch, seq_len, dtype=torch.long)
        for row, n in enumerate(pad_lengths[:batch]):
            if n:
                if pad == "right":
                    mask[row, seq_len - n :] = 0
                else:
                    mask[row, :n] = 0
        out["attention_mask"] = mask
        out["labels"] = out["labels"].masked_fill(mask == 0, -100)
    return out
