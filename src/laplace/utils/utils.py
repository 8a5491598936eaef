"""Prior bookkeeping and sampling helpers, and laplace-torch's ``laplace.utils.utils`` path.

The evaluation helpers live in :mod:`laplace.utils.validation` and the dense linear algebra in
:mod:`laplace.utils.linalg`; both are re-exported here under laplace-torch's module path.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Sampler

from laplace.utils.enums import PriorStructure, parse_enum
from laplace.utils.linalg import (
    block_diag,
    diagonal_add_scalar,
    invsqrt_precision,
    kron,
    normal_samples,
    symeig,
)
from laplace.utils.validation import get_nll, validate

__all__ = [
    "SoDSampler",
    "block_diag",
    "diagonal_add_scalar",
    "expand_prior_precision",
    "fix_prior_prec_structure",
    "get_nll",
    "invsqrt_precision",
    "kron",
    "normal_samples",
    "parameters_per_layer",
    "symeig",
    "validate",
]

_BATCHNORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class SoDSampler(Sampler):
    """Sampler over a fixed random subset of ``M`` out of ``N`` indices (subset of data).

    The subset is drawn once, without replacement, from ``numpy.random.default_rng(seed)``.

    Args:
        N: Size of the dataset.
        M: Size of the subset, ``0 ≤ M ≤ N``.
        seed: Seed of the numpy generator.

    Raises:
        ValueError: If ``M`` is negative or larger than ``N``.
    """

    def __init__(self, N: int, M: int, seed: int = 0):
        if not 0 <= M <= N:
            raise ValueError(f"need 0 <= M <= N, got N={N}, M={M}.")
        self.N, self.M, self.seed = N, M, seed
        rng = np.random.default_rng(seed)
        self.indices = torch.as_tensor(rng.choice(N, M, replace=False))

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


# --------------------------------------------------------------------------- priors


def parameters_per_layer(model: nn.Module) -> list[int]:
    """Number of entries of every parameter tensor of ``model`` (frozen ones included).

    Args:
        model: A torch module.

    Returns:
        ``[p.numel() for p in model.parameters()]``.
    """
    return [p.numel() for p in model.parameters()]


def _is_batchnorm(module: nn.Module) -> bool:
    """Whether ``module`` is a 1d, 2d or 3d batch-norm layer.

    Args:
        module: A torch module.

    Returns:
        True for ``BatchNorm1d/2d/3d`` instances (and subclasses).
    """
    return isinstance(module, _BATCHNORM_TYPES)


def _is_valid_scalar(scalar: Any) -> bool:
    """Whether ``scalar`` is a real number or a tensor holding exactly one value.

    Args:
        scalar: Candidate value.

    Returns:
        True for real Python/numpy scalars (bools included), 0-d tensors and tensors of
        shape ``(1,)``; False otherwise (strings, complex numbers, lists, larger tensors).
    """
    if torch.is_tensor(scalar):
        return scalar.ndim == 0 or (scalar.ndim == 1 and len(scalar) == 1)
    return bool(np.isscalar(scalar) and isinstance(scalar, numbers.Real | np.bool_))


def expand_prior_precision(prior_prec: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """Expand a scalar, layer-wise or diagonal prior precision to one value per parameter.

    Only parameters with ``requires_grad`` count. A length-1 (or 0-d) ``prior_prec`` is a
    scalar, a length-``P`` one is already diagonal, and a length-``n_layers`` one holds one
    value per trainable parameter tensor (the scalar rule wins if lengths coincide, then the
    diagonal one). Layer-wise values are cast to the parameters' dtype.

    Args:
        prior_prec: Prior precision of shape ``()``, ``(1,)``, ``(n_layers,)`` or ``(P,)``.
        model: Module whose trainable parameters the prior applies to.

    Returns:
        Diagonal prior precision of shape ``(P,)``.

    Raises:
        ValueError: If ``prior_prec`` has more than one dimension or an unsupported length.
    """
    prior_prec = torch.as_tensor(prior_prec)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no parameters with requires_grad=True.")
    device, dtype = params[0].device, params[0].dtype
    n_params = sum(p.numel() for p in params)
    if prior_prec.ndim > 1:
        raise ValueError(
            f"prior_prec must be a scalar or a vector, got shape {tuple(prior_prec.shape)}."
        )
    if prior_prec.numel() == 1:
        return prior_prec.reshape(1).to(device) * torch.ones(n_params, device=device, dtype=dtype)
    if len(prior_prec) == n_params:
        return prior_prec.to(device)
    if len(prior_prec) == len(params):
        sizes = torch.tensor([p.numel() for p in params], device=device)
        return torch.repeat_interleave(prior_prec.to(device=device, dtype=dtype), sizes)
    raise ValueError(
        f"prior_prec must have length 1, n_layers={len(params)} or n_params={n_params}, "
        f"got {len(prior_prec)}."
    )


def fix_prior_prec_structure(
    prior_prec_init: torch.Tensor | float,
    prior_structure: PriorStructure | str,
    n_layers: int,
    n_params: int,
    device: torch.device | str | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Build a constant prior precision with the shape that ``prior_structure`` asks for.

    Args:
        prior_prec_init: Positive value filling the tensor: a number or a one-element tensor.
        prior_structure: ``"scalar"`` (shape ``(1,)``), ``"layerwise"`` (``(n_layers,)``)
            or ``"diag"`` (``(n_params,)``).
        n_layers: Number of parameter tensors treated probabilistically (callers count
            those with ``requires_grad``).
        n_params: Number of parameters treated probabilistically.
        device: Device of the result.
        dtype: Dtype of the result.

    Returns:
        The prior precision tensor.

    Raises:
        ValueError: If ``prior_structure`` is unknown, ``prior_prec_init`` is not positive
            and finite, or the requested length is not a positive integer.
        TypeError: If ``prior_prec_init`` is not a single real value.
    """
    structure = parse_enum(PriorStructure, prior_structure, "prior_structure")
    if not _is_valid_scalar(prior_prec_init):
        raise TypeError(
            f"prior_prec_init must be a single real value, got {type(prior_prec_init).__name__}"
            + (
                f" of shape {tuple(prior_prec_init.shape)}."
                if torch.is_tensor(prior_prec_init)
                else "."
            )
        )
    value = float(torch.as_tensor(prior_prec_init).item())
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"prior_prec_init must be positive and finite, got {value}.")
    length = {
        PriorStructure.SCALAR: 1,
        PriorStructure.LAYERWISE: n_layers,
        PriorStructure.DIAG: n_params,
    }[structure]
    name = {PriorStructure.LAYERWISE: "n_layers", PriorStructure.DIAG: "n_params"}.get(structure)
    if name is not None and (
        isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 1
    ):
        raise ValueError(f"{name} must be a positive integer, got {length!r}.")
    return torch.full((int(length),), value, device=device, dtype=dtype)
