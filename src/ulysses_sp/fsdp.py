"""FSDP2 wrapping the way this library trains: one unit per decoder layer, then the root, over all ranks.

Used by ``ulysses-sp train`` (``train/model_factory.py``) and by the planner's measured step
(``simulate.py``), so the two shard the model identically and the planner measures what training runs. And
:func:`sharded_mesh`: the mesh a model's FSDP2 units shard over, refusing one wrapped in part (``causal_lm_loss``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .hf import decoder_layers

__all__ = ["fully_shard_layers", "sharded_mesh"]


def fully_shard_layers(
    model: nn.Module,
    device: torch.device,
    world_size: int,
    *,
    compute_dtype: torch.dtype = torch.float32,
    offload_to_cpu: bool = False,
    mesh: Any = None,
) -> Any:
    """Apply FSDP2 to every decoder layer of ``model`` and then to the model (the root unit); in place.

    Args:
        model: a transformers causal LM, on any device (meta included: materialise it afterwards).
        device: the compute device; ``world_size``: the ranks the parameters are sharded over.
        compute_dtype: the dtype FSDP2 gathers parameters in (gradients are reduced in fp32); fp32 = no
            mixed precision.
        offload_to_cpu: keep the sharded parameters, gradients (and so the optimizer states) in host memory.
        mesh: a 1-D DeviceMesh over all ranks; built (``"world"``) when None.

    Returns the mesh used. Raises ValueError when the model has no decoder layers to shard.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"found no decoder layers in {type(model).__name__} to shard with FSDP2 (no _no_split_modules and "
            "no base_model.layers); use DDP (--parallel ddp) for this model"
        )
    if mesh is None:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("world",))
    mixed = compute_dtype != torch.float32
    policy = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if mixed
        else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if offload_to_cpu else OffloadPolicy(),
    }
    for layer in layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    return mesh


def sharded_mesh(model: nn.Module) -> Any:
    """The device mesh FSDP2 shards ``model``'s parameters over; None without FSDP2 (no ``fully_shard`` module in
    it), or while none of its parameters is sharded (a unit's are plain tensors from its forward to its
    backward, and the root's after a forward under no_grad).

    Raises ValueError when ``fully_shard`` was applied to some of its modules only (the decoder layers, not the
    model itself), leaving trainable parameters outside every FSDP2 unit: nothing averages their gradients over the
    ranks, so they would come out silently wrong (each rank's own share of the embedding's gradient, say).
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not units:
        return None
    managed = {id(param) for unit in units for param in unit.parameters()}
    plain = [name for name, param in model.named_parameters() if param.requires_grad and id(param) not in managed]
    if plain:
        more = f" or {len(plain) - 1} more trainable parameters" if len(plain) > 1 else ""
        raise ValueError(
            f"FSDP2 (fully_shard) wraps some of the model's modules, but no FSDP2 unit holds {plain[0]!r}{more}, so "
            "nothing averages their gradients over the ranks (they would be silently wrong); call fully_shard on the "
            "whole model too, after its layers (as ulysses_sp.fsdp.fully_shard_layers does)"
        )
    sharded = (param for param in model.parameters() if isinstance(param, DTensor))
    return next((param.device_mesh for param in sharded), None)
