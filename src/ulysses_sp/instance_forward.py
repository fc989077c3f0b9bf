"""Objects installed as a module's ``forward`` (head chunks, the tiled MLP and norms, the norms' projections).

Set as ``module.forward`` itself, such an object makes ``torch.compile`` guard on its identity: each decoder layer
compiled on its own (``for layer in layers: layer.compile()``, the FSDP2 recipe) then compiles again for every
layer, and from dynamo's recompile limit on (8 layers) the remaining layers run eagerly. :func:`install_forward`
sets the object's bound ``__call__`` instead: dynamo guards on its function, the same for every layer. (A bound
method also pickles and deep-copies with its object, as the object itself did.)
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn

__all__ = ["install_forward", "installed_forward", "restore_forward"]


def install_forward(module: nn.Module, handler: Any) -> None:
    """Make ``handler(*args, **kwargs)`` the forward of ``module`` (this instance only)."""
    module.forward = handler.__call__


def installed_forward(module: nn.Module) -> Any:
    """The instance forward of ``module``: the object :func:`install_forward` installed, else whatever was set as
    ``module.forward`` on the instance (None: the class's forward)."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, types.MethodType) and forward.__name__ == "__call__":
        return forward.__self__
    return forward


def restore_forward(module: nn.Module, previous: Any) -> None:
    """Undo :func:`install_forward`: ``previous`` (what :func:`installed_forward` gave before it) as the instance
    forward, or the class's forward when it is None."""
    module.__dict__.pop("forward", None)
    if previous is not None:
        module.forward = previous
