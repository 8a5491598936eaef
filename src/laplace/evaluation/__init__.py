"""Evaluating calibration: metrics of a predictive on a loader, on shifted inputs, and plots.

``evaluate(la, loader, **predictive_kwargs)`` returns a JSON-serialisable dict (see
``docs/evaluation.md``), with out-of-distribution metrics (``ood_metrics``) given an
``ood_loader``; ``adversarial_sweep`` scores several predictives on FGSM or PGD inputs per ε;
the plots draw such results. The metrics and scoring rules are the likelihoods'
(``laplace.likelihoods.scoring``): each likelihood object gives its evaluation and its named
validation losses (``"nll"``, ``"ece"``, ``"brier"``, ``"crps"``).
"""

from laplace.evaluation.adversarial import (
    ATTACKS,
    SWEEP_METRICS,
    adversarial_sweep,
    fgsm,
    pgd,
)
from laplace.evaluation.evaluate import ENTROPY_BINS, FPR95_TPR, evaluate, ood_metrics
from laplace.evaluation.plots import (
    plot_adversarial_sweep,
    plot_calibration_curve,
    plot_entropy_histograms,
    plot_predictive_band,
    plot_reliability_diagram,
)
from laplace.likelihoods.running_scores import (
    BernoulliBrier,
    BernoulliNLL,
    BrierScore,
    GaussianCRPS,
    GaussianNLL,
    HeteroscedasticCRPS,
    HeteroscedasticNLL,
    MeanScore,
    PerLabelCalibrationError,
    PITCalibration,
    ReliabilityBins,
)
from laplace.likelihoods.scoring import (
    VALIDATION_LOSSES,
    Evaluation,
    bernoulli_entropy,
    categorical_entropy,
    gaussian_crps,
    gaussian_entropy,
    gaussian_nll,
)

__all__ = [
    "ATTACKS",
    "ENTROPY_BINS",
    "FPR95_TPR",
    "SWEEP_METRICS",
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
    "adversarial_sweep",
    "bernoulli_entropy",
    "categorical_entropy",
    "evaluate",
    "fgsm",
    "gaussian_crps",
    "gaussian_entropy",
    "gaussian_nll",
    "ood_metrics",
    "pgd",
    "plot_adversarial_sweep",
    "plot_calibration_curve",
    "plot_entropy_histograms",
    "plot_predictive_band",
    "plot_reliability_diagram",
]
