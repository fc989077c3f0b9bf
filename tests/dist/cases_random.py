"""Random parity cases: architecture x heads x head chunks x memory features x batch shape x wrapper x layout x
LoRA adapters (with their input dropout where the head chunks draw its masks), each one training step compared
with one process on the full batch (loss and every gradient).

A case is drawn from ``(seed, index, world)`` alone, so every rank draws the same one and a failure is
reproduced by its numbers. :func:`run_case` returns ``"ok"`` or ``"refused: <ValueError>"`` (a layout the heads
cannot take, or a batch Ulysses refuses); a result that differs raises. tests/dist/test_random_parity.py runs
a fixed seed's first cases; a longer campaign (how the padding cases of docs/semantics.md were found)::

    python -m tests.dist.test_random_parity --world 4 --seed 7 --count 100
"""

from __future__ import annotations

import copy
import os
import random
import traceback

import torch
import torch.distributed as dist

import ulysses_sp as U
from tests.dist.cases_core import reference
from tests.dist.cases_memory_features import full_grad, wrap
from tests.helpers.models import (
    build,
    dp_share,
    dropout_seeds,
    make_batch,
    router_aux_on,
    with_chunk_dropout,
    with_lora,
)
from tests.helpers.parity import GRAD_TOL, LOSS_TOL

ARCHS = (
    "llama", "qwen3", "mistral", "qwen2", "gemma2", "mixtral", "qwen3_moe", "deepseek_v3_mla_v4", "starcoder2",
    "granite", "glm4", "smollm3", "exaone4", "ministral", "stablelm", "llama3_yarn",
)  # fmt: skip
DROPOUT_SEED = 1000
SEED_ENV, START_ENV, COUNT_ENV = "ULYSSES_SP_RANDOM_SEED", "ULYSSES_SP_RANDOM_START", "ULYSSES_SP_RANDOM_COUNT"


