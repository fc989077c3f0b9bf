"""Multi-rank cases for head-chunked ("untied") attention and the core in slices of heads, run inside gloo workers
by tests/dist/test_head_chunks_parity.py.

Every parity case compares the loss and every gradient with one process on the full batch (plain transformers
attention, the model's own loss), as :mod:`tests.dist.cases_core` does, for C = 1, 2, 4 head chunks, and counts
the all-to-alls: a chunked layer issues 2C in forward and 4C in backward (2C of them the recompute), and where its
chunks share the kv heads one more in forward and two in backward; the unchunked one 2 and 2, so a layer that
silently fell back to the unchunked path fails the case.
"""

from __future__ import annotations

import copy
import functools

import torch

import ulysses_sp as U
from tests.dist.cases_architectures import EVAL_ONLY, PARITY_ARCHS
from tests.dist.cases_core import BF16_REL, check_parity, reference, sequence_parallel
from tests.dist.cases_memory_features import build_model, check_features, full_grad, wrap
from tests.helpers.harness import run_cases
from tests.helpers.models import (
    assert_as_close_as_one_process,
    build,
    dp_share,
    dropout_seeds,
    make_batch,
    with_chunk_dropout,
    with_lora,
)
from tests.helpers.parity import assert_loss_and_grads
from tests.helpers.spy import calls_to
from ulysses_sp import chunk_core, head_chunk_pipeline, sliced_core

P = functools.partial
CHUNKS = (1, 2, 4)
BF16_WIRE = {"comm_dtype": torch.bfloat16, "rel": BF16_REL}  # bf16 on the wire, fp32 compute
# Architectures of the parity suite whose attention module cannot be split (head_chunks=2 is refused at
# parallelize with a ValueError naming the reason); every other one must be exact in chunks.
REFUSED = {
    "opt": "it has no o_proj child",  # out_proj
    "phi": "it has no o_proj child",  # dense
    "biogpt": "it has no o_proj child",  # out_proj
    "phi3_longrope": "it has no q_proj/k_proj/v_proj child",  # one fused qkv_proj
    # q/k norms over all heads' width at once (not per head): refused at parallelize
    "olmo3": "its q_norm normalises 32 features at once (4 heads x 8",
    # a per-head output gate (gate_proj) the chunks would skip: refused by the first call's probe, which names it
    "afmoe": "differ on a probe; it also computes with ['gate_proj']",
}


def all_to_alls(chunks: int, layers: int, fused: int = 0) -> int:
    """All-to-alls of one forward + backward: per layer 2C forward and 4C backward chunked (2 for each of the
    ``fused`` chunk backwards that used the saved output: q/k/v with the output's gradient, then their gradients;
    where the chunks share the kv heads, they travel with chunk 0's q in forward and in backward and their
    gradients' sum with the last chunk's: no all-to-all more), 2 + 2 unchunked."""
    return layers * (6 * chunks if chunks > 1 else 4) - 2 * fused


def chunked_parity(layout, arch: str, chunks: int, *, layers: int = 2, fused: bool | None = None, **kwargs) -> None:
    """check_parity with ``head_chunks=chunks``, and the all-to-all count of a chunked (or unchunked) run;
    ``fused``: every chunk's backward must (True) or must not (False) run from the saved output."""
    stats = U.CommStats()
    with calls_to(head_chunk_pipeline, "kernel_backward") as fused_calls:
        check_parity(layout, arch, head_chunks=chunks, stats=stats, **kwargs)
    found = len(fused_calls)
    want = all_to_alls(chunks, layers, found) if layout.ulysses > 1 else 0
    assert stats.calls["all_to_all"] == want, (stats.calls, want)
    if fused is not None and chunks > 1:
        assert found == (layers * chunks if fused else 0), (found, fused)


def blocked_parity(layout, arch: str, chunks: int, **kwargs) -> None:
    """chunked_parity with each fused chunk backward's kernel in blocks of queries and keys (chunk_core: 4 rows a
    block at least, so the test's 24 to 48 tokens a rank attends make 2 to 4 blocks a document): more stand-in
    outputs made than chunk backwards run proves the blocks ran."""
    old, chunk_core.MIN_BLOCK_ROWS = chunk_core.MIN_BLOCK_ROWS, 4
    try:
        with (
            calls_to(chunk_core, "stand_in_output") as stand_ins,
            calls_to(head_chunk_pipeline, "kernel_backward") as backwards,
        ):
            chunked_parity(layout, arch, chunks, fused=True, **kwargs)
    finally:
        chunk_core.MIN_BLOCK_ROWS = old
    assert len(stand_ins) > len(backwards) > 0, (len(stand_ins), len(backwards))


