"""``CustomLikelihood``: your ``Likelihood`` as a likelihood object."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from typing_extensions import Unpack, override

from laplace.likelihoods.likelihood_model import (
    LikelihoodModel,
    LossModule,
    SamplingOptions,
)
from laplace.likelihoods.protocol import Likelihood
from laplace.utils.enums import HessianStructure, LinkApprox

__all__ = ["CustomLikelihood"]


def _overrides(obj: Likelihood, method: str) -> bool:
    return getattr(type(obj), method) is not getattr(Likelihood, method)


class CustomLikelihood(LikelihoodModel[Tensor]):
    """The likelihood object of a user's [`Likelihood`][laplace.Likelihood] subclass instance.

    Its curvature, loss and predictive come from the user's methods; gradients of the loss
    w.r.t. the outputs (empirical Fisher, per-sample gradients) by autograd.

    Args:
        likelihood: The user's likelihood.

    Raises:
        TypeError: If it implements neither ``output_hessian`` nor ``output_hessian_sqrt``,
            or not ``loss``.
    """

    hessian_structures = (
        HessianStructure.FULL,
        HessianStructure.DIAG,
        HessianStructure.KRON,
        HessianStructure.EKFAC,
    )
    loss_module_curvature = False
    function_space = ()
    #: The user's predictive receives covariances (B, C, C).
    output_variances = False
    #: The user's likelihood this object stands for.
    kind: Likelihood

    def __init__(self, likelihood: Likelihood) -> None:
        missing = [m for m in ("loss",) if not _overrides(likelihood, m)]
        hessians = ("output_hessian", "output_hessian_sqrt")
        if not any(_overrides(likelihood, method) for method in hessians):
            missing.append("output_hessian or output_hessian_sqrt")
        if missing:
            raise TypeError(
                f"likelihood {type(likelihood).__name__} must implement {' and '.join(missing)} "
                "(see laplace.likelihoods.Likelihood)."
            )
        super().__init__()
        self.kind = likelihood
        self.predicts_probabilities = bool(likelihood.predicts_probabilities)

    @property
    def name(self) -> str:
        """The user's ``name``."""
        return str(self.kind.name)

    @property
    def predictions(self) -> str:
        """What the predictive returns, for messages."""
        return f"the predictions of {self.name}"

    @override
    def loss_module(self, reduction: str = "mean") -> nn.Module:
        return LossModule(self, reduction)

    @override
    def per_sample_loss(self, f: Tensor, y: Tensor) -> Tensor:
        y = self.prepare_targets(f, y)
        return self.kind.loss(f, y) + self.kind.log_normalizer(y).to(f)

    @override
    def loss_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        y = self.prepare_targets(f, y)
        with torch.enable_grad():
            leaf = f.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(self.kind.loss(leaf, y).sum(), leaf)
        return grad

    @override
    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        return self.kind.output_hessian_sqrt(f)

    @override
    def output_hessian(self, f: Tensor) -> Tensor:
        return self.kind.output_hessian(f)

    @override
    def sample_targets(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return self.kind.sample(f.detach(), generator)

    @override
    def check_row_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        self.kind.check_targets(y, output_shape)

    @override
    def glm_predictive(
        self,
        f_mu: Tensor,
        f_var: Tensor,
        link_approx: LinkApprox,
        **sampling: Unpack[SamplingOptions],
    ) -> Tensor:
        return self.kind.predictive(f_mu, f_var, **sampling)

    @override
    def sampled_predictive(self, f: Tensor) -> Tensor:
        return self.kind.inverse_link(f).mean(dim=0)

    @override
    def predictive_sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return self.kind.inverse_link(f)
