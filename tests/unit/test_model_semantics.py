"""What parallelize reads from a model, in one process: windows and decoders, masks the model builds itself,
positions, MLA head dims, id checks, deepcopy, dropout streams, the MoE aux loss."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import CONFIG_MAPPING

import ulysses_sp as U
from tests.helpers.models import VOCAB, build, build_generic, make_batch
from tests.unit.test_core_single import fake_layout
from ulysses_sp.attention import UlyssesAttention
from ulysses_sp.cores import check_flex_head_dim, sdpa_core
from ulysses_sp.hf import decoder_module


def _applied_windows(model) -> list:
    """The sliding window each attention layer hands the core in one forward pass (None: full causal)."""
    seen = []

    def core(q, k, v, segments, **kwargs):
        seen.append(kwargs["sliding_window"])
        return sdpa_core(q, k, v, segments, **kwargs)

    par = U.parallelize(model, U.ParallelLayout.single(), core=core)
    with torch.no_grad():
        par(input_ids=torch.randint(0, VOCAB, (1, 8)))
    return seen


@pytest.mark.parametrize(
    ("arch", "expected"),
    [
        ("qwen2_moe_window", [6, None]),  # layer_types from use_sliding_window + max_window_layers
        ("phimoe_window", [6, 6]),  # sliding_window without layer types: every layer
        ("qwen2", [None, 6]),
        ("llama", [None, None]),
        ("qwen3", [None, None]),  # use_sliding_window=False
        ("llama_unused_window", [None, None]),  # the config's key is never applied by Llama's mask
        ("gemma3", [6, None]),
    ],
)
def test_layer_window_follows_the_models_own_mask(arch, expected):
    assert _applied_windows(build(arch, kv_heads=2)) == expected


# Families whose mask ignores a sliding_window key in their config (applied anyway, the loss was off by up to 2e-2).
UNUSED_WINDOW_TYPES = [
    "llama",
    "olmo2",
    "gpt_neox",
    "granite",
    "internlm3",
    "jetmoe",
    "hunyuan_v1_moe",
    "olmo",
    "bitnet",
    "minimax_m2",
]


@pytest.mark.parametrize(
    "model_type",
    [
        pytest.param(t, marks=pytest.mark.skipif(t not in CONFIG_MAPPING, reason=f"no {t} in this transformers"))
        for t in UNUSED_WINDOW_TYPES
    ],
)
def test_a_window_the_model_never_applies_is_not_applied(model_type):
    model = build_generic(model_type, sliding_window=4)
    batch = make_batch(2, 24)
    with torch.no_grad():
        want = model(**batch, use_cache=False).loss
        single = U.ParallelLayout.single()
        par = U.parallelize(copy.deepcopy(model), single)
        got = U.causal_lm_loss(par, U.shard_batch(batch, single), single)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_window_passed_to_attention_that_the_mask_does_not_apply_is_refused():
    """OLMoE passes config.sliding_window to its attention function but masks causally: under sdpa one process
    applies no window, under flash attention it does. Ulysses refuses instead of picking one."""
    par = U.parallelize(build_generic("olmoe", sliding_window=4), U.ParallelLayout.single())
    with pytest.raises(ValueError, match="passes sliding_window=4 .* applies no window"):
        par(input_ids=torch.randint(0, VOCAB, (1, 8)))


def test_a_mask_the_model_builds_itself_is_refused():
    """Doge adds a dynamic mask made from learned parameters (A, dt_proj) to its attention: Ulysses would drop it
    (wrong loss, no gradient for them), so the first forward raises a ValueError naming the module."""
    model = build_generic("doge")
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.A)
    par = U.parallelize(model, U.ParallelLayout.single())
    with pytest.raises(ValueError, match="DogeAttention passes its own attention mask .* shape \\(1, 4, 8, 8\\)"):
        par(input_ids=torch.randint(0, VOCAB, (1, 8)))
    window = U.parallelize(build_generic("doge", sliding_window=4), U.ParallelLayout.single())
    with pytest.raises(ValueError, match="reads attention_mask.dtype"):  # it computes with its sliding mask
        window(input_ids=torch.randint(0, VOCAB, (1, 8)))


def test_mask_overlays_are_refused():
    """An extra mask function on top of the causal one (e.g. bidirectional image tokens) is not dropped silently."""
    from transformers.masking_utils import create_causal_mask

    par = U.parallelize(build("llama"), U.ParallelLayout.single())
    embeds = torch.zeros(1, 8, par.config.hidden_size)
    with pytest.raises(ValueError, match="extra mask function"):
        create_causal_mask(par.config, embeds, None, None, or_mask_function=lambda b, h, q, k: q == k)
    assert create_causal_mask(par.config, embeds, None, None) is None


def _single_loss(model, batch, sharded=None):
    """(the model's own loss on the full batch, the Ulysses loss at sp=1 on ``sharded`` or the same batch)."""
    single = U.ParallelLayout.single()
    with torch.no_grad():
        want = model(**batch, use_cache=False).loss
        par = U.parallelize(copy.deepcopy(model), single)
        got = U.causal_lm_loss(par, U.shard_batch(sharded or batch, single), single)
    return got, want


@pytest.mark.parametrize(
    ("arch", "documents", "from_mask"),
    [("llama", True, False), ("opt", False, True), ("biogpt", False, False), ("afmoe", False, False)],
)
def test_what_the_decoder_does_with_positions_is_read_from_its_code(arch, documents, from_mask):
    from ulysses_sp.hf import attention_modules
    from ulysses_sp.masks import read_decoder_masks

    model = build(arch, kv_heads=2 if arch != "opt" else None)
    reading = read_decoder_masks(decoder_module(model, attention_modules(model)))
    assert (reading.documents, reading.positions_from_mask) == (documents, from_mask)


@pytest.mark.parametrize("arch", ["opt", "biogpt", "afmoe"])
def test_packed_documents_attend_to_each_other_where_the_models_mask_ignores_positions(arch):
    """OPT, BioGPT and AFMoE build their mask without position_ids: one process lets packed documents attend to
    each other, and so must Ulysses (it used to keep them apart: a different loss)."""
    got, want = _single_loss(build(arch, kv_heads=2 if arch == "afmoe" else None), make_batch(2, 24, packed=(10, 14)))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_left_padding_on_a_model_that_derives_positions_from_the_mask():
    """OPT numbers tokens with cumsum(mask) * mask - 1: shard_batch's positions 0, 1, ... (padding included) are
    refused for left-padded rows; the model's own positions, given to shard_batch, are exact."""
    model, batch = build("opt"), make_batch(2, 24, pad="left")
    with pytest.raises(ValueError, match="OPTDecoder derives position ids from the attention mask .* row 1"):
        _single_loss(model, batch)
    mask = batch["attention_mask"]
    own = {**batch, "position_ids": mask.cumsum(-1) * mask - 1}
    got, want = _single_loss(model, batch, sharded=own)  # the reference derives them itself
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got, want = _single_loss(model, make_batch(2, 23, pad="right"))  # right padding carries no target
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got, want = _single_loss(build("biogpt"), batch)  # BioGPT numbers tokens 0, 1, ... like shard_batch
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_packed_rows_are_refused_when_the_mask_cannot_be_read():
    from ulysses_sp.masks import DecoderMasks

    ctx = UlyssesAttention(U.ParallelLayout.single(), sdpa_core, core_name="sdpa", masks=DecoderMasks(documents=None))
    ctx.begin_forward(torch.arange(8)[None], None, 1, 8)  # one document: fine
    with pytest.raises(ValueError, match="one document per row"):
        ctx.begin_forward(torch.cat([torch.arange(3), torch.arange(5)])[None], None, 1, 8)


def test_shard_batch_masks_the_padding_it_adds():
    shard = U.shard_batch(make_batch(2, 7), fake_layout(2, 1))
    assert shard["attention_mask"].tolist() == [[1, 1, 1, 0]] * 2
    assert "attention_mask" not in U.shard_batch(make_batch(2, 8), fake_layout(2, 1))


def test_decoder_hook_is_where_the_causal_lm_enters():
    """OPTForCausalLM calls model.decoder directly (skipping OPTModel): the hook must sit on OPTDecoder."""
    opt = build("opt")
    attention = [layer.self_attn for layer in opt.model.decoder.layers]
    assert decoder_module(opt, attention) is opt.model.decoder
    llama = build("llama")
    assert decoder_module(llama, [layer.self_attn for layer in llama.model.layers]) is llama.model


@pytest.mark.parametrize(("d_qk", "d_v"), [(12, 8), (8, 12)])
def test_v_head_dim_differs_from_qk_head_dim(d_qk, d_v):
    """MLA-style heads: the padded exchange gives exactly sdpa on the unpadded tensors (both directions)."""
    ctx = UlyssesAttention(U.ParallelLayout.single(), sdpa_core, core_name="sdpa")
    positions = torch.arange(10)[None]
    ctx.begin_forward(positions, None, 2, 10)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 10, d_qk, generator=gen) for _ in range(2))
    v = torch.randn(2, 4, 10, d_v, generator=gen)
    out, _ = ctx(torch.nn.Module(), q, k, v, None, scaling=None, position_ids=positions)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    assert out.shape == (2, 10, 4, d_v)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize(
    ("key", "value", "vocab", "needles"),
    [
        ("input_ids", VOCAB + 1, VOCAB, [f"input_ids holds id {VOCAB + 1}", f"vocabulary of {VOCAB} tokens"]),
        ("input_ids", -3, None, ["input_ids holds id -3", "negative"]),
        ("labels", VOCAB, VOCAB, [f"labels holds id {VOCAB}", "-100 (ignored)"]),
        ("labels", -5, None, ["labels holds id -5"]),
    ],
)
def test_shard_batch_refuses_ids_outside_the_vocabulary(key, value, vocab, needles):
    batch = make_batch(1, 8)
    batch[key][0, 3] = value
    with pytest.raises(ValueError) as err:
        U.shard_batch(batch, fake_layout(2, 0), vocab_size=vocab)
    assert all(n in str(err.value) for n in needles), str(err.value)


