"""The autocast and RNG state a forward ran under, to run it again identically (in backward, or in a compiled
graph's operator, where the caller's autocast state is not in effect)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["Replay", "autocast_state", "under_autocast"]

AutocastState = list[tuple[str, bool, torch.dtype]]  # (device type, enabled, dtype) for "cpu" and the device's type


def autocast_state(device: torch.device) -> AutocastState:
    """Autocast's state now for the CPU and ``device``'s type."""
    types = dict.fromkeys(("cpu", device.type))
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]


@contextlib.contextmanager
def under_autocast(state: AutocastState) -> Iterator[None]:
    """Run under the autocast ``state`` (what :func:`autocast_state` gave)."""
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in state:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        yield


class Replay:
    """The autocast and RNG state of a forward, to recompute it identically in backward.

    ``autocast`` / ``cpu_rng`` / ``cuda_rng``: a state given (a compiled graph's operator: the traced autocast
    state and the RNG state its forward returned) instead of the state now."""

    def __init__(
        self,
        device: torch.device,
        autocast: AutocastState | None = None,
        cpu_rng: torch.Tensor | None = None,
        cuda_rng: torch.Tensor | None = None,
    ) -> None:
        self.device = device
        self.autocast = autocast if autocast is not None else autocast_state(device)
        self.cpu_rng = cpu_rng if cpu_rng is not None else torch.get_rng_state()
        if cuda_rng is None and device.type == "cuda":
            cuda_rng = torch.cuda.get_rng_state(device)
        self.cuda_rng = cuda_rng

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        devices = [self.device] if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices), under_autocast(self.autocast):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.device)
            yield
