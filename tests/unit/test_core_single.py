"""Single-process tests of the core: sharding, segments, loss, layout and bad input."""

import copy
import re

import pytest
import torch

import ulysses_sp as U
from tests.helpers.models import VOCAB, build, make_batch
from ulysses_sp.layout import sp_degrees_for


def fake_layout(sp: int, sp_rank: int):
    """Where sp rank ``sp_rank`` sits, without process groups: shard_batch cuts its shard in this process."""
    return U.ParallelLayout.rank_view(sp, sp_rank)


def test_shard_batch_pads_shifts_and_keeps_every_token():
    batch = make_batch(2, 11)
    shards = [U.shard_batch(batch, fake_layout(4, r)) for r in range(4)]
    ids = torch.cat([s["input_ids"] for s in shards], dim=1)
    assert ids.shape == (2, 12)
    torch.testing.assert_close(ids[:, :11], batch["input_ids"])
    targets = torch.cat([s["shift_labels"] for s in shards], dim=1)
    torch.testing.assert_close(targets[:, :10], batch["labels"][:, 1:])
    assert (targets[:, 10:] == -100).all()
    # the first token of shard 1 is the target of the last token of shard 0
    assert torch.equal(shards[0]["shift_labels"][:, -1], shards[1]["input_ids"][:, 0])
    positions = torch.cat([s["position_ids"] for s in shards], dim=1)
    # the padding is a document of its own: it never raises the largest position (length-dependent RoPE)
    torch.testing.assert_close(positions, torch.cat([torch.arange(11), torch.zeros(1, dtype=torch.long)]).expand(2, 12))


def test_shard_batch_packed_positions_and_mask():
    batch = make_batch(2, 9, packed=(4, 5), pad="right", pad_lengths=(0, 2))
    shards = [U.shard_batch(batch, fake_layout(2, r)) for r in range(2)]
    positions = torch.cat([s["position_ids"] for s in shards], dim=1)
    assert positions[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0]  # the padding: a document of its own
    mask = torch.cat([s["attention_mask"] for s in shards], dim=1)
    assert mask[1].tolist() == [1] * 7 + [0, 0, 0]


def test_shard_batch_rejects_labels_of_other_length():
    batch = make_batch(1, 10)
    batch["labels"] = batch["labels"][:, :9]
    with pytest.raises(ValueError, match=r"labels has shape \(1, 9\) but input_ids has shape \(1, 10\)"):
        U.shard_batch(batch, fake_layout(2, 0))


def test_shard_batch_needs_input_ids():
    with pytest.raises(ValueError, match="needs input_ids"):
        U.shard_batch({"labels": torch.zeros(1, 4)}, fake_layout(2, 0))


def test_segments_documents_and_padding():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [5, 6, 7, 8, 9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 0]])
    seg = U.Segments.from_positions(positions, mask)
    assert seg.spans == [[(0, 3), (3, 5), (5, 8)], [(2, 7)]]
    assert not seg.is_dense
    index, cu, max_len = seg.varlen()
    assert cu.tolist() == [0, 3, 5, 8, 13] and max_len == 5
    assert index.tolist() == list(range(8)) + [10, 11, 12, 13, 14]
    assert U.Segments.from_positions(torch.arange(6)[None]).is_dense


def test_loss_with_no_valid_token_is_zero_not_nan():
    layout = U.ParallelLayout.single()
    logits = torch.randn(1, 4, 10, requires_grad=True)
    loss = U.sequence_parallel_cross_entropy(logits, torch.full((1, 4), -100), layout)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_loss_is_token_weighted_mean():
    layout = U.ParallelLayout.single()
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    labels[0, :3] = -100
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(U.sequence_parallel_cross_entropy(logits, labels, layout), expected)
    half = U.sequence_parallel_cross_entropy(logits, labels, layout, num_items_in_batch=14)
    torch.testing.assert_close(half, expected * 7 / 14)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_sp1_matches_plain_model(arch):
    """sp=1 runs in one process with no process group, through the same code path."""
    batch = make_batch(2, 20, packed=(8, 12))
    model = build(arch, kv_heads=2)
    ref = model(**batch, use_cache=False).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    layout = U.ParallelLayout.single()
    U.parallelize(model, layout)
    loss = _loss(model, batch, layout)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_batch_of_padding_alone_still_reaches_every_parameter(attn):
    """An epoch's last batch can leave one data-parallel replica nothing but padding. Its core made zeros with
    no graph, so q/k/v and the norm before them got no gradient there: DDP / FSDP2 on the other replicas
    waited in a gradient reduction that this one never joined (a gloo size mismatch that killed the run).
    Every parameter now gets a gradient, zero for such a batch."""
    model = build("llama", kv_heads=2, attn=attn)
    layout = U.ParallelLayout.single()
    U.parallelize(model, layout)
    batch = make_batch(2, 12)
    batch["attention_mask"] = torch.zeros_like(batch["input_ids"])
    batch["labels"] = torch.full_like(batch["input_ids"], -100)
    loss = U.causal_lm_loss(model, U.shard_batch(batch, layout), layout, num_items_in_batch=5)
    loss.backward()
    assert loss.item() == 0.0
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient from a batch of padding"
        assert not p.grad.any(), name


