"""One contract for every backend family (``CurvatureInterface``), against dense float64 oracles.

backend × structure × model (the shared cases, a dict-input model, a LoRA model); Jacobians,
per-sample gradients, ``enable_backprop``, subnetworks, last layer; agreement across backends;
per-call Monte-Carlo samples of the stochastic GGN, and every GGN/EF backend on a subnetwork.

The Monte-Carlo Fisher with k sampled targets per data point is an unbiased estimate of the
exact GGN whose squared Frobenius error has expectation ``v / k``, where ``v`` is computed
exactly here by enumerating the classes of each data point:

    v = Σₙ Σ_c pₙ_c ‖Aₙ(c) − Jₙᵀ Λₙ Jₙ‖²_F,   Aₙ(c) = Jₙᵀ gₙ(c) gₙ(c)ᵀ Jₙ,  gₙ(c) = pₙ − e_c.

By Markov's inequality the error exceeds ``T · v / k`` with probability at most ``1/T``; the
tests use a fixed seed and ``T = MARKOV_FACTOR``, so the tolerance shrinks as ``1/k``.
"""

from __future__ import annotations

import pytest
import torch
from backend_cases import (
    BACKENDS,
    GGN_BACKENDS,
    Backend,
    LoRAModel,
    dict_per_sample_gradients,
    ids,
    lora_case,
)

from conftest import CASE_BUILDERS, Oracle, assert_close, dict_case
from laplace import Laplace
from laplace.curvature import BackPackGGN, CurvlinopsEF, CurvlinopsGGN

STRUCTURES = ["full", "diag"]


def _curvature(backend, structure: str, X, y):
    return backend.full(X, y) if structure == "full" else backend.diag(X, y)


def _expected(row: Backend, structure: str, oracle: Oracle, X, y):
    H = row.reference(oracle, X, y)
    return H if structure == "full" else H.diagonal()


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("row", BACKENDS, ids=ids(BACKENDS))
def test_curvature_matches_oracle(case, row, structure):
    oracle = Oracle(case.model, case.likelihood)
    backend = row.cls(case.model, case.likelihood)
    loss, H = _curvature(backend, structure, case.X, case.y)
    assert_close(H, _expected(row, structure, oracle, case.X, case.y))
    assert_close(loss, oracle.loss(case.X, case.y))
    assert not H.requires_grad and not loss.requires_grad


@pytest.mark.parametrize("row", BACKENDS, ids=ids(BACKENDS))
def test_jacobians_and_gradients_match_oracle(case, row):
    oracle = Oracle(case.model, case.likelihood)
    backend = row.cls(case.model, case.likelihood)
    Js, f = backend.jacobians(case.X)
    assert_close(Js, oracle.jacobian(case.X))
    assert_close(f, case.model(case.X))
    Gs, loss = backend.gradients(case.X, case.y)
    assert_close(Gs, oracle.per_sample_gradients(case.X, case.y))
    assert_close(loss, oracle.loss(case.X, case.y))


@pytest.mark.parametrize("row", BACKENDS, ids=ids(BACKENDS))
def test_selected_output_jacobians_are_rows_of_the_oracle_jacobian(case, row):
    """Row ``b, k`` is the gradient of output ``outputs[b, k]`` of input ``b``."""
    oracle = Oracle(case.model, case.likelihood)
    backend = row.cls(case.model, case.likelihood)
    J = oracle.jacobian(case.X)  # (B, C, P)
    B, C = J.shape[:2]
    one = torch.arange(B) % C
    Js, f = backend.selected_output_jacobians(case.X, one)
    assert Js.shape == (B, 1, J.shape[-1])
    assert_close(Js[:, 0], J[torch.arange(B), one])
    assert_close(f, case.model(case.X))
    two = torch.stack([one, (one + 1) % C], dim=1)
    Js, _ = backend.selected_output_jacobians(case.X, two)
    assert_close(Js, torch.stack([J[torch.arange(B), two[:, k]] for k in range(2)], dim=1))
    with pytest.raises(ValueError, match="outputs must have shape"):
        backend.selected_output_jacobians(case.X, one[:-1])


@pytest.mark.parametrize("row", BACKENDS, ids=ids(BACKENDS))
def test_jacobians_and_gradients_under_no_grad(case, row):
    """Predictives and grid search call the backend inside ``torch.no_grad()``."""
    oracle = Oracle(case.model, case.likelihood)
    backend = row.cls(case.model, case.likelihood)
    with torch.no_grad():
        Js, f = backend.jacobians(case.X)
        Gs, _ = backend.gradients(case.X, case.y)
    assert_close(Js, oracle.jacobian(case.X))
    assert_close(f, case.model(case.X))
    assert_close(Gs, oracle.per_sample_gradients(case.X, case.y))