def test_ignored_labels_and_valid_ids_pass():
    batch = make_batch(1, 8, pad="right", pad_lengths=(3,))  # labels -100 on the padding
    U.shard_batch(batch, fake_layout(2, 0), vocab_size=VOCAB)


def test_float_input_ids_are_refused_with_a_value_error():
    batch = make_batch(1, 8)
    batch["input_ids"] = batch["input_ids"].float()
    with pytest.raises(ValueError, match="integer token ids"):
        U.shard_batch(batch, fake_layout(2, 0))
    model = U.parallelize(build("llama"), U.ParallelLayout.single())
    with pytest.raises(ValueError, match="integer token ids"):
        model(input_ids=batch["input_ids"])


def test_forward_refuses_token_ids_outside_the_embedding():
    model = U.parallelize(build("llama"), U.ParallelLayout.single())
    ids = torch.tensor([[1, 2, VOCAB + 4]])
    with pytest.raises(ValueError, match=f"input_ids holds id {VOCAB + 4}, outside the vocabulary of {VOCAB}"):
        model(input_ids=ids)


def test_deepcopy_is_parallelized_on_its_own():
    model = U.parallelize(build("llama"), U.ParallelLayout.single())
    twin = copy.deepcopy(model)
    U.unparallelize(twin)
    assert not hasattr(twin, "_ulysses_sp_state") and hasattr(model, "_ulysses_sp_state")
    ids = torch.randint(0, VOCAB, (1, 8))
    with U.plain_attention(model):  # the original's hooks survived the copy's unparallelize
        reference = model(input_ids=ids).logits
    torch.testing.assert_close(model(input_ids=ids).logits, reference)
    torch.testing.assert_close(twin(input_ids=ids).logits, reference)


