r"""VaLLA: variational linearised Laplace with inducing points (Ortega et al., 2023).

Internal module; the public paths are :mod:`laplace.baselaplace` and :mod:`laplace`.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from laplace.base import BaseLaplace, arguments_for
from laplace.curvature import CurvatureInterface
from laplace.data import Inputs, batch_size_of, check_outputs, dataset_size
from laplace.errors import UnsupportedError, check_finite_result, check_positive_int
from laplace.functional.base import BaseFunctionalLaplace
from laplace.functional.inducing import (
    as_inducing,
    check_inducing_state,
    choose_inducing,
    detached_inputs,
    inducing_count,
)
from laplace.functional.scoring import check_state, jacobian_chunks, positive_int, validation_nll
from laplace.functional.valla_objective import check_alpha, negative_objective
from laplace.priors import as_scalar_prior_precision
from laplace.utils.enums import Likelihood, parse_enum
from laplace.utils.functional_utils import preserve_model_gradients, to_device

__all__ = ["VaLLA"]

STRATEGIES = ("random", "kmeans")


class VaLLA(BaseFunctionalLaplace):
    r"""Linearised Laplace whose posterior is fitted variationally through ``M`` inducing points.

    With the Jacobians ``J_Z`` (M, P) of one output per inducing input ``z_m``, a lower
    triangular ``L`` (M, M) and the isotropic prior ``N(θ*, δ⁻¹I)``, the posterior over the
    weights of the linearised network is

    .. math::
        q(θ) = \mathcal{N}(θ^*, Σ_q), \quad Σ_q = (δ I + J_Z^\top L L^\top J_Z)^{-1}, \qquad
        f_* \sim \mathcal{N}\big(f(x_*; θ^*),\; J_* Σ_q J_*^\top\big).

    ``fit`` minimises, by Adam on minibatches, the alpha-energy objective
    ``−(N/B) Σ_b ℓ_α(y_b)/T + KL(q ‖ p)`` over ``L``, ``log δ``, ``log σ²`` (regression) and
    floating-point inducing inputs, where ``ℓ_α(y) = (1/α) log E_q[p(y|f)^α]`` for
    ``0 < α ≤ 1`` and ``ℓ_0(y) = E_q[log p(y|f)]`` (``α = 0``: the negative ELBO). Gaussian
    regression has the closed form

    .. math::
        \ell_α(y) = -\tfrac12 \log(2πσ^2) - \frac{(y - m)^2}{2(σ^2 + α v)}
            - \frac{1}{2α}\log\Big(1 + \frac{α v}{σ^2}\Big)
            \xrightarrow{α \to 0} -\tfrac12 \log(2πσ^2) - \frac{(y - m)^2 + v}{2σ^2},

    with ``m, v`` the latent mean and variance. Classification estimates ``ℓ_α`` by MC over the
    softmax (``mc_softmax_samples`` draws from :attr:`generator`), or with the α-independent
    probit approximation when that is 0; the KL and details are in
    :mod:`laplace.functional.valla_objective`. Covariances use a float64 QR factor of
    ``[Aᵀ; I]``, ``A = Lᵀ J_Z / √δ`` (never the P×P matrix).

    Reward modelling fits as classification on pairs (B, 2, ...) → logits (B, 2), with inducing
    inputs from the pairs' items (output 0), and predicts as regression on items (B, ...).

    Args:
        model: The trained network (kept fixed).
        likelihood: ``"classification"``, ``"regression"`` or ``"reward_modeling"``.
        inducing_locations: Inputs (M, ...) or a mapping, or ``"random"`` / ``"kmeans"`` to pick
            ``num_inducing`` training inputs at :meth:`fit` (k-means runs in torch; its centres
            are snapped to the nearest training inputs; no scikit-learn or SciPy needed).
        num_inducing: M; required with a strategy, must match explicit locations.
        inducing_classes: Output used at each inducing input (M,); 0 when None (strategies use
            the training labels for classification).
        sigma_noise: Initial σ (regression); learnt by :meth:`fit`.
        prior_precision: Initial scalar δ; learnt by :meth:`fit`.
        prior_mean: Must be 0.
        temperature: Likelihood temperature T.
        enable_backprop: Keep predictives differentiable w.r.t. the inputs.
        dict_key_x: Key of the inputs in dict-like batches.
        dict_key_y: Key of the targets in dict-like batches.
        backend: Backend whose ``jacobians`` are used; ``CurvlinopsGGN`` when None.
        backend_kwargs: Keyword arguments of the backend.
        seed: Seed of the inducing-point choice and of :attr:`generator`.
        alpha: ``α ∈ [0, 1]`` of the alpha-energy; 0 is the ELBO.
        mc_softmax_samples: Monte Carlo draws of the classification term; 0 uses the probit
            approximation (then ``alpha`` must be 1 for classification and reward modelling).

    Attributes:
        inducing_locations: The strategy until :meth:`fit` picks the points, then the inputs.
        fit_history_: ``objective`` (the minimised objective per step) and ``val_nll``.
        generator: Seeded ``torch.Generator`` on the model's device for the MC draws of fit.

    Raises:
        ValueError: For an unknown strategy, a bad ``num_inducing``, ``inducing_classes`` of the
            wrong shape, a non-scalar prior precision, a non-zero prior mean, a bad ``alpha`` or
            ``mc_softmax_samples`` (``alpha != 1`` needs MC samples for classification).
    """

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
        backend_kwargs: dict[str, Any] | None = None,
        seed: int = 0,
        alpha: float = 1.0,
        mc_softmax_samples: int = 0,
    ) -> None:
        check_alpha(alpha, mc_softmax_samples, parse_enum(Likelihood, likelihood, "likelihood"))
        self.log_noise_variance: nn.Parameter | None = None
        super().__init__(**arguments_for(BaseLaplace.__init__, locals()))
        if bool((self.prior_mean != 0).any()):
            raise ValueError("VaLLA needs prior_mean=0.")
        self.seed, self.alpha, self.mc_softmax_samples = seed, alpha, mc_softmax_samples
        self.generator = torch.Generator(device=self._device).manual_seed(seed)
        if isinstance(inducing_locations, str):
            if inducing_locations not in STRATEGIES:
                raise ValueError(
                    f"inducing_locations must be inputs or one of {list(STRATEGIES)}, got "
                    f"{inducing_locations!r}."
                )
            check_positive_int(num_inducing, "num_inducing")
            self._strategy = self.inducing_locations = inducing_locations
            self.num_inducing = num_inducing
        else:
            self._strategy = None
            self.inducing_locations = as_inducing(inducing_locations, self._device, self._dtype)
            count = inducing_count(self.inducing_locations, dict_key_x)
            if num_inducing is not None and num_inducing != count:
                raise ValueError(f"num_inducing={num_inducing} but {count} inducing inputs given.")
            self.num_inducing = count
        classes = torch.zeros(self.num_inducing, dtype=torch.long)
        if inducing_classes is not None:
            classes = torch.as_tensor(inducing_classes, dtype=torch.long)
        if classes.shape != (self.num_inducing,):
            raise ValueError(f"inducing_classes must have shape ({self.num_inducing},).")
        self.inducing_classes = classes.to(self._device)
        initial = None if self._strategy else self.inducing_locations
        self._initial = (initial, self.inducing_classes.clone())
        self._init_factor()
        self.fit_history_: dict[str, list[float]] = {"objective": [], "val_nll": []}

    @property
    def prior_precision(self) -> Tensor:
        """Scalar prior precision ``δ = exp(log_prior_precision)``, shape (1,)."""
        return self.log_prior_precision.detach().exp()

    @prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        log = as_scalar_prior_precision(value, "VaLLA", self._device, self._dtype).log()
        self.log_prior_precision = nn.Parameter(log.detach().clone())

    @property
    def sigma_noise(self) -> Tensor:
        """Observation noise σ (learnt for regression), shape (1,)."""
        if self.log_noise_variance is None:
            return self._sigma_noise
        return (0.5 * self.log_noise_variance.detach()).exp()

    @sigma_noise.setter
    def sigma_noise(self, value: float | Tensor) -> None:
        BaseFunctionalLaplace.sigma_noise.fset(self, value)
        if self.likelihood == Likelihood.REGRESSION:
            self.log_noise_variance = nn.Parameter(2 * self._sigma_noise.detach().log().clone())

    def _init_factor(self) -> None:
        rows, cols = torch.tril_indices(self.num_inducing, self.num_inducing)
        self.L = nn.Parameter((rows == cols).to(self._dtype).to(self._device))

    def _factor_matrix(self) -> Tensor:
        M = self.num_inducing
        rows, cols = torch.tril_indices(M, M, device=self._device)
        return torch.zeros(M, M, dtype=self._dtype, device=self._device).index_put(
            (rows, cols), self.L
        )

    # --------------------------------------------------------------------------- posterior
    def _inducing_factor(self) -> tuple[Tensor, Tensor, Tensor]:
        """``A = Lᵀ J_Z/√δ`` (M, P) and the QR factors of ``[Aᵀ; I]`` (float64)."""
        trainable = isinstance(self.inducing_locations, nn.Parameter)
        Js = torch.cat([J for J, _ in jacobian_chunks(self, self.inducing_locations, trainable)])
        JZ = Js[torch.arange(self.num_inducing), self.inducing_classes].to(torch.float64)
        scale = self.log_prior_precision.to(torch.float64).mul(0.5).exp()
        A = self._factor_matrix().to(torch.float64).T @ JZ / scale
        eye = torch.eye(self.num_inducing, dtype=torch.float64, device=self._device)
        Q, R = torch.linalg.qr(torch.cat([A.T, eye]), mode="reduced")
        return A, Q, R

    def _covariance(self, Js: Tensor, Q: Tensor, joint: bool) -> Tensor:
        """``J (δI + AᵀA·δ)⁻¹ Jᵀ`` as ``‖(I − QQᵀ)[J/√δ, 0]‖²`` for Js (B, C, P)."""
        B, C, P = Js.shape
        scale = self.log_prior_precision.to(torch.float64).mul(0.5).exp()
        padded = nn.functional.pad(Js.to(torch.float64).reshape(B * C, P) / scale, (0, Q.shape[1]))
        roots = padded - (padded @ Q) @ Q.T
        if joint:
            cov = roots @ roots.T
        else:
            roots = roots.reshape(B, C, -1)
            cov = roots @ roots.transpose(1, 2)
        return ((cov + cov.transpose(-1, -2)) / 2).to(Js.dtype)

    def _moments(self, X: Inputs, joint: bool, differentiable: bool) -> tuple[Tensor, ...]:
        _, Q, R = factors = self._inducing_factor()
        Js, f = zip(*jacobian_chunks(self, X, differentiable))
        Js, f = torch.cat(Js), torch.cat(f)
        return f, self._covariance(Js, Q, joint), factors[0], R

    def _latent_moments(self, X: Inputs, joint: bool) -> tuple[Tensor, Tensor]:
        f, cov, _, _ = self._moments(X, joint, self.enable_backprop)
        if not self.enable_backprop:
            f, cov = f.detach(), cov.detach()
        return (f.reshape(-1) if joint else f), cov

    def functional_variance(self, Js: Tensor) -> Tensor:
        """Posterior output covariances from Jacobians: (B, C, P) → (B, C, C)."""
        self._check_fitted("functional_variance")
        return self._covariance(Js, self._inducing_factor()[1], joint=False).detach()

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """Joint posterior covariance from Jacobians: (B, C, P) → (B·C, B·C)."""
        self._check_fitted("functional_covariance")
        return self._covariance(Js, self._inducing_factor()[1], joint=True).detach()

    # ---------------------------------------------------------------------------------- fit
    def _objective(self, X: Inputs, y: Tensor) -> Tensor:
        """The minimised objective on one minibatch (see :func:`negative_objective`)."""
        return negative_objective(self, X, y)

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
        if not positive_int(iterations) or not (math.isfinite(lr) and lr > 0):
            raise ValueError("iterations must be a positive integer and lr positive and finite.")
        if val_steps is not None and not positive_int(val_steps):
            raise ValueError(f"val_steps must be a positive integer, got {val_steps!r}.")
        self.model.eval()
        self.n_data = dataset_size(train_loader)
        X0, y0 = next(self._batches(train_loader))
        with torch.no_grad():
            f0 = self.model(X0)
        output_shape = check_outputs(f0, batch_size_of(X0, self.dict_key_x)).shape
        self._likelihood_model.check_targets(y0, output_shape)
        self.n_outputs = output_shape[-1]
        self.mean = self._subset.vector().detach()
        if override or not self._fitted:
            Z, classes = self._initial[0], self._initial[1].clone()
            if self._strategy is not None:
                Z, classes = choose_inducing(self, train_loader, self._strategy)
            self.inducing_locations = as_inducing(Z, self._device, self._dtype)
            self.inducing_classes = classes
            self._init_factor()
            self.fit_history_ = {"objective": [], "val_nll": []}
        if bool(
            (self.inducing_classes >= self.n_outputs).any() | (self.inducing_classes < 0).any()
        ):
            raise ValueError(f"inducing_classes must lie in [0, {self.n_outputs}).")
        params = (
            self.L,
            self.log_prior_precision,
            self.log_noise_variance,
            self.inducing_locations,
        )
        optimizer = torch.optim.Adam([p for p in params if isinstance(p, nn.Parameter)], lr=lr)
        self._fitted = False
        batches = iter(self._batches(train_loader, progress_bar, "VaLLA"))
        for step in range(1, iterations + 1):
            try:
                X, y = next(batches)
            except StopIteration:
                batches = iter(self._batches(train_loader))
                X, y = next(batches)
            self._likelihood_model.check_targets(y, output_shape)
            optimizer.zero_grad()
            objective = check_finite_result(self._objective(X, y), "VaLLA objective of a batch")
            objective.backward()
            optimizer.step()
            self.fit_history_["objective"].append(float(objective.detach()))
            if val_loader is not None and val_steps and step % val_steps == 0:
                self._fitted = True
                self.fit_history_["val_nll"].append(float(validation_nll(self, val_loader)))
        self._fitted = True
        if val_loader is not None and (not val_steps or iterations % val_steps):
            self.fit_history_["val_nll"].append(float(validation_nll(self, val_loader)))

    def optimize_prior_precision(self, *args: Any, **kwargs: Any) -> None:
        """Not available: :meth:`fit` learns the prior precision (as in laplace-torch)."""
        raise NotImplementedError("VaLLA learns the prior precision in fit().")

    def log_marginal_likelihood(self, *args: Any, **kwargs: Any) -> Tensor:
        """Not defined: the objective is in ``fit_history_["objective"]`` (as in laplace-torch)."""
        raise NotImplementedError("VaLLA has no Laplace marginal likelihood; see fit_history_.")

    def state_dict(self) -> dict[str, Any]:
        """The fitted posterior as tensors and plain values (``weights_only=True`` loadable)."""
        self._check_fitted("state_dict")
        noise = self.log_noise_variance
        return {
            "cls_name": type(self).__name__,
            "likelihood": self.likelihood.value,
            "mean": self.mean.detach().clone(),
            "num_inducing": self.num_inducing,
            "inducing_locations": detached_inputs(self.inducing_locations),
            "inducing_classes": self.inducing_classes.detach().clone(),
            "inducing_strategy": self._strategy,
            "initial_inducing_locations": detached_inputs(self._initial[0]),
            "initial_inducing_classes": self._initial[1].detach().clone(),
            "L": self.L.detach().clone(),
            "log_prior_precision": self.log_prior_precision.detach().clone(),
            "log_noise_variance": None if noise is None else noise.detach().clone(),
            "temperature": self.temperature,
            "alpha": self.alpha,
            "mc_softmax_samples": self.mc_softmax_samples,
            "seed": self.seed,
            "generator_state": self.generator.get_state().clone(),
            "n_data": self.n_data,
            "n_outputs": self.n_outputs,
            "fit_history": {k: list(v) for k, v in self.fit_history_.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` for the same model (any device).

        Raises:
            ValueError: For another class or likelihood, other model weights, or inconsistent
                shapes (``L``, inducing inputs and outputs, noise).
        """
        check_state(self, state_dict)
        check_inducing_state(state_dict, self.likelihood, self.dict_key_x)
        M, Z = state_dict["num_inducing"], state_dict["inducing_locations"]
        noise = state_dict["log_noise_variance"]
        check_alpha(state_dict["alpha"], state_dict["mc_softmax_samples"], self.likelihood)
        self.alpha, self.mc_softmax_samples = state_dict["alpha"], state_dict["mc_softmax_samples"]
        self.seed, self.num_inducing = state_dict["seed"], M
        self.generator.set_state(state_dict["generator_state"].cpu())
        self.mean = state_dict["mean"].to(self._device, self._dtype)
        self._strategy = state_dict["inducing_strategy"]
        self.inducing_locations = as_inducing(Z, self._device, self._dtype)
        self.inducing_classes = state_dict["inducing_classes"].to(self._device)
        initial = state_dict["initial_inducing_locations"]
        initial = None if initial is None else to_device(initial, self._device, self._dtype)
        self._initial = (initial, state_dict["initial_inducing_classes"].to(self._device))
        self.L = nn.Parameter(state_dict["L"].to(self._device, self._dtype).clone())
        log_delta = state_dict["log_prior_precision"].to(self._device, self._dtype)
        self.log_prior_precision = nn.Parameter(log_delta.reshape(1).clone())
        if noise is not None:
            self.log_noise_variance = nn.Parameter(noise.to(self._device, self._dtype).clone())
        self.temperature = state_dict["temperature"]
        self.n_data, self.n_outputs = state_dict["n_data"], state_dict["n_outputs"]
        self.fit_history_ = {k: list(v) for k, v in state_dict["fit_history"].items()}
        self._fitted = True

    @property
    def log_likelihood(self) -> Tensor:
        """Not tracked by VaLLA (as in laplace-torch)."""
        raise UnsupportedError("VaLLA does not track the training log-likelihood.")