def test_unsupported_core_is_rejected():
    with pytest.raises(ValueError, match=r"unsupported attention core 'flash_attention_9'"):
        U.parallelize(build("llama"), U.ParallelLayout.single(), core="flash_attention_9")


def test_flash_core_without_package_or_gpu_is_rejected():
    with pytest.raises(ValueError, match="flash_attention_2"):
        U.parallelize(build("llama"), U.ParallelLayout.single(), core="flash_attention_2")


def test_parallelize_twice_is_rejected_and_unparallelize_restores():
    model = build("llama")
    U.parallelize(model, U.ParallelLayout.single())
    assert model.config._attn_implementation == "ulysses_sdpa"
    with pytest.raises(ValueError, match="already parallelized"):
        U.parallelize(model, U.ParallelLayout.single())
    U.unparallelize(model)
    assert model.config._attn_implementation == "sdpa"


def test_not_a_transformers_model():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        U.parallelize(torch.nn.Linear(2, 2), U.ParallelLayout.single())


def test_layout_validation():
    with pytest.raises(ValueError, match="sp must be a positive int"):
        U.ParallelLayout.from_env(sp=0)
    with pytest.raises(ValueError, match="needs an sp_group"):
        U.ParallelLayout(dp=1, sp=2)
    with pytest.raises(ValueError, match="dp=2 needs a dp_group and a loss_group"):
        U.ParallelLayout(dp=2, sp=1)  # the replicas share a refusal over loss_group, sp=1 too
    layout = U.ParallelLayout.single()
    assert sp_degrees_for(12, 4) == [1, 2, 4, 12]
    layout.check_heads(12, 4)  # sp=1 always works
    three = U.ParallelLayout.single()
    object.__setattr__(three, "sp", 3)  # check_heads only reads sp
    with pytest.raises(ValueError, match="sp values that work: 1, 2, 4, 12"):
        three.check_heads(12, 4)


def test_a_layout_pickles_without_process_groups():
    """A rank view or a one-process layout pickles (a dataloader worker receives one); the fields survive."""
    import pickle

    for layout in (U.ParallelLayout.rank_view(4, 3, dp=2, dp_rank=1, ring=2), U.ParallelLayout.single()):
        got = pickle.loads(pickle.dumps(layout))
        assert repr(got) == repr(layout) and (got.is_view, got.sp_group) == (layout.is_view, None)
        assert copy.deepcopy(layout) is layout


def test_from_env_without_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert U.ParallelLayout.from_env(sp=1).world_size == 1
    with pytest.raises(ValueError, match="torchrun"):
        U.ParallelLayout.from_env(sp=2)


def test_default_group_starts_once_as_one_rank_without_a_launcher_and_refuses_a_half_environment(monkeypatch):
    import datetime

    import torch.distributed as dist

    from ulysses_sp.process_group import init_default_group

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4 is set but RANK is not"):
        init_default_group("gloo")
    monkeypatch.delenv("WORLD_SIZE")
    # NCCL on a rank whose LOCAL_RANK names a GPU the machine lacks (torchrun --nproc-per-node above the GPUs):
    # CUDA's "invalid device ordinal" on that rank alone before; named, before any group starts
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    with pytest.raises(ValueError, match=r"LOCAL_RANK=\d+, but this machine shows \d+ GPU\(s\).*--nproc-per-node"):
        init_default_group("nccl")
    monkeypatch.delenv("LOCAL_RANK")
    assert not dist.is_initialized()
    init_default_group("gloo", datetime.timedelta(seconds=30))
    try:
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        init_default_group("gloo")  # already started: nothing happens
        assert dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_interior_padding_hole_is_rejected():
    positions = torch.arange(8)[None]
    mask = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"padding inside row 0 \(token 3"):
        U.Segments.from_positions(positions, mask)


