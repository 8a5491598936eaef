"""Lazy access to the optional ASDL and BackPACK backends.

The ASDL (``asdfghjkl``) and BackPACK (``backpack-for-pytorch``) libraries are extras: importing
``laplace.curvature`` never imports them. A backend class is loaded when it is first named;
if its library is missing the ``ImportError`` says which extra to install.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator, Mapping
from importlib.util import find_spec

from laplace.utils.errors import ArgumentTypeError

__all__ = [
    "OPTIONAL_BACKENDS",
    "BackendRegistry",
    "available_optional",
    "check_backend_kwargs",
    "check_library",
    "load_optional",
]

#: Optional backend class name -> (laplace module, the library's import name, pip extra).
OPTIONAL_BACKENDS: dict[str, tuple[str, str, str]] = {
    **{
        name: ("laplace.curvature.asdl", "asdl", "asdl")
        for name in ("AsdlInterface", "AsdlGGN", "AsdlEF", "AsdlHessian")
    },
    **{
        name: ("laplace.curvature.backpack", "backpack", "backpack")
        for name in ("BackPackInterface", "BackPackGGN", "BackPackEF")
    },
}


def _library_available(library: str) -> bool:
    try:
        return find_spec(library) is not None
    except ValueError:  # the module is in sys.modules as None (blocked)
        return False


def available_optional() -> list[str]:
    """Names of the optional backend classes whose library is installed."""
    return [name for name, (_, lib, _) in OPTIONAL_BACKENDS.items() if _library_available(lib)]


def check_library(backend: str, library: str, extra: str) -> None:
    """Refuse to use ``backend`` when its third-party ``library`` is not installed.

    Args:
        backend: The backend's class name, for the message.
        library: The import name of the library (``"asdl"``, ``"backpack"``).
        extra: The pip extra of laplace-ng that installs it.

    Raises:
        ImportError: If the library is not installed, with the install command.
    """
    if not _library_available(library):
        raise ImportError(
            f"{backend} needs the {extra!r} extra, which is not installed: "
            f"pip install 'laplace-ng[{extra}]'"
        )


def load_optional(name: str) -> type:
    """Import and return the optional backend class ``name``.

    Raises:
        ImportError: If the library behind it is not installed, with the install command.
    """
    module, library, extra = OPTIONAL_BACKENDS[name]
    check_library(name, library, extra)
    return getattr(importlib.import_module(module), name)


class BackendRegistry(Mapping[str, type]):
    """Backend classes by short name, importing the optional ones on lookup.

    Iteration lists the backends that can be used here (optional ones only when their
    library is installed); looking up an optional backend whose library is missing raises
    the ``ImportError`` of ``load_optional``.

    Args:
        entries: Name to class, or to the class name of an optional backend.
    """

    def __init__(self, entries: Mapping[str, type | str]) -> None:
        self._entries = dict(entries)

    def __getitem__(self, key: str) -> type:
        entry = self._entries[key]
        return load_optional(entry) if isinstance(entry, str) else entry

    def _usable(self, key: str) -> bool:
        entry = self._entries[key]
        return not isinstance(entry, str) or _library_available(OPTIONAL_BACKENDS[entry][1])

    def __contains__(self, key: object) -> bool:
        return key in self._entries and self._usable(key)

    def __iter__(self) -> Iterator[str]:
        return (key for key in self._entries if self._usable(key))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def check_backend_kwargs(backend_cls: type, options: Mapping[str, object]) -> None:
    """Refuse ``backend_kwargs`` that the backend's constructor does not take.

    Args:
        backend_cls: The backend class.
        options: The keyword arguments it will be built with.

    Raises:
        ArgumentTypeError: (a ``ValueError`` and a ``TypeError``, the type of the constructor's
            own error) naming the unknown keys and the accepted ones.
    """
    parameters = inspect.signature(backend_cls.__init__).parameters
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = sorted(set(options) - set(parameters))
    if unknown:
        accepted = [n for n in parameters if n not in ("self", "model", "likelihood")]
        raise ArgumentTypeError(
            f"backend_kwargs {unknown} are not arguments of {backend_cls.__name__}; it takes "
            f"{accepted}."
        )
