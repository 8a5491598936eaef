"""Evaluating calibration: metrics of a predictive on a loader, reliability plots, tuning losses.

``evaluate(la, loader, **predictive_kwargs)`` returns a JSON-serialisable dict: ``accuracy``,
``nll``, ``brier``, ``ece``, ``mce`` for classification; ``nll``, ``rmse``, ``crps``,
``coverage`` and a PIT ``calibration_curve`` for regression; ``ood_auroc`` with an
out-of-distribution loader. The plots draw such a result; the metric names ``"nll"``,
``"ece"``, ``"brier"`` and ``"crps"`` are accepted by
``optimize_prior_precision(method="gridsearch", loss=...)``.
"""

from laplace.evaluation.evaluate import evaluate
from laplace.evaluation.gaussian import (
    GaussianCRPS,
    GaussianNLL,
    HeteroscedasticCRPS,
    HeteroscedasticNLL,
    PITCalibration,
    gaussian_crps,
    gaussian_entropy,
    gaussian_nll,
)
from laplace.evaluation.metrics import (
    BernoulliBrier,
    BernoulliNLL,
    BrierScore,
    PerLabelCalibrationError,
    ReliabilityBins,
    bernoulli_entropy,
    categorical_entropy,
)
from laplace.evaluation.plots import (
    plot_calibration_curve,
    plot_predictive_band,
    plot_reliability_diagram,
)
from laplace.evaluation.registry import EVALUATIONS, VALIDATION_LOSSES, validation_metric
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
    "BernoulliBrier",
    "BernoulliEvaluation",
    "BernoulliNLL",
    "BrierScore",
    "CategoricalEvaluation",
    "Evaluation",
    "GaussianCRPS",
    "GaussianEvaluation",
    "GaussianNLL",
    "HeteroscedasticCRPS",
    "HeteroscedasticEvaluation",
    "HeteroscedasticNLL",
    "PITCalibration",
    "PerLabelCalibrationError",
    "ReliabilityBins",
    "bernoulli_entropy",
    "categorical_entropy",
    "evaluate",
    "gaussian_crps",
    "gaussian_entropy",
    "gaussian_nll",
    "plot_calibration_curve",
    "plot_predictive_band",
    "plot_reliability_diagram",
    "validation_metric",
]
