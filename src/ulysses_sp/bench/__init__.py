"""Benchmarks of ulysses-sp against its peers, run by ``ulysses-sp bench``.

Modules: :mod:`runner` (the command: sections, JSON, report), :mod:`rankmem` (per-rank saved-activation and
peak bytes, one process standing in for one rank with the fake process group), :mod:`collectives` (a
counter of every c10d collective, whoever issues it), :mod:`steptime` (the multi-rank world: timings,
collectives, loss/gradient agreement), :mod:`deepspeed_ref` (DeepSpeed's ``UlyssesSPAttentionHF`` set up
as the reference), :mod:`formulas` (bytes per layer for Ulysses and ring attention), :mod:`gpu` (maximum
sequence search, tokens/s and MFU on CUDA), :mod:`world` (spawning gloo ranks), :mod:`plots`,
:mod:`report` (BENCHMARKS.md), :mod:`models` (benchmark shapes).
"""

from .runner import PRESETS, BenchConfig, run_bench

__all__ = ["PRESETS", "BenchConfig", "run_bench"]
