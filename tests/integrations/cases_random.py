"""Random Trainer / SFTTrainer cases: architecture x heads x layout x batch x accumulation x padding or packing x
activation checkpointing x LoRA (lm_head trained too, as PEFT's modules_to_save) x tiled loss, MLP and norms x head
chunks x a ring x label smoothing x clipping x schedule x token counting x dataloader workers x sampling x evaluation
during training x an MoE's load-balancing term x compute_metrics x a resume from a halfway checkpoint x FSDP2 (the
model sharded as it loads), each a short training run plus an eval under Ulysses SP, compared afterwards with the
plain trainer in one process (unsharded; stopped and resumed at the same step where the case resumes, so that what
transformers or TRL do on a resume in one process is the reference too).

A case is drawn from ``(seed, index, world)`` alone, so every rank and the test draw the same one and a failure
is reproduced by its numbers. On the ranks :func:`run_case` trains and writes what it measured under
``$ULYSSES_IT_OUT/random/<seed>-<world>-<index>/`` (per-step losses and gradient norms, the eval loss, the
tokens counted, the trained weights); it returns ``"ok"`` or ``"refused: <ValueError>"``. The test runs
:func:`reference` (the same case, one process, the plain trainer: the same samples per optimizer step) and
compares. tests/integrations/test_random_trainer.py runs a fixed seed's first cases; a campaign::

    python -m tests.integrations.test_random_trainer --world 4 --seed 3 --count 20
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch
import torch.distributed as dist
from datasets import Dataset

from tests.helpers.models import VOCAB, build, router_aux_on
from tests.integrations.common import (
    RUN_SETTINGS,
    checkpointing_arg,
    pad_collate,
    record_case,
    token_metrics,
    tokenizer,
    train_losses,
)

ARCHS = (
    "llama", "qwen3", "mistral", "qwen2", "gemma2", "mixtral", "qwen3_moe", "deepseek_v3_mla_v4", "starcoder2",
    "granite", "glm4", "smollm3", "stablelm",
)  # fmt: skip
METRICS = ("accuracy", "valid", "target_logit_sum")  # what token_metrics reports
SEED_ENV, START_ENV, COUNT_ENV = "ULYSSES_SP_RANDOM_SEED", "ULYSSES_SP_RANDOM_START", "ULYSSES_SP_RANDOM_COUNT"


def random_case(seed: int, index: int, world: int) -> dict:
    """The parameters of case ``index`` of ``seed`` on ``world`` ranks (plain data: printed with a failure)."""
    r = random.Random(f"trainer/{seed}/{world}/{index}")
    dp = r.choice([1, 2]) if world == 4 else 1
    sp = world // dp
    heads = r.choice([4, 8])
    kind = r.choice(["trainer", "trainer", "sft"])
    batch = r.randint(1, 3)
    if dp == 1:  # one SP group sees every batch as one process does, a partial last one included
        samples, eval_samples = r.randint(3, 13), r.randint(1, 7)
    else:  # full batches, as many on each dp rank: accelerate would repeat samples to even them out (as DDP)
        samples, eval_samples = batch * dp * r.randint(1, 3), 0
    packing = kind == "sft" and dp == 1 and r.random() < 0.6  # packed rows: their number depends on the data
    arch = r.choice(ARCHS)
    case = dict(
        arch=arch,
        heads=heads,
        kv_heads=r.choice([h for h in (1, 2, 4, 8) if heads % h == 0]),
        attn="eager" if arch == "gemma2" else r.choice(["sdpa", "sdpa", "eager"]),  # softcapping: eager only
        dp=dp,
        sp=sp,
        kind=kind,
        batch=batch,
        accum=r.randint(1, 3),
        epochs=r.choice([1, 1, 2]),
        lengths=tuple(r.randint(3, 60) for _ in range(samples)),
        eval_lengths=tuple(r.randint(3, 60) for _ in range(eval_samples)),
        eval_batch=r.randint(1, 3),
        data_seed=r.randint(0, 99),
        pad="left" if kind == "trainer" and r.random() < 0.3 else "right",
        packing=packing,
        max_length=r.randint(24, 64) if kind == "sft" else None,
        checkpointing=r.random() < 0.4,
        lora=r.random() < 0.25,
        tiled_loss=r.choice([None, True, False]),
        head_chunks=r.choice([None, None, 1, 2]),
        max_grad_norm=r.choice([0.0, 1.0]),
        schedule=r.choice([("constant", 0), ("linear", 1), ("cosine", 2)]),
        tokens_seen=r.choice(["no", "all", "non_padding"]),
        # an MoE's load-balancing term off: SFTConfig(router_aux_loss_coef=0.0) (TRL's); under the Trainer, on
        # means output_router_logits=True (weighted 0.5)
        router_aux_off=r.random() < 0.5,
        # collating in a dataloader worker process (spawned here: a worker per rank on 2 cores; 2 ranks only)
        workers=r.choice([0, 0, 1]) if world == 2 else 0,
        sampling=r.choice(["random", "random", "sequential", "group_by_length"]),
        eval_every=r.choice([None, None, 2]),  # evaluate during training too, then train on
        lora_all=r.random() < 0.5,  # LoRA on every attention projection (else q and v only)
        # stopped after half the optimizer steps with a checkpoint, then resumed from it by a new trainer (under SP
        # and in the one-process reference alike)
        resume=r.random() < 0.3,
        # under SP: the model sharded with FSDP2 over the world as it loads (transformers' DistributedConfig), which
        # the Trainer leaves unwrapped (its adapters, if any, replicated and averaged by the Trainer)
        fsdp2=r.random() < 0.3,
        # the tiled MLP and norms (None: the trainer's default, on), in chunks of a few tokens so that rows split
        tiled_mlp=r.choice([None, None, False]),
        tiled_norms=r.choice([None, False]),
        mlp_chunk=r.choice([None, 4, 7, 16]),
        # with checkpointing: transformers' every_n_layers (the other layers keep their activations)
        checkpoint_every=r.choice([1, 2]),
        # compute_metrics (next-token accuracy, valid targets, the targets' logits) from whole-sequence logits
        metrics=r.random() < 0.4,
        # under SP: accelerator_config={"split_batches": True}, each dataloader batch (batch x dp samples) split over
        # the dp groups (accelerate alone would split it over every rank): the same samples per micro-batch
        split=r.random() < 0.3,
        # with LoRA: lm_head trained too, as PEFT's modules_to_save copy (the tiled loss runs in the copy)
        lora_head=r.random() < 0.4,
        # under SP: a ring of 2 inside the SP group (hybrid Ulysses x Ring, zigzag token order; sp_ring=)
        ring=r.choice([None, None, 2]),
        # the Trainer's label_smoothing_factor (refused under TRL's SFTTrainer, whose own loss shifts the shard)
        smoothing=r.choice([0.0, 0.0, 0.1]) if kind == "trainer" else 0.0,
        # TRL's loss_type: "dft" weighs each target's loss by its probability (detached), per token
        loss_type=r.choice(["nll", "dft"]) if kind == "sft" else "nll",
        # SFT: a completion_mask column (the loss on a row's tokens after its first few only, TRL's
        # completion_only_loss). (TRL's activation_offloading needs an accelerator: not drawn.)
        prompt=r.choice([0, 0, 1, 4]) if kind == "sft" else 0,
        # SFT without packing: TRL's padding_free collation (each batch flattened into one row, positions restarting)
        padding_free=kind == "sft" and not packing and r.random() < 0.5,
        # with checkpointing: torch's reentrant checkpoint (use_reentrant=True; else transformers' default)
        reentrant=r.random() < 0.3,
        # with compute_metrics: TrainingArguments(batch_eval_metrics=True), the metrics summed batch by batch
        batch_metrics=r.random() < 0.4,
        # TrainingArguments(dataloader_drop_last=True): a partial last batch (train and eval) dropped
        drop_last=r.random() < 0.25,
    )
    if case["padding_free"]:
        case["max_length"] = None  # TRL does not truncate padding-free batches without packing (and refuses it)
    if case["fsdp2"]:
        # transformers' Trainer refuses checkpoints with optimizer state for a model sharded at load time
        # ("Resuming is not supported ..."; save_only_model=True is its way)
        case["resume"] = False
    if case["fsdp2"]:
        # PEFT's modules_to_save deep-copies lm_head, which FSDP2 refuses for a module it sharded at load time
        # (in get_peft_model, before any trainer)
        case["lora_head"] = False
    if case["tiled_mlp"] is False and case["tiled_norms"] is False:
        case["mlp_chunk"] = None  # a chunk size with no tiling is refused (the trainers' own check)
    if case["sampling"] == "group_by_length" and dp > 1:
        # over dp ranks a step's micro-batches hold other samples than the one process's: losses differ from the
        # first step under plain DDP too (sp=1: the same losses as dp2 x sp2), so not a sequence-parallel matter
        case["sampling"] = "random"
    return case


# ----------------------------------------------------------------------------------------------- the pieces
def _rows(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def dataset(case: dict, eval_set: bool = False) -> Dataset | None:
    """The case's rows: ``input_ids`` (SFT) or ``input_ids`` and ``labels`` ignoring a prompt of 2 tokens."""
    lengths = case["eval_lengths"] if eval_set else case["lengths"]
    if not lengths:
        return None
    rows = _rows(lengths, case["data_seed"] + eval_set)
    if case["kind"] == "sft" and case.get("prompt"):  # TRL folds the mask into the labels
        masks = [[0] * case["prompt"] + [1] * (len(row) - case["prompt"]) for row in rows]
        return Dataset.from_dict({"input_ids": rows, "completion_mask": masks})
    if case["kind"] == "sft":
        return Dataset.from_dict({"input_ids": rows})
    return Dataset.from_dict({"input_ids": rows, "labels": [[-100] * 2 + row[2:] for row in rows]})


