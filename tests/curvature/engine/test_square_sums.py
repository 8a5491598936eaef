"""Square sums of per-sample gradients without forming them (``SQUARE_SUM_RULES``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import assert_close
from laplace.curvature.engine import layer_rules


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_square_sum_equals_the_squared_per_sample_gradients(padding_idx):
    from laplace.curvature.engine.square_sums import SQUARE_SUM_RULES

    gen = torch.Generator().manual_seed(0)
    module = nn.Embedding(6, 3, padding_idx=padding_idx).double()
    tokens = torch.randint(0, 6, (4, 7), generator=gen)  # tokens repeat within rows
    tokens[0, :3] = 2  # the padding token, and a token three times in one row
    out = module(tokens)
    grads = torch.randn(5, *out.shape, dtype=torch.float64, generator=gen)  # 5 columns
    call = layer_rules.ModuleCall(module, (tokens,), {}, [out], [0], ["weight"])
    rule = SQUARE_SUM_RULES[nn.Embedding]
    assert rule.applies(call, 1)
    per_sample = torch.stack([layer_rules.per_sample_grads(call, [g])["weight"] for g in grads])
    two_chunks = rule.partial(call, grads[:2]) + rule.partial(call, grads[2:])
    assert_close(rule.finish(call, two_chunks)["weight"], per_sample.square().sum((0, 1)))


RECURRENT_SUMS = [
    (nn.LSTM, False, 1, True),
    (nn.LSTM, True, 2, False),
    (nn.GRU, True, 2, True),
    (nn.GRU, False, 1, False),
    (nn.RNN, True, 2, True),
]


def _recurrent_call(kind, bidirectional, layers, with_hx):
    """A recorded batch-first call of a tiny recurrent layer (float64) and 3 columns' gradients."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    module = kind(3, 4, layers, batch_first=True, bidirectional=bidirectional).double()
    x = torch.randn(5, 6, 3, generator=gen, dtype=torch.float64)
    states = layers * (2 if bidirectional else 1)
    h0 = torch.randn(states, 5, 4, generator=gen, dtype=torch.float64)
    hx = (h0, h0.cos()) if kind is nn.LSTM else h0
    out, state = module(x, hx) if with_hx else module(x)
    outputs = [out, *(s.movedim(1, 0) for s in (state if kind is nn.LSTM else (state,)))]
    grads = [torch.randn(3, *z.shape, generator=gen, dtype=torch.float64) for z in outputs]
    args = (x, tuple(h.movedim(1, 0) for h in hx) if kind is nn.LSTM else hx.movedim(1, 0))
    names = [name for name, _ in module.named_parameters()]
    call = layer_rules.ModuleCall(
        module, args if with_hx else (x,), {}, outputs, list(range(len(outputs))), names
    )
    return call, grads, (x, hx if with_hx else None)


def _autograd_per_sample(module, inputs, grads):
    """Per-sample gradients (K, B, n) of each parameter by plain autograd, one sample at a time."""
    x, hx = inputs
    params = dict(module.named_parameters())
    rows = {name: [] for name in params}
    for k in range(len(grads[0])):
        for n in range(len(x)):
            if hx is None:
                out, state = module(x[n : n + 1])
            elif isinstance(hx, tuple):
                out, state = module(x[n : n + 1], tuple(h[:, n : n + 1] for h in hx))
            else:
                out, state = module(x[n : n + 1], hx[:, n : n + 1])
            outputs = [out, *(state if isinstance(state, tuple) else (state,))]
            outputs = [outputs[0][0], *(s[:, 0] for s in outputs[1:])]
            value = sum((z * g[k, n]).sum() for z, g in zip(outputs, grads))
            for name, u in zip(params, torch.autograd.grad(value, list(params.values()))):
                rows[name].append(u.flatten())
    return {
        name: torch.stack(us).unflatten(0, (len(grads[0]), len(x))) for name, us in rows.items()
    }


@pytest.mark.oracle
@pytest.mark.parametrize(
    "kind, bidirectional, layers, with_hx",
    RECURRENT_SUMS,
    ids=[
        f"{k.__name__}-{d + 1}dir-{n}layers-{'hx' if h else 'zeros'}"
        for k, d, n, h in RECURRENT_SUMS
    ],
)
def test_recurrent_exact_sums_equal_the_per_sample_oracle(kind, bidirectional, layers, with_hx):
    """One pullback of all columns gives the squares and Grams of the per-sample gradients."""
    from laplace.curvature.engine.square_sums import EXACT_SUM_RULES

    call, grads, inputs = _recurrent_call(kind, bidirectional, layers, with_hx)
    expected = _autograd_per_sample(call.module, inputs, grads)
    dense = {name for name in call.names if name.startswith("bias") or name.endswith("_l0")}
    sums = EXACT_SUM_RULES[kind](call, grads, dense)
    assert set(sums) == set(call.names)
    for name, u in expected.items():
        u = u.flatten(0, 1)
        if name in dense:
            assert_close(sums[name], u.T @ u)
        else:
            assert_close(sums[name].flatten(), u.square().sum(0))
    # the per-sample rule of a call tiled for the 3 columns: unrolled once, pulled back at once
    tiled = layer_rules.tiled_call(call, 3)
    per_sample = layer_rules.per_sample_grads(tiled, [g.flatten(0, 1) for g in grads])
    for name, u in expected.items():
        assert_close(per_sample[name].flatten(1), u.flatten(0, 1))


