"""Head-chunked attention in one process: refusals before any step, the automatic choice, and sp=1 exactness.

The multi-rank exactness proof (sp=2, sp=4, dp x sp, Ulysses x ring, DDP, FSDP2) is
tests/dist/test_head_chunks_parity.py.
"""

import copy

import pytest
import torch

import ulysses_sp as U
from tests.helpers.models import build, loss_and_grads, make_batch
from tests.helpers.parity import assert_loss_and_grads
from ulysses_sp.head_chunks import HeadChunkedAttention
from ulysses_sp.head_split import chunk_exchange_bytes, head_chunk_choices
from ulysses_sp.instance_forward import installed_forward
from ulysses_sp.plan.attention import choose_head_chunks


def _chunked(model) -> list[HeadChunkedAttention]:
    return [installed_forward(m) for m in model.modules() if isinstance(installed_forward(m), HeadChunkedAttention)]


@pytest.mark.parametrize(("arch", "kv_heads", "chunks"), [("qwen3", 2, 4), ("deepseek_v3_mla_v4", None, 2)])
def test_sp1_chunks_match_plain_model(arch, kv_heads, chunks):
    batch = make_batch(2, 20, packed=(8, 12))
    model = build(arch, kv_heads=kv_heads)
    ref = model(**batch, use_cache=False).loss
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    keys = set(model.state_dict())
    layout = U.ParallelLayout.single()
    U.parallelize(model, layout, head_chunks=chunks)
    installed = _chunked(model)
    assert len(installed) == model.config.num_hidden_layers
    assert set(model.state_dict()) == keys  # the module tree is unchanged
    loss, grads = loss_and_grads(model, batch, layout)
    assert all(h.verified for h in installed)  # the probe ran and passed: the chunked path was taken
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6, msg=name)
    U.unparallelize(model)
    assert not _chunked(model)


@pytest.mark.parametrize("autocast", [False, True])
def test_backward_runs_the_input_projections_by_hand(monkeypatch, autocast):
    """Backward cuts autograd at the q/k/v projections of the block's input (ProjectionCut): each chunk's three
    taps deliver their gradients, which are added in place into the sums, and the result is still the plain
    model's (fp32; under bf16 autocast, to bf16's precision)."""
    from ulysses_sp.head_chunk_grads import ProjectionCut

    delivered = []
    deliver = ProjectionCut.deliver
    monkeypatch.setattr(
        ProjectionCut, "deliver", lambda self, name, grad: (delivered.append(name), deliver(self, name, grad))
    )
    batch = make_batch(2, 24, packed=(10, 14))
    model = build("llama", kv_heads=2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref, want = loss_and_grads(copy.deepcopy(model), batch)
        layout = U.ParallelLayout.single()
        U.parallelize(model, layout, head_chunks=2)
        loss, grads = loss_and_grads(model, batch, layout)
    layers = model.config.num_hidden_layers
    assert sorted(delivered) == sorted(["q_proj", "k_proj", "v_proj"] * 2 * layers)
    tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref, **tol)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], **tol, msg=name)


def test_unsplittable_module_refused_at_parallelize():
    """OPT's attention has out_proj, not o_proj: head_chunks > 1 is refused before any forward, naming o_proj (the
    message said 'no q_proj/k_proj/v_proj/o_proj' while listing its q_proj, k_proj and v_proj)."""
    with pytest.raises(
        ValueError, match=r"OPTAttention cannot run its heads in chunks: it has no o_proj child.*head_chunks=1"
    ):
        U.parallelize(build("opt"), U.ParallelLayout.single(), head_chunks=2)
    model = U.parallelize(build("opt"), U.ParallelLayout.single())  # automatic: unchunked, accepted
    assert not _chunked(model)


