"""Activation checkpointing and host offload in one process: exactness, recompute, memory, reversibility."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ulysses_sp as U
from tests.helpers.models import VOCAB, build, make_batch
from tests.unit.test_tiling import assert_same, loss_and_grads
from ulysses_sp.memory import PeakMemory, _StorageTracker
from ulysses_sp.offload import offload_store

LAYERS, HIDDEN, INTER, TOKENS = 8, 32, 64, 1024  # the memory tests' model and sequence


def count_layer_runs(model):
    """Forward runs of layer 0's first norm: 1 per step without checkpointing, 2 with its recompute."""
    calls = []
    model.model.layers[0].input_layernorm.register_forward_hook(lambda *_: calls.append(1))
    return calls


def deep_llama(layers: int, hidden: int, inter: int, vocab: int) -> LlamaForCausalLM:
    """A Llama with more layers than tests/helpers/models.py builds (memory scales with them), fp32 on CPU."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).float()


@pytest.fixture(scope="module")
def deep_model():
    return deep_llama(LAYERS, HIDDEN, INTER, VOCAB)


@pytest.mark.parametrize("mode", ["checkpoint", "offload"])
def test_loss_and_every_gradient_equal_no_checkpointing(mode):
    model, batch = build("qwen3", kv_heads=2), make_batch(2, 24, packed=(10, 14))
    want = loss_and_grads(copy.deepcopy(model), batch)
    ckpt = U.enable_activation_checkpointing(copy.deepcopy(model), mode)
    runs = count_layer_runs(ckpt)
    assert_same(loss_and_grads(ckpt, batch), want)
    assert len(runs) == 2  # the layer really was recomputed in backward


def test_bf16_autocast_offload_equals_no_checkpointing():
    model, batch = build("llama", kv_heads=2), make_batch(2, 24)
    want = loss_and_grads(copy.deepcopy(model), batch, bf16_autocast=True)
    got = loss_and_grads(U.enable_activation_checkpointing(copy.deepcopy(model), "offload"), batch, bf16_autocast=True)
    assert_same(got, want)


def test_peft_lora_with_offload_and_tiled_mlp():
    from peft import LoraConfig, get_peft_model

    model, batch = build("llama", kv_heads=2), make_batch(2, 24)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    want = loss_and_grads(copy.deepcopy(peft_model), batch)
    both = U.enable_activation_checkpointing(copy.deepcopy(peft_model), "offload")
    U.enable_tiled_mlp(both, chunk_tokens=5)
    got = loss_and_grads(both, batch)
    assert len(got[1]) == 16
    assert_same(got, want)


def test_offload_keeps_the_layer_inputs_in_the_host_store_not_on_the_compute_device(deep_model):
    """After forward, which storages does autograd keep alive? Every storage created in the forward and still
    live is tracked (memory._StorageTracker); the ones that are the host store's tensors are in host memory,
    the rest stay on the compute device. Offload must move exactly the L layer inputs [b, n, h] out."""
    ids = torch.randint(0, VOCAB, (1, TOKENS))
    layer_inputs = LAYERS * TOKENS * HIDDEN * 4
    kept = {}
    for mode in ("checkpoint", "offload"):
        model = U.enable_activation_checkpointing(copy.deepcopy(deep_model), mode)
        model.train()
        with _StorageTracker("cpu") as tracker:
            logits = model(input_ids=ids, use_cache=False).logits
        store = offload_store(model)
        host = {t.untyped_storage().data_ptr() for t in store.held_tensors()} if store else set()
        live = tracker.live  # the weights, older than the block, count for nothing (seen through w.t())
        kept[mode] = {
            "device": sum(nbytes for ptr, nbytes in live.items() if ptr not in host),
            "host": sum(nbytes for ptr, nbytes in live.items() if ptr in host),
        }
        logits.sum().backward()
        assert store is None or store.held_bytes() == 0  # released once backward used them
    assert kept["checkpoint"]["host"] == 0 and kept["offload"]["host"] == layer_inputs, kept
    assert kept["offload"]["device"] <= kept["checkpoint"]["device"] - layer_inputs, kept
    # what is left lies outside the layers: logits [b, n, V], the final norm's 3 [b, n, h], RoPE cos/sin
    assert kept["offload"]["device"] <= TOKENS * (VOCAB + 4 * HIDDEN) * 4, kept


def test_checkpointing_lowers_the_peak_of_forward_and_backward(deep_model):
    """Without checkpointing all 8 layers keep their activations (their MLPs alone keep [b, n, h + 4 I] each);
    with it, 8 layer inputs [b, n, h] plus about one layer's activations while it is recomputed."""
    ids = torch.randint(0, VOCAB, (1, TOKENS))
    peaks = {}
    for mode in ("none", "checkpoint"):
        model = U.enable_activation_checkpointing(copy.deepcopy(deep_model), mode)
        model.train()
        with PeakMemory() as peak:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        peaks[mode] = peak.peak_bytes
    mlp_saved = TOKENS * (HIDDEN + 4 * INTER) * 4
    assert peaks["none"] - peaks["checkpoint"] >= (LAYERS - 2) * mlp_saved, peaks
    assert peaks["checkpoint"] * 4 < peaks["none"], peaks  # measured 3.7 MiB against 19.1 MiB