def random_case(seed: int, index: int, world: int) -> dict:
    """The parameters of case ``index`` of ``seed`` on ``world`` ranks (plain data: printed with a failure)."""
    r = random.Random(f"{seed}/{world}/{index}")
    layout = r.choice(["sp", "dp", "ring"]) if world == 4 else "sp"
    sp = 2 if layout == "dp" else world
    heads = r.choice([2, 4, 8] if world == 2 else [4, 8, 8])
    rows = 2 if layout == "dp" else r.choice([1, 2])
    n = sp * r.randint(2, 14) if r.random() < 0.6 else r.randint(2 * sp, 44)  # divisible by sp or not
    batch: dict = dict(batch=rows, seq_len=n, seed=r.randint(0, 99))
    kind = r.choice(["plain", "packed", "pad"])
    if kind == "packed":
        cuts = sorted(r.sample(range(1, n), k=min(r.randint(1, 3), n - 1)))
        batch["packed"] = tuple(b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True))
    elif kind == "pad":
        batch["pad"] = r.choice(["right", "right", "left"])
        batch["pad_lengths"] = tuple(r.randint(0, n // 2) for _ in range(rows))
    case = dict(
        arch=(arch := r.choice(ARCHS)),
        heads=heads,
        kv_heads=r.choice([h for h in (1, 2, 4, 8) if heads % h == 0]),
        # gemma2's softcapping runs under eager attention only (in transformers and here)
        core="eager" if arch == "gemma2" else r.choice(["sdpa", "eager"]),
        layout=layout,
        batch=batch,
        head_chunks=r.choice([None, 1, 2, 4]),
        mlp_chunk=r.choice([None, r.randint(1, 9)]),  # None: no tiled MLP and norms
        checkpointing=r.choice(["none", "checkpoint", "offload"]),
        loss_chunk=r.choice([None, r.randint(1, 9)]),  # None: no tiled loss
        wrapper=r.choice(["none", "ddp", "fsdp2"]),
        # PEFT LoRA (random A and B) on q and v, or on every attention projection (MLA: its q_b / kv_b / o)
        lora=r.choice([None, None, "qv", "all"]),
        # the adapters' input dropout: compared where the reference can draw the head chunks' masks (chunks >= 2,
        # contiguous shards: not the ring's zigzag); else the case runs without it
        lora_dropout=r.choice([0.0, 0.25]),
        # an MoE adds its load-balancing loss (output_router_logits, weighted 0.5 so that a shard's alone shows)
        router_aux=r.random() < 0.5,
        # with LoRA: lm_head trained too, as PEFT's modules_to_save copy (the tiled loss runs in the copy)
        lora_head=r.random() < 0.4,
    )
    if case["lora"] is None or case["head_chunks"] not in (2, 4) or layout == "ring":
        case["lora_dropout"] = 0.0
    return case


def run_case(case: dict, layouts: dict[str, U.ParallelLayout]) -> str:
    """One step of ``case`` on this rank against one process; "ok", or "refused: ..." for a ValueError."""
    layout = layouts[case["layout"]]
    model = build(case["arch"], heads=case["heads"], kv_heads=case["kv_heads"], attn=case["core"])
    batch = make_batch(**case["batch"])
    if case["router_aux"] and hasattr(model, "router_aux_loss_coef"):
        router_aux_on(model)
    ref_model = model
    if case["lora"] is not None:
        names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        wanted = ("q_proj", "v_proj") if case["lora"] == "qv" else ("q_proj", "k_proj", "v_proj", "o_proj")
        targets = tuple(n for n in (*wanted, "q_b_proj", "kv_b_proj") if n in names)
        saved = ["lm_head"] if case["lora_head"] else None
        ref_model = model = with_lora(model, targets, lora_dropout=case["lora_dropout"], modules_to_save=saved)
        if case["lora_dropout"]:  # the reference draws each rank's masks as the head chunks do (seed 1000 + layer)
            p, copied = case["lora_dropout"], copy.deepcopy(model)
            ref_model = with_chunk_dropout(copied, targets, p=p, seed=DROPOUT_SEED, layout=layout)
    ref_loss, ref_grads = reference(ref_model, batch)
    with dropout_seeds(DROPOUT_SEED):
        return _parallel_step(case, layout, model, batch, ref_loss, ref_grads)


def _parallel_step(case: dict, layout: U.ParallelLayout, model, batch: dict, ref_loss, ref_grads) -> str:
    try:
        par = U.parallelize(copy.deepcopy(model), layout, core=case["core"], head_chunks=case["head_chunks"])
        if case["mlp_chunk"] is not None:
            U.enable_tiled_mlp(par, chunk_tokens=case["mlp_chunk"])
            U.enable_tiled_norms(par, chunk_tokens=case["mlp_chunk"])
        U.enable_activation_checkpointing(par, case["checkpointing"])
        if case["loss_chunk"] is not None:
            U.enable_tiled_loss(par, chunk_tokens=case["loss_chunk"])
        par.train()
        wrapped = par if case["wrapper"] == "none" else wrap(par, case["wrapper"])
        mine = dp_share(batch, layout)
        loss = U.causal_lm_loss(wrapped, U.shard_batch(mine, layout), layout)
    except ValueError as error:
        return f"refused: {error}"
    loss.backward()
    if case["wrapper"] == "none":
        U.sync_gradients(par, layout)
    torch.testing.assert_close(loss.detach(), ref_loss, **LOSS_TOL)
    for name, param in par.named_parameters():
        want = ref_grads[name]
        if want is None:  # a parameter the loss does not reach
            assert param.grad is None or not full_grad(param).any(), name
            continue
        # atol also 1e-6 of the gradient's largest element: a random tiny model can hold gradients of 1e7 beside
        # ones of 1e5 in one tensor, and fp32 rounds by more than rtol of the small ones (seed 12 case 31 on 2
        # ranks: GLM-4's v_proj.bias up to 7.4e7, where the one-process fp32 reference itself is 30 (4e-7 of it)
        # off float64's, and head chunks 1 and 2 as far)
        atol = max(GRAD_TOL["atol"], 1e-6 * float(want.abs().max()))
        torch.testing.assert_close(
            full_grad(param), want, rtol=GRAD_TOL["rtol"], atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )
    return "ok"


def _world(world: int) -> dict[str, str]:
    layouts = {"sp": U.ParallelLayout.from_env(sp=world)}
    if world == 4:
        layouts |= {"dp": U.ParallelLayout.from_env(sp=2), "ring": U.ParallelLayout.from_env(sp=4, ring=2)}
    seed = int(os.environ.get(SEED_ENV, 0))
    start, count = int(os.environ.get(START_ENV, 0)), int(os.environ.get(COUNT_ENV, 12))
    results = {}
    for index in range(start, start + count):
        case = random_case(seed, index, world)
        try:
            results[str(index)] = run_case(case, layouts)
        except Exception:
            results[str(index)] = f"{case}\n{traceback.format_exc()}"
        dist.barrier()
    return results


def world2() -> dict[str, str]:
    return _world(2)


def world4() -> dict[str, str]:
    return _world(4)
