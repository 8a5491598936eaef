"""``likelihood="heteroscedastic_regression"``: outputs [μ, log σ²], what surrounds the oracles.

Curvature, marginal likelihood and predictive moments are checked against oracles in
``test_likelihoods.py``.
"""

from __future__ import annotations

import pytest
import torch
from likelihood_cases import LikelihoodOracle, heteroscedastic_case
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import assert_close
from laplace import Laplace, marglik_training
from laplace.curvature import AsdlGGN, BackPackGGN, CurvlinopsHessian
from laplace.evaluation import evaluate
from laplace.likelihoods import HeteroscedasticGaussianNLLLoss, make_likelihood

HETERO = "heteroscedastic_regression"


def test_loss_module_is_torchs_gaussian_nll():
    case = heteroscedastic_case()
    f = case.model(case.X).detach()
    mu, s = f.chunk(2, dim=-1)
    expected = nn.GaussianNLLLoss()(mu, case.y, s.exp())
    assert_close(HeteroscedasticGaussianNLLLoss()(f, case.y), expected)
    assert make_likelihood(HETERO).loss_module().reduction == "mean"


def test_noise_is_not_a_hyperparameter_and_targets_are_checked():
    case = heteroscedastic_case()
    with pytest.raises(ValueError, match=r"sigma_noise must be 1 for .*heteroscedastic"):
        Laplace(case.model, HETERO, "all", "diag", sigma_noise=0.3)
    la = Laplace(case.model, HETERO, "all", "diag")
    with pytest.raises(ValueError, match=r"do not match the means of the model output.*\(5, 2\)"):
        la.fit(DataLoader(TensorDataset(case.X, torch.zeros(20, 4).double()), batch_size=5))
    odd = nn.Linear(3, 3).double()
    la = Laplace(odd, HETERO, "all", "diag")
    with pytest.raises(ValueError, match=r"outputs \(B, 2C\).*3 outputs"):
        la.fit(case.loader())


def test_structures_and_backends_that_cannot_are_refused():
    case = heteroscedastic_case()
    with pytest.raises(
        ValueError, match=r"hessian_structure in \['full', 'diag', 'kron', 'ekfac', 'gp'\]"
    ):
        Laplace(case.model, HETERO, "all", "lowrank")
    with pytest.raises(ValueError, match="no low-rank Laplace"):
        from laplace import LowRankLaplace

        LowRankLaplace(case.model, HETERO)
    with pytest.raises(ValueError, match=r"function-space.*'nystrom'.*\['sod'\]"):
        from laplace import ELLA

        ELLA(case.model, HETERO, subsample_size=5, n_eigenvalues=3)
    for backend in (AsdlGGN, BackPackGGN):
        with pytest.raises(ValueError, match=r"HeteroscedasticGaussianNLLLoss.*CurvlinopsGGN"):
            Laplace(case.model, HETERO, "all", "diag", backend=backend)
    la = Laplace(case.model, HETERO, "all", "diag")
    la.fit(case.loader())
    with pytest.raises(ValueError, match="heteroscedastic predictions have no joint form"):
        la(case.X[:2], joint=True)


def test_kron_and_the_exact_hessian_fit():
    case = heteroscedastic_case()
    for structure in ("kron", "ekfac"):
        la = Laplace(case.model, HETERO, "all", structure)
        la.fit(case.loader())
        assert torch.isfinite(la.log_marginal_likelihood())
    hessian = Laplace(case.model, HETERO, "all", "full", backend=CurvlinopsHessian)
    hessian.fit(case.loader())
    oracle = LikelihoodOracle(case)
    exact = torch.func.hessian(lambda t: oracle.nll(case.X, case.y, t))(oracle.theta)
    assert_close(hessian.H, exact)


def _noisy_data(n: int = 160):
    torch.manual_seed(0)
    X = torch.linspace(0, 4, n, dtype=torch.float64).unsqueeze(-1)
    y = torch.sin(X) + (0.05 + 0.2 * X) * torch.randn(n, 1, dtype=torch.float64)
    return X, y


def test_marglik_training_learns_noise_that_grows_with_x():
    X, y = _noisy_data()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 2)).double()
    loader = DataLoader(TensorDataset(X, y), batch_size=40, shuffle=True)
    la, model, margliks, _ = marglik_training(
        model, loader, likelihood=HETERO, n_epochs=120, optimizer_kwargs={"lr": 1e-2}
    )
    prediction = la(torch.tensor([[0.2], [3.8]], dtype=torch.float64))
    noise = prediction.aleatoric_variance.sqrt().squeeze(-1)
    assert noise[0] < 0.3 and 0.5 < noise[1] < 1.3  # true σ: 0.09 and 0.81
    assert margliks[-1] < margliks[0]


def test_tuning_evaluate_and_state_dict():
    X, y = _noisy_data(60)
    model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    loader = DataLoader(TensorDataset(X, y), batch_size=20)
    la = Laplace(model, HETERO, "last_layer", "kron")
    la.fit(loader)
    la.optimize_prior_precision(n_steps=10)
    la.optimize_prior_precision(method="gridsearch", val_loader=loader, grid_size=4)
    default = la.prior_precision.clone()
    la.optimize_prior_precision(method="gridsearch", val_loader=loader, grid_size=4, loss="nll")
    assert_close(la.prior_precision, default)  # the default is the predictive's Gaussian NLL
    la.optimize_prior_precision(method="gridsearch", val_loader=loader, grid_size=4, loss="crps")
    result = evaluate(la, loader)
    assert set(result) >= {"nll", "rmse", "crps", "coverage"}
    fresh = Laplace(model, HETERO, "last_layer", "kron")
    fresh.load_state_dict(la.state_dict())
    assert_close(fresh(X[:4]).variance, la(X[:4]).variance)
