"""The passes of a low-rank fit: the top-k curvature eigenpairs, and INF's exact diagonal.

Internal module; ``LowRankLaplace`` and ``DiagLowRankLaplace`` name them as their
``_curvature_pass``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import Unpack

from laplace.core.passes.curvature_sum import FitPieces, LossThenProducts
from laplace.core.passes.data_loop import LoopArguments, LoopOptions
from laplace.curvature import EFInterface, GGNInterface
from laplace.curvature.solvers.eigen import (
    EigensolverOptions,
    RankedSolverOptions,
    top_eigenpairs,
)
from laplace.curvature.solvers.products import CurvatureProduct, NativeProduct, curvature_product
from laplace.structures.diagonal import DiagonalPosterior
from laplace.utils import distributed as distributed_utils
from laplace.utils.data import Inputs
from laplace.utils.errors import (
    check_finite_result,
)

#: What takes outputs with extra dimensions where the curvlinops operators do not.
_NATIVE_ROUTE = "solver='randomized' (the default) with a GGN or EF backend"


class PlusLowRank:
    """A curvature product plus ``U diag(λ) Uᵀ``: an online fit's earlier low-rank curvature.

    Args:
        product: The curvature over the new data (a ``CurvatureProduct``).
        U: Earlier eigenvectors, shape (P, k).
        eigenvalues: Earlier eigenvalues, shape (k,).
    """

    def __init__(self, product: CurvatureProduct, U: Tensor, eigenvalues: Tensor) -> None:
        self.product, self.U, self.eigenvalues = product, U, eigenvalues
        self.n_params, self.dtype, self.device = product.n_params, product.dtype, product.device

    def matmat(self, V: Tensor) -> Tensor:
        """``H V + U diag(λ) Uᵀ V`` for ``V`` (P, m)."""
        U = self.U.to(V.dtype)
        return self.product.matmat(V) + U @ (self.eigenvalues.to(V.dtype)[:, None] * (U.T @ V))

    def sketch(self, m: int, generator: torch.Generator) -> Tensor | None:
        """The new data's sketch (see ``CurvatureProduct``)."""
        return self.product.sketch(m, generator)


class TopEigenpairs(LossThenProducts):
    """The pass of a low-rank fit: the summed loss, then the top-k curvature eigenpairs.

    One pass sums the loss (checking each batch's outputs and targets) before
    any solver work; then ``top_eigenpairs`` multiplies the
    curvature over the data with blocks of vectors (``curvature_product``), one more pass
    over the batches ([`passes`][laplace.core.passes.data_loop.DataLoop.passes]) per product.

    Args:
        *args: See ``FitPass``.
        pieces: See ``FitPass``.
        solver: The eigensolver's options, with ``n_eigenvalues`` (see ``_solver_options``).
        **options: See ``FitPass``.

    Attributes:
        errors: After ``run``, the a posteriori relative errors of the eigenvalues (k,).
    """

    def __init__(
        self,
        *args: Unpack[LoopArguments],
        pieces: FitPieces,
        solver: RankedSolverOptions,
        **options: Unpack[LoopOptions],
    ) -> None:
        super().__init__(*args, pieces=pieces, **options)
        self.solver = solver.copy()
        self.errors: Tensor | None = None
        #: Whether the products are the native ones (else curvlinops' operators).
        self.native = self.solver["solver"] == "randomized" and isinstance(
            self.pieces.backend, (GGNInterface, EFInterface)
        )

    def check_batch(self, X: Inputs, y: Tensor, f: object) -> Tensor:
        """``FitPass.check_batch``; on curvlinops' operators, also plain outputs.

        Raises:
            ValueError: For outputs with extra dimensions on curvlinops' operators, which see
                the torch loss of outputs (B, C).
        """
        f = super().check_batch(X, y, f)
        if not self.native:
            self.pieces.likelihood.outputs.require_plain(
                f.shape, "LowRankLaplace's operator route", _NATIVE_ROUTE
            )
        return f

    def run(self, loader: DataLoader) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """``((U (P, k), λ (k,)), loss)`` over ``loader``.

        Raises:
            RuntimeError: If the eigenpairs are not finite.
        """
        loss = self.summed_loss(loader)
        options = self.solver.copy()
        k = int(options.pop("n_eigenvalues"))
        eigensolver: EigensolverOptions = options  # without n_eigenvalues
        local_n = distributed_utils.data_count(loader) if self.distributed else self.pieces.n_data
        product = curvature_product(
            self.pieces.backend,
            self.product_data(loader),
            local_n,
            native=self.native,
            reduce=self.reduce,
            seed=options.get("seed", 0),
        )
        self.product = product
        if self.pieces.previous is not None:  # an online fit (diag_lowrank): earlier data
            product = PlusLowRank(product, *self.pieces.previous[:2])
        U, eigenvalues, self.errors = top_eigenpairs(product, k, **eigensolver)
        self.results = {"eigenvalue_errors": self.errors}
        if not self.pieces.posterior.is_finite((U, eigenvalues)):
            raise RuntimeError("the curvature eigenpairs contain NaN or inf; check the model.")
        return (U, eigenvalues), loss


class DiagonallyCorrectedEigenpairs(TopEigenpairs):
    """The pass of a diagonal-plus-low-rank fit: the top-k eigenpairs, then the exact diagonal.

    ``TopEigenpairs``, then the backend's diagonal summed over the batches (all-reduced in a
    distributed fit): from what the batches the native eigensolver kept between its passes
    recorded, the other batches recorded once more (``NativeProduct.diagonal``); a pass of the
    backend's diag after curvlinops' operators. In an online fit the earlier curvature enters as
    what the posterior kept of it: its ``U diag(λ) Uᵀ`` is added to every product of the
    eigensolver and its exact diagonal to the new one. Arguments as ``TopEigenpairs``.
    """

    def run(self, loader: DataLoader) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
        """``((U (P, k), λ (k,), diag(H) (P,)), loss)`` over ``loader``.

        Raises:
            RuntimeError: If the eigenpairs or the diagonal are not finite.
        """
        (U, eigenvalues), loss = super().run(loader)
        pieces = self.pieces

        def step(X: Inputs, y: Tensor) -> Tensor:
            return DiagonalPosterior.batch_curvature(pieces.backend, X, y, pieces.n_data)[1]

        if isinstance(self.product, NativeProduct):  # from the batches it kept, and the others
            diagonal = self.product.diagonal().to(U.dtype)
        else:  # curvlinops' operator keeps nothing: one more pass
            diagonal = U.new_zeros(len(U))
            with distributed_utils.guard(self.distributed, self.what):
                for batch_diagonal in self.passes(loader, step):
                    diagonal += batch_diagonal.to(diagonal.dtype)
        if self.distributed:
            diagonal = distributed_utils.all_reduce_sum(diagonal)
        if pieces.previous is not None:
            diagonal = diagonal + pieces.previous[2]
        check_finite_result(diagonal, "curvature diagonal")
        return (U, eigenvalues, diagonal), loss
