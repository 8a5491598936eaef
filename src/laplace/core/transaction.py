"""Calls that change nothing when they fail: snapshot the state, restore it on any exception.

``transactional`` wraps the ``TRANSACTIONAL_METHODS``; the snapshot is shallow, so they assign
new tensors, never modify a stored posterior in place (docs/architecture.md, "Serialization and
transactions"). ``preserve_model_gradients`` keeps the model's ``.grad`` across a fit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch
from torch import nn

__all__ = [
    "TRANSACTIONAL_METHODS",
    "Snapshot",
    "preserve_model_gradients",
    "transactional",
]

#: Methods of a Laplace approximation that change nothing when they raise.
TRANSACTIONAL_METHODS = (
    "fit",
    "load_state_dict",
    "log_marginal_likelihood",
    "optimize_prior_precision",
)

#: ids of the objects inside a transactional call (a nested call does not snapshot again).
_ACTIVE: set[int] = set()

P = ParamSpec("P")
R = TypeVar("R")


class Transactional(Protocol):
    """An object whose methods ``transactional`` wraps: what a snapshot of it holds."""

    #: The objects whose attributes a call may change (the object first).
    _transaction_parts: Callable[[], tuple[object, ...]]
    #: Attributes left out of the snapshot, each with the callable that rebuilds it.
    _transaction_rebuild: Callable[[], dict[str, Callable[[], object]]]


class WithModel(Protocol):
    """An object with a network ``model``."""

    @property
    def model(self) -> nn.Module:
        """The network."""
        ...


#: The object a method keeping the gradients belongs to.
M = TypeVar("M", bound=WithModel)


class Snapshot:
    """The attribute dictionaries of some objects, to put back after a failed call.

    Args:
        parts: The objects whose attributes a call may change (the approximation first).
        rebuild: Attributes of the first part left out of the snapshot, each with a callable
            (no arguments) that rebuilds it once the other attributes are restored.
    """

    def __init__(
        self, parts: tuple[object, ...], rebuild: dict[str, Callable[[], object]]
    ) -> None:
        self._states = [(part, dict(vars(part))) for part in parts]
        owner_state = self._states[0][1]
        for name in rebuild:
            owner_state.pop(name, None)
        self._rebuild = rebuild
        values = [value for _, state in self._states for value in state.values()]
        self._parameters = [(v, v.detach().clone()) for v in values if isinstance(v, nn.Parameter)]
        self._generators = [(v, v.get_state()) for v in values if isinstance(v, torch.Generator)]

    def restore(self) -> None:
        """Put every attribute back as it was (attributes added since are removed)."""
        for part, state in self._states:
            attributes = vars(part)
            attributes.clear()
            attributes.update(state)
        with torch.no_grad():
            for parameter, value in self._parameters:
                parameter.copy_(value)
        for generator, state in self._generators:
            generator.set_state(state)
        for rebuild in self._rebuild.values():
            rebuild()


def transactional(method: Callable[..., R]) -> Callable[..., R]:
    """Wrap a method so that it changes nothing when it raises; nested calls share a snapshot.

    The object provides ``_transaction_parts()`` and ``_transaction_rebuild()`` (``Snapshot``'s
    ``parts`` and ``rebuild``: a ``Transactional``). The wrapper takes any arguments: the
    classes that override a wrapped method of ``BaseLaplace`` keep their own parameter lists.
    """
    if getattr(method, "_transactional", False):
        return method

    @functools.wraps(method)
    def wrapper(self: Transactional, *args: object, **kwargs: object) -> R:
        if id(self) in _ACTIVE:
            return method(self, *args, **kwargs)
        snapshot = Snapshot(self._transaction_parts(), self._transaction_rebuild())
        _ACTIVE.add(id(self))
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            snapshot.restore()
            raise
        finally:
            _ACTIVE.discard(id(self))

    wrapper._transactional = True
    return wrapper


def preserve_model_gradients(
    method: Callable[Concatenate[M, P], R],
) -> Callable[Concatenate[M, P], R]:
    """Decorate a method of an object with a ``model`` so it leaves ``param.grad`` untouched.

    Every parameter's ``.grad`` (None included) is restored after the call, also when it raises.
    """

    @functools.wraps(method)
    def wrapped(self: M, *args: P.args, **kwargs: P.kwargs) -> R:
        params = list(self.model.parameters())
        saved = [None if p.grad is None else p.grad.detach().clone() for p in params]
        try:
            return method(self, *args, **kwargs)
        finally:
            for p, grad in zip(params, saved, strict=True):
                p.grad = grad

    return wrapped
