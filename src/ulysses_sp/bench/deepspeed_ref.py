"""DeepSpeed's ``UlyssesSPAttentionHF`` (ALST) set up on a transformers model, as the side-by-side reference.

What DeepSpeed 0.19 needs, and what the benchmark does about it:

* ``deepspeed.comm`` must wrap the torch process group: ``deepspeed.init_distributed(dist_backend="gloo")``
  adopts the group that is already initialised.
* ``UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, micro_batch_size, seq_length, ...)``
  creates its SP groups (``parallel_state_sp``, once per process) and REPLACES transformers' global
  ``ALL_ATTENTION_FUNCTIONS["sdpa"]`` with its wrapper, so every sdpa model in the process would run it.
  :class:`DeepSpeedUlysses` keeps the wrapper and installs it only inside ``with ds.active():``, so the
  no-SP baseline in the same process runs plain sdpa.
* It needs no ZeRO engine: ZeRO is what DeepSpeed's Trainer/Accelerate integrations run the model with, not
  something the attention calls. Both sides of the comparison use the same plain loop (forward, the same
  token-weighted loss, backward, one gradient all-reduce, AdamW), so the step times differ by the SP
  attention only. Batches are sharded the way ``UlyssesSPDataLoaderAdapter`` shards them (shift labels,
  then slice every key), which for lengths divisible by sp is what ``ulysses_sp.shard_batch`` returns.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

from torch import nn

__all__ = ["DeepSpeedUlysses", "deepspeed_available", "deepspeed_version"]


def deepspeed_available() -> bool:
    """True when ``deepspeed`` is importable (the optional ``deepspeed`` extra)."""
    return importlib.util.find_spec("deepspeed") is not None


def deepspeed_version() -> str | None:
    """The installed DeepSpeed version, or None."""
    if not deepspeed_available():
        return None
    from importlib.metadata import version

    return version("deepspeed")


class DeepSpeedUlysses:
    """DeepSpeed's Ulysses attention registered for ``model`` (fixed ``seq_len``, ``micro_batch`` rows).

    Call once per process (DeepSpeed keeps its SP groups in module state). ``with self.active():`` runs the
    model through DeepSpeed's attention; outside it transformers' own sdpa is back in place.
    """

    def __init__(self, model: nn.Module, *, sp: int, seq_len: int, micro_batch: int = 1) -> None:
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if model.config._attn_implementation != "sdpa":
            raise ValueError(f"the DeepSpeed reference runs sdpa models, got {model.config._attn_implementation!r}")
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        self._functions = ALL_ATTENTION_FUNCTIONS
        self._plain = ALL_ATTENTION_FUNCTIONS["sdpa"]
        self.mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=sp,
            micro_batch_size=micro_batch,
            seq_length=seq_len,
            seq_length_is_variable=False,
        )
        self._wrapper = ALL_ATTENTION_FUNCTIONS["sdpa"]
        ALL_ATTENTION_FUNCTIONS["sdpa"] = self._plain  # installed only inside active()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run sdpa models through DeepSpeed's Ulysses attention inside the block."""
        self._functions["sdpa"] = self._wrapper
        try:
            yield
        finally:
            self._functions["sdpa"] = self._plain
