"""Multi-rank cases for the core engine, run inside gloo workers by tests/dist/test_core_parity.py.

Every parity case runs the same model in one process on the full batch (plain transformers attention,
no ulysses_sp code) and compares loss and every parameter gradient with the sequence-parallel run.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from unittest import mock

import torch
import torch.distributed as dist

import ulysses_sp as U
from tests.helpers.harness import run_cases
from tests.helpers.models import VOCAB, build, dp_share, make_batch
from tests.helpers.parity import LOSS_TOL, assert_loss_and_grads

BF16_REL = 2e-2  # bf16 on the wire: |g - g_ref| <= 2% of |g_ref|, per parameter (an all-zero grad fails)


def reference(model, batch):
    """One process, full batch, the model's own attention and loss."""
    ref = copy.deepcopy(model)
    out = ref(**batch, use_cache=False)
    out.loss.backward()
    # None: a parameter the loss does not reach (AFMoE's expert_bias only picks experts)
    return out.loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}


def sequence_parallel(model, batch, layout, prepare=None, shard_kwargs=None, **kwargs):
    """This rank's share of the dp x sp run: its dp rows, its sequence shard; grads averaged over the world.

    ``prepare(par)``: called on the parallelized copy before the step (memory features, an FSDP2 wrapping,
    which then reduces the grads itself); it returns True when it wrapped the model so. ``shard_kwargs``: for
    ``shard_batch`` (e.g. ``ignore_index``)."""
    par = U.parallelize(copy.deepcopy(model), layout, **kwargs)
    wrapped = prepare(par) if prepare is not None else False
    mine = dp_share(batch, layout)
    shard = U.shard_batch(mine, layout, **(shard_kwargs or {}))
    inputs = {k: shard[k] for k in ("input_ids", "position_ids", "attention_mask") if k in shard}
    loss = U.sequence_parallel_cross_entropy(par(**inputs).logits, shard["shift_labels"], layout)
    loss.backward()
    if not wrapped:
        U.sync_gradients(par, layout, bucket_numel=5000)  # several buckets, some holding several grads
    return loss.detach(), {n: p.grad for n, p in par.named_parameters()}, par


def raises_everywhere(fn, *needles: str) -> None:
    """``fn()`` must raise a ValueError on this rank whose message holds every needle."""
    try:
        fn()
    except ValueError as err:
        assert all(n in str(err) for n in needles), (needles, str(err))
    else:
        raise AssertionError(f"no ValueError (expected one mentioning {needles})")


def assert_rel_close(got, want, rel, name=""):
    err = (got.float() - want.float()).norm()
    assert err <= rel * want.float().norm() + 1e-12, f"{name}: |diff| {err:.3e} > {rel} x |ref| {want.norm():.3e}"


def check_parity(
    layout,
    arch="llama",
    *,
    heads=4,
    kv_heads=None,
    batch=None,
    ref_attn="sdpa",
    rel=None,
    checkpointing=False,
    train=True,
    sp_batch=None,
    adapt=None,
    ref_adapt=None,
    **kwargs,
):
    """``sp_batch``: what the sequence-parallel run shards instead of ``batch`` (e.g. with position_ids the
    reference derives itself); ``adapt(model)``: the model to run instead of the built one (e.g. with LoRA);
    ``ref_adapt(copy)``: the reference's instead of that model (e.g. its dropout drawing the run's masks)."""
    batch = batch if batch is not None else make_batch(2, 24)
    model = build(arch, heads=heads, kv_heads=kv_heads, attn=ref_attn)
    if adapt is not None:
        model = adapt(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train(checkpointing or train)  # built models start in train mode; the configs have no dropout
    ref_loss, ref_grads = reference(model if ref_adapt is None else ref_adapt(copy.deepcopy(model)), batch)
    loss, grads, _ = sequence_parallel(model, sp_batch if sp_batch is not None else batch, layout, **kwargs)
    if rel is None:
        return assert_loss_and_grads(loss, grads, ref_loss, ref_grads)
    assert grads.keys() == ref_grads.keys()
    assert_rel_close(loss, ref_loss, rel, "loss")
    for name, grad in grads.items():
        assert_rel_close(grad, ref_grads[name], rel, name)


def _compiled_steps(model, par, layout, batches, after_step=None):
    """Train steps of the compiled ``par`` on ``batches`` (an int: a batch of that many tokens): each step's loss
    and every gradient equal one process (plain ``model``, eager); ``after_step(i)`` runs after step ``i``'s check."""
    for i, batch in enumerate(batches):
        batch = make_batch(2, batch, seed=1 + i) if isinstance(batch, int) else batch
        ref_loss, ref_grads = reference(model, batch)
        par.zero_grad(set_to_none=True)
        loss = U.causal_lm_loss(par, U.shard_batch(batch, layout), layout)
        loss.backward()
        U.sync_gradients(par, layout)
        assert_loss_and_grads(loss, {n: p.grad for n, p in par.named_parameters()}, ref_loss, ref_grads)
        if after_step is not None:
            after_step(i)


def compiled(layout):
    """``torch.compile`` (dynamo's tracing; the eager backend keeps it quick) over the parallelized model with the
    tiled loss, MLP and norms and activation checkpointing, the loss through ``causal_lm_loss``: the loss and every
    gradient of one process."""
    model = build("llama", kv_heads=2)
    par = U.parallelize(copy.deepcopy(model), layout)
    features = U.Features(
        tiled_loss=True, tiled_mlp=True, tiled_norms=True, mlp_chunk_tokens=5, loss_chunk_tokens=7,
        activation_checkpointing="checkpoint",
    )  # fmt: skip
    U.apply_features(par, features, "cpu")
    torch._dynamo.reset()
    par.compile(backend="eager")
    _compiled_steps(model, par, layout, [make_batch(2, 24, packed=(10, 14))])


def compiled_layers_fullgraph(layout):
    """Each decoder layer compiled on its own with fullgraph=True (the FSDP2 recipe; aot_eager, what inductor gets):
    the all-to-alls trace into the layer's graph (CommStats counting them inside it failed the trace: "HOP: Unsafe
    side effect"), both layers share one graph (the head-chunk wrapper set as each attention's forward made dynamo
    compile one graph per layer, and past its recompile limit of 8 run the other layers eagerly), and a second step
    of new tensors of the same shapes compiles nothing (the documents, looked up by id(position_ids), recompiled
    every step); loss and gradients of every step, one of another shard length too, equal one process."""
    from torch._dynamo.utils import counters

    model = build("llama", kv_heads=2)
    par = U.parallelize(copy.deepcopy(model), layout)
    torch._dynamo.reset()
    counters.clear()
    for layer in par.model.layers:
        layer.compile(backend="aot_eager", fullgraph=True)

    def one_graph(step):
        if step < 2:  # (step 2, 20 tokens: a recompile for the new length is dynamo's, as in one process)
            assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])

    _compiled_steps(model, par, layout, (24, 24, 20), one_graph)


