"""``enable_backprop`` (gradients of the GLM predictive w.r.t. the inputs) and reward modelling.

Both are checked through the public ``Laplace`` factory for every subset × structure that
laplace-torch supports with them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, Oracle, assert_close, freeze_all_but
from laplace import Laplace

STRUCTURES = ["full", "kron", "diag"]
SUBSETS = ["all", "last_layer"]


def finite_difference(fn, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Central differences of a scalar function of ``x``, one coordinate at a time."""
    numeric = torch.zeros_like(x)
    flat = numeric.view(-1)
    for i in range(x.numel()):
        step = torch.zeros_like(x).view(-1)
        step[i] = eps
        step = step.view_as(x)
        flat[i] = (fn(x + step) - fn(x - step)).detach() / (2 * eps)
    return numeric


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("subset", SUBSETS)
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_enable_backprop_gradients_equal_finite_differences(subset, structure, likelihood):
    case = CASE_BUILDERS[
        "mlp_regression_3out" if likelihood == "regression" else "mlp_classification"
    ]()
    la = Laplace(case.model, likelihood, subset, structure, enable_backprop=True)
    la.fit(case.loader())
    x = case.X[:3].clone().requires_grad_()

    def objective(inputs: torch.Tensor) -> torch.Tensor:
        if likelihood == "classification":
            return (la(inputs, link_approx="probit") * torch.arange(1.0, 5.0).double()).sum()
        f_mu, f_var = la(inputs)
        return f_mu.sum() + f_var.sum()

    (grad,) = torch.autograd.grad(objective(x), x)
    assert grad.abs().sum() > 0
    assert_close(grad, finite_difference(objective, x), rtol=1e-5, atol=1e-7)


def test_without_enable_backprop_the_predictive_is_detached(regression_case):
    la = Laplace(regression_case.model, "regression", "all", "full")
    la.fit(regression_case.loader())
    f_mu, f_var = la(regression_case.X[:2].clone().requires_grad_())
    assert not f_mu.requires_grad and not f_var.requires_grad


class PairScorer(nn.Module):
    """Single-output reward model: (B, 2, D) pairs → (B, 2) logits, (B, D) → (B, 1) rewards."""

    def __init__(self, n_in: int = 3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_in, 4), nn.Tanh(), nn.Linear(4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            return self.net(x.reshape(-1, x.shape[-1])).reshape(x.shape[0], 2)
        return self.net(x)


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
