"""Shared tiny models, data loaders and dense float64 oracles built with ``torch.func``.

Every curvature, log-determinant and predictive of the library is checked against the dense
references defined here: exact Jacobians (``jacrev``), the exact GGN ``Σ Jᵀ Λ J``, the exact
Hessian of the summed loss, and the empirical Fisher ``Σ g gᵀ``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev, vmap
from torch.utils.data import DataLoader, Dataset, TensorDataset

# Named tolerances for float64 comparisons.
ATOL_F64 = 1e-9
RTOL_F64 = 1e-7


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol=RTOL_F64, atol=ATOL_F64):
    """Compare tensors and report the worst entry when they differ."""
    actual = torch.as_tensor(actual).detach()
    expected = torch.as_tensor(expected, dtype=actual.dtype).detach().to(actual.device)
    assert actual.shape == expected.shape, (
        f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    diff = (actual - expected).abs()
    bound = atol + rtol * expected.abs()
    if not bool((diff <= bound).all()):
        worst = int((diff - bound).flatten().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), actual.shape))
        raise AssertionError(
            f"tensors differ: worst entry {idx}: actual={actual[idx].item():.10g} "
            f"expected={expected[idx].item():.10g} |diff|={diff[idx].item():.3g} "
            f"(rtol={rtol}, atol={atol}); {int((diff > bound).sum())} entries out of tolerance"
        )


class DictDataset(Dataset):
    """Dataset of dict-like batches, as HuggingFace loaders emit."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, key_x="input_ids", key_y="labels"):
        self.x, self.y, self.key_x, self.key_y = x, y, key_x, key_y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {self.key_x: self.x[i], self.key_y: self.y[i]}


class DictInputModel(nn.Module):
    """A model whose forward takes a dict with the input under ``input_ids``."""

    def __init__(self, n_in=3, n_out=2):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_in, 4), nn.Tanh(), nn.Linear(4, n_out))

    def forward(self, data):
        return self.net(data["input_ids"])


@dataclass
class Case:
    """A tiny float64 model with its data and likelihood."""

    name: str
    likelihood: str
    model: nn.Module
    X: torch.Tensor
    y: torch.Tensor
    batch_size: int = 7

    @property
    def n_outputs(self) -> int:
        with torch.no_grad():
            return self.model(self.X[:1]).shape[-1]

    def loader(self, batch_size: int | None = None) -> DataLoader:
        return DataLoader(TensorDataset(self.X, self.y), batch_size=batch_size or self.batch_size)


def _regression_case(name: str, n_out: int, seed: int) -> Case:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, n_out)).double()
    X = torch.randn(20, 3, dtype=torch.float64)
    y = torch.randn(20, n_out, dtype=torch.float64)
    return Case(name, "regression", model, X, y)


def _classification_case(seed: int) -> Case:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4)).double()
    X = torch.randn(20, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (20,))
    return Case("mlp_classification", "classification", model, X, y)


def _cnn_case(seed: int) -> Case:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(12, 3),
    ).double()
    X = torch.randn(12, 1, 7, 7, dtype=torch.float64)
    y = torch.randint(0, 3, (12,))
    return Case("cnn_classification", "classification", model, X, y, batch_size=5)


CASE_BUILDERS: dict[str, Callable[[], Case]] = {
    "mlp_regression_1out": lambda: _regression_case("mlp_regression_1out", 1, 0),
    "mlp_regression_3out": lambda: _regression_case("mlp_regression_3out", 3, 1),
    "mlp_classification": lambda: _classification_case(2),
    "cnn_classification": lambda: _cnn_case(3),
}


@pytest.fixture(params=list(CASE_BUILDERS), ids=list(CASE_BUILDERS))
def case(request) -> Case:
    """Every tiny model × likelihood case."""
    return CASE_BUILDERS[request.param]()


@pytest.fixture
def regression_case() -> Case:
    return CASE_BUILDERS["mlp_regression_3out"]()


@pytest.fixture
def classification_case() -> Case:
    return CASE_BUILDERS["mlp_classification"]()


@pytest.fixture
def clf() -> Case:
    return CASE_BUILDERS["mlp_classification"]()


