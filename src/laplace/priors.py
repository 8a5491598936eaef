"""Validation of the hyperparameters: prior precision and mean, observation noise, temperature.

Also the expansion of a scalar or layer-wise prior precision to the diagonal.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from laplace.errors import ArgumentTypeError, MetaDeviceError
from laplace.utils.enums import Likelihood

__all__ = [
    "as_float_tensor",
    "as_prior_mean",
    "as_prior_precision",
    "as_scalar_prior_precision",
    "as_sigma_noise",
    "check_temperature",
    "expand_to_diagonal",
]


def as_float_tensor(value: float | Tensor, name: str, device, dtype) -> Tensor:
    """A real number or tensor as a floating-point tensor on ``device`` with ``dtype``.

    Raises:
        ArgumentTypeError: (a ``ValueError`` and a ``TypeError``) for anything else, e.g. a
            string, a list, None, or a complex or boolean tensor.
        MetaDeviceError: For a tensor on the ``meta`` device (it holds no values).
        ValueError: For a finite number that overflows ``dtype`` or a non-zero one that
            becomes zero in it (e.g. 1e-50 in float32).
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Tensor)):
        raise ArgumentTypeError(
            f"{name} must be a real number or a torch.Tensor, got {type(value).__name__}."
        )
    if isinstance(value, Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise ArgumentTypeError(
                f"{name} must be a real (integer or floating-point) tensor, got {value.dtype}."
            )
        if value.device.type == "meta":
            raise MetaDeviceError(f"{name} is on the meta device: it holds no values.")
        source = value.detach()
        converted = value.to(device=device, dtype=dtype)
    else:
        # A number goes straight to the parameters' dtype (via float32 it would lose digits).
        source = torch.tensor(float(value), dtype=torch.float64)
        converted = torch.tensor(float(value), device=device, dtype=dtype)
    _check_representable(source, converted.detach(), name, dtype)
    return converted


def _check_representable(source: Tensor, converted: Tensor, name: str, dtype) -> None:
    """Refuse values that overflow to inf or flush to zero when converted to ``dtype``."""
    source = source.to(device=converted.device)
    finite = torch.isfinite(source)
    if bool((finite & ~torch.isfinite(converted)).any()):
        raise ValueError(
            f"{name} overflows the parameters' dtype {dtype} (largest value "
            f"{torch.finfo(dtype).max:.3g}); use a smaller value or a float64 model."
        )
    if bool(((source != 0) & (converted == 0)).any()):
        raise ValueError(
            f"{name} is zero in the parameters' dtype {dtype} (smallest positive value "
            f"{torch.finfo(dtype).tiny:.3g}); use a larger value or a float64 model."
        )


def as_prior_precision(
    value: float | Tensor, n_layers: int | None, n_params: int | None, device, dtype
) -> Tensor:
    """Check a prior precision and return it as a vector of length 1, ``n_layers`` or ``n_params``.

    Gradients are kept, so a precision with ``requires_grad`` stays differentiable. While the
    parameters are not known yet (``n_params`` None: a last layer found on the first batch of
    ``fit``) the length is not checked; it is checked again once they are.

    Raises:
        ValueError: If the length fits none of the three structures or an entry is not positive.
    """
    tensor = as_float_tensor(value, "prior_precision", device, dtype)
    if tensor.dim() > 1:
        raise ValueError(
            f"prior_precision must be a scalar or a vector, got shape {tuple(tensor.shape)}."
        )
    tensor = tensor.reshape(-1)
    if n_params is not None and len(tensor) not in (1, n_layers, n_params):
        layerwise = "" if n_layers is None else f"layer-wise (length n_layers={n_layers}) or "
        raise ValueError(
            f"prior_precision has length {len(tensor)}; it must be a scalar (length 1), "
            f"{layerwise}diagonal (length n_params={n_params})."
        )
    if not bool((tensor.detach() > 0).all()) or not bool(torch.isfinite(tensor.detach()).all()):
        raise ValueError("prior_precision must be positive and finite in every entry.")
    return tensor


def as_scalar_prior_precision(value: float | Tensor, owner: str, device, dtype) -> Tensor:
    """Check an isotropic prior precision ``δ`` and return it with shape (1,).

    Args:
        value: The candidate.
        owner: The class that needs a scalar, for the message.
        device: Device of the result.
        dtype: Floating-point type of the result.

    Raises:
        ValueError: If it is not a positive finite scalar (a wrong type raises an error that
            is a ``ValueError`` and a ``TypeError``).
    """
    tensor = as_prior_precision(value, None, None, device, dtype)
    if len(tensor) != 1:
        raise ValueError(
            f"{owner} needs a scalar prior_precision (isotropic: the GP kernel is J Jᵀ/δ), "
            f"got length {len(tensor)}."
        )
    return tensor


def as_prior_mean(value: float | Tensor, n_params: int | None, device, dtype) -> Tensor:
    """Check a prior mean: a scalar or a vector of length ``n_params`` (unchecked while None).

    Raises:
        ValueError: If the mean is neither a scalar nor of length ``n_params``, or not finite.
    """
    tensor = as_float_tensor(value, "prior_mean", device, dtype)
    if not bool(torch.isfinite(tensor.detach()).all()):
        raise ValueError("prior_mean must be finite in every entry (no NaN or inf).")
    if tensor.numel() == 1:
        return tensor.reshape(())
    if tensor.dim() != 1 or (n_params is not None and len(tensor) != n_params):
        raise ValueError(
            f"prior_mean must be a scalar or a vector of length n_params={n_params}, "
            f"got shape {tuple(tensor.shape)}."
        )
    return tensor


def expand_to_diagonal(prior_precision: Tensor, layer_sizes: list[int]) -> Tensor:
    """Expand a scalar, layer-wise or diagonal precision to the diagonal, shape (P,)."""
    n_params = sum(layer_sizes)
    if len(prior_precision) == n_params:
        return prior_precision
    if len(prior_precision) == 1:
        return prior_precision.expand(n_params)
    sizes = torch.as_tensor(layer_sizes, device=prior_precision.device)
    return torch.repeat_interleave(prior_precision, sizes)


def as_sigma_noise(value: float | Tensor, likelihood: Likelihood, device, dtype) -> Tensor:
    """Check the observation noise σ: a positive scalar, 1 unless the likelihood is regression.

    Raises:
        ValueError: For a tensor with more than one entry or dimension, a non-positive σ, or
            σ ≠ 1 for classification; a wrong type raises an error that is a ``ValueError``
            and a ``TypeError``.
    """
    sigma = as_float_tensor(value, "sigma_noise", device, dtype)
    if sigma.dim() > 1 or sigma.numel() != 1:
        raise ValueError(
            "sigma_noise must be a scalar (homoscedastic noise): a number or a tensor of shape "
            f"() or (1,), got shape {tuple(sigma.shape)}."
        )
    if not bool(sigma.detach() > 0) or not bool(torch.isfinite(sigma.detach()).all()):
        raise ValueError(f"sigma_noise must be positive and finite, got {sigma.item()}.")
    if likelihood != Likelihood.REGRESSION and not bool(sigma.detach() == 1):
        raise ValueError(
            f"sigma_noise must be 1 for likelihood={likelihood.value!r}; observation noise "
            "only applies to regression."
        )
    return sigma


def check_temperature(temperature: float | Tensor) -> float | Tensor:
    """Return ``temperature`` if it is a positive, finite real number (or one-element tensor).

    Raises:
        ArgumentTypeError: If it is not a real number or a one-element real tensor (a
            ``ValueError`` and a ``TypeError``).
        ValueError: If it is not positive and finite.
    """
    if isinstance(temperature, Tensor) and (
        temperature.numel() != 1 or temperature.is_complex() or temperature.dtype == torch.bool
    ):
        raise ArgumentTypeError(
            "temperature must be a positive real number or a one-element real tensor, got a "
            f"{temperature.dtype} tensor of shape {tuple(temperature.shape)}."
        )
    if isinstance(temperature, bool) or not isinstance(temperature, (numbers.Real, Tensor)):
        raise ArgumentTypeError(
            f"temperature must be a positive real number, got {type(temperature).__name__}."
        )
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be positive and finite, got {temperature}.")
    return temperature
