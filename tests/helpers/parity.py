"""A parallel run against one process on the full batch: the loss, then every named gradient (fp32 tolerances)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["GRAD_TOL", "LOSS_TOL", "assert_loss_and_grads"]

LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)


def assert_loss_and_grads(
    loss: torch.Tensor,
    grads: Mapping[str, torch.Tensor | None],
    ref_loss: torch.Tensor,
    ref_grads: Mapping[str, torch.Tensor | None],
    *,
    label: str = "",
    zeros_for_none: bool = False,
) -> None:
    """``loss`` equals ``ref_loss`` (:data:`LOSS_TOL`) and each gradient of ``grads`` (name -> gradient, None where
    the loss does not reach the parameter) the one of that name in ``ref_grads`` (:data:`GRAD_TOL`); both name the
    same parameters. ``label`` goes before a failing parameter's name (e.g. the architecture). ``zeros_for_none``:
    where the reference has none, an all-zero gradient passes too (a wrapper or a gradient sync that gives every
    parameter one: FSDP2, ``sync_gradients``); by default it must be None there too (a zero gradient is not
    None to an optimizer: AdamW decays the parameter)."""
    assert grads.keys() == ref_grads.keys(), grads.keys() ^ ref_grads.keys()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), **LOSS_TOL)
    for name, grad in grads.items():
        if zeros_for_none and ref_grads[name] is None:
            assert grad is None or not grad.any(), f"{label}{name}: a gradient where one process has none"
            continue
        torch.testing.assert_close(grad, ref_grads[name], **GRAD_TOL, msg=lambda m, n=f"{label}{name}": f"{n}: {m}")
