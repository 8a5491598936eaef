"""Reward modelling (``RewardModeling``): fitted as classification on pairs, predicted as
regression, through the ``Laplace`` factory for every subset × structure laplace-torch
supports with it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import Oracle, PairScorer, assert_close, freeze_all_but
from laplace import Laplace

SUBSETS = ["all", "last_layer"]


@pytest.fixture
def reward_data() -> tuple[nn.Module, DataLoader, torch.Tensor]:
    torch.manual_seed(0)
    model = PairScorer().double()
    X = torch.randn(14, 2, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (14,))
    return model, DataLoader(TensorDataset(X, y), batch_size=5), X


@pytest.mark.parametrize("structure", ["kron", "diag", "ekfac"])
@pytest.mark.parametrize("subset", SUBSETS)
def test_reward_modeling_predicts_rewards_with_regression_shapes(reward_data, subset, structure):
    model, loader, X = reward_data
    la = Laplace(model, "reward_modeling", subset, structure)
    la.fit(loader)
    assert_close(la.log_likelihood, -Oracle(model, "classification").loss(X, loader.dataset[:][1]))
    x_test = torch.randn(5, 3, dtype=torch.float64)
    f_mu, f_var = la(x_test)
    assert f_mu.shape == (5, 1) and f_var.shape == (5, 1, 1)
    assert bool((f_var > 0).all())
    assert_close(f_mu, model(x_test))
    _, f_var_diag = la(x_test, diagonal_output=True)
    assert f_var_diag.shape == (5, 1)
    assert la(X[:4], fitting=True).shape == (4, 2)
    assert la.predictive_samples(x_test, n_samples=3).shape == (3, 5, 1)
    assert torch.isfinite(la.log_marginal_likelihood())
    if subset == "last_layer":  # equals all-weights Laplace on the model with a frozen body
        frozen = Laplace(freeze_all_but(model, "net.2"), "reward_modeling", "all", structure)
        frozen.fit(loader)
        assert_close(la.log_marginal_likelihood(), frozen.log_marginal_likelihood())
        for a, b in zip(la(x_test), frozen(x_test)):
            assert_close(a, b)


@pytest.mark.parametrize("structure", ["full", "lowrank", "diag_lowrank"])
def test_reward_modeling_rejects_structures_laplace_torch_does_not_support(structure):
    with pytest.raises(ValueError, match="reward_modeling"):
        Laplace(PairScorer(), "reward_modeling", "all", structure)
