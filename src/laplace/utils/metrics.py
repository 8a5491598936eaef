"""laplace-torch's ``laplace.utils.metrics`` path: a façade, the metric lives with the others.

:mod:`laplace.likelihoods.scoring` holds the running metrics of predictions.
"""

from laplace.likelihoods.scoring import RunningNLLMetric

__all__ = ["RunningNLLMetric"]
