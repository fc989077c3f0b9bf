"""Multi-rank cases for the sequence-tiled layer (tiled norms fused into the tiled MLP), run by
tests/dist/test_layer_tiling_parity.py.

Every architecture of the parity suite (:data:`tests.dist.cases_architectures.PARITY_ARCHS`) trains one step
under Ulysses with the layer's memory features on (tiled norms, the tiled MLP where the layer has an MLP the
library recognises, activation checkpointing), wrapped in FSDP2 (``fully_shard`` per decoder layer and at the
root on a CPU gloo mesh) or left unwrapped, and the loss and every gradient are compared with one process on the
full batch running the plain transformers model.
"""

from __future__ import annotations

import functools

import torch.distributed as dist

import ulysses_sp as U
from tests.dist.cases_architectures import EVAL_ONLY, PARITY_ARCHS
from tests.dist.cases_core import reference, sequence_parallel
from tests.helpers.harness import run_cases
from tests.helpers.models import build, make_batch
from tests.helpers.parity import assert_loss_and_grads
from ulysses_sp.hf import decoder_layers, mlp_modules
from ulysses_sp.instance_forward import installed_forward
from ulysses_sp.tiled_norms import TiledNorm, _HandThrough


def layer_features(model, checkpointing: str, stride: int = 1) -> None:
    """Tiled MLP (if the layers have one), tiled norms, checkpointing: as apply_features turns them on."""
    try:
        mlp_modules(model)
    except ValueError:  # OPT / BioGPT: fc1 / fc2 straight in the layer, no MLP module to tile
        has_mlp = False
    else:
        has_mlp = True
    if has_mlp:
        U.enable_tiled_mlp(model, chunk_tokens=5)  # 12 or 13 tokens per rank: several chunks, a short last one
    U.enable_tiled_norms(model, chunk_tokens=4)
    fused = [m for m in model.modules() if isinstance(installed_forward(m), _HandThrough)]
    alone = [m for m in model.modules() if isinstance(installed_forward(m), TiledNorm)]
    assert alone and (fused or not has_mlp or _post_norm(model)), (len(fused), len(alone))
    U.enable_activation_checkpointing(model, checkpointing, stride=stride)


def _post_norm(model) -> bool:
    from ulysses_sp.tiled_norms import mlp_norm_name

    return all(mlp_norm_name(layer) is None for layer in decoder_layers(model))


def layer_tiling_parity(layout, arch: str, kv_heads, wrapper: str, checkpointing: str = "checkpoint", stride: int = 1):
    batch = make_batch(2, 24, packed=(15, 9))
    model = build(arch, kv_heads=kv_heads)
    train = arch not in EVAL_ONLY
    model.train(train)
    ref_loss, ref_grads = reference(model, batch)

    def prepare(par) -> bool:
        layer_features(par, checkpointing, stride)
        par.train(train)
        if wrapper == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
            for layer in decoder_layers(par):
                fully_shard(layer, mesh=mesh)
            fully_shard(par, mesh=mesh)
        return wrapper == "fsdp2"

    loss, grads, _ = sequence_parallel(model, batch, layout, prepare=prepare)
    grads = {name: grad.full_tensor() if hasattr(grad, "full_tensor") else grad for name, grad in grads.items()}
    assert_loss_and_grads(loss, grads, ref_loss, ref_grads, zeros_for_none=True)


def cases(layout, prefix: str, wrappers: tuple[str, ...]) -> dict:
    P = functools.partial
    return {
        f"{prefix}_{arch}_{wrapper}": P(layer_tiling_parity, layout, arch, kv, wrapper)
        for arch, kv in PARITY_ARCHS.items()
        for wrapper in wrappers
    }


def stride_cases(layout, prefix: str) -> dict:
    """Every 2nd layer's input kept (the tiny models have 2 layers: one group), on the device or the host."""
    P = functools.partial
    return {
        f"{prefix}_{arch}_{mode}_stride2_fsdp2": P(layer_tiling_parity, layout, arch, kv, "fsdp2", mode, stride=2)
        for arch, kv in (("llama_dynamic", 2), ("deepseek_v3_mla", None), ("qwen3_moe", 2), ("opt", None))
        for mode in ("checkpoint", "offload")
    }


def world2() -> dict[str, str]:
    sp2 = U.ParallelLayout.from_env(sp=2)
    extra = {
        "sp2_llama_dynamic_offload_fsdp2": functools.partial(
            layer_tiling_parity, sp2, "llama_dynamic", 2, "fsdp2", checkpointing="offload"
        ),
        "sp2_llama_dynamic_no_checkpointing": functools.partial(
            layer_tiling_parity, sp2, "llama_dynamic", 2, "none", checkpointing="none"
        ),
    }
    return run_cases({**cases(sp2, "sp2", ("none", "fsdp2")), **stride_cases(sp2, "sp2"), **extra})


def world4() -> dict[str, str]:
    dp2sp2 = U.ParallelLayout.from_env(sp=2)
    return run_cases({**cases(dp2sp2, "dp2_sp2", ("fsdp2",)), **stride_cases(dp2sp2, "dp2_sp2")})
