"""Integration jobs (run by tests/integrations/jobs.py's entry points): a batch refused on ONE rank only.

A collator that refuses (or changes) the batch on rank 1 alone stands for a bad sample dealt to one rank. Every rank
must raise a ValueError, instead of the others going on into a collective (the forward's agreement, the gradient
all-reduce) that the stopped rank never reaches.
"""

from __future__ import annotations

import os
from unittest import mock

import torch
import torch.distributed as dist

from tests.helpers.models import build
from tests.integrations.common import TRAIN_LENGTHS, expect_error, pad_collate, token_dataset, trainer_args
from ulysses_sp.integrations import SequenceParallelCollator


def refused_on_rank1(features: list[dict]) -> dict[str, torch.Tensor]:
    """Rank 1's batch has labels a token short (refused there); RANK is inherited by dataloader workers."""
    batch = pad_collate(features)
    if os.environ["RANK"] == "1":
        batch["labels"] = batch["labels"][:, 1:]
    return batch


def different_on_rank1(features: list[dict]) -> dict[str, torch.Tensor]:
    """Rank 1 holds another batch than its SP peers (as a sampler split over the world would give it)."""
    batch = pad_collate(features)
    if os.environ["RANK"] == "1":
        batch["input_ids"][0, 0] += 1
    return batch


class _FixedLengthStream(torch.utils.data.IterableDataset):
    """An iterable dataset (accelerate dispatches its batches from process 0) of rows of one length."""

    def __iter__(self):
        gen = torch.Generator().manual_seed(0)
        for _ in range(8):
            ids = torch.randint(3, 100, (12,), generator=gen).tolist()
            yield {"input_ids": ids, "labels": ids}


def _trainer(collator, sp: int, workers: int = 0, data=None, **args):
    from ulysses_sp.integrations import UlyssesTrainer

    out = os.path.join(os.environ["ULYSSES_IT_OUT"], "refusal")
    return UlyssesTrainer(
        model=build("llama"),
        args=trainer_args(out, dataloader_num_workers=workers, **args),
        train_dataset=data if data is not None else token_dataset(TRAIN_LENGTHS[:8], seed=1),
        data_collator=collator,
        sp_size=sp,
    )


def _accelerate_first_batch(collator, sp: int, workers: int) -> None:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from ulysses_sp.integrations import SequenceParallelConfig

    data = token_dataset(TRAIN_LENGTHS[:8], seed=1)
    loader = DataLoader(data, batch_size=2, collate_fn=collator, num_workers=workers)
    _, loader, _ = SequenceParallelConfig(sp_size=sp).prepare(Accelerator(cpu=True), build("llama"), loader)
    next(iter(loader))


def _collated_in_a_worker(collator) -> dict:
    """A SequenceParallelCollator on two samples as a dataloader worker runs it (no process group there): the shard
    with its checks' verdict, or the verdict alone. (A real worker costs seconds to start.)"""
    features = [token_dataset(TRAIN_LENGTHS[:2], seed=1)[i] for i in range(2)]
    with mock.patch("torch.utils.data.get_worker_info", return_value=object()):
        return collator(features)


def refusal_on_one_rank() -> None:
    """World 2. Under SP (sp=2), collated in dataloader workers, which have no process group (the main process of
    each rank shares their verdict): a batch refused on rank 1 raises on both ranks in the Trainer's training (real
    workers) and evaluation, and in an Accelerate loop (real workers); batches that differ inside the SP group (the
    same-batch check, skipped in workers before) too. With two replicas and no sequence split (sp=1, dp=2),
    collated in the main process, and in gather_for_metrics: the same. A dispatching dataloader (an iterable
    dataset) at sp=1 collates on process 0 alone: no agreement runs there, and it trains, counting the tokens seen as
    plain DDP does (its slices of a batch are per row: it gets no full-batch counts)."""
    refused = "labels has shape" if dist.get_rank() == 1 else "sp_rank 1: malformed batch"
    expect_error(ValueError, refused, _trainer(refused_on_rank1, 2, workers=1).train)
    trainer = _trainer(refused_on_rank1, 2)
    model, device, layout = trainer.model, trainer.args.device, trainer.sp_layout
    batch = _collated_in_a_worker(trainer.data_collator)
    expect_error(ValueError, refused, lambda: trainer.prediction_step(model, batch, prediction_loss_only=True))
    batch = _collated_in_a_worker(SequenceParallelCollator(different_on_rank1, layout, defer_checks=True))
    expect_error(ValueError, "hold different batches", lambda: trainer.get_batch_samples(iter([batch]), 1, device))
    batch = _collated_in_a_worker(SequenceParallelCollator(pad_collate, layout, defer_checks=True))
    assert "ulysses_sp_batch_check" in batch
    (batch,), _ = trainer.get_batch_samples(iter([batch]), 1, device)
    assert "ulysses_sp_batch_check" not in batch and "shift_labels" in batch, sorted(batch)
    expect_error(ValueError, refused, lambda: _accelerate_first_batch(refused_on_rank1, 2, workers=1))
    replica = "data-parallel replica(s) [1] rejected their batch"
    expect_error(ValueError, replica, _trainer(refused_on_rank1, 1).train)
    expect_error(ValueError, replica, lambda: _accelerate_first_batch(refused_on_rank1, 1, workers=0))
    expect_error(ValueError, replica, _gather_for_metrics_refused_on_rank1)
    dispatched = _trainer(pad_collate, 1, data=_FixedLengthStream(), max_steps=2, include_num_input_tokens_seen="all")
    dispatched.train()
    assert dispatched.state.num_input_tokens_seen == 2 * 4 * 12, (
        dispatched.state.num_input_tokens_seen
    )  # 2 steps x 4 rows


def _gather_for_metrics_refused_on_rank1() -> None:
    """sp=1, dp=2: rank 1 passes a scalar as a per-token tensor (refused there); rank 0 would wait in the dp gather."""
    from accelerate import Accelerator

    from ulysses_sp import ParallelLayout
    from ulysses_sp.integrations.metrics import gather_for_metrics

    shard = torch.zeros(2, 4) if dist.get_rank() == 0 else torch.zeros(())
    gather_for_metrics(Accelerator(cpu=True), shard, ParallelLayout.from_env(sp=1), sequence_dim=1)


def refused_on_replica1(features: list[dict]) -> dict[str, torch.Tensor]:
    """With dp=2 x sp=2: the batch of replica 1's ranks (2 and 3) has labels a token short."""
    batch = pad_collate(features)
    if int(os.environ["RANK"]) >= 2:
        batch["labels"] = batch["labels"][:, 1:]
    return batch


def refusal_in_worker_dp2_sp2() -> None:
    """World 4 (dp=2 x sp=2): a batch refused in a dataloader worker of replica 1's ranks raises on all four ranks
    (replica 0's ranks would wait in the forward's agreement or the gradient all-reduce)."""
    replica = "data-parallel replica(s) [1] rejected their batch"
    expect_error(ValueError, replica, lambda: _accelerate_first_batch(refused_on_replica1, 2, workers=1))
