"""Small numerical and bookkeeping helpers shared across the library.

The helpers fall in four groups:

* evaluation: :func:`get_nll` and :func:`validate` (used by the grid search over prior
  precisions);
* dense linear algebra: :func:`invsqrt_precision`, :func:`kron`, :func:`diagonal_add_scalar`,
  :func:`symeig`, :func:`block_diag`;
* sampling: :func:`normal_samples` and :class:`SoDSampler`;
* prior bookkeeping: :func:`parameters_per_layer`, :func:`expand_prior_precision`,
  :func:`fix_prior_prec_structure`, :func:`_is_valid_scalar`, :func:`_is_batchnorm`.
"""

from __future__ import annotations

import copy
import inspect
import logging
import numbers
from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Sampler

from laplace.utils.enums import LinkApprox, PredType, PriorStructure, parse_enum

if TYPE_CHECKING:
    from laplace.baselaplace import BaseLaplace

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

logger = logging.getLogger(__name__)

_BATCHNORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


# --------------------------------------------------------------------------- evaluation


def get_nll(out_dist: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of class probabilities.

    Computes ``-(1/B) Σ_b log out_dist[b, targets[b]]``.

    Args:
        out_dist: Predictive class probabilities, shape ``(B, C)``.
        targets: Integer class labels, shape ``(B,)``.

    Returns:
        The mean negative log-likelihood, a 0-d tensor.

    Raises:
        ValueError: If the shapes of ``out_dist`` and ``targets`` do not match.
    """
    if out_dist.ndim != 2:
        raise ValueError(f"out_dist must have shape (B, C), got {tuple(out_dist.shape)}.")
    if targets.shape != out_dist.shape[:1]:
        raise ValueError(
            f"targets must have shape ({out_dist.shape[0]},) to match out_dist, "
            f"got {tuple(targets.shape)}."
        )
    picked = out_dist.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return -picked.log().mean()


def _model_device(laplace: Any) -> torch.device:
    """Device on which ``laplace`` expects its inputs."""
    device = getattr(laplace, "_device", None)
    if device is not None:
        return torch.device(device)
    param = next(iter(laplace.model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def _split_batch(
    data: Any, dict_key_y: str, device: torch.device
) -> tuple[torch.Tensor | MutableMapping, torch.Tensor]:
    """Split a loader batch into inputs and targets, both moved to ``device``."""
    if isinstance(data, MutableMapping):
        if dict_key_y not in data:
            raise ValueError(
                f"dict-like batch has no target under dict_key_y={dict_key_y!r}; "
                f"keys: {list(data.keys())}."
            )
        X = copy.copy(data)  # never mutate the user's batch
        for key, value in data.items():
            if torch.is_tensor(value):
                X[key] = value.to(device)
        return X, data[dict_key_y].to(device)
    try:
        X, y = data
    except (TypeError, ValueError):
        raise ValueError(
            "val_loader must yield (X, y) pairs or dict-like batches with the targets "
            f"under dict_key_y={dict_key_y!r}."
        ) from None
    return X.to(device), y.to(device)


def _accepts_args(fn: Callable, n_args: int) -> bool | None:
    """Whether ``fn`` can be called with ``n_args`` positional arguments (None: unknown)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*range(n_args))
    except TypeError:
        return False
    return True


def _update_metric(metric: torchmetrics.Metric, out: tuple, y: torch.Tensor) -> None:
    """Feed a regression predictive ``(f_mu, f_var)`` to a running metric.

    The variance is passed when ``metric.update`` accepts three arguments; otherwise the
    metric only receives the mean.
    """
    accepts = _accepts_args(metric.update, len(out) + 1)
    if accepts is True:
        metric.update(*out, y)
    elif accepts is False:
        metric.update(out[0], y)
    else:  # signature unknown: try the full call first
        try:
            metric.update(*out, y)
        except TypeError:
            metric.update(out[0], y)