class BatchTokenMetrics:
    """``compute_metrics`` under ``batch_eval_metrics=True``: :func:`token_metrics` added up over the eval batches,
    reported with the last (``compute_result``)."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(("valid", "correct", "target_logit_sum"), 0.0)

    def __call__(self, prediction: Any, compute_result: bool) -> dict[str, float]:
        one = token_metrics(prediction)
        if one["valid"]:  # (a batch without targets has no accuracy)
            self.sums["valid"] += one["valid"]
            self.sums["correct"] += one["accuracy"] * one["valid"]
            self.sums["target_logit_sum"] += one["target_logit_sum"]
        if not compute_result:
            return {}
        sums, self.sums = self.sums, dict.fromkeys(self.sums, 0.0)
        accuracy = sums["correct"] / sums["valid"] if sums["valid"] else float("nan")
        return {"valid": sums["valid"], "accuracy": accuracy, "target_logit_sum": sums["target_logit_sum"]}


def left_pad_collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """``pad_collate`` with the padding on the left (a generation-style collator); labels -100 on padding."""
    batch = pad_collate(features)
    for row, mask in enumerate(batch["attention_mask"]):
        shift = int((mask == 0).sum())
        for key in batch:
            batch[key][row] = torch.roll(batch[key][row], shift)
    return batch


def model(case: dict, sharded_in: str | None = None) -> torch.nn.Module:
    """The case's tiny model (the same weights in every process), with LoRA adapters when the case asks;
    ``sharded_in``: saved there by rank 0 and loaded back sharded with FSDP2 over the world."""
    net = build(case["arch"], heads=case["heads"], kv_heads=case["kv_heads"], attn=case["attn"])
    if sharded_in is not None:
        net = _load_sharded(net, sharded_in)
    if case["kind"] == "trainer" and not case["router_aux_off"] and hasattr(net, "router_aux_loss_coef"):
        router_aux_on(net)
        # its outputs then hold the aux loss and router logits beside the logits: compute_metrics gets the logits
        # alone, in one process and under SP (which refuses the others, naming this setting)
        net.config.keys_to_ignore_at_inference = ["past_key_values", "aux_loss", "router_logits"]
    if not case["lora"]:
        return net
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in net.named_modules()}
    attention = ("q_proj", "k_proj", "v_proj", "o_proj") if case["lora_all"] else ("q_proj", "v_proj")
    targets = [n for n in (*attention, "q_b_proj", "kv_b_proj") if n in names] or "all-linear"
    saved = ["lm_head"] if case.get("lora_head") else None
    return get_peft_model(net, LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=saved))


def _load_sharded(net: torch.nn.Module, path: str) -> torch.nn.Module:
    """``net`` as transformers loads it sharded with FSDP2 over the world (``from_pretrained(distributed_config=
    DistributedConfig(fsdp_size=world))``): its parameters DTensors, the Trainer leaves it unwrapped."""
    from transformers.distributed import DistributedConfig

    if dist.get_rank() == 0:
        net.save_pretrained(path)
    dist.barrier()
    config = DistributedConfig(fsdp_size=dist.get_world_size())
    loaded = type(net).from_pretrained(
        path, distributed_config=config, attn_implementation=net.config._attn_implementation
    )
    assert loaded.is_distributed_loading_by_transformers, type(loaded).__name__
    return loaded


def training_args(case: dict, out: str, accum: int, split: bool = False) -> Any:
    """TrainingArguments (or SFTConfig) of the case; ``accum``: micro-batches per optimizer step here; ``split``:
    batches of ``dp`` times the case's, split over the dp groups (``split_batches``)."""
    scheduler, warmup = case["schedule"]
    times = case["dp"] if split else 1
    args = dict(
        RUN_SETTINGS,  # lr 1e-3 as test_equivalence: AdamW turns round-off in near-zero gradients into lr-sized steps
        output_dir=out,
        per_device_train_batch_size=case["batch"] * times,
        per_device_eval_batch_size=case["eval_batch"] * times,
        gradient_accumulation_steps=accum,
        num_train_epochs=case["epochs"],
        lr_scheduler_type=scheduler,
        warmup_steps=warmup,
        max_grad_norm=case["max_grad_norm"],
        include_num_input_tokens_seen=case["tokens_seen"],
        batch_eval_metrics=case["metrics"] and case["batch_metrics"],
        dataloader_drop_last=case["drop_last"],
        # AdamW's eps at 1e-8 turns the round-off in a gradient that is zero in exact arithmetic (a key bias
        # outside RoPE's dimensions) into steps near the learning rate, which would swamp the weight comparison
        adam_epsilon=1e-6,
        dataloader_num_workers=case["workers"],
        dataloader_persistent_workers=case["workers"] > 0,  # one worker start per dataloader, not per epoch
        train_sampling_strategy=case["sampling"],
        eval_strategy="steps" if case["eval_every"] and case["eval_lengths"] else "no",
        eval_steps=case["eval_every"],
        label_smoothing_factor=case["smoothing"],
        **{checkpointing_arg(): case["checkpointing"]},
    )
    if split:
        args["accelerator_config"] = {"split_batches": True}
    options = {"every_n_layers": case["checkpoint_every"]} if case["checkpoint_every"] > 1 else {}
    if case.get("reentrant"):
        options["use_reentrant"] = True
    if case["checkpointing"] and options:
        args[checkpointing_arg() + "_kwargs"] = options
    if case["kind"] == "sft":
        from trl import SFTConfig

        aux = {"router_aux_loss_coef": 0.0} if case["router_aux_off"] else {}
        sft = dict(packing=case["packing"], max_length=case["max_length"], loss_type=case["loss_type"], **aux)
        if case["padding_free"]:  # else TRL's default (on with packing)
            sft["padding_free"] = True
        if case.get("prompt"):  # TRL reads completion_mask only then (its default: for prompt/completion columns)
            sft["completion_only_loss"] = True
        return SFTConfig(**args, **sft)
    from transformers import TrainingArguments

    return TrainingArguments(**args)


