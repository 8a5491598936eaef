"""What the likelihood objects answer instead of callers comparing likelihood names.

Binary, multi-label, heteroscedastic and a user-defined (Poisson) likelihood against oracles:
every case runs the same checks as the built-in likelihoods: the curvature (full and diagonal,
all weights, last layer, subnetwork) against the exact GGN with that likelihood's output
curvature built by ``torch.func``; KFAC of a single linear layer on a single point against the
exact GGN; the empirical Fisher; the log-likelihood; the marginal likelihood and its gradient
in the prior precision against finite differences; the GLM predictive against Monte-Carlo
estimates from the exact moments; and predictive samples. The structured (diagonal plus low
rank) output Hessians equal the dense ones.
"""

from __future__ import annotations

import math

import pytest
import torch
from likelihood_cases import CASES, LikelihoodCase, LikelihoodOracle
from torch import nn

from conftest import assert_close
from laplace import Laplace
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN
from laplace.likelihoods import HeteroscedasticPrediction, make_likelihood
from laplace.utils.enums import HessianStructure
from laplace.utils.errors import UnsupportedError
from laplace.utils.predictive import probit, probit_logits

B, C = 5, 3


def _outputs_and_targets(name: str, generator: torch.Generator):
    f = torch.randn(B, C, dtype=torch.float64, generator=generator)
    if name == "regression":
        return f, torch.randn(B, C, dtype=torch.float64, generator=generator)
    return f, torch.randint(C, (B,), generator=generator)


@pytest.mark.parametrize("name", ["regression", "classification", "reward_modeling"])
def test_loss_module_times_loss_scale_is_the_summed_negative_log_likelihood(name):
    likelihood = make_likelihood(name)
    f, y = _outputs_and_targets(name, torch.Generator().manual_seed(0))
    if name == "regression":  # -log N(y; f, I) up to its constant: ½ Σ (y - f)²
        expected = 0.5 * (y - f).square().sum()
    else:  # -log softmax(f)[y]
        expected = -torch.log_softmax(f, -1)[torch.arange(B), y].sum()
    summed = likelihood.loss_module(reduction="sum")(f, y)
    assert_close(likelihood.loss_scale * summed, expected)
    assert_close(likelihood.loss(f, y), expected)
    mean = likelihood.loss_module()(f, y)
    assert_close(mean, summed / (B * C if name == "regression" else B))


@pytest.mark.parametrize(
    ("name", "noise", "composite"),
    [
        ("regression", True, False),
        ("classification", False, False),
        ("reward_modeling", False, True),
    ],
)
def test_noise_hyperparameter_and_composite_models(name, noise, composite):
    likelihood = make_likelihood(name)
    assert likelihood.has_noise_hyperparameter is noise
    assert likelihood.is_composite is composite
    sigma = torch.tensor(2.0, dtype=torch.float64)
    constant = 0.5 * B * C * math.log(2 * math.pi * 4.0)
    if noise:  # σ enters the log-likelihood; without a noise hyperparameter it must not
        expected = -torch.tensor(10.0, dtype=torch.float64) / 4.0 - constant
    else:
        expected = -torch.tensor(10.0, dtype=torch.float64)
    assert_close(likelihood.log_likelihood(torch.tensor(10.0), B, C, sigma, 1.0), expected)


@pytest.mark.parametrize("structure", list(HessianStructure), ids=lambda s: s.value)
def test_structure_support(structure):
    for name in ("regression", "classification"):
        make_likelihood(name).check_structure(structure)
    reward = make_likelihood("reward_modeling")
    # laplace-torch's two, and EKFAC (a Kronecker structure fitted the same way)
    if structure in (HessianStructure.KRON, HessianStructure.DIAG, HessianStructure.EKFAC):
        reward.check_structure(structure)
    else:
        with pytest.raises(ValueError, match=r"reward_modeling.*\['kron', 'diag', 'ekfac'\]"):
            reward.check_structure(structure)


