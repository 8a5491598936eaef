"""A fit that fails half-way leaves the approximation exactly as it was, and usable.

Every structure and subset is fitted on data whose second batch fails in one of four ways: the
model's output turns NaN (so the curvature does), the model raises, the loader raises, or the
loader raises ``KeyboardInterrupt``. The failing fit is tried on an unfitted approximation, on a
fitted one (``override=True``) and as an online update (``override=False``); afterwards every
attribute of the approximation (and of the feature extractor that finds the last layer) is the
same object holding bitwise the same values, predictions are unchanged, and a good fit still
gives the posterior of a fresh approximation.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from corpus import EXTRA
from torch import nn
from torch.utils.data import DataLoader, Dataset

from conftest import CASE_BUILDERS, assert_close
from laplace import Laplace
from laplace.baselaplace import BaseLaplace
from laplace.core.transaction import TRANSACTIONAL_METHODS
from laplace.functional import BaseFunctionalLaplace
from laplace.utils.matrix import Kron, KronDecomposed

#: First input coordinate of the rows that make the model fail.
MARKER = 1234.0
#: Index of the failing row: in the second batch of 5.
FAILING_ROW = 7

KINDS = ["nan_curvature", "model_raises", "loader_raises", "keyboard_interrupt"]

#: (id, subset, structure, constructor arguments, supports override=False, fit options)
STRUCTURES = [
    ("all-full", "all", "full", {}, True, {}),
    ("all-diag", "all", "diag", {}, True, {}),
    ("all-kron", "all", "kron", {}, True, {}),
    ("all-lowrank", "all", "lowrank", {}, False, {}),
    ("ll-full", "last_layer", "full", {}, True, {}),
    ("ll-diag", "last_layer", "diag", {}, True, {}),
    ("ll-kron", "last_layer", "kron", {}, True, {}),
    ("subnet-full", "subnetwork", "full", {}, True, {}),
    ("subnet-diag", "subnetwork", "diag", {}, True, {}),
    ("gp-sod", "all", "gp", {"n_subset": 20}, False, {}),
    ("ll-gp-sod", "last_layer", "gp", {"n_subset": 20}, False, {}),
    ("gp-ella", "all", "gp", {"functional_approximation": "nystrom", "subsample_size": 6,
                              "n_eigenvalues": 3}, False, {}),
    ("gp-valla", "all", "gp", {"functional_approximation": "variational",
                               "inducing_locations": "random", "num_inducing": 3}, True,
     {"iterations": 6}),
]  # fmt: skip


class Saboteur(nn.Module):
    """The classification MLP, failing on batches that hold a row marked with :data:`MARKER`."""

    def __init__(self, net: nn.Module, kind: str) -> None:
        super().__init__()
        self.net, self.kind = net, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.kind in ("nan_curvature", "model_raises") and bool((x[:, 0] == MARKER).any()):
            if self.kind == "model_raises":
                raise RuntimeError("the model failed on this batch")
            out = out * float("nan")
        return out


class Faulty(Dataset):
    """The training data; row :data:`FAILING_ROW` fails as ``kind`` says."""

    def __init__(self, X: torch.Tensor, y: torch.Tensor, kind: str) -> None:
        self.X, self.y, self.kind = X, y, kind

    def __len__(self) -> int:
        return len(self.X)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == FAILING_ROW and self.kind == "loader_raises":
            raise OSError("disk read failed")
        if i == FAILING_ROW and self.kind == "keyboard_interrupt":
            raise KeyboardInterrupt
        if i == FAILING_ROW and self.kind in ("nan_curvature", "model_raises"):
            x = self.X[i].clone()
            x[0] = MARKER
            return x, self.y[i]
        return self.X[i], self.y[i]


def _expected_error(kind: str) -> type[BaseException]:
    return {
        "nan_curvature": RuntimeError,
        "model_raises": RuntimeError,
        "loader_raises": OSError,
        "keyboard_interrupt": KeyboardInterrupt,
    }[kind]


def _build(subset: str, structure: str, extra: dict, kind: str):
    case = CASE_BUILDERS["mlp_classification"]()
    model = Saboteur(case.model, kind).eval()
    kwargs = {**EXTRA.get(subset, {}), **extra}
    if structure == "lowrank":
        kwargs.update(EXTRA["lowrank"])
    la = Laplace(model, "classification", subset, structure, prior_precision=0.5, **kwargs)
    good = DataLoader(Faulty(case.X, case.y, "none"), batch_size=5)
    bad = DataLoader(Faulty(case.X, case.y, kind), batch_size=5)
    return case, la, good, bad


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Kron):
        return _leaves(value.kfacs)
    if isinstance(value, KronDecomposed):
        return _leaves([value.eigenvectors, value.eigenvalues, value.deltas])
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    return []


def fingerprint(la: BaseLaplace) -> list[dict[str, tuple[int, list[torch.Tensor]]]]:
    """Per object a fit may change: attribute → (identity, clones of the tensors it holds)."""
    return [
        {name: (id(value), [t.detach().clone() for t in _leaves(value)])
         for name, value in vars(part).items()}
        for part in la._transaction_parts()
    ]  # fmt: skip


def assert_unchanged(before, after, rebuilt=()) -> None:
    """Same attributes, same objects, bitwise the same tensors.

    ``rebuilt`` names state the snapshot drops and rebuilds (the unfitted zero curvature): only
    its values must agree.
    """
    for part_before, part_after in zip(before, after, strict=True):
        assert part_before.keys() == part_after.keys()
        for name, (identity, tensors) in part_before.items():
            if name not in rebuilt:
                assert part_after[name][0] == identity, f"attribute {name!r} was replaced"
            for old, new in zip(tensors, part_after[name][1], strict=True):
                assert torch.equal(old, new), f"attribute {name!r} was modified in place"


def _predict(la, X):
    out = la(X)
    return out if isinstance(out, torch.Tensor) else torch.cat([out[0], out[1].flatten(1)], 1)


def _fail(la, loader, kind: str, **options) -> None:
    with pytest.raises(_expected_error(kind)):
        la.fit(loader, **options)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("subset", "structure", "extra", "online", "fit_options"),
    [s[1:] for s in STRUCTURES],
    ids=[s[0] for s in STRUCTURES],
)
def test_failed_fit_changes_nothing(subset, structure, extra, online, fit_options, kind):
    case, la, good, bad = _build(subset, structure, extra, kind)
    X_test = case.X[:4]

    # an unfitted approximation stays unfitted (the prior), its last layer still unknown
    before, rebuilt = fingerprint(la), set(la._transaction_rebuild())
    _fail(la, bad, kind, **fit_options)
    assert_unchanged(before, fingerprint(la), rebuilt)
    assert not la._fitted

    # a fitted one keeps its posterior, through a refit and through an online update
    la.fit(good, **fit_options)
    reference = _predict(la, X_test)
    marglik = la.log_marginal_likelihood() if structure != "gp" or "n_subset" in extra else None
    before = fingerprint(la)
    _fail(la, bad, kind, **fit_options)
    assert_unchanged(before, fingerprint(la))
    if online:
        _fail(la, bad, kind, override=False, **fit_options)
        assert_unchanged(before, fingerprint(la))
    assert torch.equal(_predict(la, X_test), reference)
    if marglik is not None:
        assert torch.equal(la.log_marginal_likelihood(), marglik)

    # and is usable: a good fit after the failures equals that of a twin that never failed
    # (random generators included)
    la.fit(good, **fit_options)
    _, twin, _, _ = _build(subset, structure, extra, kind)
    twin.fit(good, **fit_options)
    twin.fit(good, **fit_options)
    assert_close(_predict(la, X_test), _predict(twin, X_test))


def test_failed_load_state_dict_changes_nothing():
    case = CASE_BUILDERS["mlp_classification"]()
    la = Laplace(case.model, "classification", "last_layer", "kron")
    fitted = Laplace(case.model, "classification", "last_layer", "kron")
    fitted.fit(case.loader())
    tampered = fitted.state_dict()
    tampered["prior_precision"] = -tampered["prior_precision"]  # checked after H is loaded
    before = fingerprint(la)
    with pytest.raises(ValueError, match="prior_precision"):
        la.load_state_dict(tampered)
    assert_unchanged(before, fingerprint(la), set(la._transaction_rebuild()))
    assert la.model.last_layer is None  # found from the state, forgotten again


def test_failed_marglik_hyperparameters_change_nothing():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = Laplace(case.model, "regression", "all", "diag")
    la.fit(case.loader())
    before = fingerprint(la)
    with pytest.raises(ValueError, match="sigma_noise"):
        la.log_marginal_likelihood(prior_precision=3.0, sigma_noise=-1.0)
    assert_unchanged(before, fingerprint(la))


def test_interrupted_prior_tuning_changes_nothing():
    """Every marglik step sets the prior: a tuning stopped half-way must not leave one."""
    case = CASE_BUILDERS["mlp_classification"]()
    la = Laplace(case.model, "classification", "all", "full", prior_precision=0.5)
    la.fit(case.loader())
    steps = 0
    original = type(la).log_marginal_likelihood

    def interrupted(self, *args, **kwargs):
        nonlocal steps
        steps += 1
        if steps == 5:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    before = fingerprint(la)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(la), "log_marginal_likelihood", interrupted)
        with pytest.raises(KeyboardInterrupt):
            la.optimize_prior_precision(n_steps=20)
    assert steps == 5
    assert_unchanged(before, fingerprint(la))
    assert la.prior_precision.item() == 0.5


def _public_classes(cls: type) -> list[type]:
    found = [cls] if not inspect.isabstract(cls) else []
    for sub in cls.__subclasses__():
        found += _public_classes(sub)
    return found


@pytest.mark.parametrize("name", TRANSACTIONAL_METHODS)
def test_every_class_is_transactional(name):
    """The mechanism is inherited: no Laplace class can define a fit that escapes it."""
    classes = _public_classes(BaseLaplace)
    assert BaseFunctionalLaplace in classes or any(
        issubclass(c, BaseFunctionalLaplace) for c in classes
    )
    for cls in classes:
        method = getattr(cls, name, None)
        if method is not None:
            assert getattr(method, "_transactional", False), f"{cls.__name__}.{name}"


class FailingBackward(torch.autograd.Function):
    """The identity whose backward pass raises (as an interrupt during a library's backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt


@pytest.mark.parametrize("backend", ["AsdlGGN", "AsdlEF"])
def test_a_backend_failing_in_its_backward_pass_leaves_the_model_as_it_was(backend):
    pytest.importorskip("asdl")
    from laplace import curvature

    case = CASE_BUILDERS["mlp_classification"]()
    model = nn.Sequential(case.model, nn.Identity())
    model[1].forward = FailingBackward.apply
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    la = Laplace(model, "classification", "all", "diag", backend=getattr(curvature, backend))
    with pytest.raises(KeyboardInterrupt):
        la.fit(case.loader())
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