def test_modes_are_reversible_and_none_turns_transformers_checkpointing_off():
    model, batch = build("llama"), make_batch(1, 12)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    runs = count_layer_runs(model)
    U.enable_activation_checkpointing(model, "none")
    loss_and_grads(model, batch)
    assert len(runs) == 1 and not model.model.layers[0].gradient_checkpointing
    U.disable_activation_checkpointing(model)
    assert model.model.layers[0].gradient_checkpointing
    loss_and_grads(model, batch)
    assert len(runs) == 3

    plain = build("llama")
    U.enable_activation_checkpointing(plain, "offload")
    U.disable_activation_checkpointing(plain)
    assert all(
        "gradient_checkpointing" not in m.__dict__ and "_gradient_checkpointing_func" not in m.__dict__
        for m in plain.model.layers
    )
    assert offload_store(plain) is None and U.disable_activation_checkpointing(plain) is plain


def own_flags(model):
    """Each module's checkpointing attributes set on the instance (not the class's defaults)."""
    names = ("gradient_checkpointing", "_gradient_checkpointing_func")
    return [{name: m.__dict__[name] for name in names if name in m.__dict__} for m in model.modules()]


@pytest.mark.parametrize(
    ("mode", "stride", "how"),
    [("offload", 1, "deepcopy"), ("checkpoint", 2, "deepcopy"), ("checkpoint", 1, "torch.load")],
)
def test_disable_on_a_copied_or_loaded_model_restores_it(tmp_path, mode, stride, how):
    """disable_activation_checkpointing of a copy.deepcopy (or of what torch.load gave back) set a new object() as
    each layer's gradient_checkpointing and checkpoint function (the 'missing' sentinel was copied): its next
    training step raised TypeError "'object' object is not callable"."""
    model, batch = build("llama"), make_batch(1, 12)
    want = loss_and_grads(copy.deepcopy(model), batch)
    U.enable_activation_checkpointing(model, mode, stride=stride)
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        torch.save(model, tmp_path / "model.pt")
        twin = torch.load(tmp_path / "model.pt", weights_only=False)
    U.disable_activation_checkpointing(twin)
    assert own_flags(twin) == own_flags(build("llama"))  # LlamaModel's own False, nothing on the layers
    runs = count_layer_runs(twin)
    assert_same(loss_and_grads(twin, batch), want)
    assert len(runs) == 1  # not checkpointed any more


def test_a_copied_model_gets_its_own_empty_store():
    model = U.enable_activation_checkpointing(build("llama"), "offload")
    copied = copy.deepcopy(model)
    store = offload_store(copied)
    assert store is not offload_store(model) and store.held_bytes() == 0
    assert all(layer._gradient_checkpointing_func.store is store for layer in copied.model.layers)
    loss_and_grads(copied, make_batch(1, 12))


