"""Posterior structures: each turns summed curvature and hyperparameters into a Gaussian."""

from laplace.structures.dense import DensePosterior
from laplace.structures.diagonal import DiagonalPosterior
from laplace.structures.kronecker import KronPosterior
from laplace.structures.low_rank import DiagLowRankPosterior, LowRankPosterior
from laplace.structures.posterior import NotPositiveDefiniteError, Posterior

__all__ = [
    "DensePosterior",
    "DiagLowRankPosterior",
    "DiagonalPosterior",
    "KronPosterior",
    "LowRankPosterior",
    "NotPositiveDefiniteError",
    "Posterior",
]
