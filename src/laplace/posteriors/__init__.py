"""Posterior structures: each turns summed curvature and hyperparameters into a Gaussian."""

from laplace.posteriors.base import NotPositiveDefiniteError, Posterior
from laplace.posteriors.dense import DensePosterior
from laplace.posteriors.diagonal import DiagonalPosterior
from laplace.posteriors.kron import KronPosterior
from laplace.posteriors.lowrank import DiagLowRankPosterior, LowRankPosterior

__all__ = [
    "DensePosterior",
    "DiagLowRankPosterior",
    "DiagonalPosterior",
    "KronPosterior",
    "LowRankPosterior",
    "NotPositiveDefiniteError",
    "Posterior",
]
