"""Calibration metrics against independent references: torchmetrics, closed forms, numpy, SciPy.

Predictions are fed to ``evaluate`` through the identity predictive (the loader's inputs *are*
the probabilities or moments, ``cases.predictions``), so these tests check the metrics and the
batched pass, not a Laplace approximation.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch.utils.data import DataLoader
from torchmetrics.functional.classification import (
    binary_calibration_error,
    multiclass_calibration_error,
)

from cases.predictions import MomentsDataset, _evaluate_predictions, _labels, _probs
from conftest import assert_close
from laplace.evaluation import evaluate, gaussian_nll

# torchmetrics' calibration error bins float32 confidences.
RTOL_F32, ATOL_F32 = 1e-6, 1e-7


# ------------------------------------------------------------------------- classification
@pytest.mark.parametrize("n_bins", [15, 7])
def test_ece_and_mce_equal_torchmetrics_on_the_same_probabilities(n_bins):
    probs = _probs(203, 5)
    y = _labels(probs)
    result = _evaluate_predictions(probs, y, n_bins=n_bins)
    for key, norm in (("ece", "l1"), ("mce", "max")):
        expected = multiclass_calibration_error(probs, y, 5, n_bins=n_bins, norm=norm)
        assert_close(torch.tensor(result[key]), expected.double(), RTOL_F32, ATOL_F32)
    assert result["ece"] > 0 and result["mce"] >= result["ece"]


def test_default_is_fifteen_bins():
    probs = _probs(50, 3, seed=4)
    result = _evaluate_predictions(probs, _labels(probs))
    assert len(result["reliability"]["count"]) == 15
    expected = multiclass_calibration_error(probs, _labels(probs), 3, n_bins=15)
    assert_close(torch.tensor(result["ece"]), expected.double(), RTOL_F32, ATOL_F32)


def test_reliability_bins_reproduce_the_ece():
    probs = _probs(300, 4, seed=2)
    y = _labels(probs, seed=3)
    result = _evaluate_predictions(probs, y)
    bins = {key: torch.tensor(value) for key, value in result["reliability"].items()}
    conf = probs.max(-1).values
    index = (conf * 15).long().clamp(max=14)
    assert_close(bins["count"], torch.bincount(index, minlength=15).double())
    gap = (bins["accuracy"] - bins["confidence"]).abs()
    ece_from_bins = (gap * bins["count"]).sum() / bins["count"].sum()
    assert_close(ece_from_bins, torch.tensor(result["ece"]), RTOL_F32, ATOL_F32)
    assert_close(torch.tensor(result["confidence"]), conf.mean())
    assert bins["bin_edges"].tolist() == pytest.approx(np.linspace(0, 1, 16).tolist())


def test_accuracy_nll_brier_by_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]], dtype=torch.float64)
    y = torch.tensor([0, 1])
    result = _evaluate_predictions(probs, y, batch_size=1)
    assert result["accuracy"] == 0.5
    assert result["nll"] == pytest.approx(-(math.log(0.7) + math.log(0.1)) / 2, rel=1e-12)
    # (0.3² + 0.2² + 0.1²) and (0.1² + 0.9² + 0.8²), averaged
    assert result["brier"] == pytest.approx(0.8, rel=1e-12)
    assert result["n"] == 2


def test_accuracy_nll_brier_against_numpy():
    probs = _probs(101, 6, seed=5)
    y = _labels(probs, seed=6)
    result = _evaluate_predictions(probs, y, batch_size=13)
    p, t = probs.numpy(), y.numpy()
    onehot = np.eye(6)[t]
    assert result["accuracy"] == pytest.approx(np.mean(p.argmax(1) == t), rel=RTOL_F32)
    assert result["nll"] == pytest.approx(-np.mean(np.log(p[np.arange(101), t])), rel=1e-12)
    assert result["brier"] == pytest.approx(np.mean(((p - onehot) ** 2).sum(1)), rel=1e-12)


def test_result_is_plain_json():
    probs = _probs(20, 3)
    result = _evaluate_predictions(probs, _labels(probs))
    assert json.loads(json.dumps(result)) == result
    assert {"accuracy", "nll", "brier", "ece", "mce"} <= set(result)


# ------------------------------------------------------------------------------ regression
def _gaussian_data(n, c, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, c, generator=gen, dtype=torch.float64)
    std = 0.5 + torch.rand(n, c, generator=gen, dtype=torch.float64)
    y = mean + std * torch.randn(n, c, generator=gen, dtype=torch.float64)
    return mean, std, y


def _evaluate_moments(mean, var, y, batch_size=9, **kwargs):
    loader = DataLoader(MomentsDataset(mean, var, y), batch_size=batch_size)
    return evaluate(lambda x: tuple(x), loader, **kwargs)


def test_regression_nll_rmse_crps_against_scipy_and_numpy():
    mean, std, y = _gaussian_data(57, 2)
    result = _evaluate_moments(mean, std.square(), y)
    m, s, t = mean.numpy(), std.numpy(), y.numpy()
    nll = -stats.norm.logpdf(t, m, s).sum(1).mean()
    assert result["nll"] == pytest.approx(nll, rel=1e-10)
    assert result["rmse"] == pytest.approx(np.sqrt(np.mean((m - t) ** 2)), rel=1e-10)
    z = (t - m) / s
    crps = s * (z * (2 * stats.norm.cdf(z) - 1) + 2 * stats.norm.pdf(z) - 1 / np.sqrt(np.pi))
    assert result["crps"] == pytest.approx(crps.mean(), rel=1e-10)
    assert result["n"] == 57


def test_full_covariance_nll_against_scipy_multivariate_normal():
    gen = torch.Generator().manual_seed(3)
    mean = torch.randn(11, 3, generator=gen, dtype=torch.float64)
    A = torch.randn(11, 3, 3, generator=gen, dtype=torch.float64)
    cov = A @ A.transpose(-1, -2) + 0.1 * torch.eye(3, dtype=torch.float64)
    y = torch.randn(11, 3, generator=gen, dtype=torch.float64)
    got = gaussian_nll(mean, cov, y)
    expected = [
        -stats.multivariate_normal.logpdf(y[i].numpy(), mean[i].numpy(), cov[i].numpy())
        for i in range(11)
    ]
    assert_close(got, torch.tensor(expected))
    result = _evaluate_moments(mean, cov, y, sigma_noise=0.0)
    assert result["nll"] == pytest.approx(float(np.mean(expected)), rel=1e-10)
    # CRPS and coverage use the marginals
    marginal = _evaluate_moments(mean, cov.diagonal(dim1=-2, dim2=-1), y)
    assert result["crps"] == pytest.approx(marginal["crps"], rel=1e-12)
    assert result["coverage"] == marginal["coverage"]


def test_sigma_noise_is_added_to_the_variance():
    mean, std, y = _gaussian_data(30, 1, seed=2)
    with_noise = _evaluate_moments(mean, std.square(), y, sigma_noise=0.7)
    total = _evaluate_moments(mean, std.square() + 0.49, y)
    for key in ("nll", "crps", "coverage"):
        assert with_noise[key] == pytest.approx(total[key], rel=1e-12)
    assert with_noise["calibration_curve"] == total["calibration_curve"]


def _binomial_tolerance(p: float, n: int) -> float:
    """Four standard deviations of a fraction of n Bernoulli(p) draws."""
    return 4 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("n_outputs", [1, 2])
def test_coverage_and_pit_curve_of_a_calibrated_predictive(n_outputs):
    n = 5000
    mean, std, y = _gaussian_data(n, n_outputs, seed=7)
    levels = (0.5, 0.8, 0.95)
    result = _evaluate_moments(mean, std.square(), y, batch_size=512, coverage_levels=levels)
    n_values = n * n_outputs
    assert set(result["coverage"]) == {"0.5", "0.8", "0.95"}
    for level in levels:
        assert abs(result["coverage"][f"{level:g}"] - level) < _binomial_tolerance(level, n_values)
    curve = result["calibration_curve"]
    assert len(curve["expected"]) == 16
    assert curve["observed"][0] == 0 and curve["observed"][-1] == 1
    for p, observed in zip(curve["expected"], curve["observed"], strict=True):
        assert abs(observed - p) <= _binomial_tolerance(p, n_values) + 1e-12


def test_coverage_detects_an_overconfident_predictive():
    n = 5000
    mean, std, y = _gaussian_data(n, 1, seed=8)
    result = _evaluate_moments(mean, (0.5 * std).square(), y, batch_size=512)
    # the true coverage of the 90% interval of half the width is 2Φ(0.5·1.645) − 1 ≈ 0.59
    expected = 2 * stats.norm.cdf(0.5 * stats.norm.ppf(0.95)) - 1
    assert abs(result["coverage"]["0.9"] - expected) < _binomial_tolerance(expected, n)
    assert result["coverage"]["0.9"] < 0.9 - _binomial_tolerance(0.9, n)


# ------------------------------------------------------------------------- multi-label
def test_per_label_bernoulli_metrics_against_torchmetrics_and_numpy():
    gen = torch.Generator().manual_seed(9)
    probs = torch.rand(120, 3, generator=gen, dtype=torch.float64)
    y = (torch.rand(120, 3, generator=gen, dtype=torch.float64) < probs**1.5).long()
    result = _evaluate_predictions(probs, y, likelihood="binary_classification", n_bins=10)
    p, t = probs.numpy(), y.numpy()
    per_label = result["per_label"]
    nll = -(t * np.log(p) + (1 - t) * np.log(1 - p)).mean(0)
    assert per_label["nll"] == pytest.approx(nll.tolist(), rel=1e-10)
    assert per_label["brier"] == pytest.approx(((p - t) ** 2).mean(0).tolist(), rel=1e-10)
    assert per_label["accuracy"] == pytest.approx(((p > 0.5) == t).mean(0).tolist(), rel=1e-6)
    for key, norm in (("ece", "l1"), ("mce", "max")):
        expected = [
            binary_calibration_error(
                probs[:, k].contiguous(), y[:, k], n_bins=10, norm=norm
            ).item()
            for k in range(3)
        ]
        assert per_label[key] == pytest.approx(expected, rel=1e-6)
    for key in ("accuracy", "nll", "brier", "ece", "mce"):
        assert result[key] == pytest.approx(float(np.mean(per_label[key])), rel=1e-6)
    assert json.loads(json.dumps(result)) == result
