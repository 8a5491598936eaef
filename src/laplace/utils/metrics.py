"""laplace-torch's ``laplace.utils.metrics`` path, a façade whose metric is imported on first use.

``RunningNLLMetric`` is a ``torchmetrics.Metric``, defined in ``laplace.utils.running_nll``;
reading it here imports torchmetrics, which ``import laplace`` does not.
"""

from typing import TYPE_CHECKING

from laplace.utils.lazy import lazy_attributes

if TYPE_CHECKING:
    from laplace.utils.running_nll import RunningNLLMetric

__all__ = ["RunningNLLMetric"]

__getattr__ = lazy_attributes(__name__, {"RunningNLLMetric": "laplace.utils.running_nll"})
