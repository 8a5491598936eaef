"""``BaseLaplace``: what every approximation shares, through the public classes.

The prediction options parsed once at the boundary, use before ``fit``, the backend argument,
tensors following the model's device and dtype, and ``enable_backprop`` (gradients of the GLM
predictive w.r.t. the inputs) for every subset × structure that laplace-torch supports with it.
"""

from __future__ import annotations

import pytest
import torch

from conftest import CASE_BUILDERS, assert_close
from laplace import DiagLaplace, FullLaplace, Laplace


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cls", [FullLaplace, DiagLaplace], ids=["full", "diag"])
def test_tensors_follow_model_device_and_dtype(cls, dtype, device):
    case = CASE_BUILDERS["mlp_classification"]()
    model = case.model.to(device=device, dtype=dtype)
    X, y = case.X.to(dtype), case.y
    la = cls(model, "classification")
    la.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=8))
    for t in (
        la.H,
        la.mean,
        la.prior_precision,
        la.prior_precision_diag,
        la.log_marginal_likelihood(),
        la.sample(3),
    ):
        assert t.dtype == dtype and t.device.type == device.type
    probs = la(X[:4].to(device))
    assert probs.dtype == dtype and probs.device.type == device.type


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pred_type": "bayes"}, "pred_type='bayes'.*'glm'"),
        ({"link_approx": "logit"}, "link_approx='logit'.*'probit'"),
        ({"pred_type": "nn"}, "only link_approx='mc'"),
    ],
)
def test_predictive_rejects_bad_options(clf, kwargs, match):
    la = DiagLaplace(clf.model, "classification")
    la.fit(clf.loader())
    with pytest.raises(ValueError, match=match):
        la(clf.X[:2], **kwargs)


def test_use_before_fit_is_refused(clf):
    la = FullLaplace(clf.model, "classification")
    for action in (
        lambda: la(clf.X[:2]),
        la.log_marginal_likelihood,
        lambda: la.sample(2),
        lambda: la.optimize_prior_precision(),
        la.state_dict,
    ):
        with pytest.raises(RuntimeError, match="call fit"):
            action()


def test_bad_backend(clf):
    with pytest.raises(TypeError, match="backend"):
        DiagLaplace(clf.model, "classification", backend=object)


def test_asdl_fisher_kwargs_are_ignored_by_other_backends(clf):
    la = DiagLaplace(clf.model, "classification", asdl_fisher_kwargs={"n_mc_samples": 3})
    la.fit(clf.loader())
    assert la.H.shape == (la.n_params,)


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
