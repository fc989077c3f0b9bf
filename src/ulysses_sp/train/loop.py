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
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.layout import ParallelLayout
from ulysses_sp.loss import causal_lm_loss, count_valid_tokens
from ulysses_sp.shapes import SHAPES
from ulysses_sp.sharding import shard_batch
from ulysses_sp.train.checkpoint import (
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from ulysses_sp.train.config import TrainConfig, config_to_dict
from ulysses_sp.train.data import build_data, load_tokenizer, pad_token_id
from ulysses_sp.train.faults import Fault
from ulysses_sp.train.metrics import MetricsLog, Progress, peak_memory_gib, peak_tflops
from ulysses_sp.train.model_factory import (
    build_model,
    hf_model_config,
    tokenizer_source,
    training_flops_per_token,
)
from ulysses_sp.train.optim import build_optimizer, build_scheduler, planned_steps

__all__ = ["Trainer", "resolve_config", "resume_point"]

# Settings that may change when resuming without changing what the run computes next.
_FREE_ON_RESUME = {"resume", "overwrite", "nproc", "max_steps", "epochs", "eval_every", "eval_batches", "log_every"}
_FREE_ON_RESUME |= {"output_dir", "save_every", "keep_last", "metrics_file", "dist_timeout", "final_save"}
# Memory features: the same step, computed with less memory.
_FREE_ON_RESUME |= {"activation_checkpointing", "tiled_loss", "loss_chunk_mib", "tiled_mlp", "mlp_chunk_tokens"}


def resolve_config(config: TrainConfig, world_size: int) -> TrainConfig:
    """The config as this run uses it: ``nproc`` = the world size, ``tokenizer`` = what is loaded, ``lr``."""
    tokenizer = tokenizer_source(config) or "gpt2-bpe"
    return dataclasses.replace(config, nproc=world_size, tokenizer=tokenizer, lr=config.peak_lr())


def resume_point(config: TrainConfig) -> Path | None:
    """The checkpoint this run starts from (None = fresh); ValueError if a fresh start would mix runs.

    A fresh run into an ``--output-dir`` that holds checkpoints is refused unless ``--overwrite`` is given
    (their steps would interleave with the new run's and ``--resume`` would pick the wrong one).
    """
    output_dir = Path(config.output_dir)
    if isinstance(config.resume, str):
        return resolve_checkpoint(config.resume)
    if config.resume:
        return find_latest_checkpoint(output_dir)
    existing = list_checkpoints(output_dir)
    if existing and not config.overwrite:
        raise ValueError(
            f"--output-dir {str(output_dir)!r} already holds checkpoints (newest: {existing[-1].name}); pass "
            "--resume to continue from it, --overwrite to delete them and start fresh, or another --output-dir"
        )
    return None


class Trainer:
    """Builds everything for one rank from a config and a layout, then :meth:`fit` trains."""

    def __init__(self, config: TrainConfig, layout: ParallelLayout) -> None:
        self.config = config
        self.layout = layout
        self.device = layout.device
        self.output_dir = Path(config.output_dir)
        self.fault = Fault.from_env()
        self.compute_dtype = config.torch_dtype(self.device.type)
        resume_dir = resume_point(config)
        # Saving and loading keep one rank busy with files while the others wait: those waits go through a
        # group with a long timeout, so a slow filesystem is not mistaken for a dead rank.
        self.io_group = _io_group(config.dist_timeout)

        self.tokenizer = load_tokenizer(tokenizer_source(config))
        self.pad_id = pad_token_id(self.tokenizer)
        self.data = build_data(config, self.tokenizer, dp_rank=layout.dp_rank, dp_size=layout.dp)
        source = str(resume_dir) if resume_dir else (None if config.model in SHAPES else config.model)
        hf_config = hf_model_config(config, self.tokenizer, source=source)
        vocab_size = hf_config.get_text_config().vocab_size
        if len(self.tokenizer) > vocab_size:
            raise ValueError(
                f"--tokenizer {tokenizer_source(config) or 'gpt2-bpe'!r} has {len(self.tokenizer)} tokens but "
                f"--model {config.model!r} has a vocabulary of {vocab_size}; use the model's own tokenizer"
            )
        self.model, self.hf_model = build_model(config, layout, hf_config, source, wait=self._io_barrier)
        self.optimizer = build_optimizer(self.model, config)
        self._weight_decays = [group["weight_decay"] for group in self.optimizer.param_groups]
        in_epochs = self.data.train.total_micro_batches(config.epochs) if config.epochs else None
        self.total_steps = planned_steps(config, in_epochs)
        self.scheduler = build_scheduler(self.optimizer, config, self.total_steps)
        self.resolved_config = resolve_config(config, layout.world_size)
        self.step = 0
        self.tokens_seen = 0
        self.changed_settings: list[str] = []
        self._flops_per_token: dict[int, float] = {}
        self.peak_tflops = peak_tflops(self.device)
        if resume_dir is not None:
            self._restore(resume_dir)
        self.resumed_from = resume_dir
        self.set_aside: list[Path] = []
        if layout.is_main:  # only now that everything loaded: a bad flag must not cost the old checkpoints
            if config.overwrite and resume_dir is None:
                for path in list_checkpoints(self.output_dir):
                    _remove_checkpoint(path)
            if resume_dir is not None:
                self.set_aside = _set_aside_newer(self.output_dir, self.step)
        self._io_barrier()
        self.metrics = MetricsLog(
            self.output_dir / config.metrics_file,
            enabled=layout.is_main,
            resume_step=self.step if resume_dir is not None else None,
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

    def _loss(self, shard: dict[str, torch.Tensor], num_items: int | None = None) -> torch.Tensor:
        """The model on this rank's shard of a micro-batch -> the token-weighted loss over the world (tiled
        lm_head + loss unless --no-tiled-loss)."""
        with self._autocast():
            return causal_lm_loss(self.model, shard, self.layout, num_items_in_batch=num_items)

    def _train_step(self) -> dict[str, Any] | None:
        """One optimizer step; returns its metrics record, or None when the data has run out."""
        start = time.perf_counter()
        loader = self.data.train
        seq_len = loader.seq_len
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
                loss = self._loss(shard, num_items)
                loss.backward()
            loss_total += loss.item()
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
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
            "epoch": loader.epoch,
            "peak_mem_gib": peak_memory_gib(self.device),
        }

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
            loss = self._loss(shard)
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
        """Write ``checkpoint-{step}`` (collective: every rank calls it)."""
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
            config=self.resolved_config,
            scheduler_state=self.scheduler.state_dict(),
            data_state=self.data.train.state_dict(),
            metrics={"tokens_seen": self.tokens_seen},
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

        checkpoint = load_checkpoint(path, rank=self.layout.rank)
        _check_same_batch_plan(checkpoint.config or {}, self.resolved_config)  # same on every rank: no hang
        state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        dcp.load(state, checkpoint_id=path / "optimizer", process_group=self.io_group)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        if checkpoint.scheduler_state is not None:
            self.scheduler.load_state_dict(checkpoint.scheduler_state)
        self._apply_optimizer_settings()
        if checkpoint.data_state is not None:
            self.data.train.load_state_dict(checkpoint.data_state)
        checkpoint.restore_rng()
        self.step = checkpoint.step
        self.tokens_seen = int(checkpoint.metrics.get("tokens_seen", 0))
        self.changed_settings = _changed_settings(checkpoint.config or {}, self.resolved_config)

    def _apply_optimizer_settings(self) -> None:
        """After a restore: this run's --lr and --weight-decay (the saved state carries the old ones), and the
        learning rate of the current step under this run's schedule (e.g. a larger --max-steps)."""
        peak = self.config.peak_lr()
        self.scheduler.base_lrs = [peak for _ in self.optimizer.param_groups]
        for group, decay, factor in zip(
            self.optimizer.param_groups, self._weight_decays, self.scheduler.lr_lambdas, strict=True
        ):
            group["initial_lr"] = peak
            group["weight_decay"] = decay
            group["lr"] = peak * factor(self.scheduler.last_epoch)

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
        """Train to the planned step (or the end of the data); returns the summary record."""
        config, layout = self.config, self.layout
        progress = Progress(
            enabled=layout.is_main, total=self.total_steps, initial=self.step, log_every=config.log_every
        )
        if self.resumed_from is not None:
            progress.message(f"resumed from {self.resumed_from} at step {self.step}")
            for path in self.set_aside:
                progress.message(f"  note: {path.name} is newer than the resumed step; moved aside, not deleted")
            for line in self.changed_settings:
                progress.message(f"  note: changed since the checkpoint: {line}")
        start, first_loss, last_loss = time.perf_counter(), None, None
        start_step, start_tokens = self.step, self.tokens_seen
        evaluation, eval_step, checkpoint, saved_step = None, None, None, start_step
        stopped_early = False
        while self.step < self.total_steps and not self.data.train.exhausted:
            record = self._train_step()
            if record is None:
                stopped_early = True
                break
            first_loss = record["loss"] if first_loss is None else first_loss
            last_loss = record["loss"]
            self.metrics.write(record)
            progress.update(record)
            if self.fault is not None:
                self.fault.after_step(self.step, layout.rank)
            if config.eval_every and self.step % config.eval_every == 0:
                evaluation, eval_step = self._evaluate_and_log(progress), self.step
            if config.save_every and self.step % config.save_every == 0:
                checkpoint, saved_step = self._save_and_log(), self.step
        progress.close()
        if config.eval_every and eval_step != self.step and self.step > start_step:
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
        }
        self.metrics.write(summary)
        return summary


