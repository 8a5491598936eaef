"""Helpers of the ASDL adapters: module checks, warnings, and reading ASDL's results off modules.

ASDL stores what it computes on the modules it ran on: ``module.fisher.diag.<param name>``,
``module.fisher.kron.{A, B}``, ``module.hessian.diag.<param name>``. The readers here turn those
into the library's flat parameter vector order (``model.parameters()``, trainable ones only).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from asdl.core import _supported_module_classes
from torch import Tensor, nn

from laplace.curvature.third_party import kron_blocks
from laplace.utils.matrix import Kron

__all__ = ["check_asdl_support", "diag_vector", "kron_from_asdl", "quiet"]


@contextmanager
def quiet() -> Iterator[None]:
    """Silence torch's warning about ASDL's (non-full) module backward hooks."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*non-full backward hook.*")
        yield


def check_asdl_support(model: nn.Module) -> None:
    """Refuse models whose trainable parameters live in modules ASDL has no rules for.

    Raises:
        ValueError: Naming the unsupported module types and the backend to use instead.
    """
    unsupported = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))
            and not isinstance(m, _supported_module_classes)
        }
    )
    if unsupported:
        supported = ", ".join(c.__name__ for c in _supported_module_classes)
        raise ValueError(
            f"ASDL cannot differentiate the trainable parameters of {unsupported} (it supports "
            f"{supported}); use backend=CurvlinopsGGN, which handles any module."
        )


def _trainable(module: nn.Module) -> Iterator[tuple[nn.Module, str, Tensor]]:
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False):
            if p.requires_grad:
                yield sub, name, p


def diag_vector(module: nn.Module, attr: str) -> Tensor:
    """Per-parameter diagonals stored by ASDL under ``<submodule>.<attr>.diag``, shape (P,).

    Raises:
        ValueError: If ASDL stored nothing for a trainable parameter.
    """
    parts = []
    for sub, name, _ in _trainable(module):
        value = getattr(getattr(getattr(sub, attr, None), "diag", None), name, None)
        if value is None:
            raise ValueError(
                f"ASDL computed no curvature for parameter {name!r} of {type(sub).__name__}; "
                "use backend=CurvlinopsGGN."
            )
        parts.append(value.flatten())
    return torch.cat(parts)


def kron_from_asdl(module: nn.Module, scale: float, n_data: int, factor: float) -> Kron:
    """The :class:`Kron` of ASDL's Kronecker factors stored on ``module``'s layers.

    ASDL's ``kron.B`` (p_out, p_out) is the output-gradient factor of the σ-free curvature and
    ``kron.A`` (p_in, p_in) the input factor, both summed over the batch; a bias block is ``B``.
    Only Linear and convolution layers are read (see
    :class:`~laplace.curvature.third_party.KroneckerLayersOnly`).

    Args:
        module: The module ASDL ran on.
        scale: Factor from ASDL's ``B`` to the library's output-gradient factor.
        n_data: Number of data points N of the whole data set.
        factor: The backend's loss factor.
    """
    blocks = []
    for sub, name, _ in _trainable(module):
        kron = sub.fisher.kron
        blocks.append((scale * kron.B, kron.A if name == "weight" else None))
    return kron_blocks(blocks, n_data, factor)