def arch_chunked_or_refused(layout, arch: str, kv_heads: int | None, batch, train: bool) -> None:
    """An architecture of the parity suite with head_chunks=2: exact, or (REFUSED) a ValueError naming why."""
    if arch not in REFUSED:
        return chunked_parity(layout, arch, 2, kv_heads=kv_heads, batch=batch, train=train)
    try:
        check_parity(layout, arch, kv_heads=kv_heads, batch=batch, train=train, head_chunks=2)
    except ValueError as err:
        assert "cannot run its heads in chunks" in str(err) and REFUSED[arch] in str(err), err
        assert "head_chunks=1" in str(err), err
    else:
        raise AssertionError(f"{arch} was run in head chunks; expected a ValueError ({REFUSED[arch]})")


def family_cases(layout, prefix: str, heads: int, kv: int, chunks: tuple[int, ...]) -> dict:
    """The core parity suite's families with ``heads`` query heads: MHA, GQA (``kv`` kv heads), MQA, MLA with
    v head dim != qk, windows with packed documents, softcap with the eager core, padding. Without a ring the
    plain families' chunks run their backward from the saved output; windows and softcap recompute."""
    cases, fused, windows = {}, layout.ring == 1, make_batch(2, 30, packed=(13, 17))
    for c in chunks:

        def case(arch: str, kernel: bool, c: int = c, **kwargs) -> functools.partial:
            return P(chunked_parity, layout, arch, c, heads=heads, fused=kernel, **kwargs)

        cases |= {
            f"{prefix}_C{c}_mha": case("llama", fused),
            f"{prefix}_C{c}_gqa": case("qwen3", fused, kv_heads=kv, batch=make_batch(2, 24, packed=(10, 14))),
            f"{prefix}_C{c}_mqa": case("llama", fused, kv_heads=1),
            f"{prefix}_C{c}_mla_v4": case("deepseek_v3_mla_v4", fused),
            f"{prefix}_C{c}_window_packed": case("mistral", False, kv_heads=kv, batch=windows),
            f"{prefix}_C{c}_softcap_eager": case("gemma2", False, kv_heads=kv, ref_attn="eager", core="eager"),
            f"{prefix}_C{c}_padded": case("llama", fused, kv_heads=kv, batch=make_batch(2, 23, pad="right")),
        }
    return cases


def feature_cases(layout, prefix: str, chunks: tuple[int, ...], adapt=None, tag: str = "") -> dict:
    """DDP and FSDP2 with the memory features on (tiled MLP, offloaded checkpoints, tiled loss), 8 heads;
    ``adapt``: check_features', named with ``tag``."""
    return {
        f"{prefix}_C{c}{tag}_features_{wrapper}": P(
            check_features,
            layout,
            wrapper,
            tiled=True,
            checkpointing="offload",
            tiled_loss=True,
            heads=8,
            head_chunks=c,
            adapt=adapt,
        )
        for c in chunks
        for wrapper in ("ddp", "fsdp2")
    }


def kv_sharing(layout) -> None:
    """Gemma3n's layer 1 stores its k/v for layer 2 to reuse (KV sharing). Automatic head chunks (a 1-byte budget:
    4 chunks of 8 heads over 2 ranks) chunk layer 0 alone and are exact: chunking layer 1 stored the last chunk's
    kv heads only, which layer 2 then read (silently wrong, at sp=1 too); head_chunks=2 is refused naming it."""
    stats = U.CommStats()
    with calls_to(head_chunk_pipeline, "kernel_backward") as fused:
        check_parity(layout, "gemma3n_kv_shared", heads=8, head_chunks=None, head_chunk_budget_bytes=1, stats=stats)
    assert stats.calls["all_to_all"] == all_to_alls(4, 1, len(fused)) + all_to_alls(1, 2), stats.calls
    try:
        U.parallelize(build("gemma3n_kv_shared", heads=8), layout, head_chunks=2)
    except ValueError as err:
        assert "stores its k/v for later layers" in str(err) and "head_chunks=1" in str(err), err
    else:
        raise AssertionError("head_chunks=2 was accepted for a layer whose k/v later layers reuse")


