"""Single-process tests of how prepared Accelerate dataloaders deal batches over the dp SP groups: iterable
datasets, ``Accelerator(split_batches=True)`` and its scheduler, each against what one process (or plain
data parallelism over dp processes) reads."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from ulysses_sp import ParallelLayout
from ulysses_sp.integrations import deal_batches_over_dp


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def one_process(data, batch_size: int) -> list[list[int]]:
    return [b.tolist() for b in torch.utils.data.DataLoader(data, batch_size=batch_size)]


def dealt(loader, sp_rank: int, dp: int, dp_rank: int, split: bool = False) -> list[list[int]]:
    layout = ParallelLayout.rank_view(2, sp_rank, dp=dp, dp_rank=dp_rank)
    assert deal_batches_over_dp(loader, layout, split_batches=split) is loader
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("sp_rank", [0, 1])
def test_an_iterable_dataset_reads_as_in_one_process_for_one_dp_group(sp_rank):
    """dp=1: every sample once, the last batch partial, as one process reads it (accelerate's shard over the
    world completed the last batch with samples from the start: [4, 0])."""
    from accelerate.data_loader import DataLoaderShard, IterableDatasetShard

    for split in (False, True):
        shard = IterableDatasetShard(Stream(5), batch_size=2, num_processes=2, process_index=sp_rank)
        got = dealt(DataLoaderShard(shard, batch_size=2), sp_rank, dp=1, dp_rank=0, split=split)
        assert got == one_process(Stream(5), 2) == [[0, 1], [2, 3], [4]]


def test_split_batches_splits_each_batch_over_the_dp_groups_not_the_ranks():
    """``split_batches``: batches of 4 over 4 ranks (dp=2 x sp=2) give each SP group half of every batch, the
    same half on both of its ranks; together the groups read one process's batches (the last evened out with
    samples from the start, as accelerate does over dp processes). The shards come as ``prepare`` builds them
    under SP (whole batches per rank, re-pointed here), for a map-style dataset and an iterable one alike, or as
    accelerate builds them for an iterable one (a quarter of each batch per rank, the Trainer's route)."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, IterableDatasetShard

    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(10)), 4, drop_last=False)
    for kind in ("map", "iterable", "iterable split over the world"):
        per_group = []
        for dp_rank in (0, 1):
            per_rank = []
            for sp_rank in (0, 1):
                rank = 2 * dp_rank + sp_rank
                if kind == "map":
                    shard = BatchSamplerShard(sampler, num_processes=4, process_index=rank)
                    loader = DataLoaderShard(range(10), batch_sampler=shard)
                else:
                    world = kind.endswith("world")
                    shard = IterableDatasetShard(
                        Stream(10), batch_size=4, num_processes=4, process_index=rank, split_batches=world
                    )
                    loader = DataLoaderShard(shard, batch_size=1 if world else 4)
                per_rank.append(dealt(loader, sp_rank, dp=2, dp_rank=dp_rank, split=not kind.endswith("world")))
            assert per_rank[0] == per_rank[1], kind
            per_group.append(per_rank[0])
        assert [a + b for a, b in zip(*per_group, strict=True)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]], kind


def test_split_batches_under_sp_needs_batches_that_split_over_dp_only():
    """A batch of 2 over dp=2 x sp=2 ranks is split over the 2 groups (accelerate alone would refuse it: not a
    multiple of the 4 processes); accelerate prepares it with whole batches, its configuration given back after;
    a batch of 3 does not split over 2 groups and is refused before anything is prepared."""
    from accelerate.utils import DataLoaderConfiguration

    from ulysses_sp.integrations.accelerate import check_split_batches, split_over_dp_groups

    config = DataLoaderConfiguration(split_batches=True)
    accelerator = SimpleNamespace(dataloader_config=config, split_batches=True)
    layout = ParallelLayout.rank_view(2, 0, dp=2, dp_rank=0)
    assert check_split_batches(accelerator, layout, [("batch_size", 2)])
    assert not check_split_batches(accelerator, ParallelLayout.rank_view(1, 0, dp=4, dp_rank=0), [("b", 3)])
    with pytest.raises(ValueError, match="so per_device_eval_batch_size must be a multiple of 2, got 3"):
        check_split_batches(accelerator, layout, [("batch_size", 2), ("per_device_eval_batch_size", 3)])
    with split_over_dp_groups(accelerator, True):
        assert accelerator.dataloader_config.split_batches is False
    assert accelerator.dataloader_config is config
    with pytest.raises(RuntimeError), split_over_dp_groups(accelerator, True):
        raise RuntimeError("prepare failed")
    assert accelerator.dataloader_config is config


@pytest.mark.parametrize("dp", [1, 2])
def test_a_scheduler_prepared_under_split_batches_steps_once_per_optimizer_step(dp):
    """Under ``split_batches`` an optimizer step reads one batch (split over the dp groups), so the schedule
    advances once, as Accelerate steps it there, though ``prepare`` built the scheduler with the split off."""
    from accelerate.scheduler import AcceleratedScheduler
    from accelerate.state import GradientState

    from ulysses_sp.integrations.accelerate import step_scheduler_per_dp_group

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    optimizer.step_was_skipped = False
    with mock.patch("accelerate.scheduler.AcceleratorState", lambda: SimpleNamespace(num_processes=4)):
        lambda_lr = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        scheduler = AcceleratedScheduler(lambda_lr, optimizer, split_batches=False)
        step_scheduler_per_dp_group(scheduler, dp, split_batches=True)
        GradientState()._set_sync_gradients(True)
        scheduler.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 1.0 / 3


def test_an_iterable_dataset_for_one_dp_group_reads_in_a_spawned_worker():
    """dp=1 with a dataloader worker started by spawn (forkserver, Python 3.14's default on Linux, alike): the whole
    stream is read as one process reads it; the shard, a class made at run time, did not pickle ("Can't pickle local
    object '_whole_stream_class.<locals>.WholeStreamShard'")."""
    from accelerate.data_loader import DataLoaderShard, IterableDatasetShard

    shard = IterableDatasetShard(Stream(5), batch_size=2, num_processes=2, process_index=1)
    loader = DataLoaderShard(shard, batch_size=2, num_workers=1, multiprocessing_context="spawn")
    assert dealt(loader, 1, dp=1, dp_rank=0) == one_process(Stream(5), 2)
