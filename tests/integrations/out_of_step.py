"""Multi-rank cases (world 2, sp=2; run by tests/integrations/test_out_of_step.py): ranks that are not in the same
collective, because one of them does something the other does not.

A Trainer callback that saves a checkpoint on rank 0 only, a forward on one rank only, and a collective of the
user's own on one rank: each rank must raise a clear ValueError (``RanksOutOfStep``) saying what each rank is doing,
not a bare IndexError, a gloo abort, or a refusal read from another collective's bytes.
"""

from __future__ import annotations

import datetime
import tempfile
from dataclasses import replace

import torch
import torch.distributed as dist

from tests.helpers.harness import run_cases
from tests.helpers.models import VOCAB, build
from tests.integrations.common import TRAIN_LENGTHS, pad_collate, token_dataset, trainer_args
from ulysses_sp import ParallelLayout, gather_sequence, parallelize, sequence_parallel_cross_entropy, shard_batch
from ulysses_sp.validation import PeersAbsent, RanksOutOfStep

BATCH_CHECK = "is checking a batch (shard_batch"
FLOS = "is gathering the Trainer's flos counts"
FORWARD = "is starting a forward of the model"
ADVICE = "control.should_save / should_evaluate / should_log"


def _out_of_step(fn, *fragments: str) -> str:
    """Call ``fn``: it must raise RanksOutOfStep with every fragment (and the advice) in its message."""
    try:
        fn()
    except RanksOutOfStep as error:
        for fragment in (*fragments, ADVICE):
            assert fragment in str(error), f"expected {fragment!r} in: {error}"
        return str(error)
    raise AssertionError("ranks out of step were not detected")


def save_on_one_rank() -> None:
    """A callback sets control.should_save on rank 0 only after step 1: rank 0 gathers the flos counts of a checkpoint
    save while rank 1 checks the batch of step 2. Each raises, naming what both are doing."""
    from transformers import TrainerCallback

    from ulysses_sp.integrations import UlyssesTrainer

    class SaveOnRankZero(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = control.should_save or (dist.get_rank() == 0 and state.global_step == 1)

    with tempfile.TemporaryDirectory() as out:
        trainer = UlyssesTrainer(
            model=build("llama"),
            args=trainer_args(out, max_steps=3, logging_steps=10),
            train_dataset=token_dataset(TRAIN_LENGTHS[:6], seed=1),
            data_collator=pad_collate,
            sp_size=2,
            callbacks=[SaveOnRankZero()],
        )
        if dist.get_rank() == 0:
            _out_of_step(trainer.train, f"rank 0 (this one) {FLOS}", f"rank 1 {BATCH_CHECK}")
        else:
            _out_of_step(trainer.train, f"rank 1 (this one) {BATCH_CHECK}", f"rank 0 {FLOS}")


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def forward_on_one_rank() -> None:
    """sp_rank 0 runs a forward of its own while sp_rank 1 checks the next batch: both raise."""
    layout = ParallelLayout.from_env(sp=2)
    model = parallelize(build("llama"), layout)
    shard = shard_batch(_batch(), layout)
    if layout.sp_rank == 0:
        inputs = {key: shard[key] for key in ("input_ids", "position_ids")}
        _out_of_step(lambda: model(**inputs), f"(this one) {FORWARD}", BATCH_CHECK)
    else:
        _out_of_step(lambda: shard_batch(_batch(), layout), f"(this one) {BATCH_CHECK}", FORWARD)


def collective_of_its_own() -> None:
    """sp_rank 0 all-gathers a tensor of its own (the size of a report) while sp_rank 1 checks a batch: sp_rank 1
    raises, finding no report where sp_rank 0's should be (it read ones there before: a refusal of id 1)."""
    layout = ParallelLayout.from_env(sp=2)
    if layout.sp_rank == 0:
        parts = [torch.zeros(32, dtype=torch.long) for _ in range(2)]
        dist.all_gather(parts, torch.ones(32, dtype=torch.long), group=layout.sp_group)
    else:
        _out_of_step(lambda: shard_batch(_batch(), layout), "rank 0 is in another collective (no ulysses-sp report")


def alone_until_timeout() -> None:
    """rank 0 runs gather_sequence, a forward, then a loss alone (``if rank == 0:``) while rank 1 goes on elsewhere: it
    waited until the process group's timeout (30 minutes by default) and then raised gloo's bare "Timed out waiting
    2000ms for send operation to complete"; now PeersAbsent saying what it was doing, the likely cause, and the
    timeout settings. (Each on an SP group of its own with a 2 s timeout, which rank 1 never uses; the shard is cut on
    the suite's layout, the same cut.)"""
    shard = shard_batch(_batch(), ParallelLayout.from_env(sp=2))
    groups = [dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2)) for _ in range(3)]  # made together
    if dist.get_rank() == 1:
        return
    doings = ("gathering a tensor's shards (gather_sequence)", "starting a forward of the model", "reducing the loss")
    for doing, group in zip(doings, groups, strict=True):
        layout = ParallelLayout.from_groups(group)
        model = parallelize(build("llama"), layout)
        try:
            if doing.startswith("gathering"):
                gather_sequence(shard["input_ids"], layout)
            elif doing.startswith("starting"):
                model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
            else:  # (the loss group is the world: its own on this group)
                logits = torch.zeros(*shard["input_ids"].shape, VOCAB)
                sequence_parallel_cross_entropy(logits, shard["shift_labels"], replace(layout, loss_group=group))
        except PeersAbsent as error:
            said = "rank 0 timed out waiting for the other ranks of its group (they never joined this collective) while"
            advice = ["if rank == 0: trainer.evaluate()", "plain_attention", "timeout=...", "--dist-timeout"]
            for fragment in (f"{said} {doing}", *advice, "Timed out waiting 2000ms"):
                assert fragment in str(error), f"expected {fragment!r} in: {error}"
        else:
            raise AssertionError("a collective on one rank alone returned")


def world2() -> dict[str, str]:
    return run_cases(
        {
            "save_on_one_rank": save_on_one_rank,
            "forward_on_one_rank": forward_on_one_rank,
            "collective_of_its_own": collective_of_its_own,
            "alone_until_timeout": alone_until_timeout,
        }
    )
