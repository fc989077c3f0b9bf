"""Trainer, SFTTrainer and Accelerate under Ulysses SP on 2 and 4 gloo ranks, against DP and one-process runs.

The HF article's experiment: DP=2/SP=1/GAS=1 (plain Trainer / SFTTrainer) against DP=1/SP=2/GAS=2 (ours) on
the same data: the same samples per optimizer step, so the per-step logged loss must agree to 1e-5 (fp32)
and the final weights to AdamW round-off. Each world size is spawned once (module fixtures) and runs many jobs
(tests/integrations/jobs.py); one-process references run here, in the test process.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

from tests.helpers.harness import assert_case, run_world
from tests.helpers.models import build
from tests.integrations.common import (
    EVAL_LENGTHS,
    TRAIN_LENGTHS,
    argmax_and_top,
    first,
    pad_collate,
    read_json,
    stream_trainer,
    token_dataset,
    token_metrics,
    train_losses,
    trainer_args,
)
from tests.integrations.jobs import EMBEDS_ARGS, MOE_IGNORED, OWN_TOKENS, moe_model

# The Trainer trains a model sharded at load time (from_pretrained(distributed_config=...)) only in transformers
# whose models report it (is_distributed_loading_by_transformers, read by the Trainer to leave the model unwrapped);
# older ones wrap its DTensor parameters in DDP, which fails.
TRAINER_FSDP2 = pytest.mark.skipif(
    not hasattr(PreTrainedModel, "is_distributed_loading_by_transformers"),
    reason="this transformers' Trainer cannot train a model sharded at load time (DistributedConfig)",
)
FSDP2_JOB = pytest.param("trainer_fsdp2_sp2_gas2", marks=TRAINER_FSDP2)

LOSS_ATOL = 1e-5  # fp32 per-step logged loss
WEIGHT_ATOL = 1e-4  # after 4-8 AdamW steps (lr 1e-3): round-off in the gradients moves weights by ~1e-5


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("integrations")
    os.environ["ULYSSES_IT_OUT"] = str(path)  # inherited by the spawned ranks
    return path


@pytest.fixture(scope="module")
def world2_plain(out_dir):
    return run_world(2, "tests.integrations.jobs:world2_plain", timeout=300)


@pytest.fixture(scope="module")
def world2_sp(out_dir):
    return run_world(2, "tests.integrations.jobs:world2_sp", timeout=480)


@pytest.fixture(scope="module")
def world4(out_dir):
    return run_world(4, "tests.integrations.jobs:world4", timeout=300)


def result(out_dir, job: str) -> dict:
    return read_json(os.path.join(out_dir, job, "result.json"))


def weights(out_dir, job: str, name: str = "final/model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(os.path.join(out_dir, job, name))


def assert_same_run(out_dir, reference: str, run: str) -> None:
    ref, got = result(out_dir, reference), result(out_dir, run)
    assert got["global_step"] == ref["global_step"] and got["epoch"] == ref["epoch"]
    assert got["total_flos"] == ref["total_flos"]  # the collated batches' tokens, not the shards' (padded for sp)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=LOSS_ATOL, rtol=0)
    ref_w, got_w = weights(out_dir, reference), weights(out_dir, run)
    assert ref_w.keys() == got_w.keys()
    for name in ref_w:
        torch.testing.assert_close(got_w[name], ref_w[name], atol=WEIGHT_ATOL, rtol=0, msg=name)


def assert_trained_as(out_dir, job: str, reference) -> None:
    """Job ``job``'s per-step losses and saved weights against the trained one-process ``reference`` trainer's."""
    from transformers import AutoModelForCausalLM

    ours, want = result(out_dir, job), train_losses(reference.state.log_history)
    assert ours["global_step"] == len(want) >= 2
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(want), atol=LOSS_ATOL, rtol=0)
    saved = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, job, "final"))
    for name, param in reference.model.named_parameters():
        torch.testing.assert_close(saved.get_parameter(name), param, atol=WEIGHT_ATOL, rtol=0, msg=name)


def speed_counts(metrics: dict, prefix: str) -> tuple[int, int]:
    """(samples, steps) that transformers' speed metrics stand for: rate x runtime (rounded to 4 decimals) for the
    samples, and the steps from the ratio of the two rates (each rounded to 3 decimals, both over the same runtime)."""
    samples_per_second = metrics[f"{prefix}_samples_per_second"]
    samples = round(samples_per_second * metrics[f"{prefix}_runtime"])
    return samples, round(metrics[f"{prefix}_steps_per_second"] / samples_per_second * samples)


def one_process_eval_loss(model, samples: int, **args) -> float:
    """The eval loss a plain, single-process Trainer (TrainingArguments ``args``) reports for this model."""
    from transformers import Trainer

    trainer = Trainer(
        model=model,
        args=trainer_args("unused", per_device_eval_batch_size=2, **args),
        eval_dataset=token_dataset(EVAL_LENGTHS[:samples], seed=2),
        data_collator=pad_collate,
    )
    return trainer.evaluate()["eval_loss"]


# ------------------------------------------------------------------------------------- Trainer
def test_trainer_dp1_sp2_gas2_equals_dp2_sp1_gas1(world2_plain, world2_sp, out_dir):
    """Per-step logged loss within 1e-5 and final weights within 1e-4 over 2 epochs (8 optimizer steps)."""
    assert_case(world2_plain, "trainer_dp2", 2)
    assert_case(world2_sp, "trainer_sp2_gas2", 2)
    assert_same_run(out_dir, "trainer_dp2", "trainer_sp2_gas2")
    ours = result(out_dir, "trainer_sp2_gas2")
    assert len(ours["losses"]) == ours["global_step"] == 8  # 16 samples / (2 per batch x GAS 2 x dp 1), 2 epochs
    assert ours["train_batches"] == 8  # every rank of the SP group iterates the whole epoch, not half of it


def test_a_collator_of_inputs_embeds_trains_and_evaluates_as_one_process(world2_sp, out_dir, tmp_path):
    """A collator that gives inputs_embeds [b, N, hidden] and no input_ids (another tower's tokens) was refused ("the
    collated batch needs an 'input_ids' tensor"): now its shards are cut as input_ids are, and the losses, weights,
    eval loss, FLOPs and tokens seen (none: one process counts input_ids only) are those of one process."""
    from transformers import Trainer

    from tests.integrations.common import embeds_collate

    job = "trainer_embeds_sp2"
    assert_case(world2_sp, job, 2)
    args = trainer_args(str(tmp_path), **EMBEDS_ARGS)
    data = token_dataset(TRAIN_LENGTHS, seed=1), token_dataset(EVAL_LENGTHS, seed=2)
    reference = Trainer(
        model=build("llama"), args=args, train_dataset=data[0], eval_dataset=data[1], data_collator=embeds_collate
    )
    reference.train()
    assert_trained_as(out_dir, job, reference)
    got = result(out_dir, job)
    state = reference.state
    assert (got["total_flos"], got["tokens_seen"]) == (state.total_flos, state.num_input_tokens_seen), got
    want = [e["grad_norm"] for e in state.log_history if "grad_norm" in e]  # (AdamW's steps hide a gradient's scale)
    torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(want), rtol=1e-4, atol=0)
    assert abs(got["eval_loss"] - reference.evaluate()["eval_loss"]) < LOSS_ATOL


def test_a_step_and_an_eval_batch_of_no_targets_match_one_process(world2_sp, out_dir, tmp_path):
    """A step whose every label is -100 (the Trainer passes num_items_in_batch = 0) turned every weight into NaN
    under the tiled loss; an eval batch of none counted as 0 in eval_loss (one process's NaN is left out)."""
    from transformers import Trainer

    from tests.integrations.common import no_target_trainer

    assert_case(world2_sp, "no_targets_sp2", 2)
    reference = no_target_trainer(Trainer, str(tmp_path))
    reference.train()
    want = [[e["loss"], e["grad_norm"]] for e in reference.state.log_history if "grad_norm" in e]
    got = result(out_dir, "no_targets_sp2")
    assert len(got["steps"]) == len(want) == 4 and want[1][1] == 0.0
    for (loss, norm), (want_loss, want_norm) in zip(got["steps"], want, strict=True):
        assert abs(norm - want_norm) < 1e-4 * max(1.0, want_norm), (got["steps"], want)
        if want_loss == want_loss:  # (the plain Trainer logs a NaN step's loss as the running mean: not compared)
            assert abs(loss - want_loss) < LOSS_ATOL, (got["steps"], want)
    assert abs(got["eval_loss"] - reference.evaluate()["eval_loss"]) < LOSS_ATOL
    weights = torch.load(os.path.join(out_dir, "no_targets_sp2", "weights.pt"))
    for name, param in reference.model.named_parameters():
        torch.testing.assert_close(torch.tensor(weights[name]), param.detach(), atol=WEIGHT_ATOL, rtol=0, msg=name)


def test_streamed_datasets_of_many_shards_train_and_evaluate_as_one_process(world2_sp, out_dir, tmp_path):
    """datasets.IterableDataset train and eval sets of 4 shards: accelerate gave each of the 2 ranks its own shards
    (refused: 'cannot find how DataLoaderShard splits batches'); and the eval loss counted the last, partial batch's
    loss twice (4.856361 where one process reports 4.856153): the Trainer repeats each batch loss by the first
    batch's size, and a stream's length, hence its remainder, is unknown to accelerate."""
    from transformers import Trainer

    assert_case(world2_sp, "trainer_stream_sp2", 2)
    reference = stream_trainer(Trainer, str(tmp_path))
    reference.train()
    got = result(out_dir, "trainer_stream_sp2")
    want = train_losses(reference.state.log_history)
    assert len(got["losses"]) == len(want) == 6
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want), atol=LOSS_ATOL, rtol=0)
    assert abs(got["eval_loss"] - reference.evaluate()["eval_loss"]) < LOSS_ATOL


