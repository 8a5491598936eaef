"""Half-precision networks: the network runs in bfloat16 / float16, the posterior in float32.

The reference is the same network cast to float32 (its weights are the half-precision ones,
exactly) on the same inputs (rounded to half precision first), so the two differ only by the
rounding of the half-precision forward and backward passes.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace import Laplace

#: Unit roundoff u of each half type (bfloat16: 8 significant bits, float16: 11).
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
#: Roundings along one path through the tiny networks: each layer's forward and backward
#: product and activation round once (u each), about 8 of them from input to curvature; the
#: curvature's relative Frobenius error is then at most about 8u.
ROUNDINGS = 8
N_CLASSES = 3


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, N_CLASSES))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, N_CLASSES)
    )


class TinyBert(nn.Module):
    """Logits (B, C) of a one-layer BERT from a config, position embeddings trainable."""

    def __init__(self):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.BertConfig(
            vocab_size=13, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=8, max_position_embeddings=8, num_labels=N_CLASSES,
            attn_implementation="eager",
        )  # fmt: skip
        self.bert = transformers.BertForSequenceClassification(config)

    def forward(self, tokens):
        return self.bert(input_ids=tokens).logits


class TinyRecurrent(nn.Module):
    """Logits (B, C) of an LSTM and a GRU over sequences (B, T, 3), read at the last step."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.gru = nn.GRU(4, 4, batch_first=True)
        self.head = nn.Linear(4, N_CLASSES)

    def forward(self, x):
        return self.head(self.gru(self.lstm(x)[0])[0][:, -1])


def data(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    if name == "mlp":
        return torch.randn(48, 4, generator=gen)
    if name == "recurrent":
        return torch.randn(48, 5, 3, generator=gen)
    if name == "cnn":
        return torch.randn(48, 1, 6, 6, generator=gen)
    return torch.randint(0, 13, (48, 5), generator=gen)


BUILDERS = {"mlp": mlp, "cnn": cnn, "bert": TinyBert, "recurrent": TinyRecurrent}


def pair(name: str, dtype: torch.dtype) -> tuple[nn.Module, nn.Module, DataLoader, DataLoader]:
    """A half-precision network and its float32 copy, with loaders of the same inputs."""
    torch.manual_seed(0)
    half = BUILDERS[name]().to(dtype).eval()
    single = BUILDERS[name]().eval()
    single.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    X = data(name)
    X_half = X.to(dtype) if X.is_floating_point() else X
    X_single = X_half.float() if X.is_floating_point() else X
    y = torch.randint(0, N_CLASSES, (len(X),), generator=torch.Generator().manual_seed(2))
    return (
        half,
        single,
        DataLoader(TensorDataset(X_half, y), batch_size=16),
        DataLoader(TensorDataset(X_single, y), batch_size=16),
    )


def dense(la) -> torch.Tensor:
    P = la.posterior_precision
    return P.to_matrix() if hasattr(P, "to_matrix") else P


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("structure", ["kron", "diag"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "bert"])
def test_half_precision_posterior_is_the_float32_one_within_the_forward_rounding(
    name, subset, structure, dtype
):
    half, single, half_loader, single_loader = pair(name, dtype)
    fitted = {}
    for model, loader in ((half, half_loader), (single, single_loader)):
        la = Laplace(model, "classification", subset, structure, prior_precision=0.5)
        la.fit(loader)
        fitted[model] = la
    la_half, la_single = fitted[half], fitted[single]
    assert la_half.mean.dtype == torch.float32
    assert next(half.parameters()).dtype == dtype  # the network keeps running in its type
    expected = dense(la_single)
    error = (dense(la_half) - expected).norm() / expected.norm()
    assert error <= ROUNDINGS * UNIT_ROUNDOFF[dtype], error
    la_half.optimize_prior_precision(method="marglik", n_steps=5)
    X = next(iter(half_loader))[0][:5]
    probs = la_half(X, link_approx="probit")
    assert probs.dtype == torch.float32 and torch.allclose(probs.sum(-1), torch.ones(5))
    f_mu, f_var = la_half._functional_moments(X)
    assert f_mu.dtype == f_var.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_half_precision_recurrent_layers_give_the_float32_posterior(structure, dtype):
    half, single, half_loader, single_loader = pair("recurrent", dtype)
    fitted = []
    for model, loader in ((half, half_loader), (single, single_loader)):
        la = Laplace(model, "classification", "all", structure, prior_precision=0.5)
        la.fit(loader)
        fitted.append(dense(la))
    error = (fitted[0] - fitted[1]).norm() / fitted[1].norm()
    assert error <= ROUNDINGS * UNIT_ROUNDOFF[dtype], error


def test_float64_posterior_of_a_float32_recurrent_network():
    _, single, _, loader = pair("recurrent", torch.bfloat16)
    ours = Laplace(single, "classification", "all", "diag", dtype=torch.float64)
    ours.fit(loader)
    reference = Laplace(single, "classification", "all", "diag")
    reference.fit(loader)
    assert ours.H.dtype == torch.float64
    assert torch.allclose(ours.H.float(), reference.H, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "subset, structure, kwargs",
    [
        ("all", "full", {}),
        ("all", "lowrank", {}),
        ("subnetwork", "full", {"subnetwork_indices": torch.tensor([0, 3, 70, 120])}),
        ("all", "gp", {"n_subset": 10}),
        ("all", "ekfac", {}),
        ("last_layer", "ekfac", {}),
        ("all", "diag_lowrank", {"backend_kwargs": {"n_eigenvalues": 5}}),
    ],
    ids=["full", "lowrank", "subnetwork", "gp", "ekfac", "ll-ekfac", "diag_lowrank"],
)
def test_every_structure_fits_predicts_samples_and_round_trips_in_bfloat16(
    subset, structure, kwargs
):
    half, _, loader, _ = pair("mlp", torch.bfloat16)
    la = Laplace(half, "classification", subset, structure, **kwargs)
    la.fit(loader)
    X = next(iter(loader))[0][:5]
    probs = la(X, link_approx="probit")
    assert probs.dtype == torch.float32
    if structure != "gp":
        samples = la(X, pred_type="nn", link_approx="mc", n_samples=4)
        assert samples.dtype == torch.float32
    assert next(half.parameters()).dtype == torch.bfloat16
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    restored = Laplace(half, "classification", subset, structure, **kwargs)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.mean.dtype == torch.float32
    assert torch.equal(restored(X, link_approx="probit"), probs)


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("subset", "structure"), [("all", "kron"), ("last_layer", "full")])
def test_dtype_argument_asks_for_a_float64_posterior(source, subset, structure):
    """``dtype=torch.float64``: the network runs in its type, everything after it in float64."""
    half, single, loader, single_loader = pair("mlp", torch.bfloat16)
    model, loader = (half, loader) if source == torch.bfloat16 else (single, single_loader)
    la = Laplace(model, "classification", subset, structure, dtype=torch.float64)
    la.fit(loader)
    assert la.dtype == torch.float64 and la.mean.dtype == torch.float64
    assert dense(la).dtype == torch.float64
    reference = Laplace(single, "classification", subset, structure)
    reference.fit(single_loader)
    error = (dense(la) - dense(reference)).norm() / dense(reference).norm()
    assert error <= ROUNDINGS * UNIT_ROUNDOFF[torch.bfloat16], error
    X = next(iter(loader))[0][:5]
    assert la(X, link_approx="probit").dtype == torch.float64
    assert la.log_marginal_likelihood().dtype == torch.float64
    assert next(model.parameters()).dtype == source


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64, "float64"], ids=str)
def test_a_bad_dtype_is_refused_naming_the_argument(dtype):
    with pytest.raises(ValueError, match=r"dtype must be None.*torch.float32 or torch.float64"):
        Laplace(mlp(), "classification", dtype=dtype)


