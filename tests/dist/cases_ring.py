"""Multi-rank cases for ring and hybrid Ulysses x Ring attention, run by tests/dist/test_ring_parity.py.

Parity cases reuse cases_core.check_parity: the same model in one process on the full batch (plain
transformers attention) against the ring / hybrid run, loss and every parameter gradient in fp32.
"""

from __future__ import annotations

import copy
import functools
import os

import torch
import torch.distributed as dist

import ulysses_sp as U
from tests.dist.cases_architectures import zero_pad_embedding
from tests.dist.cases_core import check_parity, expect_raise, reference
from tests.helpers.harness import run_cases
from tests.helpers.models import build, dp_share, make_batch
from tests.helpers.parity import LOSS_TOL, assert_loss_and_grads
from tests.helpers.ring_sim import one_process_error_sums, ring_error_sums
from ulysses_sp.ring import ring_bytes_per_layer

P = functools.partial


def ring_layout(sp: int, ring: int, **heads) -> U.ParallelLayout:
    layout = U.ParallelLayout.from_env(sp=sp, ring=ring, **heads)
    assert (layout.sp, layout.ring, layout.ulysses) == (sp, ring, sp // ring), layout
    assert dist.get_world_size(layout.sp_group) == sp
    if ring > 1:
        assert dist.get_world_size(layout.ring_group) == ring
        assert dist.get_rank(layout.ring_group) == layout.ring_rank
    return layout


# ---------------------------------------------------------------------------------------------- bytes
def _run_counted(layout, heads, kv_heads, seq_len):
    stats = U.CommStats()
    model = U.parallelize(build("llama", heads=heads, kv_heads=kv_heads), layout, stats=stats)
    shard = U.shard_batch(make_batch(1, seq_len), layout)
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    forward = (stats.calls.copy(), stats.bytes.copy())
    U.sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout).backward()
    return model.config.num_hidden_layers, forward, (stats.calls, stats.bytes)