def test_an_overridden_compute_loss_is_refused_or_warned_about(world2_sp, out_dir):
    """A subclass's compute_loss from outputs.logits and inputs["labels"]: a ValueError saying why under the tiled
    loss (training and evaluation; it was a bare TypeError), one warning on rank 0 without it (the loss is silently
    not the one-process loss otherwise); none for one that calls super().compute_loss or, under the tiled loss,
    causal_lm_loss (which trains as the trainer's own loss does)."""
    assert_case(world2_sp, "loss_override_sp2", 2)
    assert result(out_dir, "loss_override_sp2")["warnings"] == [
        {"LogitsLossTrainer": 1, "SuperLossTrainer": 0, "CausalLMLossTrainer": 0},
        {"LogitsLossTrainer": 0, "SuperLossTrainer": 0, "CausalLMLossTrainer": 0},
    ]


def test_trainer_resumed_from_checkpoint_equals_uninterrupted(world2_sp, out_dir):
    """Resuming at checkpoint-4 (optimizer, scheduler, data position restored) ends where the full run ends."""
    assert_case(world2_sp, "trainer_sp2_resume", 2)
    assert_same_run(out_dir, "trainer_sp2_gas2", "trainer_sp2_resume")


@TRAINER_FSDP2
def test_trainer_fsdp2_sp2_gas2_equals_dp2(world2_plain, world2_sp, out_dir):
    """FSDP2 through the Trainer on CPU: a model sharded at load time (DistributedConfig(fsdp_size=world))."""
    assert_case(world2_sp, "trainer_fsdp2_sp2_gas2", 2)
    assert_same_run(out_dir, "trainer_dp2", "trainer_fsdp2_sp2_gas2")