def test_a_masked_hole_is_refused_as_one_at_sharding():
    """Labels -100 wherever the mask is 0 (as collators make them): a hole's target is its next real token's, and
    the refusal named that target ("padding after the row's real tokens has a target") instead of the hole,
    which the forward refuses whatever the targets."""
    ids = torch.arange(1, 13)[None]
    mask = torch.ones_like(ids)
    mask[0, 5] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    with pytest.raises(ValueError, match=r"padding inside row 0 \(token 5 is masked between real tokens"):
        U.shard_batch(batch, fake_layout(2, 0))
    right = {k: v[:, :6] for k, v in batch.items()}  # padding at the end: the target message as before
    right["labels"][0, 5] = 7
    with pytest.raises(ValueError, match=r"padding token 4 of row 0 \(attention_mask 0, after the row's real"):
        U.shard_batch({**right, "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])}, fake_layout(2, 0))


def test_attention_sinks_are_rejected_before_training():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=4,
        attn_implementation="eager",
    )
    model = GptOssForCausalLM(cfg)
    with pytest.raises(ValueError, match="attention sinks"):
        U.parallelize(model, U.ParallelLayout.single(), core="eager")
    assert model.config._attn_implementation == "eager"  # a refused model is left untouched


def test_chunked_attention_is_rejected():
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=32,
        intermediate_size_mlp=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        attention_chunk_size=4,
    )
    with pytest.raises(ValueError, match="chunked_attention"):
        U.parallelize(Llama4ForCausalLM(cfg), U.ParallelLayout.single())


def test_moe_router_auxiliary_loss_is_checked_before_training(monkeypatch):
    """output_router_logits=True is accepted when the model's load-balancing loss is the form causal_lm_loss computes
    over the whole sequence (exact: tests/dist/cases_architectures.py), refused before training when it is not."""
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qwen3_moe

    model = build("qwen3_moe")
    model.config.output_router_logits = True
    U.parallelize(copy.deepcopy(model), U.ParallelLayout.single())
    original = qwen3_moe.load_balancing_loss_func
    monkeypatch.setattr(qwen3_moe, "load_balancing_loss_func", lambda *args: 2 * original(*args))
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM's load-balancing loss is not the Switch-Transformer"):
        U.parallelize(model, U.ParallelLayout.single())


def test_softcap_with_sdpa_is_rejected_before_training():
    model = build("gemma2", kv_heads=2, attn="eager")
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0.*core='eager'"):
        U.parallelize(model, U.ParallelLayout.single(), core="sdpa")


def test_a_target_on_padding_after_real_tokens_is_refused():
    """Right padding whose labels were left unmasked: one process lets a padding query attend to the tokens
    before it, Ulysses gives padding no attention, so shard_batch refuses the batch, naming the label."""
    batch = make_batch(2, 10, pad="right", pad_lengths=(0, 3))
    batch["labels"] = batch["input_ids"].clone()
    fix = "set the labels to -100 wherever attention_mask is 0"
    with pytest.raises(ValueError, match=rf"padding token 7 of row 1 .*labels\[1, 8\] = \d+.*{fix}"):
        U.shard_batch(batch, fake_layout(2, 0))
    given = {k: v for k, v in batch.items() if k != "labels"} | {"shift_labels": U.shift_labels(batch["labels"])}
    with pytest.raises(ValueError, match=r"padding token 7 of row 1 .*shift_labels\[1, 7\]"):
        U.shard_batch(given, U.ParallelLayout.single())
    U.shard_batch(make_batch(2, 10, pad="right", pad_lengths=(0, 3)), fake_layout(2, 0))  # labels masked: taken
    left = make_batch(2, 10, pad="left", pad_lengths=(0, 3))
    left["labels"] = left["input_ids"].clone()  # a left pad sees no key: zero output in one process too
    U.shard_batch(left, fake_layout(2, 0))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padding_under_an_eager_model_is_refused(attn):
    """An eager model gives a left pad (a query that sees no key) the mean of every value in its row, and the
    last pad's target counts; Ulysses gives it zero, as sdpa does: refused for eager, equal for sdpa."""
    model = build("llama", kv_heads=2, attn=attn)
    batch = make_batch(2, 12, pad="left", pad_lengths=(0, 4))
    layout = U.ParallelLayout.single()
    par = U.parallelize(copy.deepcopy(model), layout, core="eager")
    shard = U.shard_batch(batch, layout)
    inputs = {k: shard[k] for k in ("input_ids", "position_ids", "attention_mask")}
    if attn == "eager":
        with pytest.raises(ValueError, match=r"row 1 starts with padding.*eager attention.*padding_side = 'right'"):
            par(**inputs)
        return
    logits = par(**inputs).logits
    loss = U.sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout)
    torch.testing.assert_close(loss, model(**batch, use_cache=False).loss)


