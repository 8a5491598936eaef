"""Large output dimensions of a last layer: diagonal-plus-low-rank output curvatures vs dense.

The large-output paths are exercised on the tiny float64 models with
``LARGE_OUTPUT_THRESHOLD`` lowered (fixture ``large``), and compared with the dense path of the
same approximation (threshold restored) and with dense matrices built from the oracles.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import (
    CASE_BUILDERS,
    POSITION_CASES,
    Oracle,
    assert_close,
    freeze_all_but,
    transformer_case,
)
from laplace import DiagLLLaplace, FullLLLaplace, KronLLLaplace
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN
from laplace.likelihoods.categorical import Categorical
from laplace.structures import large_output as large_output_module
from laplace.utils.diag_lowrank import DiagLowRank
from laplace.utils.errors import TooLargeError
from laplace.utils.matrix import StructuredKron
from laplace.utils.predictive import laplace_bridge

STRUCTURES = {"kron": KronLLLaplace, "diag": DiagLLLaplace, "full": FullLLLaplace}


#: (case, backend): softmax GGN (s = −1), softmax EF (s = +1 with columns), regression (d only).
FITS = {
    "classification-ggn": ("mlp_classification", CurvlinopsGGN),
    "classification-ef": ("mlp_classification", CurvlinopsEF),
    "regression-ggn": ("mlp_regression_3out", CurvlinopsGGN),
}


HYPER = {"prior_precision": 0.8, "temperature": 1.3}


@pytest.fixture
def large(monkeypatch):
    """Lower the threshold so that the tiny models' 3 or 4 outputs count as many."""
    monkeypatch.setattr(large_output_module, "LARGE_OUTPUT_THRESHOLD", 2)
    return monkeypatch


def use_threshold(monkeypatch, value: int) -> None:
    monkeypatch.setattr(large_output_module, "LARGE_OUTPUT_THRESHOLD", value)


def fit_both(monkeypatch, structure: str, fit: str, **kwargs):
    """The approximation fitted through the large-output path and through the dense path."""
    name, backend = FITS[fit]
    case = CASE_BUILDERS[name]()
    sigma = {"sigma_noise": 0.7} if case.likelihood == "regression" else {}
    fitted = []
    for threshold in (2, 10_000):
        use_threshold(monkeypatch, threshold)
        la = STRUCTURES[structure](case.model, case.likelihood, backend=backend, **HYPER, **sigma)
        la.fit(case.loader(), **kwargs)
        fitted.append(la)
    use_threshold(monkeypatch, 2)
    return case, fitted[0], fitted[1]


# -------------------------------------------------------------------- last-layer Laplace, fit
@pytest.mark.parametrize("fit", list(FITS))
def test_kron_last_layer_equals_the_dense_kron_posterior(large, fit):
    _, ours, theirs = fit_both(large, "kron", fit)
    assert isinstance(ours.H_facs, StructuredKron)
    for structured, dense in zip(ours.H_facs.kfacs, theirs.H_facs.kfacs):
        for a, b in zip(structured, dense):
            assert_close(a.to_dense() if isinstance(a, DiagLowRank) else a, b)
    assert_close(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood())
    P = theirs.posterior_precision.to_matrix()
    assert_close(ours.posterior_precision.to_matrix(), P)
    root = ours.posterior_precision.to_matrix(-0.5)
    assert_close(root @ root.T, torch.linalg.inv(P))
    gen = torch.Generator().manual_seed(0)
    assert ours.sample(3, generator=gen).shape == (3, ours.n_params)
    prior = torch.tensor([0.5, 2.0], dtype=torch.float64, requires_grad=True)
    grads = [
        torch.autograd.grad(la.log_marginal_likelihood(prior), prior)[0] for la in (ours, theirs)
    ]
    assert_close(*grads)