def test_probe_refuses_before_any_step_and_automatic_falls_back():
    """AFMoE gates each head's output (gate_proj), which the chunks would skip: its structure passes, the first
    forward's probe finds the difference and raises before any gradient exists; with automatic C the same model
    keeps its own (exact) path."""
    model = U.parallelize(build("afmoe", kv_heads=2), U.ParallelLayout.single(), head_chunks=2)
    with pytest.raises(ValueError, match=r"AfmoeAttention cannot run its heads in chunks: its own forward and the"):
        loss_and_grads(model, make_batch(1, 12), U.ParallelLayout.single())
    assert all(p.grad is None for p in model.parameters())
    plain = build("afmoe", kv_heads=2)
    auto = U.parallelize(copy.deepcopy(plain), U.ParallelLayout.single(), head_chunk_budget_bytes=1)
    installed = _chunked(auto)
    assert installed and all(h.requested is None for h in installed)
    batch = make_batch(1, 12)
    loss, _ = loss_and_grads(auto, batch, U.ParallelLayout.single())
    assert all(h.verified is False for h in installed)
    torch.testing.assert_close(loss, plain(**batch, use_cache=False).loss.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first", ["eval", "train"])
def test_dropout_outside_the_core_is_refused_whatever_mode_the_first_call_runs_in(first):
    """Seed-OSS drops its attention output after o_proj (residual_dropout) while training, which the chunks would
    leave out. Probed in eval mode (an evaluation first) it passed and then trained without that dropout; probed
    while training it was refused as "projections do not split by heads". The probe now runs the module in
    training mode and its forward under two seeds: refused by name either way, the model's modes left as they were."""
    from tests.helpers.models import build_generic

    model = build_generic("seed_oss", residual_dropout=0.1, attention_dropout=0.0)
    model = U.parallelize(model, U.ParallelLayout.single(), head_chunks=2)
    model.train(first == "train")
    state = torch.random.get_rng_state()
    refused = r"SeedOssAttention cannot run its heads in chunks: its forward draws random"
    with pytest.raises(ValueError, match=refused), torch.no_grad():
        model(**make_batch(1, 12), use_cache=False)
    assert all(m.training == (first == "train") for m in model.modules())
    assert torch.equal(torch.random.get_rng_state(), state)  # the probe's forwards drew from their own generator
    fine = U.parallelize(build_generic("seed_oss", residual_dropout=0.0), U.ParallelLayout.single(), head_chunks=2)
    fine.eval()
    with torch.no_grad():
        fine(**make_batch(1, 12), use_cache=False)
    assert all(h.verified for h in _chunked(fine)) and not any(m.training for m in fine.modules())


@pytest.mark.parametrize("bad", [3, -1, True, 2.0, "2"])
def test_bad_chunk_count_names_the_choices(bad):
    with pytest.raises(ValueError, match=rf"head_chunks.*{bad!r}" if bad != -1 else r"head_chunks must be"):
        U.parallelize(build("llama", heads=4, kv_heads=2), U.ParallelLayout.single(), head_chunks=bad)


def test_choices_and_automatic_choice():
    assert head_chunk_choices(8, 2, 2) == [1, 2, 4]  # 8 chunks of 1 head would not split over 2 ranks
    assert head_chunk_choices(16, 2, 4) == [1, 2, 4]
    assert head_chunk_choices(4, 4, 4) == [1]
    kw = dict(tokens=16384, head_dim=64, element_size=4, hidden=1024, ring=1, device="cuda")
    # q/k/v after the exchange of the chunks alive (min(C, 2)), x 16384 x 64 x 4 bytes: 16 heads, 4 kv heads over
    # 2 ranks: C=1 (8 + 2 x 2) rows, C=2 2 x (4 + 2 x 1); C=4 and C=8 share the kv heads (one per chunk < 2
    # ranks): 2 x 2 and 2 x 1 query rows, the 2 x 2 kv rows once and their fp32 gradient sum (2 x 2 more)
    row = 16384 * 64 * 4
    assert head_chunk_choices(16, 4, 2) == [1, 2, 4, 8]
    sizes = {c: chunk_exchange_bytes(16, 4, 2, c, tokens=16384, head_dim=64, element_size=4) for c in (1, 2, 4, 8)}
    assert sizes == {1: 12 * row, 2: 12 * row, 4: 12 * row, 8: 10 * row}
    assert choose_head_chunks(16, 4, 2, budget_bytes=12 * row, **kw) == 1
    assert choose_head_chunks(16, 4, 2, budget_bytes=12 * row - 1, **kw) == 8
    # none fits: the C of the planner's lowest attention peak (ulysses_sp.plan.attention.attention_peak)
    assert choose_head_chunks(16, 4, 2, budget_bytes=1, **kw) == 8
    # Llama-3.1-8B's heads at sp=8 (32 on 8 kv: one kv head a rank, shared by C = 2 and 4) at 8M tokens: C = 4
    big = dict(tokens=1 << 23, head_dim=128, element_size=2, hidden=4096, ring=1, device="cuda")
    assert choose_head_chunks(32, 8, 8, **big) == 4
    assert choose_head_chunks(32, 8, 8, **{**big, "tokens": 1 << 19}) == 1  # C = 1 fits the default budget
    # bf16: 4 query rows and 4 kv rows of 2 bytes, the kv heads' gradient sum 4 rows of 4 bytes
    bf16 = chunk_exchange_bytes(16, 4, 2, 4, tokens=16384, head_dim=64, element_size=2)
    assert bf16 == (4 * 2 + 4 * 2 + 4 * 4) * 16384 * 64
    assert choose_head_chunks(16, 4, 2, budget_bytes=1, requested=2, **kw) == 2


def test_automatic_choice_where_none_fits_is_computed_once_per_shape():
    """Every attention layer asks for C on every call; where no C fits, the planner's terms of every C took 56-82 us a
    call (71 us for Llama-3.1-8B's heads at sp=8, 2M tokens): they are computed once per shape (8 us a call now)."""
    from ulysses_sp.plan.attention import _lowest_peak_chunks

    kw = dict(tokens=1 << 21, head_dim=128, element_size=2, hidden=4096, ring=1, device="cuda")
    _lowest_peak_chunks.cache_clear()
    assert [choose_head_chunks(32, 8, 8, **kw) for _ in range(3)] == [4] * 3
    assert choose_head_chunks(32, 8, 8, **{**kw, "tokens": 1 << 22}) == 4
    assert _lowest_peak_chunks.cache_info()[:2] == (2, 2)  # (hits, misses): one per shape


# (hidden, heads, kv heads, ulysses, ring, tokens, features) where no C fits the budget, and the planned peaks of the C
# the rule took when it compared the q/k/v with their gradients, or (features) when its attention peak assumed a
# checkpointed layer, tiled norms and no layer gradients, and of the lowest (Llama-3.1-8B's heads: 32 of 128 on 8 kv)
_NO_CHECKPOINTS = {"activation_checkpointing": "none"}
_OVER_BUDGET = [
    (2048, 16, 8, 4, 1, 1 << 21, {}),  # C = 1 25.1 GiB, C = 4 21.7
    (4096, 32, 8, 2, 4, 1 << 23, {}),  # Llama-3.1-8B's heads, ulysses 2 x ring 4: C = 4 70.5 GiB, C = 16 63.9
    (4096, 32, 8, 2, 16, 1 << 25, {}),  # ulysses 2 x ring 16: C = 4 65.0 GiB, C = 16 58.3
    (1024, 8, 4, 2, 2, 1 << 23, {}),  # C = 1 68.5 GiB, C = 4 49.4
    (2048, 16, 16, 8, 2, 1 << 21, {}),  # C = 1 14.9 GiB, C = 2 12.9
    (4096, 32, 8, 8, 1, 1 << 23, {}),  # Llama-3.1-8B's heads at sp=8 (issue 18): C = 4 64.9 GiB (C = 1 82.4), as before
    # without checkpointing every layer keeps what its attention saved: the unchunked ring block its q/k/v and output,
    # the chunked one nothing but its input: C = 1 214.7 GiB, C = 2 104.2 (16 layers)
    (1024, 8, 1, 4, 2, 1 << 23, _NO_CHECKPOINTS),
    (2048, 16, 8, 8, 4, 1 << 23, _NO_CHECKPOINTS),  # C = 1 109.0 GiB, C = 2 54.7
    (3072, 24, 4, 4, 1, 1 << 21, {"tiled_norms": False}),  # the MLP's backward beside C = 1's saved: 53.8 / 48.7 GiB
    (3072, 24, 8, 4, 2, 1 << 21, {"dtype": "fp32"}),  # FSDP2's layer gradients in backward: C = 1 39.7 GiB, C = 2 39.2
]


@pytest.mark.parametrize(("hidden", "heads", "kv_heads", "ulysses", "ring", "seq_len", "features"), _OVER_BUDGET)
def test_automatic_chunks_are_the_planners_lowest_peak_where_none_fits_the_budget(
    hidden, heads, kv_heads, ulysses, ring, seq_len, features
):
    """Where no C's q/k/v fit the budget, automatic C is the one whose planned per-rank peak is lowest (ties within
    0.5%: the fewest chunks): the plan of each allowed C (bf16 on CUDA, 16 layers; the default features but
    ``features``) against the plan of automatic C, which is the runtime's choose_head_chunks for the same tokens and
    the same layer (benchmarks/chunk_choice_sweep.py over a grid of shapes and feature sets)."""
    from ulysses_sp.plan import Features, ModelShape, plan_memory
    from ulysses_sp.plan.memory import planned_layer

    shape = ModelShape(
        hidden_size=hidden, num_layers=16, num_heads=heads, num_kv_heads=kv_heads, head_dim=128,
        intermediate_size=4 * hidden, vocab_size=32000, tie_word_embeddings=False,
    )  # fmt: skip
    args = dict(seq_len=seq_len, sp=ulysses * ring, ring=ring)
    peaks = {
        c: plan_memory(shape, **args, features=Features(**features, head_chunks=c)).peak_bytes
        for c in head_chunk_choices(heads, kv_heads, ulysses)
    }
    auto = plan_memory(shape, **args, features=Features(**features))
    tokens = auto.tokens_per_rank * ulysses
    element_size, layer = planned_layer(shape, auto.features)  # as the run time reads it (the test below)
    sizes = dict(tokens=tokens, head_dim=128, element_size=element_size)
    assert min(chunk_exchange_bytes(heads, kv_heads, ulysses, c, **sizes) for c in peaks) > 1 << 30  # none fits
    runtime = choose_head_chunks(
        heads, kv_heads, ulysses, **sizes, hidden=hidden, ring=ring, device="cuda", layer=layer
    )
    assert auto.head_chunks == runtime
    assert peaks[runtime] <= min(peaks.values()) * 1.005, (runtime, peaks)


@pytest.mark.parametrize("compiled", [False, True])
def test_runtime_chunks_are_the_planners_with_checkpointing_on_and_off(monkeypatch, compiled):
    """The attention reads its decoder layer at each call (ulysses_sp.head_chunk_choice): where no C fits the budget
    it takes the planner's C for the same settings, checkpointing switched on after parallelize and off again (4
    heads on 1 kv head, head dim 16, 2 layers, 4,194,304 tokens at sp=1, fp32 on the CPU: C = 1 checkpointed, C = 4
    not; before, the run time took C = 1 without checkpointing too, where the plan holds 2 layers' saved q/k/v).
    A step of a few tokens with a 1-byte budget (the same branch) then runs in each mode, switched back and forth,
    its decoder layers compiled or not: the chunked path runs with C = 4 in both layers without checkpointing and not
    at all with it (C = 1; seen from inside the compiled layer), and the loss and gradients match the model's own."""
    from ulysses_sp.features import Features, apply_features
    from ulysses_sp.head_chunk_choice import layer_memory
    from ulysses_sp.offload import disable_activation_checkpointing, enable_activation_checkpointing
    from ulysses_sp.plan import ModelShape, plan_memory
    from ulysses_sp.plan.memory import planned_layer

    plain = build("llama", heads=4, kv_heads=1, head_dim=16)
    seq_len, layout = 1 << 22, U.ParallelLayout.single()
    model = U.parallelize(copy.deepcopy(plain), layout)
    apply_features(model, Features(tiled_loss=False), "cpu")  # tiled MLP and norms, checkpoints kept (CPU)
    installed = _chunked(model)
    x = torch.zeros(1, 1, plain.config.hidden_size).expand(
        1, seq_len, -1
    )  # (a view: only its shape and dtype are read)

    def planned(mode: str) -> int:
        """The planner's C for checkpointing ``mode``, after checking that the layer each attention reads at run time
        is the planner's (plan.memory.planned_layer) for the same settings."""
        features = Features(activation_checkpointing=mode, parallel="ddp", tiled_loss=False)
        _, layer = planned_layer(ModelShape.from_config(plain.config), features.resolve("cpu"))
        assert [layer_memory(h.layer, h.layers, h.projection("q_proj")) for h in installed] == [layer] * 2
        return plan_memory(plain.config, seq_len=seq_len, sp=1, features=features, device="cpu").head_chunks

    model.train()
    assert [h.chunks_for(x) for h in installed] == [planned("checkpoint")] * 2 == [1, 1]
    disable_activation_checkpointing(model)
    assert [h.chunks_for(x) for h in installed] == [planned("none")] * 2 == [4, 4]
    with torch.no_grad():  # the layer as it is, whatever the grad mode (a forward and its recompute agree)
        assert [h.chunks_for(x) for h in installed] == [4, 4]
    enable_activation_checkpointing(model, "checkpoint")
    assert [h.chunks_for(x) for h in installed] == [1, 1]

    batch = make_batch(2, 24, packed=(10, 14))
    ref_loss, ref_grads = loss_and_grads(plain, batch)
    for h in installed:
        h.budget_bytes = 1
    if compiled:
        for layer in model.model.layers:
            layer.compile(backend="eager")
    calls, chunked = [], HeadChunkedAttention.chunked

    @torch.compiler.disable
    def spy(self, x, chunks, args, kwargs):
        calls.append((chunks, torch.is_grad_enabled()))
        return chunked(self, x, chunks, args, kwargs)

    monkeypatch.setattr(HeadChunkedAttention, "chunked", spy)
    for step, mode in enumerate(("checkpoint", "none", "checkpoint", "none")):
        if mode == "none":
            disable_activation_checkpointing(model)
        elif step:
            enable_activation_checkpointing(model, "checkpoint")
        calls.clear()
        model.zero_grad()
        loss, grads = loss_and_grads(model, batch, layout)
        assert calls == ([] if mode == "checkpoint" else [(4, True)] * 2), (step, calls)
        assert_loss_and_grads(loss, grads, ref_loss, ref_grads, label=f"step {step} ({mode}): ")


def _spied_chunks(monkeypatch) -> list[tuple[int, bool]]:
    """(C, grad enabled) of every call of HeadChunkedAttention.chunks_for from now on."""
    calls, chunks_for = [], HeadChunkedAttention.chunks_for

    def spy(self, x):
        calls.append((chunks_for(self, x), torch.is_grad_enabled()))
        return calls[-1][0]

    monkeypatch.setattr(HeadChunkedAttention, "chunks_for", spy)
    return calls


@pytest.mark.parametrize("when", ["after", "before"])
@pytest.mark.parametrize("impl", ["reentrant", "non_reentrant"])
def test_torch_checkpoint_wrapper_counts_as_checkpointed(monkeypatch, impl, when):
    """A decoder layer inside PyTorch's checkpoint_wrapper (what accelerate's FSDP activation checkpointing and
    torchtitan-style setups put around it), applied ``when`` parallelize, takes the checkpointed C in every call (4
    heads on 1 kv head, 24 tokens, a 1-byte budget: C = 1 checkpointed, 4 not). Before, the reentrant wrapper's
    forward (no graph) took C = 1 and its recompute C = 4, the non-reentrant one C = 4 (not checkpointed) in all four
    calls. The step matches the model's own; with attention dropout (0.5) the gradients equal those of this library's
    checkpointing under the same seed (before, the reentrant wrapper's were up to 0.14 apart: its recompute drew the
    masks of another C than the forward whose loss they are the gradients of)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from ulysses_sp.features import Features, apply_features

    layout, batch = U.ParallelLayout.single(), make_batch(2, 24, packed=(10, 14))
    checkpoint = CheckpointImpl.REENTRANT if impl == "reentrant" else CheckpointImpl.NO_REENTRANT

    def step(plain, mode: str) -> tuple[torch.Tensor, dict]:
        """One step of ``plain`` parallelized, checkpointed by ``mode``: "wrapper", "checkpoint" (this library's) or
        "none"; the gradients named as in ``plain``."""
        model, wrapped = copy.deepcopy(plain), mode == "wrapper"
        layers = model.model.layers
        for i in range(len(layers) if wrapped and when == "before" else 0):
            layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=checkpoint)
        model = U.parallelize(model, layout)
        apply_features(model, Features(tiled_loss=False, activation_checkpointing="none" if wrapped else mode), "cpu")
        for i in range(len(layers) if wrapped and when == "after" else 0):
            layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=checkpoint)
        for h in _chunked(model):
            h.budget_bytes = 1
        torch.manual_seed(5)
        loss, grads = loss_and_grads(model.train(), batch, layout)
        return loss, {name.replace("._checkpoint_wrapped_module", ""): g for name, g in grads.items()}

    calls = _spied_chunks(monkeypatch)
    plain = build("llama", heads=4, kv_heads=1, head_dim=16)
    step(plain, "none")
    assert calls == [(4, True)] * 2, calls  # unwrapped, not checkpointed
    calls.clear()
    loss, grads = step(plain, "wrapper")
    assert calls == [(1, impl == "non_reentrant")] * 2 + [(1, True)] * 2, calls  # forward, recompute
    ref_loss, ref_grads = loss_and_grads(plain, batch)
    assert_loss_and_grads(loss, grads, ref_loss, ref_grads)

    for layer in plain.model.layers:
        layer.self_attn.attention_dropout = 0.5
    assert_loss_and_grads(*step(plain, "wrapper"), *step(plain, "checkpoint"))


def test_a_hand_written_reentrant_checkpoint_takes_one_c_in_forward_and_recompute(monkeypatch):
    """A reentrant checkpoint the choice cannot see (torch.utils.checkpoint called by a module of the user's around
    each decoder layer, neither transformers' flag nor PyTorch's wrapper) runs the layer's forward without a graph and
    its recompute with one: both take the same C (4: read as not checkpointed), since the choice reads the modules,
    never grad mode. Before, the forward took C = 1 (no graph: "as checkpointed") and the recompute C = 4, and with
    attention dropout the gradients were not those of the loss (4 heads on 1 kv head, 24 tokens, a 1-byte budget)."""
    from torch.utils.checkpoint import checkpoint

    from ulysses_sp.features import Features, apply_features

    class Reentrant(torch.nn.Module):
        def __init__(self, layer: torch.nn.Module) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, hidden_states, *args, **kwargs):
            return checkpoint(lambda h: self.layer(h, *args, **kwargs), hidden_states, use_reentrant=True)

    layout, batch = U.ParallelLayout.single(), make_batch(2, 24, packed=(10, 14))
    plain = build("llama", heads=4, kv_heads=1, head_dim=16)
    for layer in plain.model.layers:
        layer.self_attn.attention_dropout = 0.5

    def step(wrapped: bool) -> tuple[torch.Tensor, dict]:
        model = U.parallelize(copy.deepcopy(plain), layout)
        apply_features(model, Features(tiled_loss=False, activation_checkpointing="none"), "cpu")
        for h in _chunked(model):
            h.budget_bytes = 1
        layers = model.model.layers
        for i in range(len(layers) if wrapped else 0):
            layers[i] = Reentrant(layers[i])
        torch.manual_seed(5)
        loss, grads = loss_and_grads(model.train(), batch, layout)
        return loss, {name.replace(".layer.", "."): g for name, g in grads.items()}

    calls = _spied_chunks(monkeypatch)
    ref = step(False)
    assert calls == [(4, True)] * 2, calls
    calls.clear()
    got = step(True)
    assert calls == [(4, False)] * 2 + [(4, True)] * 2, calls  # forward (no graph), recompute
    assert_loss_and_grads(*got, *ref)


def test_chunks_count_the_layers_whose_attention_runs_in_chunks():
    """The attention's count of decoder layers (the other layers' saved tensors where nothing is checkpointed) is the
    count of layers holding a chunked attention, as the planner's (its text layers): not every module of a class in
    ``_no_split_modules`` (Qwen2-VL adds its vision blocks; here the 5 RMSNorms of a 2-layer Llama stand in, which
    made it 7)."""
    model = build("llama", heads=4, kv_heads=1, head_dim=16)
    model._no_split_modules = [*model._no_split_modules, "LlamaRMSNorm"]
    installed = _chunked(U.parallelize(model, U.ParallelLayout.single()))
    assert [h.layers for h in installed] == [2, 2]
    assert [h.layer.layer for h in installed] == list(model.model.layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", ["dense", "packed_padded"])
@pytest.mark.parametrize("blocks", ["whole", "blocks", "blocks_from_sums"])
def test_chunk_kernel_matches_the_eager_core_and_its_autograd(monkeypatch, dtype, rows, blocks):
    """ulysses_sp.chunk_core against the reference core: the kernel's output and its fused backward from the saved
    output and lse equal the eager core's output and autograd gradients (GQA, a value width below the padded one,
    packed documents and padding with one kernel call per document). ``blocks``: the backward in blocks of queries
    and keys (4 rows at least: the 24 dense rows in 4 blocks, 10 calls; the documents of 10 and 14 in 2 and 3,
    3 + 6 calls a row), from the output or from its row sums with the gradient (a stand-in output per block), the
    k/v gradients summed here or handed to ``add_kv`` block by block."""
    from ulysses_sp import chunk_core
    from ulysses_sp.chunk_core import chunk_kernel, kernel_backward, kernel_forward, output_row_sums
    from ulysses_sp.cores import AttentionCall, Segments, eager_core

    torch.manual_seed(0)
    b, heads, kv_heads, n, width, d_v = 2, 4, 2, 24, 8, 6
    q, k, v = (torch.randn(b, h, n, width, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    v[..., d_v:] = 0  # MLA: v padded with zeros to the q/k width
    if rows == "dense":
        segments = Segments.from_positions(torch.arange(n).expand(b, n))
    else:
        positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(b, n)
        mask = torch.ones(b, n, dtype=torch.long)
        mask[1, 20:] = 0  # right padding in row 1
        segments = Segments.from_positions(positions, mask)
    call = AttentionCall(segments, None, 0.3, None, 0.0, d_v, width)
    kernel = chunk_kernel(call, q, ring=1, core_name="sdpa")
    assert kernel is not None and kernel.name == "cpu_flash"
    for refused in (dict(ring=2, core_name="sdpa"), dict(ring=1, core_name="eager")):
        assert chunk_kernel(call, q, **refused) is None
    out, lse = kernel_forward(kernel, q, k, v, call)  # [b, N, h, d_v]

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = eager_core(*leaves, segments, scaling=0.3)[..., :d_v]
    tol = dict(rtol=1e-5, atol=1e-6)  # the eager core takes its softmax in fp32, also for fp64 inputs
    torch.testing.assert_close(out, ref.detach(), **tol)
    grad = torch.randn_like(ref)
    torch.autograd.backward(ref, grad)
    if blocks != "whole":
        monkeypatch.setattr(chunk_core, "MIN_BLOCK_ROWS", 4)
    calls = []
    backward = kernel.backward
    monkeypatch.setattr(kernel, "backward", lambda *a, **kw: calls.append(kw["causal"]) or backward(*a, **kw))
    if blocks == "blocks_from_sums":
        kv_sums = [torch.zeros_like(k), torch.zeros_like(v)]

        def add_kv(piece, dk, dv):
            kv_sums[0][piece] += dk
            kv_sums[1][piece] += dv

        dq, dk, dv = kernel_backward(
            kernel, grad, q, k, v, None, lse, call, row_sums=output_row_sums(grad, out), add_kv=add_kv
        )
        assert dk is None and dv is None
        grads = (dq, *kv_sums)
    else:
        grads = kernel_backward(kernel, grad, q, k, v, out, lse, call)
    for got, leaf in zip(grads, leaves, strict=True):
        assert got.shape == leaf.shape and got.dtype == dtype
        torch.testing.assert_close(got, leaf.grad, **tol)
    # kernel calls: whole, one (dense) or one a document (2 + 2); in blocks, the causal triangle of each document's
    # blocks (dense 24 rows: 4 blocks; documents of 10, 14 / 10, 10 (padding after): 2, 3 / 2, 2 blocks)
    want = {"dense": 1, "packed_padded": 4} if blocks == "whole" else {"dense": 10, "packed_padded": 3 + 6 + 3 + 3}
    assert len(calls) == want[rows] and calls.count(True) == (
        len(calls) if blocks == "whole" else {"dense": 4}.get(rows, 9)
    )


def test_out_pack_send_is_out_local_grads_side_by_side():
    from ulysses_sp.comm import out_local_grad, out_pack_send, out_send_grad

    first, second = torch.randn(2, 5, 8, 3), torch.randn(2, 5, 8, 1)  # [b, n, P h, d_i], P = 4
    packed = out_pack_send(4, first, second).tensor()
    torch.testing.assert_close(packed, torch.cat([out_local_grad(first, 4), out_local_grad(second, 4)], dim=-1))
    a, b = out_send_grad(packed).split((3, 1), dim=-1)
    torch.testing.assert_close(a, out_send_grad(out_local_grad(first, 4)))
    torch.testing.assert_close(b, out_send_grad(out_local_grad(second, 4)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stand_in_output_gives_the_kernel_backward_the_true_outputs_gradients(dtype):
    """The fused backward sends the output's row sums with its gradient instead of the output: the kernel's
    backward from the stand-in output equals the one from the true output (fp32: to rounding; 16-bit: within the
    kernel's own rounding), rows with a zero gradient included, and the stand-in is no larger than the output."""
    from ulysses_sp.chunk_core import output_row_sums, stand_in_output
    from ulysses_sp.ring_kernels import get_ring_kernel

    torch.manual_seed(0)
    kernel = get_ring_kernel("cpu_flash")
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.25)
    grad = torch.randn_like(out)
    grad[:, :, 5] = 0  # a row with no gradient (padding)
    sums = output_row_sums(grad.to(dtype), out.to(dtype))
    stand_in = stand_in_output(grad.to(dtype), sums)
    assert stand_in.dtype == dtype and torch.isfinite(stand_in).all() and not stand_in[:, :, 5].any()
    assert (stand_in.float().norm(dim=-1) <= out.norm(dim=-1) * 1.01 + 1e-6).all()
    expected = kernel.backward(grad, q, k, v, out, lse, causal=True, scale=0.25)
    found = kernel.backward(grad, q, k, v, stand_in.float(), lse, causal=True, scale=0.25)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
    for e, f in zip(expected, found, strict=True):
        torch.testing.assert_close(f, e, **tol)