def _scalar_result(value: Any) -> float:
    """Convert a loss value to a Python float, failing clearly on non-scalars."""
    tensor = torch.as_tensor(value)
    if tensor.numel() != 1:
        raise ValueError(f"loss must return a scalar, got a value of shape {tuple(tensor.shape)}.")
    return float(tensor.item())


@torch.no_grad()
def validate(
    laplace: BaseLaplace,
    val_loader: DataLoader,
    loss: torchmetrics.Metric
    | Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    | Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    pred_type: PredType | str = PredType.GLM,
    link_approx: LinkApprox | str = LinkApprox.PROBIT,
    n_samples: int = 100,
    dict_key_y: str = "labels",
) -> float:
    """Evaluate the Laplace predictive of ``laplace`` on a validation loader.

    The model is put in eval mode and the predictive
    ``laplace(X, pred_type=..., link_approx=..., n_samples=..., fitting=True)`` is run on every
    batch. Classification predictives are probabilities ``(B, C)``; regression GLM
    predictives are ``(f_mu (B, C), f_var (B, C, C))``.

    * A :class:`torchmetrics.Metric` is reset, updated batch by batch and its ``compute()``
      is summed (metrics such as a per-output MSE return one value per output). For
      regression, ``update(f_mu, f_var, y)`` is used when the metric's ``update`` accepts
      three arguments and ``update(f_mu, y)`` otherwise.
    * Any other callable is evaluated once on the concatenated predictions:
      ``loss(probs, y)`` for classification and ``loss(f_mu, f_var, y)`` for regression.

    Args:
        laplace: A Laplace approximation (anything callable like one with a ``model``).
        val_loader: Loader yielding ``(X, y)`` pairs or dict-like batches whose targets are
            stored under ``dict_key_y``.
        loss: A torchmetrics metric or a callable returning a scalar.
        pred_type: Predictive type passed to ``laplace``.
        link_approx: Link approximation passed to ``laplace``.
        n_samples: Number of Monte-Carlo samples passed to ``laplace``.
        dict_key_y: Key of the targets in dict-like batches.

    Returns:
        The validation loss as a Python float.

    Raises:
        TypeError: If ``loss`` is neither a metric nor callable.
        ValueError: If ``pred_type``/``link_approx`` are unknown, ``n_samples`` is not a
            positive integer, a batch has an unexpected format, or ``val_loader`` is empty.
    """
    if not callable(loss):
        raise TypeError(
            f"loss must be a torchmetrics.Metric or a callable, got {type(loss).__name__}."
        )
    pred_type = parse_enum(PredType, pred_type, "pred_type")
    link_approx = parse_enum(LinkApprox, link_approx, "link_approx")
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral):
        raise ValueError(f"n_samples must be a positive integer, got {n_samples!r}.")
    if n_samples < 1:
        raise ValueError(f"n_samples must be a positive integer, got {n_samples}.")

    laplace.model.eval()
    device = _model_device(laplace)
    running = isinstance(loss, torchmetrics.Metric)
    if running:
        loss.reset()

    means: list[torch.Tensor] = []
    variances: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    n_batches = 0
    for data in val_loader:
        X, y = _split_batch(data, dict_key_y, device)
        out = laplace(
            X, pred_type=pred_type, link_approx=link_approx, n_samples=n_samples, fitting=True
        )
        n_batches += 1
        if running:
            if isinstance(out, tuple):
                _update_metric(loss, out, y)
            else:
                loss.update(out, y)
            continue
        if isinstance(out, tuple):
            means.append(out[0])
            variances.append(out[1])
        else:
            means.append(out)
        targets.append(y)

    if n_batches == 0:
        raise ValueError("val_loader yielded no batches.")
    if running:
        return float(loss.compute().sum().item())
    y_all = torch.cat(targets, dim=0)
    if variances:
        return _scalar_result(loss(torch.cat(means, dim=0), torch.cat(variances, dim=0), y_all))
    return _scalar_result(loss(torch.cat(means, dim=0), y_all))


# --------------------------------------------------------------------------- linear algebra