def compiled_layers_batches_vary(layout):
    """Decoder layers compiled on their own, batches as training gives them: rows packed with documents that
    differ from batch to batch compile once (the documents' spans, traced into the graph, made each new packing
    compile again, and past dynamo's recompile limit run the layers eagerly: the core now runs them eagerly), and
    rows of another length compile once more, for every length after (guards on each span did it for each
    length); loss and gradients of every step equal one process. Heads in chunks (head_chunks=2) run eagerly
    inside the compiled layers, with no compile at a second step either."""
    from torch._dynamo.utils import counters

    model = build("llama", kv_heads=2)
    packings = [(5, 9, 10), (12, 12), (3, 21)]
    varied = [make_batch(2, 24, packed=p, seed=i) for i, p in enumerate(packings)] + [24, 20, 16]
    for head_chunks, batches in ((None, varied), (2, [24, 24])):
        par = U.parallelize(copy.deepcopy(model), layout, head_chunks=head_chunks)
        torch._dynamo.reset()
        counters.clear()
        for layer in par.model.layers:
            layer.compile(backend="aot_eager")
        graphs: list[int] = []
        count = functools.partial(lambda g, step: g.append(counters["stats"]["unique_graphs"]), graphs)
        _compiled_steps(model, par, layout, batches, count)
        if head_chunks is None:  # packings, then dense rows of 24 (another branch), 20 (dynamic from here), 16
            assert graphs[0] == graphs[1] == graphs[2] and graphs[-1] == graphs[-2], graphs
        else:
            assert graphs[1] == graphs[0], graphs


def compiled_layers_default_features(layout):
    """Decoder layers compiled one by one over apply_features' defaults (activation checkpointing, tiled MLP with its
    norm fused in, tiled input norm; chunks of 5 tokens): each layer is ONE graph with no break, both layers share it,
    and further steps compile nothing (before: a break in the tiled norm inside the checkpoint, so dynamo ran every
    layer eagerly, 0 graphs; without checkpointing 6 graphs and 10 breaks); loss and gradients equal one process."""
    from torch._dynamo.utils import counters

    model = build("llama", kv_heads=2)
    for checkpointing in ("checkpoint", "none"):
        par = U.parallelize(copy.deepcopy(model), layout)
        U.apply_features(par, U.Features(mlp_chunk_tokens=5, activation_checkpointing=checkpointing), "cpu")
        torch._dynamo.reset()
        counters.clear()
        for layer in par.model.layers:
            layer.compile(backend="aot_eager")
        seen: list[tuple[int, int]] = []
        count = functools.partial(
            lambda s, step: s.append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))), seen
        )
        _compiled_steps(model, par, layout, (24, 24, 24), count)
        assert seen == [(1, 0)] * 3, (checkpointing, seen)