def test_flex_head_dim_check_is_for_cuda_only():
    check_flex_head_dim(8, torch.device("cpu"))  # CPU flex runs eagerly: any head dim
    check_flex_head_dim(16, torch.device("cuda"))
    with pytest.raises(ValueError, match="head dim >= 16 on CUDA.*got head dim 8; use core='sdpa'"):
        check_flex_head_dim(8, torch.device("cuda"))


def test_flex_core_trains_nowhere_torch_has_no_backward_for_it():
    """parallelize(core='flex_attention') on the CPU, then a training step: torch's NotImplementedError ("FlexAttention
    does not support backward on CPU") from inside the layers (only `ulysses-sp train` refused it, by a rule of its
    own). Now the core names itself and sdpa; the forward under no_grad (evaluation) still runs, as one process."""
    batch = make_batch(2, 24, packed=(7, 10, 7))
    model = build("llama", kv_heads=2)
    with torch.no_grad():
        reference = model(**batch, use_cache=False).loss  # (a cache turns transformers' packed-document mask off)
    par = U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), core="flex_attention")
    with pytest.raises(ValueError, match=r"^core 'flex_attention' cannot train on a cpu device .* use core='sdpa'"):
        par(**batch)
    with torch.no_grad():
        torch.testing.assert_close(par(**batch).loss, reference)


