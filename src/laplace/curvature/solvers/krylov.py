r"""Krylov solvers on a symmetric positive (semi-)definite map given by its block products.

``conjugate_gradients`` solves ``A X = B``, all columns in one block per iteration, each in its
own Krylov space; ``block_conjugate_gradients`` lets the columns share one space (fewer
iterations for many right-hand sides, as posterior samples are);
``lanczos_quadrature`` returns, per probe, the nodes and weights of the Gauss quadrature of
``zᵀ f(A) z`` (Ubaru, Chen & Saad, 2017), so one run serves ``log det(h·A + δ·I)`` at every pair.

Written here rather than taken from curvlinops: the matrix-free posterior needs each column's
residual and iteration count, a strict mode, the products counted, and the per-probe quadrature
kept (its standard error, and no product after a change of hyperparameters).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "LanczosQuadrature",
    "SolveReport",
    "block_conjugate_gradients",
    "conjugate_gradients",
    "lanczos_quadrature",
    "rademacher_probes",
]

#: ``A V`` for a block ``V`` (P, m), shape (P, m), called as ``matmat(V, out)``: ``out`` (P, m)
#: is the memory of a vector the solver no longer needs (or None), which the product may
#: overwrite with its result. Reusing it keeps a solver's vectors in the same memory over its
#: iterations.
MatMat = Callable[[Tensor, Tensor | None], Tensor]
#: ``M⁻¹ R`` for a block ``R`` (P, m).
Precondition = Callable[[Tensor], Tensor]


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
    precondition: Precondition | None = None,
    overwrite: bool = False,
) -> tuple[Tensor, SolveReport]:
    """Solve ``A X = B`` for a symmetric positive definite ``A`` by preconditioned CG.

    Each column runs its own recursion (its own step lengths) until
    ``‖bⱼ − A xⱼ‖ ≤ tol·‖bⱼ‖``; the unconverged columns are multiplied together, one block
    product per iteration. The iterates are updated in place: while every column is active the
    solver holds the solution, the residual, the direction and the product (P, m), with the
    preconditioned residual when there is a preconditioner; a column that converges leaves
    the block (the others are then compacted once).

    Args:
        matmat: ``A V`` for blocks ``V`` (P, k) (see ``MatMat``).
        B: Right-hand sides (P, m).
        tol: Relative residual to reach, > 0.
        max_iter: Most iterations per column.
        precondition: ``M⁻¹ R`` for blocks ``R`` (P, k), with ``M ≈ A`` symmetric positive
            definite (None: the identity).
        overwrite: Use ``B``'s memory for the residual (``B`` is overwritten).

    Returns:
        ``X`` (P, m) and the ``SolveReport``. Columns that did not converge hold their last
        iterate.
    """
    norms = torch.linalg.vector_norm(B, dim=0)
    residual_norms = norms.clone()
    solution = torch.zeros_like(B)
    # The active columns' iterates: the solution and the residual themselves until a column
    # leaves the block, compacted copies after.
    X, R = solution, (B if overwrite else B.clone())
    Z = R if precondition is None else precondition(R)
    D, rz = Z.clone(), torch.linalg.vecdot(R, Z, dim=0)
    del Z
    active = torch.arange(B.shape[1], device=B.device)
    keep = norms > 0  # a zero right-hand side is solved by zero
    iterations, products = 0, 0
    spare: Tensor | None = None  # the memory of the last product, reused for the next
    while True:
        if not bool(keep.all()):  # solved columns leave the block
            if X is not solution:
                solution[:, active] = X
            active, rz, spare = active[keep], rz[keep], None
            X, R, D = X[:, keep], R[:, keep], D[:, keep]
        if not len(active) or iterations == max_iter:
            break
        if iterations:  # the next direction, conjugate to the last
            Z = R if precondition is None else precondition(R)
            rz_new = torch.linalg.vecdot(R, Z, dim=0)
            D.mul_(rz_new / rz).add_(Z)
            rz = rz_new
            del Z
        AD = matmat(D, spare)
        products += len(active)
        iterations += 1
        step = rz / torch.linalg.vecdot(D, AD, dim=0)
        X.addcmul_(D, step)
        R.addcmul_(AD, step, value=-1)
        spare = AD
        residual_norms[active] = torch.linalg.vector_norm(R, dim=0)
        keep = residual_norms[active] > tol * norms[active]
    if X is not solution:
        solution[:, active] = X
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
    return solution, report


def block_conjugate_gradients(
    matmat: MatMat,
    B: Tensor,
    tol: float,
    max_iter: int,
    precondition: Precondition | None = None,
    overwrite: bool = False,
) -> tuple[Tensor, SolveReport]:
    """Solve ``A X = B`` for a symmetric positive definite ``A`` by block conjugate gradients.

    The columns share one Krylov space (O'Leary, 1980): each iteration multiplies a block ``D``
    (P, m) of directions, A-conjugate to the earlier blocks and orthonormalised by a QR
    decomposition (Dubrulle, 2001, which keeps the iteration stable when residuals become
    dependent), and minimises every column's error in the A-norm over all directions so far.
    A column then converges as if the m extreme eigenvalues its neighbours found were
    removed: on a posterior precision (a low-rank curvature plus the prior) m random
    right-hand sides take a fraction of the iterations each takes alone. Every nonzero column
    is multiplied until all have reached ``‖bⱼ − A xⱼ‖ ≤ tol·‖bⱼ‖`` (products: columns ×
    iterations); a zero right-hand side is solved by zero without a product. A block of one
    column is solved by ``conjugate_gradients`` (the same iterates, without the QR and
    Cholesky factorisations).

    Args:
        matmat: ``A V`` for blocks ``V`` (P, m) (see ``MatMat``).
        B: Right-hand sides (P, m).
        tol: Relative residual to reach, > 0.
        max_iter: Most iterations.
        precondition: ``M⁻¹ R`` for blocks ``R`` (P, m), with ``M ≈ A`` symmetric positive
            definite (None: the identity).
        overwrite: Use ``B``'s memory for the residuals (``B`` is overwritten).

    Returns:
        ``X`` (P, m) and the ``SolveReport``. Without convergence, ``X`` holds the last iterate.
    """
    if B.shape[1] <= 1:
        return conjugate_gradients(matmat, B, tol, max_iter, precondition, overwrite)
    norms = torch.linalg.vector_norm(B, dim=0)
    solution = torch.zeros_like(B)
    nonzero = (norms > 0).nonzero().squeeze(1)
    whole = len(nonzero) == B.shape[1]
    X = solution if whole else solution[:, nonzero]
    R = (B if overwrite else B.clone()) if whole else B[:, nonzero]
    targets = tol * norms[nonzero]
    residual_norms = norms[nonzero]
    iterations, spare = 0, None
    Z = R if precondition is None else precondition(R)
    D = torch.linalg.qr(Z).Q
    while len(nonzero) and bool((residual_norms > targets).any()) and iterations < max_iter:
        AD = matmat(D, spare)
        iterations += 1
        factor = torch.linalg.cholesky(D.T @ AD)  # Dᵀ A D, symmetric positive definite
        step = torch.cholesky_solve(D.T @ R, factor)
        X.addmm_(D, step)
        R.addmm_(AD, step, alpha=-1)
        residual_norms = torch.linalg.vector_norm(R, dim=0)
        if bool((residual_norms <= targets).all()) or iterations == max_iter:
            break
        Z = R if precondition is None else precondition(R)
        conjugation = torch.cholesky_solve(AD.T @ Z, factor)  # Z's part along D in A
        D = torch.linalg.qr(torch.addmm(Z, D, conjugation, alpha=-1)).Q
        spare = AD
    if not whole:
        solution[:, nonzero] = X
    relative = torch.zeros_like(norms)
    relative[nonzero] = residual_norms / norms[nonzero]
    report = SolveReport(
        relative_residuals=relative,
        iterations=iterations,
        products=iterations * len(nonzero),
        tol=tol,
        converged=bool((relative <= tol).all()),
    )
    return solution, report


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
    probes = torch.empty(n_params, n_probes, device=like.device, dtype=like.dtype)
    return probes.copy_(signs).mul_(2).sub_(1)


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
    matmat: MatMat, probes: Tensor, steps: int, reorthogonalize: bool, overwrite: bool = False
) -> LanczosQuadrature:
    r"""The Lanczos process from each probe, and its Gauss quadrature nodes and weights.

    All probes run together (one block product per step). A probe whose next Lanczos vector
    vanishes (its Krylov space is invariant: the quadrature is then exact) stops there.

    Args:
        matmat: ``A V`` for blocks ``V`` (P, m), ``A`` symmetric (see ``MatMat``).
        probes: Start vectors (P, m), nonzero.
        steps: Lanczos steps per probe (the quadrature's number of nodes), at most P.
        reorthogonalize: Orthogonalise each new vector against all earlier ones of its probe
            (twice; keeps the (P, steps, m) basis: exact quadrature once ``steps`` reaches
            the dimension of the Krylov space). Without it only three vectors per probe are
            kept; orthogonality is then lost as Ritz values converge, which spreads the
            weights over duplicated nodes but leaves the quadrature of smooth functions
            accurate (Ubaru, Chen & Saad, 2017, §4).
        overwrite: Use ``probes``' memory for the first Lanczos vectors (``probes`` is
            overwritten).

    Returns:
        The ``LanczosQuadrature``.
    """
    m = probes.shape[1]
    norms = torch.linalg.vector_norm(probes, dim=0)
    Q = probes.div_(norms) if overwrite else probes / norms
    Q_previous: Tensor | None = None
    spare: Tensor | None = None  # the memory of a vector no longer needed
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
        if bool(active.all()):
            W = matmat(Q, spare)
        else:  # closed probes' vectors stay zero
            W = torch.zeros_like(Q) if spare is None else spare.zero_()
            W[:, active] = matmat(Q[:, active], None)
        products += int(active.sum())
        alpha = torch.linalg.vecdot(Q, W, dim=0)
        alphas[:, j] = alpha * active
        W.addcmul_(Q, alpha, value=-1)
        if Q_previous is not None:
            W.addcmul_(Q_previous, beta, value=-1)
        if reorthogonalize:
            for _ in range(2):
                for V in basis:
                    W.addcmul_(V, torch.linalg.vecdot(V, W, dim=0), value=-1)
        beta_new = torch.linalg.vector_norm(W, dim=0)
        scale = torch.maximum(scale, alpha.abs() + beta_new)
        closing = active & (beta_new <= tiny * scale)
        lengths[closing] = j + 1
        active = active & ~closing
        if j + 1 == steps or not bool(active.any()):
            break
        betas[:, j] = beta_new * active
        inverse = torch.where(active, 1 / beta_new.clamp_min(torch.finfo(W.dtype).tiny), 0)
        spare = None if reorthogonalize else Q_previous  # a basis vector is kept
        Q_previous, Q = Q, W.mul_(inverse)
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
