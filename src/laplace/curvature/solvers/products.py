r"""The curvature summed over a data set as a map on blocks of parameter vectors.

Eigensolvers (``laplace.curvature.solvers.eigen``) only multiply the curvature ``H`` (P × P) with
blocks ``V`` (P, m): ``NativeProduct`` computes ``Σ Gᵀ (G V)`` per batch for GGN and EF
backends (``laplace.curvature.engine.block_product``) and draws sketches ``Gᵀ Ω``;
``OperatorProduct`` multiplies with a curvlinops operator (the exact Hessian, Lanczos and
LOBPCG). Both sum over processes through a ``reduce`` callable; ``NativeProduct`` keeps the
batches it records between passes within ``PASS_CACHE_BYTES``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from laplace.curvature.curvature import EFInterface, GGNInterface
from laplace.curvature.curvlinops import CurvlinopsHessian
from laplace.curvature.engine.block_product import BlockSum, ParameterBlock, SampleVectors
from laplace.curvature.registry import available_optional, load_optional
from laplace.utils.data import Inputs, batch_size_of, posterior_dtype

if TYPE_CHECKING:
    from curvlinops._torch_base import PyTorchLinearOperator

    from laplace.curvature.curvature_backend import CurvatureBackend

__all__ = [
    "PASS_CACHE_BYTES",
    "CurvatureProduct",
    "NativeProduct",
    "OperatorProduct",
    "curvature_operator",
    "curvature_product",
]

Reduce = Callable[[Tensor], Tensor]

#: Bytes of recorded batches (layer inputs and output gradients) a ``NativeProduct`` keeps
#: between its passes, so that their forward and backward passes are not repeated.
PASS_CACHE_BYTES = 128 * 2**20


class CurvatureProduct(Protocol):
    """A symmetric P × P curvature that multiplies blocks of vectors.

    Attributes:
        n_params: P.
        dtype: Floating-point type of the products.
        device: Device of the products.
    """

    n_params: int
    dtype: torch.dtype
    device: torch.device

    def matmat(self, V: Tensor, out: Tensor | None = None) -> Tensor:
        """``H V`` for a block ``V`` (P, m), shape (P, m).

        ``out`` (P, m) of the product's dtype is memory the result may be written into
        (overwritten); use the returned tensor, which is ``out`` on a single process.
        """

    def sketch(self, m: int, generator: torch.Generator) -> Tensor | None:
        """A (P, m) block whose range favours the top eigenvectors, or None (use Gaussian)."""


def _identity(value: Tensor) -> Tensor:
    return value


class NativeProduct:
    """``H = Σₙ Σₖ gₙₖ gₙₖᵀ`` of a GGN or EF backend over a data set, by per-layer rules.

    Args:
        backend: A backend of the GGN (exact or Monte-Carlo) or empirical-Fisher family.
        data: Re-iterable batches ``(X, y)`` on the model's device.
        reduce: Sum of a local product over processes (identity when None).
        seed: Seed of the sampled targets of a Monte-Carlo Fisher, re-used on every pass so that
            each pass multiplies with the same matrix.
        cache_bytes: Memory for batches kept between passes (``PASS_CACHE_BYTES`` when
            None; 0 records every batch on every pass).
    """

    def __init__(
        self,
        backend: CurvatureBackend,
        data: Iterable[tuple[Inputs, Tensor]],
        reduce: Reduce | None = None,
        seed: int = 0,
        cache_bytes: int | None = None,
    ) -> None:
        self.backend, self.data = backend, data
        self.reduce = reduce or _identity
        self.seed = seed
        self.cache_bytes = PASS_CACHE_BYTES if cache_bytes is None else cache_bytes
        self._kept: list[SampleVectors] = []
        self._kept_bytes, self._passes, self._all_kept = 0, 0, False
        self._resume: Tensor | None = None
        p = backend.params[0]
        self.n_params = sum(q.numel() for q in backend.params)
        engine = getattr(backend, "engine", None)
        self.dtype = (engine.dtype if engine is not None else None) or posterior_dtype(p.dtype)
        self.device = p.device

    def batches(self) -> Iterator[SampleVectors]:
        """Per batch, its per-sample vectors ``G`` as a map on blocks: one pass.

        The first pass keeps the batches it records while they fit in ``cache_bytes`` (without
        their autograd graphs); later passes reuse them and record only the others. Sampled
        columns (Monte-Carlo Fisher) come from a generator seeded anew on every pass (resumed
        after the kept batches), so every pass sees the same matrix. A batch that is not kept
        is released once its consumer is done with it: one batch at a time is held.
        """
        first = self._passes == 0
        self._passes += 1
        for vectors in self._kept:
            yield vectors
            vectors.clear_cache()
        if self._all_kept:
            return
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        if self._resume is not None:
            generator.set_state(self._resume)
        keeping = first
        for i, (X, y) in enumerate(self.data):
            if i < len(self._kept):
                continue
            vectors = self._record(X, y, generator)
            room = self.cache_bytes - self._kept_bytes
            keeping = keeping and vectors.layerwise and vectors.nbytes <= room
            if keeping:
                self._kept_bytes += vectors.nbytes
                vectors.drop_graph()
                self._kept.append(vectors)
                self._resume = generator.get_state()
            yield vectors
            if keeping:
                vectors.clear_cache()
            else:
                vectors.release()
            del vectors  # not held while the next batch is recorded
        self._all_kept = keeping

    def _record(self, X: Inputs, y: Tensor, generator: torch.Generator) -> SampleVectors:
        """The per-sample vectors of one batch: a recorded forward pass and its columns."""
        trace = self.backend.trace(X)
        columns = self.backend.curvature_columns(trace.f.detach(), y, generator)
        return SampleVectors(trace, torch.stack(list(columns)))

    def diagonal(self) -> Tensor:
        """``diag(H)`` on this process, from the batches kept between passes and the others.

        The kept batches give it from what they recorded; the others are recorded once more
        (one pass over them, none when every batch was kept).

        Returns:
            Shape (P,), not summed over processes.
        """
        total = torch.zeros(self.n_params, dtype=self.dtype, device=self.device)
        for vectors in self.batches():
            gradients = vectors.output_gradients if vectors.layerwise else None
            total += vectors.trace.square_sum(vectors.columns, gradients).to(self.dtype)
        return total

    def matmat(self, V: Tensor, out: Tensor | None = None) -> Tensor:
        """``H V`` for ``V`` (P, m): one pass over the data (``out``: see ``CurvatureProduct``)."""
        block = ParameterBlock(self.backend.engine, V)
        return self.backproject(lambda vectors: vectors.project(block), V.shape[1], out)

    def backproject(
        self, weights: Callable[[SampleVectors], Tensor], m: int, out: Tensor | None = None
    ) -> Tensor:
        """``Σ Gᵀ W`` over the batches, with sample-space weights ``W = weights(G)`` (K, B, m).

        Args:
            weights: The weights of a batch's per-sample vectors.
            m: Number of columns of the weights and of the result.
            out: Memory the result is accumulated in (P, m), overwritten (None: new memory).

        Returns:
            Shape (P, m), summed over processes: one pass.
        """
        like = torch.empty(0, dtype=self.dtype, device=self.device)
        total = BlockSum(self.backend.engine, m, like, out)
        for vectors in self.batches():
            vectors.backproject(weights(vectors), total)
        return self.reduce(total.result())

    def sketch(self, m: int, generator: torch.Generator) -> Tensor:
        """``Σ Gᵀ Ω`` with standard normal weights ``Ω`` (K, B, m) per batch: one pass."""

        def gaussian(vectors: SampleVectors) -> Tensor:
            shape = (vectors.K, vectors.B, m)
            return torch.randn(shape, generator=generator, device=self.device, dtype=self.dtype)

        return self.backproject(gaussian, m)


class OperatorProduct:
    """A curvlinops linear operator times a scale, summed over processes.

    Args:
        operator: The operator (P × P).
        scale: Factor that turns it into the library's curvature.
        reduce: Sum of a local product over processes (identity when None).
    """

    def __init__(
        self, operator: PyTorchLinearOperator, scale: float, reduce: Reduce | None = None
    ) -> None:
        self.operator, self.scale = operator, scale
        self.reduce = reduce or _identity
        self.n_params = operator.shape[0]
        self.dtype, self.device = operator.dtype, operator.device

    def matmat(self, V: Tensor, out: Tensor | None = None) -> Tensor:
        """``scale · (operator @ V)`` for ``V`` (P, m), summed over processes.

        ``out``: see ``CurvatureProduct.matmat``.
        """
        return self.reduce(torch.mul(self.operator @ V, self.scale, out=out))

    def sketch(self, m: int, generator: torch.Generator) -> None:
        """No sketch: solvers start from Gaussian vectors."""
        return None


def curvature_operator(
    backend: CurvatureBackend, data: Iterable[tuple[Inputs, Tensor]], n_data: int
) -> tuple[PyTorchLinearOperator, float]:
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
    from curvlinops import (  # imports SciPy: on first use
        EFLinearOperator,
        FisherMCLinearOperator,
        GGNLinearOperator,
        HessianLinearOperator,
    )

    kwargs: dict[str, object] = {
        "check_deterministic": False,
        "num_data": n_data,
        "batch_size_fn": lambda X: batch_size_of(X, backend.dict_key_x),
    }
    asdl = [load_optional("AsdlHessian")] if "AsdlHessian" in available_optional() else []
    if isinstance(backend, GGNInterface) and backend.stochastic:
        operator_cls, scale = FisherMCLinearOperator, backend.factor
        kwargs["mc_samples"] = backend.num_samples
    elif isinstance(backend, GGNInterface):
        operator_cls, scale = GGNLinearOperator, backend.factor
    elif isinstance(backend, EFInterface):
        operator_cls, scale = EFLinearOperator, backend.factor**2
    elif isinstance(backend, (CurvlinopsHessian, *asdl)):
        operator_cls, scale = HessianLinearOperator, backend.factor
    else:
        raise ValueError(
            f"{type(backend).__name__} has no matrix-free curvature for low-rank Laplace; use "
            "a GGN, empirical-Fisher or Hessian backend (e.g. CurvlinopsGGN, CurvlinopsEF, "
            "CurvlinopsHessian, AsdlHessian)."
        )
    operator = operator_cls(backend.model, backend.lossfunc, backend.params, data, **kwargs)
    return operator, scale


def curvature_product(
    backend: CurvatureBackend,
    data: Iterable[tuple[Inputs, Tensor]],
    n_data: int,
    native: bool = True,
    reduce: Reduce | None = None,
    seed: int = 0,
) -> CurvatureProduct:
    """The backend's curvature over ``data`` as a ``CurvatureProduct``.

    Args:
        backend: A GGN (exact or ``stochastic``), empirical-Fisher or Hessian backend.
        data: Re-iterable batches ``(X, y)`` on the model's device.
        n_data: Number of data points in ``data`` (on this process).
        native: Use ``NativeProduct`` where the backend's family has one (GGN, Fisher);
            else, and for the Hessian, the curvlinops operator.
        reduce: Sum of a local product over processes (identity when None).
        seed: Seed of the Monte-Carlo Fisher's sampled targets (native route).

    Raises:
        ValueError: For a backend with no matrix-free curvature.
    """
    if native and isinstance(backend, (GGNInterface, EFInterface)):
        return NativeProduct(backend, data, reduce, seed)
    return OperatorProduct(*curvature_operator(backend, data, n_data), reduce)
