"""Before ``fit`` the posterior is the prior (laplace-torch's unfitted state).

With no data the curvature is zero: ``H`` is a zero curvature in the structure's own form,
``mean`` is the prior mean, and every posterior quantity that needs no data (precision,
log-determinants, ``scatter``, ``square_norm``, ``log_prob``) is that of the prior
``N(μ₀, diag(p₀)⁻¹)``, checked here against ``torch.distributions``. Predictions, samples and the
marginal likelihood (which needs the data's log-likelihood) refuse with a clear error.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Normal
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, assert_close
from laplace import (
    DiagLaplace,
    DiagLLLaplace,
    DiagSubnetLaplace,
    FullLaplace,
    FullLLLaplace,
    FullSubnetLaplace,
    KronLaplace,
    KronLLLaplace,
    LowRankLaplace,
)
from laplace.curvature import CurvlinopsGGN
from laplace.utils.errors import NotFittedError
from laplace.utils.matrix import Kron

SUBNET = torch.tensor([7, 2, 30, 11])
#: (class, extra constructor arguments); last-layer classes name their layer.
CLASSES = {
    "full": (FullLaplace, {}),
    "diag": (DiagLaplace, {}),
    "kron": (KronLaplace, {}),
    "lowrank": (LowRankLaplace, {}),
    "full_ll": (FullLLLaplace, {"last_layer_name": "2"}),
    "diag_ll": (DiagLLLaplace, {"last_layer_name": "2"}),
    "kron_ll": (KronLLLaplace, {"last_layer_name": "2"}),
    "full_subnet": (FullSubnetLaplace, {"subnetwork_indices": SUBNET}),
    "diag_subnet": (DiagSubnetLaplace, {"subnetwork_indices": SUBNET}),
}


#: A prior precision per class: scalar, layer-wise or diagonal (P = 38 weights, 18 in the head).
PRIORS = {
    "full": torch.tensor([0.5, 1.5, 2.0, 3.0]),
    "diag": torch.linspace(0.5, 3.0, 38),
    "kron": torch.tensor([0.5, 1.5, 2.0, 3.0]),
    "lowrank": 2.0,
    "full_ll": torch.tensor([0.5, 2.0]),
    "diag_ll": torch.linspace(0.5, 3.0, 18),
    "kron_ll": torch.tensor([0.5, 2.0]),
    "full_subnet": torch.linspace(0.5, 3.0, 4),
    "diag_subnet": 2.0,
}


def _build(name: str, **kwargs):
    case = CASE_BUILDERS["mlp_regression_3out"]()
    cls, extra = CLASSES[name]
    return case, cls(case.model, "regression", **extra, **kwargs)


def _covered_weights(name: str, model) -> torch.Tensor:
    """The model's values of the weights the posterior covers, shape (P,)."""
    if name.endswith("subnet"):
        return torch.cat([p.detach().flatten() for p in model.parameters()])[SUBNET]
    layer = model[2] if name.endswith("_ll") else model
    return torch.cat([p.detach().flatten() for p in layer.parameters()])


def _dense(H) -> torch.Tensor:
    """A curvature or precision in any structure's form as a dense matrix."""
    if isinstance(H, Kron):
        return H.to_matrix()
    if isinstance(H, tuple):  # low rank: (U, λ), or the precision ((U, λ), diagonal)
        (U, eigenvalues), diagonal = H if isinstance(H[0], tuple) else (H, None)
        dense = U @ torch.diag(eigenvalues) @ U.T
        return dense if diagonal is None else dense + torch.diag(diagonal)
    if hasattr(H, "to_matrix"):  # KronDecomposed
        return H.to_matrix()
    return torch.diag(H) if H.dim() == 1 else H


@pytest.mark.parametrize("name", list(CLASSES))
def test_unfitted_posterior_is_the_prior(name):
    case, la = _build(name, prior_precision=PRIORS[name], prior_mean=0.3)
    theta_map = _covered_weights(name, case.model)
    P = len(theta_map)
    p0 = la.prior_precision_diag
    assert p0.shape == (P,)
    # H: a zero curvature in the structure's own form
    kind = name.split("_")[0]
    if kind in ("full", "diag"):
        assert la.H.shape == ((P, P) if kind == "full" else (P,))
    elif kind == "kron":
        assert isinstance(la.H, Kron) and la.H_facs is None
        assert [[tuple(F.shape) for F in b] for b in la.H.kfacs] == [
            [(p.shape[0], p.shape[0]), (p.shape[1], p.shape[1])]
            if p.dim() == 2
            else [(len(p),) * 2]
            for p in la.params
        ]
    else:
        assert la.H[0].shape == (P, 0) and la.H[1].shape == (0,)
    assert_close(_dense(la.H), torch.zeros(P, P, dtype=torch.float64))
    # mean: the prior mean (the subnetwork's other weights stay at the MAP)
    mean = la.mean_subnet if name.endswith("subnet") else la.mean
    assert_close(mean, torch.full((P,), 0.3, dtype=torch.float64))
    if name.endswith("subnet"):
        theta = torch.cat([p.detach().flatten() for p in case.model.parameters()])
        theta[SUBNET] = 0.3
        assert_close(la.mean, theta)
    # the posterior precision is the prior's, in the structure's representation
    assert_close(_dense(la.posterior_precision), torch.diag(p0))
    # marginal-likelihood pieces that need no data
    zero = torch.tensor(0.0, dtype=torch.float64)
    assert_close(la.log_det_prior_precision, p0.log().sum())
    assert_close(la.log_det_posterior_precision, p0.log().sum())
    assert_close(la.log_det_ratio, zero)
    assert_close(la.scatter, zero)
    # square_norm and log_prob are those of the prior N(μ₀, diag(p₀)⁻¹)
    value = theta_map + 0.1
    prior = Normal(torch.full((P,), 0.3, dtype=torch.float64), p0.rsqrt())
    assert_close(la.square_norm(value), ((value - 0.3).square() * p0).sum())
    assert_close(la.log_prob(value), prior.log_prob(value).sum())
    unnormalised = -0.5 * ((value - 0.3).square() * p0).sum()
    assert_close(la.log_prob(value, normalized=False), unnormalised)


