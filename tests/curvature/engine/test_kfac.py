"""KFAC over every parameterised layer, mixed in one posterior, against dense float64 oracles.

Embeddings (diagonal token-count factor), transformers' ``Conv1D`` (``A ⊗ G``), the exact
blocks of LayerNorm / BatchNorm / GroupNorm / RMSNorm and of a module without a rule, and the
Linear head, all in one :class:`KronLaplace`.
"""

from __future__ import annotations

import io
import itertools
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import Oracle, assert_close, assert_marglik_matches, kron_dense_blocks
from laplace import DiagLaplace, FullLaplace, KronLaplace
from laplace.curvature import AsdlGGN, BackPackGGN, CurvlinopsGGN
from laplace.structures.diagonal import diag_functional_variance
from laplace.structures.kronecker import kron_functional_variance

Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D

RTOL, ATOL = 1e-8, 1e-11
VOCAB, PAD = 7, 0


class Scale(nn.Module):
    """A module without any rule: its parameter takes the ``torch.func`` fallback."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(n))

    def forward(self, x):
        return x * self.weight


class MixedNet(nn.Module):
    """Tokens (B, T) → embedding, LayerNorm, Conv1D, Scale, BatchNorm, GroupNorm, RMSNorm, head."""

    def __init__(self, dim: int = 4, hidden: int = 5, n_out: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=PAD)
        self.norm = nn.LayerNorm(dim)
        self.proj = Conv1D(hidden, dim)
        self.scale = Scale(hidden)
        self.batch_norm = nn.BatchNorm1d(hidden)
        self.group_norm = nn.GroupNorm(1, hidden)
        self.rms = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, n_out)

    def forward(self, tokens):
        h = torch.tanh(self.proj(self.norm(self.embed(tokens))))
        h = self.group_norm(self.batch_norm(self.scale(h).transpose(1, 2))).transpose(1, 2)
        return self.head(self.rms(h).mean(1))


#: The blocks of MixedNet's parameters, in order (kron-diag: a diagonal first factor).
MIXED_KINDS = ["kron-diag", *["exact"] * 2, "kron", "bias", *["exact"] * 6, "kron", "bias"]


def mixed_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = MixedNet().double().eval()
    with torch.no_grad():
        for module in (model.norm, model.batch_norm, model.group_norm, model.rms):
            for p in module.parameters():
                p.add_(0.5 * torch.randn_like(p))
        model.proj.weight.normal_(0, 0.5)
        model.proj.bias.normal_(0, 0.2)
        model.batch_norm.running_mean.normal_(0, 0.3)
        model.batch_norm.running_var.uniform_(0.5, 1.5)
    return model


def tokens(n: int, T: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    X = torch.randint(0, VOCAB, (n, T), generator=gen)
    return X, torch.randint(0, 3, (n,), generator=gen)


def loader(X, y, batch_size: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(X, y), batch_size=batch_size)


def oracle_blocks(model: nn.Module, matrix: torch.Tensor) -> list[torch.Tensor]:
    sizes = [p.numel() for p in model.parameters()]
    starts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    return [matrix[a:b, a:b] for a, b in itertools.pairwise(starts)]


def fitted(model, X, y, likelihood="classification", **kwargs) -> KronLaplace:
    la = KronLaplace(model, likelihood, **kwargs)
    la.fit(loader(X, y))
    return la


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


# ------------------------------------------------------------ the mixed posterior, dense
def dense_precision(la: KronLaplace, sigma: float = 1.0) -> torch.Tensor:
    return la.H_facs.to_matrix() / sigma**2 + torch.diag(la.prior_precision_diag)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_mixed_marglik_and_its_gradients_equal_full_laplace_on_the_dense_kfac(likelihood):
    model = mixed_net()
    X, y = tokens(10, 3)
    y = y if likelihood == "classification" else torch.randn(10, 3, dtype=torch.float64)
    la = fitted(model, X, y, likelihood, backend_kwargs={"kfac_dense_limit": 4})
    assert [len(F) for F in la.H_facs.kfacs].count(1) == 10  # biases, exact dense, diagonal
    assert any(F[0].ndim == 1 for F in la.H_facs.kfacs if len(F) == 1)
    full = FullLaplace(model, likelihood)
    full.fit(loader(X, y))
    full.H = la.H_facs.to_matrix()
    priors = ([0.7], torch.linspace(0.5, 2.0, la.n_layers).tolist())
    assert_marglik_matches(la, full, likelihood, priors)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_mixed_glm_predictive_is_jacobian_free_and_matches_the_dense_reference(approx):
    model = mixed_net()
    X, y = tokens(10, 3)
    kwargs = {"kfac_approx": approx, "kfac_dense_limit": 4}
    prior = torch.linspace(0.5, 2, 13).double()
    la = fitted(model, X, y, backend_kwargs=kwargs, prior_precision=prior)
    J = Oracle(model, "classification").jacobian(X)
    expected = J @ torch.linalg.inv(dense_precision(la)) @ J.transpose(1, 2)
    trace = la.backend.trace(X)
    f_var = kron_functional_variance(trace, la.posterior_precision)
    assert f_var is not None  # every block has a layer-wise form
    assert_close(f_var, expected, rtol=1e-8, atol=1e-12)
    f_mu, f_var = la._functional_moments(X)
    assert_close(f_var, expected, rtol=1e-8, atol=1e-12)
    assert_close(f_mu, model(X))
    f_var_jac = la.functional_variance(la.backend.jacobians(X)[0])
    assert_close(f_var_jac, expected, rtol=1e-8, atol=1e-12)


def test_diag_glm_predictive_of_the_mixed_model_is_jacobian_free():
    model = mixed_net()
    X, y = tokens(10, 3)
    la = DiagLaplace(model, "classification", prior_precision=0.7)
    la.fit(loader(X, y))
    trace = la.backend.trace(X)
    f_var = diag_functional_variance(trace, la.posterior_precision)
    assert f_var is not None
    J = Oracle(model, "classification").jacobian(X)
    expected = (J / la.posterior_precision) @ J.transpose(1, 2)
    assert_close(f_var, expected, rtol=1e-8, atol=1e-12)


def test_mixed_samples_are_the_symmetric_root_of_the_dense_covariance():
    model = mixed_net()
    X, y = tokens(10, 3)
    la = fitted(model, X, y, prior_precision=0.8, backend_kwargs={"kfac_dense_limit": 4})
    w, V = torch.linalg.eigh(dense_precision(la))
    root = (V * w.rsqrt()) @ V.T
    samples = la.sample(5, generator=torch.Generator().manual_seed(3))
    z = torch.randn(
        5, la.n_params, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    assert_close(samples, la.mean + z @ root, rtol=1e-8, atol=1e-10)


def test_mixed_state_dict_round_trip_and_online_fit():
    model = mixed_net()
    X, y = tokens(12, 3)
    la = fitted(model, X, y, prior_precision=0.5, backend_kwargs={"kfac_dense_limit": 4})
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True, map_location="cpu")
    other = KronLaplace(model, "classification", backend_kwargs={"kfac_dense_limit": 4})
    other.load_state_dict(state)
    assert other.H_facs.shapes == la.H_facs.shapes
    assert_close(other.log_marginal_likelihood(), la.log_marginal_likelihood())
    # the dense structure of another limit does not load
    with pytest.raises(ValueError, match="Kronecker factors of shapes"):
        KronLaplace(model, "classification").load_state_dict(state)
    online = KronLaplace(
        model, "classification", prior_precision=0.5, backend_kwargs={"kfac_dense_limit": 4}
    )
    for i, part in enumerate([slice(0, 5), slice(5, None)]):
        online.fit(loader(X[part], y[part]), override=i == 0)
    for got, want in zip(online.H_facs.kfacs, la.H_facs.kfacs):
        for g, w in zip(got, want):
            assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert_close(online.log_marginal_likelihood(), la.log_marginal_likelihood())


def test_an_embedding_never_holds_a_vocabulary_square():
    """V = 10⁶: a V × V factor would be 8 TB; fit, marglik, predictive and samples run."""
    V, D = 1_000_000, 2
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, D), nn.Flatten(), nn.Linear(3 * D, 2)).double()
    X = torch.randint(0, V, (8, 3))
    y = torch.randint(0, 2, (8,))
    la = fitted(model, X, y)
    assert la.H_facs.shapes[0] == [(V,), (D, D)]
    assert la.H.factor_bases(0)[0] is None  # the identity stays implicit
    assert math.isfinite(la.log_marginal_likelihood().item())
    _, f_var = la._functional_moments(X[:4])
    J = la.backend.jacobians(X[:4])[0]
    assert_close(f_var, la.functional_variance(J), rtol=1e-8, atol=1e-12)
    assert la.sample(2).shape == (2, la.n_params)


def test_one_sigma_per_output_combines_exact_blocks_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()
    X, y = torch.randn(10, 3, dtype=torch.float64), torch.randn(10, 2, dtype=torch.float64)
    shared = fitted(model, X, y, "regression", sigma_noise=0.7)
    per_output = fitted(model, X, y, "regression", sigma_noise=torch.tensor([0.7, 0.7]))
    assert_close(per_output.log_marginal_likelihood(), shared.log_marginal_likelihood())
    # (separate eigendecompositions of each output's sum: round-off as for Linear layers alone)
    f_var = per_output._functional_moments(X)[1]
    assert_close(f_var, shared._functional_moments(X)[1], rtol=1e-6, atol=1e-12)


# --------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("backend", [AsdlGGN, BackPackGGN])
@pytest.mark.parametrize(
    ("layer", "name"), [(nn.LayerNorm(4), "LayerNorm"), (nn.Embedding(5, 4), "Embedding")]
)
def test_third_party_kfac_names_the_module_and_the_alternatives(backend, layer, name):
    model = nn.Sequential(layer, nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=rf"'0' \({name}\).*CurvlinopsGGN.*'diag'"):
        KronLaplace(model, "classification", backend=backend)


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


# ------------------------------------------------------------------ tiny transformers
class LastToken(nn.Module):
    """Next-token logits at the last position, (B, V)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        return self.lm(input_ids=tokens).logits[:, -1]


