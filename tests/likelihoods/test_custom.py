"""Your own likelihood through the public protocol ``laplace.likelihoods.Likelihood``.

The Poisson example of ``docs/likelihoods.md`` runs the oracle battery of the built-in
likelihoods in ``test_likelihoods.py`` (``poisson_2``); this file checks the protocol:
what a subclass must implement, the defaults, and the parts of the library around it.
"""

from __future__ import annotations

import pytest
import torch
from likelihood_cases import LikelihoodOracle, poisson_case, poisson_class
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import assert_close
from laplace import Laplace, marglik_training
from laplace.curvature import BackPackGGN, CurvlinopsGGN
from laplace.likelihoods import Likelihood


class SqrtPoisson(Likelihood):
    """The docs' Poisson with the Hessian's square root instead of the Hessian, no sampler."""

    def loss(self, f, y):
        return (f.exp() - y * f).sum(-1)

    def output_hessian_sqrt(self, f):
        return torch.diag_embed((0.5 * f).exp())


def test_the_object_is_the_likelihood_and_its_name_is_stored():
    case = poisson_case()
    la = Laplace(case.model, case.likelihood, "all", "diag")
    assert la.likelihood is case.likelihood
    la.fit(case.loader())
    assert la.state_dict()["likelihood"] == "Poisson"
    fresh = Laplace(case.model, poisson_class()(), "all", "diag")
    fresh.load_state_dict(la.state_dict())
    assert_close(fresh.log_marginal_likelihood(), la.log_marginal_likelihood())


def test_hessian_square_root_gives_the_same_curvature_and_defaults_apply():
    case = poisson_case()
    reference = Laplace(case.model, case.likelihood, "all", "full")
    reference.fit(case.loader())
    la = Laplace(case.model, SqrtPoisson(), "all", "full")
    la.fit(case.loader())
    assert_close(la.H, reference.H)
    log_y_factorial = torch.lgamma(case.y + 1).sum()
    assert_close(la.loss, reference.loss - log_y_factorial)  # no log_normalizer: 0
    generator = torch.Generator().manual_seed(0)
    mc = la(case.X[:3], n_samples=20_000, generator=generator)  # default: MC mean of f
    J = LikelihoodOracle(case).jacobian(case.X[:3])
    f_var = J @ torch.linalg.inv(la.posterior_precision) @ J.transpose(1, 2)
    tolerance = 5 * f_var.diagonal(dim1=-2, dim2=-1).sqrt() / 20_000**0.5
    assert torch.all((mc - case.model(case.X[:3]).detach()).abs() <= tolerance)
    assert la.predictive_samples(case.X[:3], n_samples=4).shape == (4, 3, 2)


def test_kron_last_layer_and_a_monte_carlo_fisher_without_sampler():
    case = poisson_case()
    combinations = [("all", "kron"), ("last_layer", "kron"), ("last_layer", "diag")]
    for subset, structure in [*combinations, ("all", "ekfac"), ("last_layer", "ekfac")]:
        la = Laplace(case.model, case.likelihood, subset, structure)
        la.fit(case.loader())
        assert torch.isfinite(la.log_marginal_likelihood())
    without_sampler = Laplace(
        case.model, SqrtPoisson(), "all", "diag", backend_kwargs={"stochastic": True}
    )
    with pytest.raises(NotImplementedError, match="SqrtPoisson does not implement sample"):
        without_sampler.fit(case.loader())


def test_what_a_likelihood_must_implement():
    class NoHessian(Likelihood):
        def loss(self, f, y):
            return f.sum(-1)

    class NoLoss(Likelihood):
        def output_hessian(self, f):
            return torch.diag_embed(torch.ones_like(f))

    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match="NoHessian must implement output_hessian or"):
        Laplace(model, NoHessian(), "all", "diag")
    with pytest.raises(TypeError, match="NoLoss must implement loss"):
        Laplace(model, NoLoss(), "all", "diag")
    with pytest.raises(ValueError, match=r"likelihood='poisson' is not supported.*Likelihood"):
        Laplace(model, "poisson", "all", "diag")


def test_unsupported_combinations_name_what_works():
    case = poisson_case()
    with pytest.raises(
        ValueError, match=r"hessian_structure in \['full', 'diag', 'kron', 'ekfac'\]"
    ):
        Laplace(case.model, case.likelihood, "all", "lowrank")
    with pytest.raises(ValueError, match=r"Poisson.*CurvlinopsGGN"):
        Laplace(case.model, case.likelihood, "all", "diag", backend=BackPackGGN)
    with pytest.raises(ValueError, match="sigma_noise must be 1 for likelihood='Poisson'"):
        Laplace(case.model, case.likelihood, "all", "diag", sigma_noise=2.0)
    la = Laplace(case.model, case.likelihood, "all", "diag")
    with pytest.raises(ValueError, match="non-negative counts"):
        la.fit(DataLoader(TensorDataset(case.X, -case.y), batch_size=5))


def test_tuning_and_marglik_training():
    torch.manual_seed(0)
    X = torch.rand(120, 1, dtype=torch.float64) * 2
    y = torch.poisson(torch.exp(1 + X))
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    loader = DataLoader(TensorDataset(X, y), batch_size=40)
    la, model, margliks, losses = marglik_training(
        model,
        loader,
        likelihood=poisson_class()(),
        hessian_structure="full",
        backend=CurvlinopsGGN,
        n_epochs=60,
        optimizer_kwargs={"lr": 1e-2},
    )
    assert losses[-1] < losses[0] and margliks[-1] < margliks[0]
    rate = la(torch.tensor([[0.0], [2.0]], dtype=torch.float64)).squeeze(-1)
    assert_close(rate, torch.exp(torch.tensor([1.0, 3.0], dtype=torch.float64)), rtol=0.25)
    la.optimize_prior_precision(method="gridsearch", val_loader=loader, grid_size=4)