def test_given_shift_labels_are_sharded_when_labels_are_absent():
    batch = make_batch(1, 7)
    targets = U.shift_labels(batch.pop("labels"))
    batch["shift_labels"] = targets
    shards = [U.shard_batch(batch, fake_layout(2, r)) for r in range(2)]
    torch.testing.assert_close(torch.cat([s["shift_labels"] for s in shards], 1)[:, :7], targets)


def _loss(model, batch, layout=None):
    if layout is None:
        return model(**batch, use_cache=False).loss
    shard = U.shard_batch(batch, layout)
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    return U.sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_recompute_after_many_forwards_finds_its_documents(reentrant):
    """Five packed micro-batches forwarded before one backward: each recompute uses its own documents."""
    batches = [
        make_batch(1, 24, seed=i, packed=p) for i, p in enumerate([(5, 19), (12, 12), (24,), (3, 9, 12), (20, 4)])
    ]
    grads = []
    for layout in (None, U.ParallelLayout.single()):
        model = build("llama", kv_heads=2)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        if layout is not None:
            U.parallelize(model, layout)
        total = sum(_loss(model, b, layout) for b in batches)
        total.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[1].items():
        torch.testing.assert_close(grad, grads[0][name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda b, L: U.shard_batch(b["input_ids"], L), r"batch must be a dict of \[batch, seq_len\] tensors"),
        (lambda b, L: U.shard_batch(b, None), "layout must be a ulysses_sp.ParallelLayout, got NoneType"),
        (lambda b, L: U.shard_batch({**b, "input_ids": b["input_ids"][:, :0]}, L), r"shape \(2, 0\): a batch needs"),
        (lambda b, L: U.shard_batch({**b, "labels": b["labels"].float()}, L), "labels must hold integers, got dtype"),
        # (a tokenizer without a pad token: None failed in torch's new_full, on lengths not divisible by sp only)
        (lambda b, L: U.shard_batch(b, L, pad_token_id=None), "pad_token_id=None: shard_batch pads input_ids to a"),
        (lambda b, L: U.shard_batch(b, L, pad_token_id=1.5), r"pad_token_id=1.5: .* must be a non-negative int"),
        (
            lambda b, L: U.shard_batch(b, L, pad_token_id=VOCAB, vocab_size=VOCAB),
            rf"pad_token_id={VOCAB}: .* must be an int in \[0, {VOCAB}\); .* eos_token_id, or 0",
        ),
        (
            lambda b, L: U.shard_batch({**b, "attention_mask": torch.ones(2, 1, 24, 24)}, L),
            r"got shape \(2, 1, 24, 24\) \(1 = token, 0 = padding\): a 4-D mask is not supported; give the 2-D",
        ),
        (lambda b, L: U.causal_lm_loss(build("llama"), b, L), "the shard has no shift_labels"),
        (lambda b, L: U.parallelize(build("llama"), None), "layout must be a ulysses_sp.ParallelLayout"),
        (lambda b, L: U.parallelize(build("llama"), L, comm_dtype="bf16"), "comm_dtype must be a floating torch.d"),
        # (an integer or bool wire truncated q/k/v at sp > 1: loss 4.847758 against one process's 4.843582, silently)
        (lambda b, L: U.parallelize(build("llama"), L, comm_dtype=torch.int8), "got torch.int8"),
        (lambda b, L: U.parallelize(build("llama"), L, comm_dtype=torch.bool), "got torch.bool"),
        (lambda b, L: U.apply_features(build("llama"), {"tiled_loss": True}, "cpu"), "must be a ulysses_sp.Features"),
        (lambda b, L: U.choose_layout(2, 0), "num_heads must be a positive int or None, got 0"),
        (lambda b, L: U.choose_layout(True, 4), "sp must be a positive int, got True"),
        (lambda b, L: U.parallelize(build("llama"), L, head_chunk_budget_bytes=-5), "head_chunk_budget_bytes must"),
        (
            lambda b, L: U.parallelize(build("llama"), L)(input_ids=b["input_ids"][0]),
            r"input_ids of shape \(24,\): a parallelized model takes \[batch, tokens\]",
        ),
        (lambda b, L: U.gather_sequence(b["input_ids"], None), "layout must be a ulysses_sp.ParallelLayout"),
        (lambda b, L: U.gather_sequence(b["input_ids"].sum(), L), "needs a tensor with a sequence dim, got a 0-dim"),
        (
            lambda b, L: U.gather_sequence(b["input_ids"], L, dim=2),
            r"dim=2 is not a dim of a tensor of shape \(2, 24\)",
        ),
        (lambda b, L: U.gather_sequence(torch.ones(2, 3, requires_grad=True), L), "gather_sequence is not differenti"),
        (
            lambda b, L: U.gather_sequence(b["input_ids"], U.ParallelLayout.rank_view(2, 1)),
            "a ParallelLayout.rank_view has no process group to gather over",
        ),
    ],
)
def test_api_misuse_is_a_value_error_naming_it(call, message):
    with pytest.raises(ValueError, match=message):
        call(make_batch(2, 24), U.ParallelLayout.single())