def compiled_model_steps(layout):
    """model.compile() over the parallelized model (aot_eager): the once-per-forward checks leave the graph at one
    break (dynamo used to fail on them frame after frame: 24 graphs and 17 breaks for 2 layers) and a second step of
    the same shapes compiles nothing (CommStats' counts, read as constants, made every step recompile); loss and
    gradients equal one process. fullgraph=True is refused by an error that names the break and what works."""
    from torch._dynamo.utils import counters

    model = build("llama", kv_heads=2)
    par = U.parallelize(copy.deepcopy(model), layout)
    torch._dynamo.reset()
    counters.clear()
    par.compile(backend="aot_eager")
    graphs = []
    _compiled_steps(model, par, layout, (24, 24), lambda step: graphs.append(counters["stats"]["unique_graphs"]))
    assert graphs[0] <= 3 and graphs[1] == graphs[0], graphs
    whole = U.parallelize(copy.deepcopy(model), layout)
    torch._dynamo.reset()  # (else dynamo reuses the code compiled above, breaks and all, fullgraph or not)
    whole.compile(backend="aot_eager", fullgraph=True)
    shard = U.shard_batch(make_batch(2, 24), layout)
    named = ["shard across the SP group", "layer.compile(fullgraph=True)"]
    expect_raise(torch._dynamo.exc.Unsupported, named)(lambda: U.causal_lm_loss(whole, shard, layout))
    torch._dynamo.reset()


def flex_forward(layout):
    """flex_attention has no CPU backward in torch: compare the forward loss here (GPU tests do backward)."""
    batch = make_batch(2, 24, packed=(7, 10, 7))
    model = build("llama", kv_heads=2)
    with torch.no_grad():
        ref_loss = model(**batch, use_cache=False).loss
        par = U.parallelize(copy.deepcopy(model), layout, core="flex_attention")
        shard = U.shard_batch(batch, layout)
        logits = par(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        loss = U.sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout)
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOL)


def collective_count(layout):
    """Per attention layer: exactly 2 all-to-alls forward (q/k/v fused + output), 2 more in backward."""
    stats = U.CommStats()
    model = build("llama", heads=4, kv_heads=2)
    layers = model.config.num_hidden_layers
    par = U.parallelize(model, layout, stats=stats)
    shard = U.shard_batch(make_batch(1, 16), layout)
    logits = par(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    assert stats.calls["all_to_all"] == 2 * layers, stats.calls
    assert stats.calls["all_gather"] == 2, stats.calls  # shape check + positions: once per forward, not per layer
    # bytes per layer: q/k/v out as (H + 2*hkv*P) * n * d and the output back as H * n * d, fp32 (b = 1)
    p, n, d, heads, hkv = layout.sp, 16 // layout.sp, 8, 4, max(2 // layout.sp, 1)
    per_layer = ((heads + 2 * hkv * p) * n * d + heads * n * d) * 4
    assert stats.bytes["all_to_all"] == layers * per_layer, (stats.bytes, layers * per_layer)
    loss = U.sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout, stats=stats)
    loss.backward()
    assert stats.calls["all_to_all"] == 4 * layers, stats.calls
    assert stats.calls["all_reduce"] == 2, stats.calls  # loss sums forward and backward


def shape_mismatch(layout):
    """Ranks of one SP group with different shard shapes: a ValueError on every rank, not a hang."""
    model = U.parallelize(build("llama"), layout)
    n = 8 + 2 * layout.sp_rank
    ids = torch.zeros(1, n, dtype=torch.long)
    try:
        model(input_ids=ids, position_ids=torch.arange(n)[None] + n * layout.sp_rank)
    except ValueError as err:
        assert "same shape" in str(err), err
    else:
        raise AssertionError("mismatched shard shapes were not rejected")


def bad_input_on_one_rank(layout):
    """Only sp_rank 1 passes malformed position_ids: every rank raises (no rank left waiting)."""
    model = U.parallelize(build("llama"), layout)
    ids = torch.zeros(1, 8, dtype=torch.long)
    positions = torch.arange(8)[None] + 8 * layout.sp_rank
    if layout.sp_rank == 1:
        positions = positions[:, :5]
    try:
        model(input_ids=ids, position_ids=positions)
    except ValueError as err:
        expected = "position_ids must be" if layout.sp_rank == 1 else "sp_rank(s) [1]"
        assert expected in str(err), err
    else:
        raise AssertionError("bad input on one rank was not rejected")


def padding_with_targets_refused(layout):
    """Two ways padding could carry a target whose output one process and Ulysses compute differently: the
    labels of right padding left unmasked (refused by shard_batch), and left padding under an eager model,
    whose pads average every value (refused at the forward); both on every rank, before any exchange."""
    unmasked = make_batch(2, 24, pad="right")
    unmasked["labels"] = unmasked["input_ids"].clone()
    try:
        U.shard_batch(unmasked, layout)
    except ValueError as err:
        assert "padding token 19 of row 1" in str(err) and "-100 wherever attention_mask is 0" in str(err), err
    else:
        raise AssertionError("a target on right padding was not refused")
    model = U.parallelize(build("llama", kv_heads=2, attn="eager"), layout, core="eager")
    shard = U.shard_batch(make_batch(2, 24, pad="left"), layout)
    try:
        model(**{k: shard[k] for k in ("input_ids", "position_ids", "attention_mask")})
    except ValueError as err:
        assert "row 1 starts with padding" in str(err) and "attn_implementation='sdpa'" in str(err), err
    else:
        raise AssertionError("left padding under an eager model was not refused")


