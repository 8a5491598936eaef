"""Which evaluation measures each likelihood's predictive, and the named validation losses.

:data:`EVALUATIONS` maps a likelihood name to the evaluation class of its predictive, so a new
likelihood is one entry; :func:`validation_metric` builds the running metric that grid search
validates with (``optimize_prior_precision(method="gridsearch", loss="ece")``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torchmetrics import Metric

from laplace.evaluation.tasks import (
    BernoulliEvaluation,
    CategoricalEvaluation,
    Evaluation,
    GaussianEvaluation,
    HeteroscedasticEvaluation,
)

__all__ = [
    "EVALUATIONS",
    "VALIDATION_LOSSES",
    "evaluation_class",
    "make_evaluation",
    "validation_metric",
]

#: The evaluation of each likelihood's predictive, by likelihood name.
EVALUATIONS: dict[str, type[Evaluation]] = {
    "classification": CategoricalEvaluation,
    "regression": GaussianEvaluation,
    "reward_modeling": GaussianEvaluation,  # its predictive is a regression on rewards
    "binary_classification": BernoulliEvaluation,  # independent labels, probabilities (B, K)
    "heteroscedastic_regression": HeteroscedasticEvaluation,
}

#: Every validation loss name accepted by grid search.
VALIDATION_LOSSES: tuple[str, ...] = tuple(
    sorted({name for cls in EVALUATIONS.values() for name in cls.validation_losses})
)


def _likelihood_name(likelihood: Any) -> str:
    """The name of a likelihood enum member, string, or likelihood object."""
    return str(getattr(likelihood, "value", None) or getattr(likelihood, "name", likelihood))


def evaluation_class(likelihood: Any) -> type[Evaluation]:
    """The evaluation of a likelihood (an enum member or its name).

    Raises:
        ValueError: For a likelihood without an evaluation, listing those with one.
    """
    name = _likelihood_name(likelihood)
    if name not in EVALUATIONS:
        accepted = ", ".join(repr(key) for key in EVALUATIONS)
        raise ValueError(f"likelihood={name!r} cannot be evaluated; accepted values: {accepted}.")
    return EVALUATIONS[name]


def make_evaluation(likelihood: Any, **kwargs: Any) -> Evaluation:
    """Build the evaluation of ``likelihood`` with the keyword arguments of :class:`Evaluation`."""
    return evaluation_class(likelihood)(**kwargs)


def validation_metric(
    name: str,
    likelihood: Any,
    n_outputs: int,
    sigma_noise: float | Tensor = 0.0,
    **kwargs: Any,
) -> Metric:
    """The running validation metric called ``name`` for a likelihood's predictions.

    Args:
        name: One of :data:`VALIDATION_LOSSES` (``"nll"``, ``"ece"``, ``"brier"``,
            ``"crps"``); lower is better for all.
        likelihood: The likelihood whose predictions the metric scores.
        n_outputs: Number of classes, labels or regression outputs.
        sigma_noise: Observation noise σ (regression).
        **kwargs: Keyword arguments of :class:`torchmetrics.Metric`.

    Raises:
        ValueError: For an unknown name, or one the likelihood does not offer.
    """
    if name not in VALIDATION_LOSSES:
        accepted = ", ".join(repr(key) for key in VALIDATION_LOSSES)
        raise ValueError(
            f"loss={name!r} is not supported; accepted names: {accepted} (or a "
            "torchmetrics.Metric or a callable)."
        )
    losses = evaluation_class(likelihood).validation_losses
    if name not in losses:
        accepted = ", ".join(repr(key) for key in losses)
        raise ValueError(
            f"loss={name!r} does not apply to likelihood={_likelihood_name(likelihood)!r}; "
            f"accepted names: {accepted}."
        )
    return losses[name](n_outputs, sigma_noise, **kwargs)