def test_apply_features_is_all_or_nothing_and_names_the_field_to_turn_off():
    """OPT's layers have no MLP the tiling recognises: apply_features undoes the tiled loss it had switched on,
    so the call the error names works on the same model."""
    model = build("opt")
    with pytest.raises(ValueError, match=r"no recognisable MLP .*Features\(tiled_mlp=False\) turns this one off"):
        U.apply_features(model, U.Features(), "cpu")
    from ulysses_sp.tiled_loss import tiled_loss_enabled

    assert not tiled_loss_enabled(model)
    U.apply_features(model, U.Features(tiled_mlp=False), "cpu")
    assert tiled_loss_enabled(model)


def test_apply_features_refuses_head_chunks_it_does_not_set():
    """Features.head_chunks is parallelize's setting (train and simulate pass it to both): apply_features was given
    Features(head_chunks=2) in a user's loop and silently ran the model as it was parallelized. Now a value other
    than parallelize's is refused before anything is switched on; None (the default) or the same value passes."""
    from ulysses_sp.tiled_loss import tiled_loss_enabled

    single = U.ParallelLayout.single()
    chunked = U.parallelize(build("llama"), single, head_chunks=2)
    U.apply_features(chunked, U.Features(head_chunks=2), "cpu")
    automatic = U.parallelize(build("llama"), single)
    for model, given in ((automatic, "head_chunks=None"), (build("llama"), "not parallelized")):
        with pytest.raises(ValueError, match=rf"Features\(head_chunks=2\).*{re.escape(given)}.*head_chunks=2\)"):
            U.apply_features(model, U.Features(head_chunks=2), "cpu")
        assert not tiled_loss_enabled(model)
        U.apply_features(model, U.Features(head_chunks=0), "cpu")  # automatic: what both already do
    U.apply_features(build("llama"), U.Features(head_chunks=1), "cpu")


def test_causal_lm_loss_refuses_shards_on_a_model_without_sequence_parallel_attention(monkeypatch):
    """A layout that splits the sequence (a rank view of sp=2 here: refused before any collective) and a model that
    runs transformers' own attention (never parallelized, or unparallelized): each rank's attention would see its
    shard alone. Another library's attention registered under the model's implementation (as the DeepSpeed
    reference of ``ulysses-sp bench`` does) is left to that library."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ulysses_sp.loss import _check_parallelized

    view = U.ParallelLayout.rank_view(2, 0)
    shard = U.shard_batch(make_batch(1, 8), view)
    for impl in ("sdpa", "eager"):
        with pytest.raises(ValueError, match=r"sp=2, but the model is not parallelized .*parallelize\(model, layout\)"):
            U.causal_lm_loss(build("llama", attn=impl), shard, view)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", lambda *args, **kwargs: None)  # another library's
    _check_parallelized(build("llama"), view)
    _check_parallelized(build("llama", attn="eager"), U.ParallelLayout.single())  # no sequence split


def test_losses_read_another_ignore_index_on_a_shard_or_on_raw_targets():
    """ignore_index=-1 passed to the loss functions, on shard_batch's output (already -100) or on targets marked
    -1 by hand: the same value as torch's cross-entropy ignoring those targets."""
    from ulysses_sp.validation import first_bad_id

    layout = U.ParallelLayout.single()
    batch = make_batch(2, 11)
    batch["labels"][0, 2:5] = -1
    logits = torch.randn(2, 11, 128)
    shard = U.shard_batch(batch, layout, ignore_index=-1)
    raw = U.shift_labels(batch["labels"], ignore_index=-1)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), raw.flatten(), ignore_index=-1)
    for targets in (shard["shift_labels"], raw):
        got = U.sequence_parallel_cross_entropy(logits, targets, layout, ignore_index=-1)
        torch.testing.assert_close(got, want)
        assert U.count_valid_tokens(targets, layout, ignore_index=-1) == int((raw != -1).sum())
    assert first_bad_id(torch.tensor([3, 16]), 16, 16) is None  # an ignore_index at the vocabulary size is allowed


