"""Benchmarks of ulysses-sp against its peers, run by ``ulysses-sp bench``.

Modules: :mod:`.config` (what it measures: flags, presets), :mod:`.runner` (the command: sections, JSON,
report), :mod:`.collectives` (a counter of every c10d collective, whoever issues it), :mod:`.steptime` (the
multi-rank world: timings, collectives, loss/gradient agreement), :mod:`.deepspeed_ref` (DeepSpeed's
``UlyssesSPAttentionHF`` as the reference), :mod:`.formulas` (bytes per layer), :mod:`.gpu` (longest
sequence, tokens/s and MFU on CUDA), :mod:`.world` (spawning gloo ranks), :mod:`.plots`, :mod:`.report`.
One rank of a large layout is measured through :mod:`ulysses_sp.standin`.
"""

from .config import PRESETS, BenchConfig
from .runner import run_bench

__all__ = ["PRESETS", "BenchConfig", "run_bench"]
