"""ELLA: function-space Laplace with a Nyström basis."""

from __future__ import annotations

import io

import pytest
import torch
from functional_cases import HYPER, _fitted_functional, ella, regression_data
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from conftest import CASE_BUILDERS, PairScorer, assert_close
from laplace import ELLA, Laplace
from laplace.baselaplace import ELLA as ELLAFromBaselaplace

#: ELLA with a complete basis vs FullLaplace: both are exact, only round-off differs.
EXACT_RTOL, EXACT_ATOL = 1e-7, 1e-12


#: Absolute gap allowed between a rank-10 ELLA and the exact predictive variances.
LOW_RANK_ATOL = 0.02


def full_laplace(model, loader):
    full = Laplace(model, "regression", "all", "full", **HYPER)
    full.fit(loader)
    return full


def test_ella_with_all_eigenvalues_equals_the_full_laplace_glm_predictive():
    model, _, loader = regression_data()
    la = ella(model, loader, 40, 26, **HYPER)  # N > P: the basis spans all of R^P
    assert type(la) is ELLA is ELLAFromBaselaplace
    full = full_laplace(model, loader)
    X_test = torch.randn(6, 3, dtype=torch.float64)
    for joint in (False, True):
        for a, b in zip(la(X_test, joint=joint), full(X_test, joint=joint)):
            assert_close(a, b, rtol=EXACT_RTOL, atol=EXACT_ATOL)
    Js, _ = full.backend.jacobians(X_test)
    assert_close(la.functional_variance(Js), full.functional_variance(Js), EXACT_RTOL, EXACT_ATOL)


def test_ella_with_the_whole_subset_is_exact_at_the_training_inputs():
    model, X, loader = regression_data(n=15)  # N < P: exact on the span of the data
    la = ella(model, loader, 15, 15, **HYPER)
    full = full_laplace(model, loader)
    for a, b in zip(la(X, joint=True), full(X, joint=True)):
        assert_close(a, b, rtol=EXACT_RTOL, atol=EXACT_ATOL)


def test_ella_with_fewer_eigenvalues_is_a_psd_approximation_close_to_exact():
    model, _, loader = regression_data()
    la = ella(model, loader, 40, 10, **HYPER)
    exact = full_laplace(model, loader)
    X_test = torch.randn(8, 3, dtype=torch.float64)
    _, cov = la.predictive_moments(X_test, joint=True)
    assert bool((torch.linalg.eigvalsh(cov) > -1e-12).all())
    assert_close(la(X_test)[1], exact(X_test)[1], rtol=0.0, atol=LOW_RANK_ATOL)
    assert la.dual_directions.shape == (26, 10)
    assert_close(la.dual_directions.T @ la.dual_directions, torch.eye(10), atol=1e-10)


def test_ella_classification_shapes_samples_and_history():
    case = CASE_BUILDERS["mlp_classification"]()
    la = ella(case.model, case.loader(), 12, 6, likelihood="classification")
    probs = la(case.X[:5])
    assert probs.shape == (5, 4)
    assert_close(probs.sum(-1), torch.ones(5))
    assert la.functional_samples(case.X[:5], n_samples=3).shape == (3, 5, 4)
    assert la.predictive_samples(case.X[:5], n_samples=3).shape == (3, 5, 4)
    assert la.fit_history_["processed_examples"][-1] == 20.0
    balanced = ella(case.model, case.loader(), 8, 4, likelihood="classification")
    balanced.fit(case.loader(), balanced=True, val_loader=case.loader())
    assert len(balanced.fit_history_["val_nll"]) == 1


def test_ella_gridsearch_and_missing_marglik():
    model, _, loader = regression_data()
    la = ella(model, loader, 20, 8)
    la.optimize_prior_precision(val_loader=loader, grid_size=5)
    assert len(la.fit_history_["tuning"]) == 5
    best = min(la.fit_history_["tuning"], key=lambda r: r["val_nll"])
    assert float(la.prior_precision) == pytest.approx(best["prior_precision"])
    with pytest.raises(NotImplementedError, match="gridsearch"):
        la.optimize_prior_precision(method="marglik")
    with pytest.raises(NotImplementedError, match="marginal likelihood"):
        la.log_marginal_likelihood()


