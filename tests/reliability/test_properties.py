"""Property-based tests: random tiny models × structure × subset × likelihood × backend.

Hypothesis draws a network (depth, widths, activation, bias), a likelihood, data, a prior, σ and
a curvature backend; every approximation must then agree with the dense float64 oracles of
``conftest`` (exact GGN = Jᵀ Λ J, exact Jacobians): posterior precision, log marginal likelihood
and GLM predictive. Online fits must equal one fit on all the data, and ``state_dict`` must
round-trip bit for bit through ``torch.load(weights_only=True)``.

Profiles (``LAPLACE_HYPOTHESIS_PROFILE``): ``ci`` (default, few examples, used by ``make test``)
and ``thorough`` (many more, used by ``make test-all``). Both are derandomised and keep no
example database, so every run tries the same examples.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import warnings
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import Oracle, assert_close, freeze_all_but
from laplace import Laplace
from laplace.curvature import AsdlGGN, BackPackGGN, CurvlinopsGGN

_COMMON = {
    "derandomize": True,
    "database": None,
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile("ci", max_examples=50, **_COMMON)
settings.register_profile("thorough", max_examples=500, **_COMMON)
settings.load_profile(os.environ.get("LAPLACE_HYPOTHESIS_PROFILE", "ci"))

#: Tolerances against the float64 oracles (Kronecker posteriors go through eigenbases).
RTOL, ATOL = 1e-7, 1e-9
RTOL_EIGEN, ATOL_EIGEN = 1e-6, 1e-8

BACKENDS = [CurvlinopsGGN, AsdlGGN, BackPackGGN]


@dataclass
class Problem:
    """A tiny float64 network with its data and hyperparameters."""

    model: nn.Sequential
    likelihood: str
    X: torch.Tensor
    y: torch.Tensor
    batch_size: int
    prior: float
    sigma: float

    def loader(self, rows: slice = slice(None)) -> DataLoader:
        return DataLoader(TensorDataset(self.X[rows], self.y[rows]), batch_size=self.batch_size)


@st.composite
def problems(draw, max_points: int = 9) -> Problem:
    likelihood = draw(st.sampled_from(["regression", "classification"]))
    n_in = draw(st.integers(1, 3))
    n_out = draw(st.integers(2 if likelihood == "classification" else 1, 3))
    hidden = draw(st.lists(st.integers(1, 4), max_size=2))
    activation = draw(st.sampled_from([nn.Tanh, nn.Sigmoid]))
    bias = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    n = draw(st.integers(1, max_points))
    torch.manual_seed(seed)
    widths = [n_in, *hidden, n_out]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers += [nn.Linear(a, b, bias=bias or i == len(widths) - 2)]
        if i < len(widths) - 2:
            layers.append(activation())
    X = torch.randn(n, n_in, dtype=torch.float64)
    if likelihood == "regression":
        y = torch.randn(n, n_out, dtype=torch.float64)
    else:
        y = torch.randint(0, n_out, (n,))
    return Problem(
        nn.Sequential(*layers).double(),
        likelihood,
        X,
        y,
        batch_size=draw(st.integers(1, n)),
        prior=draw(st.floats(0.1, 10.0)),
        sigma=draw(st.floats(0.3, 3.0)) if likelihood == "regression" else 1.0,
    )


@dataclass
class Drawn:
    """An unfitted approximation of a problem and the oracle over its parameters."""

    problem: Problem
    la: object
    oracle: Oracle
    structure: str
    indices: torch.Tensor | None  # subnetwork entries, None for all weights or the last layer


@st.composite
def approximations(draw, structures=("full", "diag", "kron"), exact_kron: bool = False):
    """An approximation over random subset × structure × backend of a random problem.

    With ``exact_kron``, Kronecker problems have one data point (where KFAC is exact).
    """
    structure = draw(st.sampled_from(structures))
    problem = draw(problems(max_points=1 if exact_kron and structure == "kron" else 9))
    subsets = {"full": 3, "diag": 3, "kron": 2, "lowrank": 1, "gp": 2}[structure]
    subset = draw(st.sampled_from(["all", "last_layer", "subnetwork"][:subsets]))
    kwargs = {
        "sigma_noise": problem.sigma,
        "prior_precision": problem.prior,
        "backend": draw(st.sampled_from(BACKENDS)),
    }
    model, indices = problem.model, None
    n_params = sum(p.numel() for p in model.parameters())
    if subset == "subnetwork":
        chosen = draw(st.lists(st.integers(0, n_params - 1), min_size=1, max_size=6, unique=True))
        indices = kwargs["subnetwork_indices"] = torch.tensor(chosen)
    if subset == "last_layer":
        model = freeze_all_but(model, str(len(model) - 1))
    if structure == "lowrank":
        kwargs["backend_kwargs"] = {"n_eigenvalues": draw(st.integers(1, n_params - 1))}
    if structure == "gp":
        kwargs["n_subset"] = draw(st.integers(1, len(problem.X)))
    la = Laplace(problem.model, problem.likelihood, subset, structure, **kwargs)
    return Drawn(problem, la, Oracle(model, problem.likelihood), structure, indices)


def _oracle_ggn(problem: Problem, oracle: Oracle, indices, structure: str) -> torch.Tensor:
    """The curvature the structure represents exactly: the GGN, its diagonal or its blocks."""
    ggn = oracle.ggn(problem.X)
    if indices is not None:
        ggn = ggn[indices][:, indices]
    if structure == "diag":
        return torch.diag(ggn.diagonal())
    if structure == "kron":  # per parameter tensor; exact for one data point
        blocks = torch.block_diag(*[torch.ones(s.numel(), s.numel()) for s in oracle.shapes])
        return ggn * blocks.to(ggn)
    return ggn


def _oracle_precision(problem, oracle, indices, structure) -> torch.Tensor:
    ggn = _oracle_ggn(problem, oracle, indices, structure)
    return ggn / problem.sigma**2 + problem.prior * torch.eye(len(ggn), dtype=ggn.dtype)


def _dense(la) -> torch.Tensor:
    P = la.posterior_precision
    if hasattr(P, "to_matrix"):
        return P.to_matrix()
    return torch.diag(P) if P.dim() == 1 else P


def _tolerances(structure: str) -> dict[str, float]:
    return {"rtol": RTOL_EIGEN, "atol": ATOL_EIGEN} if structure == "kron" else {}


@given(approximations(exact_kron=True))
def test_posterior_precision_marglik_and_glm_predictive_match_the_oracle(drawn: Drawn):
    problem, la, oracle, indices, structure = (
        drawn.problem,
        drawn.la,
        drawn.oracle,
        drawn.indices,
        drawn.structure,
    )
    la.fit(problem.loader())
    P = _oracle_precision(problem, oracle, indices, structure)
    tol = _tolerances(structure)
    assert_close(_dense(la), P, **tol)

    # log p(D) ≈ log p(D | θ*) − ½ (log det P − log det P₀ + θ*ᵀ P₀ θ*)
    n, c = len(problem.X), la.n_outputs
    loss = oracle.loss(problem.X, problem.y)
    if problem.likelihood == "regression":
        s2 = problem.sigma**2
        log_lik = -loss / s2 - 0.5 * n * c * math.log(2 * math.pi * s2)
    else:
        log_lik = -loss
    theta = oracle.theta if indices is None else oracle.theta[indices]
    log_det_ratio = torch.logdet(P) - len(P) * math.log(problem.prior)  # float64, not float32
    expected = log_lik - 0.5 * (log_det_ratio + problem.prior * theta.square().sum())
    assert_close(la.log_marginal_likelihood(), expected, **tol)

    # GLM predictive: f_var = J P⁻¹ Jᵀ
    X_test = torch.randn(3, problem.X.shape[1], dtype=torch.float64)
    J = oracle.jacobian(X_test)
    J = J if indices is None else J[..., indices]
    _, f_var = la._glm_predictive_distribution(X_test)
    assert_close(f_var, J @ torch.linalg.solve(P, J.transpose(1, 2)), **tol)


@given(approximations(), st.data())
def test_online_fits_equal_one_fit_on_all_the_data(drawn: Drawn, data):
    problem, la = drawn.problem, drawn.la
    n = len(problem.X)
    if n < 2:  # two copies of the point
        problem.X, problem.y, n = torch.cat([problem.X] * 2), torch.cat([problem.y] * 2), 2
    split = data.draw(st.integers(1, n - 1))
    la.fit(problem.loader(slice(None, split)))
    la.fit(problem.loader(slice(split, None)), override=False)
    once = type(la)(**_constructor_arguments(la))
    once.fit(problem.loader())
    tol = _tolerances(drawn.structure)
    assert la.n_data == once.n_data == n
    assert_close(_dense(la), _dense(once), **tol)
    assert_close(la.log_marginal_likelihood(), once.log_marginal_likelihood(), **tol)


def _constructor_arguments(la) -> dict:
    """Rebuild an equivalent unfitted approximation (laplace-torch's attribute names)."""
    code = la.__init__.__code__
    names = code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]
    return {name: getattr(la, name) for name in names if hasattr(la, name)}


