"""Multi-rank cases for the tiled lm_head + loss, run by tests/dist/test_tiled_loss_parity.py.

Each case runs a sequence-parallel model with the tiled loss (alone, under DDP, under FSDP2, with tied and
untied embeddings, dp x sp, with gradient accumulation) and compares the loss and every parameter gradient
with one process on the full batch running the model's own (untiled) loss and attention.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ulysses_sp as U
from tests.dist.cases_core import reference
from tests.helpers.harness import run_cases
from tests.helpers.models import build, dp_share, make_batch, router_aux_on
from tests.helpers.parity import GRAD_TOL, LOSS_TOL, assert_loss_and_grads


def wrap(model: torch.nn.Module, how: str) -> torch.nn.Module:
    """No wrapper (grads averaged by sync_gradients), DDP or FSDP2 over the whole world."""
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if how in ("fsdp2", "fsdp2_head_unit"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        if how == "fsdp2_head_unit":  # lm_head as its own FSDP unit, as transformers' DistributedConfig does
            fully_shard(model.lm_head, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    assert how == "none", how
    return model


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name.removeprefix("module.")] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return grads


def run_parallel(model, batch, layout, *, how="none", features=(), chunk_tokens=5, core="sdpa"):
    """This rank's share of the dp x sp run with the tiled loss; returns (loss, full gradients)."""
    par = U.parallelize(copy.deepcopy(model), layout, core=core)
    U.enable_tiled_loss(par, chunk_tokens=chunk_tokens)
    for feature in features:
        feature(par)
    par = wrap(par, how)
    mine = dp_share(batch, layout)
    shard = U.shard_batch(mine, layout)
    loss = U.causal_lm_loss(par, shard, layout)
    loss.backward()
    if how == "none":
        U.sync_gradients(par, layout)
    return loss.detach(), full_grads(par)


def check(layout, arch="llama", *, batch=None, tied=False, attn="sdpa", **kwargs):
    batch = batch if batch is not None else make_batch(2, 24, pad="right")
    model = build(arch, kv_heads=2, attn=attn)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    ref_loss, ref_grads = reference(model, batch)
    loss, grads = run_parallel(model, batch, layout, core=attn if attn == "eager" else "sdpa", **kwargs)
    assert_loss_and_grads(loss, grads, ref_loss, ref_grads)


def accumulate(layout, how):
    """Gradient accumulation: two micro-batches, each forward then backward (DDP: no_sync on the first), against
    the sum of the one-process gradients of the two."""
    model = build("llama", kv_heads=2)
    batch = make_batch(4, 24, pad="right")
    micro = [{k: v[rows] for k, v in batch.items()} for rows in (slice(0, 2), slice(2, 4))]
    ref_grads: dict[str, torch.Tensor] = {}
    for part in micro:
        for name, grad in reference(model, part)[1].items():
            ref_grads[name] = ref_grads[name] + grad if name in ref_grads else grad
    par = wrap(U.enable_tiled_loss(U.parallelize(copy.deepcopy(model), layout), chunk_tokens=5), how)
    for i, part in enumerate(micro):
        with par.no_sync() if how == "ddp" and i == 0 else contextlib.nullcontext():
            U.causal_lm_loss(par, U.shard_batch(part, layout), layout).backward()
    grads = full_grads(par)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


def eval_loss(layout):
    """Under no_grad (evaluation) the tiled loss equals the one-process loss and keeps no graph."""
    model = build("llama", kv_heads=2)
    batch = make_batch(2, 24, packed=(10, 14))
    with torch.no_grad():
        want = model(**batch, use_cache=False).loss
        par = U.enable_tiled_loss(U.parallelize(copy.deepcopy(model), layout), chunk_tokens=3)
        got = U.causal_lm_loss(par, U.shard_batch(batch, layout), layout)
    assert not got.requires_grad
    torch.testing.assert_close(got, want, **LOSS_TOL)