def test_ella_state_dict_round_trip_with_weights_only():
    model, _, loader = regression_data()
    la = ella(model, loader, 20, 8, **HYPER)
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    restored = ELLA(model, "regression", 1, 1)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    X_test = torch.randn(4, 3, dtype=torch.float64)
    for a, b in zip(restored(X_test), la(X_test)):
        assert_close(a, b)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(ValueError, match="MAP weights"):
        ELLA(model, "regression", 1, 1).load_state_dict(la.state_dict())


def test_ella_predicts_with_its_final_posterior_after_validation_steps_and_refits():
    model, X, loader = regression_data()  # 6 batches: validations after batches 2, 4 and 6
    plain = ella(model, loader, 20, 8, **HYPER)
    validated = ELLA(model, "regression", 20, 8, **HYPER)
    validated.fit(loader, val_loader=loader, val_steps=2)
    assert len(validated.fit_history_["val_nll"]) == 3
    first_data = DataLoader(torch.utils.data.Subset(loader.dataset, range(25)), batch_size=7)
    refitted = ella(model, first_data, 20, 8, **HYPER)
    refitted(X[:2])
    refitted.fit(loader)
    for la in (validated, refitted):
        for a, b in zip(la(X[:4]), plain(X[:4])):
            assert_close(a, b)


def test_ella_bad_inputs_raise_clear_errors():
    model, _, loader = regression_data()
    with pytest.raises(ValueError, match="n_eigenvalues <= subsample_size"):
        ELLA(model, "regression", subsample_size=5, n_eigenvalues=6)
    with pytest.raises(ValueError, match="subset_of_weights='all'"):
        Laplace(model, "regression", "last_layer", "gp", functional_approximation="nystrom")
    with pytest.raises(ValueError, match="scalar prior_precision"):
        ELLA(model, "regression", 5, 2, prior_precision=torch.ones(3))
    with pytest.raises(ValueError, match="exceeds"):
        ELLA(model, "regression", 50, 2).fit(loader)
    with pytest.raises(ValueError, match="numerical rank"):
        ELLA(model, "regression", 40, 30).fit(loader)
    with pytest.raises(RuntimeError, match="fit"):
        ELLA(model, "regression", 5, 2)(torch.randn(2, 3, dtype=torch.float64))


def test_reward_modeling_ella_predicts_pair_probabilities_when_fitting():
    torch.manual_seed(0)
    model = PairScorer().double()
    X = torch.randn(12, 2, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (12,))
    la = Laplace(
        model,
        "reward_modeling",
        subset_of_weights="all",
        hessian_structure="gp",
        functional_approximation="nystrom",
        n_eigenvalues=5,
        subsample_size=10,
    )
    la.fit(DataLoader(TensorDataset(X, y), batch_size=5))
    probs = la(X[:3], pred_type="gp", fitting=True)
    assert probs.shape == (3, 2)
    assert_close(probs.sum(-1), torch.ones(3, dtype=torch.float64))
    f_mu, f_var = la(torch.randn(4, 3, dtype=torch.float64), pred_type="gp")
    assert f_mu.shape == (4, 1) and f_var.shape == (4, 1, 1)


def test_validation_nll_is_a_tensor_and_the_history_holds_floats():
    model, _, loader = regression_data()
    la = Laplace(
        model, "regression", "all", "gp", functional_approximation="nystrom",
        subsample_size=10, n_eigenvalues=3,
    )  # fmt: skip
    la.fit(loader, val_loader=loader)
    score = la._validation_nll(loader)
    assert isinstance(score, torch.Tensor) and score.dim() == 0
    assert all(type(value) is float for value in la.fit_history_["val_nll"])
    assert la.fit_history_["val_nll"][-1] == pytest.approx(float(score))


