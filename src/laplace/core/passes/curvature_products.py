"""The pass of a matrix-free fit: the summed loss and what products ``H V`` over the data need.

Internal module; ``MatFreeLaplace`` names it as its ``_curvature_pass``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import Unpack

from laplace.core.passes.curvature_sum import FitPieces, LossThenProducts
from laplace.core.passes.data_loop import LoopArguments, LoopOptions
from laplace.curvature.solvers.products import NativeProduct
from laplace.structures.matrix_free import (
    MatFreeCurvature,
    MatFreeOptions,
)
from laplace.utils import distributed as distributed_utils
from laplace.utils.errors import check_finite_result


class CurvatureProducts(LossThenProducts):
    """The pass of a matrix-free fit: the summed loss, then what the products need.

    One pass sums the loss (checking each batch's outputs and targets); the data are then kept
    for products ``H V`` of the native per-layer engine (``NativeProduct``: the batches it
    records are kept between passes within ``cache_bytes``); with ``preconditioner="diag"`` the
    curvature's diagonal is computed from them (``NativeProduct.diagonal``).

    Args:
        *args: See ``FitPass``.
        pieces: See ``FitPass``.
        options: The solver settings.
        **kwargs: See ``FitPass``.
    """

    def __init__(
        self,
        *args: Unpack[LoopArguments],
        pieces: FitPieces,
        options: MatFreeOptions,
        **kwargs: Unpack[LoopOptions],
    ) -> None:
        super().__init__(*args, pieces=pieces, **kwargs)
        self.options = options

    def run(self, loader: DataLoader) -> tuple[MatFreeCurvature, Tensor]:
        """``(curvature, loss)`` over ``loader``.

        Raises:
            RuntimeError: If the curvature's diagonal is not finite.
        """
        loss = self.summed_loss(loader)
        pieces, options = self.pieces, self.options
        dtype = pieces.subset.dtype
        product = NativeProduct(
            pieces.backend,
            self.product_data(loader),
            reduce=self.reduce,
            seed=options.seed,
            cache_bytes=options.cache_bytes,
        )
        like = torch.empty(0, dtype=dtype, device=pieces.subset.device)
        diagonal = None
        if options.preconditioner == "diag":
            with distributed_utils.guard(self.distributed, self.what):
                diagonal = product.diagonal().to(dtype)
            if self.distributed:
                diagonal = distributed_utils.all_reduce_sum(diagonal)
            check_finite_result(diagonal, "curvature diagonal")
        rank = torch.distributed.get_rank() if self.distributed else 0
        H = MatFreeCurvature(
            product.n_params,
            like,
            options,
            product,
            diagonal,
            distributed=self.distributed,
            reduce_rank=rank,
        )
        return H, loss
