"""What the likelihood objects answer instead of callers comparing likelihood names."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_close
from laplace.likelihoods import make_likelihood
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