def test_trainer_dp2_sp2_on_4_ranks_equals_dp2(world2_plain, world4, out_dir):
    assert_case(world4, "trainer_dp2_sp2", 4)
    assert_same_run(out_dir, "trainer_dp2", "trainer_dp2_sp2")
    assert result(out_dir, "trainer_dp2_sp2")["train_batches"] == 4  # batches dealt over dp=2 SP groups


@pytest.mark.parametrize("kind", ["trainer", "trainer_smoothed", "trainer_moe", "sft_moe"])
def test_average_tokens_across_devices_off_dp2_sp2_equals_plain_ddp(world2_plain, world4, out_dir, kind):
    """average_tokens_across_devices=False (refused before): plain DDP divides each dp rank's loss by its own
    targets; under SP a dp replica's targets are its SP group's, so each replica's loss, gradients (the logged norm)
    and the weights are those of plain DDP over dp=2 (the Trainer's loss, label-smoothed too, an MoE's through the
    load-balancing path and TRL's with its term), not the world-count ones of average_tokens_across_devices=True."""
    reference, job = f"{kind}_own_tokens_dp2", f"{kind}_own_tokens_dp2_sp2"
    assert_case(world2_plain, reference, 2)
    assert_case(world4, job, 4)
    assert_same_run(out_dir, reference, job)
    want, got = result(out_dir, reference)["grad_norms"], result(out_dir, job)["grad_norms"]
    assert len(got) == len(want) == result(out_dir, job)["global_step"] >= 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)
    if kind == "trainer":  # the switch matters here: the first step's loss, the mean of the dp ranks' own means
        averaged = result(out_dir, "trainer_dp2")["losses"][0]  # (the same batches, the world's count)
        assert abs(result(out_dir, job)["losses"][0] - averaged) > 100 * LOSS_ATOL, (result(out_dir, job), averaged)


def test_trainer_moe_load_balancing_loss_dp2_sp2_equals_one_process(world4, out_dir):
    """An MoE model with output_router_logits: its load-balancing term over each dp replica's micro-batch, as one
    process adds it to each micro-batch (dp2 x sp2 x GAS 2 against GAS 4): losses, eval loss and weights. The eval's
    last batch (1 of 9 samples) is evened out over the dp groups by accelerate: the repeated rows count in neither
    part of its loss (their router tokens counted in the term: the eval loss was 7.5e-5 off one process's)."""
    from transformers import Trainer

    from tests.integrations.jobs import moe_model

    job = "trainer_moe_aux_dp2_sp2_gas2"
    assert_case(world4, job, 4)
    reference = Trainer(
        model=moe_model(),
        args=trainer_args(os.path.join(out_dir, "moe_ref"), gradient_accumulation_steps=4, num_train_epochs=1),
        train_dataset=token_dataset(TRAIN_LENGTHS, seed=1),
        eval_dataset=token_dataset(EVAL_LENGTHS, seed=2),
        data_collator=pad_collate,
    )
    reference.train()
    assert_trained_as(out_dir, job, reference)
    assert result(out_dir, job)["global_step"] == 2  # 16 samples / (2 per batch x GAS 2 x dp 2)
    assert abs(result(out_dir, job)["eval_loss"] - reference.evaluate()["eval_loss"]) < LOSS_ATOL


