"""FSDP2 wrapping the way this library trains: one unit per decoder layer, then the root, over all ranks.

Used by ``ulysses-sp train`` (``train/model_factory.py``) and by the planner's measured step
(``simulate.py``), so the two shard the model identically and the planner measures what training runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .hf import decoder_layers

__all__ = ["fully_shard_layers"]


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
