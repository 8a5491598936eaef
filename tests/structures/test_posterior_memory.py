"""Memory estimates of the posterior structures, and the refusals they make before allocating.

Every structure estimates the bytes of its fit (``Posterior.fit_bytes``) and of a GLM
prediction (``Posterior.prediction_bytes``) from shapes alone; ``fit`` and the GLM predictive
refuse a request whose estimate exceeds the available memory
(``laplace.utils.errors.available_memory``, patched here to a machine too small for the model).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, TensorDataset

from laplace import Laplace
from laplace.parametric import parametric_laplace
from laplace.structures import large_output
from laplace.structures.per_output import PerOutputPosterior
from laplace.utils import errors
from laplace.utils.errors import TooLargeError
from laplace.utils.matrix import Kron, KronDecomposed

#: The estimate of a fit may exceed the bytes of the fitted state by this fraction: Kronecker
#: blocks of a bias share their weight's output eigenbasis, which the estimate counts twice.
ESTIMATE_OVERSHOOT = 0.25
#: With one σ per output the shared eigenbases are a larger part of a smaller state.
PER_OUTPUT_KRON_OVERSHOOT = 0.4

N_IN, WIDTH, N_OUT, N_DATA = 3, 16, 2, 32

#: name → (subset_of_weights, hessian_structure, extra arguments of ``Laplace``)
CASES: dict[str, tuple[str, str, dict]] = {
    "full": ("all", "full", {}),
    "diag": ("all", "diag", {}),
    "kron": ("all", "kron", {}),
    "ekfac": ("all", "ekfac", {}),
    "lowrank": ("all", "lowrank", {"backend_kwargs": {"n_eigenvalues": 5}}),
    "diag_lowrank": ("all", "diag_lowrank", {"backend_kwargs": {"n_eigenvalues": 5}}),
    "matfree": ("all", "matfree", {"preconditioner": "diag"}),
    "last_layer_full": ("last_layer", "full", {}),
    "last_layer_kron": ("last_layer", "kron", {}),
    "last_layer_diag": ("last_layer", "diag", {}),
    "subnetwork_full": ("subnetwork", "full", {"subnetwork_indices": torch.arange(0, 98, 3)}),
    "subnetwork_diag": ("subnetwork", "diag", {"subnetwork_indices": torch.arange(0, 98, 3)}),
}


class CountingLoader(DataLoader):
    """A loader that counts the passes over it."""

    passes = 0

    def __iter__(self):
        self.passes += 1
        return super().__iter__()


def _data() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(N_DATA, N_IN, generator=generator)
    return X, torch.randint(0, N_OUT, (N_DATA,), generator=generator)


def _fitted(name: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(N_IN, WIDTH), nn.Tanh(), nn.Linear(WIDTH, N_OUT))
    subset, structure, kwargs = CASES[name]
    la = Laplace(model, "classification", subset, structure, **kwargs)
    X, y = _data()
    la.fit(CountingLoader(TensorDataset(X, y), batch_size=8))
    return la


def _machine_of(monkeypatch, n_bytes: int) -> None:
    """Make every device report ``n_bytes`` of memory."""
    monkeypatch.setattr(
        errors, "available_memory", lambda device: None if device.type == "meta" else n_bytes
    )


def _forward_counter(model: nn.Module) -> Callable[[], int]:
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    return lambda: len(calls)


@pytest.mark.parametrize("name", list(CASES))
def test_a_fit_larger_than_memory_is_refused_before_any_work(monkeypatch, name):
    la = _fitted(name)
    H, loss, state = la.H, la.loss, la.state_dict()
    X, y = _data()
    loader = CountingLoader(TensorDataset(X, y), batch_size=8)
    _machine_of(monkeypatch, 16)
    with pytest.raises(TooLargeError, match=r"a fit of .* needs [0-9.e-]+ GiB, more .* use "):
        la.fit(loader)
    assert loader.passes == 0  # no batch was drawn
    assert la.H is H and la.loss is loss  # the previous posterior stays
    for key, value in la.state_dict().items():
        assert key in state
        if isinstance(value, Tensor):
            assert torch.equal(value, state[key])


@pytest.mark.parametrize("name", list(CASES))
def test_a_prediction_larger_than_memory_is_refused_before_any_work(monkeypatch, name):
    la = _fitted(name)
    X, _ = _data()
    expected = la(X)
    forwards = _forward_counter(la.model)
    _machine_of(monkeypatch, 16)
    with pytest.raises(
        TooLargeError, match=r"GLM prediction of 32 test points .* needs .* GiB.*none fits.*use "
    ):
        la(X)
    assert forwards() == 0  # the model was not run
    monkeypatch.undo()
    torch.testing.assert_close(la(X), expected)


@pytest.mark.parametrize("name", ["full", "kron", "last_layer_diag"])
def test_a_refused_prediction_names_the_test_points_that_fit(monkeypatch, name):
    la = _fitted(name)
    plan = la._glm_plan()
    fits = plan.posterior.prediction_bytes(10, N_OUT, plan.kind)
    _machine_of(monkeypatch, fits)
    X, _ = _data()
    with pytest.raises(TooLargeError, match=r"at most 10 test points fit"):
        la(X)
    la(X[:10])


def test_a_joint_prediction_counts_the_joint_covariance(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(N_IN, WIDTH), nn.Tanh(), nn.Linear(WIDTH, N_OUT))
    X, _ = _data()
    la = Laplace(model, "regression", "all", "kron")
    la.fit(DataLoader(TensorDataset(X, torch.randn(N_DATA, N_OUT)), batch_size=8))
    plan = la._glm_plan()
    joint = plan.posterior.prediction_bytes(N_DATA, N_OUT, plan.kind, joint=True)
    _machine_of(monkeypatch, joint - 1)
    la(X)  # the marginal prediction fits
    with pytest.raises(TooLargeError, match=r"GLM prediction \(joint\) of 32 test points"):
        la(X, joint=True)


def _tensors(value: object, seen: dict[int, Tensor]) -> None:
    """Collect the distinct storages of the tensors reachable from ``value`` (by data pointer)."""
    if isinstance(value, Tensor):
        if value.numel():
            seen.setdefault(value.untyped_storage().data_ptr(), value)
    elif isinstance(value, list | tuple):
        for item in value:
            _tensors(item, seen)
    elif isinstance(value, Kron | KronDecomposed):
        for item in vars(value).values():
            _tensors(item, seen)


def _fitted_state_bytes(la) -> int:
    """Bytes of the fitted curvature with its factorisation (dense: the Cholesky factor)."""
    posterior = la._posterior
    _ = posterior.log_det  # eigendecompositions and factors are formed now
    seen: dict[int, Tensor] = {}
    _tensors(la.H, seen)
    _tensors(posterior.H, seen)  # a combination of per-output curvatures is a tensor of its own
    if "cholesky" in vars(posterior):
        _tensors(posterior.cholesky, seen)
    return sum(t.untyped_storage().nbytes() for t in seen.values())


@pytest.mark.parametrize("name", [name for name in CASES if name != "matfree"])
def test_the_fit_estimate_bounds_the_fitted_state_closely(name):
    la = _fitted(name)
    estimate, actual = la._fit_bytes(), _fitted_state_bytes(la)
    assert actual <= estimate <= (1 + ESTIMATE_OVERSHOOT) * actual, (estimate, actual)


def test_the_matrix_free_estimate_is_its_diagonal_and_one_solver_block():
    la = _fitted("matfree")
    diagonal = la.H.diagonal.untyped_storage().nbytes()
    assert la._fit_bytes() == diagonal + la.solver_options.block_bytes


def test_estimates_use_the_model_dtype():
    la = _fitted("full")
    params = [p.double() for p in la._subset.curvature_params]
    assert type(la._posterior).fit_bytes(params) == 2 * la._fit_bytes()


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the tensors made under it and still alive (distinct storages)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, Tensor) or t.untyped_storage().data_ptr() in self.storages:
                continue
            storage = t.untyped_storage()
            key, n_bytes = storage.data_ptr(), storage.nbytes()
            self.storages.add(key)
            self.live += n_bytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, n_bytes)
        return out

    def _freed(self, key: int, n_bytes: int) -> None:
        self.live -= n_bytes
        self.storages.discard(key)


#: How far the peak of a head's first prediction may lie from its estimate: the estimate
#: counts the arrays the structure forms, not the small ones around them.
HEAD_ESTIMATE_TOLERANCE = 0.2


@pytest.mark.parametrize("n_features", [16, 64])
def test_a_head_over_many_outputs_is_estimated_as_what_its_prediction_forms(n_features):
    """Above ``LARGE_OUTPUT_THRESHOLD`` Kron keeps the head's output factor as a diagonal plus
    a low-rank part: the prediction's estimate counts it so (not as a dense C × C matrix), what
    its closed form forms from it (``_low_rank_prediction_numbers``) and no Jacobian rows."""
    torch.manual_seed(0)
    n_classes = large_output.LARGE_OUTPUT_THRESHOLD + 52
    model = nn.Sequential(nn.Linear(N_IN, n_features), nn.Tanh(), nn.Linear(n_features, n_classes))
    X = torch.randn(N_DATA, N_IN, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, n_classes, (N_DATA,), generator=torch.Generator().manual_seed(1))
    la = Laplace(model, "classification", "last_layer", "kron")
    la.fit(DataLoader(TensorDataset(X, y), batch_size=8))
    plan = la._glm_plan()
    assert plan.variances_only is not None
    estimate = plan.posterior.prediction_bytes(8, n_classes, plan.kind, variances_only=True)
    dense = 2 * 2 * n_classes**2 * 4  # two blocks' dense (C, C) factors with eigenvectors
    assert estimate < dense / 3
    with LiveBytes() as memory, torch.no_grad():
        la(X[:8])
    assert abs(memory.peak - estimate) <= HEAD_ESTIMATE_TOLERANCE * estimate, (
        memory.peak,
        estimate,
    )


def _fitted_per_output(structure: str):
    """A regression fit with one σ per output (``structures.per_output``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(N_IN, WIDTH), nn.Tanh(), nn.Linear(WIDTH, N_OUT))
    sigma = torch.tensor([0.5, 0.7])
    la = Laplace(model, "regression", "all", structure, sigma_noise=sigma)
    X, _ = _data()
    y = torch.randn(N_DATA, N_OUT, generator=torch.Generator().manual_seed(1))
    la.fit(CountingLoader(TensorDataset(X, y), batch_size=8))
    return la, X, y


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_one_sigma_per_output_estimates_and_refusals(monkeypatch, structure):
    la, X, y = _fitted_per_output(structure)
    assert isinstance(la._posterior, PerOutputPosterior)
    estimate, actual = la._fit_bytes(), _fitted_state_bytes(la)
    overshoot = PER_OUTPUT_KRON_OVERSHOOT if structure == "kron" else ESTIMATE_OVERSHOOT
    assert actual <= estimate <= (1 + overshoot) * actual, (estimate, actual)
    H, expected = la.H, la(X)
    loader = CountingLoader(TensorDataset(X, y), batch_size=8)
    _machine_of(monkeypatch, 16)
    with pytest.raises(TooLargeError, match=r"a fit of .* needs"):
        la.fit(loader)
    assert loader.passes == 0 and la.H is H
    with pytest.raises(TooLargeError, match=r"GLM prediction of 32 test points"):
        la(X)
    monkeypatch.undo()
    torch.testing.assert_close(la(X), expected)