def trainer(case: dict, out: str, sp: int | None) -> Any:
    """The case's trainer: plain in one process (``sp=None``; ``accum`` micro-batches of every dp rank), or
    UlyssesTrainer / UlyssesSFTTrainer with ``sp_size=sp`` and the case's SP options."""
    accum = case["accum"] * (case["dp"] if sp is None else 1)
    sharded = sp is not None and case["fsdp2"]
    kwargs: dict[str, Any] = dict(
        model=model(case, os.path.join(out, "sharded_model") if sharded else None),
        args=training_args(case, out, accum, split=sp is not None and case["split"]),
        train_dataset=dataset(case),
        eval_dataset=dataset(case, eval_set=True),
    )
    if case["metrics"]:
        kwargs["compute_metrics"] = BatchTokenMetrics() if case.get("batch_metrics") else token_metrics
    if case["kind"] == "sft":
        kwargs["processing_class"] = tokenizer()
    else:
        kwargs["data_collator"] = left_pad_collate if case["pad"] == "left" else pad_collate
    if sp is not None:
        options = dict(sp_size=sp, sp_tiled_loss=case["tiled_loss"], sp_head_chunks=case["head_chunks"])
        options.update(sp_ring=case["ring"])
        tiling = dict(sp_tiled_mlp=case["tiled_mlp"], sp_tiled_norms=case["tiled_norms"])
        kwargs.update(options, sp_mlp_chunk_tokens=case["mlp_chunk"])
        kwargs.update({k: v for k, v in tiling.items() if v is not None})  # None: the trainer's default
    if case["kind"] == "sft":
        from trl import SFTTrainer

        from ulysses_sp.integrations import UlyssesSFTTrainer

        return SFTTrainer(**kwargs) if sp is None else UlyssesSFTTrainer(**kwargs)
    from transformers import Trainer

    from ulysses_sp.integrations import UlyssesTrainer

    return Trainer(**kwargs) if sp is None else UlyssesTrainer(**kwargs)


