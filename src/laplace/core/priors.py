"""The hyperparameters' checks (prior precision and mean, σ, temperature) and prior expansion."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor, nn

from laplace.likelihoods import LikelihoodModel
from laplace.structures.posterior import expand_to_diagonal
from laplace.utils.enums import PriorStructure
from laplace.utils.errors import (
    ArgumentTypeError,
    MetaDeviceError,
    check_positive_float,
    check_positive_int,
)

__all__ = [
    "as_float_tensor",
    "as_prior_mean",
    "as_prior_precision",
    "as_scalar_prior_precision",
    "as_sigma_noise",
    "check_temperature",
    "expand_prior_precision",
    "expand_to_diagonal",
    "fix_prior_prec_structure",
]


def as_float_tensor(value: float | Tensor, name: str, device, dtype) -> Tensor:
    """A real number or tensor as a floating-point tensor on ``device`` with ``dtype``.

    Raises:
        ArgumentTypeError: For anything else, e.g. a string, or a complex or boolean tensor.
        MetaDeviceError: For a tensor on the ``meta`` device.
        ValueError: For a value that overflows ``dtype`` or a non-zero one that becomes zero.
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
        if value.dtype == dtype:  # no conversion, nothing to lose (a tuning step's prior)
            return converted
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

    Gradients are kept; with ``n_params`` None (last layer not found yet) the length is unchecked.

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
    values = tensor.detach()  # every entry in (0, inf), NaN not: read back from the device once
    if tensor.numel() == 1:
        valid = 0 < values.item() < math.inf
    else:
        valid = bool(((values > 0) & (values < math.inf)).all())
    if not valid:
        raise ValueError("prior_precision must be positive and finite in every entry.")
    return tensor


def as_scalar_prior_precision(value: float | Tensor, owner: str, device, dtype) -> Tensor:
    """Check an isotropic prior precision ``δ`` (for the class ``owner``); shape (1,).

    Raises:
        ValueError: If it is not a positive finite scalar.
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


def prior_weighted_sum(prior_precision: Tensor, values: Tensor, layer_sizes: list[int]) -> Tensor:
    """``Σᵢ p₀ᵢ vᵢ`` for ``values`` (P,) and a scalar, layer-wise or diagonal ``p₀`` unexpanded."""
    sums = sum_per_prior_entry(values, len(prior_precision), layer_sizes)
    return (prior_precision * sums).sum()


def sum_per_prior_entry(values: Tensor, n_prior: int, layer_sizes: list[int]) -> Tensor:
    """``values`` (P,) summed over the weights each entry of a prior of length ``n_prior`` covers.

    A scalar prior covers all of them (shape ()), a layer-wise one each layer (L,), a diagonal
    one each weight (the values as they are); ``(p₀ * sums).sum()`` is ``Σᵢ p₀ᵢ vᵢ``.
    """
    if n_prior == len(values):
        return values
    if n_prior == 1:
        return values.sum()
    return torch.stack([chunk.sum() for chunk in values.split(layer_sizes)])


def prior_log_det(prior_precision: Tensor, layer_sizes: list[int]) -> Tensor:
    """``log det diag(p₀)`` of a scalar, layer-wise or diagonal ``p₀``, unexpanded."""
    n_params = sum(layer_sizes)
    if len(prior_precision) == n_params:
        return prior_precision.log().sum()
    if len(prior_precision) == 1:
        return (prior_precision.log() * n_params).sum()
    like = prior_precision
    counts = torch.as_tensor(layer_sizes, device=like.device, dtype=like.dtype)
    return (prior_precision.log() * counts).sum()


def as_sigma_noise(value: float | Tensor, likelihood: LikelihoodModel, device, dtype) -> Tensor:
    """Check the observation noise σ (a number, shape () or (1,), or (C,) for one per output).

    Raises:
        ValueError: For more than one dimension, a non-positive σ, or σ ≠ 1 for a likelihood
            without observation noise.
    """
    sigma = as_float_tensor(value, "sigma_noise", device, dtype)
    if sigma.dim() > 1 or sigma.numel() == 0:
        raise ValueError(
            "sigma_noise must be a scalar (one σ: a number or a tensor of shape () or (1,)) or "
            f"a vector of shape (C,) (one σ per output), got shape {tuple(sigma.shape)}."
        )
    if not bool((sigma.detach() > 0).all()) or not bool(torch.isfinite(sigma.detach()).all()):
        raise ValueError(f"sigma_noise must be positive and finite, got {sigma.tolist()}.")
    if not likelihood.has_noise_hyperparameter and not bool((sigma.detach() == 1).all()):
        raise ValueError(
            f"sigma_noise must be 1 for likelihood={likelihood.name!r} (sigma_noise != 1 is only "
            "available for regression): the observation noise σ is a hyperparameter of "
            "likelihood='regression' only."
        )
    return sigma


def check_temperature(temperature: float | Tensor) -> float | Tensor:
    """Return ``temperature`` if it is a positive, finite real number (or one-element tensor).

    Raises:
        ArgumentTypeError: If it is not a real number or a one-element real tensor.
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


def expand_prior_precision(prior_prec: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """Expand a scalar, layer-wise or diagonal prior precision to the diagonal, shape (P,).

    Only parameters with ``requires_grad`` count; where lengths coincide, scalar wins, then
    diagonal.

    Args:
        prior_prec: Prior precision of shape ``()``, ``(1,)``, ``(n_layers,)`` or ``(P,)``.
        model: Module whose trainable parameters the prior applies to.

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
        n_layers: Number of parameter tensors treated probabilistically.
        n_params: Number of parameters treated probabilistically.
        device: Device of the result.
        dtype: Dtype of the result.

    Raises:
        ValueError: If ``prior_structure`` is unknown, ``prior_prec_init`` is not positive
            and finite, or the requested length is not a positive integer.
        TypeError: If ``prior_prec_init`` is not a single real value.
    """
    structure = PriorStructure(prior_structure)
    value = check_positive_float(prior_prec_init, "prior_prec_init")
    if structure == PriorStructure.SCALAR:
        length = 1
    elif structure == PriorStructure.LAYERWISE:
        length = check_positive_int(n_layers, "n_layers")
    else:
        length = check_positive_int(n_params, "n_params")
    return torch.full((int(length),), value, device=device, dtype=dtype)
