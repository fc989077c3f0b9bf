"""The memory planner: per-GPU memory of a training step, the longest sequence that fits, recommended settings.

Modules: :mod:`.shape` (model sizes), :mod:`.memory` (the memory model), :mod:`.search` (longest sequence),
:mod:`.recommend`, :mod:`.units` (byte sizes), :mod:`.cli` (``ulysses-sp plan``). ``--simulate`` runs one
real step as one rank of the layout: :mod:`ulysses_sp.simulate`.
"""

from ..features import Features
from .memory import MemoryPlan, plan_memory, usable_gpu_bytes
from .recommend import Recommendation, recommend
from .search import max_seq_len, search_longest
from .shape import ModelShape, load_model_config, model_shape
from .units import GiB, format_bytes, parse_bytes

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