@given(approximations(structures=("full", "diag", "kron", "lowrank", "gp")))
def test_state_dict_round_trips_bit_exact(drawn: Drawn):
    problem, la = drawn.problem, drawn.la
    la.fit(problem.loader())
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    twin = type(la)(**_constructor_arguments(la))
    twin.load_state_dict(state)
    _assert_bitwise_equal(twin.state_dict(), la.state_dict())
    X_test = torch.randn(3, problem.X.shape[1], dtype=torch.float64)
    _assert_bitwise_equal(twin(X_test), la(X_test))


def _assert_bitwise_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_bitwise_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_bitwise_equal(x, y)
    else:
        assert a == b


LINK_APPROXIMATIONS = ["probit", "bridge", "bridge_norm", "mc"]


@st.composite
def relu_classifiers(draw):
    """A float32 or float64 ReLU classifier, its biases drawn so that some paths may be dead."""
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    n_in, n_out = draw(st.integers(1, 3)), draw(st.integers(2, 4))
    hidden = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    widths = [n_in, *hidden, n_out]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1]).to(dtype)
    shift = draw(st.floats(-2, 0.5))
    with torch.no_grad():
        for layer in model[:-1:2]:
            layer.bias.add_(shift)
    return model


@given(relu_classifiers(), st.data())
def test_every_predictive_is_a_distribution(model, data):
    """Random posteriors × structure × subset × link: rows in [0, 1] that sum to 1.

    Rank-deficient predictive covariances (a few subnetwork weights, dead ReLU paths) are where
    the Laplace bridge has no Dirichlet; it must fall back, never return such rows.
    """
    structure = data.draw(st.sampled_from(["full", "kron", "diag", "lowrank", "gp"]))
    subsets = {"full": 3, "diag": 3, "kron": 2, "lowrank": 1, "gp": 2}[structure]
    subset = data.draw(st.sampled_from(["all", "last_layer", "subnetwork"][:subsets]))
    dtype, n_params = model[0].weight.dtype, sum(p.numel() for p in model.parameters())
    kwargs = {"prior_precision": data.draw(st.floats(1e-4, 1e4))}
    if subset == "subnetwork":
        chosen = data.draw(st.lists(st.integers(0, n_params - 1), min_size=1, max_size=3))
        kwargs["subnetwork_indices"] = torch.tensor(sorted(set(chosen)))
    if structure == "lowrank":
        kwargs["backend_kwargs"] = {"n_eigenvalues": data.draw(st.integers(1, n_params - 1))}
    if structure == "gp":
        kwargs["n_subset"] = data.draw(st.integers(1, 8))
    n_out = model[-1].out_features
    X = 3 * torch.randn(8, model[0].in_features, dtype=dtype)
    y = torch.randint(0, n_out, (8,))
    la = Laplace(model, "classification", subset, structure, **kwargs)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=4))
    tolerance = 100 * torch.finfo(dtype).eps
    for link in LINK_APPROXIMATIONS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the bridge's fallback, counted
            probs = la(X, link_approx=link, generator=torch.Generator().manual_seed(0))
        assert probs.shape == (8, n_out), link
        assert bool(((probs >= 0) & (probs <= 1 + tolerance)).all()), (link, probs)
        assert_close(probs.sum(-1), torch.ones(8, dtype=probs.dtype), rtol=0, atol=tolerance)
