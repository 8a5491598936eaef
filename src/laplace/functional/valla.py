r"""VaLLA: variational linearised Laplace with inducing points (Ortega et al., 2023).

Internal module; the public paths are ``laplace.baselaplace`` and ``laplace``.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from functools import partial
from typing import cast

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from laplace.core.base_laplace import BaseLaplace, arguments_for
from laplace.core.passes.data_loop import DataLoop, Gather
from laplace.core.priors import as_scalar_prior_precision
from laplace.core.serialization import StateDict
from laplace.core.transaction import preserve_model_gradients
from laplace.curvature import CurvatureInterface
from laplace.functional.base_functional import BaseFunctionalLaplace, HistoryState, check_val_steps
from laplace.functional.inducing import (
    INDUCING_STATE,
    as_inducing,
    detached_inputs,
    inducing_from_data,
    inducing_setup,
)
from laplace.functional.valla_objective import InducingPosterior, check_alpha, inducing_kl
from laplace.likelihoods import make_likelihood
from laplace.utils.data import (
    Inputs,
    batch_size_of,
    dataset_size,
    to_device,
    training_indices,
)
from laplace.utils.enums import FunctionalApproximation, Likelihood
from laplace.utils.errors import check_finite_result, check_positive_float, check_positive_int

__all__ = ["VaLLA"]


class VaLLAState(HistoryState["VaLLA"]):
    """The state of VaLLA: its named attributes, fit history, inducing points and generator."""

    def value_keys(self, la: VaLLA) -> tuple[str, ...]:
        """The history state's entries, the inducing points' and the generator's."""
        return (*super().value_keys(la), *INDUCING_STATE, "generator_state")

    def values(self, la: VaLLA) -> StateDict:
        """The history state, the inducing points (current and initial) and the generator."""
        return {
            **super().values(la),
            "inducing_locations": detached_inputs(la._inducing_inputs),
            "inducing_classes": la.inducing_classes.detach().clone(),
            "inducing_strategy": la._strategy,
            "initial_inducing_locations": detached_inputs(la._initial[0]),
            "initial_inducing_classes": la._initial[1].detach().clone(),
            "generator_state": la.generator.get_state().clone(),
        }

    def check(self, la: VaLLA, state_dict: StateDict) -> None:
        """Refuse inducing points or an energy (alpha) the approximation cannot take.

        ``L`` must have ``M(M+1)/2`` entries, the inducing inputs and classes ``M`` rows, the
        prior precision one entry, and the noise must be there iff the likelihood has one.
        """
        super().check(la, state_dict)
        M, log_noise = state_dict["num_inducing"], state_dict["log_noise_variance"]
        if (
            not isinstance(M, int)
            or state_dict["L"].shape != (M * (M + 1) // 2,)
            or state_dict["inducing_classes"].shape != (M,)
            or batch_size_of(state_dict["inducing_locations"], la.dict_key_x) != M
            or (log_noise is not None) != la._likelihood_model.has_noise_hyperparameter
            or state_dict["log_prior_precision"].numel() != 1
        ):
            raise ValueError(
                f"inconsistent VaLLA state: with num_inducing={M!r}, L needs M(M+1)/2 entries, "
                "the inducing inputs and classes M rows, the prior precision one entry, and a "
                "noise only for regression."
            )
        check_alpha(state_dict["alpha"], state_dict["mc_softmax_samples"], la._likelihood_model)

    def load(self, la: VaLLA, state_dict: StateDict) -> None:
        """Assign the history state, the inducing points and the generator's state."""
        super().load(la, state_dict)
        la.generator.set_state(state_dict["generator_state"].cpu())
        la.inducing_locations = as_inducing(
            state_dict["inducing_locations"], la._device, la._dtype
        )
        la.inducing_classes = state_dict["inducing_classes"].to(la._device)
        la._strategy = state_dict["inducing_strategy"]
        initial = state_dict["initial_inducing_locations"]
        la._initial = (
            None if initial is None else to_device(initial, la._device, la._dtype),
            state_dict["initial_inducing_classes"].to(la._device),
        )


#: The counts of VaLLA's state (positive integers).
_COUNTS = ("num_inducing", "n_data", "n_outputs")


class VaLLA(BaseFunctionalLaplace):
    r"""Linearised Laplace whose posterior is fitted variationally through ``M`` inducing points.

    ``q(θ) = N(θ*, (δI + J_Zᵀ L Lᵀ J_Z)⁻¹)`` with the Jacobians ``J_Z`` (M, P) of one output per
    inducing input; ``fit`` minimises the alpha-energy by Adam over ``L``, ``log δ``, ``log σ²``
    (regression) and floating-point inducing inputs; ``_objective`` is computed from the moments
    and factors of ``_latent_distribution``, a step a subclass can override. Reward modelling
    fits on pairs and predicts rewards of items. See ``docs/function_space.md``.

    Arguments not listed are those of [`BaseLaplace`][laplace.core.base_laplace.BaseLaplace].

    Args:
        model: The trained network (kept fixed).
        likelihood: ``"classification"``, ``"regression"`` or ``"reward_modeling"``.
        inducing_locations: Inputs (M, ...) or a mapping, or ``"random"`` / ``"kmeans"`` to pick
            ``num_inducing`` training inputs at ``fit``.
        num_inducing: M; required with a strategy, must match explicit locations.
        inducing_classes: Output used at each inducing input (M,); 0 when None (strategies use
            the training labels for classification).
        sigma_noise: Initial σ (regression); learnt by ``fit``.
        prior_precision: Initial scalar δ; learnt by ``fit``.
        prior_mean: Must be 0.
        backend: Backend whose ``jacobians`` are used; ``CurvlinopsGGN`` when None.
        seed: Seed of the inducing-point choice and of ``generator``.
        alpha: ``α ∈ [0, 1]`` of the alpha-energy; 0 is the ELBO.
        mc_softmax_samples: Monte Carlo draws of the classification term; 0 uses the probit
            approximation (then ``alpha`` must be 1 for classification and reward modelling).

    Attributes:
        inducing_locations: The strategy until ``fit`` picks the points, then the inputs.
        fit_history_: ``objective`` (the minimised objective per step) and ``val_nll``.
        generator: Seeded ``torch.Generator`` on the model's device for the MC draws of fit.

    Raises:
        ValueError: For an unknown strategy, a bad ``num_inducing``, ``inducing_classes`` of the
            wrong shape, a non-scalar prior precision, a non-zero prior mean, a bad ``alpha`` or
            ``mc_softmax_samples`` (``alpha != 1`` needs MC samples for classification).
    """

    _function_space = FunctionalApproximation.VARIATIONAL
    _column_targets = True

    _state_format = VaLLAState(
        plain=("temperature", "alpha", "mc_softmax_samples", "seed", *_COUNTS),
        parameters=("L", "log_prior_precision", "log_noise_variance"),
        counts=_COUNTS,
    )
    _centred_prior = "the variational GP prior is centred"

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        inducing_locations: Tensor | MutableMapping | str,
        num_inducing: int | None = None,
        inducing_classes: Tensor | None = None,
        sigma_noise: float | Tensor = 1.0,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: type[CurvatureInterface] | None = None,
        backend_kwargs: Mapping[str, object] | None = None,
        seed: int = 0,
        alpha: float = 1.0,
        mc_softmax_samples: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_alpha(alpha, mc_softmax_samples, make_likelihood(likelihood))
        self.log_noise_variance: nn.Parameter | None = None
        super().__init__(**arguments_for(BaseLaplace.__init__, locals()))
        self.seed, self.alpha, self.mc_softmax_samples = seed, alpha, mc_softmax_samples
        self.generator = torch.Generator(device=self._device).manual_seed(seed)
        setup = (inducing_locations, num_inducing, inducing_classes, self._device, self._dtype)
        self._strategy, self.inducing_locations, self.num_inducing, self.inducing_classes = (
            inducing_setup(*setup, dict_key_x)
        )
        initial = None if self._strategy else self._inducing_inputs
        self._initial = (initial, self.inducing_classes.clone())
        self._init_factor()
        self.fit_history_: dict[str, list[object]] = {"objective": [], "val_nll": []}
        self._gp = InducingPosterior(self._jacobian_chunks, self._variational)

    @property
    def _inducing_inputs(self) -> Inputs:
        """The inducing inputs: given, or chosen by ``fit`` where a strategy was given."""
        return cast(Inputs, self.inducing_locations)  # the strategy's name only before fit

    @property
    def prior_precision(self) -> Tensor:
        """Scalar prior precision ``δ = exp(log_prior_precision)``, shape (1,)."""
        return self.log_prior_precision.detach().exp()

    @prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        log = as_scalar_prior_precision(value, type(self).__name__, self._device, self._dtype)
        self.log_prior_precision = nn.Parameter(log.log().detach().clone())

    @property
    def sigma_noise(self) -> Tensor:
        """Observation noise σ (learnt for regression), shape (1,)."""
        if self.log_noise_variance is None:
            return self._sigma_noise
        return (0.5 * self.log_noise_variance.detach()).exp()

    @sigma_noise.setter
    def sigma_noise(self, value: float | Tensor) -> None:
        BaseLaplace.sigma_noise.fset(self, value)
        if self._likelihood_model.has_noise_hyperparameter:
            self.log_noise_variance = nn.Parameter(2 * self._sigma_noise.detach().log().clone())

    def _init_factor(self) -> None:
        """``L = I``, stored as the M(M+1)/2 entries of its lower triangle."""
        rows, cols = torch.tril_indices(self.num_inducing, self.num_inducing)
        self.L = nn.Parameter((rows == cols).to(self._dtype).to(self._device))

    def _factor_matrix(self) -> Tensor:
        """``L`` (M, M) from its entries."""
        M = self.num_inducing
        rows, cols = torch.tril_indices(M, M, device=self._device)
        return torch.zeros(M, M, dtype=self._dtype, device=self._device).index_put(
            (rows, cols), self.L
        )

    def _variational(self) -> tuple[Inputs, Tensor, Tensor, Tensor]:
        """The inducing inputs and outputs, ``L`` (M, M) and ``log δ`` of the posterior."""
        Z, classes = self._inducing_inputs, self.inducing_classes
        return Z, classes, self._factor_matrix(), self.log_prior_precision

    # ---------------------------------------------------------------------------------- fit
    def _latent_distribution(
        self, X: Inputs, joint: bool = False
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The latent moments at ``X`` and the factors of the inducing posterior, as ``fit`` uses.

        Differentiable in the variational parameters and the inducing inputs (not detached).

        Returns:
            Outputs (B, C); covariances (B, C, C), or (B·C, B·C) with ``joint``, without
            observation noise; ``A = Lᵀ J_Z/√δ`` (M, P) and the upper triangular ``R`` (M, M)
            of the QR factorisation of ``[Aᵀ; I]`` (float64; ``RᵀR = I + AAᵀ``).
        """
        return self._gp.objective_moments(X, joint)

    def _objective(self, X: Inputs, y: Tensor) -> Tensor:
        """``−(N/B) Σ_b ℓ_α(y_b)/T + KL(q ‖ p)`` on a minibatch.

        Differentiable in the variational parameters, the noise and the inducing inputs (see
        ``laplace.functional.valla_objective``); the moments are ``_latent_distribution``'s.
        """
        f, cov, A, R = self._latent_distribution(X)
        noise = None if self.log_noise_variance is None else self.log_noise_variance.exp()
        log_lik = self._likelihood_model.fit_likelihood.alpha_energy(
            y, f, cov, self.alpha, noise, self.mc_softmax_samples, self.generator
        )
        return -(self.n_data / len(f)) * log_lik / self.temperature + inducing_kl(A, R)

    @preserve_model_gradients
    def fit(
        self,
        train_loader: DataLoader,
        *,
        iterations: int = 100,
        lr: float = 1e-3,
        val_loader: DataLoader | None = None,
        val_steps: int | None = None,
        progress_bar: bool = False,
        override: bool = True,
    ) -> None:
        """Minimise the objective with Adam, one training batch per iteration (cycling the loader).

        The objective's data term is scaled to ``N = n_data``, the number of training points the
        loader's sampler reaches (``laplace.utils.data.training_indices``): a
        ``SubsetRandomSampler``'s indices, the rows a sequential ``drop_last`` loader yields;
        ``len(train_loader.dataset)`` only when every point is reached.

        Args:
            train_loader: Training batches ``(X, y)`` or dict-like.
            iterations: Number of Adam steps.
            lr: Adam learning rate.
            val_loader: Validation data whose predictive NLL is recorded in ``fit_history_``.
            val_steps: Record the validation NLL every ``val_steps`` iterations (else at the end).
            progress_bar: Show a progress bar.
            override: Restart from the initial inducing points and ``L = I``; False continues.

        Raises:
            ValueError: For bad optimisation settings or inducing classes.
        """
        check_positive_int(iterations, "iterations")
        check_positive_float(lr, "lr")
        check_val_steps(val_steps)
        check_alpha(self.alpha, self.mc_softmax_samples, self._likelihood_model)
        dataset_size(train_loader)
        n_data = len(training_indices(train_loader))  # the points the objective sums over
        self.model.eval()
        self.n_data = n_data
        empty = "train_loader is empty: fit needs at least one data point."
        loop = self._data_loop(DataLoop, desc="VaLLA", empty_message=empty)
        output_shape = self._start_fit(*next(loop.cycle(train_loader, 1)))
        self._check_fit_memory(getattr(train_loader, "batch_size", None) or 1)
        if override or not self._fitted:
            self._reset_inducing(train_loader)
        classes = self.inducing_classes
        n_inducing = batch_size_of(self._inducing_inputs, self.dict_key_x)
        if tuple(classes.shape) != (n_inducing,):
            raise ValueError(
                f"inducing_classes must have shape ({n_inducing},) (one class per inducing "
                f"point), got {tuple(classes.shape)}."
            )
        if bool((classes >= self.n_outputs).any() | (classes < 0).any()):
            raise ValueError(f"inducing_classes must lie in [0, {self.n_outputs}).")
        variational = (self.L, self.log_prior_precision, self.log_noise_variance)
        params = [
            p for p in (*variational, self.inducing_locations) if isinstance(p, nn.Parameter)
        ]
        optimizer = torch.optim.Adam(params, lr=lr)
        self._fitted, loop.progress_bar = False, progress_bar
        for step, (X, y) in enumerate(loop.cycle(train_loader, iterations), 1):
            y = self._fit_targets(y, output_shape)
            self._likelihood_model.check_targets(y, output_shape)
            optimizer.zero_grad()
            objective = check_finite_result(self._objective(X, y), "VaLLA objective of a batch")
            objective.backward()
            optimizer.step()
            self.fit_history_["objective"].append(float(objective.detach()))
            self._record_validation(val_loader, val_steps, step)
        self._fitted = True
        self._record_validation(val_loader, val_steps, iterations, last=True)

    def _inducing_bytes(self, n_points: int) -> int:
        """One evaluation of the objective's moments at ``n_points`` points, from shapes alone.

        The inducing points' Jacobians (M, C, P), ``A`` (M, P) and the QR factor (P + M, M)
        in float64; the points' Jacobians (B, C, P), and their padded rows and roots
        (B·C, P + M) in float64.
        """
        M, C, P = self.num_inducing, self.n_outputs, self.n_params
        itemsize = self.mean.element_size()
        inducing = M * C * P * itemsize + (M * P + (P + M) * M) * 8
        return inducing + n_points * C * (P * itemsize + 2 * (P + M) * 8)

    def _fit_bytes(self, batch_size: int) -> int:
        """One step of the objective on a batch (``_inducing_bytes``) and its gradients."""
        return 2 * self._inducing_bytes(batch_size)

    def _prediction_bytes(self, n_points: int, joint: bool) -> int:
        """The moments at ``n_points`` points (``_inducing_bytes``, all at once) and their size."""
        return self._inducing_bytes(n_points) + self._moment_bytes(n_points, joint)

    def _reset_inducing(self, train_loader: DataLoader) -> None:
        """Start from the initial (or newly chosen) inducing points, ``L = I`` and no history."""
        Z, classes = self._initial[0], self._initial[1].clone()
        if self._strategy is not None:
            gather = partial(self._data_loop, Gather)
            Z, classes = inducing_from_data(
                train_loader, self._strategy, self.num_inducing, self.seed,
                self._likelihood_model, self.dict_key_x, gather,
            )  # fmt: skip
        self.inducing_locations = as_inducing(Z, self._device, self._dtype)
        self.inducing_classes = classes
        self._init_factor()
        self.fit_history_ = {"objective": [], "val_nll": []}

    def optimize_prior_precision(self, *args: object, **kwargs: object) -> None:
        """Not available: ``fit`` learns the prior precision (as in laplace-torch)."""
        raise NotImplementedError("VaLLA learns the prior precision in fit().")
