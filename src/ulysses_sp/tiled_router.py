"""Router logits of a tiled MoE block, for its load-balancing loss: recorded once per layer, whole, with gradient.

Why: transformers collects an MoE's router logits (``output_router_logits=True``) with a forward hook on the router
module. Under the tiled MLP (:mod:`ulysses_sp.tiling`) that hook fires once per chunk, inside a forward that keeps
no graph, so the load-balancing loss would see split logits without gradient.

How: after the tiled block's forward, :func:`record_router_logits` takes the entries the hook appended per chunk
out of transformers' collection and runs the router again over the same chunks, as a tiled forward of its own
(:class:`RouterTiles`: the norm fused into the MLP first, if any; only its input kept, each chunk recomputed in
backward). Its logits must equal the chunks' bit for bit (else ValueError: the block does not route its input as
one ``[tokens, hidden]`` matrix), and they are recorded, ``[b n, experts]`` in the untiled block's row order, as
the one entry the untiled block gives. Cost: one more ``hidden x experts`` matmul per chunk, forward and backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .tiling import MLP_OFF, TiledForward, _spans

if TYPE_CHECKING:
    from .tiling import TiledMLP

__all__ = ["RouterTiles", "record_router_logits", "router_collection"]


def router_collection() -> dict[str, list] | None:
    """The router outputs transformers collects in this forward (``{key: entries}``), or None when it collects none."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # an older transformers returns router logits from the block: run_chunks refuses that
        return None
    collected = _active_collector.get()
    found = {key: entries for key, entries in (collected or {}).items() if "router" in key}
    return found or None


def _recorders(specs: dict, key: str) -> list[tuple[type | None, str | None, int]]:
    """``(target class, class-name suffix, output index)`` of each recorder of ``key`` in a model's
    ``_can_record_outputs`` (``specs``)."""
    spec = specs.get(key)
    found = []
    for one in spec if isinstance(spec, list) else [spec] if spec is not None else []:
        if isinstance(one, str):
            found.append((None, one, 1))  # transformers' default index outside hidden_states
        elif isinstance(one, type):
            found.append((one, None, 1))
        else:
            found.append((getattr(one, "target_class", None), getattr(one, "class_name", None), one.index))
    return found


def _router_of(mlp: nn.Module, specs: dict, key: str) -> tuple[nn.Module, int] | None:
    """The one submodule of ``mlp`` whose output ``key`` records, and the index recorded; None when it has none."""
    found = [
        (module, index)
        for name, module in mlp.named_modules()
        for cls, suffix, index in _recorders(specs, key)
        if (cls is not None and isinstance(module, cls)) or (suffix is not None and name.endswith(suffix))
    ]
    if len(found) > 1:
        raise ValueError(
            f"{type(mlp).__name__} holds {len(found)} modules whose {key} transformers records; the tiled MLP can "
            f"record one router per block; set model.config.output_router_logits = False or {MLP_OFF}"
        )
    return found[0] if found else None


class RouterTiles(TiledForward):
    """The router of a tiled MoE block over the same chunks (after the fused norm, if any): ``[..., n, h]`` in,
    its recorded output ``[..., n, experts]`` out; only the input kept for backward."""

    def __init__(self, block: TiledMLP, router: nn.Module, index: int) -> None:
        super().__init__(router, block.chunk_tokens)
        self.block, self.index = block, index
        self.hint = block.hint

    def chunk_size(self, x: torch.Tensor) -> int:
        return self.block.chunk_size(x)

    def call_module(self, chunk: torch.Tensor) -> torch.Tensor:
        if self.block.pre_forward is not None:
            chunk = self.block.pre_forward(chunk)
        # the router's own forward (its hook would record this chunk), on [tokens, hidden] as the block calls it
        out = type(self.module).forward(self.module, chunk.reshape(-1, chunk.shape[-1]))
        logits = out[self.index] if isinstance(out, tuple | list) else out  # [b c, experts]
        return logits.view(*chunk.shape[:-1], logits.shape[-1])

    def pre_parameters(self) -> list[torch.Tensor]:
        return self.block.pre_parameters()


def record_router_logits(
    block: TiledMLP, hidden_states: torch.Tensor, collected: dict[str, list] | None, before: dict
) -> None:
    """Replace the per-chunk entries the tiled ``block`` left in ``collected`` (past ``before[key]``) by one entry
    per key, computed by :class:`RouterTiles` with gradient (see the module docstring); the model's recorders are
    ``block.recorders`` (its ``_can_record_outputs``). Run whenever the config asks for router logits, recorded or
    not (``collected`` None: activation checkpointing's recompute, which must save what the forward saved)."""
    for key in [k for k in block.recorders if "router" in k]:
        entries = (collected or {}).get(key)
        chunks = entries[before[key] :] if entries is not None else []
        tiles = _tiles(block, key)
        if tiles is None and not chunks:
            continue  # a block without a router (a dense layer of an MoE)
        spans = _spans(hidden_states.shape[-2], block.chunk_size(hidden_states))
        if tiles is None or (entries is not None and len(chunks) != len(spans)):
            raise ValueError(
                f"the tiled {type(block.module).__name__} recorded {len(chunks)} {key} over {len(spans)} chunks, "
                "not one per chunk from one router of its own; set model.config.output_router_logits = False or "
                f"{block.hint}"
            )
        logits = tiles(hidden_states)  # [..., n, experts]
        if entries is None:
            continue
        del entries[before[key] :]
        rows = hidden_states.shape[:-2].numel()
        seen = torch.cat([c.detach().reshape(rows, -1, c.shape[-1]) for c in chunks], dim=1)  # [rows, n, experts]
        if not torch.equal(seen, logits.detach().reshape(seen.shape)):
            raise ValueError(
                f"{type(block.module).__name__}'s router, run on the block's input as a [tokens, hidden] matrix, "
                f"does not give the {key} the block records, so the tiled MLP cannot record them whole; set "
                f"model.config.output_router_logits = False or {block.hint}"
            )
        # [b n, experts], as the untiled block records, and like its entry not a view (FSDP2 warns of one among its
        # root's outputs: an in-place op would skip its pre-backward all-gather): a copy, [tokens, experts] a layer
        entries.append(logits.reshape(-1, logits.shape[-1]).clone())


def _tiles(block: Any, key: str) -> RouterTiles | None:
    """The block's :class:`RouterTiles` for ``key`` (None: the block has no router that ``key`` records), found on
    the block's first routed forward and kept: not searched for again in every layer's forward."""
    made = block.__dict__.setdefault("router_tiles", {})
    if key not in made:
        found = _router_of(block.module, block.recorders, key)
        made[key] = None if found is None else RouterTiles(block, *found)
    return made[key]
