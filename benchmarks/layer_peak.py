"""The recompute + backward peak of ONE checkpointed decoder layer on CPU, with and without the tiled norms.

One process stands in for one rank: ``--tokens`` local tokens through a Llama decoder layer (sdpa, causal),
as the layer runs inside a step with activation checkpointing: its forward keeps only its input, then
``PeakMemory`` measures its backward (the recompute and the gradients). Parameter gradients are allocated
before the measurement (they are the step's, not the layer's). Example (one rank of sp=2 at 16K tokens holds
8K tokens; its attention works on 4 of the 8 heads over 16K tokens, the same bytes as 8 heads over 8K)::

    python benchmarks/layer_peak.py --hidden 512 --heads 8 --kv-heads 2 --intermediate 1408 --tokens 8192
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ulysses_sp.features import Features, apply_features
from ulysses_sp.memory import PeakMemory


def layer_backward_peak(
    features: Features, *, hidden: int, heads: int, kv_heads: int, intermediate: int, tokens: int, seed: int = 0
) -> int:
    """Bytes the last decoder layer's recompute + backward allocates at its peak (fp32, CPU)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        vocab_size=64,
        max_position_embeddings=tokens,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    apply_features(model, features, "cpu")
    model.train()
    layer, rotary = model.model.layers[0], model.model.rotary_emb
    for param in layer.parameters():
        param.grad = torch.zeros_like(param)
    x = torch.randn(1, tokens, hidden, requires_grad=True)  # [b, t, h]: the layer input (its checkpoint)
    grad_out = torch.randn(1, tokens, hidden)
    positions = torch.arange(tokens)[None]
    position_embeddings = rotary(x, positions)
    out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings)
    with PeakMemory("cpu") as peak:
        out.backward(grad_out)
    return peak.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 512), ("heads", 8), ("kv-heads", 2), ("intermediate", 1408), ("tokens", 8192)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    shape = dict(
        hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate, tokens=args.tokens
    )
    one = 4 * args.tokens * args.hidden  # one fp32 [tokens, hidden] tensor
    rows = {}
    for label, features in (
        (
            "plain MLP",
            Features(tiled_loss=False, tiled_mlp=False, tiled_norms=False, activation_checkpointing="checkpoint"),
        ),
        ("tiled MLP (before)", Features(tiled_loss=False, tiled_norms=False, activation_checkpointing="checkpoint")),
        ("tiled MLP + tiled norms", Features(tiled_loss=False, activation_checkpointing="checkpoint")),
    ):
        peak = layer_backward_peak(features, **shape)
        rows[label] = {"peak_bytes": peak, "tensors_of_tokens_x_hidden": round(peak / one, 2)}
    before, after = rows["tiled MLP (before)"]["peak_bytes"], rows["tiled MLP + tiled norms"]["peak_bytes"]
    print(json.dumps({"shape": shape, "rows": rows, "factor": round(before / after, 3)}, indent=2))


if __name__ == "__main__":
    main()