@pytest.mark.parametrize(
    "job, world, args",
    [
        ("trainer_sp2_gas2", 2, {}),
        pytest.param("trainer_fsdp2_sp2_gas2", 2, {}, marks=TRAINER_FSDP2),
        ("trainer_dp2_sp2", 4, {}),
        ("trainer_own_tokens_dp2_sp2", 4, {}),
        ("trainer_moe_own_tokens_dp2_sp2", 4, {}),  # (its saved config adds the load-balancing term, 0.5)
        ("trainer_smoothed_own_tokens_dp2_sp2", 4, {"label_smoothing_factor": 0.1}),
    ],
)
def test_eval_under_sp_equals_one_process_eval(request, out_dir, job, world, args):
    """Eval of long odd-length sequences, run sharded, reports the loss one process computes on the saved model
    (with ``args``), under average_tokens_across_devices=False (``own_tokens``) too."""
    from transformers import AutoModelForCausalLM

    assert_case(request.getfixturevalue("world2_sp" if world == 2 else "world4"), job, world)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, job, "final"))
    got = result(out_dir, job)
    assert abs(got["eval_loss"] - one_process_eval_loss(model, got["eval_samples"], **args)) < LOSS_ATOL


@pytest.mark.parametrize(
    "job, world, argmax", [("trainer_metrics_sp2", 2, False), ("trainer_metrics_dp2_sp2", 4, True)]
)
def test_compute_metrics_and_predict_under_sp_equal_one_process(world2_sp, world4, out_dir, job, world, argmax):
    """compute_metrics gets whole-sequence logits (or preprocess_logits_for_metrics' pair of tensors) and labels,
    every eval sample once: the metrics one process computes (the tiled loss at sp=2 gets its logits from a second
    forward, and include_for_metrics its inputs and losses; dp=2 x sp=2 evens out the last batch); predict() returns
    one process's logits at every real token, and on a dataset without labels its logits alone (no loss, no labels),
    as evaluate() there reports what one process reports."""
    from transformers import Trainer

    assert_case(world2_sp if world == 2 else world4, job, world)
    included = ["inputs", "loss"] if world == 2 else []  # as the job
    reference = Trainer(
        model=build("llama"),
        args=trainer_args("unused", include_for_metrics=included),
        eval_dataset=token_dataset(EVAL_LENGTHS, seed=2),
        data_collator=pad_collate,
        compute_metrics=token_metrics,
        preprocess_logits_for_metrics=argmax_and_top if argmax else None,
    )
    want, got = reference.evaluate(), result(out_dir, job)
    # (with dp=2 the last batch of 1 sample is evened out to 2 per dp group by accelerate: the eval loss counted the
    # repeated samples, 4.858189 against one process's 4.858502; now they are left out of it)
    more = ["eval_target_logit_sum", "eval_input_sum", "eval_loss_mean"]
    keys = ["eval_loss", "eval_accuracy", "eval_valid", "eval_positions"]
    for key in keys + (more if world == 2 else ["eval_top_logit_sum"]):
        assert abs(got["metrics"][key] - want[key]) < 1e-4, (key, got["metrics"], want)
    predicted = torch.load(os.path.join(out_dir, job, "predicted.pt"))
    expected = reference.predict(token_dataset(EVAL_LENGTHS, seed=2))
    # the speed metrics count the steps of the dp groups (an SP group shares each batch): eval_steps_per_second
    # stood for 3 steps of 9 samples in batches of 2 at sp=2, where one process runs 5
    dp = world // 2
    steps = math.ceil(len(EVAL_LENGTHS) / (2 * dp))  # transformers' count over dp ranks, 5 in one process
    for ours, theirs, prefix in ((got["metrics"], want, "eval"), (got["predict"], expected.metrics, "test")):
        assert speed_counts(ours, prefix) == (len(EVAL_LENGTHS), steps), (prefix, ours)
        if dp == 1:
            assert speed_counts(theirs, prefix) == (len(EVAL_LENGTHS), steps), (prefix, theirs)
    assert abs(got["predict"]["test_loss"] - expected.metrics["test_loss"]) < 1e-4, (got["predict"], expected.metrics)
    unlabelled = token_dataset(EVAL_LENGTHS, seed=2).remove_columns("labels")
    bare = reference.predict(unlabelled)
    assert bare.label_ids is None and predicted["bare_labels"] is None
    assert "test_loss" not in got["bare"] and "eval_loss" not in got["bare_eval"]
    assert sorted(got["bare_eval"]) == sorted(reference.evaluate(unlabelled))
    assert len(predicted["predictions"]) == len(predicted["bare"]) == len(EVAL_LENGTHS)
    differ = 0
    for row, n in enumerate(EVAL_LENGTHS):
        torch.testing.assert_close(predicted["labels"][row][:n], torch.as_tensor(expected.label_ids[row][:n]))
        assert (predicted["labels"][row][n:] == -100).all()
        ours, theirs = predicted["predictions"][row][:n], torch.as_tensor(first(expected.predictions)[row][:n])
        ours_bare, theirs_bare = predicted["bare"][row][:n], torch.as_tensor(first(bare.predictions)[row][:n])
        if argmax:
            differ += int((ours != theirs).sum()) + int((ours_bare != theirs_bare).sum())
        else:
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours_bare, theirs_bare, atol=1e-5, rtol=1e-5)
    assert differ <= 2  # the same next-token guesses (a near tie apart)


