"""Likelihood objects: loss, output-space curvature and predictive link for each observation model.

The rest of the library asks a likelihood object instead of branching on its name: whether it
has an observation noise σ, its torch loss module, the Hessian structures it can be fitted with.
Losses follow laplace-torch's conventions: the summed loss, ``½ Σ‖y − f‖²`` for regression
(σ-free, so the output Hessian is the identity) and ``Σ CE`` for classification.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from typing_extensions import override

from laplace.errors import DataError, LabelError
from laplace.predictive import probit_logits
from laplace.utils.enums import HessianStructure, Likelihood, parse_enum
from laplace.utils.linalg import softmax_hessian_factor

__all__ = [
    "Categorical",
    "GaussianRegression",
    "LikelihoodModel",
    "RewardModeling",
    "make_likelihood",
]


class LikelihoodModel(ABC):
    """An observation model ``p(y | f)`` over network outputs ``f`` of shape (B, C)."""

    kind: Likelihood
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
                f"likelihood={self.kind.value!r} supports hessian_structure in "
                f"{[h.value for h in self.hessian_structures]}, got {structure.value!r}."
            )

    @abstractmethod
    def loss_module(self, reduction: str = "mean") -> nn.Module:
        """The loss as a torch module (``nn.MSELoss``, ``nn.CrossEntropyLoss``) for SGD loops.

        Args:
            reduction: ``"mean"``, ``"sum"`` or ``"none"``, as torch's losses take it.
        """

    @abstractmethod
    def per_sample_loss(self, f: Tensor, y: Tensor) -> Tensor:
        """Negative log-likelihood up to constants, shape (B,)."""

    def loss(self, f: Tensor, y: Tensor) -> Tensor:
        """Summed loss over the batch, a scalar."""
        return self.per_sample_loss(f, y).sum()

    @abstractmethod
    def loss_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        """Gradient of the per-sample loss w.r.t. ``f``, shape (B, C)."""

    @abstractmethod
    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        """A factor ``L`` of the output Hessian ``Λ = L Lᵀ``, shape (B, C, R) with R ≤ C."""

    def output_hessian(self, f: Tensor) -> Tensor:
        """Hessian of the per-sample loss w.r.t. ``f``, shape (B, C, C)."""
        L = self.output_hessian_sqrt(f)
        return L @ L.transpose(-1, -2)

    def ggn(self, J: Tensor, f: Tensor) -> Tensor:
        """Generalised Gauss-Newton ``Σₙ Jₙᵀ Λₙ Jₙ`` of per-point Jacobians.

        Args:
            J: Jacobians of the outputs (B, C, K) w.r.t. K parameters or features.
            f: Outputs (B, C) at which the output Hessians ``Λₙ`` are taken.

        Returns:
            Shape (K, K).
        """
        return torch.einsum("bck,bcd,bdl->kl", J, self.output_hessian(f), J)

    @abstractmethod
    def predictive_nll(
        self, f_mu: Tensor, f_var: Tensor, y: Tensor, sigma_noise: Tensor
    ) -> Tensor:
        """Summed negative log-likelihood of targets under the predictive of ``N(f_mu, f_var)``.

        Args:
            f_mu: Latent means (B, C).
            f_var: Latent covariances (B, C, C).
            y: Targets of the batch.
            sigma_noise: Observation noise σ (used by likelihoods that have one).

        Returns:
            A scalar.
        """

    @abstractmethod
    def sample_targets(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Draw targets ``y ~ p(y | f)`` (for Monte-Carlo Fisher estimates)."""

    @abstractmethod
    def log_likelihood(
        self, loss: Tensor, n_data: int, n_outputs: int, sigma_noise: Tensor, temperature: float
    ) -> Tensor:
        """Log-likelihood of the training data from its summed loss."""

    def prepare_targets(self, f: Tensor, y: Tensor) -> Tensor:
        """Check targets against the outputs and bring them to the shape the loss expects.

        Raises:
            ValueError: See :meth:`check_targets`.
        """
        self.check_targets(y, f.shape)
        return y

    @abstractmethod
    def check_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        """Refuse targets that cannot belong to outputs of shape ``output_shape`` (B, C, ...).

        Cheap (no model call): the data loops run it on every batch before any curvature work,
        with the output shape of the first batch (the batch size is not compared).

        Raises:
            ValueError: Naming the problem (shape, label range); a :class:`DataError` (also a
                ``RuntimeError``) for targets of the wrong kind, a :class:`LabelError` (also an
                ``IndexError``) for a class label outside ``[0, C)``.
        """


