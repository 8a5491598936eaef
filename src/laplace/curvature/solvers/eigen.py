r"""Top-k eigenpairs of the curvature summed over a data set, from block products only.

Solvers take a ``CurvatureProduct`` and never form a P × P
matrix: ``"randomized"`` (default) starts from the KFAC Rayleigh–Ritz block
(``laplace.curvature.solvers.kfac_start``) and returns its Nyström approximation
``Y (Q₀ᵀ Y)⁻¹ Yᵀ`` (Tropp et al., 2017), or from a sketch runs randomised block Krylov passes
with Rayleigh–Ritz (Musco & Musco, 2015); ``"lanczos"`` (ARPACK's ``eigsh``) and ``"lobpcg"``
are exact to ``tol``. Every result carries relative errors: bounds ``‖H uᵢ − λᵢ uᵢ‖ / λᵢ`` after
Krylov passes and exact solvers, the relative change of each eigenvalue in its one product (an
estimate) after a Nyström step. See ``docs/backends.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, TypedDict

import numpy as np
import torch
from torch import Tensor

from laplace.curvature.solvers.kfac_start import CANDIDATES_PER_VECTOR, KfacStart, kfac_start
from laplace.curvature.solvers.products import CurvatureProduct, NativeProduct

if TYPE_CHECKING:
    from scipy.sparse.linalg import LinearOperator

__all__ = [
    "DEFAULT_OVERSAMPLING",
    "DEFAULT_PASSES",
    "EIGENVALUE_THRESHOLD",
    "SOLVERS",
    "STARTS",
    "Eigenpairs",
    "EigensolverOptions",
    "RankedSolverOptions",
    "top_eigenpairs",
]

#: Eigenvalues at or below this are dropped (as laplace-torch's low-rank backend does).
EIGENVALUE_THRESHOLD = 1e-6

#: Extra vectors per Krylov block beyond the k wanted.
DEFAULT_OVERSAMPLING = 10

#: Block products (passes over the data, after the sketch) of the Krylov solver by default.
DEFAULT_PASSES = 3

#: Start blocks of the randomized solver.
STARTS = ("kfac", "sketch")


class EigensolverOptions(TypedDict, total=False):
    """The options of ``top_eigenpairs`` besides the product and ``k`` (see there)."""

    solver: str
    tol: float
    max_iter: int | None
    seed: int
    oversampling: int
    start: str
    candidates: int | None


class RankedSolverOptions(EigensolverOptions, total=False):
    """``EigensolverOptions`` with the number ``k`` of eigenpairs (``n_eigenvalues``)."""

    n_eigenvalues: int


class Eigenpairs(NamedTuple):
    """Eigenpairs in descending order with their relative error bounds.

    Attributes:
        vectors: Orthonormal eigenvectors, shape (P, k).
        values: Eigenvalues, shape (k,).
        errors: ``‖H uᵢ − λᵢ uᵢ‖ / λᵢ``, shape (k,).
    """

    vectors: Tensor
    values: Tensor
    errors: Tensor


def _cholesky_qr(block: Tensor, shift: bool) -> Tensor | None:
    """``Q`` of ``block = Q R`` from the Cholesky factor of its Gram matrix, or None if it fails.

    A Gram matrix and a triangular solve, both matrix products, instead of Householder QR, which
    is tens of times slower on tall blocks; a shift (Fukaya et al., 2020) keeps the first
    factorisation of an ill-conditioned block positive definite.
    """
    gram = block.T @ block
    if shift:
        size = block.shape[0] * block.shape[1] + block.shape[1] ** 2
        gram.diagonal().add_(11 * size * torch.finfo(block.dtype).eps * gram.diagonal().sum())
    L, info = torch.linalg.cholesky_ex(gram)
    if int(info) != 0:
        return None
    return torch.linalg.solve_triangular(L.T, block, upper=True, left=False)


def _orthonormal(block: Tensor, basis: Tensor | None) -> Tensor:
    """Orthonormal columns spanning ``block`` projected off ``basis`` (twice, for stability).

    Shifted Cholesky QR, then Cholesky QR twice; Householder QR when the block is numerically
    rank deficient, its columns completed with random directions off the basis. Whatever the
    route, the columns are returned only orthonormal and orthogonal to the basis (to
    ``100 · eps · b``): a basis that is not would make the Rayleigh–Ritz values exceed the
    curvature's eigenvalues.

    Raises:
        RuntimeError: If three rounds of random directions leave a column on the basis.
    """
    tolerance = 100 * torch.finfo(block.dtype).eps * block.shape[1]
    Q: Tensor | None = block
    for step in range(3):
        if basis is not None and step < 2 and Q is not None:
            Q = torch.addmm(Q, basis, basis.T @ Q, alpha=-1)
        Q = _cholesky_qr(Q, shift=step == 0) if Q is not None else None
    if Q is not None:  # accepted when orthonormal and orthogonal to the basis
        eye = torch.eye(block.shape[1], dtype=block.dtype, device=block.device)
        errors = [Q.T @ Q - eye, *([] if basis is None else [basis.T @ Q])]
        if all(bool((error.abs() <= tolerance).all()) for error in errors):
            return Q
    Q = block
    for attempt in range(3):
        for _ in range(2):
            if basis is not None:
                Q = torch.addmm(Q, basis, basis.T @ Q, alpha=-1)
            Q = torch.linalg.qr(Q).Q
        if basis is None:
            return Q
        # Householder QR completes a rank-deficient block (an invariant subspace: H K in the
        # span of K, whose remainder is round-off) with directions that need not be off the
        # basis: replace the columns the basis still holds by random directions, and again
        kept = (basis.T @ Q).abs().amax(0) <= tolerance
        if bool(kept.all()):
            return Q
        generator = torch.Generator(device=Q.device).manual_seed(attempt)
        fresh = torch.randn(Q.shape, generator=generator, device=Q.device, dtype=Q.dtype)
        Q = torch.where(kept, Q, fresh)
    raise RuntimeError(
        "the eigensolver could not extend its basis by directions orthogonal to it; use "
        "solver='lanczos' or fewer n_eigenvalues."
    )


def _symmetric(T: Tensor) -> Tensor:
    return (T + T.T) / 2


def _ritz(T: Tensor, k: int) -> tuple[Tensor, Tensor]:
    values, vectors = torch.linalg.eigh(_symmetric(T))
    return values.flip(0)[:k], vectors.flip(1)[:, :k]


def _nystrom(start: KfacStart, k: int) -> Eigenpairs:
    """Eigenpairs of ``Y (Q₀ᵀ Y)⁻¹ Yᵀ`` from ``Q₀`` (P, b) and ``Y = H Q₀``, with estimates.

    The shift ``ν`` of Tropp et al. (2017) keeps ``Q₀ᵀ Y`` positive definite in floating point;
    directions with no curvature are dropped.
    """
    Q, Y = start.Q, start.HQ
    nu = torch.finfo(Y.dtype).eps * Y.norm()
    Y = Y.add_(Q, alpha=float(nu))  # in place: H Q₀ is not needed afterwards
    w, W = torch.linalg.eigh(_symmetric(Q.T @ Y))
    keep = w > w.max() * torch.finfo(w.dtype).eps * len(w)
    F = Y @ (W[:, keep] * w[keep].rsqrt())  # F Fᵀ = Y (Q₀ᵀ Y)⁻¹ Yᵀ
    del Q, Y
    # F = U S Vᵀ from the eigenpairs of Fᵀ F: each eigenvalue to eps · λ_max, as the Ritz values
    # of the Krylov solver; small ones lose relative accuracy, where they matter least.
    squares, V = _ritz(F.T @ F, k)
    values = (squares - nu).clamp(min=0)
    U = F @ (V / squares.clamp(min=torch.finfo(squares.dtype).tiny).sqrt())
    ritz = start.values[: len(values)]
    errors = (values - ritz).clamp(min=0) / values.clamp(min=torch.finfo(values.dtype).tiny)
    return Eigenpairs(U, values, errors)


def _block_krylov(
    product: CurvatureProduct,
    k: int,
    tol: float,
    max_iter: int | None,
    seed: int,
    oversampling: int,
    start: str = "kfac",
    candidates: int | None = None,
) -> Eigenpairs:
    """Randomised block Krylov with Rayleigh–Ritz and residual bounds (see the module)."""
    P = product.n_params
    width = min(k + oversampling, P)
    begun = None
    if start == "kfac" and isinstance(product, NativeProduct):
        begun = kfac_start(product, width, candidates or CANDIDATES_PER_VECTOR * width)
    if begun is not None and not max_iter:
        return _nystrom(begun, k)
    if begun is None:
        generator = torch.Generator(device=product.device).manual_seed(seed)
        first = product.sketch(width, generator)
        if first is None:
            first = torch.randn(
                P, width, generator=generator, device=product.device, dtype=product.dtype
            )
        first = _orthonormal(first, None)
        n_passes = DEFAULT_PASSES if max_iter is None else max(1, max_iter)
    else:
        first, n_passes = begun.Q, 1 + max_iter
    storage = first.new_empty(P, min(P, n_passes * width))  # the basis K, filled block by block
    d = width
    storage[:, :d] = first
    Q = storage[:, :d]  # the newest block, a view of the basis
    T = Q.new_zeros(0, 0)
    for step in range(n_passes):
        basis, b = storage[:, :d], Q.shape[1]
        rest = begun.HQ if step == 0 and begun is not None else product.matmat(Q)
        coefficients = basis.T @ rest  # (d, b): the new columns of T = Kᵀ H K
        rest.addmm_(basis, coefficients, alpha=-1)
        T = torch.cat([torch.cat([T, coefficients[: d - b].T], 0), coefficients], 1)
        values, W = _ritz(T, k)
        # H K − K T lives in the newest block: H Q − K (Kᵀ H Q) = rest, so ‖r_i‖ = ‖rest w_i‖.
        residuals = (rest @ W[d - b :]).norm(dim=0)
        errors = residuals / values.abs().clamp(min=torch.finfo(values.dtype).tiny)
        room = storage.shape[1] - d
        done = room == 0 or (tol > 0 and bool((errors <= tol).all()))
        if done or step == n_passes - 1:
            break
        b = min(width, room)
        storage[:, d : d + b] = _orthonormal(rest[:, :b], basis)
        Q = storage[:, d : d + b]
        d += b
    return Eigenpairs(storage[:, :d] @ W, values, errors)


def _scipy(product: CurvatureProduct) -> LinearOperator:
    from scipy.sparse.linalg import LinearOperator

    np_dtype = np.float64 if product.dtype == torch.float64 else np.float32

    def matmat(M: np.ndarray) -> np.ndarray:
        V = torch.as_tensor(np.ascontiguousarray(M), dtype=product.dtype, device=product.device)
        return product.matmat(V.reshape(product.n_params, -1)).cpu().numpy()

    return LinearOperator(
        (product.n_params, product.n_params),
        matvec=lambda v: matmat(v).reshape(v.shape),
        matmat=matmat,
        dtype=np_dtype,
    )


def _with_errors(product: CurvatureProduct, values: np.ndarray, vectors: np.ndarray) -> Eigenpairs:
    """Eigenpairs of an exact solver in descending order, with one product for the bounds."""
    order = np.argsort(values)[::-1]
    values = torch.as_tensor(values[order].copy(), dtype=product.dtype, device=product.device)
    U = torch.as_tensor(vectors[:, order].copy(), dtype=product.dtype, device=product.device)
    residuals = (product.matmat(U) - U * values).norm(dim=0)
    errors = residuals / values.abs().clamp(min=torch.finfo(values.dtype).tiny)
    return Eigenpairs(U, values, errors)


def _lanczos(product, k, tol, max_iter, seed, oversampling, **_) -> Eigenpairs:
    from scipy.sparse.linalg import eigsh

    op = _scipy(product)
    v0 = np.random.default_rng(seed).standard_normal(product.n_params).astype(op.dtype)
    return _with_errors(product, *eigsh(op, k=k, which="LA", tol=tol, maxiter=max_iter, v0=v0))


def _lobpcg(product, k, tol, max_iter, seed, oversampling, **_) -> Eigenpairs:
    from scipy.sparse.linalg import lobpcg

    op = _scipy(product)
    X = np.random.default_rng(seed).standard_normal((product.n_params, k)).astype(op.dtype)
    values, vectors = lobpcg(op, X, largest=True, tol=tol or None, maxiter=max_iter or 200)
    return _with_errors(product, values, vectors)


#: Solver name → ``(product, k, tol, max_iter, seed, oversampling, **start) -> Eigenpairs``.
SOLVERS: dict[str, Callable[..., Eigenpairs]] = {
    "randomized": _block_krylov,
    "lanczos": _lanczos,
    "lobpcg": _lobpcg,
}


def top_eigenpairs(
    product: CurvatureProduct,
    k: int,
    solver: str = "randomized",
    tol: float = 0.0,
    max_iter: int | None = None,
    seed: int = 0,
    oversampling: int = DEFAULT_OVERSAMPLING,
    start: str = "kfac",
    candidates: int | None = None,
) -> Eigenpairs:
    """Largest k eigenpairs of the curvature, eigenvalues above the threshold only.

    Args:
        product: The curvature over the data set.
        k: Number of eigenpairs, 1 ≤ k < P.
        solver: ``"randomized"`` (block Krylov), ``"lanczos"`` or ``"lobpcg"``.
        tol: Lanczos/LOBPCG: relative accuracy (0: machine precision). Randomized: stop
            before ``max_iter`` passes once every error bound is at most ``tol`` (0: never).
        max_iter: Iteration limit; for the randomized solver the number of block products
            after the start: 0 (Nyström) after a KFAC start, ``DEFAULT_PASSES`` after a
            sketch, when None.
        seed: Seed of the random start vectors.
        oversampling: Extra vectors per Krylov block (randomized solver).
        start: Start block of the randomized solver, ``"kfac"`` (where it applies, else a
            sketch) or ``"sketch"``.
        candidates: Kronecker candidates of the KFAC start,
            ``CANDIDATES_PER_VECTOR`` per vector when None.

    Returns:
        Eigenvectors (P, k'), eigenvalues (k',) in descending order and their relative errors
        (k', see the module), with k' ≤ k the number above ``EIGENVALUE_THRESHOLD``.

    Raises:
        ValueError: For an unknown solver or start, or k outside [1, P).
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {sorted(SOLVERS)}, got {solver!r}.")
    n_params = product.n_params
    if not 1 <= k < n_params:
        raise ValueError(
            f"n_eigenvalues must be between 1 and n_params - 1 = {n_params - 1}, got {k}."
        )
    if start not in STARTS:
        raise ValueError(f"start must be one of {list(STARTS)}, got {start!r}.")
    options = {"start": start, "candidates": candidates}
    pairs = SOLVERS[solver](product, k, tol, max_iter, seed, oversampling, **options)
    keep = pairs.values > EIGENVALUE_THRESHOLD
    return Eigenpairs(pairs.vectors[:, keep], pairs.values[keep], pairs.errors[keep])