def unmasked_left_padding():
    """Left padding whose labels are left unmasked: a left pad sees no key (zero output in one sdpa process
    and in Ulysses), so its target counts alike."""
    batch = make_batch(2, 24, pad="left")
    batch["labels"] = batch["input_ids"].clone()
    return batch


def different_batches(layout):
    """A sampler split over the world instead of dp gives SP ranks different samples: caught at sharding."""
    batch = make_batch(1, 16, seed=10 + layout.sp_rank)
    try:
        U.shard_batch(batch, layout)
    except ValueError as err:
        assert "hold different batches" in str(err) and "num_replicas=layout.dp" in str(err), err
    else:
        raise AssertionError("different batches within an SP group were not detected")


def heads_not_divisible(layout):
    try:
        U.parallelize(build("llama", heads=3), layout)
    except ValueError as err:
        assert "num_attention_heads=3" in str(err) and "sp values that work: 1, 3" in str(err), err
    else:
        raise AssertionError("3 heads over sp=2 were accepted")


def missing_positions(layout):
    model = U.parallelize(build("llama"), layout)
    try:
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    except ValueError as err:
        assert "position_ids" in str(err), err
    else:
        raise AssertionError("a forward without position_ids was accepted under sp > 1")


def plain_attention_roundtrip(layout):
    """The model switches back to plain attention (same outputs as never parallelized) and generates the tokens of the
    model never parallelized, on every rank and on one rank alone (no collective inside). generate() outside
    plain_attention is refused on every rank, with a KV cache or not: with use_cache=False it ran each rank's whole
    prompt as a shard of one longer sequence, which gave OPT's other tokens than one process's (logits off by 0.3),
    silently; now its logits_to_keep=1 is refused, naming plain_attention."""
    from tests.helpers.models import build_generic

    model = build("llama")
    before = copy.deepcopy(model)
    U.parallelize(model, layout)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # row 0 left-padded
    want = before.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    for alone in (False, True):
        if alone and dist.get_rank() != 0:
            continue
        with U.plain_attention(model):
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False), want)
            got = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got, before(input_ids=ids, attention_mask=mask).logits, **LOSS_TOL)
    opt = U.parallelize(build_generic("opt"), layout)
    for generator in (model, opt):
        for cache in (True, False):
            expect_raise(ValueError, ["logits_to_keep=1 under sequence parallelism", "plain_attention(model)"])(
                lambda g=generator, c=cache: g.generate(ids, max_new_tokens=2, do_sample=False, use_cache=c)
            )
    U.unparallelize(model)
    torch.testing.assert_close(model(input_ids=ids).logits, before(input_ids=ids).logits)
    assert model.config._attn_implementation == "sdpa"


def changed_after_parallelize(layout):
    """What a user may change on a parallelized model. Its attention implementation switched other than by
    plain_attention (e.g. to eager for attention maps): each attention would see the rank's shard alone, which it
    silently did; now refused on every rank, and exact again once switched back. output_attentions: refused (the
    weights came back as an empty tuple). Sequence-pooling heads: refused at parallelize (each rank pooled its own
    shard's last token)."""
    from transformers import LlamaForSequenceClassification

    model = U.parallelize(build("llama"), layout)
    shard = U.shard_batch(make_batch(2, 24), layout)
    inputs = {k: shard[k] for k in ("input_ids", "position_ids", "attention_mask") if k in shard}
    with U.plain_attention(model):  # the switch that is allowed, nested too
        with U.plain_attention(model):
            model(input_ids=shard["input_ids"])
        model(input_ids=shard["input_ids"])  # still plain: the inner block's exit switched back to Ulysses
        inside = copy.deepcopy(model)
    expect_raise(ValueError, ["implementation is 'sdpa', not 'ulysses_sdpa'"])(lambda: inside(**inputs))
    model.set_attn_implementation("eager")
    expect_raise(ValueError, ["implementation is 'eager', not 'ulysses_sdpa'", "plain_attention"])(
        lambda: model(**inputs)
    )
    model.config._attn_implementation = "sdpa"
    expect_raise(ValueError, ["implementation is 'sdpa', not 'ulysses_sdpa'"])(lambda: model.model(**inputs))
    model.set_attn_implementation("ulysses_sdpa")
    expect_raise(ValueError, ["output_attentions=True"])(lambda: model(**inputs, output_attentions=True))
    check_parity(layout, "llama", prepare=lambda par: par.set_attn_implementation("eager") or (
        par.set_attn_implementation("ulysses_sdpa")))  # fmt: skip
    classifier = LlamaForSequenceClassification(build("llama").config)
    expect_raise(ValueError, ["LlamaForSequenceClassification pools one token"])(
        lambda: U.parallelize(classifier, layout)
    )


