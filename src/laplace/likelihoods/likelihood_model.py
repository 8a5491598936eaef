"""``LikelihoodModel``: what the library asks of an observation model ``p(y | f)``.

Losses follow laplace-torch's conventions: the summed loss, ``½ Σ‖y − f‖²`` for regression
(σ-free, so the output Hessian is the identity) and ``Σ CE`` for classification. The maths is
written for rows (B, C); outputs with extra dimensions reach it as rows (B·T, C) through its
[`OutputAdapter`][laplace.utils.outputs.OutputAdapter], which drops the positions an
``ignore_index`` drops and gives predictions the outputs' shape back.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar, Generic, TypedDict, TypeVar, cast

import torch
from torch import Tensor, nn

from laplace.likelihoods.scoring import (
    VALIDATION_LOSSES,
    Evaluation,
    EvaluationOptions,
    MetricFactory,
    MetricOptions,
)
from laplace.utils import enums
from laplace.utils.diag_lowrank import DiagLowRankBatch
from laplace.utils.enums import FunctionalApproximation, HessianStructure, LinkApprox
from laplace.utils.errors import UnsupportedError
from laplace.utils.outputs import OutputAdapter, OutputLayout, PositionTargets
from laplace.utils.predictive import draw_gaussian

if TYPE_CHECKING:
    from torchmetrics import Metric
    from typing_extensions import Unpack

    from laplace.likelihoods.protocol import Likelihood

__all__ = [
    "LikelihoodModel",
    "LossModule",
    "Prediction",
    "ProbabilityPredictions",
    "ReducedLoss",
    "SamplingOptions",
]

#: A likelihood's predictions: probabilities (B, C), or a tuple of Gaussian moments
#: (``(mean, variance)``, heteroscedastic regression's ``HeteroscedasticPrediction``).
Prediction = Tensor | tuple[Tensor, ...]
#: The predictions of one likelihood (probabilities, a pair of moments, ...).
PredictionT = TypeVar("PredictionT", bound=Prediction)


class SamplingOptions(TypedDict, total=False):
    """The Monte-Carlo options of a predictive (``la(x, n_samples=..., generator=...)``).

    Attributes:
        n_samples: Monte-Carlo samples.
        generator: Random number generator of the samples.
    """

    n_samples: int
    generator: torch.Generator | None


class LikelihoodModel(ABC, Generic[PredictionT]):
    """An observation model ``p(y | f)`` over network outputs ``f`` of shape (B, C).

    It predicts the outputs' Gaussian moments by default (Gaussian regression's predictive);
    ``PredictionT`` is what its predictions are (``ProbabilityPredictions``: a tensor).
    """

    #: The user's ``likelihood`` argument this object stands for: a built-in's name (a member
    #: of ``laplace.utils.enums.Likelihood`` where laplace-torch names it) or the user's object.
    kind: enums.Likelihood | str | Likelihood
    #: Whether predictions are probabilities (classification) or Gaussian moments.
    predicts_probabilities: bool = False
    #: The torch loss module class of ``loss_module`` (``nn.MSELoss``, ...).
    torch_loss: type[nn.Module]
    #: Whether the model has an observation noise σ (a hyperparameter); otherwise σ must be 1.
    has_noise_hyperparameter: bool = False
    #: The per-sample loss is ``loss_scale`` times the summed ``loss_module`` (½ for MSE).
    loss_scale: float = 1.0
    #: The Hessian structures it can be fitted with; None: every structure.
    hessian_structures: tuple[HessianStructure, ...] | None = None
    #: Whether the fit data are pairs of items (B, 2, ...) that the likelihood compares.
    pairwise: bool = False
    #: Grid search's named validation losses: ``(n_outputs, sigma_noise, **kwargs) → Metric``.
    validation_losses: ClassVar[dict[str, MetricFactory]] = {}
    #: Grid search's default validation loss (a key of ``validation_losses``); None: MSE.
    default_validation_loss: str | None = None
    #: Whether curvlinops' operators on ``loss_module`` give its curvature (low-rank).
    loss_module_curvature: bool = True
    #: The function-space (GP) approximations that support it.
    function_space: tuple[FunctionalApproximation, ...] = tuple(FunctionalApproximation)
    #: How targets relate to outputs with extra dimensions; None: outputs (B, C) only.
    position_targets: PositionTargets | None = None
    #: The ``link_approx`` values its GLM predictive accepts; None: the link is not used.
    links: tuple[LinkApprox, ...] | None = None
    #: Whether ``joint=True`` (the joint Gaussian over test outputs) applies to its predictive.
    supports_joint: bool = False
    #: What the predictive returns, for messages.
    predictions: str = "predictions"
    #: Whether ``glm_predictive`` takes output variances (B, C) (True) or covariances
    #: (B, C, C) (False); None: what the caller asked for (``diagonal_output``).
    output_variances: bool | None = None

    def __init__(self) -> None:
        #: The user's ``class_dim`` / ``ignore_index`` and the class dimension found from data.
        self.outputs = OutputAdapter()
        #: The likelihood used to fit the curvature (another one for reward modelling).
        self.fit_likelihood: LikelihoodModel = self
        #: The likelihood used for predictions (another one for reward modelling).
        self.predictive_likelihood: LikelihoodModel = self

    @property
    def name(self) -> str:
        """The likelihood's name, as stored in a ``state_dict`` and shown in messages."""
        return self.kind_name()

    @classmethod
    def kind_name(cls) -> str:
        """A built-in's name: the string of its ``kind``."""
        return str(getattr(cls.kind, "value", cls.kind))

    @property
    def is_composite(self) -> bool:
        """Whether it fits one observation model and predicts another (reward modelling)."""
        return self.fit_likelihood is not self.predictive_likelihood

    def check_structure(self, structure: HessianStructure) -> None:
        """Refuse a Hessian structure this likelihood cannot be fitted with.

        Raises:
            ValueError: Naming the likelihood and the structures it supports.
        """
        refuse_structure(self.name, self.hessian_structures, structure)

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
        """Refuse a curvature backend whose ``supported_losses`` exclude ``loss_module``.

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
        """Refuse the matrix-free (low-rank) curvature when ``loss_module`` cannot give it.

        Raises:
            ValueError: Naming the structures that work.
        """
        if not self.loss_module_curvature:
            raise ValueError(
                f"likelihood={self.name!r} has no low-rank Laplace: the eigensolver multiplies "
                "with curvlinops' operators of the torch loss, whose output Hessian is not this "
                "likelihood's curvature; use hessian_structure='full', 'diag' or 'kron'."
            )

    # ------------------------------------------------------------------------------ outputs
    def layout(self, output_shape: Sequence[int], y: Tensor | None = None) -> OutputLayout:
        """The rows of outputs of ``output_shape`` (B, …), for targets ``y`` (None: predicting).

        Raises:
            ValueError: See ``laplace.utils.outputs.OutputAdapter.layout``.
        """
        return self.outputs.layout(output_shape, y, self.position_targets, self.name)

    def output_count(self, output_shape: Sequence[int], y: Tensor | None = None) -> int:
        """``la.n_outputs`` for outputs of ``output_shape``: C, the outputs of one row."""
        return self.layout(output_shape, y).n_classes

    def check_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        """Refuse targets that cannot belong to outputs of shape ``output_shape`` (B, …).

        Cheap (no model call): the data loops run it on every batch before any curvature work.
        Labels equal to ``ignore_index`` are accepted (their positions are dropped).

        Raises:
            ValueError: Naming the problem (shape, label range, an ambiguous class dimension);
                a ``DataError`` (a ``RuntimeError``) for targets of the wrong kind, a
                ``LabelError`` (an ``IndexError``) for a class label outside ``[0, C)``.
        """
        layout = self.layout(output_shape, y)
        targets, _ = layout.labelled(y)
        row_shape = output_shape if layout.plain else (len(targets), layout.n_classes)
        self.check_row_targets(targets, row_shape)

    def loss(self, f: Tensor, y: Tensor) -> Tensor:
        """Summed loss of a batch of outputs (B, …) over its data points and kept positions."""
        return self.point_losses(f, y).sum()

    def point_losses(self, f: Tensor, y: Tensor) -> Tensor:
        """Loss of each data point of a batch of outputs (B, …), summed over its kept positions.

        Returns:
            Shape (B,).
        """
        rows, targets, keep = self.layout(f.shape, y).split(f, y)
        per_row = self.per_sample_loss(rows, targets)
        if keep is not None:
            per_row = per_row * keep
        return per_row.reshape(len(f), -1).sum(1)

    def output_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        """Gradient of the summed loss w.r.t. the outputs, shape of ``f`` (B, …)."""
        layout = self.layout(f.shape, y)
        rows, targets, keep = layout.split(f, y)
        gradient = self.loss_gradient(rows, targets)
        if keep is not None:
            gradient = gradient * keep.unsqueeze(-1)
        return layout.restore(gradient)

    @abstractmethod
    def per_sample_loss(self, f: Tensor, y: Tensor) -> Tensor:
        """Negative log-likelihood of rows (B, C) up to constants, shape (B,)."""

    @abstractmethod
    def loss_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        """Gradient of the per-row loss w.r.t. rows ``f`` (B, C), shape (B, C)."""

    @abstractmethod
    def check_row_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        """Refuse targets that cannot belong to rows of shape ``output_shape`` (B, C).

        Raises:
            ValueError: As ``check_targets``.
        """

    # ------------------------------------------------------------------------------ fit
    def loss_module(self, reduction: str = "mean") -> nn.Module:
        """The loss as a torch module (``torch_loss``) for SGD loops and backends.

        Args:
            reduction: ``"mean"``, ``"sum"`` or ``"none"``, as torch's losses take it.
        """
        return self.torch_loss(reduction=reduction)

    @abstractmethod
    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        """A factor ``L`` of the output Hessian ``Λ = L Lᵀ``, shape (B, C, K)."""

    def output_hessian(self, f: Tensor) -> Tensor:
        """Hessian (or Fisher) of the per-sample loss w.r.t. ``f``, shape (B, C, C)."""
        L = self.output_hessian_sqrt(f)
        return L @ L.transpose(-1, -2)

    def structured_output_hessian(self, f: Tensor) -> DiagLowRankBatch:
        """The output Hessians as ``Λₙ = diag(dₙ) + s·Vₙ Vₙᵀ``, without a (B, C, C) tensor.

        By default ``d = 0``, ``s = +1`` and ``V`` = ``output_hessian_sqrt``; likelihoods that
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
        VaLLA), which refuse the likelihoods without one (see ``function_space``).

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

        ``α = 0`` is the expected log-likelihood (the ELBO's). By default the Monte-Carlo
        ``(1/α) log((1/S) Σ_s p(y | f_s)^α)`` of ``draw_log_likelihood``, and without draws
        the probit ``predictive_nll`` (which does not depend on ``α``).

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
            ValueError: See ``check_row_targets``.
        """
        self.check_row_targets(y, f.shape)
        return y

    def column_targets(self, y: Tensor, output_shape: Sequence[int]) -> Tensor:
        """Targets (B,) of outputs (B, 1) as the column (B, 1) where they are the outputs' values.

        As given by default (labels (B,) are no column); see
        ``BaseFunctionalLaplace._fit_targets``.
        """
        return y

    def loss_targets(self, y: Tensor, dtype: torch.dtype) -> Tensor:
        """Targets of a batch as ``loss_module`` takes them (curvlinops' operators); as given."""
        return y

    # ------------------------------------------------------------------------------ predictions
    def check_prediction(self, link_approx: LinkApprox, joint: bool) -> None:
        """Refuse predictive options that do not apply, before any work.

        Raises:
            ValueError: For ``joint=True`` without a joint form, or a ``link_approx`` outside
                ``links``.
        """
        if joint and not self.supports_joint:
            raise ValueError(
                "joint=True gives the joint Gaussian over the outputs of a regression GLM "
                f"predictive; {self.predictions} have no joint form (use joint=False)."
            )
        if self.links is not None and link_approx not in self.links:
            raise ValueError(
                f"likelihood={self.name!r} accepts link_approx in "
                f"{[link.value for link in self.links]}, got {link_approx.value!r}."
            )

    def check_variance_prediction(
        self, link_approx: LinkApprox, joint: bool, diagonal_output: bool, reason: str
    ) -> None:
        """Refuse options that need covariances between outputs when only variances exist.

        Args:
            link_approx: The requested link approximation.
            joint: Whether the joint Gaussian over test outputs was requested.
            diagonal_output: Whether variances were requested.
            reason: Why only output variances (B, C) are computed, for the message.

        Raises:
            ValueError: Unless ``diagonal_output=True`` and ``joint=False``.
        """
        if joint or not diagonal_output:
            raise ValueError(
                f"{reason}: use diagonal_output=True (and joint=False) for the predictive "
                "variances, or pred_type='nn' with link_approx='mc' to sample weights."
            )

    def predict(
        self,
        f_mu: Tensor,
        f_var: Tensor,
        link_approx: LinkApprox,
        n_samples: int,
        generator: torch.Generator | None,
        diagonal_output: bool,
    ) -> PredictionT:
        """The GLM predictive from the Gaussian over the outputs at the test inputs.

        Args:
            f_mu: Output means in the outputs' shape (B, …).
            f_var: Covariances (B·T, C, C) of their rows (``laplace.utils.outputs``), or variances
                where ``diagonal_moments`` asked for them.
            link_approx: See ``glm_predictive``.
            n_samples: Monte-Carlo samples of ``"mc"``.
            generator: Random number generator of ``"mc"``.
            diagonal_output: Whether the caller asked for variances.
        """
        layout = self.layout(f_mu.shape)
        prediction = self.glm_predictive(
            layout.rows(f_mu), f_var, link_approx, n_samples=n_samples, generator=generator
        )
        return prediction if layout.plain else self.restore_prediction(prediction, layout)

    def restore_prediction(self, prediction: PredictionT, layout: OutputLayout) -> PredictionT:
        """Predictions of rows in the outputs' shape (outputs with extra dimensions).

        Gaussian moments by default: the means (B, …) and each output's variance (B, …).
        """
        f_mu, f_var = prediction
        if f_var.dim() == f_mu.dim() + 1:
            f_var = f_var.diagonal(dim1=-2, dim2=-1)
        return cast(PredictionT, (layout.restore(f_mu), layout.restore(f_var)))

    def diagonal_moments(self, diagonal_output: bool) -> bool:
        """Whether ``glm_predictive`` needs only the output variances (B, C)."""
        return diagonal_output if self.output_variances is None else self.output_variances

    def glm_predictive(
        self,
        f_mu: Tensor,
        f_var: Tensor,
        link_approx: LinkApprox,
        **sampling: Unpack[SamplingOptions],
    ) -> PredictionT:
        """Predictions from a Gaussian over the outputs (the linearised network).

        Args:
            f_mu: Output means (B, C).
            f_var: Output covariances (B, C, C), or variances (B, C) when
                ``diagonal_moments`` said so.
            link_approx: The link approximation (for likelihoods with ``links``).
            **sampling: ``n_samples`` and ``generator`` of Monte-Carlo approximations.

        Returns:
            ``(f_mu, f_var)`` by default (Gaussian regression).
        """
        return cast(PredictionT, (f_mu, f_var))

    def validation_rows(self, prediction: PredictionT, y: Tensor) -> tuple[PredictionT, Tensor]:
        """Predictions and targets of a validation batch as the validation metrics take them.

        Gaussian moments by default: means and variances flattened per data point (B, T·C)
        for outputs with extra dimensions (as given for outputs (B, C)).
        """
        if not isinstance(prediction, tuple) or self.layout(prediction[0].shape).plain:
            return prediction, y
        rows = tuple(p.reshape(len(p), -1) for p in prediction)
        return cast(PredictionT, rows), y.reshape(len(y), -1)

    def sampled_predictive(self, f: Tensor) -> PredictionT:
        """Predictions from sampled networks' outputs ``f`` (S, B, C) (``pred_type="nn"``).

        Returns:
            The mean (B, C) and variance (B, C) over the samples by default.
        """
        return cast(PredictionT, (f.mean(dim=0), f.var(dim=0)))

    def sampled_predictive_of(self, groups: Iterable[Tensor]) -> PredictionT:
        """``sampled_predictive`` of groups of sampled outputs (Sᵢ, B, …), put together first."""
        return self.sampled_predictive(torch.cat(list(groups)))

    def predictive_sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One predictive draw per output sample ``f`` (S, B, C): the outputs by default."""
        return f

    # ------------------------------------------------------------------------------ scoring
    def validation_loss(
        self,
        name: str | None,
        n_outputs: int,
        sigma_noise: float | Tensor = 0.0,
        **kwargs: Unpack[MetricOptions],
    ) -> Metric:
        """The running validation loss ``name`` of grid search over this likelihood's predictions.

        Args:
            name: A key of ``validation_losses``; None: ``default_validation_loss``,
                else the running mean squared error of the predictive mean (laplace-torch's).
            n_outputs: Number of classes, labels or regression outputs.
            sigma_noise: Observation noise σ added to regression variances.
            **kwargs: Keyword arguments of ``torchmetrics.Metric``.

        Raises:
            ValueError: For an unknown name, or one this likelihood does not offer.
        """
        if name is None:
            if self.default_validation_loss is None:
                from torchmetrics import MeanSquaredError

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


class ProbabilityPredictions(LikelihoodModel[Tensor]):
    """A likelihood whose predictions are probabilities ``link(f)`` of the outputs.

    The GLM predictive approximates ``E[link(f)]`` under the Gaussian over the outputs by one of
    the functions of ``link_approximations``; sampled networks and predictive samples apply
    ``link`` to each draw.
    """

    predicts_probabilities = True
    #: ``link_approx`` → function of ``(f_mu, f_var, n_samples=, generator=)``.
    link_approximations: dict[LinkApprox, Callable[..., Tensor]]
    #: The probabilities ``link(f)`` of outputs ``f`` (..., C), a torch function.
    link: Callable[[Tensor], Tensor]
    #: The link approximations that work from output variances (B, C) alone.
    variance_links: tuple[LinkApprox, ...] = (LinkApprox.PROBIT,)

    def check_variance_prediction(
        self, link_approx: LinkApprox, joint: bool, diagonal_output: bool, reason: str
    ) -> None:
        """Refuse a link approximation that needs covariances between outputs.

        Raises:
            ValueError: For a ``link_approx`` outside ``variance_links``.
        """
        if link_approx not in self.variance_links:
            raise ValueError(
                f"{reason}: link_approx={link_approx.value!r} needs the covariance between "
                f"outputs; use link_approx in {[link.value for link in self.variance_links]}, "
                "or pred_type='nn' with link_approx='mc', which samples the weights from the "
                "posterior."
            )

    @property
    def links(self) -> tuple[LinkApprox, ...]:  # type: ignore[override]
        """The link approximations the GLM predictive accepts."""
        return tuple(self.link_approximations)

    def glm_predictive(
        self,
        f_mu: Tensor,
        f_var: Tensor,
        link_approx: LinkApprox,
        **sampling: Unpack[SamplingOptions],
    ) -> Tensor:
        """Probabilities (B, C) by the link approximation ``link_approx``."""
        return self.link_approximations[link_approx](f_mu, f_var, **sampling)

    def sampled_predictive(self, f: Tensor) -> Tensor:
        """The mean probabilities over sampled outputs (S, B, …), shape (B, …)."""
        return self.predictive_sample(f).mean(dim=0)

    def sampled_predictive_of(self, groups: Iterable[Tensor]) -> Tensor:
        """The mean probabilities over groups of sampled outputs, summed a group at a time."""
        total, count = 0, 0
        for f in groups:
            total = total + self.predictive_sample(f).sum(dim=0)
            count += len(f)
        return total / count

    def predictive_sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """The probabilities of each output sample (S, B, …), along the class dimension."""
        layout = self.layout(f.shape[1:])
        return layout.restore(self.link(layout.rows(f)))

    def restore_prediction(self, prediction: Tensor, layout: OutputLayout) -> Tensor:
        """Probabilities of rows (B·T, C) in the outputs' shape."""
        return layout.restore(prediction)

    def validation_rows(self, prediction: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Probabilities (B·T, C) and labels of the positions that count (not dropped)."""
        layout = self.layout(prediction.shape, y)
        targets, keep = layout.labelled(y)
        rows = layout.rows(prediction)
        return (rows, targets) if keep is None else (rows[keep], targets[keep])


class ReducedLoss(nn.Module):
    """A torch loss module that reduces a loss of each data point as torch's losses do.

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Raises:
        ValueError: For another ``reduction``.
    """

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")
        self.reduction = reduction

    def reduce(self, loss: Tensor) -> Tensor:
        """The mean or sum of ``loss``, or ``loss`` itself with ``"none"``."""
        if self.reduction == "mean":
            return loss.mean()
        return loss.sum() if self.reduction == "sum" else loss


class LossModule(ReducedLoss):
    """A likelihood object's negative log-likelihood as a torch loss ``(f, y) → loss``.

    For the torch-loss routes (curvlinops' operators, training loops) of likelihoods without a
    torch loss of their own, and of outputs of any layout.

    Args:
        likelihood: The likelihood object.
        reduction: ``"mean"`` (over data points), ``"sum"`` or ``"none"`` (shape (B,)).
    """

    def __init__(self, likelihood: LikelihoodModel, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.likelihood = likelihood

    def forward(self, f: Tensor, y: Tensor) -> Tensor:
        """The loss of outputs ``f`` (B, …) and targets ``y``."""
        return self.reduce(self.likelihood.point_losses(f, y))


def refuse_structure(
    name: str, supported: tuple[HessianStructure, ...] | None, structure: HessianStructure
) -> None:
    """Refuse ``structure`` where a likelihood's ``supported`` structures (None: all) lack it.

    Raises:
        ValueError: Naming the likelihood and the structures it supports.
    """
    if supported is not None and structure not in supported:
        raise ValueError(
            f"likelihood={name!r} supports hessian_structure in "
            f"{[h.value for h in supported]}, got {structure.value!r}."
        )