def test_projected_qkv_freed_once_sent_and_frozen_projections(monkeypatch):
    """Backward keeps a chunk's projected q/k/v only until their exchange has copied them (Roots holds gradient
    edges, not the tensors): none is alive when any chunk's kernel backward runs. Frozen k/v projections of an
    input that needs no gradient (layer 0 under frozen embeddings) have no edge; q's gradient still flows, exact."""
    import weakref

    from ulysses_sp import head_chunk_grads, head_chunk_pipeline

    projected, alive_at_kernel = [], []
    roots_init = head_chunk_grads.Roots.__init__

    def record(self, q, k, v, **kwargs):
        projected.extend(weakref.ref(t) for t in (q, k, v))
        roots_init(self, q, k, v, **kwargs)

    kernel_backward = head_chunk_pipeline.kernel_backward

    def check(*args, **kwargs):
        alive_at_kernel.append(sum(ref() is not None for ref in projected))
        return kernel_backward(*args, **kwargs)

    monkeypatch.setattr(head_chunk_grads.Roots, "__init__", record)
    monkeypatch.setattr(head_chunk_pipeline, "kernel_backward", check)
    batch = make_batch(2, 24, packed=(10, 14))
    model = build("llama", kv_heads=2)
    frozen = ["model.embed_tokens.weight"] + [
        f"model.layers.{i}.self_attn.{p}.weight"
        for i in range(model.config.num_hidden_layers)
        for p in ("k_proj", "v_proj")
    ]
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    ref, want = loss_and_grads(copy.deepcopy(model), batch)
    layout = U.ParallelLayout.single()
    U.parallelize(model, layout, head_chunks=2)
    loss, grads = loss_and_grads(model, batch, layout)
    assert projected and alive_at_kernel and set(alive_at_kernel) == {0}
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        if want[name] is None:
            assert grad is None, name
        else:
            torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("arch", "remade", "autocast"),
    [("llama", True, False), ("qwen3", True, True), ("deepseek_v3_mla_v4", False, False)],
)
def test_tiled_norm_output_remade_by_tiles_not_kept(monkeypatch, arch, remade, autocast):
    """With tiled norms the chunked block keeps the input norm's input, not its output, from forward to backward:
    no layer's norm output is alive once the forward has returned, and backward remakes it tile by tile for each
    projection and weight gradient. MLA projects its input through q_a_proj / kv_a_proj_with_mqa too, which the
    probe finds: it keeps its input as before. Loss and gradients are the plain model's either way."""
    import weakref

    from ulysses_sp import head_chunk_pipeline
    from ulysses_sp.deferred_input import NormRemake

    inputs, tiles = [], []
    forward, remake_tiles = head_chunk_pipeline.ChunkRun.forward, NormRemake.tiles

    def record(self, x, save=False):
        if save:
            inputs.append(weakref.ref(x))
        return forward(self, x, save)

    def count(self, source):
        tiles.append(source.shape)
        yield from remake_tiles(self, source)

    monkeypatch.setattr(head_chunk_pipeline.ChunkRun, "forward", record)
    monkeypatch.setattr(NormRemake, "tiles", count)
    batch = make_batch(2, 20, packed=(8, 12))
    model = build(arch, kv_heads=2 if arch != "deepseek_v3_mla_v4" else None)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref = model(**batch, use_cache=False).loss
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    layout = U.ParallelLayout.single()
    U.parallelize(model, layout, head_chunks=2)
    U.enable_tiled_norms(model, chunk_tokens=6)  # 20 tokens: tiles of 6, 6, 6 and 2
    shard = U.shard_batch(batch, layout)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        loss = U.sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout)
    assert len(inputs) == model.config.num_hidden_layers
    assert all(h.remakeable is remade for h in _chunked(model))
    assert [ref() is None for ref in inputs] == [remade] * len(inputs)  # norm outputs freed, or kept by the block
    loss.backward()
    assert any(shape[-2] == 20 for shape in tiles) is remade  # (the probe's tiles are its 6 tokens')
    tol = {"rtol": 2e-2, "atol": 2e-3} if autocast else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(loss.detach(), ref.detach(), **tol)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], **tol, msg=name)