@pytest.mark.parametrize(
    ("call", "phrase"),
    [
        (lambda m, X, loader: ella(m, loader, 10, 3, likelihood="classification", sigma_noise=2.0),
         "only available for regression"),
        (lambda m, X, loader: ella(m, loader, 2.5, 1), "n_eigenvalues"),
        (lambda m, X, loader: ella(m, loader, 10, 3).fit(loader, val_steps=0),
         "val_steps must be positive"),
        (lambda m, X, loader: Laplace(m, "regression", "all", "diag",
                                 functional_approximation="nystrom"),
         "requires hessian_structure"),
        (lambda m, X, loader: ella(
            torch.nn.Linear(1, 1, bias=False).double(),
            DataLoader(TensorDataset(torch.ones(4, 1).double(), torch.ones(4, 1).double())),
            2, 2),
         "insufficient positive rank"),
    ],
)  # fmt: skip
def test_errors_carry_laplace_torchs_wording(call, phrase):
    # Code written against laplace-torch matches these phrases; ours follow them.
    model, X, loader = regression_data()
    with pytest.raises(ValueError, match=phrase):
        call(model, X, loader)


# ------------------------------------------------------------------- hooks a subclass can use
class FirstPointsELLA(ELLA):
    """ELLA whose Nyström subset is the first ``subsample_size`` points of the dataset."""

    def _indices(self, loader, balanced):
        return torch.arange(self.subsample_size)


def test_ella_basis_spans_the_jacobians_of_the_points_its_indices_hook_chooses():
    model, X, loader = regression_data(n=20)  # one output: each point's Jacobian row is J(x)
    la = FirstPointsELLA(model, "regression", subsample_size=5, n_eigenvalues=5)
    la.fit(loader)
    V = la.dual_directions
    J = la.backend.jacobians(X)[0][:, 0].double()  # (N, P)
    projected = J @ V @ V.T
    assert_close(projected[:5], J[:5], rtol=1e-9, atol=1e-12)
    assert float((projected[5:] - J[5:]).norm()) > 1e-3  # other points leave the span
    phi, f = la._features(X[:3])
    assert_close(phi, (J[:3] @ V)[:, None], rtol=1e-12, atol=1e-12)
    assert_close(f, model(X[:3]))
    assert la.feature_gram.shape == (5, 5)


def test_ella_indices_hook_draws_among_the_points_the_loader_reaches_and_balances_classes():
    X = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0] * 11 + [1])
    case = CASE_BUILDERS["mlp_classification"]()
    la = ELLA(case.model.float(), "classification", subsample_size=4, n_eigenvalues=2, seed=3)
    sampled = DataLoader(TensorDataset(X, y), batch_size=4, sampler=SubsetRandomSampler(range(8)))
    assert set(la._indices(sampled, balanced=False).tolist()) <= set(range(8))
    everything = DataLoader(TensorDataset(X, y), batch_size=4)
    balanced = la._indices(everything, balanced=True)
    assert len(balanced) == 4 and 11 in balanced.tolist()  # the one point of class 1
    with pytest.raises(ValueError, match="balanced=True needs classification"):
        ELLA(torch.nn.Linear(3, 1), "regression", 4, 2)._indices(everything, balanced=True)


def test_ella_tunes_its_prior_precision_on_vector_validation_targets():
    model, X, loader = regression_data(n=15)
    y = loader.dataset.tensors[1]
    histories = []
    for targets in (y, y[:, 0]):
        la = _fitted_functional("nystrom", model, X, loader)
        val_loader = DataLoader(TensorDataset(X[:8], targets[:8]), batch_size=3)
        la.optimize_prior_precision(val_loader=val_loader, grid_size=5)
        histories.append(la.fit_history_["tuning"])
    assert histories[0] == histories[1]