class GaussianRegression(LikelihoodModel):
    """Homoscedastic Gaussian ``N(y; f, σ²I)``; the stored loss and curvature are σ-free."""

    kind = Likelihood.REGRESSION
    predicts_probabilities = False
    has_noise_hyperparameter = True
    loss_scale = 0.5

    @override
    def loss_module(self, reduction: str = "mean") -> nn.Module:
        return nn.MSELoss(reduction=reduction)

    @override
    def per_sample_loss(self, f: Tensor, y: Tensor) -> Tensor:
        y = self.prepare_targets(f, y)
        return 0.5 * (y - f).square().flatten(1).sum(1)

    @override
    def ggn(self, J: Tensor, f: Tensor) -> Tensor:
        return torch.einsum("bck,bcl->kl", J, J)

    @override
    def predictive_nll(
        self, f_mu: Tensor, f_var: Tensor, y: Tensor, sigma_noise: Tensor
    ) -> Tensor:
        """Gaussian NLL with the latent variances plus ``σ²``, summed over outputs and points."""
        y = self.prepare_targets(f_mu, y.to(f_mu.dtype))
        var = f_var.diagonal(dim1=-2, dim2=-1) + sigma_noise.square()
        return 0.5 * ((y - f_mu).square() / var + var.log() + math.log(2 * math.pi)).sum()

    @override
    def loss_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        return f - self.prepare_targets(f, y)

    @override
    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
        return eye.expand(f.shape[0], -1, -1)

    @override
    def sample_targets(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        noise = torch.randn(f.shape, dtype=f.dtype, device=f.device, generator=generator)
        return f + noise

    @override
    def log_likelihood(
        self, loss: Tensor, n_data: int, n_outputs: int, sigma_noise: Tensor, temperature: float
    ) -> Tensor:
        sigma2 = sigma_noise.square()
        normaliser = 0.5 * n_data * n_outputs * torch.log(2 * math.pi * sigma2)
        return -loss / (sigma2 * temperature) - normaliser

    @override
    def prepare_targets(self, f: Tensor, y: Tensor) -> Tensor:
        self.check_targets(y, f.shape)
        if y.shape != f.shape:
            raise ValueError(f"a batch of {len(y)} regression targets for {len(f)} model outputs.")
        return y

    @override
    def check_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        if y.dtype == torch.bool or y.is_complex():
            raise DataError(f"regression targets must be real numbers, got {y.dtype} targets.")
        if y.dim() != len(output_shape) or tuple(y.shape[1:]) != tuple(output_shape[1:]):
            raise ValueError(
                f"regression targets of shape {tuple(y.shape)} do not match the model output "
                f"of shape {tuple(output_shape)} (B = batch size): give targets of shape "
                f"(B, {', '.join(str(d) for d in output_shape[1:])}), e.g. y.reshape(len(y), -1) "
                "for one output; they are not reshaped silently."
            )


class Categorical(LikelihoodModel):
    """Categorical likelihood with a softmax link; targets are class indices or probabilities."""

    kind = Likelihood.CLASSIFICATION
    predicts_probabilities = True

    @override
    def loss_module(self, reduction: str = "mean") -> nn.Module:
        return nn.CrossEntropyLoss(reduction=reduction)

    @override
    def per_sample_loss(self, f: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(f, self.prepare_targets(f, y), reduction="none")

    @override
    def loss_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        y = self.prepare_targets(f, y)
        p = torch.softmax(f, dim=-1)
        if y.dtype.is_floating_point:
            return p - y
        return p - F.one_hot(y, f.shape[-1]).to(f.dtype)

    @override
    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        """A rank-(C − 1) factor of ``Λ = diag(p) − p pᵀ`` (:func:`softmax_hessian_factor`)."""
        return softmax_hessian_factor(torch.softmax(f, dim=-1))

    @override
    def output_hessian(self, f: Tensor) -> Tensor:
        p = torch.softmax(f, dim=-1)
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)

    @override
    def predictive_nll(
        self, f_mu: Tensor, f_var: Tensor, y: Tensor, sigma_noise: Tensor
    ) -> Tensor:
        """Cross-entropy of the logits of the probit approximation (:func:`probit_logits`)."""
        logits = probit_logits(f_mu, f_var)
        return F.cross_entropy(logits, self.class_indices(y), reduction="sum")

    @staticmethod
    def class_indices(y: Tensor) -> Tensor:
        """Class indices (B,) as ``long`` from indices (B,), a column (B, 1) or one-hot (B, C).

        Class probabilities (B, C) give their most likely class.

        Raises:
            ValueError: For any other shape.
        """
        if y.dim() == 2:
            y = y[:, 0] if y.shape[1] == 1 else y.argmax(-1)
        if y.dim() != 1:
            raise ValueError(
                f"classification targets must have shape (B,) or (B, C), got {tuple(y.shape)}."
            )
        return y.long()

    @override
    def sample_targets(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        p = torch.softmax(f.detach(), dim=-1)
        return torch.multinomial(p, 1, generator=generator).squeeze(-1)

    @override
    def log_likelihood(
        self, loss: Tensor, n_data: int, n_outputs: int, sigma_noise: Tensor, temperature: float
    ) -> Tensor:
        return -loss / temperature

    @override
    def prepare_targets(self, f: Tensor, y: Tensor) -> Tensor:
        self.check_targets(y, f.shape)
        if y.dtype.is_floating_point and y.shape == f.shape:
            return y
        y = y.reshape(-1)
        if y.shape[0] != f.shape[0]:
            raise ValueError(
                f"classification targets of shape {tuple(y.shape)} do not match the batch of "
                f"{f.shape[0]} outputs."
            )
        return y.long()

    @override
    def check_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        n_classes = output_shape[-1]
        if y.numel() == 0 or (y.dtype.is_floating_point and y.shape[1:] == output_shape[1:]):
            return  # class probabilities
        if y.dtype.is_floating_point or y.dtype == torch.bool or y.is_complex():
            raise DataError(
                f"classification targets must be integer class labels of shape (B,) or class "
                f"probabilities of shape (B, {n_classes}); got {y.dtype} targets of shape "
                f"{tuple(y.shape)} (convert labels with y.long())."
            )
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= n_classes:
            bad = low if low < 0 else high
            raise LabelError(
                f"class label {bad} is outside [0, C) for the model's C={n_classes} outputs; "
                "labels must be integers 0, ..., C-1."
            )


class RewardModeling(LikelihoodModel):
    """Bradley–Terry reward model: fitted as classification on pairs, predicted as regression."""

    kind = Likelihood.REWARD_MODELING
    predicts_probabilities = False
    #: The structures laplace-torch supports for reward modelling.
    hessian_structures = (HessianStructure.KRON, HessianStructure.DIAG)
    pairwise = True

    def __init__(self) -> None:
        self._fit = Categorical()
        self._predict = GaussianRegression()

    @override
    @property
    def fit_likelihood(self) -> LikelihoodModel:
        return self._fit

    @override
    @property
    def predictive_likelihood(self) -> LikelihoodModel:
        return self._predict

    @override
    def loss_module(self, reduction: str = "mean") -> nn.Module:
        return self._fit.loss_module(reduction)

    @override
    def per_sample_loss(self, f: Tensor, y: Tensor) -> Tensor:
        return self._fit.per_sample_loss(f, y)

    @override
    def loss_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        return self._fit.loss_gradient(f, y)

    @override
    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        return self._fit.output_hessian_sqrt(f)

    @override
    def output_hessian(self, f: Tensor) -> Tensor:
        return self._fit.output_hessian(f)

    @override
    def sample_targets(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return self._fit.sample_targets(f, generator)

    @override
    def predictive_nll(
        self, f_mu: Tensor, f_var: Tensor, y: Tensor, sigma_noise: Tensor
    ) -> Tensor:
        return self._fit.predictive_nll(f_mu, f_var, y, sigma_noise)

    @override
    def log_likelihood(
        self, loss: Tensor, n_data: int, n_outputs: int, sigma_noise: Tensor, temperature: float
    ) -> Tensor:
        return self._fit.log_likelihood(loss, n_data, n_outputs, sigma_noise, temperature)

    @override
    def prepare_targets(self, f: Tensor, y: Tensor) -> Tensor:
        return self._fit.prepare_targets(f, y)

    @override
    def check_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        self._fit.check_targets(y, output_shape)


_LIKELIHOODS: dict[Likelihood, type[LikelihoodModel]] = {
    Likelihood.REGRESSION: GaussianRegression,
    Likelihood.CLASSIFICATION: Categorical,
    Likelihood.REWARD_MODELING: RewardModeling,
}


def make_likelihood(likelihood: Likelihood | str) -> LikelihoodModel:
    """Build the likelihood object for a user's ``likelihood`` argument.

    Raises:
        ValueError: If ``likelihood`` is not one of the supported names.
    """
    return _LIKELIHOODS[parse_enum(Likelihood, likelihood, "likelihood")]()