def test_moe_predictions_beside_logits_refused_then_equal_one_process_when_ignored(world2_sp, out_dir):
    """Mixtral with output_router_logits: one process hands compute_metrics (aux_loss, logits, router_logits), so SP,
    which gathers only the logits, refuses; with those keys in ignore_keys both give the logits alone, and the same
    metrics and loss (the load-balancing term over the whole sequence)."""
    from transformers import Trainer

    job = "trainer_metrics_moe_sp2"
    assert_case(world2_sp, job, 2)
    reference = Trainer(
        model=moe_model(),
        args=trainer_args("unused"),
        eval_dataset=token_dataset(EVAL_LENGTHS, seed=2),
        data_collator=pad_collate,
        compute_metrics=token_metrics,
    )
    want, got = reference.evaluate(ignore_keys=MOE_IGNORED), result(out_dir, job)["metrics"]
    for key in ("eval_loss", "eval_accuracy", "eval_valid", "eval_positions", "eval_target_logit_sum"):
        assert abs(got[key] - want[key]) < 1e-4, (key, got, want)


def test_batch_eval_metrics_get_the_inputs_of_one_process(world2_sp, out_dir, tmp_path):
    """batch_eval_metrics with include_for_metrics=["inputs", "loss"]: compute_metrics gets each eval batch as one
    process collated it (whole rows of input_ids, attention_mask and labels, left-padded), not this rank's shard with
    what SP added (shift_labels, position_ids, the token counts), and the batch losses of one process."""
    from transformers import Trainer

    from tests.integrations.jobs import batch_eval_inputs

    assert_case(world2_sp, "batch_eval_inputs_sp2", 2)
    got = torch.load(os.path.join(out_dir, "batch_eval_inputs_sp2", "batches.pt"))
    want = batch_eval_inputs(Trainer, str(tmp_path))
    assert len(got) == len(want) == 5
    for ours, theirs in zip(got, want, strict=True):
        assert sorted(ours["inputs"]) == sorted(theirs["inputs"]) == ["attention_mask", "input_ids", "labels"]
        for key, value in theirs["inputs"].items():
            torch.testing.assert_close(ours["inputs"][key], value, atol=0, rtol=0, msg=key)
        torch.testing.assert_close(ours["losses"], theirs["losses"], atol=LOSS_ATOL, rtol=0)


@pytest.mark.parametrize("job", ["trainer_sp2_gas2", FSDP2_JOB])
def test_checkpoints_and_final_model_are_plain_hf(world2_sp, out_dir, job):
    """Checkpoints load in plain transformers with their default attention, and match the saved weights."""
    from transformers import LlamaForCausalLM

    run = os.path.join(out_dir, job)
    assert sorted(d for d in os.listdir(run) if d.startswith("checkpoint-")) == ["checkpoint-4", "checkpoint-8"]
    for folder in ("checkpoint-4", "checkpoint-8", "final"):
        with open(os.path.join(run, folder, "config.json")) as f:
            assert "ulysses" not in f.read()
        model = LlamaForCausalLM.from_pretrained(os.path.join(run, folder))
        assert model.config._attn_implementation == "sdpa"
        assert not hasattr(model, "_ulysses_sp_state")
    final = weights(out_dir, job)
    last = weights(out_dir, job, "checkpoint-8/model.safetensors")
    for name in final:
        torch.testing.assert_close(last[name], final[name], atol=0, rtol=0)


# ------------------------------------------------------------------------------------- TRL
def test_sft_packing_dp1_sp2_gas2_equals_dp2_sp1_gas1(world2_plain, world2_sp, out_dir):
    """SFTTrainer with padding-free packing (documents restart position_ids and cross shard boundaries)."""
    assert_case(world2_plain, "sft_dp2", 2)
    assert_case(world2_sp, "sft_sp2_gas2", 2)
    assert_same_run(out_dir, "sft_dp2", "sft_sp2_gas2")
    assert result(out_dir, "sft_sp2_gas2")["global_step"] >= 3


