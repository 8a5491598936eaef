"""The Kronecker structure with low-rank and mixed blocks, against dense float64 oracles.

All-weights KronLaplace with many outputs: ``LARGE_OUTPUT_THRESHOLD`` is lowered (fixture
``threshold``) so that the tiny models' layers count as large; the structured fit is compared
with the dense all-weights Kron fit of the same curvature columns (threshold restored; the
Monte-Carlo Fisher draws the same targets from the same seed) and, for the output layer's
factor, with the empirical Fisher written out by hand.

Mixed blocks: embeddings (a diagonal factor), transformers' ``Conv1D``, the exact blocks of
normalisation layers and of a module without a rule, and a Linear head in one posterior
(``cases.mixed_layers``): marginal likelihood, GLM predictive, samples, state and online fit
against the dense matrix of its blocks.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cases.mixed_layers import fitted, loader, mixed_net, tokens
from conftest import CASE_BUILDERS, POSITION_CASES, Oracle, assert_close, assert_marglik_matches
from laplace import FullLaplace, KronLaplace, Laplace
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN
from laplace.likelihoods.categorical import Categorical
from laplace.structures import large_output as large_output_module
from laplace.structures import memory_budgets as nn_predictive_module
from laplace.structures.kronecker import kron_functional_variance
from laplace.utils.diag_lowrank import DiagLowRank
from laplace.utils.errors import TooLargeError
from laplace.utils.matrix import StructuredKron, StructuredKronDecomposed

#: Curvatures with a few columns per data point: empirical Fisher, Monte-Carlo Fisher.
BACKENDS = {
    "ef": {"backend": CurvlinopsEF},
    "mc": {"backend": CurvlinopsGGN, "backend_kwargs": {"stochastic": True, "num_samples": 2}},
}


CASES = {
    "mlp": lambda: CASE_BUILDERS["mlp_classification"](),
    "tokens": POSITION_CASES["token_classification"],  # (B, T, C), some labels −100
}


#: Large enough that nothing is truncated on the tiny data sets.
EXACT_RANK = 1000


#: Standard deviations of the Monte-Carlo error allowed for a sample covariance entry.
MC_SIGMAS = 6.0


@pytest.fixture
def threshold(monkeypatch):
    """A setter of ``LARGE_OUTPUT_THRESHOLD`` (restored after the test)."""

    def use(value: int) -> None:
        monkeypatch.setattr(large_output_module, "LARGE_OUTPUT_THRESHOLD", value)

    use(2)
    return use


def fit(case, threshold, value: int, backend: str, rank: int = EXACT_RANK, **kwargs):
    """A KronLaplace fitted with the threshold at ``value`` (same MC draws for every fit)."""
    threshold(value)
    la = KronLaplace(
        case.model, "classification", output_factor_rank=rank, **BACKENDS[backend], **kwargs
    )
    torch.manual_seed(11)
    la.fit(case.loader())
    threshold(2)
    return la


def fit_both(case, threshold, backend: str, **kwargs):
    """The structured fit (every layer large) and the dense fit of the same columns."""
    return (
        fit(case, threshold, 2, backend, **kwargs),
        fit(case, threshold, 10_000, backend, **kwargs),
    )


def layerwise_prior(la) -> torch.Tensor:
    return torch.linspace(0.4, 2.0, la.n_layers, dtype=torch.float64)


# ------------------------------------------------------------------------ posterior equality
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name", list(CASES))
def test_structured_all_weights_kron_equals_the_dense_one(threshold, name, backend):
    case = CASES[name]()
    ours, theirs = fit_both(case, threshold, backend)
    assert isinstance(ours.H_facs, StructuredKron) and isinstance(ours.H, StructuredKronDecomposed)
    assert all(isinstance(block[0], DiagLowRank) for block in ours.H_facs.kfacs)
    assert not isinstance(theirs.H_facs, StructuredKron)
    assert_close(ours.H_facs.to_matrix(), theirs.H_facs.to_matrix())
    assert_close(ours.log_det_posterior_precision, theirs.log_det_posterior_precision)
    assert_close(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood())
    grads = []
    for la in (ours, theirs):
        prior = layerwise_prior(la).requires_grad_()
        (grad,) = torch.autograd.grad(la.log_marginal_likelihood(prior), prior)
        grads.append(grad)
    assert_close(*grads)
    P = theirs.posterior_precision.to_matrix()
    assert_close(ours.posterior_precision.to_matrix(), P)
    root = ours.posterior_precision.to_matrix(exponent=-0.5)
    assert_close(root @ root.T, torch.linalg.inv(P))


def test_samples_have_the_posterior_covariance(threshold):
    case = CASES["mlp"]()
    ours, theirs = fit_both(case, threshold, "ef")
    n = 20_000
    samples = ours.sample(n, generator=torch.Generator().manual_seed(3))
    covariance = torch.linalg.inv(theirs.posterior_precision.to_matrix())
    deviations = samples - ours.mean
    sample_covariance = deviations.T @ deviations / n
    variances = covariance.diagonal()
    standard_error = ((variances[:, None] * variances[None] + covariance.square()) / n).sqrt()
    worst = ((sample_covariance - covariance).abs() / standard_error).max()
    assert worst < MC_SIGMAS, f"sample covariance off by {worst:.1f} standard errors"


def test_dropped_positions_contribute_nothing_to_the_output_factor(threshold):
    """The output layer's G is Σ g gᵀ over the kept positions' loss gradients, nothing else."""
    case = CASES["tokens"]()
    ours = fit(case, threshold, 2, "ef")
    with torch.no_grad():
        f = case.model(case.X)
    gradients = torch.softmax(f, -1) - nn.functional.one_hot(case.y.clamp_min(0), f.shape[-1])
    kept = case.y != -100
    assert not bool(kept.all())
    rows = (gradients * kept[..., None]).reshape(-1, f.shape[-1])
    G_head = ours.H_facs.kfacs[2][0]  # the head's weight block: G ⊗ A, loss factor 1
    assert_close(G_head.to_dense(), rows.T @ rows)
    everything = gradients.reshape(-1, f.shape[-1])
    assert not torch.allclose(G_head.to_dense(), everything.T @ everything)


def test_a_large_hidden_layer_mixes_with_dense_blocks_and_keeps_the_glm(threshold):
    """Threshold 4: the hidden layer (5 outputs) is structured, the 4-class head is not."""
    case = CASES["mlp"]()
    backend = {"backend": CurvlinopsGGN}  # the exact GGN of 4 outputs is affordable
    threshold(4)
    ours = KronLaplace(case.model, "classification", output_factor_rank=EXACT_RANK, **backend)
    ours.fit(case.loader())
    threshold(10_000)
    theirs = KronLaplace(case.model, "classification", **backend)
    theirs.fit(case.loader())
    kinds = [type(block[0]) for block in ours.H_facs.kfacs]
    assert kinds == [DiagLowRank, DiagLowRank, torch.Tensor, torch.Tensor]
    assert_close(ours.H_facs.to_matrix(), theirs.H_facs.to_matrix())
    assert_close(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood())
    X = case.X[:5]
    assert_close(ours(X), theirs(X))  # GLM through dense Jacobian rows of 4 outputs
    mc = [
        la(X, link_approx="mc", generator=torch.Generator().manual_seed(0))
        for la in (ours, theirs)
    ]
    assert_close(*mc)


# ------------------------------------------------------------------- the bounded rank
def test_truncated_factors_stay_within_their_log_det_bound(threshold):
    case = CASES["mlp"]()
    kept = fit(case, threshold, 2, "ef", rank=2)
    exact = fit(case, threshold, 2, "ef")
    dropped = [block[0].dropped for block in kept.H_facs.kfacs]
    assert all(bool(d > 0) for d in dropped)  # 20 gradient columns folded to 2
    # EF factors are U Uᵀ: the kept ones are G − R + diag(R) (the diagonal of G exact), so the
    # log det moves by at most 2·h·(tr A·tr R_weight + tr R_bias)/δ per layer either way
    # (h = 1/(σ²T) = 1 here; ‖diag(R) − R‖_* ≤ 2 tr R and both precisions are ⪰ δ I).
    for ours, theirs in zip(kept.H_facs.kfacs, exact.H_facs.kfacs):
        assert_close(ours[0].to_dense().diagonal(), theirs[0].to_dense().diagonal())
    delta = kept.prior_precision.item()
    blocks = kept.H_facs.kfacs
    traces = [(b[1].trace() if len(b) == 2 else 1.0) * b[0].dropped for b in blocks]
    gap = exact.log_det_posterior_precision - kept.log_det_posterior_precision
    assert 0 < abs(gap) <= 2 * sum(traces) / delta


# --------------------------------------------------------------------- fit variants and state
def test_online_fit_equals_one_fit_on_all_the_data(threshold):
    case = CASES["mlp"]()
    threshold(2)
    la = KronLaplace(case.model, "classification", backend=CurvlinopsEF, output_factor_rank=99)
    halves = [DataLoader(TensorDataset(case.X[i::2], case.y[i::2]), batch_size=7) for i in (0, 1)]
    la.fit(halves[0])
    la.fit(halves[1], override=False)
    once = fit(case, threshold, 2, "ef")
    assert la.n_data == once.n_data
    assert_close(la.H_facs.to_matrix(), once.H_facs.to_matrix())
    assert_close(la.log_marginal_likelihood(), once.log_marginal_likelihood())


def test_damping_and_state_dict_round_trip(threshold):
    case = CASES["tokens"]()
    ours, theirs = fit_both(case, threshold, "ef", damping=True)
    assert_close(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood())
    threshold(2)
    options = {"backend": CurvlinopsEF, "damping": True, "output_factor_rank": EXACT_RANK}
    loaded = KronLaplace(case.model, "classification", **options)
    loaded.load_state_dict(ours.state_dict())
    assert isinstance(loaded.H_facs, StructuredKron)
    assert_close(loaded.H_facs.to_matrix(), ours.H_facs.to_matrix())
    assert_close(loaded.log_marginal_likelihood(), ours.log_marginal_likelihood())
    threshold(10_000)
    dense = KronLaplace(case.model, "classification", backend=CurvlinopsEF, damping=True)
    with pytest.raises(ValueError, match="diagonal-plus-low-rank factor"):
        dense.load_state_dict(ours.state_dict())


def test_marglik_tuning_runs_through_the_structure(threshold):
    case = CASES["tokens"]()
    ours, theirs = fit_both(case, threshold, "mc")
    for la in (ours, theirs):
        la.prior_precision = layerwise_prior(la)
        la.optimize_prior_precision(method="marglik", n_steps=5)
    assert_close(ours.prior_precision, theirs.prior_precision, rtol=1e-8, atol=1e-10)


# --------------------------------------------------------------------------- predictions
def test_nn_predictive_of_sequence_logits_has_their_shape(threshold):
    case = CASES["tokens"]()
    ours = fit(case, threshold, 2, "mc")
    probs = ours(case.X[:3], pred_type="nn", link_approx="mc", n_samples=4)
    assert probs.shape == (3, 5, 4)
    assert_close(probs.sum(-1), torch.ones(3, 5, dtype=torch.float64))
    thetas = ours.sample(4, generator=torch.Generator().manual_seed(4))
    sampled = copy.deepcopy(case.model)
    expected = []
    for theta in thetas:  # one forward pass per weight sample
        nn.utils.vector_to_parameters(theta, sampled.parameters())
        with torch.no_grad():
            expected.append(torch.softmax(sampled(case.X[:3]), -1))
    generator = torch.Generator().manual_seed(4)
    probs = ours(case.X[:3], pred_type="nn", link_approx="mc", n_samples=4, generator=generator)
    assert_close(probs, torch.stack(expected).mean(0))


def test_glm_predictive_over_a_vocabulary_is_refused(threshold):
    case = CASES["tokens"]()
    ours = fit(case, threshold, 2, "ef")
    refusal = r"C=4 outputs.*LARGE_OUTPUT_THRESHOLD=2.*pred_type='nn'.*last_layer"
    for call in (
        lambda: ours(case.X[:2]),
        lambda: ours(case.X[:2], link_approx="mc"),
        lambda: ours.functional_samples(case.X[:2], diagonal_output=True),
    ):
        with pytest.raises(ValueError, match=refusal):
            call()


@pytest.mark.parametrize(("subset", "structure"), [("all", "diag"), ("subnetwork", "full")])
def test_glm_predictive_of_other_structures_over_a_vocabulary_is_refused(
    threshold, subset, structure
):
    case = CASES["mlp"]()
    threshold(2)
    extra = {"subnetwork_indices": torch.arange(5)} if subset == "subnetwork" else {}
    la = Laplace(case.model, "classification", subset, structure, backend=CurvlinopsEF, **extra)
    la.fit(case.loader())
    with pytest.raises(ValueError, match=r"LARGE_OUTPUT_THRESHOLD=2.*pred_type='nn'"):
        la(case.X[:2])
    assert la(case.X[:2], pred_type="nn", link_approx="mc", n_samples=3).shape[0] == 2


# ------------------------------------------------------------------------------- refusals
def test_exact_ggn_over_a_vocabulary_is_refused_before_its_columns(threshold, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a dense output Hessian was built")

    monkeypatch.setattr(Categorical, "output_hessian_sqrt", refuse)
    case = CASES["tokens"]()
    la = KronLaplace(case.model, "classification")
    message = (
        r"C=4 outputs per position.*LARGE_OUTPUT_THRESHOLD=2 \(layer 'head', Linear.*"
        r"stochastic.*CurvlinopsEF.*subset_of_weights='last_layer'"
    )
    with pytest.raises(ValueError, match=message):
        la.fit(case.loader())
    assert not la._fitted


def test_third_party_kfac_and_conv1d_are_refused_by_name(threshold):
    case = CASES["mlp"]()
    backpack = pytest.importorskip("laplace.curvature.backpack")
    la = KronLaplace(case.model, "classification", backend=backpack.BackPackEF)
    with pytest.raises(ValueError, match=r"BackPackEF would build the dense output factor"):
        la.fit(case.loader())
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    model = nn.Sequential(nn.Linear(3, 2), pytorch_utils.Conv1D(5, 2)).double()
    with pytest.raises(ValueError, match=r"module '1' \(Conv1D\) has 5 outputs.*last_layer"):
        KronLaplace(model, "classification", backend=CurvlinopsEF)


def test_exact_ggn_columns_larger_than_memory_are_refused_before_they_are_formed():
    model = nn.Sequential(nn.Linear(3, 200_000))
    loader = DataLoader(TensorDataset(torch.randn(4, 3), torch.zeros(4, dtype=torch.long)))
    la = Laplace(model, "classification", "all", "diag")
    with pytest.raises(TooLargeError, match=r"C=200,000 outputs.*GiB.*stochastic.*CurvlinopsEF"):
        la.fit(loader)
    la = Laplace(model, "classification", "all", "diag", backend=CurvlinopsEF)
    la.fit(loader)  # one gradient column per point
    assert la.H.shape == (800_000,)


def test_nn_predictive_holds_a_bounded_group_of_samples_at_a_time(monkeypatch):
    case = CASES["tokens"]()
    la = KronLaplace(case.model, "classification", backend=CurvlinopsEF)
    la.fit(case.loader())
    per_sample = (la.n_params + case.X[:3].shape[0] * 5 * 4) * 8  # weights + (3, T=5, C=4) logits
    monkeypatch.setattr(nn_predictive_module, "NN_SAMPLE_BYTES", 3 * per_sample)
    groups = []
    draw = la._nn_functional_samples

    def recorded(*args, **kwargs):
        groups.append(draw(*args, **kwargs))
        return groups[-1]

    monkeypatch.setattr(la, "_nn_functional_samples", recorded)
    probs = la(case.X[:3], pred_type="nn", link_approx="mc", n_samples=10)
    assert [len(f) for f in groups] == [1, 3, 3, 3]
    assert_close(probs, torch.cat(groups).softmax(-1).mean(0))
    assert probs.shape == (3, 5, 4)


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


def test_glm_variance_of_convolutions_at_few_and_many_positions_matches_the_dense_reference(
    monkeypatch,
):
    """A convolution at T = 16 positions goes through its products ``Mc``, one at T = 4
    (T² ≤ C (T + C), C = 4 outputs) through its positions' Grams: both equal J P⁻¹ Jᵀ."""
    from laplace.structures import kron_glm

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.Tanh(),
        nn.Conv2d(4, 5, 2, stride=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(20, 4),
    ).double()
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(12, 3, 6, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (12,), generator=gen)
    la = KronLaplace(model, "classification", prior_precision=torch.linspace(0.5, 2, 6).double())
    la.fit(DataLoader(TensorDataset(X, y), batch_size=4))
    paths = []
    for name in ("_position_block", "_product_block"):
        original = getattr(kron_glm._Slot, name)

        def recorded(self, *args, _original=original, _name=name):
            paths.append((_name, args[-1].shape[1]))
            return _original(self, *args)

        monkeypatch.setattr(kron_glm._Slot, name, recorded)
    J = Oracle(model, "classification").jacobian(X)
    expected = J @ torch.linalg.inv(dense_precision(la)) @ J.transpose(1, 2)
    f_var = kron_functional_variance(la.backend.trace(X), la.posterior_precision)
    assert_close(f_var, expected, rtol=1e-8, atol=1e-12)
    assert set(paths) == {("_product_block", 16), ("_position_block", 4)}
