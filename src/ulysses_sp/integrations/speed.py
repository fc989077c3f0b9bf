"""The Trainer's evaluation speed metrics under sequence parallelism, as plain data parallelism over dp reports them.

``Trainer.evaluate()`` and ``predict()`` count their steps as ``ceil(num_samples / (eval_batch_size x world_size))``,
a batch per rank of the world. Under SP the ``sp`` ranks of a group share each batch (every one holds a part of its
sequences), so the steps each rank runs are ``ceil(num_samples / (eval_batch_size x dp))``: with the world's count
``{prefix}_steps_per_second`` came out up to ``sp`` times too low (3 of 5 steps for 9 samples in batches of 2 at
sp=2). :class:`StepCountedMetrics` gives it the steps of ``dp`` ranks instead, the count one process (dp=1) or plain
DDP over ``dp`` ranks gives; the samples, the runtime and every other metric stay as the Trainer makes them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StepCountedMetrics"]


class StepCountedMetrics(dict):
    """An evaluation loop's metrics whose ``{prefix}_steps_per_second``, when the Trainer adds its speed metrics with
    ``update``, is ``num_steps`` over that ``{prefix}_runtime`` (rounded to 3 decimals, as transformers rounds it).

    ``Trainer.evaluate()`` / ``predict()`` add them to the metrics of the loop's output before logging them and
    handing them to the callbacks, so all of these see the right rate."""

    def __init__(self, metrics: dict[str, Any], prefix: str, num_steps: int) -> None:
        super().__init__(metrics)
        self.prefix = prefix
        self.num_steps = num_steps

    def update(self, *args: Any, **kwargs: Any) -> None:
        new = dict(*args, **kwargs)
        super().update(new)
        key, runtime = f"{self.prefix}_steps_per_second", new.get(f"{self.prefix}_runtime")
        if key in new and runtime:
            self[key] = round(self.num_steps / runtime, 3)