class _LoggedWork:
    """An exchange's work handle that marks the exchange done when it is waited for."""

    def __init__(self, work, key: int, in_flight: set[int]) -> None:
        self.work, self.key, self.in_flight = work, key, in_flight

    def wait(self) -> None:
        self.work.wait()
        self.in_flight.discard(self.key)


def overlap(layout, chunks: int = 4, core: str = "sdpa") -> None:
    """Every core call (forward, its recompute in backward) and every core backward of a chunked layer runs while
    another chunk's exchange is in flight (launched asynchronously, not yet waited for). ``core="sdpa"``: the
    chunks' cores run through a block kernel and backward from the saved output; ``"eager"``: recomputed."""
    model = U.parallelize(build("llama", heads=8, kv_heads=2), layout, head_chunks=chunks, core=core)
    ctx = U.ulysses_context(model)
    in_flight: set[int] = set()
    cores: list[int] = []  # exchanges in flight at each core call
    core_backwards: list[int] = []
    launched = [0]
    pipeline = head_chunk_pipeline
    saved = pipeline.start_all_to_all, torch.autograd.grad, pipeline.kernel_forward, pipeline.kernel_backward
    start, grad, kernel_forward, kernel_backward = saved
    core_for = ctx.core_for

    def logged_start(send, group, stats=None):
        recv, work = start(send, group, stats)
        launched[0] += 1
        in_flight.add(launched[0])
        return recv, _LoggedWork(work, launched[0], in_flight)

    def logged_core(*args, **kwargs):
        cores.append(len(in_flight))
        return core_for(*args, **kwargs)

    def logged_kernel(*args, **kwargs):
        cores.append(len(in_flight))
        return kernel_forward(*args, **kwargs)

    def logged_kernel_backward(*args, **kwargs):
        core_backwards.append(len(in_flight))
        return kernel_backward(*args, **kwargs)

    def logged_grad(outputs, inputs, *args, **kwargs):
        if not isinstance(inputs, list):  # the core's backward (a tensor or a tuple; the projections' pass lists)
            core_backwards.append(len(in_flight))
        return grad(outputs, inputs, *args, **kwargs)

    pipeline.start_all_to_all, torch.autograd.grad, ctx.core_for = logged_start, logged_grad, logged_core
    pipeline.kernel_forward, pipeline.kernel_backward = logged_kernel, logged_kernel_backward
    try:
        shard = U.shard_batch(make_batch(1, 32), layout)
        U.causal_lm_loss(model, shard, layout).backward()
    finally:
        pipeline.start_all_to_all, torch.autograd.grad, pipeline.kernel_forward, pipeline.kernel_backward = saved
        del ctx.core_for
    layers = model.config.num_hidden_layers
    fused = chunks * layers if core == "sdpa" else 0
    want = all_to_alls(chunks, layers, fused)
    assert launched[0] == want and not in_flight, (launched, want, in_flight)
    core_calls = (1 if fused else 2) * chunks * layers  # the recomputing backward runs each core again
    assert len(cores) == core_calls and len(core_backwards) == chunks * layers, (cores, core_backwards)
    assert all(cores) and all(core_backwards), f"a core ran with no exchange in flight: {cores}, {core_backwards}"


