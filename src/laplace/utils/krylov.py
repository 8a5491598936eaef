r"""Krylov solvers on a symmetric positive (semi-)definite map given by its block products.

``conjugate_gradients`` solves ``A X = B`` column by column, all columns in one block per
iteration (a column that has converged leaves the block, so it costs no further products), with
an optional preconditioner; ``lanczos_quadrature`` runs the Lanczos process from a block of
probe vectors and returns, per probe, the nodes and weights of the Gauss quadrature of
``zᵀ f(A) z`` (stochastic Lanczos quadrature: Ubaru, Chen & Saad, 2017). The Krylov space of
``A`` is that of ``h·A + δ·I`` for every ``h > 0`` and δ, so one run serves
``log det(h·A + δ·I)`` at every pair: ``zᵀ f(h·A + δ) z ≈ Σⱼ wⱼ f(h·θⱼ + δ)``.

Written here rather than taken from curvlinops (whose ``CGInverseLinearOperator`` runs
GPyTorch's ``linear_cg``, an extra dependency, and whose Lanczos spectrum estimates pool the
probes): the matrix-free posterior needs each column's relative residual and iteration count
reported, a strict mode, the number of products counted, and the per-probe quadrature kept so
that its standard error is known and a change of hyperparameters costs no product.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "LanczosQuadrature",
    "SolveReport",
    "conjugate_gradients",
    "lanczos_quadrature",
    "rademacher_probes",
]

#: ``A X`` for a block ``X`` (P, m), shape (P, m).
MatMat = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class SolveReport:
    """What a conjugate-gradient solve reached.

    Attributes:
        relative_residuals: ``‖rⱼ‖ / ‖bⱼ‖`` per column at the end, shape (m,), with ``rⱼ`` the
            recursively updated residual (``bⱼ − A xⱼ`` in exact arithmetic; 0 for a zero
            right-hand side).
        iterations: Iterations of the column that took most.
        products: Products of ``A`` with one vector made (columns × iterations, summed).
        tol: The tolerance asked for.
        converged: Whether every column reached ``tol``.
    """

    relative_residuals: Tensor
    iterations: int
    products: int
    tol: float
    converged: bool

    @classmethod
    def merged(cls, reports: list[SolveReport]) -> SolveReport:
        """One report of solves made a block of columns at a time (``reports``, not empty)."""
        return cls(
            relative_residuals=torch.cat([r.relative_residuals for r in reports]),
            iterations=max(r.iterations for r in reports),
            products=sum(r.products for r in reports),
            tol=reports[0].tol,
            converged=all(r.converged for r in reports),
        )

    def __str__(self) -> str:
        worst = float(self.relative_residuals.max()) if self.relative_residuals.numel() else 0.0
        return (
            f"{self.iterations} iterations, {self.products} products, worst relative residual "
            f"{worst:.2e} (tolerance {self.tol:.0e})"
        )


def conjugate_gradients(
    matmat: MatMat,
    B: Tensor,
    tol: float,
    max_iter: int,
    precondition: MatMat | None = None,
) -> tuple[Tensor, SolveReport]:
    """Solve ``A X = B`` for a symmetric positive definite ``A`` by preconditioned CG.

    Each column runs its own recursion (its own step lengths) until
    ``‖bⱼ − A xⱼ‖ ≤ tol·‖bⱼ‖``; the unconverged columns are multiplied together, one block
    product per iteration.

    Args:
        matmat: ``A V`` for blocks ``V`` (P, k).
        B: Right-hand sides (P, m).
        tol: Relative residual to reach, > 0.
        max_iter: Most iterations per column.
        precondition: ``M⁻¹ R`` for blocks ``R`` (P, k), with ``M ≈ A`` symmetric positive
            definite (None: the identity).

    Returns:
        ``X`` (P, m) and the ``SolveReport``. Columns that did not converge hold their last
        iterate.
    """
    X = torch.zeros_like(B)
    R = B.clone()
    norms = B.norm(dim=0)
    residual_norms = norms.clone()
    active = (norms > 0).nonzero().flatten()
    iterations, products = 0, 0
    if len(active):
        Z = R[:, active] if precondition is None else precondition(R[:, active])
        D = Z.clone()
        rz = (R[:, active] * Z).sum(0)
    while len(active) and iterations < max_iter:
        AD = matmat(D)
        products += len(active)
        iterations += 1
        step = rz / (D * AD).sum(0)
        X[:, active] += step * D
        R_active = R[:, active] - step * AD
        R[:, active] = R_active
        residual_norms[active] = R_active.norm(dim=0)
        keep = residual_norms[active] > tol * norms[active]
        active, R_active, D, rz = active[keep], R_active[:, keep], D[:, keep], rz[keep]
        if not len(active):
            break
        Z = R_active if precondition is None else precondition(R_active)
        rz_new = (R_active * Z).sum(0)
        D = Z + (rz_new / rz) * D
        rz = rz_new
    relative = torch.where(
        norms > 0, residual_norms / norms.clamp_min(torch.finfo(B.dtype).tiny), 0
    )
    report = SolveReport(
        relative_residuals=relative,
        iterations=iterations,
        products=products,
        tol=tol,
        converged=not len(active),
    )
    return X, report


def rademacher_probes(
    n_params: int, n_probes: int, generator: torch.Generator, like: Tensor
) -> Tensor:
    """Probe vectors with ``E[z zᵀ] = I``: (P, n_probes) random signs while ``n_probes < P``.

    From ``n_probes ≥ P`` on, the P columns of a random orthogonal matrix scaled by √P (P, P):
    ``Σ zᵢ zᵢᵀ = P·I`` exactly, so a trace estimate over them is exact.

    Args:
        n_params: P.
        n_probes: Number of probes asked for.
        generator: Source of randomness (on ``like``'s device).
        like: A tensor of the probes' device and type.
    """
    if n_probes >= n_params:
        gaussian = torch.randn(
            n_params, n_params, generator=generator, device=like.device, dtype=like.dtype
        )
        Q, R = torch.linalg.qr(gaussian)
        return Q * R.diagonal().sign() * n_params**0.5
    signs = torch.randint(
        0, 2, (n_params, n_probes), generator=generator, device=like.device, dtype=torch.int8
    )
    return signs.to(like.dtype) * 2 - 1


@dataclass(frozen=True)
class LanczosQuadrature:
    """Per probe, the Gauss quadrature of ``zᵀ f(A) z`` from its Lanczos tridiagonal matrix.

    ``zᵢᵀ f(A) zᵢ ≈ Σⱼ weights[i, j] · f(nodes[i, j])``; the rows of a probe whose Krylov space
    closed after k < steps steps hold zero weights after k.

    Attributes:
        nodes: Ritz values θ, shape (n_probes, steps).
        weights: ``‖zᵢ‖²`` times the squared first entries of the Ritz vectors, same shape.
        products: Products of ``A`` with one vector made.
    """

    nodes: Tensor
    weights: Tensor
    products: int

    def estimates(self, f: Callable[[Tensor], Tensor]) -> Tensor:
        """``zᵢᵀ f(A) zᵢ`` per probe, shape (n_probes,) (unused nodes do not enter ``f``)."""
        used = self.weights > 0
        values = f(torch.where(used, self.nodes, torch.ones_like(self.nodes)))
        return torch.where(used, self.weights * values, 0).sum(1)


def lanczos_quadrature(
    matmat: MatMat, probes: Tensor, steps: int, reorthogonalize: bool
) -> LanczosQuadrature:
    r"""The Lanczos process from each probe, and its Gauss quadrature nodes and weights.

    All probes run together (one block product per step). A probe whose next Lanczos vector
    vanishes (its Krylov space is invariant: the quadrature is then exact) stops there.

    Args:
        matmat: ``A V`` for blocks ``V`` (P, m), ``A`` symmetric.
        probes: Start vectors (P, m), nonzero.
        steps: Lanczos steps per probe (the quadrature's number of nodes), at most P.
        reorthogonalize: Orthogonalise each new vector against all earlier ones of its probe
            (twice; keeps the (P, steps, m) basis: exact quadrature once ``steps`` reaches
            the dimension of the Krylov space). Without it only three vectors per probe are
            kept; orthogonality is then lost as Ritz values converge, which spreads the
            weights over duplicated nodes but leaves the quadrature of smooth functions
            accurate (Ubaru, Chen & Saad, 2017, §4).

    Returns:
        The ``LanczosQuadrature``.
    """
    m = probes.shape[1]
    norms = probes.norm(dim=0)
    Q = probes / norms
    Q_previous = torch.zeros_like(Q)
    alphas = probes.new_zeros(m, steps)
    betas = probes.new_zeros(m, steps)
    lengths = torch.full((m,), steps, dtype=torch.long, device=probes.device)
    basis = [Q] if reorthogonalize else []
    beta = probes.new_zeros(m)
    active = torch.ones(m, dtype=torch.bool, device=probes.device)
    products = 0
    scale = probes.new_zeros(m)
    tiny = 100 * torch.finfo(probes.dtype).eps
    for j in range(steps):
        W = torch.zeros_like(Q)
        W[:, active] = matmat(Q[:, active])
        products += int(active.sum())
        alpha = (Q * W).sum(0)
        alphas[:, j] = alpha * active
        W = W - alpha * Q - beta * Q_previous
        if reorthogonalize:
            for _ in range(2):
                for V in basis:
                    W = W - (V * W).sum(0) * V
        beta_new = W.norm(dim=0)
        scale = torch.maximum(scale, alpha.abs() + beta_new)
        closing = active & (beta_new <= tiny * scale)
        lengths[closing] = j + 1
        active = active & ~closing
        if j + 1 == steps or not bool(active.any()):
            break
        betas[:, j] = beta_new * active
        Q_previous, Q = (
            Q,
            torch.where(active, W / beta_new.clamp_min(torch.finfo(W.dtype).tiny), 0),
        )
        beta = beta_new * active
        if reorthogonalize:
            basis.append(Q)
    nodes = probes.new_zeros(m, steps)
    weights = probes.new_zeros(m, steps)
    for i in range(m):
        k = int(lengths[i])
        T = (
            torch.diag(alphas[i, :k])
            + torch.diag(betas[i, : k - 1], 1)
            + torch.diag(betas[i, : k - 1], -1)
        )
        theta, vectors = torch.linalg.eigh(T)
        nodes[i, :k] = theta
        weights[i, :k] = vectors[0].square() * norms[i].square()
    return LanczosQuadrature(nodes=nodes, weights=weights, products=products)