@pytest.mark.parametrize("name", list(CASES))
def test_sampled_networks_larger_than_memory_are_refused_before_any_work(monkeypatch, name):
    la = _fitted(name)
    X, _ = _data()
    expected = la(X, pred_type="nn", link_approx="mc", n_samples=4, generator=_generator())
    forwards = _forward_counter(la.model)
    _machine_of(monkeypatch, 16)
    refusal = r"4 sampled networks \(pred_type='nn'\) on 32 test points .* needs .* GiB.*none fits"
    with pytest.raises(TooLargeError, match=refusal):
        la(X, pred_type="nn", link_approx="mc", n_samples=4)
    with pytest.raises(TooLargeError, match=refusal):
        la.functional_samples(X, pred_type="nn", n_samples=4)
    with pytest.raises(TooLargeError, match=refusal):
        la.predictive_samples(X, pred_type="nn", n_samples=4)
    assert forwards() == 0
    monkeypatch.undo()
    actual = la(X, pred_type="nn", link_approx="mc", n_samples=4, generator=_generator())
    torch.testing.assert_close(actual, expected)


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("name", ["full", "kron", "last_layer_diag"])
def test_a_refused_sampling_names_the_samples_that_fit(monkeypatch, name):
    la = _fitted(name)
    X, _ = _data()
    estimates = []

    def record(needed, *args):
        estimates.append(needed)

    with monkeypatch.context() as patch:
        patch.setattr(parametric_laplace, "check_fits_in_memory", record)
        for n_samples in (1, 8):
            la.functional_samples(X, pred_type="nn", n_samples=n_samples)
    assert estimates[0] < estimates[1]
    _machine_of(monkeypatch, (estimates[0] + estimates[1]) // 2)
    with pytest.raises(
        TooLargeError, match=r"draw fewer samples \(at most (\d+) samples fit\)"
    ) as info:
        la.functional_samples(X, pred_type="nn", n_samples=8)
    fitting = int(re.search(r"at most (\d+) samples fit", str(info.value)).group(1))
    assert 1 <= fitting < 8
    assert la.functional_samples(X, pred_type="nn", n_samples=fitting).shape[0] == fitting
    with pytest.raises(TooLargeError):
        la.functional_samples(X, pred_type="nn", n_samples=fitting + 1)


#: name → (subset_of_weights, extra arguments of ``Laplace`` for ``hessian_structure="gp"``)
GP_CASES: dict[str, tuple[str, dict]] = {
    "sod": ("all", {"n_subset": 16}),
    "sod_last_layer": ("last_layer", {"n_subset": 16}),
    "ella": (
        "all",
        {"functional_approximation": "nystrom", "subsample_size": 8, "n_eigenvalues": 4},
    ),
    "valla": (
        "all",
        {
            "functional_approximation": "variational",
            "inducing_locations": "random",
            "num_inducing": 4,
        },
    ),
}


def _fitted_gp(name: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(N_IN, WIDTH), nn.Tanh(), nn.Linear(WIDTH, N_OUT))
    subset, kwargs = GP_CASES[name]
    la = Laplace(model, "classification", subset, "gp", **kwargs)
    X, y = _data()
    fit_kwargs = {"iterations": 2} if name == "valla" else {}
    la.fit(DataLoader(TensorDataset(X, y), batch_size=8), **fit_kwargs)
    return la, fit_kwargs


def _state_tensors(la) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in la.state_dict().items() if isinstance(v, Tensor)}


