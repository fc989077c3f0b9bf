"""Benchmarks of ulysses-sp against its peers, run by ``ulysses-sp bench``.

Modules: :mod:`.config` (what it measures: flags, presets), :mod:`.runner` (the command: sections, JSON,
report), :mod:`.collectives` (a counter of every c10d collective, whoever issues it), :mod:`.steptime` (the
multi-rank world: timings, collectives, loss/gradient agreement), :mod:`.deepspeed_ref` (DeepSpeed's
``UlyssesSPAttentionHF`` as the reference), :mod:`.models` (the benchmark models), :mod:`.gpu` (longest
sequence, tokens/s and MFU on CUDA), :mod:`.world` (spawning gloo ranks), :mod:`.headchunks` (4 head chunks
over 1), :mod:`.tiledloss` (the tiled loss against the plain one), :mod:`.plots`, :mod:`.report` (with
:mod:`.report_chunks` and :mod:`.tables`). Bytes per layer are :mod:`ulysses_sp.traffic`'s formulas.
One rank of a large layout is measured through :mod:`ulysses_sp.standin`.
"""

from .config import PRESETS, BenchConfig
from .runner import run_bench

__all__ = ["PRESETS", "BenchConfig", "run_bench"]
