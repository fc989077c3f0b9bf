"""A package's public names imported from their module on first use (PEP 562): :func:`lazy_exports`.

Used by ``ulysses_sp``, ``ulysses_sp.plan`` and ``ulysses_sp.tiled_loss``, so that ``import ulysses_sp``, a
command's ``--help`` and a bad flag import neither transformers nor torch. A public name must not also be a
submodule's name: importing that submodule binds it on the package, and ``__getattr__`` is never asked again.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, tuple[str, ...]], *, submodules: bool = False
) -> tuple[dict[str, str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(home, __getattr__, __dir__)`` for the package whose ``globals()`` is ``namespace``.

    ``exports`` maps a module (relative to the package: ``".memory"``, ``"..features"``) to the names it defines;
    ``home`` is each name's module. A name is imported on first use and then kept in ``namespace``; with
    ``submodules``, any submodule of the package resolves as an attribute too (``ulysses_sp.hf``).
    """
    package = namespace["__name__"]
    home = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name in home:
            value = getattr(importlib.import_module(home[name], package), name)
        elif submodules and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f".{name}", package)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace["__all__"]})

    return home, __getattr__, __dir__