def measure(run: Any) -> tuple[dict, dict[str, torch.Tensor]]:
    """Train (resuming from ``run.resume_from`` where set) and evaluate ``run``; what the comparison reads, and the
    trainable weights."""
    run.train(resume_from_checkpoint=getattr(run, "resume_from", None))
    history = run.state.log_history
    result = {
        "losses": train_losses(history),
        "grad_norms": [e["grad_norm"] for e in history if "grad_norm" in e],
        "global_step": run.state.global_step,
        "tokens_seen": run.state.num_input_tokens_seen,
        "trl_num_tokens": [e["num_tokens"] for e in history if "num_tokens" in e],  # TRL's metric
        "eval_losses": [e["eval_loss"] for e in history if "eval_loss" in e],  # during training
    }
    evaluated = run.evaluate() if run.eval_dataset is not None else {}
    result["eval_loss"] = evaluated.get("eval_loss")
    result["eval_metrics"] = {k: v for k, v in evaluated.items() if k.removeprefix("eval_") in METRICS}
    # (a sharded parameter gathered whole on every rank)
    weights = {n: _whole(p.detach()).clone() for n, p in run.model.named_parameters() if p.requires_grad}
    return result, weights


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def reference(case: dict, out: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The case in this process with the plain trainer (the test calls it; no process group)."""
    return measure(interrupted(case, out, sp=None))


# ----------------------------------------------------------------------------------------------- on the ranks
def case_dir(out: str, seed: int, world: int, index: int) -> str:
    return os.path.join(out, "random", f"{seed}-{world}-{index}")


def _stop_halfway() -> Any:
    """A TrainerCallback that saves a checkpoint after half the optimizer steps (one at least) and stops there."""
    from transformers import TrainerCallback

    class StopHalfway(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs) -> None:
            if state.global_step == max(1, state.max_steps // 2):
                control.should_save = control.should_training_stop = True

    return StopHalfway()


def interrupted(case: dict, out: str, sp: int | None) -> Any:
    """The case's trainer (``sp``: as in :func:`trainer`), resumed (in :func:`measure`) from a checkpoint another
    one saved halfway, when ``case["resume"]`` and the run has two optimizer steps or more; else the trainer of an
    uninterrupted run."""
    if not case["resume"]:
        return trainer(case, out, sp=sp)
    first = trainer(case, os.path.join(out, "first"), sp=sp)
    first.add_callback(_stop_halfway())
    first.train()
    # made after the first run: a trainer seeds torch's generator when it is made, and the training order of a
    # sampler that draws from it (group_by_length) depends on what ran in between
    run = trainer(case, out, sp=sp)
    if first.state.global_step < first.state.max_steps:  # else one optimizer step in all: nothing to resume
        run.resume_from = os.path.join(out, "first", f"checkpoint-{first.state.global_step}")
    return run


def run_case(case: dict, out: str) -> str:
    """The case under SP on this rank; rank 0 writes what it measured to ``out``. "ok", or "refused: ..."."""
    return record_case(out, lambda: measure(interrupted(case, out, sp=case["sp"])))


def _world(world: int) -> dict[str, str]:
    from tests.helpers.harness import run_cases

    seed, start = int(os.environ[SEED_ENV]), int(os.environ[START_ENV])
    out = os.environ["ULYSSES_IT_OUT"]
    results = {}

    def one(index: int) -> None:
        verdict = run_case(random_case(seed, index, world), case_dir(out, seed, world, index))
        if verdict != "ok":
            results[str(index)] = verdict

    indices = range(start, start + int(os.environ[COUNT_ENV]))
    ran = run_cases({str(i): (lambda i=i: one(i)) for i in indices})
    return {index: results.get(index, verdict) for index, verdict in ran.items()}


def world2() -> dict[str, str]:
    return _world(2)


def world4() -> dict[str, str]:
    return _world(4)
