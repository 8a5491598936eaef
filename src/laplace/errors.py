"""Exceptions that keep our messages and laplace-torch's exception types at once.

Code written for laplace-torch catches the types it raises (``except ValueError``,
``except KeyError``, ``hasattr``). Where the natural type of one of our errors differs, the
exception derives from both, so either ``except`` clause catches it:

- :class:`ArgumentTypeError` (``ValueError`` and ``TypeError``): an argument of the wrong type,
  e.g. a string as ``prior_precision`` (laplace-torch raises ``ValueError`` there);
- :class:`MissingKeyError` (``KeyError`` and ``ValueError``): a key that a mapping or a model does
  not have, e.g. ``dict_key_y`` missing from a batch or an unknown ``last_layer_name``;
- :class:`NotFittedError` (``RuntimeError`` and ``AttributeError``): something that needs
  :meth:`fit` (or a last layer that is not known yet), so ``hasattr(la, name)`` and
  ``getattr(la, name, default)`` work on properties that cannot be computed yet;
- :class:`UnsupportedError` (``NotImplementedError`` and ``AttributeError``): a property an
  approximation does not have (e.g. ELLA's training log-likelihood), for the same reason.
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = [
    "ArgumentTypeError",
    "MissingKeyError",
    "NotFittedError",
    "UnsupportedError",
    "check_positive_int",
]


class ArgumentTypeError(ValueError, TypeError):
    """An argument of the wrong type; a ``ValueError`` (as laplace-torch) and a ``TypeError``."""


class MissingKeyError(KeyError, ValueError):
    """A key that is not there; a ``KeyError`` (as laplace-torch) and a ``ValueError``.

    Its ``str`` is the message itself (``KeyError`` would print it quoted).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class NotFittedError(RuntimeError, AttributeError):
    """A quantity that needs ``fit()`` first; an ``AttributeError`` too, so ``hasattr`` works."""


class UnsupportedError(NotImplementedError, AttributeError):
    """A property this approximation does not have; an ``AttributeError`` too, for ``hasattr``."""


def check_positive_int(value: Any, name: str) -> int:
    """Return ``value`` if it is a positive integer (``bool`` excluded).

    Args:
        value: The candidate, e.g. a number of samples.
        name: The argument's name, for the message.

    Raises:
        ValueError: If ``value`` is not an integer of at least 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)