def automatic_chunks_read_the_layer(layout, wrapper: str, torch_wrapper: bool = False) -> None:
    """Where no C fits its budget, automatic C is the planner's for the same settings (ulysses_sp.head_chunk_choice):
    under ``wrapper`` (DDP, or FSDP2, whose layer gradients, 4 bytes a parameter of the layer here, the attention counts
    as the planner does), checkpointed and then not (switched off after wrapping); and a step in that branch (a 1-byte
    budget) without checkpointing is exact. ``torch_wrapper``: the layers checkpointed by PyTorch's non-reentrant
    checkpoint_wrapper instead (put around them after parallelize, FSDP2 sharding the layers inside): checkpointed
    in both modes, and exact."""
    from ulysses_sp.head_chunk_choice import layer_memory
    from ulysses_sp.head_chunks import HeadChunkedAttention
    from ulysses_sp.instance_forward import installed_forward
    from ulysses_sp.plan import Features, ModelShape, plan_memory

    model = build_model("llama", tied=False, heads=8)  # 8 heads on 2 kv heads, hidden 64, 2 layers
    batch = make_batch(2, 24, packed=(10, 14))
    ref_loss, ref_grads = reference(model, batch)
    par = U.parallelize(copy.deepcopy(model), layout)
    U.enable_tiled_mlp(par, chunk_tokens=5)
    U.enable_tiled_norms(par, chunk_tokens=5)
    U.enable_activation_checkpointing(par, "checkpoint")
    if torch_wrapper:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        U.disable_activation_checkpointing(par)
        for i, layer in enumerate(par.model.layers):
            par.model.layers[i] = checkpoint_wrapper(layer)
    par.train()
    wrapped = wrap(par, wrapper)
    installed = [h for m in par.modules() if isinstance(h := installed_forward(m), HeadChunkedAttention)]
    assert len(installed) == 2
    seq_len = 1 << 23  # no C's q/k/v fit 1 GiB a rank (only the view's shape and dtype are read)
    x = torch.zeros(1, 1, 64).expand(1, seq_len // layout.sp, -1)
    grads = 4 * ModelShape.from_config(model.config).layer_params if wrapper == "fsdp2" else 0
    for mode in ("checkpoint", "none"):
        if mode == "none":
            U.disable_activation_checkpointing(par)
        checkpointing = "checkpoint" if torch_wrapper else mode
        features = Features(
            activation_checkpointing=checkpointing, parallel=wrapper, mlp_chunk_tokens=5, tiled_loss=False
        )
        planned = plan_memory(model.config, seq_len=seq_len, sp=layout.sp, features=features, device="cpu")
        assert [h.chunks_for(x) for h in installed] == [planned.head_chunks] * 2, planned.head_chunks
        for h in installed:
            memory = layer_memory(h.layer, h.layers, h.projection("q_proj"))
            assert (memory.checkpointed, memory.grad_bytes) == (checkpointing != "none", grads), memory
    for h in installed:
        h.budget_bytes = 1
    shard = U.shard_batch(dp_share(batch, layout), layout)
    logits = wrapped(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    loss = U.sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout)
    loss.backward()
    grads = {name.replace("._checkpoint_wrapped_module", ""): full_grad(p) for name, p in par.named_parameters()}
    assert_loss_and_grads(loss, grads, ref_loss, ref_grads)


def sliced_parity(layout, arch: str, *, heads: int, layers: int = 2, **kwargs) -> None:
    """check_parity of the unchunked core in slices of one query head (a budget of 1 byte,
    :mod:`ulysses_sp.sliced_core`): exact, and every layer's core backward ran once per slice."""
    with calls_to(sliced_core, "kernel_backward") as calls:
        check_parity(layout, arch, heads=heads, head_chunks=1, head_chunk_budget_bytes=1, **kwargs)
    assert len(calls) == layers * heads // layout.ulysses, calls


def sliced_cases(layout, prefix: str, heads: int, kv: int) -> dict:
    """The families the sliced core runs: MHA, GQA with packed documents, MQA, MLA (v head dim != qk), padding."""
    case = functools.partial(P, sliced_parity, layout, heads=heads)
    return {
        f"{prefix}_sliced_mha": case("llama"),
        f"{prefix}_sliced_gqa_packed": case("qwen3", kv_heads=kv, batch=make_batch(2, 24, packed=(10, 14))),
        f"{prefix}_sliced_mqa": case("llama", kv_heads=1),
        f"{prefix}_sliced_mla_v4": case("deepseek_v3_mla_v4"),
        f"{prefix}_sliced_padded": case("llama", kv_heads=kv, batch=make_batch(2, 23, pad="right")),
    }


def with_dropout_seeds(check, *args, seed: int = 1000, **kwargs) -> None:
    """``check(*args, **kwargs)`` with layer ``l``'s LoRA dropout call seed ``seed + l`` on every rank (the seed
    tests.helpers.models.with_chunk_dropout gives the reference's masks)."""
    with dropout_seeds(seed):
        check(*args, **kwargs)


def lora_dropout_cases(layout, prefix: str, heads: int, chunks: int, features: bool = False) -> dict:
    """:func:`lora_cases`' GQA case (and ``features``: its DDP and FSDP2 cases with every memory feature on, the
    chunks remaking the tiled norm's output tile by tile) with lora_dropout 0.25: every rank draws its own masks
    (salted by its rank, at its local positions); the reference is the plain PEFT model whose dropout draws, on
    each rank's rows and tokens, that rank's mask."""
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    adapt = P(with_lora, targets=targets, lora_dropout=0.25)
    ref_adapt = P(with_chunk_dropout, targets=targets, p=0.25, seed=1000, layout=layout)
    plain = lora_cases(layout, prefix, heads, chunks, features)
    return {
        name.replace("_lora", "_lora_dropout"): P(
            with_dropout_seeds, case.func, *case.args, **(case.keywords | {"adapt": adapt, "ref_adapt": ref_adapt})
        )
        for name, case in plain.items()
        if name.endswith(("_gqa_packed", "_features_ddp", "_features_fsdp2"))
    }


def lora_16_bit_adapters(layout, chunks: int, adapter_dtype: torch.dtype = torch.bfloat16) -> None:
    """fp32 base weights with 16-bit LoRA adapters on every attention projection (PEFT rounds their shares to 16 bits):
    chunked (the first call's probe compares at the adapters' precision), and as close to the fp64 truth as one
    process running the plain PEFT model."""
    model = with_lora(build("llama", heads=8, kv_heads=2), ("q_proj", "k_proj", "v_proj", "o_proj"))
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(adapter_dtype)
    batch = make_batch(2, 24, packed=(10, 14))
    stats = U.CommStats()
    with calls_to(head_chunk_pipeline, "kernel_backward") as fused:
        loss, grads, _ = sequence_parallel(model, batch, layout, head_chunks=chunks, stats=stats)
    assert stats.calls["all_to_all"] == all_to_alls(chunks, 2, len(fused)), stats.calls  # chunked, not unchunked
    assert_as_close_as_one_process(model, batch, loss, grads)


def lora_cases(layout, prefix: str, heads: int, chunks: int, features: bool = False) -> dict:
    """PEFT LoRA adapters (random A and B) on every attention projection: exact in chunks, the kernel's backward
    (GQA, packed) and the recompute (a window), the projections of the input (q/k/v) and of an inner tensor (MLA's
    q_b / kv_b); ``features``: with every memory feature on (the chunks remake the tiled norm's output) under DDP
    and FSDP2."""
    attention = P(with_lora, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    cases = {
        f"{prefix}_C{chunks}_lora_gqa_packed": P(
            chunked_parity,
            layout,
            "qwen3",
            chunks,
            heads=heads,
            kv_heads=2,
            adapt=attention,
            fused=layout.ring == 1,
            batch=make_batch(2, 24, packed=(10, 14)),
        ),
        f"{prefix}_C{chunks}_lora_window": P(
            chunked_parity,
            layout,
            "mistral",
            chunks,
            heads=heads,
            kv_heads=2,
            adapt=attention,
            fused=False,
            batch=make_batch(2, 30, packed=(13, 17)),
        ),
        f"{prefix}_C{chunks}_lora_mla": P(
            chunked_parity,
            layout,
            "deepseek_v3_mla_v4",
            chunks,
            heads=heads,
            adapt=P(with_lora, targets=("q_b_proj", "kv_b_proj", "o_proj")),
        ),
    }
    if features:
        cases |= feature_cases(layout, prefix, (chunks,), adapt=attention, tag="_lora")
    return cases


def world2_cases(sp2) -> dict:
    batch = make_batch(2, 24, packed=(15, 9))
    archs = {
        f"sp2_C2_{arch}": P(arch_chunked_or_refused, sp2, arch, kv, batch, arch not in EVAL_ONLY)
        for arch, kv in PARITY_ARCHS.items()
    }
    return {
        **family_cases(sp2, "sp2", 8, 2, CHUNKS),
        **archs,
        **feature_cases(sp2, "sp2", (2, 4)),
        **sliced_cases(sp2, "sp2", 8, 2),
        # the kernel's backward in blocks: kv heads shared by the chunks (GQA, packed) or sent by each (MHA)
        "sp2_C4_gqa_packed_blocked_kernel": P(
            blocked_parity, sp2, "qwen3", 4, heads=8, kv_heads=2, batch=make_batch(2, 24, packed=(10, 14))
        ),
        "sp2_C2_mha_blocked_kernel": P(blocked_parity, sp2, "llama", 2, heads=8),
        "sp2_auto_kv_sharing_store_unchunked": P(kv_sharing, sp2),
        "sp2_auto_over_budget_reads_the_layer_ddp": P(automatic_chunks_read_the_layer, sp2, "ddp"),
        "sp2_auto_over_budget_reads_the_layer_fsdp2": P(automatic_chunks_read_the_layer, sp2, "fsdp2"),
        "sp2_auto_over_budget_reads_torch_checkpoint_wrapper_fsdp2": P(
            automatic_chunks_read_the_layer, sp2, "fsdp2", torch_wrapper=True
        ),
        # bf16 on the wire, fp32 compute: each exchange's arrivals cast back in their layout's copy (comm.qkv_full ...)
        "sp2_C2_mha_bf16_communication": P(chunked_parity, sp2, "llama", 2, heads=8, fused=True, **BF16_WIRE),
        "sp2_C4_gqa_packed_bf16_communication": P(
            chunked_parity,
            sp2,
            "qwen3",
            4,
            heads=8,
            kv_heads=2,
            batch=make_batch(2, 24, packed=(10, 14)),
            fused=True,
            **BF16_WIRE,
        ),
        "sp2_C4_mqa_eager_bf16_communication": P(
            chunked_parity, sp2, "llama", 4, heads=8, kv_heads=1, core="eager", fused=False, **BF16_WIRE
        ),
        "sp2_C4_exchanges_overlap_cores": P(overlap, sp2),
        "sp2_C4_exchanges_overlap_cores_recomputed": P(overlap, sp2, core="eager"),
        **lora_cases(sp2, "sp2", 8, 2, features=True),
        **lora_dropout_cases(sp2, "sp2", 8, 2, features=True),
        "sp2_C2_lora_bf16_adapters_fp32_base": P(lora_16_bit_adapters, sp2, 2),
        "sp2_C4_lora_fp16_adapters_fp32_base": P(lora_16_bit_adapters, sp2, 4, torch.float16),
    }


def world4_cases(sp4, dp2sp2, hybrid) -> dict:
    return {
        # 16 heads: 4 chunks of 4 split over 4 ranks; 2 kv heads < sp, one per chunk of 4 (kv groups of 8)
        **family_cases(sp4, "sp4", 16, 2, CHUNKS),
        **family_cases(dp2sp2, "dp2_sp2", 8, 2, (2, 4)),
        **sliced_cases(sp4, "sp4", 16, 2),
        "sp4_C4_gqa_blocked_kernel": P(blocked_parity, sp4, "llama", 4, heads=16, kv_heads=2),
        "dp2_sp2_auto_kv_sharing_store_unchunked": P(kv_sharing, dp2sp2),
        "ulysses2_ring2_C2_gqa": P(chunked_parity, hybrid, "llama", 2, heads=8, kv_heads=2),
        "ulysses2_ring2_C4_packed": P(
            chunked_parity, hybrid, "qwen2", 4, heads=8, kv_heads=4, batch=make_batch(2, 24, packed=(9, 15))
        ),
        "ulysses2_ring2_C4_mla_v4": P(chunked_parity, hybrid, "deepseek_v3_mla_v4", 4, heads=8),
        **feature_cases(dp2sp2, "dp2_sp2", (4,)),
        # every memory feature on, the chunked block remaking the tiled norm's output, on the other 4-rank layouts
        **feature_cases(sp4, "sp4", (2,)),
        **feature_cases(hybrid, "ulysses2_ring2", (4,)),
        **lora_cases(sp4, "sp4", 16, 4),
        **lora_cases(dp2sp2, "dp2_sp2", 8, 2, features=True),
        **lora_dropout_cases(sp4, "sp4", 16, 4),
        **lora_dropout_cases(dp2sp2, "dp2_sp2", 8, 2, features=True),
        **lora_cases(hybrid, "ulysses2_ring2", 8, 2),
    }


def world2() -> dict[str, str]:
    return run_cases(world2_cases(U.ParallelLayout.from_env(sp=2)))


def world4() -> dict[str, str]:
    sp4, dp2sp2 = U.ParallelLayout.from_env(sp=4), U.ParallelLayout.from_env(sp=2)
    return run_cases(world4_cases(sp4, dp2sp2, U.ParallelLayout.from_env(sp=4, ring=2)))


_NAMES = U.ParallelLayout.rank_view(1, 0)  # case names only: no process group needed
WORLD2 = sorted(world2_cases(_NAMES))
WORLD4 = sorted(world4_cases(_NAMES, _NAMES, _NAMES))