def attention_copied_by_peft(layout):
    """PEFT's modules_to_save listing an attention module or a decoder layer deep-copies it, config and all, and
    set_attn_implementation does not reach the copy's config: under SP the copy ran the model's own sdpa on each rank's
    shard alone (loss 0.2% off, silently). Refused at parallelize, the model left as it was; copied after parallelize,
    refused at the forward naming the cause; the projections listed instead are exact."""
    from tests.helpers.models import with_lora

    projections = ["q_proj", "k_proj", "v_proj", "o_proj"]
    for saved in (["self_attn"], ["layers.1"]):
        model = with_lora(build("qwen3", kv_heads=2), ("gate_proj",), modules_to_save=saved)
        expect_raise(ValueError, ["config is a copy that set_attn_implementation does not reach", "q_proj"])(
            lambda m=model: U.parallelize(m, layout)
        )
        assert model.config._attn_implementation == "sdpa"
        U.unparallelize(U.parallelize(model, U.ParallelLayout.single()))  # left unparallelized: takes sp=1
        copied = with_lora(U.parallelize(build("qwen3", kv_heads=2), layout), ("gate_proj",), modules_to_save=saved)
        shard = U.shard_batch(make_batch(1, 16), layout)
        expect_raise(RuntimeError, ["copy made after parallelize", "modules_to_save"])(
            lambda m=copied, s=shard: U.causal_lm_loss(m, s, layout)
        )
    adapt = functools.partial(with_lora, targets=("gate_proj",), modules_to_save=projections)
    check_parity(layout, "qwen3", kv_heads=2, batch=make_batch(2, 24, packed=(10, 14)), adapt=adapt)


def layouts_differ():
    """Ranks that ask for different sp (a per-rank config) built different groups and waited in each other's
    collectives until the process-group timeout (30 min by default); now a ValueError on every rank."""
    sp = 2 if dist.get_rank() == 0 else 1
    expect_raise(ValueError, ["asked for different layouts (rank 0: sp=2, ring=1; rank 1: sp=1, ring=1)"])(
        lambda: U.ParallelLayout.from_env(sp=sp)
    )


def gloo_settles_at_exit(layout):
    """A layout over a gloo group of several ranks leaves gloo's workers a moment at exit (process_group's
    docstring: a worker freeing a collective's tensors once the interpreter finalizes aborts the rank)."""
    from ulysses_sp.process_group import settle_at_exit

    assert dist.get_backend() == "gloo" and settle_at_exit.cache_info().currsize == 1
    settle_at_exit.cache_clear()  # a layout over groups made elsewhere registers it too (a second 0.2 s at exit)
    U.ParallelLayout.from_groups(layout.sp_group, layout.dp_group, loss_group=layout.loss_group)
    assert settle_at_exit.cache_info().currsize == 1


def resized_vocabulary(layout):
    """The vocabulary resized after parallelize (a tokenizer's new special tokens): ids are checked against the
    embedding's size at each forward. A grown one's new ids were refused (the size read at parallelize); an id
    outside a shrunk one reached the embedding on one rank (IndexError there, the other rank left waiting)."""
    model = build("llama")
    grown = copy.deepcopy(model)
    grown.resize_token_embeddings(VOCAB + 32, mean_resizing=False)
    batch = make_batch(2, 24)
    batch["input_ids"][0, 5] = batch["labels"][0, 5] = VOCAB + 7
    ref_loss, ref_grads = reference(grown, batch)

    def resize(par):
        par.resize_token_embeddings(VOCAB + 32, mean_resizing=False)
        par.load_state_dict(grown.state_dict())

    loss, grads, par = sequence_parallel(model, batch, layout, prepare=resize)
    assert_loss_and_grads(loss, grads, ref_loss, ref_grads)
    par.resize_token_embeddings(VOCAB - 8)
    shard = U.shard_batch(make_batch(1, 24), layout)
    shard["input_ids"] %= VOCAB - 8
    shard["input_ids"][0, -1] = VOCAB - 1  # on every rank: the message names the first rank holding one
    inputs = {k: shard[k] for k in ("input_ids", "position_ids", "attention_mask") if k in shard}
    expect_raise(ValueError, [f"input_ids holds id {VOCAB - 1}, outside the vocabulary of {VOCAB - 8} tokens"])(
        lambda: par(**inputs)
    )