CONV_SQUARE_SUMS = [
    (nn.Conv1d, dict(kernel_size=3, stride=2, padding=1), (5,)),
    (nn.Conv2d, dict(kernel_size=3, padding=1, groups=2, bias=False), (2, 2)),
    (nn.Conv2d, dict(kernel_size=2, stride=2, padding_mode="reflect", padding=1), (3, 4)),
    (nn.Conv2d, dict(kernel_size=3, dilation=2), (5, 5)),
    (nn.Conv3d, dict(kernel_size=(1, 2, 2), groups=2), (2, 2, 2)),
]


def _conv_oracle(module, x, grads):
    """Σₖₙ squared per-sample gradients by ``torch.func``: ∂θ ⟨gₖₙ, f(xₙ)⟩ for every (k, n)."""
    params = {name: p.detach() for name, p in module.named_parameters()}

    def pairing(theta, xn, gn):
        return (torch.func.functional_call(module, theta, (xn[None],))[0] * gn).sum()

    per_sample = torch.func.vmap(
        torch.func.vmap(torch.func.grad(pairing), in_dims=(None, 0, 0)), in_dims=(None, None, 0)
    )(params, x, grads)
    return {name: u.square().sum((0, 1)) for name, u in per_sample.items()}


@pytest.mark.oracle
@pytest.mark.parametrize("n_columns", [1, 4])
@pytest.mark.parametrize(
    "kind, options, spatial",
    CONV_SQUARE_SUMS,
    ids=[f"{k.__name__}-{'-'.join(map(str, s))}" for k, _, s in CONV_SQUARE_SUMS],
)
def test_conv_position_grams_equal_the_per_sample_oracle(kind, options, spatial, n_columns):
    """The Grams of output positions, added over chunks of columns, give the squared sums."""
    from laplace.curvature.engine.square_sums import SQUARE_SUM_RULES

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    module = kind(4, 6, **options).double()
    x = torch.randn(3, 4, *spatial, generator=gen, dtype=torch.float64)
    out = module(x)
    grads = torch.randn(n_columns, *out.shape, generator=gen, dtype=torch.float64)
    names = [name for name, _ in module.named_parameters()]
    call = layer_rules.ModuleCall(module, (x,), {}, [out], [0], names)
    rule = SQUARE_SUM_RULES[kind]
    grams = sum(rule.partial(call, grads[k : k + 1]) for k in range(n_columns))
    sums = rule.finish(call, grams)
    expected = _conv_oracle(module, x, grads)
    assert set(sums) == set(expected)
    for name, value in expected.items():
        assert_close(sums[name], value)


def test_conv_position_grams_apply_at_few_positions_only():
    """The Grams replace per-sample gradients where L² ≤ K (L + PER_SAMPLE_ENTRY_COST)."""
    from laplace.curvature.engine.square_sums import PER_SAMPLE_ENTRY_COST, SQUARE_SUM_RULES

    assert PER_SAMPLE_ENTRY_COST == 64  # the expectations below are for this cost
    rule = SQUARE_SUM_RULES[nn.Conv2d]
    module = nn.Conv2d(2, 2, 1)
    # (output side, columns K) → taken: 2 × 2 for 1 column, 4 × 4 for 10 (ResNet's late
    # stages), not 4 × 4 for 1 column, nor 8 × 8 and more for 10
    for side, n_columns, taken in [(2, 1, True), (4, 10, True), (4, 1, False), (8, 10, False)]:
        x = torch.randn(1, 2, side, side)
        call = layer_rules.ModuleCall(module, (x,), {}, [module(x)], [0], ["weight"])
        assert rule.applies(call, n_columns) is taken


@pytest.mark.oracle
@pytest.mark.parametrize(
    "n_classes, first, late",
    [(3, [], [2]), (10, [9], [4, 4, 1])],  # K = C − 1 columns (the softmax Hessian's rank)
)
def test_diagonal_of_a_cnn_with_gathered_position_grams_is_the_ggn_diagonal(
    n_classes, first, late
):
    """Convolutions taking the position Grams gather their columns' gradients over the
    one-column chunks, L at a time, and are finished call by call: at 2 × 2 outputs (L = 4)
    9 columns make Grams of 4, 4 and 1; at 4 × 4 (L = 16) the Grams pay off for 9 columns, not
    for 2, and take all 9 at once. The diagonal is the dense float64 GGN's."""
    from conftest import Oracle
    from laplace.curvature import CurvlinopsGGN
    from laplace.curvature.engine.square_sums import SQUARE_SUM_RULES

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 4, 3, stride=2, padding=1),  # 4 × 4 → 2 × 2: L = 4
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(16, n_classes),
    ).double()
    X = torch.randn(5, 2, 4, 4, dtype=torch.float64)
    y = torch.randint(0, n_classes, (5,))
    rule = SQUARE_SUM_RULES[nn.Conv2d]
    partials = []
    original = rule.partial

    def counted(call, grads):
        partials.append((call.module, len(grads)))
        return original(call, grads)

    backend = CurvlinopsGGN(model, "classification")
    object.__setattr__(rule, "partial", counted)
    try:
        diagonal = backend.diag(X, y)[1]
    finally:
        object.__setattr__(rule, "partial", original)
    assert [k for module, k in partials if module is model[0]] == first
    assert [k for module, k in partials if module is model[2]] == late
    assert_close(diagonal, Oracle(model, "classification").ggn(X).diagonal(), 1e-10, 1e-12)