@pytest.mark.parametrize(
    ("nproc", "gpus", "environ", "world"),
    [
        (None, 0, {}, 2),  # CPU-only machine: 2 local ranks
        (None, 1, {}, 1),  # one GPU: one rank
        (None, 8, {}, 8),
        (4, 8, {}, 4),
        (None, 8, {"WORLD_SIZE": "1", "RANK": "0"}, 1),  # under torchrun
        (None, 0, {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4"}, 4),
    ],
)
def test_expected_world_size(nproc, gpus, environ, world):
    from ulysses_sp.train.launch import expected_world_size

    assert expected_world_size(nproc, gpus, environ) == world


def test_default_sp_runs_on_one_rank(monkeypatch):
    """No --sp: 2 (the 2 CPU ranks, or dp x 2 on several GPUs), 1 on a single rank so one GPU runs it."""
    from ulysses_sp.train.config import default_sp, load_config

    assert [default_sp(w) for w in (1, 2, 4, 8)] == [1, 2, 2, 2]
    monkeypatch.setenv("WORLD_SIZE", "1")  # e.g. torchrun --nproc-per-node 1, or one GPU
    monkeypatch.setenv("RANK", "0")
    assert load_config([]).sp == 1
    assert load_config(["--sp", "2", "--nproc", "2"]).sp == 2
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    assert load_config(["--nproc", "2"]).sp == 2


def test_packed_kernel_choice(monkeypatch):
    """On CUDA, rows packed with many documents take one flex call; few documents, CPU, dropout or a small
    head dim keep the per-document sdpa loop."""
    from ulysses_sp import cores

    monkeypatch.setattr(cores, "_has_triton", lambda: True)
    many = U.Segments.from_positions(torch.arange(8).repeat(2, 9))  # 2 rows x 9 documents of 8
    tied = U.Segments.from_positions(torch.arange(8).repeat(2, 8))  # 8 a row: the H200's tie, the loop stays
    few = U.Segments.from_positions(torch.cat([torch.arange(40), torch.arange(24)]).expand(2, 64))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cores.packed_kernel(many, cuda, 64) == "flex"
    assert cores.packed_kernel(few, cuda, 64) == "per_document"
    assert cores.packed_kernel(tied, cuda, 64) == "per_document"
    assert cores.packed_kernel(many, cpu, 64) == "per_document"
    assert cores.packed_kernel(many, cuda, 64, dropout=0.1) == "per_document"
    assert cores.packed_kernel(many, cuda, 8) == "per_document"
    # the GPU test's rows of many documents (head dim 16) do reach the flex call there
    from tests.gpu.test_gpu_cores import MANY
    from tests.helpers.models import make_batch

    gpu_case = U.Segments.from_positions(make_batch(2, 128, packed=MANY)["position_ids"])
    assert cores.packed_kernel(gpu_case, cuda, 16) == "flex"
    monkeypatch.setattr(cores, "_has_triton", lambda: False)
    assert cores.packed_kernel(many, cuda, 64) == "per_document"


def test_packed_attention_benchmark_runs_and_saves(tmp_path, monkeypatch):
    import runpy
    import sys

    argv = ["packed_attention.py", "--device", "cpu", "--seq-len", "64", "--docs", "1", "4", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path)])
    runpy.run_path("benchmarks/packed_attention.py", run_name="__main__")
    table = (tmp_path / "packed_attention_cpu.md").read_text()
    assert "| cpu | 64 | 4 | per_document |" in table


