"""The bad-input corpus: one row per bad call, with the error a user must get.

A :class:`BadInput` names the public entry point it exercises, builds what the call needs
(``setup``, outside the spy), makes the bad call (``act``), and states the exception type and
the words its message must contain (the argument's name, the accepted values or shapes). Where
laplace-torch raises for the same input, ``error`` is (also) its exception type.

:func:`no_curvature` traps every curvature and Jacobian route of every backend (and the closed
forms, the eigensolver's operator, the GP kernel), so a row also proves that the error comes
before any expensive work: a trapped route may only refuse at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import laplace.core.passes.head_curvature_sum
import laplace.core.passes.top_eigenpairs
import laplace.functional.kernel
from conftest import CASE_BUILDERS, Case
from laplace import Laplace
from laplace.curvature import CurvatureInterface
from laplace.curvature.engine.per_sample import PerSampleEngine

#: Backend methods that compute curvature or Jacobians (the expensive work).
CURVATURE_ROUTES = (
    "full",
    "kron",
    "diag",
    "jacobians",
    "last_layer_jacobians",
    "gradients",
    "functorch_jacobians",
    "functorch_gradients",
    "curvature_columns",
    "trace",
)


@dataclass(frozen=True)
class BadInput:
    """One bad call and the error it must raise.

    Attributes:
        entry: The public entry point (``"fit"``, ``"constructor"``, ...).
        name: What is wrong, as a test id.
        act: Makes the bad call, given what ``setup`` returned.
        error: The exception type the call must raise.
        words: Substrings the message must contain.
        setup: Builds the objects the call needs (run before the spy is armed).
        spied: Whether the call is made with every curvature route trapped; False only where
            the bad input can only show in the model's own forward pass inside a Jacobian.
    """

    entry: str
    name: str
    act: Callable[[Any], Any]
    error: type[BaseException]
    words: tuple[str, ...]
    setup: Callable[[], Any] = lambda: None
    spied: bool = True

    @property
    def id(self) -> str:
        return f"{self.entry}: {self.name}"


class CurvatureReached(BaseException):
    """Raised by a trapped curvature route; a BaseException so nothing swallows it."""


def _trap(route: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, failing the test unless it refuses at once (``NotImplementedError``).

    A backend refusing a structure it does not have (e.g. ``kron`` of a Hessian backend) is
    such a refusal: it computes nothing.
    """

    def trapped(*args: Any, **kwargs: Any) -> Any:
        try:
            original(*args, **kwargs)
        except NotImplementedError:
            raise
        except BaseException as error:
            raise CurvatureReached(f"curvature route {route!r} ran: {error!r}") from error
        raise CurvatureReached(f"curvature route {route!r} was computed before the error")

    return trapped


def _subclasses(cls: type) -> Iterator[type]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


@contextlib.contextmanager
def no_curvature() -> Iterator[None]:
    """Trap every curvature and Jacobian route (all backends, the closed forms, eigensolver)."""
    with pytest.MonkeyPatch.context() as patch:
        for cls in {*_subclasses(CurvatureInterface), PerSampleEngine}:
            for route in CURVATURE_ROUTES:
                if route in vars(cls):
                    trap = _trap(f"{cls.__name__}.{route}", vars(cls)[route])
                    patch.setattr(cls, route, trap)
        for owner, name in (
            (laplace.core.passes.head_curvature_sum, "output_curvature"),
            (laplace.core.passes.top_eigenpairs, "curvature_product"),
            (laplace.functional.kernel.SubsetKernel, "build"),
        ):
            patch.setattr(owner, name, _trap(name, getattr(owner, name)))
        yield


# ------------------------------------------------------------------ shared builders


def clf() -> Case:
    """The tiny classification MLP (3 inputs, C=4, 44 weights)."""
    return CASE_BUILDERS["mlp_classification"]()


def reg() -> Case:
    """The tiny regression MLP (3 inputs, 1 output)."""
    return CASE_BUILDERS["mlp_regression_1out"]()


def loader(X: Any, y: Any, batch_size: int = 5) -> DataLoader:
    return DataLoader(TensorDataset(X, y), batch_size=batch_size)


#: Keyword arguments a class needs besides the model and the likelihood.
EXTRA = {
    "lowrank": {"backend_kwargs": {"n_eigenvalues": 3}},
    "subnetwork": {"subnetwork_indices": torch.tensor([0, 4, 9, 30])},
    "gp": {"n_subset": 5},
}


def approximation(
    subset: str,
    structure: str,
    case: Case | None = None,
    model: nn.Module | None = None,
    **kwargs: Any,
):
    """An unfitted approximation of ``case`` (classification by default) or of ``model``."""
    case = case or clf()
    extra = {**EXTRA.get(subset, {}), **kwargs}
    if "functional_approximation" not in kwargs:
        extra = {**EXTRA.get(structure, {}), **extra}
    return Laplace(model or case.model, case.likelihood, subset, structure, **extra)


def fitted(subset: str = "all", structure: str = "full", case: Case | None = None, **kwargs):
    """``(case, la)`` with ``la`` fitted on the case's data."""
    case = case or clf()
    la = approximation(subset, structure, case, **kwargs)
    la.fit(case.loader())
    return case, la


class TupleModel(nn.Module):
    """Returns ``(logits, features)``, as some research code does."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 5).double()
        self.head = nn.Linear(5, 4).double()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.head(h), h


class DictModel(TupleModel):
    """Returns ``{"logits": ...}``, as HuggingFace models do."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"logits": super().forward(x)[0]}


class VectorModel(TupleModel):
    """Returns one value per input, shape (B,), without an output dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[0][:, 0]
