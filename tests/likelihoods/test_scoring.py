"""Scoring rules in closed form: the Gaussian CRPS equals its integral definition."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from laplace.evaluation import gaussian_crps


def test_gaussian_crps_equals_the_integral_definition():
    # CRPS(F, y) = ∫ (F(x) − 1[x ≥ y])² dx, by quadrature
    for mu, sd, y in [(0.0, 1.0, 0.0), (1.5, 0.3, 0.2), (-2.0, 2.5, 3.0)]:
        cdf = stats.norm(mu, sd).cdf
        below, _ = integrate.quad(lambda x, cdf=cdf: cdf(x) ** 2, -np.inf, y)
        above, _ = integrate.quad(lambda x, cdf=cdf: (1 - cdf(x)) ** 2, y, np.inf)
        got = gaussian_crps(*(torch.tensor(v, dtype=torch.float64) for v in (mu, sd, y)))
        assert got.item() == pytest.approx(below + above, rel=1e-8)
    assert gaussian_crps(torch.tensor(0.0), torch.tensor(1.0), torch.tensor(0.0)).item() == (
        pytest.approx(2 / math.sqrt(2 * math.pi) - 1 / math.sqrt(math.pi), rel=1e-6)
    )
