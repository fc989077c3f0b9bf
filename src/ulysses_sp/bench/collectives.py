"""Count the collectives a block of code runs, whoever runs them (ulysses-sp, DeepSpeed, a ring core).

:class:`CollectiveCounter` is a ``TorchDispatchMode``: every ``torch.distributed`` collective goes through
the dispatcher as a ``c10d`` operator (``alltoall_base_``, ``allgather_``, ``allreduce_``, ``send``, ...),
so one counter sees the collectives of any implementation without touching its code. A library that wraps
a collective in its own custom operator (DeepSpeed's ``deepspeed::dim_zero_all_to_all``) is counted at
that operator, listed in ``_WRAPPED_OPS``. ``bytes`` counts the
payload this rank hands to the collective (for an all-to-all the whole send buffer, of which ``1/P`` stays
local; for an all-gather this rank's input), the convention of :class:`ulysses_sp.CommStats`.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CollectiveCounter"]

# c10d operator -> (name in the tables, index of the argument that holds what this rank sends)
_OPS = {
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "allgather_": ("all_gather", 1),
    "_allgather_base_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "send": ("send", 0),
    "recv_": ("recv", None),
}
# Collectives that other libraries wrap in their own custom operators, whose body (the c10d call) runs
# below this mode: (namespace, operator) -> (name, argument index).
_WRAPPED_OPS = {("deepspeed", "dim_zero_all_to_all"): ("all_to_all", 0)}


def _nbytes(value: object) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as counter: ...`` then ``counter.calls`` / ``counter.bytes`` per op name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, opname = getattr(func, "namespace", ""), getattr(func, "_opname", "")
        entry = _OPS.get(opname, (opname, None)) if namespace == "c10d" else _WRAPPED_OPS.get((namespace, opname))
        if entry is not None:
            name, index = entry
            self.calls[name] += 1
            if index is not None and index < len(args):
                self.bytes[name] += _nbytes(args[index])
        return func(*args, **(kwargs or {}))