def test_apply_features_undoes_its_work_on_any_error(monkeypatch):
    import ulysses_sp.tiling as tiling
    from ulysses_sp.tiled_loss import tiled_loss_enabled

    def broken(*args, **kwargs):
        raise RuntimeError("a fault in the tiling")

    monkeypatch.setattr(tiling, "enable_tiled_mlp", broken)
    model = build("llama")
    with pytest.raises(RuntimeError, match="a fault in the tiling"):
        U.apply_features(model, U.Features(), "cpu")
    assert not tiled_loss_enabled(model)
    switch = lambda field: f"--no-{field}"  # noqa: E731
    with pytest.raises(ValueError, match=r"already enabled.*--no-tiled_loss turns this one off"):
        U.enable_tiled_loss(model)
        U.apply_features(model, U.Features(), "cpu", switch=switch)
    assert tiled_loss_enabled(model)  # the caller's own, left on


@pytest.mark.parametrize("kind", ["PromptTuningConfig", "PrefixTuningConfig", "PromptEncoderConfig"])
def test_peft_prompt_learning_is_refused_under_sp_not_alone(kind):
    """Prompt, prefix and p-tuning add virtual tokens to each sequence the model sees: under SP each shard would get
    them (the first step failed on missing positions or a KV cache, naming neither). Refused when parallelized with
    sp > 1 (or, wrapped around a model parallelized already, by causal_lm_loss), naming the adapter; one rank (sp=1)
    takes it, as do LoRA and the adaption prompt under SP."""
    peft = pytest.importorskip("peft")
    from ulysses_sp.standin import StandIn

    def adapted(config):
        return peft.get_peft_model(build("llama"), config)

    prompt = getattr(peft, kind)(
        task_type="CAUSAL_LM",
        num_virtual_tokens=4,
        **({"encoder_hidden_size": 16} if kind == "PromptEncoderConfig" else {}),
    )
    with StandIn(sp=2) as rank:
        with pytest.raises(ValueError, match=r"the PEFT adapter 'default' is \w+_TUNING, prompt learning"):
            U.parallelize(adapted(prompt), rank.layout)
        # wrapped after parallelize: refused by causal_lm_loss (PEFT drops the shard's position_ids for the virtual
        # tokens, and the model's refusal of a shard without global positions blamed the caller's batch)
        wrapped = peft.get_peft_model(U.parallelize(build("llama"), rank.layout), prompt)
        with pytest.raises(ValueError, match=r"the PEFT adapter 'default' is \w+_TUNING, prompt learning"):
            U.causal_lm_loss(wrapped, U.shard_batch(make_batch(1, 16), rank.layout), rank.layout)
        for other in (
            peft.LoraConfig(r=4, target_modules=["q_proj"]),
            peft.AdaptionPromptConfig(adapter_len=2, adapter_layers=1, task_type="CAUSAL_LM"),
        ):
            U.unparallelize(U.parallelize(adapted(other), rank.layout))
    U.unparallelize(U.parallelize(adapted(prompt), U.ParallelLayout.single()))


def test_a_wire_dtype_on_a_ring_only_layout_is_refused():
    """comm_dtype sets the all-to-alls' payload; a ring-only layout (ulysses 1) has none, so bf16 there changed
    nothing, silently. Refused naming the layout; a hybrid (ulysses 2 x ring 2) takes it for its all-to-alls."""
    from ulysses_sp.standin import StandIn

    refused = r"comm_dtype=torch.bfloat16 .* \(ring 2, ulysses 1\) has none"
    with StandIn(sp=2, ring=2) as rank, pytest.raises(ValueError, match=refused):
        U.parallelize(build("llama"), rank.layout, comm_dtype=torch.bfloat16)
    with StandIn(sp=4, ring=2) as rank:
        model = U.parallelize(build("llama"), rank.layout, comm_dtype=torch.bfloat16)
        assert U.ulysses_context(model).comm_dtype == torch.bfloat16
