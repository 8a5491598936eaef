"""The subset-of-data GP: kernel ``K_MM = J_M J_Mᵀ``, output curvature, and its posterior.

Rows are ordered point-major (``m·C + c``). The subset's Jacobians (either kind of
``laplace.functional.ntk``) come in chunks of the GLM predictive's size; those that fit in
``CACHE_BYTES`` are kept between predictions, the others recomputed. Predictions read the
current kernel scale ``s`` and output-curvature factor ``h = 1/(σ²T)`` from the approximation;
the marginal likelihood takes them and the noise variance ``σ²`` as (differentiable) arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from typing import TypedDict

import torch
from torch import Tensor
from typing_extensions import Unpack

from laplace.core.serialization import StateDict
from laplace.functional.ntk import DenseJacobian, FactoredJacobian
from laplace.likelihoods import LikelihoodModel
from laplace.structures import NotPositiveDefiniteError
from laplace.structures.memory_budgets import jacobian_chunk_rows
from laplace.utils.data import Inputs, input_chunks, move_inputs, to_device
from laplace.utils.errors import check_finite_result

__all__ = ["Jacobians", "KernelOptions", "SubsetKernel"]

#: Bytes of subset Jacobians kept between calls.
CACHE_BYTES = 256 * 2**20
#: Noise added to the scatter term of likelihoods without observation noise (as laplace-torch).
SCATTER_JITTER = 1e-5
#: Cap of ``1/Λ`` where the output curvature vanishes (as laplace-torch).
MAX_INVERSE_CURVATURE = 10.0

#: Inputs and whether to keep the graph → (Jacobian of the points, outputs (B, C)).
Jacobians = Callable[[Inputs, bool], tuple[DenseJacobian | FactoredJacobian, Tensor]]
#: The current kernel scale ``s`` and output-curvature factor ``h``.
Scales = Callable[[], tuple[Tensor, Tensor]]


class KernelOptions(TypedDict):
    """The keyword arguments of ``SubsetKernel`` (see there)."""

    independent: bool
    jacobians: Jacobians
    chunk_rows: int
    dict_key_x: str
    scales: Scales


class SubsetKernel:
    """Kernel, output curvature and scatter vector of a data subset: the SoD GP posterior.

    A ``LatentPosterior``.

    Attributes:
        STATE_KEYS: The entries of ``state``.
        STATE_TENSORS: Those holding floating-point tensors.

    Args:
        X: The subset's inputs (M, ...).
        K: ``J_M J_Mᵀ`` (M·C, M·C), or (C, M, M) with independent outputs.
        Lambda: Diagonal of the output Hessians of the loss, (M, C).
        mu: Scatter vector: ``y − f − J(μ₀ − θ*)`` with observation noise, else ``J(θ* − μ₀)``,
            (M, C).
        loss: Summed loss of the subset.
        independent: Keep only the per-output blocks of the kernel.
        jacobians: Jacobians and outputs of inputs (see ``Jacobians``).
        chunk_rows: Points per Jacobian chunk of the subset.
        dict_key_x: Key of the inputs in dict-like batches.
        scales: The current ``(s, h)`` of predictions (see ``Scales``).
    """

    STATE_KEYS = ("X_subset", "K_MM", "Lambda", "mu", "loss")
    STATE_TENSORS = ("K_MM", "Lambda", "mu", "loss")

    def __init__(
        self,
        X: Inputs,
        K: Tensor,
        Lambda: Tensor,
        mu: Tensor,
        loss: Tensor,
        *,
        independent: bool,
        jacobians: Jacobians,
        chunk_rows: int,
        dict_key_x: str,
        scales: Scales,
    ) -> None:
        self.X, self.K, self.Lambda, self.mu, self.loss = X, K, Lambda, mu, loss
        self.independent = independent
        self.n_points, self.n_outputs = Lambda.shape
        self._jacobians, self._chunk_rows, self._dict_key_x = jacobians, chunk_rows, dict_key_x
        self._scales = scales
        self._cache: list[DenseJacobian | FactoredJacobian] = []
        self._factor_key: tuple | None = None
        self._factor: Tensor | None = None

    # ---------------------------------------------------------------------------- building
    @classmethod
    def build(
        cls,
        X: Inputs,
        y: Tensor,
        likelihood: LikelihoodModel,
        shift: Tensor,
        **options: Unpack[KernelOptions],
    ) -> SubsetKernel:
        """Jacobians, outputs, curvature and scatter terms of the subset ``(X, y)``.

        Args:
            X: The subset's inputs.
            y: Its targets.
            likelihood: The likelihood of the fit: loss, output Hessian, and whether the
                scatter vector holds the residuals (likelihoods with observation noise).
            shift: ``μ₀ − θ*``, shape (P,).
            **options: The keyword arguments of the constructor.

        Raises:
            RuntimeError: If a fit term contains NaN or inf.
        """
        jacobians, rows, key = options["jacobians"], options["chunk_rows"], options["dict_key_x"]
        chunks, outputs = zip(*(jacobians(chunk, False) for chunk in input_chunks(X, rows, key)))
        f = torch.cat(outputs)
        y = likelihood.prepare_targets(f, y)
        Jshift = torch.cat([J.matvec(shift) for J in chunks])
        mu = y - (f + Jshift) if likelihood.has_noise_hyperparameter else -Jshift
        Lambda = likelihood.output_hessian(f).diagonal(dim1=-2, dim2=-1)
        kernel = cls(X, None, Lambda, mu, likelihood.loss(f, y), **options)
        for i, J in enumerate(chunks):
            kernel._remember(i, J)
        kernel.K = kernel._gram(chunks)
        for name in ("loss", "Lambda", "mu", "K"):
            check_finite_result(getattr(kernel, name), f"GP {name} of the training subset")
        return kernel

    def _remember(self, i: int, J: DenseJacobian | FactoredJacobian) -> None:
        """Keep subset chunk ``i`` if all before it are kept and ``CACHE_BYTES`` allows."""
        if i == len(self._cache) and sum(c.nbytes for c in self._cache) + J.nbytes <= CACHE_BYTES:
            self._cache.append(J)

    def _subset_jacobians(self) -> Iterator[DenseJacobian | FactoredJacobian]:
        """The subset's Jacobians chunk by chunk: kept ones, then recomputed ones."""
        for i, chunk in enumerate(input_chunks(self.X, self._chunk_rows, self._dict_key_x)):
            if i < len(self._cache):
                yield self._cache[i]
                continue
            J, _ = self._jacobians(chunk, False)
            self._remember(i, J)
            yield J

    def _gram(self, chunks: Sequence[DenseJacobian | FactoredJacobian]) -> Tensor:
        """``J_M J_Mᵀ`` from pairs of chunks (upper blocks mirrored)."""
        M, C = self.n_points, self.n_outputs
        K = self.Lambda.new_zeros((C, M, M) if self.independent else (M * C, M * C))
        rows_per_point = 1 if self.independent else C  # rows of K per point
        starts = [0, *accumulate(rows_per_point * J.shape[0] for J in chunks)]
        for i, Ji in enumerate(chunks):
            for j in range(i, len(chunks)):
                block = Ji.cross(chunks[j], self.independent)
                a, b, c, d = starts[i], starts[i + 1], starts[j], starts[j + 1]
                K[..., a:b, c:d] = block
                K[..., c:d, a:b] = block.transpose(-1, -2)
        return K

    def test_chunk_rows(self) -> int:
        """Test points per chunk: their Jacobian and kernel with the subset in the budget."""
        J = next(self._subset_jacobians())
        return jacobian_chunk_rows(self.n_outputs, J.row_width + self.K.shape[-1], self.K.dtype)

    # --------------------------------------------------------------------------- posterior
    def _rows(self, values: Tensor) -> Tensor:
        """Per-point values (M, C) in the kernel's row order: (C, M) per output, else (M·C,)."""
        return values.T if self.independent else values.reshape(-1)

    def factor(self, s: Tensor, h: Tensor) -> Tensor:
        """Lower Cholesky factor of ``sK + Λ⁻¹/h``, cached while ``s`` and ``h`` hold.

        Raises:
            NotPositiveDefiniteError: If the matrix is not positive definite.
        """
        key = (float(s), float(h))
        differentiable = s.requires_grad or h.requires_grad
        if differentiable or key != self._factor_key:
            # Λ⁻¹/h, capped where the output curvature vanishes
            noise = torch.nan_to_num(1 / (h * self.Lambda), posinf=MAX_INVERSE_CURVATURE)
            factor, info = torch.linalg.cholesky_ex(
                s * self.K + torch.diag_embed(self._rows(noise))
            )
            if bool((info != 0).any()):
                raise NotPositiveDefiniteError(
                    "the GP posterior matrix sK + Λ⁻¹ is not positive definite; increase the "
                    "prior precision or sigma_noise."
                )
            if differentiable:
                return factor
            self._factor_key, self._factor = key, factor
        return self._factor

    def variance(
        self, J: DenseJacobian | FactoredJacobian, s: Tensor, h: Tensor, joint: bool
    ) -> Tensor:
        """``sK** − sK*M (sK_MM + Λ⁻¹/h)⁻¹ sK_M*`` at test points.

        Args:
            J: Jacobian of the B test points.
            s: Kernel scale.
            h: Output-curvature factor ``1/(σ²T)``.
            joint: Keep the covariance between test points.

        Returns:
            Covariances (B, C, C), or the joint covariance (B·C, B·C).
        """
        L = self.factor(s, h)
        B, C = J.shape
        blocks = [J.cross(Jm, self.independent) for Jm in self._subset_jacobians()]
        K_star_M = torch.cat(blocks, dim=-1)  # (C, B, M), or (B·C, M·C)
        V = torch.linalg.solve_triangular(L, s * K_star_M.transpose(-1, -2), upper=False)
        if self.independent:
            if joint:
                cov = s * J.cross(J, True) - V.transpose(1, 2) @ V
                eye = torch.eye(C, dtype=cov.dtype, device=cov.device)  # no cross-output terms
                return torch.einsum("cbm,cd->bcmd", cov, eye).reshape(B * C, B * C)
            return torch.diag_embed(s * J.output_variances() - V.square().sum(1).T)
        if joint:
            return s * J.cross(J, False) - V.T @ V
        V = V.T.reshape(B, C, -1)
        return s * J.output_blocks() - V @ V.transpose(1, 2)

    def moments(self, X: Inputs, joint: bool, create_graph: bool) -> tuple[Tensor, Tensor]:
        """Outputs and ``variance`` at ``X``, point chunk by point chunk unless ``joint``."""
        s, h = self._scales()
        if joint:
            J, f = self._jacobians(X, create_graph)
            return f.reshape(-1), self.variance(J, s, h, joint=True)
        means, variances = [], []
        for chunk in input_chunks(X, self.test_chunk_rows(), self._dict_key_x):
            J, f = self._jacobians(chunk, create_graph)
            means.append(f)
            variances.append(self.variance(J, s, h, joint=False))
        return torch.cat(means), torch.cat(variances)

    def covariance(self, Js: Tensor, joint: bool) -> Tensor:
        """``variance`` of Jacobian rows (B, C, P)."""
        return self.variance(DenseJacobian(Js), *self._scales(), joint)

    # --------------------------------------------------------------------- marginal lik.
    def _eye(self) -> Tensor:
        n = self.K.shape[-1]
        return torch.eye(n, device=self.K.device, dtype=self.K.dtype)

    def log_det_ratio(self, s: Tensor, h: Tensor, noise_variance: Tensor | None) -> Tensor:
        """``log det(sK + σ²I)`` with observation noise σ², else ``log det(I + W sK W)``.

        ``W = √(hΛ)``; the GP evidence of a Gaussian likelihood, else its Laplace approximation.
        """
        sK = s * self.K
        if noise_variance is not None:
            return torch.logdet(sK + noise_variance * self._eye()).sum()
        W = self._rows((h * self.Lambda).sqrt())
        return torch.logdet(W.unsqueeze(-1) * sK * W.unsqueeze(-2) + self._eye()).sum()

    def scatter(self, s: Tensor, noise_variance: Tensor | None) -> Tensor:
        """``μᵀ (sK + νI)⁻¹ μ``, ``ν`` the observation noise σ² or ``SCATTER_JITTER``."""
        noise = SCATTER_JITTER if noise_variance is None else noise_variance
        L = torch.linalg.cholesky(s * self.K + noise * self._eye())
        mu = self._rows(self.mu).unsqueeze(-1)
        return torch.linalg.solve_triangular(L, mu, upper=False).square().sum()

    # -------------------------------------------------------------------------------- state
    def state(self) -> dict[str, Inputs]:
        """Tensors of the fit (the subset's inputs included)."""
        return dict(
            zip(self.STATE_KEYS, (self.X, self.K, self.Lambda, self.mu, self.loss.detach()))
        )

    @classmethod
    def from_state(
        cls,
        state: StateDict,
        device: torch.device,
        dtype: torch.dtype,
        **options: Unpack[KernelOptions],
    ) -> SubsetKernel:
        """Rebuild from ``state`` on ``device`` (floating-point tensors in ``dtype``).

        The subset's inputs keep their own type (the model's, half precision included).
        ``options`` are the keyword arguments of the constructor.
        """
        inputs, *values = cls.STATE_KEYS
        tensors = [to_device(state[key], device, dtype) for key in values]
        return cls(move_inputs(state[inputs], device), *tensors, **options)
