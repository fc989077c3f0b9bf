"""Tiny data, tokenizer, collator and run settings shared by the integration jobs and the one-process references."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from datasets import Dataset

from tests.helpers.models import VOCAB, build

# Odd and even lengths, some longer than a shard: sequences of every kind reach the model.
TRAIN_LENGTHS = (9, 17, 23, 12, 31, 16, 37, 20, 11, 28, 15, 33, 19, 26, 13, 21)
EVAL_LENGTHS = (61, 40, 33, 77, 50, 45, 29, 66, 38)  # 9: the last eval batch of 2 is partial


def token_dataset(lengths: tuple[int, ...], seed: int, prompt: int = 3) -> Dataset:
    """``input_ids`` of the given lengths and ``labels`` that ignore the first ``prompt`` tokens of each row."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    labels = [[-100] * prompt + r[prompt:] for r in rows]
    return Dataset.from_dict({"input_ids": rows, "labels": labels})


def no_target_dataset(seed: int) -> Dataset:
    """4 rows, the second with every label -100: in batches of 1 row, in order, a step (or an eval batch) of no
    targets."""
    rows = token_dataset((40, 30, 20, 50), seed=seed, prompt=0).to_dict()
    rows["labels"][1] = [-100] * len(rows["labels"][1])
    return Dataset.from_dict(rows)


def no_target_trainer(trainer_class, out: str, **kwargs):
    """A Trainer (``UlyssesTrainer`` with ``sp_size=`` in kwargs) over :func:`no_target_dataset`, batches of 1 row
    in order, clipping on (the gradient norm is logged)."""
    args = trainer_args(out, per_device_train_batch_size=1, per_device_eval_batch_size=1, num_train_epochs=1)
    args.train_sampling_strategy, args.max_grad_norm = "sequential", 1.0
    data = no_target_dataset(seed=5)
    return trainer_class(
        model=build("llama"), args=args, train_dataset=data, eval_dataset=data, data_collator=pad_collate, **kwargs
    )


def stream_trainer(trainer_class, out: str, **kwargs):
    """A Trainer (``UlyssesTrainer`` with ``sp_size=`` in kwargs) for 6 steps over the train and eval sets as
    ``datasets.IterableDataset``s of 4 shards each (as a streamed dataset of many files: accelerate gives each rank
    its own shards once there are as many as ranks); the last eval batch holds 1 of 2 samples. Under SP batches are
    not dispatched from rank 0 (refused there), as docs/integrations.md says; one process keeps accelerate's default."""
    sp = {"accelerator_config": {"dispatch_batches": False}} if "sp_size" in kwargs else {}
    train, held_out = (token_dataset(lengths, seed=seed) for lengths, seed in ((TRAIN_LENGTHS, 1), (EVAL_LENGTHS, 2)))
    return trainer_class(
        model=build("llama"),
        args=trainer_args(out, max_steps=6, **sp),
        train_dataset=train.to_iterable_dataset(num_shards=4),
        eval_dataset=held_out.to_iterable_dataset(num_shards=4),
        data_collator=pad_collate,
        **kwargs,
    )


