"""Multi-rank cases for tiled MLP + norms and activation checkpointing/offload, run by test_memory_features_parity.py.

Each case trains one step of the same tiny model under Ulysses (sp=2, or dp=2 x sp=2 on 4 ranks) with the
memory features on (once with the tiled loss too), wrapped in DDP or FSDP2 (``fully_shard`` per decoder
layer and at the root on a CPU gloo mesh), and compares the loss and every parameter gradient with one
process on the full batch running the plain transformers model (no ulysses_sp code, tiling or checkpointing).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import ulysses_sp as U
from tests.dist.cases_core import reference
from tests.helpers.harness import run_cases
from tests.helpers.models import _common, dp_share, make_batch
from tests.helpers.parity import GRAD_TOL, assert_loss_and_grads
from ulysses_sp.hf import decoder_layers
from ulysses_sp.offload import offload_store


def build_model(arch: str, tied: bool, seed: int = 0, heads: int = 4):
    config = {**_common(heads, 2), "tie_word_embeddings": tied, "attn_implementation": "sdpa"}
    torch.manual_seed(seed)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**config)).float()
    return Qwen3ForCausalLM(Qwen3Config(**config)).float()


def wrap(model, wrapper: str):
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
    for layer in decoder_layers(model):  # a PEFT model's too
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_grad(param):
    grad = param.grad
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def check_features(
    layout,
    wrapper: str,
    *,
    tiled: bool,
    checkpointing: str,
    arch="llama",
    tied=False,
    batch=None,
    chunk=5,
    after_wrap=False,
    tiled_loss=False,
    heads=4,
    head_chunks=None,
    adapt=None,
    ref_adapt=None,
    stride=1,
    twin=False,
):
    """``heads`` query heads (2 kv heads); ``head_chunks``: parallelize's (None: its default); ``adapt(model)``:
    the model to run instead of the built one (e.g. with LoRA); ``ref_adapt(copy)``: the reference's instead of
    that model (e.g. its dropout drawing the run's masks); ``stride``: the checkpoint stride; ``twin``: run a
    copy.deepcopy of the model made once its features are on (an EMA or reference model), the original's weights
    then changed and both wrapped."""
    assert not (twin and after_wrap)
    batch = batch if batch is not None else make_batch(2, 24, packed=(10, 14))
    model = build_model(arch, tied, heads=heads)
    if adapt is not None:
        model = adapt(model)
    ref_loss, ref_grads = reference(model if ref_adapt is None else ref_adapt(copy.deepcopy(model)), batch)

    par = U.parallelize(copy.deepcopy(model), layout, head_chunks=head_chunks)
    wrapped = wrap(par, wrapper) if after_wrap else None
    if tiled:  # the tiled layer: MLP and norms (the MLP's norm fused into its chunks)
        U.enable_tiled_mlp(par, chunk_tokens=chunk)  # 12 tokens per rank: chunks of 5, 5 and 2
        U.enable_tiled_norms(par, chunk_tokens=chunk)
    U.enable_activation_checkpointing(par, checkpointing, stride=stride)
    if tiled_loss:
        U.enable_tiled_loss(par, chunk_tokens=7)
    if twin:
        original, par = par, copy.deepcopy(par)
        with torch.no_grad():
            for param in original.parameters():
                param.mul_(1.5)
        wrap(original, wrapper)
    par.train()
    wrapped = wrapped or wrap(par, wrapper)
    mine = dp_share(batch, layout)
    shard = U.shard_batch(mine, layout)
    if tiled_loss:
        loss = U.causal_lm_loss(wrapped, shard, layout)
    else:
        inputs = {k: shard[k] for k in ("input_ids", "position_ids", "attention_mask") if k in shard}
        logits = wrapped(**inputs).logits  # (the mask too: without it a left-padded row attended its padding)
        loss = U.sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout)
    if checkpointing == "offload":  # one host copy of each group head's input [b, n/sp, h] is held
        b, n, h = shard["input_ids"].shape[0], shard["input_ids"].shape[1], model.config.hidden_size
        held = offload_store(par).held_bytes()
        assert held == -(-model.config.num_hidden_layers // stride) * b * n * h * 4, held
    loss.backward()
    if checkpointing == "offload":
        assert offload_store(par).held_bytes() == 0, "the host store outlived backward"

    assert_loss_and_grads(loss, {name: full_grad(p) for name, p in par.named_parameters()}, ref_loss, ref_grads)


def different_lengths_per_rank(layout):
    """DDP ranks whose shards give different numbers of MLP chunks (7 vs 3): no hang, grads averaged right."""
    model = build_model("llama", tied=False)
    par = U.enable_tiled_mlp(copy.deepcopy(model), chunk_tokens=2)
    wrapped = torch.nn.parallel.DistributedDataParallel(par)
    n = 13 if dist.get_rank() == 0 else 6
    batches = [make_batch(1, 13, seed=5), make_batch(1, 6, seed=6)]
    out = wrapped(**batches[dist.get_rank()], use_cache=False)
    (out.loss * n).backward()  # DDP averages over 2 ranks: sum of n_r * loss_r / 2
    grads = {name: p.grad for name, p in par.named_parameters()}
    want = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for rank_batch, tokens in zip(batches, (13, 6), strict=True):
        ref = copy.deepcopy(model)
        (ref(**rank_batch, use_cache=False).loss * tokens / 2).backward()
        for name, p in ref.named_parameters():
            want[name] += p.grad
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


def world2() -> dict[str, str]:
    sp2 = U.ParallelLayout.from_env(sp=2)
    P = functools.partial
    cases = {}
    for wrapper in ("ddp", "fsdp2"):
        for tied in (False, True):
            suffix = f"{wrapper}_{'tied' if tied else 'untied'}"
            cases[f"sp2_tiled_{suffix}"] = P(check_features, sp2, wrapper, tiled=True, checkpointing="none", tied=tied)
            cases[f"sp2_offload_{suffix}"] = P(
                check_features, sp2, wrapper, tiled=False, checkpointing="offload", tied=tied
            )
            cases[f"sp2_tiled_offload_{suffix}"] = P(
                check_features, sp2, wrapper, tiled=True, checkpointing="offload", tied=tied
            )
        cases[f"sp2_tiled_checkpoint_qwen3_{wrapper}"] = P(
            check_features, sp2, wrapper, tiled=True, checkpointing="checkpoint", arch="qwen3"
        )
    for wrapper in ("ddp", "fsdp2"):
        cases[f"sp2_tiled_offload_enabled_after_{wrapper}"] = P(
            check_features, sp2, wrapper, tiled=True, checkpointing="offload", after_wrap=True
        )
    cases["sp2_tiled_loss_tiled_mlp_offload_fsdp2_tied"] = P(
        check_features, sp2, "fsdp2", tiled=True, checkpointing="offload", tied=True, tiled_loss=True
    )
    # a copy made with a checkpoint stride of 2 recomputed its groups with the original's FSDP2 units gathered
    cases["sp2_tiled_offload_stride2_copy_fsdp2"] = P(
        check_features, sp2, "fsdp2", tiled=True, checkpointing="offload", stride=2, twin=True
    )
    cases["sp2_tiled_offload_padded_ddp"] = P(
        check_features, sp2, "ddp", tiled=True, checkpointing="offload", batch=make_batch(2, 23, pad="right")
    )
    cases["sp2_tiled_checkpoint_left_padded_fsdp2"] = P(
        check_features,
        sp2,
        "fsdp2",
        tiled=True,
        checkpointing="checkpoint",
        stride=2,
        batch=make_batch(2, 23, pad="left"),
    )
    cases["ddp_different_chunk_counts_per_rank"] = P(different_lengths_per_rank, sp2)
    return run_cases(cases)


def world4() -> dict[str, str]:
    dp2sp2 = U.ParallelLayout.from_env(sp=2)
    P = functools.partial
    batch = make_batch(4, 22)
    cases = {
        f"dp2_sp2_tiled_offload_{wrapper}": P(
            check_features, dp2sp2, wrapper, tiled=True, checkpointing="offload", batch=batch, tied=True
        )
        for wrapper in ("ddp", "fsdp2")
    }
    return run_cases(cases)