def label_forms(layout):
    """Labels in the other forms a collator gives them, each against one process: "no loss" marked -1 instead of
    -100 (``ignore_index=-1``), targets already shifted next to the labels (``shift_labels`` win, as in
    transformers' loss; e.g. completion-only targets), and int32 labels."""
    batch = make_batch(2, 23, pad="right")
    batch["labels"][0, 3:7] = -100
    marked = batch["labels"].masked_fill(batch["labels"] == -100, -1)
    check_parity(
        layout,
        "llama",
        kv_heads=2,
        batch=batch,
        sp_batch={**batch, "labels": marked},
        shard_kwargs={"ignore_index": -1},
    )
    targets = U.shift_labels(batch["labels"])
    targets[:, :9] = -100  # the prompt's targets ignored, the labels left whole
    both = {**batch, "shift_labels": targets}
    check_parity(layout, "llama", kv_heads=2, batch=both)
    check_parity(layout, "llama", kv_heads=2, batch=batch, sp_batch={**batch, "labels": batch["labels"].int()})


def inputs_embeds(layout):
    """A batch of inputs_embeds instead of input_ids (soft prompts, another tower's tokens merged in): shard_batch
    refused it ("the batch needs input_ids") and causal_lm_loss dropped it from the shard (the model then asked for
    input_ids or inputs_embeds); now it is cut as input_ids are, zeros where the length is padded, and the loss and
    every gradient equal one process's (Llama; Gemma-3, whose embedding scales its output; the tiled loss). Ids and
    embeddings together, embeddings that are not [batch, seq_len, hidden] of floats, or that differ across the SP
    group are a ValueError on every rank."""
    batch = make_batch(2, 23, pad="right")
    noise = 0.1 * torch.randn(2, 23, 32, generator=torch.Generator().manual_seed(5))  # not a plain lookup

    def embedded(model):
        return {**batch, "inputs_embeds": model.get_input_embeddings()(batch["input_ids"]) + noise}

    for arch, tiled in (("llama", False), ("gemma3", False), ("llama", True)):
        model = build(arch, kv_heads=2)
        ref = copy.deepcopy(model)
        ref_loss = ref(**{k: v for k, v in embedded(ref).items() if k != "input_ids"}, use_cache=False).loss
        ref_loss.backward()  # (the embeddings come from this model: reference() would run a copy of it)
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        par = U.parallelize(copy.deepcopy(model), layout)
        if tiled:
            U.enable_tiled_loss(par, chunk_tokens=5)
        full = {k: v for k, v in embedded(par).items() if k != "input_ids"}
        loss = U.causal_lm_loss(par, U.shard_batch(full, layout), layout)
        loss.backward()
        U.sync_gradients(par, layout)
        assert_loss_and_grads(
            loss, {n: p.grad for n, p in par.named_parameters()}, ref_loss, ref_grads, label=f"{arch} "
        )
    with torch.no_grad():
        both = embedded(model)
        expect_raise(ValueError, ["input_ids or inputs_embeds, not both"])(lambda: U.shard_batch(both, layout))
        flat = {"inputs_embeds": both["inputs_embeds"][0], "labels": batch["labels"]}
        expect_raise(ValueError, ["inputs_embeds must be [batch, seq_len, hidden]", "(23, 32)"])(
            lambda: U.shard_batch(flat, layout)
        )
        ids = {"inputs_embeds": batch["input_ids"][..., None], "labels": batch["labels"]}
        expect_raise(ValueError, ["inputs_embeds must hold floats", "torch.int64"])(lambda: U.shard_batch(ids, layout))
        differ = {"inputs_embeds": both["inputs_embeds"] + 1e-3 * layout.sp_rank, "labels": batch["labels"]}
        expect_raise(ValueError, ["hold different batches (differing: inputs_embeds"])(
            lambda: U.shard_batch(differ, layout)
        )


def refusal_on_one_replica_sp1(layout):
    """dp=2 x sp=1 (no sequence split): a batch refused on replica 1 only, at sharding and at the forward, raises the
    same ValueError on both ranks instead of replica 0 going on to its gradient reduction; one process (sp=1, dp=1)
    refuses with no collective at all; afterwards the replicas still step together (a step equals one process)."""
    vocab = build("llama").config.vocab_size
    batch = make_batch(1, 16, seed=3)
    if layout.dp_rank == 1:
        batch["input_ids"][0, 5] = vocab
    refused = expect_raise(ValueError, ["data-parallel replica(s) [1] rejected", f"holds id {vocab}"])
    refused(lambda: U.shard_batch(batch, layout, vocab_size=vocab))
    model = U.parallelize(build("llama", kv_heads=2), layout)
    refused(lambda: model(input_ids=batch["input_ids"]))
    single, bad = U.ParallelLayout.single(), {**batch, "input_ids": batch["input_ids"].clamp(max=0) + vocab}
    collective = mock.Mock(side_effect=AssertionError("a collective in one process"))
    with mock.patch.multiple(dist, all_reduce=collective, all_gather=collective, all_gather_object=collective):
        expect_raise(ValueError, [f"input_ids holds id {vocab}"])(lambda: U.shard_batch(bad, single, vocab_size=vocab))
    check_parity(layout, "llama", kv_heads=2, batch=make_batch(2, 18))