def _require_square(M: torch.Tensor, name: str) -> None:
    if M.ndim < 2 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"{name} must be a (batch of) square matrices, got {tuple(M.shape)}.")


def invsqrt_precision(M: torch.Tensor) -> torch.Tensor:
    """Lower-triangular square root of the inverse of a precision matrix.

    Returns the lower-triangular ``L`` with ``L Lᵀ = M⁻¹`` (equivalently ``Lᵀ M L = I``),
    i.e. the Cholesky factor of the covariance, without forming ``M⁻¹``. With ``J`` the
    exchange (index-reversal) matrix, factor ``J M J = U Uᵀ`` (``U`` lower triangular); then
    ``M = R Rᵀ`` with the upper-triangular ``R = J U J``, so ``M⁻¹ = R⁻ᵀ R⁻¹`` and
    ``L = R⁻ᵀ`` is lower triangular, found by one triangular solve.

    Args:
        M: Symmetric positive-definite matrix, shape ``(..., P, P)``.

    Returns:
        ``L`` of shape ``(..., P, P)``, lower triangular.

    Raises:
        ValueError: If ``M`` is not a (batch of) square matrices.
        torch.linalg.LinAlgError: If ``M`` is not positive definite.
    """
    _require_square(M, "M")
    flipped = torch.flip(M, (-2, -1))
    U = torch.linalg.cholesky(flipped)  # lower triangular, J M J = U Uᵀ
    R = torch.flip(U, (-2, -1))  # upper triangular, M = R Rᵀ
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device).expand_as(M)
    # L = R⁻ᵀ is lower triangular: solve Rᵀ L = I.
    return torch.linalg.solve_triangular(R.mT, eye, upper=False)


