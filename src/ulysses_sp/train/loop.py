"""The training loop behind ``ulysses-sp train``: one :class:`Trainer` per rank.

Each optimizer step takes ``--grad-accum`` micro-batches from this dp rank's loader (every rank of an SP
group gets the same full rows), shards each with :func:`ulysses_sp.shard_batch`, runs the parallelized
model on the shard and :func:`ulysses_sp.sequence_parallel_cross_entropy` with the step's global
valid-token count, so the micro-batch losses add up to the step's token-weighted loss. FSDP2 / DDP over the
whole world average the gradients, which is the reduction that loss expects. Then clipping, AdamW and the
LR schedule. Evaluation runs the same sharded forward under ``torch.no_grad`` on held-out documents: the
full sequence is never gathered on one rank.

Checkpoints (see :mod:`ulysses_sp.train.checkpoint`) hold the model in Hugging Face format, the optimizer
states sharded with ``torch.distributed.checkpoint`` (resharded on load if the world size changes), the
scheduler, every rank's RNG states and the data position, so a resumed run repeats the uninterrupted one.

After the gradients, one small all-reduce per step makes every rank agree on two flags: a non-finite loss
or gradient norm on any rank (the step is skipped, and past ``--max-skipped-steps`` the run stops without
saving), and a SIGTERM received by any rank (all ranks save this step together, then stop).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.layout import ParallelLayout
from ulysses_sp.loss import causal_lm_loss, count_valid_tokens
from ulysses_sp.sharding import shard_batch
from ulysses_sp.train.checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint, set_aside_newer
from ulysses_sp.train.config import TrainConfig, config_to_dict
from ulysses_sp.train.data import build_data
from ulysses_sp.train.documents import load_tokenizer, pad_token_id
from ulysses_sp.train.errors import RunError
from ulysses_sp.train.faults import Fault
from ulysses_sp.train.lifeline import RankSignals
from ulysses_sp.train.metrics import MetricsLog, Progress, peak_memory_gib, peak_tflops
from ulysses_sp.train.model_factory import build_model, training_flops_per_token
from ulysses_sp.train.optim import build_optimizer, build_scheduler, planned_steps, restore_settings
from ulysses_sp.train.outdir import remove_previous_run, run_artifacts, set_aside_logs, set_aside_note
from ulysses_sp.train.runspec import RunSpec
from ulysses_sp.train.tracking import make_reporter, write_loss_curve

__all__ = ["Trainer"]


class Trainer:
    """Builds everything for one rank from the run's :class:`RunSpec` and a layout, then :meth:`fit` trains.

    ``signals`` (this rank's :class:`RankSignals`) carries a SIGTERM: the ranks agree on it at the next step
    boundary, save that step together and stop (``summary["stopped"] == "SIGTERM"``). ``config``: what the run
    trains with, ``spec.config`` with its dtype made concrete for this run's GPUs
    (:func:`~ulysses_sp.train.model_factory.resolve_dtype`) and the checkpoints where the planner placed them
    (:func:`~ulysses_sp.train.model_factory.place_checkpoints`); checkpoints save ``spec.config``, as asked.
    """

    def __init__(
        self, spec: RunSpec, layout: ParallelLayout, signals: RankSignals | None = None, *, config: TrainConfig
    ) -> None:
        self.spec, self.config, self.layout, self.signals = spec, config, layout, signals
        self.device = layout.device
        self.output_dir = Path(config.output_dir)
        self.fault = Fault.from_env()
        self.compute_dtype = config.torch_dtype(self.device)
        resume_dir = Path(spec.resume_from) if spec.resume_from else None
        # Saving and loading keep one rank busy with files while the others wait: those waits go through a
        # group with a long timeout, so a slow filesystem is not mistaken for a dead rank.
        self.io_group = _io_group(config.dist_timeout)

        # objects every rank needs and that cannot travel in the spec: loaded from what the spec resolved
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.pad_id = pad_token_id(self.tokenizer)
        self.data = build_data(config, self.tokenizer, dp_rank=layout.dp_rank, dp_size=layout.dp)
        self.model, self.hf_model = build_model(
            config, layout, spec.model_config(), spec.model_source, wait=self._io_barrier
        )
        self.optimizer = build_optimizer(self.model, config)
        self._weight_decays = [group["weight_decay"] for group in self.optimizer.param_groups]
        in_epochs = self.data.train.total_micro_batches(config.epochs) if config.epochs else None
        self.total_steps = planned_steps(config, in_epochs)
        self.scheduler = build_scheduler(self.optimizer, config, self.total_steps)
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0
        self.stop_requested = False
        self.eval_pending = False  # a SIGTERM saved this step before its held-out loss: the resumed run computes it
        self._flops_per_token: dict[int, float] = {}
        self.peak_tflops = peak_tflops(self.device, self.compute_dtype)
        if resume_dir is not None:
            self._restore(resume_dir)
        self.resumed_from = resume_dir
        self.set_aside: list[Path] = []
        if layout.is_main:  # only now that everything loaded: a bad flag must not cost the old checkpoints
            if config.overwrite and resume_dir is None:
                remove_previous_run(self.output_dir, config)
            stamp = int(time.time())  # one <time> for everything this resume moves aside
            if resume_dir is not None:
                self.set_aside = set_aside_newer(self.output_dir, self.step, stamp=stamp)
            if config.resume:  # never a dropped record: the whole earlier log is kept beside the new one
                self.set_aside += set_aside_logs(self.output_dir, config, self.step, stamp=stamp)
        self._io_barrier()
        artifacts = run_artifacts(self.output_dir, config)
        self.metrics_path, self.loss_curve_path = artifacts["metrics"], artifacts["loss_curve"]
        resume_step = self.step if config.resume else None  # --resume without a checkpoint: from step 0
        reporter = None
        if layout.is_main:
            reporter = make_reporter(
                config.report_to,
                output_dir=self.output_dir,
                tensorboard_dir=artifacts["tensorboard"],
                config=config_to_dict(config),
                resume_step=resume_step,
            )
        self.metrics = MetricsLog(
            self.metrics_path,
            enabled=layout.is_main,
            resume_step=resume_step,
            reporter=reporter,
            redo_eval=self.eval_pending and bool(config.eval_every),
        )

    # --- one optimizer step ------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager:
        enabled = self.compute_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=enabled)

    def _no_sync(self, skip: bool) -> contextlib.AbstractContextManager:
        # DDP: no gradient all-reduce for all but the last micro-batch. FSDP2 reduce-scatters every
        # micro-batch, so that gradients stay sharded (its memory promise).
        if skip and isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_batch(batch, self.layout, pad_token_id=self.pad_id)

    def _loss(
        self, shard: dict[str, torch.Tensor], num_items: int | None = None, smoothing: float = 0.0
    ) -> torch.Tensor:
        """The model on this rank's shard of a micro-batch -> the token-weighted loss over the world (tiled
        lm_head + loss unless --no-tiled-loss), label-smoothed by ``smoothing``."""
        with self._autocast():
            options = dict(num_items_in_batch=num_items, label_smoothing=smoothing)
            return causal_lm_loss(self.model, shard, self.layout, **options)

    def _train_step(self) -> dict[str, Any] | None:
        """One optimizer step; returns its metrics record, or None when the data has run out."""
        start = time.perf_counter()
        loader = self.data.train
        seq_len, epoch = loader.seq_len, loader.epoch  # read before the step moves them (past an epoch's end)
        micro_batches = list(itertools.islice(loader, self.config.grad_accum))
        if not micro_batches:
            return None
        shards = [self._shard(batch) for batch in micro_batches]
        # the step's valid targets over all micro-batches and ranks: the micro-batch losses then add up
        num_items = count_valid_tokens(torch.cat([s["shift_labels"].reshape(-1) for s in shards]), self.layout)
        self.model.train()
        loss_total = 0.0
        for index, shard in enumerate(shards):
            with self._no_sync(index < len(shards) - 1):
                loss = self._loss(shard, num_items, self.config.label_smoothing)
                loss.backward()
            loss_total += loss.item()
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
            grad_norm = grad_norm.full_tensor()
        finite = math.isfinite(loss_total) and math.isfinite(float(grad_norm))
        skip, self.stop_requested = self._agree(not finite, self.signals is not None and self.signals.sigterm)
        lr = self.optimizer.param_groups[0]["lr"]
        if skip:  # no update from a non-finite loss or gradient (counted; fit() stops past the limit)
            self.skipped_steps += 1
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step_time = time.perf_counter() - start
        self.step += 1
        tokens = self.layout.dp * sum(b["input_ids"].numel() for b in micro_batches)
        self.tokens_seen += tokens
        tokens_per_sec = tokens / step_time
        tflops = self._flops(seq_len) * tokens_per_sec / self.layout.world_size / 1e12
        return {
            "event": "train",
            "step": self.step,
            "loss": loss_total,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "seq_len": seq_len,
            "tokens": tokens,
            "valid_tokens": num_items,
            "tokens_per_sec": tokens_per_sec,
            "tflops": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "step_time_s": step_time,
            "epoch": epoch,
            "peak_mem_gib": peak_memory_gib(self.device),
        } | ({"skipped": True, "skipped_steps": self.skipped_steps} if skip else {})

    def _agree(self, *flags: bool) -> list[bool]:
        """Each flag OR-ed over every rank (one small all-reduce), so that all ranks act on the same step."""
        values = torch.tensor([float(flag) for flag in flags], device=self.device)
        if self.layout.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return [bool(value) for value in values.tolist()]

    def _newest_checkpoint(self) -> str:
        latest = find_latest_checkpoint(self.output_dir)
        return f"the newest checkpoint is {latest}" if latest else "no checkpoint was saved"

    def _flops(self, seq_len: int) -> float:
        if seq_len not in self._flops_per_token:
            self._flops_per_token[seq_len] = training_flops_per_token(self.hf_model, seq_len)
        return self._flops_per_token[seq_len]

    # --- evaluation --------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any] | None:
        """Token-weighted loss over up to ``--eval-batches`` held-out micro-batches, computed under SP."""
        seq_len = self.config.schedule().seq_len_at(max(self.step - 1, 0))
        loader = self.data.eval_loader(seq_len)
        if loader is None:
            return None
        start = time.perf_counter()
        self.model.eval()
        loss_sum, count_sum = 0.0, 0
        for batch in itertools.islice(loader, self.config.eval_batches):
            shard = self._shard(batch)
            loss = self._loss(shard)  # the plain cross-entropy (its exp the perplexity), smoothed or not in training
            count = count_valid_tokens(shard["shift_labels"], self.layout)
            loss_sum += loss.item() * count
            count_sum += count
        self.model.train()
        return {
            "event": "eval",
            "step": self.step,
            "eval_loss": loss_sum / max(count_sum, 1),
            "eval_tokens": count_sum,
            "seq_len": seq_len,
            "time_s": time.perf_counter() - start,
        }

    # --- checkpoints -------------------------------------------------------------------------------

    def save(self) -> Path:
        """Write ``checkpoint-{step}`` (collective: every rank calls it); RunError instead when a weight is not
        finite (a good checkpoint is never replaced by a broken one)."""
        local = (p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters())
        if self._agree(not all(bool(torch.isfinite(t).all()) for t in local))[0]:
            raise RunError(
                f"step {self.step}: the weights are not finite, so they were not saved; {self._newest_checkpoint()} "
                "(lower --lr, or check the data)"
            )
        from torch.distributed import checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        def write_sharded(directory: Path) -> None:
            state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            dcp.save(state, checkpoint_id=directory / "optimizer", process_group=self.io_group)
            if self.fault is not None:
                self.fault.in_save(self.step, self.layout.rank)

        return save_checkpoint(
            self.output_dir,
            self.step,
            model=self.hf_model,
            model_state=lambda: get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            ),
            tokenizer=self.tokenizer,
            config=self.spec.config,  # (without the planner's placement: a run over it places them again)
            scheduler_state=self.scheduler.state_dict(),
            data_state=self.data.state_dict(),
            metrics={
                "tokens_seen": self.tokens_seen,
                "skipped_steps": self.skipped_steps,
                "eval_pending": self.eval_pending,
            },
            write_sharded=write_sharded,
            keep_last=self.config.keep_last,
            rank=self.layout.rank,
            world_size=self.layout.world_size,
            barrier=self._io_barrier,
        )

    def _io_barrier(self) -> None:
        if self.layout.world_size > 1:
            dist.barrier(group=self.io_group)

    def _restore(self, path: Path) -> None:
        from torch.distributed import checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        checkpoint = load_checkpoint(path, rank=self.layout.rank)  # verified and checked by resolve_run
        state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        dcp.load(state, checkpoint_id=path / "optimizer", process_group=self.io_group)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        if checkpoint.scheduler_state is not None:
            self.scheduler.load_state_dict(checkpoint.scheduler_state)
        restore_settings(self.optimizer, self.scheduler, self.config.peak_lr(), self._weight_decays)
        if checkpoint.data_state is not None:
            self.data.load_state_dict(checkpoint.data_state)
        checkpoint.restore_rng()
        self.step = checkpoint.step
        self.tokens_seen = int(checkpoint.metrics.get("tokens_seen", 0))
        self.skipped_steps = int(checkpoint.metrics.get("skipped_steps", 0))
        self.eval_pending = bool(checkpoint.metrics.get("eval_pending", False))

    def _evaluate_and_log(self, progress: Progress) -> dict[str, Any] | None:
        evaluation = self.evaluate()
        if evaluation is not None:
            self.metrics.write(evaluation)
            progress.message(f"step {self.step}: held-out loss {evaluation['eval_loss']:.4f}")
        return evaluation

    def _save_and_log(self) -> Path:
        path = self.save()
        self.metrics.write({"event": "checkpoint", "step": self.step, "path": str(path)})
        return path

    # --- the run -----------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train to the planned step (or the end of the data, or an agreed SIGTERM); returns the summary record.
        RunError when training stops being finite (past ``--max-skipped-steps``)."""
        try:
            return self._fit()
        finally:
            self.metrics.close()
            if self.layout.is_main and self.metrics_path.is_file():
                note = write_loss_curve(self.metrics_path, self.loss_curve_path)
                if note:
                    print(f"note: {note}", flush=True)

    def _fit(self) -> dict[str, Any]:
        config, layout = self.config, self.layout
        progress = Progress(
            enabled=layout.is_main, total=self.total_steps, initial=self.step, log_every=config.log_every
        )
        if self.resumed_from is not None:
            progress.message(f"resumed from {self.resumed_from} at step {self.step}")
        elif config.resume:
            progress.message(f"--resume: no checkpoint in {self.output_dir}, so the run starts at step 0")
        if self.set_aside:
            progress.message(f"  note: {set_aside_note(self.step, self.set_aside, self.metrics_path.name)}")
        if self.metrics.missing:
            progress.message(f"  warning: {self.metrics.missing}")
        for note in self.spec.notes:
            progress.message(f"  note: {note}")
        start, first_loss, last_loss = time.perf_counter(), None, None
        start_step, start_tokens = self.step, self.tokens_seen
        evaluation, eval_step, checkpoint, saved_step = None, None, None, start_step
        if self.eval_pending and config.eval_every:  # the held-out loss the stopped run owed at this step
            evaluation, eval_step = self._evaluate_and_log(progress), self.step
        self.eval_pending = False
        stopped_early, stopped = False, None
        while self.step < self.total_steps and not self.data.train.exhausted:
            record = self._train_step()
            if record is None:
                stopped_early = True
                break
            first_loss = record["loss"] if first_loss is None else first_loss
            last_loss = record["loss"]
            self.metrics.write(record)
            progress.update(record)
            if record.get("skipped") and self.skipped_steps > config.max_skipped_steps:
                progress.close()
                raise RunError(
                    f"step {self.step}: the loss ({record['loss']}) or the gradient norm ({record['grad_norm']}) is "
                    f"not finite; {self.skipped_steps} step(s) skipped, more than --max-skipped-steps "
                    f"{config.max_skipped_steps}, so the run stopped without saving; {self._newest_checkpoint()} "
                    "(lower --lr, or allow more skipped steps)"
                )
            if self.fault is not None:
                self.fault.after_step(self.step, layout.rank)
            if config.eval_every and self.step % config.eval_every == 0 and not self.stop_requested:
                evaluation, eval_step = self._evaluate_and_log(progress), self.step
            if self.stop_requested and config.eval_every:  # saved without the held-out loss that an uninterrupted
                # run computes here (an --eval-every step or the last one): the resumed run computes it first
                last = self.step >= self.total_steps or self.data.train.exhausted
                self.eval_pending = self.step % config.eval_every == 0 or last
            if (config.save_every and self.step % config.save_every == 0) or self.stop_requested:
                checkpoint, saved_step = self._save_and_log(), self.step
            if self.stop_requested:
                stopped = "SIGTERM"
                self.metrics.write({"event": "stopped", "step": self.step, "signal": stopped, "path": str(checkpoint)})
                break
        progress.close()
        if config.eval_every and eval_step != self.step and self.step > start_step and stopped is None:
            evaluation = self._evaluate_and_log(progress)
        if saved_step != self.step and config.final_save:
            checkpoint = self._save_and_log()
        elapsed = time.perf_counter() - start
        summary = {
            "event": "summary",
            "step": self.step,
            "total_steps": self.total_steps,
            "first_loss": first_loss,
            "last_loss": last_loss,
            "eval_loss": evaluation["eval_loss"] if evaluation else None,
            "epochs_completed": self.data.train.epoch,
            "data_exhausted": stopped_early or self.data.train.exhausted,
            "tokens": self.tokens_seen - start_tokens,
            "tokens_per_sec": (self.tokens_seen - start_tokens) / elapsed if elapsed > 0 else None,
            "time_s": elapsed,
            "peak_mem_gib": peak_memory_gib(self.device),
            "checkpoint": str(checkpoint) if checkpoint else None,
            "world_size": layout.world_size,
            "sp": layout.sp,
            "dp": layout.dp,
            "skipped_steps": self.skipped_steps,
            "stopped": stopped,
        }
        self.metrics.write(summary)
        return summary


_IO_TIMEOUT_S = 2 * 3600


def _io_group(dist_timeout: int) -> dist.ProcessGroup | None:
    """A group over all ranks for waits on file I/O (checkpoint writes, model loading)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(timeout=datetime.timedelta(seconds=max(dist_timeout, _IO_TIMEOUT_S)))
