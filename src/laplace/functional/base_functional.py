r"""``BaseFunctionalLaplace``: predictives of function-space (GP) Laplace approximations.

Linearising the network at the MAP ``θ*`` makes it a GLM whose Gaussian weight prior is a GP
over functions with the neural tangent kernel ``k(x, x') = J(x) P₀⁻¹ J(x')ᵀ``. Each subclass
holds its approximation of the GP posterior as a ``LatentPosterior`` (subset of data,
Nyström features, inducing points); this class turns its latent moments into predictions. See
``docs/function_space.md``.

Internal module; the public path is [`laplace.baselaplace`][laplace.baselaplace].
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, TypeVar

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace.core.base_laplace import BaseLaplace
from laplace.core.priors import as_scalar_prior_precision, check_temperature
from laplace.core.serialization import (
    A,
    SavedApproximation,
    StateDict,
    StateFormat,
    trainable_coordinates,
)
from laplace.structures.memory_budgets import JACOBIAN_CHUNK_BYTES, jacobian_chunk_rows
from laplace.utils.data import Inputs, batch_size_of, check_outputs, input_chunks, prepare_inputs
from laplace.utils.enums import FunctionalApproximation, LinkApprox, PredType
from laplace.utils.errors import (
    UnsupportedError,
    check_fits_in_memory,
    check_generator,
    check_positive_int,
)
from laplace.utils.predictive import gaussian_output_samples

__all__ = ["BaseFunctionalLaplace", "LatentPosterior"]


def check_val_steps(val_steps: object) -> None:
    """Refuse a ``val_steps`` that is not None or a positive integer (number of batches).

    Raises:
        ArgumentTypeError: If it is not an integer.
        ValueError: If it is smaller than 1.
    """
    if val_steps is None:
        return
    try:
        check_positive_int(val_steps, "val_steps")
    except ValueError as error:  # ArgumentTypeError is a ValueError too
        raise type(error)(
            f"val_steps must be positive (a number of batches), got {val_steps!r}."
        ) from None


class FunctionalState(StateFormat[A]):
    """The state of a function-space Laplace: the class's named attributes, T checked."""

    def check(self, la: A, state_dict: StateDict) -> None:
        """Refuse a temperature that is not a positive number."""
        check_temperature(state_dict["temperature"])


class SavedWithHistory(SavedApproximation, Protocol):
    """What ``HistoryState`` reads of ELLA and VaLLA besides."""

    fit_history_: dict[str, list[object]]
    dict_key_x: str
    dict_key_y: str


#: ELLA or VaLLA.
H = TypeVar("H", bound=SavedWithHistory)


class HistoryState(FunctionalState[H]):
    """The state of ELLA and VaLLA: their named attributes and the fit history.

    Their identity holds the trainable coordinates and the dict keys besides the class,
    likelihood and module tree: the basis or the inducing inputs belong to those.
    """

    def identity_entries(self, la: H) -> dict[str, object]:
        """The names and shapes of the trainable parameters, ``dict_key_x`` and ``dict_key_y``."""
        return {
            **trainable_coordinates(la),
            "dict_key_x": la.dict_key_x,
            "dict_key_y": la.dict_key_y,
        }

    def value_keys(self, la: H) -> tuple[str, ...]:
        """The named attributes and ``fit_history``."""
        return (*super().value_keys(la), "fit_history")

    def values(self, la: H) -> StateDict:
        """The named attributes and a copy of ``fit_history_``."""
        history = {k: list(v) for k, v in la.fit_history_.items()}
        return {**super().values(la), "fit_history": history}

    def load(self, la: H, state_dict: StateDict) -> None:
        """Assign the named attributes and the fit history; the model predicts in eval mode.

        A restored estimator predicts at once, as one that was fitted does (``fit`` leaves the
        model in evaluation mode), so dropout and batch norm behave as in the fitted one.
        """
        super().load(la, state_dict)
        la.fit_history_ = {k: list(v) for k, v in state_dict["fit_history"].items()}
        la.model.eval()