def test_absent_reads_metadata_and_refuses_data():
    from ulysses_sp.deferred_input import Absent, InputTouched

    x = Absent(torch.Size([2, 5, 8]), torch.bfloat16, torch.device("cpu"))
    assert x.shape[:-1] == (2, 5) and x.size(-1) == 8 and x.dim() == 3 and x.dtype == torch.bfloat16
    assert x.device.type == "cpu" and not x.requires_grad and "Absent" in repr(x)
    for use in (lambda: x + 1, lambda: torch.nn.functional.linear(x, torch.ones(3, 8)), lambda: x.view(10, 8)):
        with pytest.raises(InputTouched, match="data of the block's input"):
            use()


def test_backward_frees_the_saved_outputs_first_and_makes_the_input_sum_late(monkeypatch):
    """Checkpointed layers: backward reads each chunk's saved core output once (o_proj's weight gradient and the row
    sums that travel with the output's gradient) and frees it before any chunk's kernel backward runs; the input's
    gradient sum is made only once the projections' output gradients waiting for it would outgrow it, so some
    kernel backward runs with gradients waiting and no sum. Exact either way."""
    import weakref

    from ulysses_sp import head_chunk_grads, head_chunk_pipeline

    saved, accumulators, seen = [], [], []
    forward, acc_init = head_chunk_pipeline.ChunkRun.forward, head_chunk_grads.Accumulators.__init__
    kernel_backward = head_chunk_pipeline.kernel_backward

    def record(self, x, save=False):
        out = forward(self, x, save)
        if save:
            saved.extend(weakref.ref(t) for t in self.local if t is not None)
        return out

    def track(self, *args, **kwargs):
        acc_init(self, *args, **kwargs)
        accumulators.append(self)

    def check(*args, **kwargs):
        acc = accumulators[-1]
        seen.append((sum(ref() is not None for ref in saved), acc._x is None, acc.waiting_bytes))
        return kernel_backward(*args, **kwargs)

    monkeypatch.setattr(head_chunk_pipeline.ChunkRun, "forward", record)
    monkeypatch.setattr(head_chunk_grads.Accumulators, "__init__", track)
    monkeypatch.setattr(head_chunk_pipeline, "kernel_backward", check)
    rows, tokens = 2, 24
    batch = make_batch(rows, tokens, packed=(10, 14))
    model = build("llama", kv_heads=2, heads=8)
    ref, want = loss_and_grads(copy.deepcopy(model), batch)
    layout = U.ParallelLayout.single()
    U.parallelize(model, layout, head_chunks=4)
    U.enable_activation_checkpointing(model, "checkpoint")
    loss, grads = loss_and_grads(model, batch, layout)
    layers = model.config.num_hidden_layers
    assert len(saved) == 2 * 4 * layers and len(seen) == 4 * layers  # forward and recompute save 4 each
    assert all(alive == 0 for alive, _, _ in seen), seen
    sum_bytes = rows * tokens * model.config.hidden_size * 4  # the input's gradient sum (fp32)
    assert all(waiting < sum_bytes for _, late, waiting in seen if late), seen
    assert any(late and waiting > 0 for _, late, waiting in seen), seen
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_blank_projection_holds_no_memory():
    """A projection a stage does not compute (a chunk's k/v where the chunks share the kv heads) is one zero expanded:
    ``[t, 2 d]`` of zeros were live at the recompute's peak (0.25 [t, h] at 8 heads of 64 / 2 kv heads, C=4)."""
    from ulysses_sp.head_chunk_parts import Blank

    weight = torch.randn(64, 32)
    zeros = Blank(64)(torch.empty(2, 1000, 32), weight)
    assert zeros.shape == (2, 1000, 64) and zeros.dtype == weight.dtype and not zeros.any()
    assert zeros.untyped_storage().nbytes() == weight.element_size()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert Blank(64)(torch.empty(3, 32), weight).dtype == torch.bfloat16