@pytest.mark.parametrize(
    ("name", "n_out", "targets"),
    [
        ("binary_classification", 3, lambda g: (torch.rand(B, 3, generator=g) > 0.5).double()),
        ("heteroscedastic_regression", 4, lambda g: torch.randn(B, 2, generator=g).double()),
    ],
)
def test_summed_loss_module_is_the_loss_of_the_new_likelihoods(name, n_out, targets):
    likelihood = make_likelihood(name)
    generator = torch.Generator().manual_seed(1)
    f = torch.randn(B, n_out, dtype=torch.float64, generator=generator)
    y = targets(generator)
    summed = likelihood.loss_module(reduction="sum")(f, y)
    assert_close(likelihood.loss_scale * summed, likelihood.loss(f, y))
    grad = torch.func.grad(lambda ff: likelihood.loss(ff, y))(f)
    assert_close(likelihood.loss_gradient(f, y), grad)


def test_the_enum_and_the_protocol_are_different_names():
    from laplace.likelihoods import Likelihood as Protocol
    from laplace.utils.enums import Likelihood as Names

    assert Names.BINARY_CLASSIFICATION == "binary_classification"
    assert [m.value for m in Names][:3] == ["regression", "classification", "reward_modeling"]
    assert isinstance(Protocol, type) and not issubclass(Protocol, str)


g = torch.Generator().manual_seed(0)


F = torch.randn(5, 3, dtype=torch.float64, generator=g)


J = torch.randn(5, 3, 4, dtype=torch.float64, generator=g)


ROOT = torch.randn(5, 3, 3, dtype=torch.float64, generator=g)


COV = ROOT @ ROOT.transpose(1, 2)


NAMES = (
    "regression",
    "classification",
    "reward_modeling",
    "binary_classification",
    "heteroscedastic_regression",
)


def test_properties_describe_each_likelihood():
    table = {
        name: (model.has_noise_hyperparameter, model.pairwise)
        for name in NAMES
        for model in [make_likelihood(name)]
    }
    assert table == {
        "regression": (True, False),
        "classification": (False, False),
        "reward_modeling": (False, True),
        "binary_classification": (False, False),
        "heteroscedastic_regression": (False, False),
    }


@pytest.mark.parametrize(
    "name", ["regression", "classification", "reward_modeling", "binary_classification"]
)
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


@pytest.mark.parametrize("name", ["classification", "reward_modeling"])
def test_one_hot_integer_rows_are_class_labels_and_other_integer_rows_are_refused(name):
    likelihood = make_likelihood(name).fit_likelihood
    y = torch.tensor([0, 2, 1, 1, 0])
    one_hot = torch.nn.functional.one_hot(y, C)  # int64 (B, C)
    assert torch.equal(likelihood.prepare_targets(F, one_hot), y)
    assert torch.equal(likelihood.loss_targets(one_hot, F.dtype), y)
    assert_close(
        likelihood.loss(F, one_hot), torch.nn.functional.cross_entropy(F, y, reduction="sum")
    )
    assert_close(likelihood.loss_gradient(F, one_hot), likelihood.loss_gradient(F, y))
    for rows in (one_hot * 2, one_hot + one_hot.roll(1, 1), one_hot[:, :2]):
        with pytest.raises(ValueError, match=r"one-hot rows") as error:
            likelihood.check_targets(rows, F.shape)
        assert isinstance(error.value, RuntimeError)  # torch's error for such targets


def test_likelihoods_without_a_function_space_validation_score_refuse_one():
    name = "heteroscedastic_regression"
    with pytest.raises(UnsupportedError, match=name):
        make_likelihood(name).predictive_nll(F[:, :2], COV[:, :2, :2], F[:, :2], torch.ones(1))


def test_probit_logits_scale_the_means_by_the_variances():
    var = COV.diagonal(dim1=1, dim2=2)
    assert_close(probit_logits(F, COV), F / torch.sqrt(1 + math.pi / 8 * var))
    assert_close(probit_logits(F, var), probit_logits(F, COV))


@pytest.mark.parametrize("n_classes", [1, 2, 5])
@pytest.mark.parametrize("spread", [1.0, 30.0], ids=["moderate", "confident"])
def test_softmax_hessian_factor_has_rank_c_minus_one(n_classes, spread):
    gen = torch.Generator().manual_seed(0)
    f = spread * torch.randn(6, 3, n_classes, generator=gen, dtype=torch.float64)
    likelihood = make_likelihood("classification")
    L = likelihood.output_hessian_sqrt(f)
    assert L.shape == (6, 3, n_classes, max(1, n_classes - 1))
    p = torch.softmax(f, -1)
    expected = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    assert_close(L @ L.transpose(-1, -2), expected, rtol=1e-10, atol=1e-15)