def _tiny_lm(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    if name == "gpt2":  # Conv1D projections, LayerNorm, wte tied to the head
        sizes = {"n_positions": 8, "n_embd": 8, "n_layer": 1, "n_head": 2}
        tokens = {"vocab_size": 11, "bos_token_id": 0, "eos_token_id": 0}
        config = transformers.GPT2Config(**sizes, **tokens, attn_implementation="eager")
        lm = transformers.GPT2LMHeadModel(config)
        lm.transformer.wpe.weight.requires_grad_(False)  # looked up once for the batch
    else:  # Linear projections, RMSNorm, an untied embedding
        sizes = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1}
        heads = {"num_attention_heads": 2, "num_key_value_heads": 2}
        config = transformers.LlamaConfig(
            vocab_size=11, max_position_embeddings=8, **sizes, **heads, attn_implementation="eager"
        )
        lm = transformers.LlamaForCausalLM(config)
    return LastToken(lm).double().eval()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_tiny_transformer_kron_predictive_matches_the_dense_reference(name):
    torch.manual_seed(0)
    model = _tiny_lm(name)
    X, y = torch.randint(0, 11, (6, 5)), torch.randint(0, 11, (6,))
    la = fitted(model, X, y)
    first = la.H_facs.shapes[0]
    # GPT-2's tied embedding (used by the embedding and the head): its exact dense block
    assert first == ([(88, 88)] if name == "gpt2" else [(11,), (8, 8)])
    assert math.isfinite(la.log_marginal_likelihood().item())
    J = Oracle(model, "classification").jacobian(X)
    expected = J @ torch.linalg.inv(dense_precision(la)) @ J.transpose(1, 2)
    assert kron_functional_variance(la.backend.trace(X), la.posterior_precision) is not None
    assert_close(la._functional_moments(X)[1], expected, rtol=1e-8, atol=1e-12)
