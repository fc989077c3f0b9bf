"""The memory planner: per-GPU memory of a training step, the longest sequence that fits, recommended settings.

Modules: :mod:`.shape` (model sizes), :mod:`.memory` (the memory model; its terms in :mod:`.attention`,
:mod:`.mlp`, :mod:`.moe`, :mod:`.earlier_layers`, :mod:`.host`), :mod:`.search` (longest sequence),
:mod:`.recommendation`, :mod:`.units` (byte sizes), :mod:`.cli` (``ulysses-sp plan``). ``--simulate`` runs one
real step as one rank of the layout: :mod:`ulysses_sp.simulate`.

Names are imported from their module on first use (PEP 562), as in the top package: ``ulysses-sp plan --help``
and the byte-size flags of ``bench`` import no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ..features import Features
    from .memory import MemoryPlan, plan_memory, usable_gpu_bytes
    from .recommendation import Recommendation, recommend
    from .search import max_seq_len, search_longest
    from .shape import ModelShape, load_model_config, model_shape
    from .units import GiB, format_bytes, parse_bytes

_EXPORTS = {
    "..features": ("Features",),
    ".memory": ("MemoryPlan", "plan_memory", "usable_gpu_bytes"),
    ".recommendation": ("Recommendation", "recommend"),
    ".search": ("max_seq_len", "search_longest"),
    ".shape": ("ModelShape", "load_model_config", "model_shape"),
    ".units": ("GiB", "format_bytes", "parse_bytes"),
}
__all__ = [
    "Features",
    "GiB",
    "MemoryPlan",
    "ModelShape",
    "Recommendation",
    "format_bytes",
    "load_model_config",
    "max_seq_len",
    "model_shape",
    "parse_bytes",
    "plan_memory",
    "recommend",
    "search_longest",
    "usable_gpu_bytes",
]


_HOME, __getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
