"""Public classes report laplace-torch's module path, wherever laplace-ng defines them.

Pickles and libraries that register support by qualified name
(``"laplace.baselaplace.BaseLaplace"``) must see laplace-torch's public module.
"""

from __future__ import annotations

__all__ = ["at_public_path"]


def at_public_path(module_name: str, *classes: type) -> None:
    """Report ``module_name`` (a public façade that exports them) as the module of ``classes``.

    Args:
        module_name: The public module, e.g. ``"laplace.baselaplace"``.
        classes: Classes that module exports under their own names.
    """
    for cls in classes:
        cls.__module__ = module_name
