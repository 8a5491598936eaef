"""Evaluating calibration: metrics of a predictive on a loader, and reliability plots.

``evaluate(la, loader, **predictive_kwargs)`` returns a JSON-serialisable dict (see
``docs/evaluation.md``); the plots draw such a result. The metrics and scoring rules are the
likelihoods' (``laplace.likelihoods.scoring``): each likelihood object gives its evaluation
and its named validation losses (``"nll"``, ``"ece"``, ``"brier"``, ``"crps"``).
"""

from laplace.evaluation.evaluate import ENTROPY_BINS, FPR95_TPR, evaluate, ood_metrics
from laplace.evaluation.plots import (
    plot_calibration_curve,
    plot_predictive_band,
    plot_reliability_diagram,
)
from laplace.likelihoods.scoring import (
    VALIDATION_LOSSES,
    BernoulliBrier,
    BernoulliNLL,
    BrierScore,
    Evaluation,
    GaussianCRPS,
    GaussianNLL,
    HeteroscedasticCRPS,
    HeteroscedasticNLL,
    MeanScore,
    PerLabelCalibrationError,
    PITCalibration,
    ReliabilityBins,
    bernoulli_entropy,
    categorical_entropy,
    gaussian_crps,
    gaussian_entropy,
    gaussian_nll,
)

__all__ = [
    "ENTROPY_BINS",
    "FPR95_TPR",
    "VALIDATION_LOSSES",
    "BernoulliBrier",
    "BernoulliNLL",
    "BrierScore",
    "Evaluation",
    "GaussianCRPS",
    "GaussianNLL",
    "HeteroscedasticCRPS",
    "HeteroscedasticNLL",
    "MeanScore",
    "PITCalibration",
    "PerLabelCalibrationError",
    "ReliabilityBins",
    "bernoulli_entropy",
    "categorical_entropy",
    "evaluate",
    "gaussian_crps",
    "gaussian_entropy",
    "gaussian_nll",
    "ood_metrics",
    "plot_calibration_curve",
    "plot_predictive_band",
    "plot_reliability_diagram",
]
