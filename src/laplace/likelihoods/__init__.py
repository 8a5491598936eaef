"""Likelihood objects: loss, output-space curvature and predictive link of each observation model.

The built-in ones are named by ``likelihood=`` (``laplace.utils.enums.Likelihood``); your own
observation model is a subclass of [`Likelihood`][laplace.Likelihood] (the public protocol),
passed as ``likelihood=MyLikelihood()``. Adding a built-in one is a class in ``_BUILT_IN``, named
by its ``kind``.
"""

from __future__ import annotations

from laplace.likelihoods.bernoulli import Bernoulli
from laplace.likelihoods.categorical import Categorical, RewardModeling
from laplace.likelihoods.custom import CustomLikelihood
from laplace.likelihoods.gaussian import GaussianRegression
from laplace.likelihoods.heteroscedastic import (
    HeteroscedasticGaussian,
    HeteroscedasticGaussianNLLLoss,
    HeteroscedasticPrediction,
)
from laplace.likelihoods.likelihood_model import LikelihoodModel, refuse_structure
from laplace.likelihoods.protocol import Likelihood
from laplace.utils import enums
from laplace.utils.outputs import IGNORE_INDEX, OutputAdapter

__all__ = [
    "Bernoulli",
    "Categorical",
    "CustomLikelihood",
    "GaussianRegression",
    "HeteroscedasticGaussian",
    "HeteroscedasticGaussianNLLLoss",
    "HeteroscedasticPrediction",
    "Likelihood",
    "LikelihoodModel",
    "RewardModeling",
    "check_structure",
    "likelihood_class",
    "make_likelihood",
]

_BUILT_IN = (Categorical, GaussianRegression, RewardModeling, Bernoulli, HeteroscedasticGaussian)
_LIKELIHOODS: dict[str, type[LikelihoodModel]] = {cls.kind_name(): cls for cls in _BUILT_IN}


def make_likelihood(
    likelihood: enums.Likelihood | str | Likelihood | LikelihoodModel,
    class_dim: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> LikelihoodModel:
    """Build the likelihood object for a user's ``likelihood`` argument.

    Args:
        likelihood: A name (``laplace.utils.enums.Likelihood`` member or its string), an
            instance of a ``Likelihood`` subclass, or a likelihood object (returned as is,
            with its own output options).
        class_dim: The class dimension of outputs with extra dimensions (see
            [`OutputAdapter`][laplace.utils.outputs.OutputAdapter]).
        ignore_index: The class label whose positions are dropped.

    Returns:
        The [`LikelihoodModel`][laplace.likelihoods.LikelihoodModel].

    Raises:
        ValueError: If ``likelihood`` is none of these, listing the accepted names.
        TypeError: For a [`Likelihood`][laplace.Likelihood] that lacks a method it must implement.
    """
    if isinstance(likelihood, LikelihoodModel):
        return likelihood
    model = (
        CustomLikelihood(likelihood)
        if isinstance(likelihood, Likelihood)
        else likelihood_class(likelihood)()
    )
    model.outputs = OutputAdapter(class_dim, ignore_index)
    return model


def likelihood_class(
    likelihood: enums.Likelihood | str | Likelihood | LikelihoodModel,
) -> type[LikelihoodModel]:
    """The class of the likelihood object ``make_likelihood`` builds, building nothing.

    Raises:
        ValueError: If ``likelihood`` is not a likelihood, listing the accepted names.
    """
    if isinstance(likelihood, LikelihoodModel):
        return type(likelihood)
    if isinstance(likelihood, Likelihood):
        return CustomLikelihood
    name = likelihood.value if isinstance(likelihood, enums.Likelihood) else likelihood
    if not isinstance(name, str) or name not in _LIKELIHOODS:
        accepted = ", ".join(repr(name) for name in _LIKELIHOODS)
        raise ValueError(
            f"likelihood={likelihood!r} is not supported; accepted values: {accepted}, or an "
            "instance of a laplace.likelihoods.Likelihood subclass (your own likelihood)."
        )
    return _LIKELIHOODS[name]


def check_structure(
    likelihood: enums.Likelihood | str | Likelihood | LikelihoodModel,
    structure: enums.HessianStructure,
) -> None:
    """Refuse a Hessian structure the likelihood cannot be fitted with (the ``Laplace`` factory).

    Raises:
        ValueError: For an unknown likelihood, or naming the likelihood and the structures it
            supports.
    """
    cls = likelihood_class(likelihood)
    name = likelihood.name if isinstance(likelihood, (Likelihood, LikelihoodModel)) else None
    refuse_structure(str(name or cls.kind_name()), cls.hessian_structures, structure)