def smoothed(layout, arch="llama", *, via="model", tiled=True, how="none", batch=None, epsilon=0.1):
    """``label_smoothing=epsilon`` against torch's ``cross_entropy(label_smoothing=)`` over the full batch's shifted
    labels in one process (plus the model's load-balancing term for an MoE): the loss and every gradient, through
    ``causal_lm_loss`` (``via="model"``, tiled or not) or ``SequenceParallelLoss`` on the shard's logits."""
    from ulysses_sp.integrations import SequenceParallelLoss

    batch = batch if batch is not None else make_batch(2, 24, pad="right")
    model = build(arch, kv_heads=2)
    if arch == "mixtral":
        router_aux_on(model)
    ref = copy.deepcopy(model)
    out = ref(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False)  # logits [b, N, V]
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # [b, N]
    options = dict(ignore_index=-100, reduction="sum", label_smoothing=epsilon)
    ref_loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), **options) / (targets != -100).sum()
    if arch == "mixtral":
        ref_loss = ref_loss + model.config.router_aux_loss_coef * out.aux_loss
    ref_loss.backward()
    par = U.parallelize(copy.deepcopy(model), layout)
    if tiled:
        U.enable_tiled_loss(par, chunk_tokens=5)
    par = wrap(par, how)
    shard = U.shard_batch(dp_share(batch, layout), layout)
    loss_fn = SequenceParallelLoss(layout, label_smoothing=epsilon)
    if via == "model":
        loss = loss_fn(par, shard)
    else:
        inputs = {k: shard[k] for k in ("input_ids", "position_ids", "attention_mask") if k in shard}
        loss = loss_fn(par(**inputs).logits, shard["shift_labels"])
    loss.backward()
    if how == "none":
        U.sync_gradients(par, layout)
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), **LOSS_TOL)
    grads = full_grads(par)
    for name, param in ref.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(grads[name], param.grad, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


def float64(layout):
    """Under torch.set_default_dtype(torch.float64), an fp64 model: the tiled loss under SP equals one process
    (the kernel's logits gradient had come out in the default dtype, which scatter_add_ refused)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = build("llama", kv_heads=2).double()
        batch = make_batch(2, 24, pad="right")
        ref_loss, ref_grads = reference(model, batch)
        loss, grads = run_parallel(model, batch, layout)
        assert {grad.dtype for grad in grads.values()} == {torch.float64}
        assert_loss_and_grads(loss, grads, ref_loss, ref_grads)
    finally:
        torch.set_default_dtype(previous)


def world2() -> dict[str, str]:
    sp2 = U.ParallelLayout.from_env(sp=2)
    P = functools.partial
    cases = {
        "sp2_untied": P(check, sp2),
        "sp2_tied": P(check, sp2, tied=True),
        "sp2_gemma2_softcap": P(check, sp2, "gemma2", attn="eager"),
        "sp2_packed_default_chunk": P(check, sp2, batch=make_batch(2, 24, packed=(7, 17)), chunk_tokens=None),
        "sp2_ddp_untied": P(check, sp2, how="ddp"),
        "sp2_ddp_tied": P(check, sp2, how="ddp", tied=True),
        "sp2_fsdp2_untied": P(check, sp2, how="fsdp2"),
        "sp2_fsdp2_tied": P(check, sp2, how="fsdp2", tied=True),
        "sp2_fsdp2_lm_head_unit": P(check, sp2, how="fsdp2_head_unit"),
        "sp2_eval_no_grad": P(eval_loss, sp2),
        "sp2_ddp_grad_accumulation": P(accumulate, sp2, "ddp"),
        "sp2_fsdp2_grad_accumulation": P(accumulate, sp2, "fsdp2"),
        # the causal LM reads cross_attentions from its decoder's output (the first-forward probe used to fail)
        "sp2_gpt2": P(check, sp2, "gpt2"),
        "sp2_label_smoothing_tiled": P(smoothed, sp2, batch=make_batch(2, 24, packed=(7, 17))),
        "sp2_label_smoothing_logits": P(smoothed, sp2, via="logits", tiled=False, epsilon=0.3),
        "sp2_label_smoothing_moe_aux_tiled_ddp": P(smoothed, sp2, "mixtral", how="ddp"),
        "sp2_float64_default_dtype": P(float64, sp2),
    }
    return run_cases(cases)


def world4() -> dict[str, str]:
    dp2sp2 = U.ParallelLayout.from_env(sp=2)
    hybrid = U.ParallelLayout.from_env(sp=4, ring=2)  # ulysses 2 x ring 2: tokens dealt in zigzag order
    sp4 = U.ParallelLayout.from_env(sp=4)
    P = functools.partial
    cases = {
        "sp4_afmoe_kv_heads_lt_sp": P(check, sp4, "afmoe", batch=make_batch(2, 26, packed=(9, 17))),
        "hybrid_2x2_fsdp2_packed": P(check, hybrid, batch=make_batch(2, 26, packed=(9, 17)), how="fsdp2"),
        "dp2_sp2_fsdp2_tied": P(check, dp2sp2, batch=make_batch(4, 22), how="fsdp2", tied=True),
        "dp2_sp2_ddp": P(check, dp2sp2, batch=make_batch(4, 22, pad="left"), how="ddp"),
        "dp2_sp2_label_smoothing_untiled": P(smoothed, dp2sp2, batch=make_batch(4, 22), tiled=False),
    }
    return run_cases(cases)