def byte_counts(layout, heads, kv_heads, seq_len=16):
    """Bytes per attention layer and rank, counted by CommStats, against the formulas (fp32, b = 1, d = 8).

    Ulysses (U ranks, n = N/sp tokens per rank, hkv = max(Hkv/U, 1)): (H + 2*hkv*U)*n*d + H*n*d elements
    forward, the same backward. Ring (R ranks, blocks of N/R tokens): (R-1) k/v messages of 2*hkv*(N/R)*d
    forward; backward (R-1) k/v messages plus R fp32 gradient messages of the same size.
    """
    layers, (fwd_calls, fwd_bytes), (calls, total) = _run_counted(layout, heads, kv_heads, seq_len)
    u, r, d = layout.ulysses, layout.ring, 8
    hkv = max(kv_heads // u, 1)
    n = seq_len // layout.sp
    a2a = ((heads + 2 * hkv * u) * n * d + heads * n * d) * 4 if u > 1 else 0
    ring_fwd, ring_bwd = ring_bytes_per_layer(
        batch=1, kv_heads=hkv, block_len=seq_len // r, head_dim=d, ring=r, element_size=4
    )
    assert ring_fwd == (r - 1) * 2 * hkv * (seq_len // r) * d * 4  # the CONTEXT.md figure: ~2*N*Hkv*d
    assert fwd_bytes["all_to_all"] == layers * a2a, (fwd_bytes, layers * a2a)
    assert fwd_bytes["ring_p2p"] == layers * ring_fwd, (fwd_bytes, layers * ring_fwd)
    assert fwd_calls["ring_p2p"] == layers * (r - 1), fwd_calls
    assert fwd_calls["all_to_all"] == (2 * layers if u > 1 else 0), fwd_calls
    assert total["all_to_all"] == 2 * layers * a2a, total
    assert total["ring_p2p"] == layers * (ring_fwd + ring_bwd), (total, layers * (ring_fwd + ring_bwd))
    assert calls["ring_p2p"] == (layers * (r - 1 + r - 1 + r) if r > 1 else 0), calls


# ---------------------------------------------------------------------------------------------- bf16 merge
def _errors(layout, dtype=torch.bfloat16, kernel=None, chunk=None) -> torch.Tensor:
    """Relative RMS error of ring attention (output, dq, dk, dv) in ``dtype`` against float64 attention on the
    same (rounded) inputs, over the whole sequence (squared errors summed over the ring)."""
    group = layout.ring_group
    sums = ring_error_sums(group, dist.get_rank(group), layout.ring, dtype=dtype, kernel=kernel, query_chunk=chunk)
    dist.all_reduce(sums, group=group)
    return (sums[:, 0] / sums[:, 1]).sqrt()


def bf16_merge_error(ring2: U.ParallelLayout, ring4: U.ParallelLayout):
    """The fp32 merge adds no error that grows with the ring: bf16 errors of the fused and the plain kernel at
    ring 2 and 4 are no larger than one bf16 process running sdpa on the whole sequence."""
    one = one_process_error_sums()
    one = (one[:, 0] / one[:, 1]).sqrt()
    names = ("out", "dq", "dk", "dv")
    for kernel in ("cpu_flash", "plain"):
        err2, err4 = _errors(ring2, kernel=kernel), _errors(ring4, kernel=kernel)
        for name, e1, e2, e4 in zip(names, one, err2, err4, strict=True):
            assert 0 < e1 < 1e-2, (name, e1)
            where = f"{kernel} {name}: one process / ring 2 / ring 4: {e1:.3e} {e2:.3e} {e4:.3e}"
            assert 0 < e2 <= e1 and 0 < e4 <= e1, where
    fp32 = _errors(ring4, torch.float32, kernel="plain", chunk=3)  # queries in chunks of 3
    assert (fp32 < 1e-5).all(), fp32


# ---------------------------------------------------------------------------------------------- bad input
def _raises(fn, *needles):
    try:
        fn()
    except ValueError as err:
        for needle in needles:
            assert needle in str(err), (needle, str(err))
    else:
        raise AssertionError(f"no ValueError (expected one mentioning {needles})")


def bad_layouts(sp: int):
    """Layouts that cannot be formed: ValueError naming the ones that can, on every rank, before any group."""
    _raises(lambda: U.ParallelLayout.from_env(sp=sp, ring=3), "ring must be a positive int dividing", "1, 2")
    if sp == 4:
        _raises(
            lambda: U.ParallelLayout.from_env(sp=4, ring=1, num_heads=2),
            "ulysses 4 x ring 1 cannot be formed",
            "ulysses 2 x ring 2, ulysses 1 x ring 4",
        )
        hybrid = U.ParallelLayout.from_env(sp=4, ring=2)
        _raises(  # 3 heads cannot split over ulysses 2
            lambda: U.parallelize(build("llama", heads=3), hybrid), "ulysses 2 x ring 2", "ulysses 1 x ring 4"
        )
    ring = U.ParallelLayout.from_env(sp=2, ring=2)
    for core in ("flex_attention", "flash_attention_2"):  # refused at parallelize, before any step
        _raises(lambda core=core: U.parallelize(build("llama"), ring, core=core), f"core={core!r}", "'sdpa'")


def hybrid_from_groups() -> U.ParallelLayout:
    """ulysses 2 x ring 2 from new_group calls: sp [0..3], ring [0, 2] / [1, 3], Ulysses [0, 1] / [2, 3]."""
    rank = dist.get_rank()
    sp_group = dist.new_group([0, 1, 2, 3])
    rings = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ulysses = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    layout = U.ParallelLayout.from_groups(sp_group, ring_group=rings[rank % 2], ulysses_group=ulysses[rank // 2])
    assert (layout.ulysses, layout.ring, layout.ring_rank, layout.ulysses_rank) == (2, 2, rank // 2, rank % 2)
    return layout


def automatic_choice():
    """ring=None with head counts: pure Ulysses when the heads allow it, else the smallest ring."""
    world = dist.get_world_size()
    assert U.ParallelLayout.from_env(sp=world, num_heads=4, num_kv_heads=2).ring == 1
    layout = U.ParallelLayout.from_env(sp=world, num_heads=2, num_kv_heads=1)
    assert (layout.ulysses, layout.ring) == (2, world // 2), layout
    assert U.ParallelLayout.from_env(sp=world).ring == 1  # no head counts: pure Ulysses as before


def topology_choice():
    """With nodes of 2 (LOCAL_WORLD_SIZE=2), sp=4 over heads that allow pure Ulysses becomes ulysses 2 x ring 2,
    and every Ulysses group is 2 consecutive ranks of one node."""
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        layout = U.ParallelLayout.from_env(sp=4, num_heads=4, num_kv_heads=4)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE")
        if saved is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    assert (layout.ulysses, layout.ring) == (2, 2), layout
    ranks = dist.get_process_group_ranks(layout.ulysses_group)
    assert ranks == [2 * (dist.get_rank() // 2), 2 * (dist.get_rank() // 2) + 1], ranks
    assert U.ParallelLayout.from_env(sp=4, num_heads=4, num_kv_heads=4, gpus_per_node=4).ring == 1
    check_parity(layout, "llama", kv_heads=2, batch=make_batch(2, 24, packed=(9, 15)))


def shards_of_another_layout(model_layout: U.ParallelLayout, others: list[U.ParallelLayout]):
    """Shards cut by shard_batch for another layout than the model's (a second from_env that chose another ring,
    or another sp) hold another order or cut of the sequence: the loss came out silently wrong (rel. 1e-4 to 1e-3
    here); now a ValueError on every rank, naming both layouts. A shard of an equal layout object runs exactly."""
    model = build("llama", heads=2, kv_heads=1)
    batch = make_batch(2, 24, seed=3)
    ref_loss = model(**batch, use_cache=False).loss.detach()
    par = U.parallelize(model, model_layout)
    for other in others:
        shard = U.shard_batch(dp_share(batch, other), other)
        wanted = [f"shard_batch for sp={other.sp}, ring={other.ring}", f"parallelized on sp={model_layout.sp}, ring="]
        expect_raise(ValueError, wanted)(lambda shard=shard, other=other: U.causal_lm_loss(par, shard, other))
        inputs = {k: shard[k] for k in ("input_ids", "position_ids")}
        expect_raise(ValueError, wanted)(lambda inputs=inputs: par(**inputs))
    same = U.ParallelLayout.from_env(sp=model_layout.sp, ring=model_layout.ring)
    loss = U.causal_lm_loss(par, U.shard_batch(dp_share(batch, same), same), same)
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOL)


def gathered_on_another_layout(layout: U.ParallelLayout):
    """gather_sequence with a layout of another ring (or sp) than the shards were cut for put their tokens together
    in another order, silently (a ring-2 shard's logits gathered on a ring-1 layout: not one process's logits); now a
    ValueError on every rank for shard_batch's tensors and the model's logits and hidden states, which carry the
    cut. With the layout they were cut for: one process's logits and hidden states."""
    model = build("llama", heads=2, kv_heads=1)
    batch = make_batch(2, 23, seed=360)
    with torch.no_grad():
        ref = model(input_ids=batch["input_ids"], output_hidden_states=True)
        par = U.parallelize(model, layout)
        shard = U.shard_batch(batch, layout)
        out = par(input_ids=shard["input_ids"], position_ids=shard["position_ids"], output_hidden_states=True)
        for other in (U.ParallelLayout.from_env(sp=layout.sp, ring=1), U.ParallelLayout.single()):
            refused = expect_raise(
                ValueError, [f"its shard) for sp={layout.sp}, ring={layout.ring}", f"layout of sp={other.sp}, ring=1"]
            )
            for part in (out.logits, out.hidden_states[1], shard["shift_labels"], shard["input_ids"]):
                refused(lambda part=part, other=other: U.gather_sequence(part, other))
        torch.testing.assert_close(U.gather_sequence(out.logits, layout)[:, :23], ref.logits, **LOSS_TOL)
        for got, want in zip(out.hidden_states, ref.hidden_states, strict=True):
            torch.testing.assert_close(U.gather_sequence(got, layout)[:, :23], want, **LOSS_TOL)


def shards_on_a_model_without_ulysses(layout: U.ParallelLayout):
    """Shards on a model that does not run Ulysses attention: never parallelized, switched back by plain_attention,
    or unparallelized (to generate) and then trained on again. Each rank's attention saw its own shard alone and
    causal_lm_loss returned a silently wrong loss (4.8423 against one process's 4.8437 here); now a ValueError on
    every rank, and the same shards run exactly once the model is parallelized again."""
    model = build("llama", heads=2, kv_heads=1)
    batch = make_batch(2, 24, seed=340)
    ref_loss = model(**batch, use_cache=False).loss.detach()
    shard = U.shard_batch(dp_share(batch, layout), layout)
    inputs = {k: shard[k] for k in ("input_ids", "position_ids")}
    refused = expect_raise(ValueError, ["not parallelized", "parallelize(model, layout)"])
    refused(lambda: U.causal_lm_loss(model, shard, layout))
    U.parallelize(model, layout)
    with U.plain_attention(model):
        in_plain = expect_raise(ValueError, [f"a shard of sp={layout.sp}", "plain_attention"])
        in_plain(lambda: U.causal_lm_loss(model, shard, layout))
        in_plain(lambda: model(**inputs))
        model(input_ids=batch["input_ids"])  # a whole input: what plain_attention is for
    U.unparallelize(model)
    refused(lambda: U.causal_lm_loss(model, shard, layout))
    U.parallelize(model, layout)
    torch.testing.assert_close(U.causal_lm_loss(model, shard, layout), ref_loss, **LOSS_TOL)


def wrapper_over_part_of_the_world(layout: U.ParallelLayout):
    """DDP or FSDP2 over the dp group (or the SP group) alone, as a Megatron-style loop would wrap it: the gradients
    were averaged without the other SP ranks' shares (half of the embedding's gradient wrong here), silently; now a
    ValueError on every rank naming the ranks each wrapper reduces over. Over the whole world: exact."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from tests.dist.cases_memory_features import wrap

    model = build("llama", heads=2, kv_heads=1)
    batch = make_batch(4, 24, seed=350)
    ref_loss = model(**batch, use_cache=False).loss.detach()
    shard = U.shard_batch(dp_share(batch, layout), layout)
    world = list(range(dist.get_world_size()))
    for group in (layout.dp_group, layout.sp_group):
        ranks = dist.get_process_group_ranks(group)
        refused = expect_raise(ValueError, [f"over ranks {ranks}", f"dp x sp: ranks {world}"])
        ddp = torch.nn.parallel.DistributedDataParallel(U.parallelize(build("llama", heads=2, kv_heads=1), layout),
                                                        process_group=group)  # fmt: skip
        refused(lambda ddp=ddp: U.causal_lm_loss(ddp, shard, layout))
        fsdp = U.parallelize(build("llama", heads=2, kv_heads=1), layout)
        fully_shard(fsdp, mesh=DeviceMesh.from_group(group, "cpu"))
        refused(lambda fsdp=fsdp: U.causal_lm_loss(fsdp, shard, layout))
    for how in ("ddp", "fsdp2"):
        wrapped = wrap(U.parallelize(build("llama", heads=2, kv_heads=1), layout), how)
        torch.testing.assert_close(U.causal_lm_loss(wrapped, shard, layout).detach(), ref_loss, **LOSS_TOL)


def fsdp2_over_part_of_the_model(layout: U.ParallelLayout):
    """FSDP2 on the decoder layers alone (no fully_shard on the model itself): the embedding, final norm and lm_head
    stayed plain tensors that nothing averaged, so their gradients were each rank's own share, silently (the
    embedding's up to 0.087 off here, at sp=2 too); now a ValueError on every rank naming one and the fix. So is
    sync_gradients on an FSDP2 model (it averages those gradients itself; it was torch's NotImplementedError for
    the DTensors). With the root wrapped too: exact, and still accepted after an evaluation under no_grad (which
    leaves the root's parameters unsharded, plain tensors until the next backward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build("llama", heads=2, kv_heads=1)
    batch = make_batch(4, 24, seed=352, pad="right")
    ref_loss, ref_grads = reference(model, batch)
    shard = U.shard_batch(dp_share(batch, layout), layout)
    par = U.parallelize(copy.deepcopy(model), layout)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in par.model.layers:
        fully_shard(layer, mesh=mesh)
    expect_raise(
        ValueError, ["no FSDP2 unit holds 'model.embed_tokens.weight' or 2 more", "fully_shard on the whole model"]
    )(lambda: U.causal_lm_loss(par, shard, layout))
    fully_shard(par, mesh=mesh)
    loss = U.causal_lm_loss(par, shard, layout)
    loss.backward()
    expect_raise(ValueError, ["FSDP2 (fully_shard) shards FSDPLlamaForCausalLM", "drop the sync_gradients"])(
        lambda: U.sync_gradients(par, layout)
    )
    grads = {name: param.grad.full_tensor() for name, param in par.named_parameters()}
    assert_loss_and_grads(loss.detach(), grads, ref_loss, ref_grads)
    with torch.no_grad():
        torch.testing.assert_close(U.causal_lm_loss(par, shard, layout), ref_loss, **LOSS_TOL)
    torch.testing.assert_close(U.causal_lm_loss(par, shard, layout).detach(), ref_loss, **LOSS_TOL)


# ---------------------------------------------------------------------------------------------- workers
def world2() -> dict[str, str]:
    ring2 = ring_layout(2, 2)
    cases = {
        "ring2_llama_gqa": P(check_parity, ring2, "llama", kv_heads=2),
        "ring2_mha_eager_core": P(check_parity, ring2, "llama", core="eager"),
        "ring2_mqa": P(check_parity, ring2, "qwen3", kv_heads=1),
        "ring2_packed": P(check_parity, ring2, "llama", kv_heads=2, batch=make_batch(2, 24, packed=(5, 9, 10))),
        "ring2_padded_right": P(check_parity, ring2, "llama", batch=make_batch(2, 24, pad="right")),
        "ring2_padded_left": P(check_parity, ring2, "llama", kv_heads=2, batch=make_batch(2, 24, pad="left")),
        "ring2_seq_not_divisible": P(check_parity, ring2, "llama", batch=make_batch(2, 23)),
        "ring2_gemma3n_zero_pad_embedding": P(zero_pad_embedding, ring2, 23),  # right pads dealt in zigzag order
        "ring2_sliding_window_packed": P(check_parity, ring2, "mistral", batch=make_batch(2, 30, packed=(13, 17))),
        "ring2_qwen2_mixed_window": P(check_parity, ring2, "qwen2", kv_heads=2),
        "ring2_gemma2_softcap": P(check_parity, ring2, "gemma2", kv_heads=2, ref_attn="eager", core="eager"),
        "ring2_window_padded_left": P(check_parity, ring2, "mistral", kv_heads=2, batch=make_batch(2, 28, pad="left")),
        "ring2_plain_kernel_packed_window": P(
            check_parity, ring2, "mistral", kv_heads=1, core="eager", batch=make_batch(2, 28, packed=(5, 15, 8))
        ),
        "ring2_gradient_checkpointing": P(
            check_parity, ring2, "qwen3", kv_heads=2, checkpointing=True, batch=make_batch(2, 24, packed=(10, 14))
        ),
        "ring2_bytes": P(byte_counts, ring2, heads=4, kv_heads=2),
        "ulysses2_bytes": P(byte_counts, ring_layout(2, 1), heads=4, kv_heads=2),
        "bad_layouts": P(bad_layouts, 2),
        "gathered_on_another_layout": P(gathered_on_another_layout, ring2),
        "automatic_choice": automatic_choice,
    }
    return run_cases(cases)


def world4() -> dict[str, str]:
    ring4 = ring_layout(4, 4)
    hybrid = ring_layout(4, 2, num_heads=2)  # a model with 2 heads at sp=4: ulysses 2 x ring 2
    dp2_ring2 = ring_layout(2, 2)
    assert dp2_ring2.dp == 2
    by_hand = hybrid_from_groups()
    cases = {
        "ring4_llama": P(check_parity, ring4, "llama", kv_heads=2),
        "ring4_packed": P(check_parity, ring4, "llama", batch=make_batch(2, 30, packed=(11, 19))),
        "ring4_padded_not_divisible": P(
            check_parity, ring4, "mistral", kv_heads=2, batch=make_batch(2, 26, pad="right")
        ),
        "ring4_mqa_packed_window": P(
            check_parity, ring4, "mistral", kv_heads=1, batch=make_batch(2, 32, packed=(3, 18, 11))
        ),
        "ring4_plain_kernel_packed": P(
            check_parity, ring4, "llama", core="eager", batch=make_batch(2, 30, packed=(11, 19))
        ),
        "hybrid_2x2_llama": P(check_parity, hybrid, "llama", heads=2),
        "hybrid_2x2_kv1_window_padded_right": P(
            check_parity, hybrid, "mistral", heads=2, kv_heads=1, batch=make_batch(2, 27, pad="right")
        ),
        "hybrid_2x2_mqa_packed": P(
            check_parity, hybrid, "llama", heads=2, kv_heads=1, batch=make_batch(2, 24, packed=(7, 10, 7))
        ),
        "hybrid_2x2_padded_left": P(check_parity, hybrid, "qwen3", heads=2, batch=make_batch(2, 21, pad="left")),
        "hybrid_2x2_gemma3_packed_window": P(
            check_parity, hybrid, "gemma3", heads=2, batch=make_batch(2, 30, packed=(11, 19))
        ),
        "hybrid_2x2_from_groups": P(check_parity, by_hand, "llama", heads=2, batch=make_batch(2, 22, pad="right")),
        "dp2_ring2": P(check_parity, dp2_ring2, "llama", kv_heads=2, batch=make_batch(4, 22)),
        "dp2_ring2_packed": P(check_parity, dp2_ring2, "qwen2", batch=make_batch(2, 24, packed=(9, 15))),
        "bf16_merge_error_ring2_vs_ring4": P(bf16_merge_error, dp2_ring2, ring4),
        "ring4_bytes": P(byte_counts, ring4, heads=4, kv_heads=2),
        "hybrid_2x2_bytes": P(byte_counts, hybrid, heads=2, kv_heads=2),
        "hybrid_2x2_bytes_kv_lt_ulysses": P(byte_counts, hybrid, heads=2, kv_heads=1),
        "ulysses4_bytes": P(byte_counts, ring_layout(4, 1), heads=4, kv_heads=2),
        "bad_layouts": P(bad_layouts, 4),
        "automatic_choice": automatic_choice,
        "topology_choice": topology_choice,
        "shards_of_another_layout_ring4": P(shards_of_another_layout, ring4, [hybrid, ring_layout(4, 1), dp2_ring2]),
        "shards_of_another_layout_hybrid": P(shards_of_another_layout, hybrid, [ring4, ring_layout(4, 1)]),
        "shards_of_another_layout_dp2_ring2": P(shards_of_another_layout, dp2_ring2, [ring_layout(2, 1), ring4]),
        "shards_on_a_model_without_ulysses_hybrid": P(shards_on_a_model_without_ulysses, hybrid),
        "shards_on_a_model_without_ulysses_dp2_ring2": P(shards_on_a_model_without_ulysses, dp2_ring2),
        "wrapper_over_part_of_the_world_dp2_ring2": P(wrapper_over_part_of_the_world, dp2_ring2),
        "fsdp2_over_part_of_the_model_dp2_ring2": P(fsdp2_over_part_of_the_model, dp2_ring2),
    }
    return run_cases(cases)
