"""The native KFAC over every parameterised layer, mixed in one posterior, against oracles.

Embeddings (diagonal token-count factor), transformers' ``Conv1D`` (``A ⊗ G``), the exact
blocks of LayerNorm / BatchNorm / GroupNorm / RMSNorm and of a module without a rule, and the
Linear head, all in one :class:`KronLaplace` (``cases.mixed_layers``); KFAC from recorded
output gradients equals KFAC; the errors name the module.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cases.mixed_layers import PAD, VOCAB, fitted, loader, mixed_net, oracle_blocks, tokens
from conftest import CASE_BUILDERS, Case, Oracle, assert_close, kron_dense_blocks
from laplace import KronLaplace
from laplace.curvature import CurvlinopsGGN
from laplace.curvature.engine.kfac import kfac

RTOL, ATOL = 1e-8, 1e-11


#: The blocks of MixedNet's parameters, in order (kron-diag: a diagonal first factor).
MIXED_KINDS = ["kron-diag", *["exact"] * 2, "kron", "bias", *["exact"] * 6, "kron", "bias"]


# --------------------------------------------------------------------- blocks vs the GGN
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_every_block_is_the_exact_ggn_block_for_one_point_at_one_position(approx):
    model = mixed_net()
    X, y = torch.tensor([[3]]), torch.tensor([1])
    backend = CurvlinopsGGN(model, "classification", kfac_approx=approx)
    _, H = backend.kron(X, y, N=1)
    kinds = [("kron-diag" if F[0].ndim == 1 else "kron") if len(F) == 2 else "x" for F in H.kfacs]
    assert kinds == [k if k.startswith("kron") else "x" for k in MIXED_KINDS]
    expected = oracle_blocks(model, Oracle(model, "classification").ggn(X))
    for got, want in zip(kron_dense_blocks(H), expected, strict=True):
        assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_exact_blocks_are_exact_over_many_points_and_positions(approx):
    model = mixed_net()
    X, y = tokens(9, 4)
    la = fitted(model, X, y, backend_kwargs={"kfac_approx": approx})
    exact = [i for i, kind in enumerate(MIXED_KINDS) if kind == "exact"]
    ggn = Oracle(model, "classification").ggn(X)
    for i in exact:
        assert_close(kron_dense_blocks(la.H_facs)[i], oracle_blocks(model, ggn)[i], RTOL, ATOL)
    # above the dense limit the exact diagonal (here: every exact block)
    diag = fitted(model, X, y, backend_kwargs={"kfac_dense_limit": 0})
    for i in exact:
        (F,) = diag.H_facs.kfacs[i]
        assert F.ndim == 1
        assert_close(F, oracle_blocks(model, ggn)[i].diagonal(), RTOL, ATOL)


def _output_columns(model, X):
    f = model(X)
    w, V = torch.linalg.eigh(Oracle(model, "classification").output_hessian(f.detach()))
    return f, (V * w.clamp(min=0).sqrt().unsqueeze(1)).unbind(-1)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_embedding_and_conv1d_factors_equal_their_definition(approx):
    """``diag(counts) ⊗ G`` and ``A ⊗ G``: first factor summed over the data, second over N."""
    model = mixed_net()
    X, y = tokens(9, 4)
    outputs = {}
    hooks = [
        m.register_forward_hook(lambda m, i, o: outputs.__setitem__(m, (i[0], o)))
        for m in (model.embed, model.proj)
    ]
    f, columns = _output_columns(model, X)
    for h in hooks:
        h.remove()
    N, T = X.shape
    G = {m: 0 for m in outputs}
    for v in columns:
        grads = torch.autograd.grad(f, [o for _, o in outputs.values()], v, retain_graph=True)
        for m, g in zip(outputs, grads):
            g = g.flatten(0, 1) if approx == "expand" else g.sum(1)
            G[m] = G[m] + g.T @ g
    one_hot = nn.functional.one_hot(X, VOCAB).double()
    one_hot[..., PAD] = 0
    a = outputs[model.proj][0].detach()
    if approx == "expand":
        counts = one_hot.sum((0, 1)) / T
        A = a.flatten(0, 1).T @ a.flatten(0, 1) / T
    else:
        counts = (one_hot.mean(1) ** 2).sum(0)
        A = a.mean(1).T @ a.mean(1)
    la = fitted(model, X, y, backend_kwargs={"kfac_approx": approx})
    embed, proj = la.H_facs.kfacs[0], la.H_facs.kfacs[3]
    assert_close(embed[0], counts, RTOL, ATOL)
    assert_close(embed[1], G[model.embed] / N, RTOL, ATOL)
    assert_close(proj[0], A, RTOL, ATOL)
    assert_close(proj[1], G[model.proj] / N, RTOL, ATOL)


class PositionEmbedded(nn.Module):
    """A position embedding looked up once for the batch, (1, T, D), and pooled over it."""

    def __init__(self):
        super().__init__()
        self.position = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        pooled = (x + self.position(torch.arange(x.shape[1]).unsqueeze(0))).mean((0, 1))
        return self.head(x.mean(1) + pooled)


def test_errors_name_the_module():
    X = torch.randn(6, 4, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (6,))
    la = KronLaplace(PositionEmbedded().double(), "classification")
    with pytest.raises(ValueError, match=r"'position' \(Embedding\).*requires_grad=False"):
        la.fit(loader(X, y))
    model = nn.Sequential(nn.Embedding(5, 2), nn.Flatten(), nn.Linear(4, 2)).double()
    targets = torch.randn(6, 2, dtype=torch.float64)
    per_output = KronLaplace(model, "regression", sigma_noise=torch.ones(2))
    with pytest.raises(ValueError, match=r"'0' \(Embedding\).*one sigma_noise"):
        per_output.fit(loader(torch.randint(0, 5, (6, 2)), targets))
    with pytest.raises(ValueError, match="kfac_dense_limit"):
        KronLaplace(model, "regression", backend_kwargs={"kfac_dense_limit": -1})
    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double().train()
    backend = CurvlinopsGGN(bn, "classification")
    with pytest.raises(ValueError, match=r"'1'.*BatchNorm1d.*batch statistics.*model.eval\(\)"):
        backend.kron(torch.randn(6, 3, dtype=torch.float64), y, N=6)


def _sequence_case() -> Case:
    """A linear layer applied at 4 positions per data point, then pooled (T > 1 for KFAC)."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Flatten(), nn.Linear(16, 3)).double()
    X = torch.randn(10, 4, 3, dtype=torch.float64)
    return Case("sequence", "classification", model, X, torch.randint(0, 3, (10,)), 4)


