"""Single-process tests of the integration data plumbing: the collator wrapper, dp dealing, core choice."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import build, make_batch
from tests.integrations.common import drop_labels_collate, pad_collate, token_dataset
from ulysses_sp import ParallelLayout
from ulysses_sp.integrations import SequenceParallelCollator, deal_batches_over_dp
from ulysses_sp.integrations.data import TOKEN_COUNT_KEY, check_world_size
from ulysses_sp.integrations.hf_trainer import resolve_core


def fake_layout(sp: int, sp_rank: int, dp: int = 1, dp_rank: int = 0):
    """Where a rank sits (no process groups): the collator cuts its shard, deal_batches_over_dp its batches."""
    return ParallelLayout.rank_view(sp, sp_rank, dp=dp, dp_rank=dp_rank)


def shards(collate, features, sp: int) -> list[dict[str, torch.Tensor]]:
    return [
        SequenceParallelCollator(collate, fake_layout(sp, r), pad_token_id=5, check_same_batch=False)(features)
        for r in range(sp)
    ]


def joined(parts, key: str) -> torch.Tensor:
    return torch.cat([p[key] for p in parts], dim=1)


def test_odd_length_is_padded_and_nothing_dropped_positions_derived():
    """Rows of 9 and 17 tokens, sp=4: padded to 20, every token and target kept, position_ids derived."""
    features = [token_dataset((9, 17), seed=3)[i] for i in range(2)]
    full = pad_collate(features)  # [2, 17], no position_ids
    parts = shards(pad_collate, features, sp=4)
    assert [p["input_ids"].shape for p in parts] == [(2, 5)] * 4
    ids = joined(parts, "input_ids")
    torch.testing.assert_close(ids[:, :17], full["input_ids"])
    assert (ids[:, 17:] == 5).all()
    targets = joined(parts, "shift_labels")
    torch.testing.assert_close(targets[:, :16], full["labels"][:, 1:])
    assert (targets[:, 16:] == -100).all()
    torch.testing.assert_close(joined(parts, "labels")[:, :17], full["labels"])
    padded = torch.cat([torch.arange(17), torch.arange(3)])  # shard_batch's padding is a document of its own
    torch.testing.assert_close(joined(parts, "position_ids"), padded.expand(2, 20))
    mask = joined(parts, "attention_mask")
    torch.testing.assert_close(mask[:, :17], full["attention_mask"])
    assert (mask[:, 17:] == 0).all()


def test_packed_positions_kept_and_stale_full_row_keys_dropped():
    """TRL's padding-free batch: restarting position_ids pass through; cu_seq_lens etc. (full row) are dropped."""
    packed = {
        "input_ids": torch.arange(10, 17)[None],
        "labels": torch.arange(10, 17)[None],
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1]]),
        "cu_seq_lens_q": torch.tensor([0, 3, 5, 7], dtype=torch.int32),
        "cu_seq_lens_k": torch.tensor([0, 3, 5, 7], dtype=torch.int32),
        "max_length_q": 3,
        "max_length_k": 3,
        "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 2, 2]], dtype=torch.int32),
    }
    parts = shards(lambda features: packed, [None], sp=2)
    for part in parts:  # attention_mask: shard_batch masks the token it pads the 7 with
        assert set(part) == {"input_ids", "labels", "shift_labels", "position_ids", "attention_mask"}
    torch.testing.assert_close(joined(parts, "position_ids"), torch.tensor([[0, 1, 2, 0, 1, 0, 1, 0]]))
    torch.testing.assert_close(joined(parts, "attention_mask"), torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]]))


def test_collator_without_labels_or_with_shift_labels_or_unknown_token_tensor_raises():
    features = [token_dataset((9,), seed=3)[0]]
    collator = SequenceParallelCollator(drop_labels_collate, fake_layout(2, 0), check_same_batch=False)
    with pytest.raises(ValueError, match="the collated batch has no 'labels'"):
        collator(features)

    def with_key(key):
        def collate(feats):
            batch = pad_collate(feats)
            batch[key] = batch["labels"].clone()
            return batch

        return SequenceParallelCollator(collate, fake_layout(2, 0), check_same_batch=False)

    with pytest.raises(ValueError, match="already has 'shift_labels'"):
        with_key("shift_labels")(features)
    with pytest.raises(ValueError, match="per-token tensor 'token_type_ids'"):
        with_key("token_type_ids")(features)
    with pytest.raises(ValueError, match="already a SequenceParallelCollator"):
        SequenceParallelCollator(collator, fake_layout(2, 0))


