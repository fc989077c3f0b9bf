"""Length-dependent rotary embeddings (dynamic, longrope) under Ulysses: they read the largest position id of a call,
so each rank's rotary module is shown the full rows' largest position, not its shard's."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .attention import UlyssesAttention


def _length_dependent(rope_type: object) -> bool:
    # rope types whose transformers implementation (dynamic_rope_update) reads max(position_ids) every call
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in types)


class GlobalRopeLength:
    """Hooks on a length-dependent rotary embedding: it sees the largest position of the full rows.

    ``before`` appends one column holding that position to the ``[b, n]`` position_ids (``[b, n + 1]``), so
    ``torch.max(position_ids)`` inside transformers' ``dynamic_rope_update`` is the global one; ``after``
    drops the extra column from every returned ``[b, n + 1, d]`` tensor. cos/sin of a position do not depend
    on the other positions of the call, so the n real columns are exactly what one process computes.
    """

    def __init__(self, pretrained: PreTrainedModel, ctx: UlyssesAttention, name: str) -> None:
        self.pretrained, self.ctx, self.name = pretrained, ctx, name
        self.appended = False

    def before(self, module, args, kwargs):
        self.appended = False
        if self.pretrained.config._attn_implementation != self.name:
            return None  # plain attention: the model runs on its own full input
        in_kwargs = "position_ids" in kwargs
        positions = kwargs["position_ids"] if in_kwargs else (args[1] if len(args) > 1 else None)
        if positions is None or positions.dim() != 2:
            raise ValueError(
                f"{type(module).__name__} (rope type {module.rope_type!r}) derives its frequencies from the largest "
                "position id; under Ulysses it needs position_ids of shape [batch, seq_len], got "
                f"{None if positions is None else tuple(positions.shape)}"
            )
        largest = self.ctx.segments_for(positions).max_position
        extended = torch.cat([positions, positions.new_full((positions.shape[0], 1), largest)], dim=1)  # [b, n+1]
        self.appended = True
        if in_kwargs:
            return args, {**kwargs, "position_ids": extended}
        return (args[0], extended, *args[2:]), kwargs

    def after(self, module, args, kwargs, output):
        if not self.appended:
            return None
        self.appended = False
        if isinstance(output, torch.Tensor):
            return output[:, :-1]  # [b, n+1, ...] -> [b, n, ...]
        return type(output)(t[:, :-1] for t in output)  # (cos, sin): [b, n+1, d] -> [b, n, d]


def rope_length_hooks(
    pretrained: PreTrainedModel, ctx: UlyssesAttention, name: str, config
) -> list[tuple[torch.nn.Module, GlobalRopeLength]]:
    """The length-dependent rotary modules of the model and a hook object for each (nothing installed yet)."""
    rotaries = [
        m
        for m in pretrained.modules()
        if _length_dependent(getattr(m, "rope_type", None))
        and any(name.endswith("inv_freq") for name, _ in m.named_buffers(recurse=False))
    ]
    params = getattr(config, "rope_parameters", None) or {}
    flat = [params] if "rope_type" in params else [p for p in params.values() if isinstance(p, dict)]
    if not rotaries and any(_length_dependent(p.get("rope_type")) for p in flat):
        raise ValueError(
            f"the config asks for a rope type whose frequencies depend on the sequence length ({params}), but no "
            f"rotary module of {type(pretrained).__name__} exposes it; under Ulysses each rank would pick them from "
            "its own shard, so this model is refused"
        )
    return [(m, GlobalRopeLength(pretrained, ctx, name)) for m in rotaries]