class PairScorer(nn.Module):
    """Single-output reward model: (B, 2, D) pairs → (B, 2) logits, (B, D) → (B, 1) rewards."""

    def __init__(self, n_in: int = 3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_in, 4), nn.Tanh(), nn.Linear(4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            return self.net(x.reshape(-1, x.shape[-1])).reshape(x.shape[0], 2)
        return self.net(x)


def dict_case(n: int = 16) -> tuple[nn.Module, DataLoader]:
    torch.manual_seed(4)
    model = DictInputModel().double()
    X = torch.randn(n, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (n,))
    return model, DataLoader(DictDataset(X, y), batch_size=5)


#: ``LAPLACE_TEST_DEVICE=cuda`` (``make test-gpu``): the ``device`` fixture gives that device only,
#: and tensors are created on it by default, so the oracle tests run there (float64 on CUDA).
TEST_DEVICE = os.environ.get("LAPLACE_TEST_DEVICE")


def pytest_configure(config):
    if TEST_DEVICE:
        if TEST_DEVICE.startswith("cuda") and not torch.cuda.is_available():
            raise pytest.UsageError(f"LAPLACE_TEST_DEVICE={TEST_DEVICE}: no CUDA device here")
        torch.set_default_device(TEST_DEVICE)


def pytest_collection_modifyitems(config, items):
    """Mark ``oracle`` the tests of modules that compare against the dense oracles."""
    for item in items:
        module = getattr(item, "module", None)
        oracles = hasattr(module, "Oracle") or hasattr(module, "PositionOracle")
        if oracles or "oracle_for" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.oracle)


def _devices() -> list[str]:
    if TEST_DEVICE:
        return [TEST_DEVICE]
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture(params=_devices())
def device(request) -> torch.device:
    return torch.device(request.param)


# --------------------------------------------------------------------------- oracles


