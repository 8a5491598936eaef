"""``LikelihoodModel``: what the library asks of an observation model ``p(y | f)``.

The rest of the library asks a likelihood object instead of branching on its name: its loss and
output-space curvature for the fit, whether it has an observation noise σ, its torch loss module,
the Hessian structures it can be fitted with, and how a Gaussian over the outputs (GLM) or
sampled outputs (NN) become predictions. Losses follow laplace-torch's conventions: the summed
loss, ``½ Σ‖y − f‖²`` for regression (σ-free, so the output Hessian is the identity) and
``Σ CE`` for classification.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torchmetrics import MeanSquaredError, Metric

from laplace.likelihoods.prediction import OutputPredictions
from laplace.likelihoods.rows import OutputRows
from laplace.likelihoods.scoring import (
    VALIDATION_LOSSES,
    Evaluation,
    EvaluationOptions,
    MetricFactory,
)
from laplace.utils.diag_lowrank import DiagLowRankBatch
from laplace.utils.enums import FunctionalApproximation, HessianStructure
from laplace.utils.errors import UnsupportedError
from laplace.utils.predictive import draw_gaussian

__all__ = ["LikelihoodModel"]


class LikelihoodModel(OutputRows, OutputPredictions, ABC):
    """An observation model ``p(y | f)`` over network outputs ``f`` of shape (B, C).

    Its maths is written for rows (B, C); outputs with extra dimensions reach it as rows
    through :class:`~laplace.likelihoods.rows.OutputRows`.

    How it predicts comes from :class:`~laplace.likelihoods.prediction.OutputPredictions`
    (the outputs' Gaussian moments by default, Gaussian regression's predictive).
    """

    #: The user's ``likelihood`` argument this object stands for (an enum member for built-ins).
    kind: Any
    #: Whether predictions are probabilities (classification) or Gaussian moments.
    predicts_probabilities: bool
    #: Whether the model has an observation noise σ (a hyperparameter); otherwise σ must be 1.
    has_noise_hyperparameter: bool = False
    #: The per-sample loss is ``loss_scale`` times the summed :meth:`loss_module` (½ for MSE).
    loss_scale: float = 1.0
    #: The Hessian structures it can be fitted with; None: every structure.
    hessian_structures: tuple[HessianStructure, ...] | None = None
    #: Whether the fit data are pairs of items (B, 2, ...) that the likelihood compares.
    pairwise: bool = False
    #: Grid search's named validation losses: ``(n_outputs, sigma_noise, **kwargs) → Metric``.
    validation_losses: ClassVar[dict[str, MetricFactory]] = {}
    #: Grid search's default validation loss (a key of :attr:`validation_losses`); None: MSE.
    default_validation_loss: str | None = None
    #: Whether curvlinops' operators on :meth:`loss_module` give its curvature (low-rank).
    loss_module_curvature: bool = True
    #: The function-space (GP) approximations that support it.
    function_space: tuple[FunctionalApproximation, ...] = tuple(FunctionalApproximation)

    @property
    def name(self) -> str:
        """The likelihood's name, as stored in a ``state_dict`` and shown in messages."""
        return self.kind.value

    @property
    def fit_likelihood(self) -> LikelihoodModel:
        """The likelihood used to fit the curvature (differs for reward modelling)."""
        return self

    @property
    def predictive_likelihood(self) -> LikelihoodModel:
        """The likelihood used for predictions (differs for reward modelling)."""
        return self

    @property
    def is_composite(self) -> bool:
        """Whether it fits one observation model and predicts another (reward modelling)."""
        return self.fit_likelihood is not self.predictive_likelihood

    def check_structure(self, structure: HessianStructure) -> None:
        """Refuse a Hessian structure this likelihood cannot be fitted with.

        Raises:
            ValueError: Naming the likelihood and the structures it supports.
        """
        if self.hessian_structures is not None and structure not in self.hessian_structures:
            raise ValueError(
                f"likelihood={self.name!r} supports hessian_structure in "
                f"{[h.value for h in self.hessian_structures]}, got {structure.value!r}."
            )

    def check_function_space(self, approximation: FunctionalApproximation) -> None:
        """Refuse a function-space (GP) approximation that does not support this likelihood.

        Raises:
            ValueError: Naming the approximations (or weight-space structures) that work.
        """
        if approximation not in self.function_space:
            alternatives = (
                f"functional_approximation in {[a.value for a in self.function_space]}"
                if self.function_space
                else "hessian_structure='full', 'diag' or 'kron'"
            )
            raise ValueError(
                f"likelihood={self.name!r} has no function-space Laplace with "
                f"functional_approximation={approximation.value!r} in laplace-ng; use "
                f"{alternatives}."
            )

    def check_backend(self, backend_cls: type) -> None:
        """Refuse a curvature backend whose ``supported_losses`` exclude :meth:`loss_module`.

        Third-party libraries (ASDL, BackPACK) backpropagate only the torch losses they know,
        on outputs (B, C): outputs with extra dimensions are then refused when first seen.

        Raises:
            ValueError: Naming the native backends, which work with every likelihood.
        """
        supported = backend_cls.supported_losses
        loss = type(self.loss_module("sum"))
        if supported is not None and loss not in supported:
            raise ValueError(
                f"{backend_cls.__name__} supports the likelihoods whose loss is one of "
                f"{[cls.__name__ for cls in supported]}; likelihood={self.name!r} uses "
                f"{loss.__name__}. Use backend=CurvlinopsGGN (or CurvlinopsEF), which work "
                "with every likelihood."
            )
        if supported is not None:  # a third-party library: outputs (B, C) only
            self.outputs.plain_only = backend_cls.__name__

    def check_low_rank(self) -> None:
        """Refuse the matrix-free (low-rank) curvature when :meth:`loss_module` cannot give it.

        Raises:
            ValueError: Naming the structures that work.
        """
        if not self.loss_module_curvature:
            raise ValueError(
                f"likelihood={self.name!r} has no low-rank Laplace: the eigensolver multiplies "
                "with curvlinops' operators of the torch loss, whose output Hessian is not this "
                "likelihood's curvature; use hessian_structure='full', 'diag' or 'kron'."
            )

    # ------------------------------------------------------------------------------ fit
    @abstractmethod
    def loss_module(self, reduction: str = "mean") -> nn.Module:
        """The loss as a torch module (``nn.MSELoss``, ``nn.CrossEntropyLoss``) for SGD loops.

        Args:
            reduction: ``"mean"``, ``"sum"`` or ``"none"``, as torch's losses take it.
        """

    @abstractmethod
    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        """A factor ``L`` of the output Hessian ``Λ = L Lᵀ``, shape (B, C, K)."""

    def output_hessian(self, f: Tensor) -> Tensor:
        """Hessian (or Fisher) of the per-sample loss w.r.t. ``f``, shape (B, C, C)."""
        L = self.output_hessian_sqrt(f)
        return L @ L.transpose(-1, -2)

    def structured_output_hessian(self, f: Tensor) -> DiagLowRankBatch:
        """The output Hessians as ``Λₙ = diag(dₙ) + s·Vₙ Vₙᵀ``, without a (B, C, C) tensor.

        Used above :data:`~laplace.posteriors.large_output.LARGE_OUTPUT_THRESHOLD` outputs. By
        default ``d = 0``, ``s = +1`` and ``V`` = :meth:`output_hessian_sqrt`; likelihoods that
        know a smaller form override it (softmax: ``(p, p, −1)``).
        """
        L = self.output_hessian_sqrt(f)
        return DiagLowRankBatch(L.new_zeros(L.shape[:2]), L, 1)

    def ggn(self, J: Tensor, f: Tensor) -> Tensor:
        """Generalised Gauss-Newton ``Σₙ Jₙᵀ Λₙ Jₙ`` of per-point Jacobians.

        Args:
            J: Jacobians of the outputs (B, C, K) w.r.t. K parameters or features.
            f: Outputs (B, C) at which the output Hessians ``Λₙ`` are taken.

        Returns:
            Shape (K, K).
        """
        return torch.einsum("bck,bcd,bdl->kl", J, self.output_hessian(f), J)

    def predictive_nll(
        self, f_mu: Tensor, f_var: Tensor, y: Tensor, sigma_noise: Tensor
    ) -> Tensor:
        """Summed negative log-likelihood of targets under the predictive of ``N(f_mu, f_var)``.

        The validation score of the function-space approximations that tune by it (ELLA,
        VaLLA), which refuse the likelihoods without one (see :attr:`function_space`).

        Args:
            f_mu: Latent means (B, C).
            f_var: Latent covariances (B, C, C).
            y: Targets of the batch.
            sigma_noise: Observation noise σ (used by likelihoods that have one).

        Returns:
            A scalar.

        Raises:
            UnsupportedError: For a likelihood that does not define it.
        """
        raise UnsupportedError(
            f"likelihood={self.name!r} has no predictive negative log-likelihood of a Gaussian "
            "over its outputs in laplace-ng."
        )

    def alpha_energy(
        self,
        y: Tensor,
        f: Tensor,
        cov: Tensor,
        alpha: float,
        noise_variance: Tensor | None,
        n_samples: int,
        generator: torch.Generator | None,
    ) -> Tensor:
        """VaLLA's summed ``ℓ_α(y) = (1/α) log E_{N(f, cov)}[p(y | f)^α]`` of a minibatch.

        ``α = 0`` is the expected log-likelihood (the ELBO's); see
        :mod:`laplace.functional.valla_objective`. By default the Monte-Carlo
        ``(1/α) log((1/S) Σ_s p(y | f_s)^α)`` of :meth:`draw_log_likelihood`, and without draws
        the probit :meth:`predictive_nll` (which does not depend on ``α``).

        Args:
            y: Targets of the minibatch.
            f: Latent means (B, C).
            cov: Latent covariances (B, C, C).
            alpha: ``α`` in [0, 1].
            noise_variance: ``σ²`` of a likelihood with observation noise.
            n_samples: Monte-Carlo draws S of the latent outputs (0: a closed form if any).
            generator: Random number generator of the draws.

        Returns:
            The summed energy, a scalar.

        Raises:
            UnsupportedError: For a likelihood that does not define it.
        """
        if not n_samples:
            return -self.predictive_nll(f, cov, y, noise_variance)
        log_p = self.draw_log_likelihood(y, draw_gaussian(f, cov, n_samples, generator))
        if alpha == 0:
            return log_p.mean(0).sum()
        return (torch.logsumexp(alpha * log_p, 0) - math.log(n_samples)).sum() / alpha

    def draw_log_likelihood(self, y: Tensor, draws: Tensor) -> Tensor:
        """``log p(y_b | f_{s,b})`` of draws of the outputs (S, B, C), shape (S, B).

        Raises:
            UnsupportedError: For a likelihood that does not define it.
        """
        raise UnsupportedError(f"likelihood={self.name!r} has no VaLLA energy in laplace-ng.")

    def validation_loss(
        self, name: str | None, n_outputs: int, sigma_noise: float | Tensor = 0.0, **kwargs: Any
    ) -> Metric:
        """The running validation loss ``name`` of grid search over this likelihood's predictions.

        Args:
            name: A key of :attr:`validation_losses`; None: :attr:`default_validation_loss`,
                else the running mean squared error of the predictive mean (laplace-torch's).
            n_outputs: Number of classes, labels or regression outputs.
            sigma_noise: Observation noise σ added to regression variances.
            **kwargs: Keyword arguments of :class:`torchmetrics.Metric`.

        Raises:
            ValueError: For an unknown name, or one this likelihood does not offer.
        """
        if name is None:
            if self.default_validation_loss is None:
                return MeanSquaredError(num_outputs=n_outputs, **kwargs)
            name = self.default_validation_loss
        if name not in VALIDATION_LOSSES:
            raise ValueError(
                f"loss={name!r} is not supported; accepted names: "
                f"{', '.join(map(repr, VALIDATION_LOSSES))} (or a torchmetrics.Metric or a "
                "callable)."
            )
        if name not in self.validation_losses:
            raise ValueError(
                f"loss={name!r} does not apply to likelihood={self.name!r}; accepted names: "
                f"{', '.join(map(repr, self.validation_losses))}."
            )
        return self.validation_losses[name](n_outputs, sigma_noise, **kwargs)

    def evaluation(self, options: EvaluationOptions) -> Evaluation:
        """The running metrics that measure this likelihood's predictive (``evaluate``).

        Raises:
            ValueError: For a likelihood without an evaluation.
        """
        raise ValueError(
            f"likelihood={self.name!r} cannot be evaluated; evaluate its predictions as those "
            "of a built-in likelihood, e.g. likelihood='classification' or 'regression'."
        )

    @abstractmethod
    def sample_targets(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Draw targets ``y ~ p(y | f)`` (for Monte-Carlo Fisher estimates)."""

    def log_likelihood(
        self, loss: Tensor, n_data: int, n_outputs: int, sigma_noise: Tensor, temperature: float
    ) -> Tensor:
        """Log-likelihood of the training data from its summed loss: ``−loss/T`` by default.

        The default is right for a loss that is the whole negative log-likelihood (no constant
        left out, no σ): classification, binary classification, your own likelihood.
        """
        return -loss / temperature

    def inducing_outputs(self, y: Tensor) -> Tensor:
        """The output (B,) whose Jacobian row an inducing point at each target contributes.

        VaLLA's inducing points each take one output row; by default the first output.
        """
        return torch.zeros(len(y), dtype=torch.long, device=y.device)

    def prepare_targets(self, f: Tensor, y: Tensor) -> Tensor:
        """Check targets against the outputs and bring them to the shape the loss expects.

        Raises:
            ValueError: See :meth:`check_row_targets`.
        """
        self.check_row_targets(y, f.shape)
        return y

    def loss_targets(self, y: Tensor, dtype: torch.dtype) -> Tensor:
        """Targets of a batch in the form :meth:`loss_module` takes them, without the outputs.

        For code that hands batches to curvlinops' operators. As given by default.

        Args:
            y: Targets of a batch.
            dtype: The model's floating-point type.
        """
        return y