@pytest.mark.parametrize(
    "job, world, args",
    [("sft_sp2_gas2", 2, {}), ("sft_moe_own_tokens_dp2_sp2", 4, {"router_aux_loss_coef": 0.5, **OWN_TOKENS})],
)
def test_sft_eval_under_sp_equals_one_process_eval(request, out_dir, job, world, args):
    """TRL's eval (packed rows, fused LM head) run sharded reports the one-process SFTTrainer eval loss on the saved
    weights; an MoE's with TRL's load-balancing term under average_tokens_across_devices=False too."""
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    from tests.integrations.common import sft_args, tokenizer

    assert_case(request.getfixturevalue("world2_sp" if world == 2 else "world4"), job, world)
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, job, "final")),
        args=sft_args(os.path.join(out_dir, f"{job}_ref"), **args),
        train_dataset=token_dataset(TRAIN_LENGTHS, seed=1).remove_columns("labels"),  # required, not used
        eval_dataset=token_dataset(EVAL_LENGTHS, seed=2).remove_columns("labels"),
        processing_class=tokenizer(),
    )
    want = trainer.evaluate()["eval_loss"]
    assert abs(result(out_dir, job)["eval_loss"] - want) < LOSS_ATOL, (result(out_dir, job)["eval_loss"], want)


def test_sft_moe_load_balancing_term_dp2_sp2_equals_one_process(world4, out_dir):
    """TRL's MoE load-balancing term (router_aux_loss_coef, weighted 0.5 here) over each dp replica's micro-batch,
    as TRL adds it in one process (dp2 x sp2 x GAS 2 against GAS 4): losses, weights, and the eval loss, TRL's
    eval_aux_loss metric and compute_metrics' before and after training (with the tiled loss on, which TRL's eval
    forward for the logits must not reach with the targets; its outputs hold the router's beside the logits, which
    TRL hands on alone)."""
    from trl import SFTTrainer

    from tests.integrations.common import sft_args, token_metrics, tokenizer

    job = "sft_moe_aux_dp2_sp2_gas2"
    assert_case(world4, job, 4)
    reference = SFTTrainer(
        model=build("mixtral", kv_heads=2),
        args=sft_args(os.path.join(out_dir, "sft_moe_ref"), router_aux_loss_coef=0.5, gradient_accumulation_steps=4),
        train_dataset=token_dataset(TRAIN_LENGTHS, seed=1).remove_columns("labels"),
        eval_dataset=token_dataset(EVAL_LENGTHS, seed=2).remove_columns("labels"),
        processing_class=tokenizer(),
        compute_metrics=token_metrics,
    )
    ours = result(out_dir, job)

    def same_eval(got: dict, want: dict) -> None:
        assert abs(got["eval_loss"] - want["eval_loss"]) < LOSS_ATOL, (got["eval_loss"], want["eval_loss"])
        for key in ("eval_valid", "eval_positions", "eval_accuracy", "eval_target_logit_sum"):
            torch.testing.assert_close(got.get("eval", got)[key], want[key], rtol=1e-5, atol=1e-4, msg=key)
        # TRL's metric: the mean of each eval step's mean over the ranks (under dp, of dp batches at a time, as
        # under plain DDP): close to one process's mean over its batches, not equal; a per-shard or scaled term
        # would be far off
        torch.testing.assert_close(got["eval_aux_loss"], want["eval_aux_loss"], rtol=1e-3, atol=0)

    same_eval(ours["eval_first"], reference.evaluate())  # before any training step (no accumulation count yet)
    reference.train()
    assert_trained_as(out_dir, job, reference)
    same_eval(ours, reference.evaluate())


def test_sft_moe_eval_with_repeated_samples_dp2_sp2_equals_one_process(world4, out_dir):
    """TRL's load-balancing term in the eval loss, unpacked batches of 2 over 9 samples: at dp=2 the last batch is
    evened out with repeated samples, which count in no part of its loss (the term counted their router tokens:
    off by -3.0e-4)."""
    from trl import SFTTrainer

    from tests.integrations.common import sft_moe_eval_kwargs

    job = "sft_moe_eval_dp2_sp2"
    assert_case(world4, job, 4)
    want = SFTTrainer(**sft_moe_eval_kwargs(os.path.join(out_dir, "sft_moe_eval_ref"))).evaluate()["eval_loss"]
    assert abs(result(out_dir, job)["eval_loss"] - want) < LOSS_ATOL, (result(out_dir, job), want)