def pad_collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """A user's collator: right-pad input_ids (0), attention_mask and labels (-100, when the features have them); no
    position_ids."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros(len(features), width, dtype=torch.long)
    labels = torch.full((len(features), width), -100, dtype=torch.long)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n] = torch.tensor(f["input_ids"])
        mask[row, :n] = 1
        labels[row, :n] = torch.tensor(f.get("labels", f["input_ids"]))
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return batch if "labels" in features[0] else {k: v for k, v in batch.items() if k != "labels"}


def embeds_collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """A user's collator for a model fed embeddings (another tower's tokens, a soft prompt): :func:`pad_collate`'s
    batch with ``inputs_embeds`` ``[b, N, 32]`` (the tiny models' hidden size) from a fixed table in place of
    ``input_ids`` (zeros where padded)."""
    batch = pad_collate(features)
    table = torch.randn(VOCAB, 32, generator=torch.Generator().manual_seed(11))
    return {"inputs_embeds": table[batch.pop("input_ids")] * batch["attention_mask"][..., None], **batch}


def drop_labels_collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """A broken collator that loses the labels."""
    batch = pad_collate(features)
    del batch["labels"]
    return batch


def tokenizer():
    """A word-level tokenizer over the tiny vocabulary (``<pad>`` = 0, ``<eos>`` = 1), built offline."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


# fp32 on CPU, constant learning rate, no clipping, a log entry per optimizer step, no saving unless asked.
RUN_SETTINGS = dict(
    gradient_accumulation_steps=1,
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    max_grad_norm=0.0,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    seed=7,
    use_cpu=True,
    bf16=False,
    ddp_timeout=120,
    disable_tqdm=True,
)


def trainer_args(out: str, **overrides):
    """TrainingArguments for the equivalence runs: batches of 2 rows, 2 epochs."""
    from transformers import TrainingArguments

    sizes = dict(per_device_train_batch_size=2, per_device_eval_batch_size=2, num_train_epochs=2)
    return TrainingArguments(output_dir=out, **{**RUN_SETTINGS, **sizes, **overrides})


def checkpointing_arg() -> str:
    """TrainingArguments' activation checkpointing flag: ``activation_checkpointing`` (``gradient_checkpointing``,
    its deprecated alias, before transformers renamed it)."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def sft_args(out: str, **overrides):
    """SFTConfig with padding-free packing (bfd) into rows of at most 48 tokens, one row per batch, 1 epoch."""
    from trl import SFTConfig

    sizes = dict(per_device_train_batch_size=1, per_device_eval_batch_size=1, num_train_epochs=1)
    return SFTConfig(output_dir=out, packing=True, max_length=48, **{**RUN_SETTINGS, **sizes, **overrides})


def sft_moe_eval_kwargs(out: str) -> dict:
    """UlyssesSFTTrainer / SFTTrainer arguments for an eval of a tiny Mixtral with TRL's load-balancing term (0.5) over
    the 9 eval samples, unpacked in batches of 2: at dp=2 accelerate evens out the last batch with repeated samples."""
    from trl import SFTConfig

    data = token_dataset(EVAL_LENGTHS, seed=2).remove_columns("labels")
    sizes = dict(per_device_train_batch_size=2, per_device_eval_batch_size=2)
    args = SFTConfig(output_dir=out, max_length=128, router_aux_loss_coef=0.5, **{**RUN_SETTINGS, **sizes})
    model = build("mixtral", kv_heads=2)
    return dict(model=model, args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer())


def token_metrics(prediction) -> dict[str, float]:
    """A user's ``compute_metrics``: next-token accuracy over the valid targets, their count, and (given logits, not
    argmax predictions from ``preprocess_logits_for_metrics``) the sum of the targets' logits."""
    predictions, labels = prediction.predictions, torch.as_tensor(prediction.label_ids)
    targets = labels[:, 1:]
    valid = targets != -100
    out = {"valid": float(valid.sum()), "positions": float(targets.numel())}  # the latter: as long rows as one process
    if isinstance(predictions, tuple):  # argmax_and_top's (guesses, top logits)
        predictions, top = predictions
        out["top_logit_sum"] = float(torch.as_tensor(top)[:, :-1][valid].double().sum())
    guesses = torch.as_tensor(predictions)[:, :-1]
    if guesses.dim() == 3:  # logits [b, N - 1, vocab]
        picked = guesses.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [b, N - 1]
        out["target_logit_sum"] = float(picked[valid].double().sum())
        guesses = guesses.argmax(-1)
    out["accuracy"] = float((guesses == targets)[valid].double().mean())
    if prediction.inputs is not None:  # include_for_metrics "inputs": whole rows, padded with 0 / -100
        inputs = torch.as_tensor(prediction.inputs)
        out["input_sum"] = float(inputs[inputs > 0].double().sum())
    if prediction.losses is not None:  # include_for_metrics "loss": each sample's batch loss
        out["loss_mean"] = float(torch.as_tensor(prediction.losses).double().mean())
    return out


def first(predictions):
    """The guesses of predictions that may be argmax_and_top's pair."""
    return predictions[0] if isinstance(predictions, tuple) else predictions


def argmax_and_top(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A user's ``preprocess_logits_for_metrics`` that keeps two tensors: the guesses and their logits."""
    top = logits.max(-1)
    return top.indices, top.values


def train_losses(log_history: list[dict]) -> list[float]:
    """The per-step logged training losses."""
    return [entry["loss"] for entry in log_history if "loss" in entry and "train_loss" not in entry]


def write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f)


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def record_case(out: str, train: Callable[[], tuple[dict, dict]]) -> str:
    """Run a random case's ``train()`` on this rank (``(result, weights)``); rank 0 writes them under ``out``.
    "ok", or "refused: <the ValueError>"."""
    try:
        result, weights = train()
    except ValueError as error:
        return f"refused: {error}"
    if dist.get_rank() == 0:
        write_json(os.path.join(out, "result.json"), result)
        torch.save(weights, os.path.join(out, "weights.pt"))
    return "ok"


def expect_error(error: type[Exception], fragment: str, fn: Callable[[], object]) -> None:
    """Call ``fn``: it must raise ``error`` with ``fragment`` in its message."""
    try:
        fn()
    except error as exc:
        assert fragment in str(exc), f"expected {fragment!r} in the message, got: {exc}"
        return
    raise AssertionError(f"expected {error.__name__} mentioning {fragment!r}")