def test_gaussian_hessian_factor_is_the_identity():
    f = torch.randn(4, 3, dtype=torch.float64)
    L = make_likelihood("regression").output_hessian_sqrt(f)
    assert_close(L, torch.eye(3, dtype=torch.float64).expand(4, -1, -1))


# ----------------------------------------------------------------- structured output Hessians
@pytest.mark.parametrize(
    "name", ["classification", "regression", "binary_classification", "reward_modeling"]
)
def test_structured_output_hessian_equals_the_dense_one(name):
    likelihood = make_likelihood(name)
    f = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    structured = likelihood.structured_output_hessian(f)
    assert_close(structured.to_dense(), likelihood.output_hessian(f))
    assert_close(structured.diagonal(), likelihood.output_hessian(f).diagonal(dim1=1, dim2=2))


#: Finite differences of the log marginal likelihood: step and tolerance.
FD_STEP, FD_RTOL = 1e-5, 1e-6


#: Monte-Carlo samples of the predictive checks; tolerances are 5 standard errors.
N_MC = 200_000


def _case(name: str) -> LikelihoodCase:
    return CASES[name]()


@pytest.fixture(params=list(CASES), ids=list(CASES))
def case(request) -> LikelihoodCase:
    return _case(request.param)


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_curvature_is_the_exact_ggn_of_the_likelihood(case, structure):
    la = Laplace(case.model, case.likelihood, "all", structure)
    la.fit(case.loader())
    ggn = LikelihoodOracle(case).ggn(case.X, case.y)
    assert_close(la.H, ggn if structure == "full" else ggn.diagonal())


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_last_layer_curvature_is_the_exact_ggn_of_the_head(case, structure):
    la = Laplace(case.model, case.likelihood, "last_layer", structure)
    la.fit(case.loader())
    head = case.model[2]
    frozen = [p for p in case.model.parameters() if all(p is not q for q in head.parameters())]
    for p in frozen:
        p.requires_grad_(False)
    ggn = LikelihoodOracle(case).ggn(case.X, case.y)
    assert_close(la.H, ggn if structure == "full" else ggn.diagonal())


def test_subnetwork_curvature_is_the_exact_ggn_restricted(case):
    indices = torch.tensor([0, 3, 7, 20, 25])
    la = Laplace(case.model, case.likelihood, "subnetwork", "full", subnetwork_indices=indices)
    la.fit(case.loader())
    ggn = LikelihoodOracle(case).ggn(case.X, case.y)
    assert_close(la.H, ggn[indices][:, indices])


def test_kron_of_one_linear_layer_on_one_point_is_exact(case):
    model = nn.Linear(3, case.model[2].out_features, bias=False).double()  # KFAC drops W–b terms
    single = LikelihoodCase(
        case.name, case.likelihood, model, case.X[:1], case.y[:1], case.nll, case.fisher
    )
    la = Laplace(model, case.likelihood, "all", "kron")
    la.fit(single.loader())
    assert_close(la.H_facs.to_matrix(), LikelihoodOracle(single).ggn(single.X, single.y))


def test_empirical_fisher_is_the_outer_product_of_loss_gradients(case):
    la = Laplace(case.model, case.likelihood, "all", "full", backend=CurvlinopsEF)
    la.fit(case.loader())
    assert_close(la.H, LikelihoodOracle(case).ef(case.X, case.y))


def test_monte_carlo_fisher_estimates_the_ggn(case):
    torch.manual_seed(0)
    la = Laplace(
        case.model,
        case.likelihood,
        "all",
        "diag",
        backend=CurvlinopsGGN,
        backend_kwargs={"stochastic": True, "num_samples": 4000},
    )
    la.fit(case.loader())
    exact = LikelihoodOracle(case).ggn(case.X, case.y).diagonal()
    # Each entry averages 20 × 4000 squared sampled gradients: a few percent of its scale.
    assert_close(la.H, exact, rtol=0.15, atol=0.02 * float(exact.max()))


def test_log_likelihood_is_the_summed_log_density(case):
    la = Laplace(case.model, case.likelihood, "all", "diag")
    la.fit(case.loader())
    assert_close(la.log_likelihood, -LikelihoodOracle(case).nll(case.X, case.y))