def test_blocked_kernel_backward_lowers_the_attention_backward_peak(monkeypatch):
    """The chunks' kernel backward in blocks of queries and keys (chunk_core.kernel_backward) holds a block's
    stand-in output and gradients, not the chunk's: in a checkpointed layer (benchmarks/layer_peak.py, hidden 512,
    8 heads / 2 kv, 8K tokens on rank 0 of sp=2, C=4) the attention's backward peaks at least 0.2 [t, h] lower
    (4.90 -> 4.67 measured; 4.71 -> 4.47 at 16K tokens, where the layer's peak became 2.55x below the tiled MLP's)."""
    from tests.unit.test_tiled_norms import layer_peak_bench
    from ulysses_sp import chunk_core
    from ulysses_sp.features import Features

    bench, _, _ = layer_peak_bench()
    shape = dict(sp=2, hidden=512, heads=8, kv_heads=2, intermediate=1408, tokens=8192)
    features = Features(tiled_loss=False, activation_checkpointing="checkpoint", mlp_chunk_tokens=512)
    phases = {}
    for rows in (10**9, 1024):  # whole: one call a chunk; blocks: 4 of 1024 of the 4096 tokens a rank attends
        monkeypatch.setattr(chunk_core, "MIN_BLOCK_ROWS", rows)
        phases[rows] = bench.layer_backward_peak(features, 4, **shape)["phases"]
    assert phases[10**9]["attention backward"] - phases[1024]["attention backward"] >= 0.2, phases