@pytest.mark.parametrize("row", BACKENDS, ids=ids(BACKENDS))
def test_enable_backprop_differentiates_wrt_inputs(row):
    case = CASE_BUILDERS["mlp_regression_3out"]()
    backend = row.cls(case.model, case.likelihood)
    X = case.X[:4].clone().requires_grad_(True)
    Js, f = backend.jacobians(X, enable_backprop=True)
    weights = torch.randn(Js.shape, dtype=Js.dtype, generator=torch.Generator().manual_seed(0))
    (grad_x,) = torch.autograd.grad((Js * weights).sum() + f.sum(), X)
    X_ref = X.detach().clone().requires_grad_(True)
    Js_ref, f_ref = backend.functorch_jacobians(X_ref, enable_backprop=True)
    (expected,) = torch.autograd.grad((Js_ref * weights).sum() + f_ref.sum(), X_ref)
    assert_close(grad_x, expected)
    assert X.grad is None


SUBNET_ROWS = [b for b in BACKENDS if "subnetwork_indices" in b.cls.__init__.__code__.co_varnames]


@pytest.mark.parametrize("row", SUBNET_ROWS, ids=ids(SUBNET_ROWS))
def test_subnetwork_indices_restrict_everything(row):
    case = CASE_BUILDERS["cnn_classification"]()
    oracle = Oracle(case.model, case.likelihood)
    indices = torch.randperm(oracle.theta.numel(), generator=torch.Generator().manual_seed(1))
    indices = indices[:9]
    backend = row.cls(case.model, case.likelihood, subnetwork_indices=indices)
    H_all = row.reference(oracle, case.X, case.y)
    assert_close(backend.full(case.X, case.y)[1], H_all[indices][:, indices])
    assert_close(backend.diag(case.X, case.y)[1], H_all.diagonal()[indices])
    assert_close(backend.jacobians(case.X)[0], oracle.jacobian(case.X)[:, :, indices])
    expected_g = oracle.per_sample_gradients(case.X, case.y)[:, indices]
    assert_close(backend.gradients(case.X, case.y)[0], expected_g)


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("row", BACKENDS, ids=ids(BACKENDS))
def test_dict_inputs(row, structure):
    model, loader = dict_case()
    X = next(iter(loader))
    y = X["labels"]
    backend = row.cls(model, "classification")
    if not row.dict_inputs:
        with pytest.raises(ValueError, match="dict-like inputs; use backend=CurvlinopsGGN"):
            _curvature(backend, structure, X, y)
        with pytest.raises(ValueError, match="dict-like"):
            backend.jacobians(X)
        return
    oracle = Oracle(model, "classification")
    loss, H = _curvature(backend, structure, X, y)
    if row.kind == "ef":  # the oracle's EF vmaps over x, which is a dict here
        Gs = dict_per_sample_gradients(model, X, y)
        assert_close(backend.gradients(X, y)[0], Gs)
        expected = Gs.T @ Gs if structure == "full" else Gs.square().sum(0)
    else:
        expected = _expected(row, structure, oracle, X, y)
    assert_close(H, expected)
    assert_close(loss, oracle.loss(X, y))
    assert_close(backend.jacobians(X)[0], oracle.jacobian(X))


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("row", BACKENDS, ids=ids(BACKENDS))
def test_lora_model(row, structure):
    model, X, y = lora_case()
    oracle = Oracle(model, "classification")
    backend = row.cls(model, "classification")
    assert len(backend.params) == 4
    if not row.any_model:
        with pytest.raises(ValueError, match=r"nn.Sequential models.*CurvlinopsGGN or AsdlGGN"):
            _curvature(backend, structure, X, y)
    else:
        _, H = _curvature(backend, structure, X, y)
        assert_close(H, _expected(row, structure, oracle, X, y))
    assert_close(backend.jacobians(X)[0], oracle.jacobian(X))


@pytest.mark.parametrize("row", BACKENDS, ids=ids(BACKENDS))
def test_last_layer_mode_uses_features(row):
    torch.manual_seed(0)
    model = LoRAModel().double()  # only used as a feature body
    head = torch.nn.Linear(3, 4).double()

    class WithHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.last_layer = model, head

        def forward_with_features(self, x):
            phi = self.body(x)
            return self.last_layer(phi), phi

        def forward(self, x):
            return self.forward_with_features(x)[0]

    net = WithHead()
    X = torch.randn(8, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (8,))
    backend = row.cls(net, "classification", last_layer=True)
    oracle = Oracle(head, "classification")
    phi = model(X).detach()
    _, H = backend.full(X, y)
    assert_close(H, row.reference(oracle, phi, y))
    assert_close(backend.diag(X, y)[1], row.reference(oracle, phi, y).diagonal())
    assert_close(backend.jacobians(X)[0], oracle.jacobian(phi))