@pytest.mark.parametrize("name", list(GP_CASES))
def test_a_gp_fit_larger_than_memory_is_refused_before_any_jacobian(monkeypatch, name):
    la, fit_kwargs = _fitted_gp(name)
    state = _state_tensors(la)
    expected = la(_data()[0])
    X, y = _data()
    loader = CountingLoader(TensorDataset(X, y), batch_size=8)
    jacobians = []
    monkeypatch.setattr(type(la.backend), "jacobians", lambda *a, **k: jacobians.append(1))
    _machine_of(monkeypatch, 16)
    with pytest.raises(TooLargeError, match=r"a fit of \w+ \(C=2 outputs, .* needs .* GiB"):
        la.fit(loader, **fit_kwargs)
    assert not jacobians
    monkeypatch.undo()
    for key, value in la.state_dict().items():
        if isinstance(value, Tensor):
            assert torch.equal(value, state[key]), key
    torch.testing.assert_close(la(X), expected)


@pytest.mark.parametrize("name", list(GP_CASES))
def test_a_gp_prediction_larger_than_memory_is_refused_before_any_work(monkeypatch, name):
    la, _ = _fitted_gp(name)
    X, _ = _data()
    expected = la(X)
    forwards = _forward_counter(la.model)
    _machine_of(monkeypatch, 16)
    refusal = r"a GP prediction of 32 test points with C=2 outputs .* needs .* GiB"
    with pytest.raises(TooLargeError, match=refusal):
        la(X)
    with pytest.raises(
        TooLargeError, match=refusal.replace("prediction", r"prediction \(joint\)")
    ):
        la.predictive_moments(X, joint=True)
    with pytest.raises(TooLargeError, match=refusal):
        la.predictive_samples(X, n_samples=3)
    assert forwards() == 0
    monkeypatch.undo()
    torch.testing.assert_close(la(X), expected)


@pytest.mark.parametrize("name", list(GP_CASES))
def test_the_gp_estimates_grow_with_the_test_points_and_cover_the_fitted_state(name):
    la, _ = _fitted_gp(name)
    few, many = la._prediction_bytes(1, False), la._prediction_bytes(1000, False)
    assert few < many
    assert la._prediction_bytes(10, False) < la._prediction_bytes(10, True)
    saved = sum(v.nbytes for v in la.state_dict().values() if isinstance(v, Tensor))
    assert la._fit_bytes(8) >= saved
    assert few >= saved - la.mean.nbytes  # the fitted GP is held by every prediction
