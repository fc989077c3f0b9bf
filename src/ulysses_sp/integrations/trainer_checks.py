"""Set-up refusals of the Trainer integration that come before the Trainer is made: what ulysses-sp's trainers do
not run on (DeepSpeed), and a model sharded in a way the Trainer would then wrap wrongly."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["refuse_deepspeed", "refuse_sharded_before"]


def refuse_deepspeed(args: Any) -> None:
    """ulysses-sp runs on DDP and FSDP2; under DeepSpeed (ZeRO-3 gathers weights only inside module calls, which
    the tiled MLP's backward and the parallel paths do not all go through) nothing of it is tested."""
    if getattr(args, "deepspeed", None):
        raise ValueError(
            "TrainingArguments(deepspeed=...) is not supported by ulysses-sp's trainers, which run on DDP or FSDP2; "
            "to shard parameters, gradients and optimizer states use FSDP2 (from_pretrained(..., distributed_config="
            "DistributedConfig(fsdp_size=...)), or TrainingArguments(fsdp=...) on GPUs)"
        )


def refuse_sharded_before(model: Any, args: Any) -> None:
    """Refuse a model whose parameters are already sharded (DTensors, e.g. ``fully_shard`` applied by hand) when
    this transformers' Trainer would wrap it in DDP, which cannot run on DTensor parameters (it fails in its
    first broadcast, or in ``model.to``): only a model sharded at load time (``from_pretrained(distributed_config=
    ...)``) in a transformers whose models report it (``is_distributed_loading_by_transformers``) is left as it is."""
    if not isinstance(model, torch.nn.Module) or args is None or getattr(args, "world_size", 1) <= 1:
        return
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return
    if getattr(model, "is_distributed_loading_by_transformers", False):
        return
    if hasattr(type(model), "is_distributed_loading_by_transformers"):
        how = (
            "its parameters were sharded before the Trainer (fully_shard by hand?), so the Trainer would wrap the "
            "DTensor parameters in DDP, which fails; load it with from_pretrained(..., distributed_config="
            "DistributedConfig(fsdp_size=...)) or pass the unsharded model with TrainingArguments(fsdp=...) on GPUs"
        )
    else:
        how = (
            "this transformers' Trainer wraps a model sharded at load time (DTensor parameters) in DDP, which fails; "
            "upgrade transformers to one whose models have is_distributed_loading_by_transformers (5.23 has it), or "
            "pass the unsharded model with TrainingArguments(fsdp=...) on GPUs"
        )
    raise ValueError(f"{type(model).__name__} has DTensor parameters on a world of {args.world_size} ranks: {how}")