@pytest.mark.parametrize("structure", STRUCTURES)
def test_exact_ggn_agrees_across_backends(case, structure):
    results = [
        _curvature(row.cls(case.model, case.likelihood), structure, case.X, case.y)[1]
        for row in GGN_BACKENDS
    ]
    for H in results[1:]:
        assert_close(H, results[0])


KRON_ROWS = [b for b in BACKENDS if "kron" in b.structures]


@pytest.mark.parametrize("row", KRON_ROWS, ids=ids(KRON_ROWS))
def test_kron_matches_native_kfac(case, row):
    native = {"ggn": CurvlinopsGGN, "ef": CurvlinopsEF}[row.kind](case.model, case.likelihood)
    loss_ref, K_ref = native.kron(case.X, case.y, N=50)
    loss, K = row.cls(case.model, case.likelihood).kron(case.X, case.y, N=50)
    assert_close(loss, loss_ref)
    assert len(K.kfacs) == len(K_ref.kfacs)
    owners = [m for m in case.model.modules() for _ in m.parameters(recurse=False)]
    for block, ref, owner in zip(K.kfacs, K_ref.kfacs, owners):
        assert [F.shape for F in block] == [F.shape for F in ref]
        if row.cls is BackPackGGN and isinstance(owner, torch.nn.Conv2d):
            continue  # BackPACK's KFLR sums convolution positions its own way
        for F, F_ref in zip(block, ref):
            assert_close(F, F_ref)


#: Markov factor T of the Monte-Carlo tolerance ``T · v / k`` (false alarm at most 1/T).
MARKOV_FACTOR = 25.0


SAMPLE_COUNTS = [1, 10, 100, 1000]


def _single_sample_terms(case, oracle):
    """Per point and class: probability p (N, C), ``Aₙ(c)`` (N, C, P, P), exact ``Gₙ``."""
    J = oracle.jacobian(case.X)
    p = torch.softmax(oracle.f(oracle.theta, case.X), dim=-1).detach()
    g = p[:, None, :] - torch.eye(p.shape[1], dtype=p.dtype)  # (N, C, C): g_n(c)
    Jg = torch.einsum("nkp,nck->ncp", J, g)  # Jₙᵀ gₙ(c)
    A = Jg[..., :, None] * Jg[..., None, :]
    G_n = torch.einsum("nc,ncpq->npq", p, A)  # the exact per-point GGN
    return p, A, g, G_n


def test_mc_ggn_approaches_the_exact_ggn_as_the_sample_count_grows():
    case = CASE_BUILDERS["mlp_classification"]()
    oracle = Oracle(case.model, case.likelihood)
    p, A, _, G_n = _single_sample_terms(case, oracle)
    assert_close(G_n.sum(0), oracle.ggn(case.X))
    v = torch.einsum("nc,ncpq->", p, (A - G_n[:, None]).square())
    backend = CurvlinopsGGN(case.model, "classification", stochastic=True)
    torch.manual_seed(0)
    errors = []
    for k in SAMPLE_COUNTS:
        _, G_k = backend.full(case.X, case.y, mc_samples=k)
        errors.append((G_k - oracle.ggn(case.X)).square().sum())
        assert errors[-1] <= MARKOV_FACTOR * v / k, f"k={k}: {errors[-1]} > {MARKOV_FACTOR}·v/k"
    assert errors[-1] < errors[0] / 10


def test_mc_kron_approaches_the_exact_output_curvature_as_the_sample_count_grows():
    # The last bias's KFAC block is Σₙ Mₙ with Mₙ the output-space curvature: Λₙ exactly, or
    # the mean of gₙ(ŷ) gₙ(ŷ)ᵀ over k sampled targets.
    case = CASE_BUILDERS["mlp_classification"]()
    oracle = Oracle(case.model, case.likelihood)
    p, _, g, _ = _single_sample_terms(case, oracle)
    outer = g[..., :, None] * g[..., None, :]  # (N, C, C, C)
    Lam = torch.einsum("nc,ncij->nij", p, outer)
    w = torch.einsum("nc,ncij->", p, (outer - Lam[:, None]).square())
    N = len(case.X)
    exact = CurvlinopsGGN(case.model, "classification").kron(case.X, case.y, N=N)[1]
    assert_close(exact.kfacs[-1][0], Lam.sum(0))
    backend = CurvlinopsGGN(case.model, "classification", stochastic=True)
    torch.manual_seed(1)
    for k in SAMPLE_COUNTS:
        bias_block = backend.kron(case.X, case.y, N, mc_samples=k)[1].kfacs[-1][0]
        error = (bias_block - Lam.sum(0)).square().sum()
        assert error <= MARKOV_FACTOR * w / k, f"k={k}: {error} > {MARKOV_FACTOR}·w/k"