#: Copies of one batch: a bfloat16 running sum would stop growing at 2**8 equal terms.
N_COPIES = 1000
#: float32 sums of N_COPIES equal terms: relative error at most N_COPIES float32 roundings.
FLOAT32_SUM_RTOL = N_COPIES * 2.0**-24


@pytest.mark.parametrize(("subset", "structure"), [("last_layer", "diag"), ("all", "kron")])
def test_curvature_is_summed_in_float32_not_in_the_network_type(subset, structure):
    """N copies of a batch give N times its curvature, far past where bfloat16 sums saturate."""
    half, _, loader, _ = pair("mlp", torch.bfloat16)
    X, y = (t[:5] for t in next(iter(loader)))
    one = Laplace(half, "classification", subset, structure)
    one.fit(DataLoader(TensorDataset(X, y), batch_size=5))
    many = Laplace(half, "classification", subset, structure)
    copies = TensorDataset(X.repeat(N_COPIES, 1), y.repeat(N_COPIES))
    many.fit(DataLoader(copies, batch_size=50))
    H_one, H_many = (la.H.to_matrix() if structure == "kron" else la.H for la in (one, many))
    expected = N_COPIES * H_one
    error = (H_many - expected).abs().max() / expected.abs().max()
    assert error <= FLOAT32_SUM_RTOL, error


class Widen(nn.Module):
    """A frozen bfloat16 base's activation handing float32 features to a float32 adapter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x).float()


def test_float32_adapters_on_a_bfloat16_frozen_base_still_work():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8).bfloat16().requires_grad_(False), Widen(), nn.Linear(8, 3)
    )
    X, y = torch.randn(20, 4).bfloat16(), torch.randint(0, N_CLASSES, (20,))
    la = Laplace(model, "classification", "all", "kron")
    la.fit(DataLoader(TensorDataset(X, y), batch_size=5))
    assert la.mean.dtype == la(X).dtype == torch.float32