@pytest.mark.parametrize("structure", list(STRUCTURES))
@pytest.mark.parametrize("fit", list(FITS))
def test_predictive_variances_equal_those_of_the_dense_posterior(large, structure, fit):
    case, ours, theirs = fit_both(large, structure, fit)
    X = case.X[:5]
    f_mu, f_var = ours.functional_variance_fast(X)
    if case.likelihood == "classification":
        probit, bridge = ours(X, link_approx="probit"), ours(X, link_approx="bridge")
    else:
        _, predictive_var = ours(X, diagonal_output=True)
    use_threshold(large, 10_000)
    ref_mu, ref_cov = theirs._glm_predictive_distribution(X)
    ref_var = ref_cov.diagonal(dim1=1, dim2=2)
    assert_close(f_mu, ref_mu)
    assert_close(f_var, ref_var)
    if case.likelihood == "classification":
        assert_close(probit, theirs(X, link_approx="probit"))
        assert_close(bridge, laplace_bridge(ref_mu, ref_var))  # the bridge of the variances
    else:
        assert_close(predictive_var, ref_var)


@pytest.mark.parametrize("structure", ["diag", "full"])
@pytest.mark.parametrize("fit", ["classification-ggn", "regression-ggn"])
def test_diag_and_full_curvature_equal_the_dense_ggn(large, structure, fit):
    case, ours, _ = fit_both(large, structure, fit)
    ggn = Oracle(freeze_all_but(case.model, "2"), case.likelihood).ggn(case.X)
    assert_close(ours.H, ggn if structure == "full" else ggn.diagonal())


def test_no_dense_output_hessian_is_built(large, monkeypatch):
    def refuse(self, f):
        raise AssertionError("a (B, C, C) output Hessian was built")

    monkeypatch.setattr(Categorical, "output_hessian", refuse)
    monkeypatch.setattr(Categorical, "output_hessian_sqrt", refuse)
    case = CASE_BUILDERS["mlp_classification"]()
    for cls in STRUCTURES.values():
        la = cls(case.model, "classification")
        la.fit(case.loader())
        assert la(case.X[:3]).shape == (3, 4)
        la.optimize_prior_precision(method="marglik", n_steps=3)


def test_truncated_factor_stays_within_its_log_det_bound(large):
    case, exact, _ = fit_both(large, "kron", "classification-ggn")
    truncated = KronLLLaplace(case.model, "classification", output_factor_rank=1, **HYPER)
    truncated.fit(case.loader())
    (G, A), (G_bias,) = truncated.H_facs.kfacs
    assert G.rank == 1 and bool(G.dropped > 0)
    h, delta = 1 / HYPER["temperature"], HYPER["prior_precision"]
    bound = h * (A.trace() * G.dropped + G_bias.dropped) / delta
    error = truncated.log_det_posterior_precision - exact.log_det_posterior_precision
    assert 0 <= float(error) <= float(bound)