def test_collator_for_logits_alone_shards_a_batch_without_labels():
    """require_labels=False (the Trainer's eval and test batches): a batch without labels is sharded as one with
    them, less labels and shift_labels; ``replaced`` keeps the other settings and the layout itself."""
    features = [token_dataset((9, 6), seed=3)[i] for i in range(2)]
    bare = [{"input_ids": f["input_ids"]} for f in features]
    for sp_rank in range(2):
        strict = SequenceParallelCollator(pad_collate, fake_layout(2, sp_rank), pad_token_id=5, check_same_batch=False)
        loose = strict.replaced(require_labels=False)
        assert loose.layout is strict.layout and (loose.pad_token_id, loose.require_labels) == (5, False)
        labelled, unlabelled = strict(features), loose(bare)
        assert set(unlabelled) == {"input_ids", "position_ids", "attention_mask"}
        for key in unlabelled:
            torch.testing.assert_close(unlabelled[key], labelled[key])
        with pytest.raises(ValueError, match="the collated batch has no 'labels'"):
            strict(bare)


@pytest.mark.parametrize("side", ["right", "left"])
def test_transformers_padding_collators_pass_and_unmasked_padding_labels_are_refused(side):
    """transformers' collators set -100 on padding, so their batches are sharded as they are; a collator that
    copies input_ids into labels leaves targets on right padding, which one process would compute differently
    (docs/semantics.md): refused, naming the fix."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq

    from ulysses_sp.train.documents import load_tokenizer

    tokenizer = load_tokenizer(None)
    tokenizer.pad_token, tokenizer.padding_side = tokenizer.eos_token, side
    texts = ["In the beginning God created the heaven and the earth.", "Amen."]
    features = [{"input_ids": tokenizer(text)["input_ids"]} for text in texts]
    with_labels = [dict(f, labels=f["input_ids"]) for f in features]  # seq2seq pads given labels with -100
    for collate, rows in (
        (DataCollatorForLanguageModeling(tokenizer, mlm=False), features),
        (DataCollatorForSeq2Seq(tokenizer), with_labels),
    ):
        parts = shards(collate, rows, 2)
        assert joined(parts, "attention_mask").eq(0).any()  # the short text was padded

    def copy_labels(rows):
        padded = tokenizer.pad(rows, return_tensors="pt")
        return dict(padded, labels=padded["input_ids"].clone())

    if side == "right":
        with pytest.raises(ValueError, match="has a target.*-100 wherever attention_mask is 0"):
            shards(copy_labels, features, 2)
    else:  # a left pad sees no key: zero output in one process too
        shards(copy_labels, features, 2)


def test_deal_batches_over_dp_repoints_accelerate_shards():
    from accelerate.data_loader import BatchSamplerShard, DataLoaderShard

    base = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(10)), batch_size=2, drop_last=False)
    for dp, dp_rank, expected in [(1, 0, [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]), (2, 1, [[2, 3], [6, 7], [0, 1]])]:
        shard = BatchSamplerShard(base, num_processes=dp * 2, process_index=dp_rank * 2 + 1)
        loader = DataLoaderShard(range(10), batch_sampler=shard)
        assert deal_batches_over_dp(loader, fake_layout(2, 1, dp=dp, dp_rank=dp_rank)) is loader
        assert list(shard) == expected  # the same batches on both ranks of the SP group; dp groups differ
    plain = torch.utils.data.DataLoader(range(10), batch_size=2)
    with pytest.raises(ValueError, match="cannot find how DataLoader splits batches over the 4 ranks"):
        deal_batches_over_dp(plain, fake_layout(2, 0, dp=2))
    assert deal_batches_over_dp(plain, fake_layout(1, 0, dp=4)) is plain  # sp=1: accelerate's split is right


@pytest.mark.parametrize("dp", [1, 2])
def test_a_prepared_scheduler_steps_once_per_dp_group_not_per_process(dp):
    """Accelerate steps a prepared scheduler once per process (each reads its own batch); the sp ranks of a group
    read one batch between them, so under SP (4 processes) it must step dp times, as under plain DDP over dp."""
    from types import SimpleNamespace
    from unittest import mock

    from accelerate.scheduler import AcceleratedScheduler
    from accelerate.state import GradientState

    from ulysses_sp.integrations.accelerate import step_scheduler_per_dp_group

    def prepared(scheduler_class, **kwargs):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
        optimizer.step_was_skipped = False
        return AcceleratedScheduler(scheduler_class(optimizer, **kwargs), optimizer), optimizer

    def lr_after(scheduler, optimizer, synced_steps: int) -> float:
        GradientState()._set_sync_gradients(False)
        scheduler.step()  # a micro-batch of an accumulation: no step
        GradientState()._set_sync_gradients(True)
        for _ in range(synced_steps):
            scheduler.step()
        return optimizer.param_groups[0]["lr"]

    halving = dict(lr_lambda=lambda step: 1.0 / (1 + step))
    with mock.patch("accelerate.scheduler.AcceleratorState", lambda: SimpleNamespace(num_processes=4)):
        plain, optimizer = prepared(torch.optim.lr_scheduler.LambdaLR, **halving)
        assert lr_after(plain, optimizer, 1) == 1.0 / 5  # 4 steps: one per process
        scheduler, optimizer = prepared(torch.optim.lr_scheduler.LambdaLR, **halving)
        step_scheduler_per_dp_group(scheduler, dp)
        assert lr_after(scheduler, optimizer, 2) == 1.0 / (1 + 2 * dp)
        one_cycle, optimizer = prepared(torch.optim.lr_scheduler.OneCycleLR, max_lr=1.0, total_steps=3)
        step_scheduler_per_dp_group(one_cycle, dp)
        lr_after(one_cycle, optimizer, 5)  # never stepped past its end (OneCycleLR would raise)
        assert one_cycle.scheduler._step_count == 4
    step_scheduler_per_dp_group(optimizer, dp)  # anything else is left alone
    assert type(optimizer) is torch.optim.SGD


def test_world_size_mismatch_names_the_fix():
    with pytest.raises(ValueError, match=r"2 processes were launched.*use_cpu=True"):
        check_world_size(1, fake_layout(2, 0), "on a CPU-only machine pass TrainingArguments(use_cpu=True)")


def test_core_follows_the_model_and_rejects_unknown_implementations():
    assert resolve_core(build("llama", attn="eager"), None) == "eager"
    assert resolve_core(build("llama"), "flex_attention") == "flex_attention"
    model = build("llama")
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(ValueError, match=r"attn_implementation='paged\|sdpa' has no Ulysses core"):
        resolve_core(model, None)


@pytest.mark.parametrize(
    "attn, core, expected", [("eager", None, "eager"), ("sdpa", None, "sdpa"), ("sdpa", "eager", "eager")]
)
def test_sequence_parallel_config_core_follows_the_model_unless_given(attn, core, expected):
    """As UlyssesTrainer(sp_core=): an eager Gemma2 (softcapping, which sdpa cannot apply) was refused with the
    former default core='sdpa', and an eager Llama silently ran sdpa."""
    from accelerate import Accelerator

    from ulysses_sp.integrations import SequenceParallelConfig

    arch = "gemma2" if attn == "eager" else "llama"
    model, _ = SequenceParallelConfig(sp_size=1, core=core).prepare(Accelerator(cpu=True), build(arch, attn=attn))
    assert model.config._attn_implementation == f"ulysses_{expected}"
    unknown = build("llama")
    unknown.config._attn_implementation = "paged|sdpa"
    with pytest.raises(ValueError, match=r"has no Ulysses core.*or pass core=<one of them>"):
        SequenceParallelConfig(sp_size=1).prepare(Accelerator(cpu=True), unknown)


def test_single_process_trainer_with_sp1_matches_plain_trainer(tmp_path):
    """sp_size=1 in one process is the plain Trainer: same losses, no process group needed."""
    from transformers import Trainer

    from tests.integrations.common import TRAIN_LENGTHS, train_losses, trainer_args
    from ulysses_sp.integrations import UlyssesTrainer

    runs = []
    for cls, extra in ((Trainer, {}), (UlyssesTrainer, {"sp_size": 1})):
        trainer = cls(
            model=build("llama"),
            args=trainer_args(str(tmp_path), num_train_epochs=1, gradient_accumulation_steps=2),
            train_dataset=token_dataset(TRAIN_LENGTHS, seed=1),
            data_collator=pad_collate,
            **extra,
        )
        trainer.train()
        runs.append(train_losses(trainer.state.log_history))
    assert isinstance(trainer.sp_layout, ParallelLayout) and trainer.sp_layout.world_size == 1
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), atol=1e-6, rtol=0)


def test_trainer_tiles_mlp_and_norms_by_default_and_each_turns_off(tmp_path):
    """As ulysses-sp train: the tiled MLP (its norm fused in) and the other norms on by default, each off by
    its argument; the chunk size is passed on."""
    from transformers import TrainingArguments

    from ulysses_sp.integrations import UlyssesTrainer
    from ulysses_sp.tiled_norms import _installed as norm_tiled
    from ulysses_sp.tiling import _installed as mlp_tiled

    def tiling(**extra):
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
        model = UlyssesTrainer(model=build("llama"), args=args, sp_size=1, **extra).model
        layer = model.model.layers[0]
        mlp = mlp_tiled(layer.mlp)
        norms = [norm_tiled(layer.input_layernorm), norm_tiled(layer.post_attention_layernorm)]
        return mlp and mlp.chunk_tokens, [type(n).__name__ if n else None for n in norms]

    assert tiling() == (None, ["TiledNorm", "_HandThrough"])  # the MLP's norm fused into its chunks
    assert tiling(sp_mlp_chunk_tokens=4) == (4, ["TiledNorm", "_HandThrough"])
    assert tiling(sp_tiled_mlp=False) == (None, ["TiledNorm", "TiledNorm"])
    assert tiling(sp_tiled_norms=False) == (None, [None, None])
    assert tiling(sp_tiled_mlp=False, sp_tiled_norms=False) == (None, [None, None])


def test_a_bad_chunk_size_is_refused_by_its_argument_name_before_the_model_is_touched(tmp_path):
    from transformers import TrainingArguments

    from ulysses_sp.integrations import SequenceParallelConfig, UlyssesTrainer

    model = build("llama")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"sp_mlp_chunk_tokens must be a positive int or None, got 0"):
        UlyssesTrainer(model=model, args=args, sp_size=1, sp_mlp_chunk_tokens=0)
    with pytest.raises(ValueError, match=r"^mlp_chunk_tokens must be a positive int or None, got 2.5"):
        SequenceParallelConfig(sp_size=2, mlp_chunk_tokens=2.5)
    unused = r"mlp_chunk_tokens=8 has no effect with (sp_)?tiled_mlp=False and (sp_)?tiled_norms=False"
    with pytest.raises(ValueError, match=unused):
        UlyssesTrainer(
            model=model, args=args, sp_size=1, sp_tiled_mlp=False, sp_tiled_norms=False, sp_mlp_chunk_tokens=8
        )
    with pytest.raises(ValueError, match=unused):
        SequenceParallelConfig(sp_size=2, tiled_mlp=False, tiled_norms=False, mlp_chunk_tokens=8)
    assert UlyssesTrainer(model=model, args=args, sp_size=1).sp_layout.sp == 1  # the model was left as it was


def test_a_bad_label_smoothing_is_refused_when_the_config_is_made():
    from ulysses_sp import causal_lm_loss
    from ulysses_sp.integrations import SequenceParallelConfig

    for bad in (1.0, -0.1, "0.1"):  # torch's cross_entropy would raise only at the first step, or take 1.0
        with pytest.raises(ValueError, match=rf"label_smoothing must be .*\[0, 1\).*got {bad!r}"):
            SequenceParallelConfig(sp_size=2, label_smoothing=bad)
        with pytest.raises(ValueError, match=rf"label_smoothing must be .*\[0, 1\).*got {bad!r}"):
            causal_lm_loss(build("llama"), {}, ParallelLayout.single(), label_smoothing=bad)


@pytest.mark.parametrize(
    ("kwargs", "find_unused", "searched"),
    [
        ({"use_reentrant": True}, None, False),
        ({"preserve_rng_state": True}, None, False),  # torch's checkpoint then runs reentrant
        ({"use_reentrant": True, "every_n_layers": 2}, None, False),
        (None, None, True),  # transformers' default: use_reentrant=False
        ({"every_n_layers": 2, "offload": True}, None, True),  # nothing left for torch: transformers' default
        ({"use_reentrant": False}, None, True),
        ({"use_reentrant": True}, True, True),  # the arguments' own setting wins
    ],
)
def test_ddp_searches_for_unused_parameters_unless_the_checkpoint_is_reentrant(kwargs, find_unused, searched):
    from types import SimpleNamespace

    from accelerate.utils import DistributedDataParallelKwargs

    from ulysses_sp.integrations.trainer_checks import ddp_for_reentrant_checkpointing

    handler = DistributedDataParallelKwargs(find_unused_parameters=True)
    args = SimpleNamespace(
        activation_checkpointing=True, activation_checkpointing_kwargs=kwargs, ddp_find_unused_parameters=find_unused
    )
    (got,) = ddp_for_reentrant_checkpointing({"kwargs_handlers": [handler]}, args)["kwargs_handlers"]
    assert got.find_unused_parameters is searched
    args.activation_checkpointing = False
    (got,) = ddp_for_reentrant_checkpointing({"kwargs_handlers": [handler]}, args)["kwargs_handlers"]
    assert got.find_unused_parameters is True


def test_liger_kernels_are_refused(tmp_path):
    from transformers import TrainingArguments

    from ulysses_sp.integrations import UlyssesTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, use_liger_kernel=True, report_to=[])
    with pytest.raises(ValueError, match=r"does not support: use_liger_kernel=True \(train\(\) would patch"):
        UlyssesTrainer(model=build("llama"), args=args, sp_size=1)


def test_label_smoothing_is_refused_under_trl_only(tmp_path):
    """UlyssesTrainer smooths over the whole sequence's targets (tests/integrations/cases_random.py draws it);
    TRL's SFTTrainer computes its loss itself from the labels the model saw, a shard's, so it is refused there."""
    from trl import SFTConfig

    from tests.integrations.common import TRAIN_LENGTHS, token_dataset, tokenizer
    from ulysses_sp.integrations import UlyssesSFTTrainer, UlyssesTrainer

    args = dict(output_dir=str(tmp_path), use_cpu=True, label_smoothing_factor=0.1, report_to=[])
    assert UlyssesTrainer(model=build("llama"), args=SFTConfig(**args), sp_size=1).label_smoother is not None
    with pytest.raises(ValueError, match=r"does not support: label_smoothing_factor=0.1"):
        UlyssesSFTTrainer(
            model=build("llama"),
            args=SFTConfig(**args),
            train_dataset=token_dataset(TRAIN_LENGTHS, seed=1).remove_columns("labels"),
            processing_class=tokenizer(),
            sp_size=1,
        )


def test_smoothed_loss_of_a_shard_without_targets_is_zero_tiled_or_not():
    """A shard whose targets are all ignored (a prompt split off): 0, not NaN, with or without the tiled loss."""
    import ulysses_sp as U
    from ulysses_sp.integrations.label_smoothing import smoothed_loss

    ids = make_batch(1, 8)["input_ids"]
    inputs = {"input_ids": ids, "shift_labels": torch.full_like(ids, -100)}
    for model in (build("llama"), U.enable_tiled_loss(build("llama"))):
        assert smoothed_loss(model, dict(inputs), 0.1, None)[0].item() == 0.0


def test_deepspeed_is_refused_before_the_trainer_is_built(tmp_path):
    """(TrainingArguments refuses deepspeed= itself where DeepSpeed is not installed: set on the built args.)"""
    from transformers import TrainingArguments

    from ulysses_sp.integrations import UlyssesTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.deepspeed = {"zero_optimization": {"stage": 3}}
    with pytest.raises(ValueError, match=r"deepspeed=...\) is not supported by ulysses-sp's trainers"):
        UlyssesTrainer(model=build("llama"), args=args, sp_size=1)


def test_an_accelerator_with_deepspeed_is_refused_before_the_model_is_touched():
    from types import SimpleNamespace

    from ulysses_sp.integrations import SequenceParallelConfig

    model = build("llama")
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=object()))
    with pytest.raises(ValueError, match="DeepSpeed plugin is not supported by SequenceParallelConfig"):
        SequenceParallelConfig(sp_size=2).prepare(accelerator, model)
    assert model.config._attn_implementation == "sdpa"  # not parallelized


def test_default_tiling_stays_off_with_a_warning_where_the_model_has_no_mlp_or_norm(caplog):
    from ulysses_sp.integrations.data import integration_features

    model = build("llama")
    for layer in model.model.layers:  # an MLP under a name the tiled MLP does not know, and no norms
        layer.dense_block = layer._modules.pop("mlp")
        layer.input_layernorm = layer.post_attention_layernorm = torch.nn.Identity()
    features = integration_features(
        model, tiled_loss=True, tiled_mlp=None, tiled_norms=None, mlp_chunk_tokens=None, switch=lambda n: f"{n}=0"
    )
    assert (features.tiled_loss, features.tiled_mlp, features.tiled_norms) == (True, False, False)
    assert "no recognisable MLP" in caplog.text and "tiled_mlp=0" in caplog.text and "tiled_norms=0" in caplog.text


@pytest.mark.parametrize("masked", [True, False])
def test_full_batch_token_counts_ride_on_sp_rank_0_only(masked):
    """Summed over the ranks, the Trainer's counts are the full batch's (not the shards', which hold the padding
    added for divisibility); -1 on every rank when the batch has no attention_mask; the length on every rank; 0 (the
    collator gave no position_ids) or 1 on every rank."""
    features = [{"input_ids": [7] * n, "labels": [7] * n} for n in (5, 2)]  # a full batch of 2 x 5, 7 real tokens

    def collate(rows):
        batch = pad_collate(rows)
        return batch if masked else {k: v for k, v in batch.items() if k != "attention_mask"}

    parts = [
        SequenceParallelCollator(collate, fake_layout(2, r), check_same_batch=False, token_counts=True)(features)
        for r in range(2)
    ]
    assert sum(p["input_ids"].numel() for p in parts) == 12  # the shards: 2 x 6
    counts = [p[TOKEN_COUNT_KEY].tolist() for p in parts]
    assert counts == ([[10, 7, 5, 0], [0, 0, 5, 0]] if masked else [[10, -1, 5, 0], [0, -1, 5, 0]])
    positioned = lambda rows: {**collate(rows), "position_ids": torch.arange(5)[None]}  # noqa: E731
    given = SequenceParallelCollator(positioned, fake_layout(2, 1), check_same_batch=False, token_counts=True)
    assert given(features)[TOKEN_COUNT_KEY].tolist()[3] == 1
    assert TOKEN_COUNT_KEY not in shards(collate, features, 2)[0]  # only for a consumer that removes it

    def embedded(rows):  # inputs_embeds [2, 5, 3] in place of input_ids: the same counts (not x the hidden size)
        batch = collate(rows)
        return {"inputs_embeds": torch.ones(*batch.pop("input_ids").shape, 3), **batch}

    for rank in range(2):
        got = SequenceParallelCollator(embedded, fake_layout(2, rank), check_same_batch=False, token_counts=True)
        assert got(features)[TOKEN_COUNT_KEY].tolist() == counts[rank]


def test_tiled_loss_gives_trl_its_fused_lm_head():
    """TRL's fused LM head (installed before the tiled loss, as UlyssesSFTTrainer does) still answers
    ``fused_lm_head=True`` with its per-token log-probabilities; a plain call gets the tiled loss."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(trl_utils, "add_fused_lm_head"):
        pytest.skip("this TRL has no fused LM head")
    import ulysses_sp as U

    model = build("llama")
    trl_utils.add_fused_lm_head(model)
    ids = torch.randint(3, 100, (2, 11), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids, labels=ids, fused_lm_head=True)
    loss = model(input_ids=ids, labels=ids).loss
    U.enable_tiled_loss(model, chunk_tokens=4)
    got = model(input_ids=ids, labels=ids, fused_lm_head=True)
    torch.testing.assert_close(got.log_probs, want.log_probs)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, loss)


def test_the_collator_pickles_for_spawned_dataloader_workers():
    """A worker started by spawn or forkserver gets the collator pickled; its layout's process groups do not
    pickle, so the worker's copy holds a rank view that cuts the same shard."""
    import copy
    import pickle
    import threading

    features = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (7, 4)]
    view = ParallelLayout.rank_view(4, 3, dp=2, dp_rank=1, ring=2)
    layout = copy.copy(view)
    object.__setattr__(layout, "sp_group", threading.Lock())  # a lock does not pickle either: a ProcessGroup's stand-in
    collator = SequenceParallelCollator(pad_collate, layout, check_same_batch=False, token_counts=True)
    with pytest.raises(TypeError):
        pickle.dumps(layout)
    worker = pickle.loads(pickle.dumps(collator))
    assert worker.layout.sp_group is None and (worker.layout.sp, worker.layout.sp_rank, worker.layout.ring) == (4, 3, 2)
    want = SequenceParallelCollator(pad_collate, view, check_same_batch=False, token_counts=True)(features)
    got = worker(features)
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=key)
