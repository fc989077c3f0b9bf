"""AdamW and the learning-rate schedule (linear warm-up, then cosine decay to a floor)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ulysses_sp.train.config import TrainConfig

__all__ = ["build_optimizer", "build_scheduler", "lr_factor", "planned_steps", "restore_settings"]


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms and biases), betas (0.9, 0.95)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.peak_lr(), betas=(0.9, 0.95), eps=1e-8)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The multiplier of the peak LR at optimizer step ``step`` (0-based).

    Linear warm-up over ``warmup_steps`` (step 0 gets ``1 / warmup_steps``), then a cosine from 1 down to
    ``min_lr_ratio`` at ``total_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`lr_factor`; its lambda is not saved, so a resumed run may change
    ``--max-steps`` and gets the new schedule from the step it resumes at."""

    def factor(step: int) -> float:
        return lr_factor(
            step, warmup_steps=config.warmup_steps, total_steps=total_steps, min_lr_ratio=config.min_lr_ratio
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def restore_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    peak_lr: float,
    weight_decays: list[float],
) -> None:
    """After a restore: this run's peak learning rate and weight decay per group (the saved state carries the old
    ones), and the learning rate of the current step under this run's schedule (e.g. a larger --max-steps)."""
    scheduler.base_lrs = [peak_lr for _ in optimizer.param_groups]
    for group, decay, factor in zip(optimizer.param_groups, weight_decays, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = peak_lr
        group["weight_decay"] = decay
        group["lr"] = peak_lr * factor(scheduler.last_epoch)


def planned_steps(config: TrainConfig, micro_batches_in_epochs: int | None) -> int:
    """Optimizer steps this run will take: ``--max-steps``, or fewer when ``--epochs`` ends sooner.

    ``micro_batches_in_epochs`` is the loader's count for ``--epochs`` passes (None without ``--epochs``).
    """
    steps = None if micro_batches_in_epochs is None else math.ceil(micro_batches_in_epochs / config.grad_accum)
    if config.max_steps is None:
        assert steps is not None, "validate() guarantees --max-steps or --epochs"
        return steps
    return config.max_steps if steps is None else min(steps, config.max_steps)