class Oracle:
    """Dense float64 references for a model with trainable parameters ``θ``.

    The loss convention is the library's: ``½ Σ‖y − f‖²`` for regression and summed
    cross-entropy for classification; curvatures are σ-free.
    """

    def __init__(self, model: nn.Module, likelihood: str):
        self.model = model
        self.likelihood = likelihood
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shapes = [p.shape for n, p in model.named_parameters() if p.requires_grad]
        self.theta = torch.cat(
            [p.detach().flatten() for p in model.parameters() if p.requires_grad]
        )

    def unflatten(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        out, i = {}, 0
        for name, shape in zip(self.names, self.shapes):
            n = shape.numel()
            out[name] = theta[i : i + n].view(shape)
            i += n
        return out

    def f(self, theta: torch.Tensor, X) -> torch.Tensor:
        return functional_call(self.model, self.unflatten(theta), (X,))

    def jacobian(self, X) -> torch.Tensor:
        """Exact Jacobian, shape (B, C, P)."""
        return jacrev(lambda t: self.f(t, X))(self.theta)

    def output_hessian(self, f: torch.Tensor) -> torch.Tensor:
        """Hessian of the per-sample loss w.r.t. the outputs, shape (B, C, C)."""
        if self.likelihood == "regression":
            return torch.eye(f.shape[-1], dtype=f.dtype).expand(f.shape[0], -1, -1)
        p = torch.softmax(f, dim=-1)
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)

    def per_sample_loss(self, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.likelihood == "regression":
            return 0.5 * ((y - f) ** 2).sum(-1)
        return nn.functional.cross_entropy(f, y, reduction="none")

    def loss(self, X, y) -> torch.Tensor:
        return self.per_sample_loss(self.f(self.theta, X), y).sum()

    def ggn(self, X) -> torch.Tensor:
        J = self.jacobian(X)
        Lam = self.output_hessian(self.f(self.theta, X).detach())
        return torch.einsum("bcp,bcd,bdq->pq", J, Lam, J)

    def hessian(self, X, y) -> torch.Tensor:
        return hessian(lambda t: self.per_sample_loss(self.f(t, X), y).sum())(self.theta)

    def per_sample_gradients(self, X, y) -> torch.Tensor:
        def single(t, x, yy):
            return self.per_sample_loss(self.f(t, x.unsqueeze(0)), yy.unsqueeze(0)).sum()

        return vmap(jacrev(single), in_dims=(None, 0, 0))(self.theta, X, y)

    def ef(self, X, y) -> torch.Tensor:
        G = self.per_sample_gradients(X, y)
        return G.T @ G


def assert_marglik_matches(la, reference, likelihood: str, priors, rtol=1e-9, atol=1e-9):
    """The log marginal likelihood and its gradients (prior; σ for regression) of ``la`` equal
    ``reference``'s (a Laplace on the same dense precision) for every prior in ``priors``."""
    regression = likelihood == "regression"
    for prior0 in priors:
        results = []
        for approx in (la, reference):
            prior = torch.tensor(prior0, dtype=torch.float64, requires_grad=True)
            sigma = torch.tensor(0.8 if regression else 1.0, requires_grad=True)
            value = approx.log_marginal_likelihood(prior, sigma.double())
            inputs = (prior, sigma) if regression else (prior,)
            results.append((value, *torch.autograd.grad(value, inputs)))
        for ours, dense in zip(*results):
            assert_close(ours, dense, rtol=rtol, atol=atol)


def assert_marglik_gradient_matches_finite_differences(la, step: float = 1e-6):
    """Gradients of a regression Laplace's marglik in a layer-wise prior and σ = central
    differences of step ``step`` (relative 1e-6)."""
    prior = torch.linspace(0.5, 2.0, la.n_layers, dtype=torch.float64, requires_grad=True)
    sigma = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    grads = torch.autograd.grad(la.log_marginal_likelihood(prior, sigma), (prior, sigma))
    with torch.no_grad():
        for i in range(len(prior)):
            shift = torch.zeros_like(prior)
            shift[i] = step
            up = la.log_marginal_likelihood(prior + shift, sigma)
            down = la.log_marginal_likelihood(prior - shift, sigma)
            assert_close((up - down) / (2 * step), grads[0][i], rtol=1e-6, atol=1e-7)
        up = la.log_marginal_likelihood(prior, sigma + step)
        down = la.log_marginal_likelihood(prior, sigma - step)
        assert_close((up - down) / (2 * step), grads[1], rtol=1e-6, atol=1e-7)


def kron_dense_blocks(K) -> list[torch.Tensor]:
    """The dense blocks of a ``Kron``: ``F₀ ⊗ F₁`` or ``F``, a 1-D factor read as a diagonal."""

    def dense(F: torch.Tensor) -> torch.Tensor:
        return F if F.ndim == 2 else torch.diag(F)

    return [dense(F[0]) if len(F) == 1 else torch.kron(dense(F[0]), dense(F[1])) for F in K.kfacs]


@pytest.fixture
def oracle_for() -> Callable[[Case], Oracle]:
    return lambda case: Oracle(case.model, case.likelihood)


# ----------------------------------------------------------------------- last-layer helpers


def freeze_all_but(model: nn.Module, module_name: str) -> nn.Module:
    """A deep copy of ``model`` whose only trainable parameters are those of ``module_name``."""
    frozen = copy.deepcopy(model)
    prefix = f"{module_name}." if module_name else ""
    for name, p in frozen.named_parameters():
        p.requires_grad_(name.startswith(prefix))
    return frozen


class TinyTransformer(nn.Module):
    """HF-style classifier: dict inputs, (B, T, D) hidden states, a linear head on every token.

    The head's logits (B, T, C) are reduced over the sequence like ``reduction``
    (``"pick_first"``, ``"pick_last"`` or ``"average"``), as sequence-classification models do.
    """

    def __init__(self, reduction: str, vocab: int = 11, dim: int = 6, n_out: int = 3):
        super().__init__()
        self.reduction = reduction
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.score = nn.Linear(dim, n_out)

    def forward(self, batch):
        h = self.embed(batch["input_ids"])
        h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
        logits = self.score(h)
        if self.reduction == "pick_first":
            return logits[:, 0]
        if self.reduction == "pick_last":
            return logits[:, -1]
        return logits.mean(1)


def transformer_case(reduction: str, n: int = 14, seq: int = 5) -> tuple[nn.Module, DataLoader]:
    torch.manual_seed(5)
    model = TinyTransformer(reduction).double().eval()
    X = torch.randint(0, 11, (n, seq))
    y = torch.randint(0, 3, (n,))
    return model, DataLoader(DictDataset(X, y), batch_size=4)


# ------------------------------------------------------------ outputs with extra dimensions


class PixelClassifier(nn.Module):
    """Per-pixel outputs (B, C, H, W): a convolution (mixing neighbouring pixels), then a
    linear head on every pixel's features (B, H, W, D), moved to PyTorch's class dimension."""

    def __init__(self, n_out: int = 3, width: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(1, width, 3, padding=1)
        self.head = nn.Linear(width, n_out)

    def forward(self, x):
        h = torch.tanh(self.conv(x)).permute(0, 2, 3, 1)
        return self.head(h).permute(0, 3, 1, 2)


class TokenClassifier(nn.Module):
    """Token logits (B, T, C) as Hugging Face returns them: a position-wise layer, a mixing of
    the positions (every token sees the whole sequence), a linear head on every token."""

    def __init__(self, d_in: int = 3, width: int = 5, n_out: int = 4):
        super().__init__()
        self.embed = nn.Linear(d_in, width)
        self.head = nn.Linear(width, n_out)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        return self.head(h + h.mean(1, keepdim=True))


@dataclass
class PositionCase(Case):
    """A :class:`Case` with outputs (B, …) whose class dimension is ``class_dim``."""

    class_dim: int = 1


def _pixel_case(likelihood: str) -> PositionCase:
    torch.manual_seed(6)
    n_out = 3 if likelihood == "classification" else 2
    model = PixelClassifier(n_out).double()
    X = torch.randn(7, 1, 5, 4, dtype=torch.float64)
    if likelihood == "classification":
        y = torch.randint(0, n_out, (7, 5, 4))
        y[0, 1, :] = -100  # dropped positions: a row of pixels, a whole image
        y[3] = -100
    else:
        y = torch.randn(7, n_out, 5, 4, dtype=torch.float64)
    return PositionCase(f"pixel_{likelihood}", likelihood, model, X, y, 3, class_dim=1)


def _token_case() -> PositionCase:
    torch.manual_seed(7)
    model = TokenClassifier().double()
    X = torch.randn(8, 5, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (8, 5))
    y[:, -2:][torch.rand(8, 2) < 0.5] = -100  # padding at the end of some sequences
    return PositionCase("token_classification", "classification", model, X, y, 3, class_dim=2)


POSITION_CASES: dict[str, Callable[[], PositionCase]] = {
    "pixel_classification": lambda: _pixel_case("classification"),
    "token_classification": _token_case,
    "pixel_regression": lambda: _pixel_case("regression"),
}


class PositionOracle(Oracle):
    """Dense references for outputs (B, …) whose every position is an independent observation.

    The curvature is the GGN of the loss summed over positions, ``Σₙ Jₙᵀ diag(Λₙₜ) Jₙ``, with
    positions labelled ``ignore_index`` dropped from the loss and the curvature.
    """

    def __init__(self, model: nn.Module, likelihood: str, class_dim: int, ignore_index=-100):
        super().__init__(model, likelihood)
        self.class_dim, self.ignore_index = class_dim, ignore_index

    def rows(self, t: torch.Tensor, jacobian: bool = False) -> torch.Tensor:
        """Outputs (B, …) as rows (B·T, C); Jacobians (B, …, P) as rows (B·T, C, P)."""
        if jacobian:
            moved = t.movedim(self.class_dim, -2)
            return moved.reshape(-1, *moved.shape[-2:])
        moved = t.movedim(self.class_dim, -1)
        return moved.reshape(-1, moved.shape[-1])

    def kept(self, y: torch.Tensor, n_rows: int) -> torch.Tensor:
        if self.likelihood == "regression":
            return torch.ones(n_rows, dtype=torch.bool)
        return y.reshape(-1) != self.ignore_index

    def ggn(self, X, y) -> torch.Tensor:
        f = self.f(self.theta, X).detach()
        J, f_rows = self.rows(self.jacobian(X), jacobian=True), self.rows(f)
        Lam = super().output_hessian(f_rows) * self.kept(y, len(f_rows))[:, None, None]
        return torch.einsum("rcp,rcd,rdq->pq", J, Lam, J)

    def per_sample_loss(self, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.likelihood == "regression":
            return 0.5 * ((y - f) ** 2).flatten(1).sum(1)
        logits = f.movedim(self.class_dim, 1)
        losses = nn.functional.cross_entropy(
            logits, y, ignore_index=self.ignore_index, reduction="none"
        )
        return losses.flatten(1).sum(1)
