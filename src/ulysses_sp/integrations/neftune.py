"""NEFTune (``TrainingArguments(neftune_noise_alpha=)``) under sequence parallelism.

transformers adds to the input embeddings, in training, uniform noise of magnitude ``alpha / sqrt(L * d)`` with ``L``
the length of the batch the embedding layer sees (``d`` the hidden size). Under SP that is a shard, ``N / sp`` of the
batch's ``N`` tokens, so its hook would add ``sqrt(sp)`` times the noise one process adds to the same batch. The hook
here takes ``L`` from the whole batch instead: each element's noise then has the distribution it has in one process
(the draws themselves are each rank's own, as they are random in one process too).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

__all__ = ["sequence_noise"]


@contextlib.contextmanager
def sequence_noise(
    embeddings: torch.nn.Module, alpha: float | None, batch_length: Callable[[torch.Tensor], int]
) -> Iterator[None]:
    """While inside, ``embeddings`` (the input embedding layer) adds NEFTune's noise to its output in training, of
    magnitude ``alpha / sqrt(batch_length(output) * hidden)``; ``alpha`` None adds nothing."""
    if alpha is None:
        yield
        return

    def add_noise(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:  # [b, n, d]
        if not module.training:
            return output
        magnitude = alpha / math.sqrt(batch_length(output) * output.size(2))
        return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)

    handle = embeddings.register_forward_hook(add_noise)
    try:
        yield
    finally:
        handle.remove()