# ------------------------------------------------------------------------------------- PEFT
def test_lora_under_sp_equals_one_process(world2_sp, out_dir):
    """LoRA through the PEFT wrapper: SP=2/GAS=2 against one process/GAS=2; losses, adapter weights, eval loss."""
    from peft import PeftModel
    from transformers import Trainer

    from tests.integrations.jobs import lora_model

    assert_case(world2_sp, "lora_sp2", 2)
    reference = Trainer(
        model=lora_model(),
        args=trainer_args(
            os.path.join(out_dir, "lora_ref"), gradient_accumulation_steps=2, num_train_epochs=1, learning_rate=1e-2
        ),
        train_dataset=token_dataset(TRAIN_LENGTHS, seed=1),
        eval_dataset=token_dataset(EVAL_LENGTHS, seed=2),
        data_collator=pad_collate,
    )
    reference.train()
    ours = result(out_dir, "lora_sp2")
    torch.testing.assert_close(
        torch.tensor(ours["losses"]), torch.tensor(train_losses(reference.state.log_history)), atol=LOSS_ATOL, rtol=0
    )
    assert abs(ours["eval_loss"] - reference.evaluate()["eval_loss"]) < LOSS_ATOL
    saved = PeftModel.from_pretrained(build("llama"), os.path.join(out_dir, "lora_sp2", "final"))
    expected = dict(reference.model.named_parameters())
    trained = [name for name, p in saved.named_parameters() if "lora_" in name]
    assert trained
    for name in trained:
        torch.testing.assert_close(saved.get_parameter(name), expected[name], atol=WEIGHT_ATOL, rtol=0, msg=name)