@pytest.mark.parametrize("route", ["full", "diag", "kron"])
def test_mc_samples_per_call_equals_num_samples(route):
    case = CASE_BUILDERS["mlp_classification"]()
    args = {"N": len(case.X)} if route == "kron" else {}
    per_call = CurvlinopsGGN(case.model, "classification", stochastic=True)
    configured = CurvlinopsGGN(case.model, "classification", stochastic=True, num_samples=7)
    torch.manual_seed(3)
    _, H_call = getattr(per_call, route)(case.X, case.y, mc_samples=7, **args)
    torch.manual_seed(3)
    _, H_configured = getattr(configured, route)(case.X, case.y, **args)
    dense = [H.to_matrix() if route == "kron" else H for H in (H_call, H_configured)]
    assert_close(dense[0], dense[1])


def test_mc_samples_is_refused_where_nothing_is_sampled():
    case = CASE_BUILDERS["mlp_classification"]()
    for backend in (
        CurvlinopsGGN(case.model, "classification"),
        CurvlinopsEF(case.model, "classification"),
    ):
        with pytest.raises(ValueError, match="mc_samples"):
            backend.full(case.X, case.y, mc_samples=4)
    stochastic = CurvlinopsGGN(case.model, "classification", stochastic=True)
    with pytest.raises(ValueError, match="mc_samples must be a positive integer"):
        stochastic.diag(case.X, case.y, mc_samples=0)
    with pytest.raises(ValueError, match="unknown keyword arguments \\['samples'\\]"):
        stochastic.full(case.X, case.y, samples=4)


SUBNET_BACKENDS = [b for b in BACKENDS if b.kind in ("ggn", "ef")]


@pytest.mark.parametrize("structure", ["full", "diag"])
@pytest.mark.parametrize("case_name", ["mlp_regression_3out", "mlp_classification"])
@pytest.mark.parametrize("row", SUBNET_BACKENDS, ids=ids(SUBNET_BACKENDS))
def test_every_ggn_and_ef_backend_fits_a_subnetwork(row, case_name, structure):
    case = CASE_BUILDERS[case_name]()
    oracle = Oracle(case.model, case.likelihood)
    idx = torch.tensor([30, 3, 17, 8, 25])
    la = Laplace(
        case.model,
        case.likelihood,
        "subnetwork",
        structure,
        subnetwork_indices=idx,
        backend=row.cls,
    )
    la.fit(case.loader())
    expected = row.reference(oracle, case.X, case.y)[idx][:, idx]
    assert_close(la.H, expected if structure == "full" else expected.diagonal())


@pytest.mark.parametrize("subnetwork", [False, True], ids=["all", "subnetwork"])
@pytest.mark.parametrize("route", ["diag", "full"])
@pytest.mark.parametrize("name", list(CASE_BUILDERS))
def test_a_batch_is_added_into_a_running_sum_in_place(name, route, subnetwork):
    """``full`` and ``diag`` with ``into`` add the batch to it and return it: the sum of the
    two batches' curvatures, in the running sum's own tensor (no batch copy)."""
    case = CASE_BUILDERS[name]()
    n_params = sum(p.numel() for p in case.model.parameters())
    indices = torch.arange(1, n_params, 3) if subnetwork else None
    backend = CurvlinopsGGN(case.model, case.likelihood, subnetwork_indices=indices)
    half = len(case.X) // 2
    first, second = (case.X[:half], case.y[:half]), (case.X[half:], case.y[half:])
    running = getattr(backend, route)(*first)[1]
    expected = running + getattr(backend, route)(*second)[1]
    pointer = running.data_ptr()
    total = getattr(backend, route)(*second, into=running)[1]
    assert total is running and total.data_ptr() == pointer
    assert_close(total, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("route", ["diag", "full"])
def test_a_running_sum_of_another_type_is_left_alone(route):
    """A float32 running sum of float64 curvature comes back unchanged, beside the batch's."""
    case = CASE_BUILDERS["mlp_classification"]()
    backend = CurvlinopsGGN(case.model, case.likelihood)
    batch = getattr(backend, route)(case.X, case.y)[1]
    running = torch.ones_like(batch, dtype=torch.float32)
    got = getattr(backend, route)(case.X, case.y, into=running)[1]
    assert got is not running and torch.equal(running, torch.ones_like(running))
    assert_close(got, batch, rtol=0, atol=0)