_IO_TIMEOUT_S = 2 * 3600


def _io_group(dist_timeout: int) -> dist.ProcessGroup | None:
    """A group over all ranks for waits on file I/O (checkpoint writes, model loading)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(timeout=datetime.timedelta(seconds=max(dist_timeout, _IO_TIMEOUT_S)))


def _remove_checkpoint(path: Path) -> None:
    """Rename, then delete: a kill half-way never leaves a ``checkpoint-N`` that looks complete."""
    doomed = path.with_name(".deleting-" + path.name)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _set_aside_newer(output_dir: Path, step: int) -> list[Path]:
    """Resuming from an older step (a rewind): rename the newer checkpoints ``abandoned-checkpoint-N`` so that
    pruning keeps the new line of training and a later bare ``--resume`` continues it. Nothing is deleted."""
    moved = []
    for path in list_checkpoints(output_dir):
        if int(path.name.split("-")[-1]) > step:
            target = path.with_name(f"abandoned-{path.name}-{int(time.time())}")
            os.replace(path, target)
            moved.append(target)
    return moved


def _check_same_batch_plan(saved: dict[str, Any], current: TrainConfig) -> None:
    """Refuse a resume that would change what a step consumes (and so what the run computes next)."""
    saved_dp = (saved.get("nproc") or 0) // max(saved.get("sp") or 1, 1)
    current_dp = (current.nproc or 0) // current.sp
    problems = []
    if "grad_accum" in saved and saved["grad_accum"] != current.grad_accum:
        problems.append(f"--grad-accum {saved['grad_accum']} -> {current.grad_accum}")
    if saved_dp and saved_dp != current_dp:
        problems.append(f"data-parallel groups (--nproc / --sp) {saved_dp} -> {current_dp}")
    if problems:
        raise ValueError(
            "cannot resume with a different batch per step (" + "; ".join(problems) + "): the data position and "
            "the sequence-length schedule count micro-batches; resume with the saved values, or start a new run "
            "from the checkpoint's weights with --model <checkpoint dir>"
        )


def _changed_settings(saved: dict[str, Any], current: TrainConfig) -> list[str]:
    """``"lr: 0.001 -> 0.003"`` for every setting that differs from the checkpoint's and matters."""
    now = config_to_dict(current)
    return [
        f"{key}: {saved[key]!r} -> {now[key]!r}"
        for key in now
        if key in saved and key not in _FREE_ON_RESUME and saved[key] != now[key]
    ]
