"""Names a module re-exports on first access, so that ``import laplace`` stays light.

``__getattr__ = lazy_attributes(__name__, {"RunningNLLMetric": "laplace.utils.running_nll"})``:
the owner (and its library) is imported the first time the name is read, and the name is then
kept in the module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(module: str, owners: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports each name of ``owners`` from its owning module.

    Args:
        module: The name of the module that re-exports (for the ``AttributeError``).
        owners: Each re-exported name and the module that defines it.

    Returns:
        The ``__getattr__`` of ``module`` (PEP 562).

    Example:
        >>> import sys, types
        >>> sys.modules["lazy_demo"] = types.ModuleType("lazy_demo")
        >>> getattr_ = lazy_attributes("lazy_demo", {"sqrt": "math"})
        >>> getattr_("sqrt")(4.0)
        2.0
    """

    def __getattr__(name: str) -> Any:
        if name in owners:
            value = getattr(importlib.import_module(owners[name]), name)
            setattr(sys.modules[module], name, value)
            return value
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
