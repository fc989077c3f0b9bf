"""Set-up checks of the Trainer integration: what ulysses-sp's trainers do not run on (DeepSpeed), a model sharded
in a way the Trainer would then wrap wrongly (both before the Trainer is made), the options that do not work under SP
(:func:`check_supported`), and DDP's search for unused parameters under torch's reentrant checkpoint."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..hf import find_pretrained
from ..moe import router_aux_loss

__all__ = ["check_supported", "ddp_for_reentrant_checkpointing", "refuse_deepspeed", "refuse_sharded_before"]


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


def check_supported(trainer: Any, sp_size: int) -> None:
    """ValueError listing every option of ``trainer`` (a ulysses-sp trainer, its model parallelized not yet) that
    does not work under SP of degree ``sp_size``, each with its fix."""
    args = trainer.args
    problems = []
    if trainer.model_init is not None:
        problems.append("model_init (the model is re-created in train(); pass model= instead)")
    if args.label_smoothing_factor != 0 and not trainer.sp_label_smoothing:
        problems.append(f"label_smoothing_factor={args.label_smoothing_factor} (set it to 0)")
    if trainer.compute_loss_func is not None:
        problems.append("compute_loss_func (the model's own token-weighted loss is used)")
    unknown = sorted(set(args.include_for_metrics) - {"inputs", "loss"})
    if unknown:
        problems.append(f"include_for_metrics={unknown} (only 'inputs' and 'loss' are gathered for it)")
    if getattr(args, "use_liger_kernel", False):
        problems.append(
            "use_liger_kernel=True (train() would patch Liger's forwards over the norms, MLPs and loss head "
            "that ulysses-sp has tiled, so neither runs as set up, untested under SP; the tiled loss, MLP and "
            "norms bound the same memory)"
        )
    if args.train_sampling_strategy == "batch_rebalance":
        problems.append("train_sampling_strategy='batch_rebalance' (use 'random', 'sequential' or 'group_by_length')")
    config = getattr(trainer.accelerator, "parallelism_config", None)
    if config is not None and ((config.sp_size or 1) > 1 or (config.cp_size or 1) > 1):
        problems.append("a parallelism_config with sp_size or cp_size > 1 (sp_size= here replaces it)")
    if sp_size > 1 and getattr(trainer, "aux_loss_enabled", False):
        # TRL's SFTTrainer turns its load-balancing term on from router_aux_loss_coef (the model's by default)
        # and sets output_router_logits from it: that coefficient is the way to turn it off
        try:
            why = None if router_aux_loss(trainer.model) is not None else "its module has no load_balancing_loss_func"
        except ValueError as error:
            why = str(error).split("; set model.config")[0]
        if why is not None:
            problems.append(
                f"TRL's load-balancing term for {type(find_pretrained(trainer.model)).__name__}, which ulysses-sp "
                f"cannot compute over the whole sequence ({why}; each shard's alone would be wrong); pass "
                "router_aux_loss_coef=0.0 in the SFTConfig"
            )
    if not trainer.model_accepts_loss_kwargs:
        problems.append(
            f"{type(find_pretrained(trainer.model)).__name__}, which does not accept loss kwargs "
            "(shift_labels, num_items_in_batch), so its loss cannot be weighted by the tokens of all shards"
        )
    if problems:
        raise ValueError(f"{type(trainer).__name__}(sp_size={sp_size}) does not support: " + "; ".join(problems))