class LatentPosterior(Protocol):
    """The GP posterior over the network outputs a function-space approximation holds."""

    def moments(self, X: Inputs, joint: bool, create_graph: bool) -> tuple[Tensor, Tensor]:
        """Latent means and covariances at ``X``, without observation noise.

        Returns:
            Means (B, C) and covariances (B, C, C); with ``joint`` means (B·C,) and the
            covariance (B·C, B·C). Detached unless ``create_graph``.
        """
        ...

    def covariance(self, Js: Tensor, joint: bool) -> Tensor:
        """``J Σ Jᵀ`` of Jacobians (B, C, P): (B, C, C), or (B·C, B·C) with ``joint``."""
        ...


class BaseFunctionalLaplace(BaseLaplace):
    """Predictions, sampling and validation shared by the function-space approximations.

    A subclass implements ``fit``, which sets ``_gp``: its ``LatentPosterior``. The
    prior precision ``δ`` is a scalar (the GP prior). Approximations tuned by the validation NLL
    (ELLA, VaLLA) record it in ``fit_history_["val_nll"]`` and, as in laplace-torch, have no
    Laplace marginal likelihood and do not track the training log-likelihood.
    """

    _function_space = FunctionalApproximation.SOD
    _state_format: StateFormat = FunctionalState()
    _gp: LatentPosterior | None = None
    _column_targets = False  # (B,) regression targets of one output as (B, 1): _fit_targets

    def _set_scalar_prior(self, value: float | Tensor) -> None:
        name = type(self).__name__
        self._prior_precision = as_scalar_prior_precision(value, name, self._device, self._dtype)

    prior_precision = property(
        BaseLaplace.prior_precision.fget,
        _set_scalar_prior,
        doc="Isotropic prior precision ``δ``, shape (1,).",
    )

    _centred_prior: str | None = None  # why the prior mean must stay 0 (ELLA, VaLLA)

    def _set_prior_mean(self, value: float | Tensor) -> None:
        previous = self.__dict__.get("_prior_mean")
        BaseLaplace.prior_mean.fset(self, value)  # checks the type and finiteness first
        if self._centred_prior and bool((self._prior_mean != 0).any()):
            if previous is not None:
                self._prior_mean = previous  # a refused value changes nothing
            raise ValueError(f"{type(self).__name__} needs prior_mean=0 ({self._centred_prior}).")

    prior_mean = property(
        BaseLaplace.prior_mean.fget,
        _set_prior_mean,
        doc="Prior mean; ELLA and VaLLA refuse any value but 0, at construction and later.",
    )

    def functional_variance(self, Js: Tensor) -> Tensor:
        """Posterior output covariances from Jacobians: (B, C, P) → (B, C, C).

        Raises:
            RuntimeError: Before ``fit``.
            ValueError: For Jacobians that are not (B, C, P).
        """
        return self._gp.covariance(self._checked_jacobians(Js, "functional_variance"), False)

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """Joint posterior covariance from Jacobians: (B, C, P) → (B·C, B·C).

        Raises:
            RuntimeError: Before ``fit``.
            ValueError: For Jacobians that are not (B, C, P).
        """
        return self._gp.covariance(self._checked_jacobians(Js, "functional_covariance"), True)

    def _checked_jacobians(self, Js: Tensor, what: str) -> Tensor:
        self._check_fitted(what)
        if not isinstance(Js, Tensor) or Js.dim() != 3 or Js.shape[-1] != self.n_params:
            shape = tuple(Js.shape) if isinstance(Js, Tensor) else type(Js).__name__
            raise ValueError(
                f"Invalid Jacobians shape for Laplace posterior approx: expected (B, C, "
                f"{self.n_params}), got {shape}."
            )
        return Js

    def log_marginal_likelihood(
        self, prior_precision: Tensor | None = None, sigma_noise: Tensor | None = None
    ) -> Tensor:
        """Not defined (as in laplace-torch): tune by the validation NLL (``fit_history_``)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no Laplace marginal likelihood; its hyperparameters "
            "are tuned by the validation NLL (see fit_history_)."
        )

    @property
    def log_likelihood(self) -> Tensor:
        """Not tracked (as in laplace-torch)."""
        raise UnsupportedError(
            f"{type(self).__name__} does not track the training log-likelihood."
        )

    def _start_fit(self, X: Inputs, y: Tensor) -> torch.Size:
        """Check the model's outputs on ``X`` and the targets ``y`` before any Jacobian.

        Sets ``n_outputs`` and the posterior mean ``mean`` (the current weights).

        Returns:
            The shape of the outputs (B, C).

        Raises:
            ValueError: For outputs that are not (B, C) (extra dimensions included) or targets
                that do not fit them.
        """
        with torch.no_grad():
            f = check_outputs(self.model(X), batch_size_of(X, self.dict_key_x))
        self._likelihood_model.outputs.require_plain(f.shape, type(self).__name__)
        self._likelihood_model.check_targets(self._fit_targets(y, f.shape), f.shape)
        self.n_outputs = f.shape[-1]
        self.mean = self._subset.vector().detach()
        return f.shape

    def _fit_targets(self, y: Tensor, output_shape: Sequence[int]) -> Tensor:
        """The targets of a batch in the shape the fit and the validation NLL take them.

        ELLA and VaLLA (``_column_targets``) read regression targets (B,) of a model with one
        output (B, 1) as (B, 1), as laplace-torch's functional approximations accept them; its
        ``FunctionalLaplace`` and parametric approximations refuse them, and so do ours.
        """
        if not self._column_targets:
            return y
        return self._likelihood_model.column_targets(y, output_shape)

    def _jacobian_chunks(
        self, X: Inputs, enable_backprop: bool = False
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """``(Js (b, C, P), f (b, C))`` of the backend over chunks of the GLM predictive's size."""
        rows = jacobian_chunk_rows(self.n_outputs, self.n_params, self._dtype)
        for chunk in input_chunks(X, rows, self.dict_key_x):
            Js, f = self.backend.jacobians(chunk, enable_backprop=enable_backprop)
            yield (Js, f) if enable_backprop else (Js.detach(), f.detach())

    def _validation_nll(self, loader: DataLoader) -> Tensor:
        """Mean predictive NLL per data point of ``loader`` (laplace-torch's validation score).

        Scored with the likelihood of the fit (pair probabilities for reward modelling): the
        noisy Gaussian for regression, the probit approximation for class probabilities. A
        non-finite score is a result (grid search skips the candidate), not an error.

        Raises:
            ValueError: If ``loader`` yields no batch.
        """
        likelihood, total, count = self._likelihood_model.fit_likelihood, 0.0, 0
        with torch.no_grad():
            for X, y in self._batches(loader, desc="validation"):
                f_mu, f_var = self.predictive_moments(X)
                y = self._fit_targets(y, f_mu.shape)
                total = total + likelihood.predictive_nll(f_mu, f_var, y, self.sigma_noise)
                count += len(y)
        if count == 0:
            raise ValueError("val_loader yielded no batches.")
        return torch.as_tensor(total / count, dtype=self._dtype, device=self._device)

    def _record_validation(
        self, val_loader: DataLoader | None, val_steps: int | None, step: int, last: bool = False
    ) -> None:
        """Append the validation NLL to ``fit_history_`` after ``step`` steps of a fit.

        Recorded when ``val_steps`` divides ``step``; at the ``last`` step unless it just was.
        """
        if val_loader is None:
            return
        on_schedule = bool(val_steps) and step % val_steps == 0
        if on_schedule != last:
            self._fitted = True
            self.fit_history_["val_nll"].append(float(self._validation_nll(val_loader)))

    def _checked_inputs(self, x: Inputs, what: str) -> Inputs:
        self._check_fitted(what)
        return prepare_inputs(x, self.dict_key_x, self._device, what)

    def predictive_moments(self, x: Inputs, *, joint: bool = False) -> tuple[Tensor, Tensor]:
        """Latent GP posterior moments at ``x``, without observation noise.

        Args:
            x: Test inputs (B, ...) or a dict-like batch.
            joint: Keep the covariance between test points.

        Returns:
            Means (B, C) and covariances (B, C, C); with ``joint=True`` means (B·C,) and the
            covariance (B·C, B·C).

        Raises:
            RuntimeError: Before ``fit``.
            ValueError: For an empty batch.
        """
        x = self._checked_inputs(x, "predictive_moments")
        n_points = batch_size_of(x, self.dict_key_x)
        check_fits_in_memory(
            self._prediction_bytes(n_points, joint),
            self._device,
            f"a GP prediction{' (joint)' if joint else ''} of {n_points:,} test points with "
            f"C={self.n_outputs:,} outputs ({type(self).__name__} over P={self.n_params:,} "
            "parameters)",
            "predict fewer test points at once, or use a smaller subset or fewer inducing points.",
        )
        return self._gp.moments(x, joint, self.enable_backprop)

    # ------------------------------------------------------------------------------ memory
    def _check_fit_memory(self, batch_size: int = 1) -> None:
        """Refuse, before any Jacobian, a fit whose estimate (``_fit_bytes``) exceeds the memory.

        Args:
            batch_size: Points per training batch, for a fit that works a batch at a time.

        Raises:
            TooLargeError: (a ``ValueError`` and a ``RuntimeError``) naming the estimate.
        """
        check_fits_in_memory(
            self._fit_bytes(batch_size),
            self._device,
            f"a fit of {type(self).__name__} (C={self.n_outputs:,} outputs, "
            f"P={self.n_params:,} parameters in {self._dtype})",
            "use a smaller subset or fewer inducing points, or a last-layer approximation.",
        )

    def _fit_bytes(self, batch_size: int) -> int:
        """Bytes a fit holds at its peak, from the settings and shapes alone (a subclass's).

        ``batch_size``: points per training batch (see ``_check_fit_memory``).
        """
        raise NotImplementedError(f"{type(self).__name__} gives no memory estimate of its fit.")

    def _prediction_bytes(self, n_points: int, joint: bool) -> int:
        """Bytes of a prediction of ``n_points`` test points, the fitted state included.

        A subclass's, from shapes alone; ``joint``: the covariance between the points.
        """
        raise NotImplementedError(f"{type(self).__name__} gives no memory estimate.")

    def _jacobian_chunk_bytes(self, n_points: int) -> int:
        """Bytes of the Jacobians ``(b, C, P)`` of ``n_points`` points, at most one chunk."""
        itemsize = self.mean.element_size()
        return min(n_points * self.n_outputs * self.n_params * itemsize, JACOBIAN_CHUNK_BYTES)

    def _moment_bytes(self, n_points: int, joint: bool) -> int:
        """Bytes of the predicted means and covariances (B, C, C), or (B·C, B·C) joint."""
        rows = n_points * self.n_outputs
        return (
            rows + (rows * rows if joint else rows * self.n_outputs)
        ) * self.mean.element_size()

    def __call__(
        self,
        x: Inputs,
        pred_type: PredType | str = PredType.GP,
        joint: bool = False,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        fitting: bool = False,
        **model_kwargs: object,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """GP posterior predictive at ``x``.

        Args:
            x: Test inputs (B, ...) or a dict-like batch.
            pred_type: Only ``"gp"`` (the function-space posterior).
            joint: Regression: return ``(f_mu (B·C,), f_cov (B·C, B·C))``.
            link_approx: Classification link: ``"probit"``, ``"bridge"``, ``"bridge_norm"`` or
                ``"mc"``.
            n_samples: Samples for ``"mc"``.
            diagonal_output: Regression: return variances (B, C) instead of (B, C, C).
            generator: Random number generator for ``"mc"``.
            fitting: Reward modelling: predict as during fitting (pair probabilities).
            **model_kwargs: Accepted for interface compatibility; not passed to the model.

        Returns:
            Classification: probabilities (B, C). Regression: ``(f_mu, f_var)``.

        Raises:
            ValueError: For a ``pred_type`` other than ``"gp"``, an unknown link, an empty batch.
            RuntimeError: Before ``fit``.
        """
        _, link_approx, likelihood = self._parse_prediction(
            pred_type, link_approx, n_samples, generator, joint, fitting
        )
        x = self._checked_inputs(x, "prediction")
        if joint:  # the joint moments as they are
            return self._glm_predictive_distribution(x, joint=True)
        diagonal = likelihood.diagonal_moments(diagonal_output)
        f_mu, f_var = self._glm_predictive_distribution(x, diagonal_output=diagonal)
        return likelihood.predict(f_mu, f_var, link_approx, n_samples, generator, diagonal_output)

    def predictive(
        self,
        x: Inputs,
        pred_type: PredType | str = PredType.GP,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Alias of ``__call__`` with laplace-torch's positional order."""
        return self(x, pred_type=pred_type, link_approx=link_approx, n_samples=n_samples)

    def _glm_predictive_distribution(
        self, X: Inputs, joint: bool = False, diagonal_output: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Latent moments at ``X`` (laplace-torch's hook, with its signature).

        Returns:
            Means (B, C) and covariances (B, C, C), variances (B, C) with
            ``diagonal_output``; with ``joint`` means (B·C,) and the covariance (B·C, B·C).
        """
        f_mu, f_var = self.predictive_moments(X, joint=joint)
        if diagonal_output and not joint:
            f_var = f_var.diagonal(dim1=-2, dim2=-1)
        return f_mu, f_var

    def functional_samples(
        self,
        x: Inputs,
        pred_type: PredType | str = PredType.GLM,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        joint: bool = False,
    ) -> Tensor:
        """Draws of the latent outputs from the GP posterior, shape (S, B, C).

        Args:
            x: Test inputs (B, ...) or a dict-like batch.
            pred_type: Accepted for compatibility; every value samples the GP posterior.
            n_samples: Number of draws S (positive).
            diagonal_output: Drop the covariance between outputs before sampling.
            generator: Random number generator.
            joint: Keep the covariance between test points.

        Raises:
            ValueError: For a non-positive ``n_samples`` or an unknown ``pred_type``.
        """
        PredType(pred_type)
        check_positive_int(n_samples, "n_samples")
        check_generator(generator)
        x = self._checked_inputs(x, "functional_samples")
        f_mu, f_var = self._glm_predictive_distribution(x, joint, diagonal_output)
        if not joint:
            return gaussian_output_samples(f_mu, f_var, n_samples, generator)
        B = batch_size_of(x, self.dict_key_x)
        C = f_mu.numel() // B
        if diagonal_output:
            same_output = torch.arange(B * C, device=f_mu.device) % C
            f_var = f_var * (same_output[:, None] == same_output[None, :])
        samples = gaussian_output_samples(f_mu[None], f_var[None], n_samples, generator)
        return samples.reshape(n_samples, B, C)

    def predictive_samples(
        self,
        x: Inputs,
        pred_type: PredType | str = PredType.GLM,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        fitting: bool = False,
        joint: bool = False,
    ) -> Tensor:
        """Samples of the predictive: probabilities for classification, outputs otherwise.

        Returns:
            Samples, shape (S, B, C).
        """
        f = self.functional_samples(x, pred_type, n_samples, diagonal_output, generator, joint)
        model = self._likelihood_model
        likelihood = model.fit_likelihood if fitting else model.predictive_likelihood
        return likelihood.predictive_sample(f, generator)