@pytest.mark.parametrize("name", list(CLASSES))
def test_predictions_samples_and_marglik_need_fit(name):
    case, la = _build(name)
    for action in (
        lambda: la(case.X[:2]),
        lambda: la.predictive_samples(case.X[:2], n_samples=2),
        lambda: la.sample(2),
        la.log_marginal_likelihood,
        lambda: la.log_likelihood,
        la.state_dict,
    ):
        with pytest.raises(RuntimeError, match="call fit\\(\\) first"):
            action()


@pytest.mark.parametrize("name", ["full", "diag", "kron", "lowrank", "full_subnet"])
def test_init_H_resets_to_the_prior_and_fit_starts_from_it(name):
    case, la = _build(name, prior_precision=2.0)
    zero = _dense(la.H).clone()
    la.fit(case.loader())
    fitted = la.log_det_posterior_precision.clone()
    assert not torch.allclose(fitted, la.log_det_prior_precision)
    la._init_H()
    assert_close(_dense(la.H), zero)
    assert_close(la.log_det_posterior_precision, la.log_det_prior_precision)
    # fit(override=False) on an unfitted approximation equals a plain fit
    if name != "lowrank":
        _, fresh = _build(name, prior_precision=2.0)
        fresh.fit(case.loader(), override=False)
        assert_close(fresh.log_det_posterior_precision, fitted)


def test_unfitted_mean_follows_the_prior_mean_and_fit_sets_the_map():
    case, la = _build("diag")
    assert_close(la.mean, torch.zeros(la.n_params, dtype=torch.float64))
    la.prior_mean = torch.full((la.n_params,), -1.0, dtype=torch.float64)
    assert_close(la.mean, la.prior_mean)
    la.fit(case.loader())
    theta = torch.cat([p.detach().flatten() for p in case.model.parameters()])
    assert_close(la.mean, theta)
    assert_close(la.scatter, ((theta + 1.0).square() * la.prior_precision_diag).sum())


@pytest.mark.parametrize("cls", [FullLLLaplace, DiagLLLaplace, KronLLLaplace])
def test_last_layer_unknown_keeps_none_and_raises_attribute_errors(cls):
    case = CASE_BUILDERS["mlp_classification"]()
    la = cls(case.model, "classification", prior_mean=0.5)
    assert la.mean is None and la.H is None and la.n_params is None
    assert la.backend is CurvlinopsGGN  # the class chosen, readable before the layer is known
    for name in ("posterior_precision", "prior_precision_diag", "log_det_ratio"):
        assert not hasattr(la, name)  # the error is an AttributeError ...
        assert getattr(la, name, "default") == "default"
        with pytest.raises(RuntimeError, match="last layer is not known yet"):
            getattr(la, name)  # ... and a RuntimeError, with our message
    with pytest.raises(NotFittedError, match="last layer is not known yet"):
        la._init_H()
    # once the layer is found (first batch of fit) the fitted posterior replaces the prior
    la.fit(case.loader())
    assert la.mean.shape == (la.n_params,) == (24,)
    assert_close(la.mean, torch.cat([case.model[2].weight.flatten(), case.model[2].bias]))


@pytest.mark.parametrize("name", ["full", "kron", "full_ll"])
def test_a_failed_first_fit_leaves_the_prior(name):
    case, la = _build(name, prior_mean=0.3)
    X = case.X.clone()
    X[9, 0] = float("nan")  # the second batch fails
    with pytest.raises(ValueError, match="NaN"):
        la.fit(DataLoader(TensorDataset(X, case.y), batch_size=7))
    P = len(_covered_weights(name, case.model))
    assert_close(_dense(la.H), torch.zeros(P, P, dtype=torch.float64))
    assert_close(la.mean, torch.full((P,), 0.3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="call fit"):
        la(case.X[:2])