def world2() -> dict[str, str]:
    sp2 = U.ParallelLayout.from_env(sp=2)
    dp2 = U.ParallelLayout.from_env(sp=1)  # two replicas, no sequence split
    P = functools.partial
    cases = {
        "llama_mha_sdpa": P(check_parity, sp2, "llama"),
        "llama_gqa_sdpa": P(check_parity, sp2, "llama", kv_heads=2),
        "llama_mqa_sdpa": P(check_parity, sp2, "llama", kv_heads=1),
        "mistral_sliding_window": P(check_parity, sp2, "mistral", kv_heads=2),
        "qwen2_mixed_window": P(check_parity, sp2, "qwen2", kv_heads=2),
        "qwen3_sdpa": P(check_parity, sp2, "qwen3", kv_heads=2),
        "gemma3_sdpa": P(check_parity, sp2, "gemma3", kv_heads=2),
        "gemma2_eager_softcap": P(check_parity, sp2, "gemma2", kv_heads=2, ref_attn="eager", core="eager"),
        "phi3_packed_sliding": P(check_parity, sp2, "phi3", kv_heads=2, batch=make_batch(2, 24, packed=(10, 14))),
        "olmo2_packed": P(check_parity, sp2, "olmo2", kv_heads=2, batch=make_batch(2, 24, packed=(10, 14))),
        "cohere2_packed_sliding": P(check_parity, sp2, "cohere2", kv_heads=2, batch=make_batch(2, 24, packed=(9, 15))),
        "gpt_neox_partial_rotary": P(check_parity, sp2, "gpt_neox", batch=make_batch(2, 23)),
        "llama_eager_core": P(check_parity, sp2, "llama", kv_heads=2, core="eager"),
        "llama_flex_core_forward": P(flex_forward, sp2),
        "compiled_with_memory_features": P(compiled, sp2),
        "compiled_layers_fullgraph": P(compiled_layers_fullgraph, sp2),
        "compiled_model_steps": P(compiled_model_steps, sp2),
        "compiled_layers_default_features": P(compiled_layers_default_features, sp2),
        "compiled_layers_batches_vary": P(compiled_layers_batches_vary, sp2),
        "seq_not_divisible": P(check_parity, sp2, "llama", batch=make_batch(2, 23)),
        "batch_size_3": P(check_parity, sp2, "llama", batch=make_batch(3, 20)),
        "padded_right": P(check_parity, sp2, "llama", batch=make_batch(2, 24, pad="right")),
        "padded_left": P(check_parity, sp2, "llama", kv_heads=2, batch=make_batch(2, 24, pad="left")),
        "padded_eager_core": P(check_parity, sp2, "llama", core="eager", batch=make_batch(2, 23, pad="right")),
        "padded_right_eager_model": P(
            check_parity, sp2, "llama", ref_attn="eager", core="eager", batch=make_batch(2, 23, pad="right")
        ),
        "padded_left_unmasked_labels": P(check_parity, sp2, "llama", kv_heads=2, batch=unmasked_left_padding()),
        "padding_with_targets_refused": P(padding_with_targets_refused, sp2),
        "label_forms": P(label_forms, sp2),
        "inputs_embeds": P(inputs_embeds, sp2),
        "packed_documents": P(check_parity, sp2, "llama", kv_heads=2, batch=make_batch(2, 24, packed=(5, 9, 10))),
        "packed_sliding_window": P(check_parity, sp2, "mistral", batch=make_batch(2, 30, packed=(13, 17))),
        "packed_eager_core": P(check_parity, sp2, "qwen3", core="eager", batch=make_batch(2, 24, packed=(12, 3, 9))),
        "bf16_communication": P(check_parity, sp2, "llama", kv_heads=2, comm_dtype=torch.bfloat16, rel=BF16_REL),
        "gradient_checkpointing": P(
            check_parity, sp2, "qwen3", kv_heads=2, checkpointing=True, batch=make_batch(2, 24, packed=(10, 14))
        ),
        "bad_input_on_one_rank_raises_everywhere": P(bad_input_on_one_rank, sp2),
        "different_batches_in_sp_group": P(different_batches, sp2),
        "collectives_per_layer": P(collective_count, sp2),
        "shape_mismatch_raises": P(shape_mismatch, sp2),
        "heads_not_divisible": P(heads_not_divisible, sp2),
        "missing_position_ids": P(missing_positions, sp2),
        "plain_attention_roundtrip": P(plain_attention_roundtrip, sp2),
        "dp2_sp1_refusal_on_one_replica": P(refusal_on_one_replica_sp1, dp2),
        "changed_after_parallelize": P(changed_after_parallelize, sp2),
        "attention_copied_by_peft": P(attention_copied_by_peft, sp2),
        "resized_vocabulary": P(resized_vocabulary, sp2),
        "layouts_differ": layouts_differ,
        "gloo_settles_at_exit": P(gloo_settles_at_exit, sp2),
    }
    return run_cases(cases)


