"""Link approximations and Gaussian draws against formulas written out independently."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_close
from laplace.utils import draw_gaussian
from laplace.utils.predictive import (
    gaussian_output_samples,
    laplace_bridge,
    monte_carlo_softmax,
    probit,
)


def random_gaussian(B=5, C=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    f_mu = torch.randn(B, C, generator=gen, dtype=torch.float64)
    A = torch.randn(B, C, C, generator=gen, dtype=torch.float64)
    return f_mu, A @ A.transpose(1, 2) / C + 0.1 * torch.eye(C, dtype=torch.float64)


def test_probit():
    f_mu, f_var = random_gaussian()
    kappa = 1 / torch.sqrt(1 + math.pi / 8 * torch.stack([torch.diag(v) for v in f_var]))
    assert_close(probit(f_mu, f_var), torch.softmax(kappa * f_mu, -1))
    assert_close(probit(f_mu, f_var.diagonal(dim1=1, dim2=2)), probit(f_mu, f_var))


def bridge_oracle(f_mu, f_var, normalize=False):
    K = f_mu.shape[-1]
    out = []
    for mu, S in zip(f_mu, f_var):
        a = torch.ones(1, K, dtype=mu.dtype)
        gain = S @ a.T @ torch.linalg.inv(a @ S @ a.T)
        mu_c = mu - (gain @ a @ mu[:, None]).squeeze(-1)
        S_c = S - gain @ a @ S
        var = torch.diag(S_c)
        if normalize:
            scale = var.mean() / math.sqrt(K / 2)
            mu_c, var = mu_c / scale.sqrt(), var / scale
        alpha = (1 - 2 / K + torch.exp(mu_c) * torch.exp(-mu_c).sum() / K**2) / var
        out.append(alpha / alpha.sum())
    return torch.stack(out)


def test_laplace_bridge():
    f_mu, f_var = random_gaussian()
    assert_close(laplace_bridge(f_mu, f_var), bridge_oracle(f_mu, f_var))
    assert_close(laplace_bridge(f_mu, f_var, normalize=True), bridge_oracle(f_mu, f_var, True))


def test_monte_carlo_softmax_converges():
    f_mu, f_var = random_gaussian(B=3, C=3, seed=1)
    n = 200_000
    got = monte_carlo_softmax(f_mu, f_var, n_samples=n, generator=torch.Generator().manual_seed(2))
    dist = torch.distributions.MultivariateNormal(f_mu, covariance_matrix=f_var)
    torch.manual_seed(3)
    probs = torch.softmax(dist.sample((n,)), -1)
    expected = probs.mean(0)
    std_err = probs.std(0) / math.sqrt(n)
    assert bool(((got - expected).abs() <= 6 * std_err * math.sqrt(2)).all())


def test_gaussian_output_samples_moments():
    f_mu, f_var = random_gaussian(B=2, C=3, seed=4)
    n = 50_000
    s = gaussian_output_samples(f_mu, f_var, n, torch.Generator().manual_seed(5))
    assert s.shape == (n, 2, 3)
    for b in range(2):
        cov = torch.cov(s[:, b].T)
        std_err = (f_var[b].diagonal()[:, None] * f_var[b].diagonal()[None] + f_var[b] ** 2) / n
        assert bool(((cov - f_var[b]).abs() <= 5 * std_err.sqrt()).all())
    diag = gaussian_output_samples(f_mu, f_var.diagonal(dim1=1, dim2=2), 4)
    assert diag.shape == (4, 2, 3)


#: Monte-Carlo tolerance for the covariance of 20 000 draws with unit-scale entries.
MC_ATOL = 0.05


def test_draw_gaussian_handles_singular_and_joint_covariances():
    g = torch.Generator().manual_seed(0)
    mean = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    cov = torch.tensor([[[1.0, 1.0], [1.0, 1.0]]], dtype=torch.float64)  # rank one
    draws = draw_gaussian(mean, cov, 20000, g)
    assert draws.shape == (20000, 1, 2)
    centred = draws[:, 0] - mean
    assert_close(centred.T @ centred / 20000, cov[0], rtol=0.0, atol=MC_ATOL)
    assert draw_gaussian(mean.reshape(-1), cov[0], 4, g).shape == (4, 2)
    with pytest.raises(torch.linalg.LinAlgError):
        draw_gaussian(mean, -cov, 2, g)
