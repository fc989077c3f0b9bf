"""A Trainer subclass's own ``compute_loss`` under sequence parallelism.

Under SP each rank's batch is a shard of the sequence: a loss computed from ``outputs.logits`` and
``inputs["labels"]`` (shifted inside the shard, averaged over the shard's tokens) is not the loss of one process,
and under the tiled loss there are no logits at all (``logits=None``). A loss that goes through the trainer's own
``compute_loss`` (``super().compute_loss(...)``), or reads ``inputs["shift_labels"]`` and weights by the step's
targets (:func:`ulysses_sp.causal_lm_loss`), is right. Which of these an override does cannot be seen before it
runs, so :class:`LossOverrideCheck` watches its first calls: a ``TypeError`` it raises on the tiled loss's missing
logits becomes a ValueError saying why, and an override that never reaches the trainer's ``compute_loss`` is
warned about once, naming the two right ways, unless it ran the model with ``shift_labels`` and ``num_items_in_batch``
(as :func:`ulysses_sp.causal_lm_loss` does under the tiled loss): the model then made the whole step's loss.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ..tiled_loss import tiled_loss_enabled

logger = logging.getLogger(__name__)

__all__ = ["LossOverrideCheck", "overriding_class"]

_RIGHT_WAYS = (
    "read inputs['shift_labels'] (the whole sequence's next tokens, cut to the shard) and weight by the step's "
    "targets (ulysses_sp.causal_lm_loss(model, inputs, trainer.sp_layout, num_items_in_batch=num_items_in_batch) "
    "does both), or call super().compute_loss(...) and add to it (docs/integrations.md)"
)


def overriding_class(trainer_type: type) -> type | None:
    """The subclass of a ulysses-sp trainer that defines its own ``compute_loss`` (the first in the MRO), else None."""
    for cls in trainer_type.__mro__:
        if "compute_loss" in cls.__dict__:
            return None if cls.__module__.startswith("ulysses_sp.") else cls
    return None


class LossOverrideCheck:
    """Watches a user's ``compute_loss`` override until one call of it has run (nothing to do without one).

    The trainer's own ``compute_loss`` calls :meth:`reached`; its training and prediction steps run the override
    inside :meth:`watch`.
    """

    def __init__(self, trainer: Any) -> None:
        self.owner = overriding_class(type(trainer))
        self.model = trainer.model
        self.tiled_loss = tiled_loss_enabled(trainer.model)  # set up by now
        self.is_main = trainer.args.process_index == 0
        self._calls: int | None = None  # calls of the trainer's compute_loss while watching
        self._weighted = False  # a forward while watching was given shift_labels and num_items_in_batch

    def reached(self) -> None:
        if self._calls is not None:
            self._calls += 1

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        if self.owner is None:
            yield
            return
        self._calls = 0
        self._weighted = False
        hook = self.model.register_forward_pre_hook(self._saw, with_kwargs=True)
        try:
            yield
        except TypeError as error:
            if self._calls == 0 and self.tiled_loss and "NoneType" in str(error):  # on the missing logits
                raise ValueError(
                    f"{self.owner.__name__}.compute_loss failed ({error}) without calling the trainer's own "
                    "compute_loss: under sequence parallelism the model computes its loss with the tiled loss and "
                    "returns no logits (logits=None), and each rank holds a shard of the sequence, so a loss from "
                    f"outputs.logits and inputs['labels'] would not be the one-process loss anyway; {_RIGHT_WAYS}"
                ) from error
            raise
        else:
            if self._calls == 0 and not self._weighted and self.is_main:
                logger.warning(
                    "%s.compute_loss does not call the trainer's own compute_loss: under sequence parallelism each "
                    "rank holds a shard of the sequence, so a loss from outputs.logits and inputs['labels'] (labels "
                    "shifted inside the shard, averaged over its tokens) is not the one-process loss; if yours is "
                    "such a loss, %s",
                    self.owner.__name__,
                    _RIGHT_WAYS,
                )
            self.owner = None  # one call tells: the override takes the same path every step
        finally:
            hook.remove()
            self._calls = None

    def _saw(self, module: Any, args: tuple, kwargs: dict) -> None:
        """A forward given the shard's targets and the step's count makes the loss of the whole step (the model's own,
        or the tiled loss's: what causal_lm_loss asks it for)."""
        if kwargs.get("shift_labels") is not None and kwargs.get("num_items_in_batch") is not None:
            self._weighted = True
