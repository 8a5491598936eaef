"""What the likelihood objects give the rest of the library instead of branches on names."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_close
from laplace.likelihoods import make_likelihood
from laplace.predictive import probit, probit_logits

g = torch.Generator().manual_seed(0)
F = torch.randn(5, 3, dtype=torch.float64, generator=g)
J = torch.randn(5, 3, 4, dtype=torch.float64, generator=g)
ROOT = torch.randn(5, 3, 3, dtype=torch.float64, generator=g)
COV = ROOT @ ROOT.transpose(1, 2)


def test_properties_describe_each_likelihood():
    table = {
        name: (model.has_observation_noise, model.pairwise)
        for name in ("regression", "classification", "reward_modeling")
        for model in [make_likelihood(name)]
    }
    assert table == {
        "regression": (True, False),
        "classification": (False, False),
        "reward_modeling": (False, True),
    }


@pytest.mark.parametrize("name", ["regression", "classification", "reward_modeling"])
def test_ggn_is_the_sum_of_jacobian_output_hessian_products(name):
    likelihood = make_likelihood(name)
    expected = torch.einsum("bck,bcd,bdl->kl", J, likelihood.output_hessian(F), J)
    assert_close(likelihood.ggn(J, F), expected)


def test_gaussian_predictive_nll_adds_the_noise_to_the_latent_variances():
    y = torch.randn(5, 3, dtype=torch.float64, generator=g)
    sigma = torch.tensor([0.7], dtype=torch.float64)
    var = COV.diagonal(dim1=1, dim2=2) + 0.49
    expected = -torch.distributions.Normal(F, var.sqrt()).log_prob(y).sum()
    assert_close(make_likelihood("regression").predictive_nll(F, COV, y, sigma), expected)
    with pytest.raises(ValueError, match="do not match"):
        make_likelihood("regression").predictive_nll(F, COV, y[:, 0], sigma)


@pytest.mark.parametrize("name", ["classification", "reward_modeling"])
def test_class_probability_nll_is_the_probit_cross_entropy(name):
    y = torch.tensor([0, 2, 1, 1, 0])
    expected = -probit(F, COV).log().gather(1, y[:, None]).sum()
    nll = make_likelihood(name).predictive_nll(F, COV, y, torch.ones(1))
    assert_close(nll, expected)
    one_hot = torch.nn.functional.one_hot(y, 3).double()
    assert_close(make_likelihood(name).predictive_nll(F, COV, one_hot, torch.ones(1)), expected)


def test_probit_logits_scale_the_means_by_the_variances():
    var = COV.diagonal(dim1=1, dim2=2)
    assert_close(probit_logits(F, COV), F / torch.sqrt(1 + math.pi / 8 * var))
    assert_close(probit_logits(F, var), probit_logits(F, COV))