def test_shared_kv_heads_are_projected_in_chunk_0s_capture(monkeypatch):
    """Where the chunks share the kv heads (16 heads on 4 kv heads, C=4, rank 0 of sp=4 standing in), each chunk's
    forward and backward runs the module's forward once up to its attention call: C captures a pass, not C + 1 (a
    capture of the kv heads with blank queries besides, whose RoPE the module still ran; 20 a step for 2 layers)."""
    from ulysses_sp.bench.headchunks import HEAD_CHUNK_MODEL
    from ulysses_sp.bench.models import bench_model
    from ulysses_sp.shapes import SHAPES
    from ulysses_sp.standin import StandIn, random_batch

    captured = []
    capture = HeadChunkedAttention.capture

    def count(self, args, kwargs, weights, heads, *rest):
        captured.append(heads)
        return capture(self, args, kwargs, weights, heads, *rest)

    batch = random_batch(SHAPES[HEAD_CHUNK_MODEL]["vocab_size"], 64, seed=1)
    with StandIn(sp=4, sp_rank=0) as rank:
        model = U.parallelize(bench_model(HEAD_CHUNK_MODEL, 64, seed=0), rank.layout, head_chunks=4)
        shard = rank.shard(batch)
        U.causal_lm_loss(model, shard, rank.layout).backward()  # the first call probes each module
        monkeypatch.setattr(HeadChunkedAttention, "capture", count)
        U.causal_lm_loss(model, shard, rank.layout).backward()
    layers = model.config.num_hidden_layers
    # chunk 0 projects its 4 query heads and the 4 kv heads; chunks 1-3 their 4 query heads (one blank kv head)
    assert captured == [(4, 4), (4, 1), (4, 1), (4, 1)] * 2 * layers