def world_not_divisible() -> None:
    try:
        U.ParallelLayout.from_env(sp=3)
    except ValueError as err:
        assert "not divisible by sp=3" in str(err) and "1, 2, 4" in str(err), err
    else:
        raise AssertionError("sp=3 on 4 ranks was accepted")


def refusal_on_one_replica(layout):
    """dp=2 x sp=2: a batch refused on replica 1 only (at sharding, then at the forward, in training and in
    evaluation) raises the same ValueError on all four ranks instead of replica 0 going on to a collective
    replica 1 never reaches; another error in replica 1's checks raises there and a RuntimeError naming it on
    replica 0; afterwards the replicas still step together (a training step equals one process)."""
    vocab = build("llama").config.vocab_size
    batch = make_batch(1, 16, seed=3)
    if layout.dp_rank == 1:
        batch["input_ids"][0, 5] = vocab
    expect_raise(ValueError, ["data-parallel replica(s) [1] rejected", f"holds id {vocab}"])(
        lambda: U.shard_batch(batch, layout, vocab_size=vocab)
    )
    model = U.parallelize(build("llama", kv_heads=2, attn="eager"), layout, core="eager")
    left = make_batch(1, 16, pad="left", pad_lengths=(3,)) if layout.dp_rank == 1 else make_batch(1, 16)
    shard = U.shard_batch(left, layout)
    inputs = {k: shard[k] for k in ("input_ids", "position_ids", "attention_mask") if k in shard}
    refused = expect_raise(ValueError, ["data-parallel replica(s) [1] rejected", "starts with padding"])
    for grad in (True, False):  # a training step, an evaluation batch
        with torch.set_grad_enabled(grad):
            refused(lambda: model(**inputs))
    shard = U.shard_batch(make_batch(1, 16), layout)
    inputs = {k: shard[k] for k in ("input_ids", "position_ids", "attention_mask") if k in shard}
    broken = mock.patch("ulysses_sp.attention.left_padding_problem", side_effect=RuntimeError("boom"))
    with broken if layout.dp_rank == 1 else contextlib.nullcontext():
        wanted = ["boom"] if layout.dp_rank == 1 else ["data-parallel replica(s) [1] rejected", "RuntimeError: boom"]
        expect_raise(RuntimeError, wanted)(lambda: model(**inputs))
    check_parity(layout, "llama", kv_heads=2, batch=make_batch(2, 18))


def expect_raise(kind: type[Exception], fragments: list[str]):
    """A function that calls ``fn`` and checks that it raises ``kind`` with every fragment in its message."""

    def check(fn) -> None:
        try:
            fn()
        except kind as err:
            assert all(f in str(err) for f in fragments), err
        else:
            raise AssertionError(f"no {kind.__name__} with {fragments}")

    return check


def groups_made_by_hand() -> U.ParallelLayout:
    """dp=2 x sp=2 from new_group calls (as Accelerate or a user would make them): from_groups."""
    rank = dist.get_rank()
    sp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    layout = U.ParallelLayout.from_groups(sp_groups[rank // 2], dp_groups[rank % 2])
    assert (layout.dp, layout.sp, layout.sp_rank, layout.dp_rank) == (2, 2, rank % 2, rank // 2), layout
    return layout


def world4() -> dict[str, str]:
    sp4 = U.ParallelLayout.from_env(sp=4)
    by_hand = groups_made_by_hand()
    dp2sp2 = U.ParallelLayout.from_env(sp=2)  # a second layout in the same process
    assert (dp2sp2.dp, dp2sp2.sp) == (2, 2) and dist.get_world_size(dp2sp2.sp_group) == 2
    P = functools.partial
    cases = {
        "sp4_llama_mha": P(check_parity, sp4, "llama"),
        "sp4_kv_heads_lt_sp": P(check_parity, sp4, "llama", kv_heads=2),
        "sp4_mqa": P(check_parity, sp4, "qwen3", kv_heads=1),
        "sp4_gemma3_packed": P(check_parity, sp4, "gemma3", kv_heads=2, batch=make_batch(2, 30, packed=(11, 19))),
        "sp4_seq_not_divisible_padded": P(
            check_parity, sp4, "mistral", kv_heads=2, batch=make_batch(2, 26, pad="right")
        ),
        "dp2_sp2_llama": P(check_parity, dp2sp2, "llama", kv_heads=2, batch=make_batch(4, 22)),
        "dp2_sp2_packed": P(check_parity, dp2sp2, "qwen2", batch=make_batch(2, 24, packed=(9, 15))),
        "from_groups_dp2_sp2": P(check_parity, by_hand, "llama", kv_heads=2, batch=make_batch(2, 21, pad="right")),
        "world_not_divisible": world_not_divisible,
        "dp2_sp2_refusal_on_one_replica": P(refusal_on_one_replica, dp2sp2),
    }
    return run_cases(cases)