def kron(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    """Kronecker product of two matrices.

    ``kron(A, B)[i·p + k, j·q + l] = A[i, j] · B[k, l]`` for ``B`` of shape ``(p, q)``.

    Args:
        t1: Matrix of shape ``(m, n)``.
        t2: Matrix of shape ``(p, q)``.

    Returns:
        The Kronecker product, shape ``(m·p, n·q)``.

    Raises:
        ValueError: If either input is not two-dimensional.
    """
    for name, t in (("t1", t1), ("t2", t2)):
        if t.ndim != 2:
            raise ValueError(f"{name} must be a matrix, got shape {tuple(t.shape)}.")
    m, n = t1.shape
    p, q = t2.shape
    return (t1[:, None, :, None] * t2[None, :, None, :]).reshape(m * p, n * q)


def diagonal_add_scalar(X: torch.Tensor, value: torch.Tensor | float) -> torch.Tensor:
    """Return a copy of ``X`` with ``value`` added to its main diagonal.

    Args:
        X: Matrix of shape ``(n, m)``.
        value: A scalar, or a tensor broadcastable to the diagonal of length ``min(n, m)``.

    Returns:
        ``X + value·I`` (out of place, differentiable), shape ``(n, m)``.

    Raises:
        ValueError: If ``X`` is not two-dimensional.
    """
    if X.ndim != 2:
        raise ValueError(f"X must be a matrix, got shape {tuple(X.shape)}.")
    k = min(X.shape)
    diag = X.new_ones(k) * value
    if X.shape[0] == X.shape[1]:
        return X + torch.diag_embed(diag)
    out = X.clone()
    out.diagonal().add_(diag)
    return out


def symeig(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Robust symmetric eigendecomposition ``M = W diag(L) Wᵀ`` of a PSD matrix.

    Only the upper triangle of ``M`` is read. When the solver does not converge, it is
    retried on ``M + I`` and 1 is subtracted from the eigenvalues. Eigenvalues are clamped at
    0 (``M`` is meant to be positive semi-definite) and NaNs are replaced by zeros.

    Args:
        M: Symmetric matrix, shape ``(..., P, P)``.

    Returns:
        ``(L, W)``: eigenvalues ``(..., P)`` in ascending order, clamped at 0, and
        orthonormal eigenvectors as columns, ``(..., P, P)``.

    Raises:
        ValueError: If ``M`` is not a (batch of) square matrices.
        torch.linalg.LinAlgError: If the decomposition fails even with jitter.
    """
    _require_square(M, "M")
    try:
        L, W = torch.linalg.eigh(M, UPLO="U")
    except RuntimeError:
        logger.info("symeig: eigh did not converge, retrying with unit jitter.")
        eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
        try:
            L, W = torch.linalg.eigh(M + eye, UPLO="U")
        except RuntimeError as err:
            raise torch.linalg.LinAlgError(
                "symeig: eigendecomposition failed even after adding unit jitter; "
                f"max |M| = {M.abs().max().item():.3g}, NaNs: {bool(M.isnan().any())}."
            ) from err
        L = L - 1.0
    L = torch.nan_to_num(L.clamp(min=0.0))
    W = torch.nan_to_num(W)
    return L, W


def block_diag(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Block-diagonal matrix from a sequence of blocks.

    Args:
        blocks: Non-empty sequence of matrices; block ``k`` has shape ``(p_k, q_k)``.

    Returns:
        Matrix of shape ``(Σ p_k, Σ q_k)`` with the blocks on the diagonal and zeros elsewhere.

    Raises:
        ValueError: If ``blocks`` is empty or a block is not two-dimensional.
    """
    blocks = list(blocks)
    if not blocks:
        raise ValueError("blocks must contain at least one matrix.")
    for i, b in enumerate(blocks):
        if b.ndim != 2:
            raise ValueError(f"blocks[{i}] must be a matrix, got shape {tuple(b.shape)}.")
    return torch.block_diag(*blocks)


# --------------------------------------------------------------------------- sampling


def normal_samples(
    mean: torch.Tensor,
    var: torch.Tensor,
    n_samples: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw samples from a batch of Gaussians with diagonal or full covariance.

    One standard-normal matrix ``Z`` of shape ``(C, S)`` is drawn and shared by all ``B``
    Gaussians (as in laplace-torch, so a seeded generator gives the same numbers): sample
    ``s`` of Gaussian ``b`` is ``mean[b] + sqrt(var[b]) ⊙ Z[:, s]`` for a diagonal and
    ``mean[b] + chol(var[b]) Z[:, s]`` for a full covariance. Each Gaussian's samples are
    exact; samples of different batch entries are correlated through ``Z``.

    Args:
        mean: Means, shape ``(B, C)``.
        var: Variances ``(B, C)`` or covariances ``(B, C, C)``.
        n_samples: Number of samples ``S``.
        generator: Optional random number generator.

    Returns:
        Samples of shape ``(S, B, C)``.

    Raises:
        ValueError: If the shapes are inconsistent, ``n_samples`` is not positive, or a
            diagonal variance is negative.
        torch.linalg.LinAlgError: If a covariance is not positive definite.
    """
    if mean.ndim != 2:
        raise ValueError(f"mean must have shape (B, C), got {tuple(mean.shape)}.")
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral):
        raise ValueError(f"n_samples must be a positive integer, got {n_samples!r}.")
    if n_samples < 1:
        raise ValueError(f"n_samples must be a positive integer, got {n_samples}.")
    batch, n_out = mean.shape
    diagonal = var.shape == mean.shape
    if diagonal:
        if bool((var < 0).any()):
            raise ValueError("var must be non-negative for a diagonal covariance.")
    elif var.shape != (batch, n_out, n_out):
        raise ValueError(
            f"var must have shape {(batch, n_out)} (diagonal) or {(batch, n_out, n_out)} "
            f"(full) for mean of shape {(batch, n_out)}, got {tuple(var.shape)}."
        )
    z = torch.randn(
        (n_out, int(n_samples)), device=mean.device, dtype=mean.dtype, generator=generator
    )
    # (B, C, S): scale the shared standard-normal draws per Gaussian.
    noise = var.sqrt().unsqueeze(-1) * z if diagonal else torch.linalg.cholesky(var) @ z
    return (mean.unsqueeze(-1) + noise).permute(2, 0, 1)


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