@pytest.mark.parametrize(("mode", "stride"), [("offload", 1), ("checkpoint", 2), ("offload", 2)])
def test_torch_save_of_an_offloading_or_strided_model_is_one_type_error_naming_the_fix(tmp_path, mode, stride):
    """It failed inside pickle with "Can't pickle local object 'WeakSet.__init__.<locals>._remove'" (offload), and
    with "cannot pickle 'weakref.ReferenceType' object" (checkpoint_stride 2: a layer's function refers to it)."""
    model = U.enable_activation_checkpointing(build("llama"), mode, stride=stride)
    with pytest.raises(TypeError, match=r"model.state_dict\(\).*disable_activation_checkpointing\(model\)"):
        torch.save(model, tmp_path / "model.pt")
    torch.save(U.disable_activation_checkpointing(model), tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    batch = make_batch(1, 12)
    torch.testing.assert_close(loaded(**batch).loss, model(**batch).loss)


def test_eval_mode_and_no_grad_keep_nothing():
    model = U.enable_activation_checkpointing(build("llama"), "offload")
    model.eval()
    out = model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert offload_store(model).held_bytes() == 0 and out.logits.requires_grad


def test_store_passes_scalars_and_empty_placeholders_through_and_chains_layer_inputs():
    """Older torch saves an empty tensor next to each checkpoint's inputs: it must not become the ``previous``
    of the next layer input (the prefetch would fetch nothing)."""
    from ulysses_sp.offload import HostActivationStore

    store = HostActivationStore()
    first = store.pack(torch.randn(4, 8))
    placeholder = torch.empty(0)
    assert store.pack(placeholder) is placeholder and store.unpack(placeholder) is placeholder
    scalar = torch.tensor(2.0)
    assert store.pack(scalar) is scalar
    second = store.pack(torch.randn(4, 8))
    assert second.previous() is first and len(store.held_tensors()) == 2
    torch.testing.assert_close(store.unpack(first), first.host)


def test_errors():
    with pytest.raises(ValueError, match=r"mode must be one of \['none', 'checkpoint', 'offload'\], got 'cpu'"):
        U.enable_activation_checkpointing(build("llama"), "cpu")
    model = U.enable_activation_checkpointing(build("llama"))
    with pytest.raises(ValueError, match="already set up.*disable_activation_checkpointing"):
        U.enable_activation_checkpointing(model, "offload")
    with pytest.raises(TypeError, match="got Linear"):
        U.enable_activation_checkpointing(torch.nn.Linear(2, 2))
    unsupported = build("llama")
    unsupported.supports_gradient_checkpointing = False
    with pytest.raises(ValueError, match="LlamaForCausalLM does not support activation checkpointing"):
        U.enable_activation_checkpointing(unsupported)


def _fetch_log(monkeypatch):
    """Every pack and fetch of the host store, and each layer's attention reaching its core's backward (the
    gradient of o_proj's input), in order: ("pack", n) / ("fetch", n) name the n-th packed layer input."""
    from ulysses_sp.offload import HostActivationStore

    log, order = [], {}
    pack, fetch = HostActivationStore.pack, HostActivationStore._fetch

    def logged_pack(self, tensor):
        entry = pack(self, tensor)
        if not isinstance(entry, torch.Tensor):
            order[id(entry)] = len(order)
        return entry

    def logged_fetch(self, entry):
        log.append(("fetch", order[id(entry)]))
        return fetch(self, entry)

    monkeypatch.setattr(HostActivationStore, "pack", logged_pack)
    monkeypatch.setattr(HostActivationStore, "_fetch", logged_fetch)
    return log


def _mark_core_backwards(monkeypatch, model, log, chunks: int) -> None:
    """Log ("core",) right after each attention core's backward: C = 1, a gradient hook on the core's query
    (made by the core's backward); in chunks, each chunk's fused kernel backward."""
    from ulysses_sp import head_chunk_pipeline

    if chunks > 1:
        kernel_backward = head_chunk_pipeline.kernel_backward

        def logged(*args, **kwargs):
            found = kernel_backward(*args, **kwargs)
            log.append(("core",))
            return found

        monkeypatch.setattr(head_chunk_pipeline, "kernel_backward", logged)
        return
    ctx = U.ulysses_context(model)
    core = ctx.core

    def marked(q, *args, **kwargs):
        if q.requires_grad:
            q.register_hook(lambda grad: log.append(("core",)))
        return core(q, *args, **kwargs)

    ctx.core = marked


@pytest.mark.parametrize(
    "parallelize_first,stride,chunks", [(True, 1, 1), (False, 1, 1), (True, 2, 1), (True, 1, 2), (False, 2, 2)]
)
def test_a_parallelized_model_fetches_the_next_input_after_the_attention_backward(
    monkeypatch, parallelize_first, stride, chunks
):
    """In a parallelized model the store fetches layer i-1's input once layer i's attention has finished its
    backward (after its core's, or all its chunks', not when layer i's recompute starts), so it is not on the
    device at the attention's peak; with a stride, a group's head is fetched again for its own layer once the
    layers after it are done. Loss and gradients are the plain model's, whichever of parallelize / offload
    comes first."""
    from tests.helpers.models import make_batch

    log = _fetch_log(monkeypatch)
    model, batch = deep_llama(4, HIDDEN, INTER, VOCAB), make_batch(1, 32)
    want = loss_and_grads(copy.deepcopy(model), batch)
    layout = U.ParallelLayout.single()
    if parallelize_first:
        U.parallelize(model, layout, head_chunks=chunks)
    U.enable_activation_checkpointing(model, "offload", stride=stride)
    if not parallelize_first:
        U.parallelize(model, layout, head_chunks=chunks)
    _mark_core_backwards(monkeypatch, model, log, chunks)
    assert_same(loss_and_grads(model, batch), want)
    core = [("core",)] * chunks  # one per chunk
    if stride == 1:  # layer i+1's core backward, then the fetch of layer i's input, before layer i's
        fetches = [("fetch", 2), ("fetch", 1), ("fetch", 0), None]
    else:  # heads 0 and 2 (packed 0 and 1): layer 3 rebuilt from head 2, which is fetched again after layer 3's
        # attention; head 0 after layer 2's; layer 1 rebuilt from it, and head 0 fetched again after layer 1's
        fetches = [("fetch", 1), ("fetch", 0), ("fetch", 0), None]
    assert log == [event for fetch in fetches for event in [*core, fetch] if event is not None], log
    U.unparallelize(model)
    assert not offload_store(model).late  # nothing would call its pending fetches: prefetch at once again


def test_a_plain_model_fetches_the_next_input_when_the_recompute_starts(monkeypatch):
    """Without parallelize nothing reports the attention's backward: layer i-1's input is fetched as soon as
    layer i's recompute has its own."""
    from tests.helpers.models import make_batch

    log = _fetch_log(monkeypatch)
    model = U.enable_activation_checkpointing(deep_llama(3, HIDDEN, INTER, VOCAB), "offload")
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_full_backward_hook(lambda *_: log.append(("attention",)))
    loss_and_grads(model, make_batch(1, 32))
    assert log == [("fetch", 1), ("attention",), ("fetch", 0), ("attention",), ("attention",)]
