"""Exceptions that are also laplace-torch's exception types, and the argument checks.

Each exception derives from the type laplace-torch raises and from the natural one, so either
``except`` clause catches it (the table is in docs/migration.md). The ``check_*`` helpers
validate the arguments every entry point shares once, at the public boundary.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

__all__ = [
    "AbstractClassError",
    "ArgumentTypeError",
    "DataError",
    "LabelError",
    "MetaDeviceError",
    "MissingKeyError",
    "ModelOutputError",
    "NotFittedError",
    "TooLargeError",
    "UnsupportedError",
    "available_memory",
    "check_bool",
    "check_finite_result",
    "check_fits_in_memory",
    "check_generator",
    "check_int_at_least",
    "check_mapping",
    "check_module",
    "check_positive_float",
    "check_positive_int",
    "is_real_scalar",
]

T = TypeVar("T")


class ArgumentTypeError(ValueError, TypeError):
    """An argument of the wrong type; a ``ValueError`` (as laplace-torch) and a ``TypeError``."""


class MissingKeyError(KeyError, ValueError):
    """A missing key; a ``KeyError`` (as laplace-torch) and a ``ValueError``, printed unquoted."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class NotFittedError(RuntimeError, AttributeError):
    """A quantity that needs ``fit()`` first; an ``AttributeError`` too, so ``hasattr`` works."""


class UnsupportedError(NotImplementedError, AttributeError):
    """A property this approximation does not have; an ``AttributeError`` too, for ``hasattr``."""


class AbstractClassError(TypeError, NotImplementedError):
    """An abstract class built directly; a ``TypeError`` and a ``NotImplementedError``."""


class DataError(ValueError, RuntimeError):
    """Data the model or the loss cannot use; a ``ValueError`` and a ``RuntimeError``."""


class MetaDeviceError(DataError, NotImplementedError):
    """Tensors on the ``meta`` device (no values); also a ``NotImplementedError`` as in torch."""


class TooLargeError(ValueError, RuntimeError):
    """A dense matrix larger than the device's memory; a ``ValueError`` and a ``RuntimeError``."""


def available_memory(device: torch.device) -> int | None:
    """Bytes of memory of ``device``: the device's for CUDA, the physical memory for the CPU.

    None where it is unknown (other devices, or no ``os.sysconf``).
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def _gib(n_bytes: int) -> str:
    """``n_bytes`` in GiB: one decimal from 1 GiB, three significant digits below."""
    gib = n_bytes / 2**30
    return f"{gib:,.1f} GiB" if gib >= 1 else f"{gib:.3g} GiB"


def check_fits_in_memory(
    needed: int, device: torch.device, what: str, instead: str | Callable[[int], str]
) -> None:
    """Refuse, before allocating it, a request of ``needed`` bytes larger than ``device``'s memory.

    The memory is ``available_memory(device)``; where it is unknown nothing is refused.

    Args:
        needed: The estimated bytes.
        device: The device they would be allocated on.
        what: What was asked, for the message.
        instead: What would fit, or a function of the available bytes giving it (called only
            when refusing).

    Raises:
        TooLargeError: ``"{what} needs … GiB …, more than the … GiB of {device}: {instead}"``.
    """
    available = available_memory(device)
    if available is not None and needed > available:
        alternative = instead(available) if callable(instead) else instead
        raise TooLargeError(
            f"{what} needs {_gib(needed)}, more than the {_gib(available)} of {device}: "
            f"{alternative}"
        )


class LabelError(ValueError, IndexError):
    """A class label outside ``[0, C)``; a ``ValueError`` and an ``IndexError``."""


class ModelOutputError(TypeError, AttributeError):
    """A model output that is not a tensor; a ``TypeError`` and an ``AttributeError``."""


def check_int_at_least(value: object, name: str, minimum: int) -> int:
    """Return ``value`` if it is an integer (``bool`` excluded) of at least ``minimum``.

    Raises:
        ArgumentTypeError: If it is not an integer.
        ValueError: If it is smaller than ``minimum``.
    """
    kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be {kind}, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be {kind}, got {value!r}.")
    return int(value)


def check_positive_int(value: object, name: str) -> int:
    """Return ``value`` if it is a positive integer (``bool`` excluded).

    Raises:
        ArgumentTypeError: If it is not an integer.
        ValueError: If it is smaller than 1.
    """
    return check_int_at_least(value, name, 1)


def check_positive_float(value: object, name: str) -> float:
    """Return ``value`` (a real number or one-element tensor) as a positive, finite float.

    Raises:
        ArgumentTypeError: If it is not a real number.
        ValueError: If it is not positive and finite.
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a positive real number, got {value!r}.")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive, finite real number, got {value!r}.")
    return float(value)


def check_bool(value: object, name: str) -> bool:
    """Return ``value`` if it is a ``bool`` (a string such as ``"no"`` would be truthy).

    Raises:
        ArgumentTypeError: For anything else.
    """
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be True or False, got {value!r}.")
    return value


def check_module(value: object, name: str = "model") -> nn.Module:
    """Return ``value`` if it is a ``torch.nn.Module``.

    Raises:
        TypeError: For anything else.
    """
    if not isinstance(value, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}.")
    return value


def check_mapping(value: object, name: str) -> dict[str, Any]:
    """A copy of ``value`` as a dict if it is a mapping with string keys (None: empty).

    The values are keyword arguments handed on to a constructor of the user's choosing
    (a backend, an optimiser), of whatever types it takes.

    Raises:
        ArgumentTypeError: For anything else.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ArgumentTypeError(
            f"{name} must be a dict of keyword arguments (or None), got {type(value).__name__}."
        )
    return dict(value)


def check_generator(value: object) -> torch.Generator | None:
    """Return ``value`` if it is None or a ``torch.Generator``.

    Raises:
        ArgumentTypeError: For anything else, e.g. an integer seed.
    """
    if value is not None and not isinstance(value, torch.Generator):
        raise ArgumentTypeError(
            f"generator must be a torch.Generator or None, got {type(value).__name__} (for a "
            "seed use torch.Generator().manual_seed(seed))."
        )
    return value


def check_finite_result(value: T, what: str) -> T:
    """Return ``value`` (a tensor) if every entry is finite.

    Raises:
        RuntimeError: Naming ``what``, for NaN or inf entries.
    """
    if not bool(torch.isfinite(torch.as_tensor(value).detach()).all()):
        raise RuntimeError(
            f"the {what} contains NaN or inf; check the model's outputs and the data."
        )
    return value


def is_real_scalar(value: object) -> bool:
    """Whether ``value`` is a real scalar (bools included) or a tensor of shape () or (1,)."""
    if torch.is_tensor(value):
        return value.ndim == 0 or (value.ndim == 1 and len(value) == 1)
    return bool(np.isscalar(value) and isinstance(value, numbers.Real | np.bool_))
