"""Top-k eigenpairs of the curvature summed over a data set, from matrix-vector products only.

The curvature of a backend family is wrapped as a curvlinops linear operator over the whole
training set (GGN, Monte-Carlo Fisher, empirical Fisher or Hessian), rescaled to the library's
loss (½‖y − f‖² for regression), and its largest eigenpairs are found by an iterative solver
that only multiplies with it: implicitly restarted Lanczos (ARPACK, ``scipy.sparse.linalg.eigsh``)
or LOBPCG (``scipy.sparse.linalg.lobpcg``, which multiplies blocks of vectors at once). No
P × P matrix is formed, so this works for every backend and any model size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from curvlinops import (
    EFLinearOperator,
    FisherMCLinearOperator,
    GGNLinearOperator,
    HessianLinearOperator,
)
from scipy.sparse.linalg import eigsh, lobpcg
from torch import Tensor

from laplace.curvature.curvature import CurvatureInterface, EFInterface, GGNInterface
from laplace.curvature.curvlinops import CurvlinopsHessian
from laplace.curvature.registry import available_optional, load_optional
from laplace.data import batch_size_of

__all__ = ["EIGENVALUE_THRESHOLD", "SOLVERS", "curvature_operator", "top_eigenpairs"]

#: Eigenvalues at or below this are dropped (as laplace-torch's low-rank backend does).
EIGENVALUE_THRESHOLD = 1e-6


def _hessian_backends() -> tuple[type[CurvatureInterface], ...]:
    optional = tuple(load_optional(n) for n in ("AsdlHessian",) if n in available_optional())
    return (CurvlinopsHessian, *optional)


def curvature_operator(
    backend: CurvatureInterface, data: Iterable[tuple[Any, Tensor]], n_data: int
) -> tuple[Any, float]:
    """The backend's curvature over ``data`` as a curvlinops operator, and its scale.

    Args:
        backend: A GGN (exact or ``stochastic``), empirical-Fisher or Hessian backend.
        data: Re-iterable batches ``(X, y)`` on the model's device.
        n_data: Number of data points in ``data``.

    Returns:
        The operator and the factor that turns it into the library's curvature (the torch
        losses are ``Σ(y − f)²``; the library's is ``½ Σ‖y − f‖²``).

    Raises:
        ValueError: For a backend with no matrix-free curvature.
    """
    kwargs: dict[str, Any] = {
        "check_deterministic": False,
        "num_data": n_data,
        "batch_size_fn": lambda X: batch_size_of(X, backend.dict_key_x),
    }
    if isinstance(backend, GGNInterface) and getattr(backend, "stochastic", False):
        operator_cls, scale = FisherMCLinearOperator, backend.factor
        kwargs["mc_samples"] = backend.num_samples
    elif isinstance(backend, GGNInterface):
        operator_cls, scale = GGNLinearOperator, backend.factor
    elif isinstance(backend, EFInterface):
        operator_cls, scale = EFLinearOperator, backend.factor**2
    elif isinstance(backend, _hessian_backends()):
        operator_cls, scale = HessianLinearOperator, backend.factor
    else:
        raise ValueError(
            f"{type(backend).__name__} has no matrix-free curvature for low-rank Laplace; use "
            "a GGN, empirical-Fisher or Hessian backend (e.g. CurvlinopsGGN, CurvlinopsEF, "
            "CurvlinopsHessian, AsdlHessian)."
        )
    operator = operator_cls(backend.model, backend.lossfunc, backend.params, data, **kwargs)
    return operator, scale


def _lanczos(operator: Any, k: int, tol: float, max_iter: int | None, rng) -> np.ndarray:
    scipy_op = _scipy(operator)
    v0 = rng.standard_normal(operator.shape[0]).astype(scipy_op.dtype)
    return eigsh(scipy_op, k=k, which="LA", tol=tol, maxiter=max_iter, v0=v0)


def _lobpcg(operator: Any, k: int, tol: float, max_iter: int | None, rng) -> np.ndarray:
    scipy_op = _scipy(operator)
    X = rng.standard_normal((operator.shape[0], k)).astype(scipy_op.dtype)
    return lobpcg(scipy_op, X, largest=True, tol=tol or None, maxiter=max_iter or 200)


def _randomized(operator: Any, k: int, tol: float, max_iter: int | None, rng) -> np.ndarray:
    """Randomised block subspace iteration with Rayleigh–Ritz (Halko et al., 2011, alg. 5.3).

    Every pass over the data multiplies a whole block of ``k + oversampling`` vectors, which
    costs little more than one vector, so ``max_iter`` (default 4) power iterations need only
    ``max_iter + 2`` passes, against the hundreds of single products of Lanczos. The top
    eigenpairs are accurate when the spectrum decays past the k-th eigenvalue, as curvature
    spectra of networks do; ``tol`` is unused.
    """
    dtype, device = operator.dtype, operator.device
    n_block = min(operator.shape[0], k + max(10, k))
    start = rng.standard_normal((operator.shape[0], n_block))
    Q = torch.as_tensor(start, dtype=dtype, device=device)
    for _ in range(4 if max_iter is None else max_iter):
        Q, _ = torch.linalg.qr(operator @ Q)
    AQ = operator @ Q
    values, small = torch.linalg.eigh(Q.T @ AQ)
    top = values.argsort(descending=True)[:k]
    return values[top].cpu().numpy(), (Q @ small[:, top]).cpu().numpy()


def _scipy(operator: Any) -> Any:
    return operator.to_scipy(dtype=np.float64 if operator.dtype == torch.float64 else np.float32)


#: Solver name → function ``(operator, k, tol, max_iter, rng) -> (eigenvalues, vectors)``.
SOLVERS: dict[str, Callable[..., Any]] = {
    "lanczos": _lanczos,
    "lobpcg": _lobpcg,
    "randomized": _randomized,
}


def top_eigenpairs(
    operator: Any,
    scale: float,
    k: int,
    solver: str = "lanczos",
    tol: float = 0.0,
    max_iter: int | None = None,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """Largest k eigenpairs of ``scale · operator``, eigenvalues above the threshold only.

    Args:
        operator: A curvlinops linear operator (P × P, symmetric).
        scale: Factor applied to the eigenvalues.
        k: Number of eigenpairs, 1 ≤ k < P.
        solver: ``"lanczos"``, ``"lobpcg"`` or ``"randomized"`` (block power iterations).
        tol: Relative accuracy of the eigenvalues; 0 asks for machine precision (Lanczos).
        max_iter: Iteration limit of the solver (its default when None).
        seed: Seed of the random start vectors.

    Returns:
        Eigenvectors (P, k') and eigenvalues (k',) in descending order, with k' ≤ k the number
        above :data:`EIGENVALUE_THRESHOLD`.

    Raises:
        ValueError: For an unknown solver or k outside [1, P).
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {sorted(SOLVERS)}, got {solver!r}.")
    n_params = operator.shape[0]
    if not 1 <= k < n_params:
        raise ValueError(
            f"n_eigenvalues must be between 1 and n_params - 1 = {n_params - 1}, got {k}."
        )
    dtype, device = operator.dtype, operator.device
    values, vectors = SOLVERS[solver](operator, k, tol, max_iter, np.random.default_rng(seed))
    order = np.argsort(values)[::-1]
    values = torch.as_tensor(values[order].copy(), dtype=dtype, device=device) * scale
    vectors = torch.as_tensor(vectors[:, order].copy(), dtype=dtype, device=device)
    keep = values > EIGENVALUE_THRESHOLD
    return vectors[:, keep], values[keep]