def test_marginal_likelihood_and_its_prior_gradient(case):
    la = Laplace(case.model, case.likelihood, "all", "full")
    la.fit(case.loader())
    oracle = LikelihoodOracle(case)
    ggn = oracle.ggn(case.X, case.y)
    assert_close(
        la.log_marginal_likelihood(torch.tensor(0.7, dtype=torch.float64)),
        oracle.log_marglik(case.X, case.y, 0.7, ggn),
    )
    delta = torch.tensor([0.7], dtype=torch.float64, requires_grad=True)
    la.log_marginal_likelihood(delta).backward()
    finite = (
        oracle.log_marglik(case.X, case.y, 0.7 + FD_STEP, ggn)
        - oracle.log_marglik(case.X, case.y, 0.7 - FD_STEP, ggn)
    ) / (2 * FD_STEP)
    assert_close(delta.grad, finite.reshape(1), rtol=FD_RTOL, atol=1e-7)


def _exact_moments(case: LikelihoodCase, prior_precision: float = 1.0):
    oracle = LikelihoodOracle(case)
    ggn = oracle.ggn(case.X, case.y)
    precision = ggn + prior_precision * torch.eye(len(ggn), dtype=ggn.dtype)
    return oracle.glm_moments(case.X[:5], precision)


def _mc_outputs(f_mu, f_var, n=N_MC, seed=0):
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(n, *f_mu.shape, dtype=f_mu.dtype, generator=generator)
    return f_mu + torch.einsum("bij,sbj->sbi", torch.linalg.cholesky(f_var), z)


def _mc_tolerance(samples: torch.Tensor) -> torch.Tensor:
    return 5 * samples.std(0) / math.sqrt(len(samples))


@pytest.mark.parametrize("name", ["binary", "multilabel_3"])
def test_binary_predictive_links(name):
    case = _case(name)
    la = Laplace(case.model, case.likelihood, "all", "full")
    la.fit(case.loader())
    f_mu, f_var = _exact_moments(case)
    v = f_var.diagonal(dim1=-2, dim2=-1)
    assert_close(la(case.X[:5]), torch.sigmoid(f_mu / torch.sqrt(1 + math.pi * v / 8)))
    probs = torch.sigmoid(_mc_outputs(f_mu, f_var))
    generator = torch.Generator().manual_seed(1)
    mc = la(case.X[:5], link_approx="mc", n_samples=N_MC, generator=generator)
    assert torch.all((mc - probs.mean(0)).abs() <= 2 * _mc_tolerance(probs))
    with pytest.raises(ValueError, match=r"binary_classification.*\['probit', 'mc'\]"):
        la(case.X[:5], link_approx="bridge")


def test_heteroscedastic_predictive_moments():
    case = _case("heteroscedastic_2")
    la = Laplace(case.model, case.likelihood, "all", "full")
    la.fit(case.loader())
    f_mu, f_var = _exact_moments(case)
    prediction = la(case.X[:5])
    assert isinstance(prediction, HeteroscedasticPrediction)
    samples = _mc_outputs(f_mu, f_var)
    s = samples.chunk(2, dim=-1)[1]
    assert_close(prediction.mean, f_mu[:, :2])
    assert_close(prediction.epistemic_variance, f_var[:, :2, :2])
    noise = s.exp()
    assert torch.all((prediction.aleatoric_variance - noise.mean(0)).abs() <= _mc_tolerance(noise))
    diagonal = la(case.X[:5], diagonal_output=True)
    assert_close(diagonal.epistemic_variance, f_var[:, :2, :2].diagonal(dim1=-2, dim2=-1))
    assert_close(diagonal.variance, diagonal.epistemic_variance + diagonal.aleatoric_variance)


def test_poisson_predictive_mean():
    case = _case("poisson_2")
    la = Laplace(case.model, case.likelihood, "all", "full")
    la.fit(case.loader())
    f_mu, f_var = _exact_moments(case)
    rates = _mc_outputs(f_mu, f_var).exp()
    prediction = la(case.X[:5])
    assert torch.all((prediction - rates.mean(0)).abs() <= _mc_tolerance(rates))