CASES = {**CASE_BUILDERS, "sequence": _sequence_case}


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("name", ["cnn_classification", "sequence", "mlp_regression_3out"])
def test_kfac_from_recorded_gradients_equals_kfac(name, approx):
    case = CASES[name]()
    backend = CurvlinopsGGN(case.model, case.likelihood)
    trace = backend.trace(case.X)
    columns = torch.stack(list(backend.curvature_columns(trace.f.detach(), case.y)))
    gradients = trace.output_gradients(columns)
    direct = kfac(trace, list(columns), 20, approx, backend.factor)
    recorded = kfac(trace, list(columns), 20, approx, backend.factor, gradients)
    assert_close(recorded.to_matrix(), direct.to_matrix())


@pytest.mark.parametrize("copy_elements", [7, 10_000])  # several chunks, and one
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_gram_of_strided_rows_sums_every_position(monkeypatch, copy_elements, scale):
    """A convolution's output gradients are (R, T, D) rows laid out (R, D, T): their Gram
    matrix, copied a chunk at a time, is the sum over every row and position."""
    from laplace.curvature.engine import kfac as kfac_module

    monkeypatch.setattr(kfac_module, "GRAM_COPY_ELEMENTS", copy_elements)
    rows = torch.randn(5, 3, 4, dtype=torch.float64).transpose(1, 2)  # (R, T, D), strided
    assert not rows.is_contiguous()
    expected = scale * torch.einsum("rtd,rte->de", rows, rows)
    sums = {}
    kfac_module._add_gram(sums, "factor", rows, "expand", scale)
    kfac_module._complete_grams(sums)
    assert_close(sums["factor"], expected, atol=1e-12, rtol=1e-12)


def _two_batches(name: str, approx: str, dense_limit: int):
    """A backend of the case ``name`` and its data split in two batches."""
    if name == "mixed":
        model, likelihood = mixed_net(), "classification"
        X, y = tokens(9, 4)
    else:
        case = CASE_BUILDERS[name]()
        model, likelihood, X, y = case.model, case.likelihood, case.X, case.y
    backend = CurvlinopsGGN(model, likelihood, kfac_approx=approx, kfac_dense_limit=dense_limit)
    half = len(X) // 2
    return backend, (X[:half], y[:half]), (X[half:], y[half:]), len(X)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize(
    "name, dense_limit",
    [("mixed", 1000), ("mixed", 0), ("cnn_classification", 1000), ("mlp_regression_3out", 1000)],
)
def test_kfac_into_a_running_sum_adds_the_batch_to_its_own_factors(name, dense_limit, approx):
    """Every kind of block summed into the running factors equals the two batches' sum.

    Kronecker weights with and without their layer's bias (whose blocks share the output
    Gram, scaled apart: ½ for regression), ``Conv1D`` (``A ⊗ G``), the embedding's token
    counts, exact dense and (``kfac_dense_limit=0``) diagonal blocks. The running factors are
    the same tensors after: no batch copy.
    """
    backend, first, second, n = _two_batches(name, approx, dense_limit)
    _, running = backend.kron(*first, N=n)
    _, batch = backend.kron(*second, N=n)
    expected = [[F.clone() for F in block] for block in (running + batch).kfacs]
    tensors = [F for block in running.kfacs for F in block]
    _, total = backend.kron(*second, N=n, into=running)
    assert total is running
    assert all(F is G for F, G in zip(tensors, (F for b in total.kfacs for F in b), strict=True))
    for got, want in zip(total.kfacs, expected, strict=True):
        for F, W in zip(got, want, strict=True):
            assert_close(F, W, rtol=1e-12, atol=1e-14)


def test_kfac_into_a_sum_of_another_type_returns_the_batch_and_leaves_the_sum():
    """A running sum the batch cannot be added to in place (float32 factors of a float64
    curvature) is left unchanged; the batch's own factors come back."""
    backend, first, second, n = _two_batches("mixed", "expand", 1000)
    _, running = backend.kron(*first, N=n)
    single = type(running)([[F.float() for F in block] for block in running.kfacs])
    before = [[F.clone() for F in block] for block in single.kfacs]
    _, batch = backend.kron(*second, N=n, into=single)
    assert batch is not single
    assert_close(batch.to_matrix(), backend.kron(*second, N=n)[1].to_matrix())
    for got, want in zip(single.kfacs, before, strict=True):
        assert all(torch.equal(F, W) for F, W in zip(got, want, strict=True))
