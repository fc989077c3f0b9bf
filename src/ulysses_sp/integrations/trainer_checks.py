"""Set-up of the Trainer integration that comes before the Trainer is made: what ulysses-sp's trainers do not run
on (DeepSpeed), a model sharded in a way the Trainer would then wrap wrongly, and DDP's search for unused
parameters under torch's reentrant checkpoint."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["ddp_for_reentrant_checkpointing", "refuse_deepspeed", "refuse_sharded_before"]


def ddp_for_reentrant_checkpointing(accelerator_args: dict[str, Any], args: Any) -> dict[str, Any]:
    """The Trainer's Accelerator arguments with DDP's ``find_unused_parameters`` off when ``args`` turn on torch's
    reentrant activation checkpointing (``use_reentrant=True``, or checkpoint kwargs without ``use_reentrant``) and
    leave ``ddp_find_unused_parameters`` unset (checkpointing turned on on the model itself is not seen here).

    transformers turns the search off under checkpointing for a ``PreTrainedModel`` only; for a wrapped one (a PEFT
    model) it stays on, and under the reentrant checkpoint DDP then marks a parameter ready twice and fails in the
    first backward. Under SP the Trainer runs in DDP even on one SP group (the shards' gradients are averaged), so
    this fails where one process trains.
    """
    given = getattr(args, "activation_checkpointing_kwargs", None) or getattr(
        args, "gradient_checkpointing_kwargs", None
    )
    checkpointing = getattr(args, "activation_checkpointing", getattr(args, "gradient_checkpointing", False))
    # as the Trainer hands them on, without every_n_layers and offload: none left -> use_reentrant=False
    # (transformers' default), else torch's checkpoint with them (reentrant unless use_reentrant=False)
    kwargs = {k: v for k, v in (given or {}).items() if k not in ("every_n_layers", "offload")}
    reentrant = bool(kwargs) and kwargs.get("use_reentrant", True)
    if not (checkpointing and reentrant) or args.ddp_find_unused_parameters is not None:
        return accelerator_args
    from accelerate.utils import DistributedDataParallelKwargs

    handlers = [
        dataclasses.replace(h, find_unused_parameters=False) if isinstance(h, DistributedDataParallelKwargs) else h
        for h in accelerator_args.get("kwargs_handlers", [])
    ]
    return {**accelerator_args, "kwargs_handlers": handlers}


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