def test_predictive_samples_follow_the_predictive(case):
    la = Laplace(case.model, case.likelihood, "all", "full")
    la.fit(case.loader())
    generator = torch.Generator().manual_seed(2)
    samples = la.predictive_samples(case.X[:5], n_samples=50_000, generator=generator)
    prediction = la(case.X[:5], link_approx="mc", n_samples=50_000, generator=generator)
    if isinstance(prediction, HeteroscedasticPrediction):  # y = μ + e^{s/2} ε, noise included
        assert samples.shape == (50_000, 5, 2)
        assert torch.all((samples.mean(0) - prediction.mean).abs() <= _mc_tolerance(samples))
        assert_close(samples.var(0), prediction.variance, rtol=0.05, atol=0)
    else:  # probabilities or rates per draw, whose mean is the predictive
        assert samples.shape == (50_000, *prediction.shape)
        tolerance = 2 * _mc_tolerance(samples)
        assert torch.all((samples.mean(0) - prediction).abs() <= tolerance)


def test_sampled_network_predictive(case):
    la = Laplace(case.model, case.likelihood, "all", "diag")
    la.fit(case.loader())
    generator = torch.Generator().manual_seed(3)
    thetas = la.sample(20, generator=torch.Generator().manual_seed(3))
    prediction = la(
        case.X[:4], pred_type="nn", link_approx="mc", n_samples=20, generator=generator
    )
    f = torch.stack([LikelihoodOracle(case).f(theta, case.X[:4]) for theta in thetas])
    if case.likelihood == "binary_classification":
        assert_close(prediction, torch.sigmoid(f).mean(0))
    elif case.likelihood == "heteroscedastic_regression":
        mu, s = f.chunk(2, dim=-1)
        assert_close(prediction.mean, mu.mean(0))
        assert_close(prediction.epistemic_variance, mu.var(0))
        assert_close(prediction.aleatoric_variance, s.exp().mean(0))
    else:
        assert_close(prediction, f.exp().mean(0))


@pytest.mark.parametrize("name", ["binary", "multilabel_3", "heteroscedastic_2"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_subset_of_data_gp_on_all_points_is_the_glm_predictive(name, subset):
    """With a diagonal output curvature the GP on all N points is the full GGN's predictive."""
    case = _case(name)
    kwargs = {"prior_precision": 0.5}
    full = Laplace(case.model, case.likelihood, subset, "full", **kwargs)
    full.fit(case.loader())
    gp = Laplace(case.model, case.likelihood, subset, "gp", n_subset=20, **kwargs)
    gp.fit(case.loader())
    expected, actual = full(case.X[:5]), gp(case.X[:5])
    for a, e in zip(
        *(p if isinstance(p, tuple) else (p,) for p in (actual, expected)), strict=True
    ):
        assert_close(a, e)
    if name == "heteroscedastic_2":
        assert isinstance(actual, HeteroscedasticPrediction)


def test_a_built_in_likelihood_is_its_class_and_its_registry_entry(monkeypatch):
    """Adding a built-in likelihood touches its module and ``_BUILT_IN``: the factory, the fit,
    the marginal likelihood, the predictive and the state find it by its ``kind`` alone, with no
    member of ``laplace.utils.enums.Likelihood``."""
    from laplace import likelihoods
    from laplace.likelihoods import Bernoulli

    class TwoLabels(Bernoulli):
        kind = "two_labels"

    monkeypatch.setitem(likelihoods._LIKELIHOODS, "two_labels", TwoLabels)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    X = torch.randn(12, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (12, 2)).double()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=6)

    fitted = {}
    for name in ("two_labels", "binary_classification"):
        la = Laplace(model, name, subset_of_weights="all", hessian_structure="kron")
        la.fit(loader)
        fitted[name] = la
    ours, reference = fitted["two_labels"], fitted["binary_classification"]
    assert ours.likelihood == "two_labels"
    assert_close(ours.log_marginal_likelihood(), reference.log_marginal_likelihood())
    assert_close(ours(X[:3], link_approx="probit"), reference(X[:3], link_approx="probit"))
    restored = Laplace(model, "two_labels", subset_of_weights="all", hessian_structure="kron")
    restored.load_state_dict(ours.state_dict())
    assert_close(restored.log_marginal_likelihood(), ours.log_marginal_likelihood())
    with pytest.raises(ValueError, match="'two_labels'"):
        Laplace(model, "three_labels", subset_of_weights="all", hessian_structure="kron")