# -------------------------------------------------------------------------------- the tiled loss's first-forward probe
@pytest.mark.parametrize("model_type", ["gpt2", "gpt_bigcode", "biogpt", "opt"])
def test_tiled_loss_where_the_causal_lm_reads_more_than_the_last_hidden_state(model_type):
    """GPT-2 and GPTBigCode read cross_attentions from their decoder's output, OPT calls model.decoder directly:
    the first-forward probe raised AttributeError on every rank. Now exact (eval mode: these configs drop out)."""
    model = build_generic(model_type).eval()
    batch = make_batch(2, 24, pad="right")
    plain = copy.deepcopy(model)
    want = plain(**batch).loss
    want.backward()
    tiled = U.enable_tiled_loss(copy.deepcopy(model), chunk_tokens=5)
    got = tiled(**batch).loss
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(tiled.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("model_type", ["gemma2", "granite", "cohere"])
def test_the_probe_accepts_16_bit_post_processing(model_type):
    """Softcapping (Gemma 2), logits_scaling (Granite) and logit_scale (Cohere) computed by the model in bf16 and by
    the tiled head in fp32 differ by bf16 rounding only: not refused."""
    extra = {"gemma2": {"attn": "eager"}, "granite": {"logits_scaling": 4.0}, "cohere": {}}
    model = build_generic(model_type, **extra[model_type]).to(torch.bfloat16)
    U.enable_tiled_loss(model)(**make_batch(1, 8))


# -------------------------------------------------------------------- targets outside the vocabulary in the plain loss
@pytest.mark.parametrize("label", [VOCAB + 2, -5])
def test_plain_loss_refuses_targets_outside_the_vocabulary(label):
    """causal_lm_loss without the tiled loss and shard_batch without vocab_size (the README's loop): the targets
    never reach the model, and cross_entropy raised IndexError on the rank holding the bad one."""
    single = U.ParallelLayout.single()
    model = U.parallelize(build("llama"), single)
    shard = U.shard_batch(make_batch(1, 8), single)
    shard["shift_labels"][0, 4] = label  # (shard_batch itself catches negative labels)
    with pytest.raises(ValueError, match=f"1 target id.* outside the vocabulary of {VOCAB} logits .*id {label}"):
        U.causal_lm_loss(model, shard, single)


# ----------------------------------------------------------------------------------------------- the batch fingerprint
def test_fingerprint_sees_edits_that_cancel_in_sums():
    """Paired +1/-1 edits 65521 tokens apart (equal weights), or +1, -2, +1 on weights 1, 2, 3, left the old
    (weighted sum, sum) fingerprint unchanged: ranks holding different batches went unnoticed."""
    from ulysses_sp.batch_checks import _fingerprint

    ids = torch.full((1, 65536), 10)
    paired = ids.clone()
    paired[0, 3] += 1
    paired[0, 3 + 65521] -= 1
    triple = ids.clone()
    triple[0, :3] += torch.tensor([1, -2, 1])
    prints = [tuple(int(v) for v in _fingerprint(x)) for x in (ids, paired, triple)]
    assert len(set(prints)) == 3, prints
    assert _fingerprint(ids.int())[1:] == _fingerprint(ids)[1:]  # the values count, not the dtype


def test_embedding_words_are_exact_and_see_one_value():
    """A batch of inputs_embeds is fingerprinted by per-token integer words computed where the embeddings are (no
    [b, N, hidden] copy to the host): the same for any chunk of tokens (exact integer sums), changed by a change of
    one value (its sign too) of one token, in fp32, bf16 and fp8."""
    from ulysses_sp.batch_checks import _fingerprint, embedding_words

    embeds = torch.randn(2, 37, 48, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        x = embeds.to(dtype)
        words = embedding_words(x)
        assert words.shape == (2, 37) and words.dtype == torch.int64
        assert torch.equal(embedding_words(x, chunk_elements=1), words)
        for edit in (lambda v: -v, lambda v: v * 2):
            y = x.clone()
            y[1, 20, 7] = edit(y[1, 20, 7].float()).to(dtype)
            changed = embedding_words(y) != words
            assert changed[1, 20] and int(changed.sum()) == 1, dtype
            assert _fingerprint(y)[1:] != _fingerprint(x)[1:]


# ----------------------------------------------------------------------------------------------------- dropout streams
def test_dropout_at_sp1_draws_what_the_model_draws():
    """Per-rank dropout streams exist under sp > 1 only (tests/dist/cases_architectures.py): one process draws exactly
    the plain model's masks, and the global generator ends where the plain model leaves it."""
    model = build_generic("gpt2").train()
    batch = make_batch(2, 24)
    torch.manual_seed(3)
    want = copy.deepcopy(model)(**batch).loss
    state = torch.get_rng_state()
    single = U.ParallelLayout.single()
    par = U.parallelize(copy.deepcopy(model), single)
    torch.manual_seed(3)
    got = U.causal_lm_loss(par, U.shard_batch(batch, single), single)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.get_rng_state(), state)


def test_layerdrop_is_refused():
    with pytest.raises(ValueError, match="layerdrop=0.1.*set layerdrop=0"):
        U.parallelize(build_generic("opt", layerdrop=0.1), U.ParallelLayout.single())


# ----------------------------------------------------------------------------------------- the MoE load-balancing loss
@pytest.mark.parametrize("tiled", [False, True], ids=["plain_loss", "tiled_loss"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe_window"])
def test_router_aux_loss_is_added_as_the_model_adds_it(arch, tiled):
    """causal_lm_loss = cross-entropy + router_aux_loss_coef x load-balancing loss, as the model's own loss (one
    process here, padded rows; sp=2, sp=4, dp2 x sp2 in tests/dist/cases_architectures.py)."""
    from tests.dist.cases_architectures import with_router_aux

    model = with_router_aux(arch)
    batch = make_batch(2, 23, pad="right")
    plain = copy.deepcopy(model)
    out = plain(**batch, use_cache=False)
    out.loss.backward()
    assert float(out.aux_loss.detach()) > 1  # the 0.5 coefficient makes it count
    single = U.ParallelLayout.single()
    par = U.parallelize(copy.deepcopy(model), single)
    if tiled:
        U.enable_tiled_loss(par, chunk_tokens=5)
    got = U.causal_lm_loss(par, U.shard_batch(batch, single), single)
    got.backward()
    torch.testing.assert_close(got, out.loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(par.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("tiled", [False, True], ids=["plain_loss", "tiled_loss"])
def test_router_aux_loss_leaves_out_rows_not_kept(tiled):
    """rows_kept (an eval batch's rows that repeat no sample): a row left out, its targets -100, counts in neither
    part of the loss, which is the model's own on the kept row alone (its router tokens made it differ)."""
    from tests.dist.cases_architectures import with_router_aux

    model = with_router_aux("mixtral")
    batch = make_batch(2, 23, pad="right")
    want = copy.deepcopy(model)(**{k: v[:1] for k, v in batch.items()}, use_cache=False).loss
    single = U.ParallelLayout.single()
    par = U.parallelize(copy.deepcopy(model), single)
    if tiled:
        U.enable_tiled_loss(par, chunk_tokens=5)
    shard = U.shard_batch({**batch, "labels": batch["labels"].index_fill(0, torch.tensor([1]), -100)}, single)
    got = U.causal_lm_loss(par, shard, single, rows_kept=torch.tensor([True, False]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert abs(float(U.causal_lm_loss(par, shard, single) - want)) > 1e-4  # the repeated row's router tokens


def test_router_logits_of_a_model_without_load_balancing_loss_change_nothing():
    """DeepSeek-V3 collects router logits but adds no load-balancing loss: nothing to add, nothing refused."""
    from ulysses_sp.moe import router_aux_loss

    model = build("deepseek_v3_mla")
    model.config.output_router_logits = True
    assert router_aux_loss(model) is None
    U.parallelize(model, U.ParallelLayout.single())


def test_learned_positions_are_the_table_of_learned_position_models_only():
    """GPT-2 / OPT hold a table of positions (a longer sequence indexes past it); RoPE models compute theirs."""
    from transformers import GPT2Config, LlamaConfig, OPTConfig

    from ulysses_sp.hf import learned_positions

    assert learned_positions(GPT2Config(n_positions=128)) == 128
    assert learned_positions(OPTConfig(max_position_embeddings=512)) == 512
    assert learned_positions(LlamaConfig(max_position_embeddings=2048)) is None