# ------------------------------------------------------------------------------------- Accelerate
def one_process_loop(steps: int, batch_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The Accelerate jobs' loop in one process on the full batches (plain attention, the model's own loss)."""
    from torch.utils.data import DataLoader

    model = build("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step, batch in enumerate(DataLoader(token_dataset(TRAIN_LENGTHS, seed=1), batch_size, collate_fn=pad_collate)):
        if step == steps:
            break
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "job, world, steps, batch_size",
    [
        ("accelerate_ddp_sp2", 2, 6, 2),
        ("accelerate_fsdp2_sp2", 2, 6, 2),
        ("accelerate_dp2_sp2", 4, 4, 4),
        ("accelerate_stream_sp2", 2, 6, 2),
        ("accelerate_stream_dp2_sp2", 4, 4, 4),
    ],
)
def test_accelerate_loop_equals_one_process(world2_sp, world4, out_dir, job, world, steps, batch_size):
    """SequenceParallelConfig.prepare on DDP, on FSDP2 (fully_shard, DTensor parameters) and on dp=2 x sp=2; and over
    a datasets.IterableDataset of 4 shards (at sp=2 collated in a worker started by forkserver): accelerate gave each
    of the ranks its own shards (refused: 'cannot find how DataLoaderShard splits batches'), and a dp=1 shard did not
    pickle."""
    assert_case(world2_sp if world == 2 else world4, job, world)
    expected_losses, expected_weights = one_process_loop(steps, batch_size)
    got = result(out_dir, job)
    assert got["batches"] == len(TRAIN_LENGTHS) // batch_size  # every SP group rank sees its dp share
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), atol=LOSS_ATOL, rtol=0)
    got_weights = torch.load(os.path.join(out_dir, job, "weights.pt"))
    for name, value in expected_weights.items():
        torch.testing.assert_close(got_weights[name], value, atol=WEIGHT_ATOL, rtol=0, msg=name)


@pytest.mark.parametrize(
    "job, world",
    [("accelerate_metrics_sp2", 2), ("accelerate_metrics_dp2_sp2", 4), ("accelerate_metrics_ulysses2_ring2", 4)],
)
def test_accelerate_gather_for_metrics_gives_every_sample_once_whole(world2_sp, world4, out_dir, job, world):
    """``loss_fn.gather_for_metrics`` over an eval set whose last batch is partial (9 samples, batches of 2): the
    samples come back once each in the dataset's order (Accelerate's own gather returns each SP group's batch sp
    times), and per-token tensors as whole sequences (zigzag undone under the ring): the tokens and targets of
    one process, and its logits at every real token; past a sample's length only padding (-100 targets)."""
    assert_case(world2_sp if world == 2 else world4, job, world)
    got = torch.load(os.path.join(out_dir, job, "gathered.pt"))
    data = token_dataset(EVAL_LENGTHS, seed=2)
    assert got["idx"] == list(range(len(EVAL_LENGTHS)))
    assert got["names"] == [f"s{i}" for i in range(len(EVAL_LENGTHS))]  # accelerator.gather_for_metrics of objects
    assert len(got["input_ids"]) == len(got["shift_labels"]) == len(got["logits"]) == len(EVAL_LENGTHS)
    model = build("llama").eval()
    for i, n in enumerate(EVAL_LENGTHS):
        ids, labels = torch.tensor(data[i]["input_ids"]), torch.tensor(data[i]["labels"])
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0]
        torch.testing.assert_close(got["input_ids"][i][:n], ids)
        torch.testing.assert_close(got["shift_labels"][i][: n - 1], labels[1:])
        assert (got["shift_labels"][i][n - 1 :] == -100).all()
        torch.testing.assert_close(got["logits"][i][:n], logits, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------- bad input
def test_bad_input_raises_clear_errors_on_every_rank(world2_sp):
    """Heads, attention implementation, core, compute_metrics, sp_size, world size, a model sharded by hand before the
    Trainer (DDP would wrap its DTensor parameters), a collator without labels."""
    assert_case(world2_sp, "bad_input", 2)


def test_a_batch_refused_on_one_rank_raises_on_every_rank(world2_sp):
    """Collated in dataloader workers under SP (Trainer train and eval, Accelerate), batches that differ inside the SP
    group, and two replicas with no sequence split (sp=1): a ValueError on both ranks; a dispatcher at sp=1 trains."""
    assert_case(world2_sp, "refusal_on_one_rank", 2)


def test_other_peft_adapters_under_sp_equal_one_process(world2_sp, out_dir):
    """DoRA, IA3, LLaMA-Adapter's adaption prompt, LoRA with modules_to_save (lm_head and embedding: the tiled loss
    in the trained copy), with trainable_token_indices and on lm_head too (W + scaling x B @ A in the tiled loss) at
    SP=2: the per-step losses and the eval loss of one
    process (prompt, prefix and p-tuning are refused: tests/unit/test_core_single.py)."""
    from transformers import Trainer

    from tests.integrations.jobs import PEFT_KINDS, peft_model

    assert_case(world2_sp, "peft_kinds_sp2", 2)
    got = result(out_dir, "peft_kinds_sp2")
    for kind in PEFT_KINDS:
        reference = Trainer(
            model=peft_model(kind),
            args=trainer_args(os.path.join(out_dir, f"peft_{kind}_ref"), max_steps=3, learning_rate=1e-2),
            train_dataset=token_dataset(TRAIN_LENGTHS, seed=1),
            eval_dataset=token_dataset(EVAL_LENGTHS, seed=2),
            data_collator=pad_collate,
        )
        reference.train()
        want = torch.tensor(train_losses(reference.state.log_history))
        torch.testing.assert_close(torch.tensor(got[kind]["losses"]), want, atol=LOSS_ATOL, rtol=0, msg=kind)
        assert abs(got[kind]["eval_loss"] - reference.evaluate()["eval_loss"]) < LOSS_ATOL, kind


def test_neftune_noise_has_one_process_magnitude_under_sp(world2_sp):
    assert_case(world2_sp, "neftune_sp2", 2)


def test_a_batch_refused_in_a_worker_of_one_replica_raises_on_every_rank(world4):
    assert_case(world4, "refusal_in_worker_dp2_sp2", 4)


def test_split_batches_that_do_not_split_over_the_dp_groups_are_refused_before_training(world4):
    assert_case(world4, "split_batches_refused_dp2_sp2", 4)


def test_every_job_is_checked(world2_plain, world2_sp, world4):
    checked = (
        {
            "trainer_dp2",
            "sft_dp2",
            "trainer_own_tokens_dp2",
            "trainer_smoothed_own_tokens_dp2",
            "trainer_moe_own_tokens_dp2",
            "sft_moe_own_tokens_dp2",
        },
        {
            "trainer_sp2_gas2",
            "trainer_sp2_resume",
            "trainer_fsdp2_sp2_gas2",
            "sft_sp2_gas2",
            "lora_sp2",
            "no_targets_sp2",
            "loss_override_sp2",
            "neftune_sp2",
            "trainer_embeds_sp2",
            "peft_kinds_sp2",
            "trainer_metrics_sp2",
            "trainer_metrics_moe_sp2",
            "batch_eval_inputs_sp2",
            "accelerate_ddp_sp2",
            "accelerate_fsdp2_sp2",
            "accelerate_stream_sp2",
            "trainer_stream_sp2",
            "accelerate_metrics_sp2",
            "bad_input",
            "refusal_on_one_rank",
        },
        {
            "trainer_dp2_sp2",
            "accelerate_dp2_sp2",
            "accelerate_stream_dp2_sp2",
            "trainer_metrics_dp2_sp2",
            "accelerate_metrics_dp2_sp2",
            "accelerate_metrics_ulysses2_ring2",
            "trainer_moe_aux_dp2_sp2_gas2",
            "sft_moe_aux_dp2_sp2_gas2",
            "sft_moe_eval_dp2_sp2",
            "refusal_in_worker_dp2_sp2",
            "split_batches_refused_dp2_sp2",
            "trainer_own_tokens_dp2_sp2",
            "trainer_smoothed_own_tokens_dp2_sp2",
            "trainer_moe_own_tokens_dp2_sp2",
            "sft_moe_own_tokens_dp2_sp2",
        },
    )
    for results, jobs in zip((world2_plain, world2_sp, world4), checked, strict=True):
        assert set(results) == jobs, set(results) ^ jobs