def test_online_fit_and_state_dict_round_trip(large):
    case = CASE_BUILDERS["mlp_classification"]()
    whole = KronLLLaplace(case.model, "classification", **HYPER)
    whole.fit(case.loader())
    first, second = (
        DataLoader(TensorDataset(case.X[s], case.y[s])) for s in (slice(0, 12), slice(12, None))
    )
    online = KronLLLaplace(case.model, "classification", **HYPER)
    online.fit(first)
    online.fit(second, override=False)
    assert_close(online.log_marginal_likelihood(), whole.log_marginal_likelihood())
    buffer = io.BytesIO()
    torch.save(whole.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    loaded = KronLLLaplace(case.model, "classification", **HYPER)
    loaded.load_state_dict(state)
    assert_close(loaded.log_marginal_likelihood(), whole.log_marginal_likelihood())
    lower = KronLLLaplace(case.model, "classification", output_factor_rank=2, **HYPER)
    with pytest.raises(ValueError, match=r"rank \d+, more than .*output_factor_rank=2"):
        lower.load_state_dict(state)  # truncating on load would change the posterior
    use_threshold(large, 10_000)
    dense = KronLLLaplace(case.model, "classification", **HYPER)
    with pytest.raises(ValueError, match="diagonal-plus-low-rank factor"):
        dense.load_state_dict(state)


# ------------------------------------------------------------------------ refusals and errors
def test_predictives_that_need_output_covariances_are_refused(large):
    case = CASE_BUILDERS["mlp_classification"]()
    la = KronLLLaplace(case.model, "classification")
    la.fit(case.loader())
    X = case.X[:3]
    with pytest.raises(ValueError, match=r"link_approx='mc' needs the covariance.*probit"):
        la(X, link_approx="mc")
    with pytest.raises(ValueError, match="diagonal_output=True"):
        la.functional_samples(X)
    assert la.functional_samples(X, diagonal_output=True, n_samples=2).shape == (2, 3, 4)
    assert la(X, pred_type="nn", link_approx="mc", n_samples=3).shape == (3, 4)
    regression = CASE_BUILDERS["mlp_regression_3out"]()
    reg = DiagLLLaplace(regression.model, "regression")
    reg.fit(regression.loader())
    for kwargs in ({}, {"joint": True}):
        with pytest.raises(ValueError, match=r"LARGE_OUTPUT_THRESHOLD=2.*diagonal_output=True"):
            reg(regression.X[:3], **kwargs)


def test_sequence_features_go_through_the_native_kfac(large):
    """A head seeing (B, T, D) features has no closed form: the backend's KFAC keeps its
    output factor low rank from few columns, and refuses the exact GGN's C per position."""
    model, loader = transformer_case("average")
    la = KronLLLaplace(model, "classification")
    with pytest.raises(ValueError, match=r"exact GGN.*stochastic.*CurvlinopsEF"):
        la.fit(loader)
    fitted = []
    for threshold in (2, 10_000):
        use_threshold(large, threshold)
        la = KronLLLaplace(model, "classification", backend=CurvlinopsEF, **HYPER)
        la.fit(loader)
        fitted.append(la)
    ours, theirs = fitted
    assert isinstance(ours.H_facs, StructuredKron)
    assert not isinstance(theirs.H_facs, StructuredKron)
    assert_close(ours.H_facs.to_matrix(), theirs.H_facs.to_matrix())
    assert_close(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood())
    with pytest.raises(ValueError, match="output_factor_rank"):
        KronLLLaplace(model, "classification", output_factor_rank=0)


def test_a_dense_head_curvature_larger_than_memory_is_refused_before_any_work():
    model = nn.Sequential(nn.Linear(3, 16), nn.Linear(16, 200_000))
    with pytest.raises(TooLargeError, match=r"P=3,400,000 .*GiB.*'kron' or 'diag'"):
        FullLLLaplace(model, "classification", last_layer_name="1")
    la = FullLLLaplace(model, "classification")

    class Loader(DataLoader):
        def __iter__(self):
            self.batches = getattr(self, "batches", 0) + 1
            return super().__iter__()

    loader = Loader(TensorDataset(torch.randn(4, 3), torch.zeros(4, dtype=torch.long)))
    with pytest.raises(TooLargeError):
        la.fit(loader)
    assert loader.batches == 1  # only the batch that finds the last layer was drawn


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_a_prediction_estimate_counts_variances_only(large, structure):
    """Above the threshold a GLM prediction forms (R, C) variances: no (R, C, C) is counted."""
    case = CASE_BUILDERS["mlp_classification"]()
    la = STRUCTURES[structure](case.model, case.likelihood)
    la.fit(case.loader())
    plan = la._glm_plan()
    assert plan.variances_only is not None
    n_rows, n_out, itemsize = 5, la.n_outputs, plan.posterior.itemsize
    with_covariances = plan.posterior.prediction_bytes(n_rows, n_out, plan.kind)
    variances = plan.posterior.prediction_bytes(n_rows, n_out, plan.kind, variances_only=True)
    assert with_covariances - variances == n_rows * n_out * (n_out - 1) * itemsize


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_token_outputs_with_dropped_positions_equal_the_dense_path(large, structure):
    case = POSITION_CASES["token_classification"]()  # (B, T, C) logits, some labels −100
    fitted = []
    for threshold in (2, 10_000):
        use_threshold(large, threshold)
        la = STRUCTURES[structure](case.model, "classification", **HYPER)
        la.fit(case.loader())
        fitted.append(la)
    ours, theirs = fitted
    use_threshold(large, 2)
    dense_H = lambda la: la.H_facs.to_matrix() if structure == "kron" else la.H  # noqa: E731
    assert_close(dense_H(ours), dense_H(theirs))
    assert_close(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood())
    f_mu, f_var = ours.functional_variance_fast(case.X[:3])
    assert f_var.shape == f_mu.shape == (3, 5, 4)
    use_threshold(large, 10_000)
    _, ref_var = theirs.functional_variance_fast(case.X[:3])
    assert_close(f_var, ref_var)
