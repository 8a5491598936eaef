"""laplace-torch code keeps working: the same exception types, hooks and module paths.

Where our natural exception type differs from laplace-torch's, ours derives from both
(``laplace.utils.errors``), so code catching either keeps working; the messages name the argument
and the accepted values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, DictDataset, Oracle, assert_close, dict_case
from laplace import (
    ELLA,
    DiagLaplace,
    FullLaplace,
    FullLLLaplace,
    FullSubnetLaplace,
    FunctionalLaplace,
    KronLLLaplace,
    Laplace,
    LowRankLaplace,
    VaLLA,
)
from laplace.curvature import BackPackEF, BackPackGGN
from laplace.utils import FeatureExtractor, LastLayerSubnetMask

BAD_NUMBERS = ["0.5", None, [1.0], object()]


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=["str", "None", "list", "object"])
@pytest.mark.parametrize("argument", ["prior_precision", "prior_mean", "sigma_noise"])
@pytest.mark.parametrize(
    ("cls", "extra"),
    [
        (FullLaplace, {}),
        (KronLLLaplace, {}),
        (FunctionalLaplace, {"n_subset": 4}),
        (ELLA, {"subsample_size": 4, "n_eigenvalues": 2}),
        (VaLLA, {"inducing_locations": "random", "num_inducing": 3}),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_non_numeric_hyperparameters_are_value_and_type_errors(cls, extra, argument, value):
    case = CASE_BUILDERS["mlp_regression_1out"]()
    with pytest.raises(ValueError, match=argument) as error:
        cls(case.model, "regression", **extra, **{argument: value})
    assert isinstance(error.value, TypeError)


def test_hyperparameter_assignment_and_numpy_scalars():
    np = pytest.importorskip("numpy")
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = DiagLaplace(case.model, "regression", prior_precision=np.float32(2.0))
    assert la.prior_precision.item() == 2.0
    with pytest.raises(ValueError, match="sigma_noise"):
        la.sigma_noise = "1.0"
    with pytest.raises(TypeError, match="temperature"):
        DiagLaplace(case.model, "regression", temperature="1")


@pytest.mark.parametrize("sigma", [torch.ones(1, 1), torch.ones(1, 1, 1), torch.ones(0)])
def test_sigma_noise_with_more_than_one_dimension(sigma):
    case = CASE_BUILDERS["mlp_regression_1out"]()
    with pytest.raises(ValueError, match="sigma_noise must be a scalar"):
        DiagLaplace(case.model, "regression", sigma_noise=sigma)
    la = DiagLaplace(case.model, "regression", sigma_noise=torch.ones(1))
    assert la.sigma_noise.shape == (1,)


def test_one_sigma_per_output_must_match_the_outputs():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = DiagLaplace(case.model, "regression", sigma_noise=torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"sigma_noise has 2 entries .* model has 1 outputs"):
        la.fit(case.loader())


@pytest.mark.parametrize("structure", ["full", "kron"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_sigma_noise_for_classification_is_refused_at_construction(subset, structure):
    case = CASE_BUILDERS["mlp_classification"]()
    with pytest.raises(ValueError, match="sigma_noise must be 1"):
        Laplace(case.model, "classification", subset, structure, sigma_noise=0.5)


@pytest.mark.parametrize("missing", ["input_ids", "labels"])
@pytest.mark.parametrize(
    ("cls", "extra"),
    [
        (DiagLaplace, {}),
        (KronLLLaplace, {}),
        (FunctionalLaplace, {"n_subset": 4}),
        (ELLA, {"subsample_size": 4, "n_eigenvalues": 2}),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_dict_batch_without_its_key_is_a_key_error(cls, extra, missing):
    model, _ = dict_case()
    X, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    keys = {"input_ids": "inputs", "labels": "targets"}
    data = DictDataset(X, y, *(keys[k] if k == missing else k for k in ("input_ids", "labels")))
    la = cls(model, "classification", **extra)
    with pytest.raises(KeyError) as error:
        la.fit(DataLoader(data, batch_size=4))
    assert isinstance(error.value, ValueError)
    message = str(error.value)
    assert repr(missing) in message and repr(keys[missing]) in message  # key and batch keys


def test_unknown_last_layer_name_is_a_key_error():
    case = CASE_BUILDERS["mlp_classification"]()
    for build in (
        lambda: FullLLLaplace(case.model, "classification", last_layer_name="head"),
        lambda: FeatureExtractor(case.model, last_layer_name="head"),
        lambda: LastLayerSubnetMask(case.model, last_layer_name="head"),
    ):
        with pytest.raises(KeyError, match="'head' is not a module of the model") as error:
            build()
        assert isinstance(error.value, ValueError)
    with pytest.raises(ValueError, match="linear last layer"):  # known, but not a Linear
        FullLLLaplace(case.model, "classification", last_layer_name="1")


def test_subnetwork_without_indices_is_a_type_error():
    case = CASE_BUILDERS["mlp_classification"]()
    with pytest.raises(TypeError, match=r"needs subnetwork_indices: a 1-D torch\.long tensor"):
        Laplace(case.model, "classification", "subnetwork", "full")
    with pytest.raises(TypeError, match="subnetwork_indices"):
        FullSubnetLaplace(case.model, "classification")
    with pytest.raises(TypeError, match="needs subnetwork_indices"):
        FullSubnetLaplace(case.model, "classification", None)


STRUCTURES = [
    ("all", "full"),
    ("all", "diag"),
    ("all", "kron"),
    ("all", "lowrank"),
    ("last_layer", "full"),
    ("last_layer", "kron"),
    ("subnetwork", "diag"),
    ("all", "gp"),
    ("last_layer", "gp"),
]


@pytest.mark.parametrize("backend", [BackPackGGN, BackPackEF], ids=["ggn", "ef"])
@pytest.mark.parametrize(("subset", "structure"), STRUCTURES, ids="/".join)
def test_backpack_with_dict_batches_is_refused_first(subset, structure, backend):
    model, loader = dict_case()
    extra = {"subnetwork": {"subnetwork_indices": torch.tensor([0, 3])}, "gp": {"n_subset": 4}}
    kwargs = {**extra.get(subset, {}), **extra.get(structure, {})}
    la = Laplace(model, "classification", subset, structure, backend=backend, **kwargs)
    with pytest.raises(ValueError, match=f"{backend.__name__} cannot take dict-like inputs"):
        la.fit(loader)


REGRESSION_FITS = [
    ("all", "full", {}),
    ("all", "diag", {}),
    ("all", "kron", {}),
    ("all", "lowrank", {"backend_kwargs": {"n_eigenvalues": 2}}),
    ("last_layer", "full", {}),
    ("last_layer", "diag", {}),
    ("subnetwork", "full", {"subnetwork_indices": torch.tensor([0, 4])}),
    ("all", "gp", {"n_subset": 5}),
    ("last_layer", "gp", {"n_subset": 5}),
]  # ELLA and VaLLA take (N,) targets as (N, 1), as laplace-torch's (test_base_functional)


@pytest.mark.parametrize(("subset", "structure", "kwargs"), REGRESSION_FITS)
def test_regression_targets_of_another_dimension_are_refused(subset, structure, kwargs):
    case = CASE_BUILDERS["mlp_regression_1out"]()  # outputs (N, 1)
    loader = DataLoader(TensorDataset(case.X, case.y[:, 0]), batch_size=7)  # targets (N,)
    la = Laplace(case.model, "regression", subset, structure, **kwargs)
    with pytest.raises(ValueError, match=r"targets of shape \(\d+,\).*output of shape \(\d+, 1\)"):
        la.fit(loader)


class _NoCurvature(Exception):
    """Raised by a backend whose curvature must not be reached."""


def _no_curvature(*args, **kwargs):
    raise _NoCurvature


LABEL_CASES = [("all", "full"), ("all", "kron"), ("last_layer", "diag"), ("all", "lowrank")]


@pytest.mark.parametrize("label", [-1, 4, 9])
@pytest.mark.parametrize(("subset", "structure"), LABEL_CASES, ids="/".join)
def test_class_labels_outside_the_classes_are_refused_before_curvature(subset, structure, label):
    case = CASE_BUILDERS["mlp_classification"]()  # C = 4
    y = case.y.clone()
    y[3] = label
    extra = {"last_layer_name": "2"} if subset == "last_layer" else {}
    la = Laplace(case.model, "classification", subset, structure, **extra)
    for route in ("full", "kron", "diag"):  # reaching the curvature would fail the test
        setattr(la.backend, route, _no_curvature)
    with pytest.raises(ValueError, match=rf"class label {label} is outside \[0, C\).*C=4"):
        la.fit(DataLoader(TensorDataset(case.X, y), batch_size=7))


@pytest.fixture
def fitted_classifier():
    case = CASE_BUILDERS["mlp_classification"]()
    la = FullLaplace(case.model, "classification")
    la.fit(case.loader())
    return case, la


@pytest.mark.parametrize("n_samples", [0, -3, 2.5])
def test_sample_counts_must_be_positive(fitted_classifier, n_samples):
    case, la = fitted_classifier
    x = case.X[:3]
    for action in (
        lambda: la(x, pred_type="nn", link_approx="mc", n_samples=n_samples),
        lambda: la(x, pred_type="glm", link_approx="mc", n_samples=n_samples),
        lambda: la.sample(n_samples),
        lambda: la.predictive_samples(x, n_samples=n_samples),
        lambda: la.functional_samples(x, pred_type="nn", n_samples=n_samples),
        lambda: la._nn_predictive_samples(x, n_samples),
    ):
        with pytest.raises(
            ValueError, match=f"n_samples must be a positive integer, got {n_samples}"
        ):
            action()
    gp = FunctionalLaplace(case.model, "classification", n_subset=5)
    gp.fit(case.loader())
    with pytest.raises(ValueError, match="n_samples must be a positive integer"):
        gp(x, link_approx="mc", n_samples=n_samples)


def test_private_hooks_keep_laplace_torch_signatures(fitted_classifier):
    case, la = fitted_classifier
    oracle = Oracle(case.model, "classification")
    x = case.X[:4]
    _, f_var = la._glm_predictive_distribution(x, joint=False, diagonal_output=False)
    J = oracle.jacobian(x)
    assert_close(f_var, J @ la.posterior_covariance @ J.transpose(1, 2))
    _, variances = la._glm_predictive_distribution(x, diagonal_output=True)
    assert_close(variances, f_var.diagonal(dim1=1, dim2=2))
    probs = la._nn_predictive_samples(x, 5)
    assert probs.shape == (5, 4, 4)
    assert_close(probs.sum(-1), torch.ones(5, 4, dtype=torch.float64))
    gp = FunctionalLaplace(case.model, "classification", n_subset=20)
    gp.fit(case.loader())
    gp_mu, gp_var = gp._glm_predictive_distribution(x, joint=False, diagonal_output=True)
    assert gp_mu.shape == (4, 4) and gp_var.shape == (4, 4)


@pytest.mark.parametrize("cls", [FullLaplace, LowRankLaplace])
def test_posterior_scale_hooks(cls):
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = cls(case.model, "regression", prior_precision=2.0)
    la.fit(case.loader())
    la._compute_scale()
    S = la.posterior_scale
    P = la.n_params
    if cls is FullLaplace:
        covariance = la.posterior_covariance
    else:
        (U, scaled), diagonal = la.posterior_precision
        covariance = torch.linalg.inv(U @ torch.diag(scaled) @ U.T + torch.diag(diagonal))
    assert S.shape == (P, P)
    assert_close(S @ S.T, covariance)
    assert_close(la._posterior_scale, S)
    # an assigned scale is used for sampling (laplace-torch samples with it) ...
    la._posterior_scale = 2 * S
    draws = la.sample(4, generator=torch.Generator().manual_seed(0)) - la.mean
    z = torch.randn(4, P, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert_close(draws, z @ (2 * S).T)
    assert_close(la.posterior_scale, 2 * S)
    # ... until a hyperparameter changes, as laplace-torch resets its cache then
    la.prior_precision = 3.0
    S3 = la.posterior_scale
    assert not torch.allclose(S3, 2 * S)
    la._posterior_scale = 0 * S3
    la._posterior_scale = None  # None resets it
    assert_close(la._posterior_scale, S3)


def test_reward_modeling_gridsearch_uses_the_running_nll():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()

    class PairScorer(nn.Module):
        """(B, 2, 3) pairs → (B, 2) logits; (B, 3) items → (B, 1) rewards."""

        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            out = self.net(x.reshape(-1, x.shape[-1]))
            return out.reshape(x.shape[0], 2) if x.dim() == 3 else out

    X, y = torch.randn(20, 2, 3, dtype=torch.float64), torch.randint(0, 2, (20,))
    loader = DataLoader(TensorDataset(X, y), batch_size=5)
    la = Laplace(PairScorer(), "reward_modeling", "all", "diag")
    la.fit(loader)
    grid = {"log_prior_prec_min": -1, "log_prior_prec_max": 1, "grid_size": 5}
    la.optimize_prior_precision(method="gridsearch", val_loader=loader, **grid)
    chosen = la.prior_precision.item()
    nll = {}
    for prior in torch.logspace(-1, 1, 5, dtype=torch.float64).tolist():
        la.prior_precision = prior
        probs = la(X, fitting=True)  # pair probabilities, as grid search validates
        nll[prior] = -probs[torch.arange(20), y].log().mean().item()
    assert chosen == pytest.approx(min(nll, key=nll.get))
