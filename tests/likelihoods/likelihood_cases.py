"""Tiny float64 cases of the likelihoods laplace-torch lacks, with independent references.

Each case holds a model, data, the ``likelihood=`` argument and the per-point negative
log-likelihood written here from its definition (not with the library). The dense oracles
build from it, with ``torch.func``: the output curvature ``Λ`` (the Hessian of the NLL w.r.t.
the outputs, or its expectation over ``y`` for the Fisher of heteroscedastic regression), the
exact GGN ``Σ Jᵀ Λ J``, per-sample gradients and the empirical Fisher.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev, vmap
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

DOCS = Path(__file__).resolve().parents[2] / "docs" / "likelihoods.md"


def poisson_class() -> type:
    """The ``Poisson`` likelihood of the worked example in ``docs/likelihoods.md``, run as is."""
    text = DOCS.read_text()
    block = re.search(r"<!-- poisson-example.*?-->\s*```python\n(.*?)```", text, re.S)
    namespace: dict[str, Any] = {}
    exec(compile(block.group(1), str(DOCS), "exec"), namespace)
    return namespace["Poisson"]


def _binary_nll(f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    y = y.reshape(f.shape).to(f.dtype)
    return -(y * F.logsigmoid(f) + (1 - y) * F.logsigmoid(-f)).sum(-1)


def _heteroscedastic_nll(f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    mu, s = f.chunk(2, dim=-1)
    return 0.5 * ((y - mu).square() * torch.exp(-s) + s + math.log(2 * math.pi)).sum(-1)


def _heteroscedastic_fisher(f: torch.Tensor) -> torch.Tensor:
    """``E_y[∇²_f NLL]`` per point: the NLL Hessian is quadratic in ``y − μ``, so the two-point
    rule ``y = μ ± σ`` (which has the first three moments of ``N(μ, σ²)``) is exact."""
    mu, s = f.chunk(2, dim=-1)
    sigma = torch.exp(0.5 * s)
    return 0.5 * (
        _nll_hessians(_heteroscedastic_nll, f, mu + sigma)
        + _nll_hessians(_heteroscedastic_nll, f, mu - sigma)
    )


def _nll_hessians(nll, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Hessian of the NLL of each point w.r.t. its outputs, (B, C, C), one point at a time."""
    return torch.stack(
        [hessian(lambda ff, yy: nll(ff[None], yy[None]).sum())(f[i], y[i]) for i in range(len(f))]
    )


def _poisson_nll(f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (f.exp() - y * f + torch.lgamma(y + 1)).sum(-1)


@dataclass
class LikelihoodCase:
    """A model, its data and likelihood, and the reference NLL of one point."""

    name: str
    likelihood: Any
    model: nn.Module
    X: torch.Tensor
    y: torch.Tensor
    nll: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    fisher: Callable[[torch.Tensor], torch.Tensor] | None = None
    batch_size: int = 7
    extra: dict[str, Any] = field(default_factory=dict)

    def loader(self, batch_size: int | None = None) -> DataLoader:
        return DataLoader(TensorDataset(self.X, self.y), batch_size=batch_size or self.batch_size)


def _mlp(n_out: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, n_out)).double()


def binary_case(n_labels: int = 1, seed: int = 0) -> LikelihoodCase:
    model = _mlp(n_labels, seed)
    X = torch.randn(20, 3, dtype=torch.float64)
    y = (torch.rand(20, n_labels) < 0.5).long()
    y = y[:, 0] if n_labels == 1 else y.double()
    name = "binary" if n_labels == 1 else f"multilabel_{n_labels}"
    return LikelihoodCase(name, "binary_classification", model, X, y, _binary_nll)


def heteroscedastic_case(n_outputs: int = 2, seed: int = 1) -> LikelihoodCase:
    model = _mlp(2 * n_outputs, seed)
    with torch.no_grad():  # log-variances around 0, means of the data's scale
        model[2].weight.mul_(0.5)
    X = torch.randn(20, 3, dtype=torch.float64)
    y = torch.randn(20, n_outputs, dtype=torch.float64)
    return LikelihoodCase(
        f"heteroscedastic_{n_outputs}",
        "heteroscedastic_regression",
        model,
        X,
        y,
        _heteroscedastic_nll,
        fisher=_heteroscedastic_fisher,
    )


def poisson_case(n_outputs: int = 2, seed: int = 2) -> LikelihoodCase:
    model = _mlp(n_outputs, seed)
    X = torch.randn(20, 3, dtype=torch.float64)
    y = torch.poisson(torch.full((20, n_outputs), 2.0, dtype=torch.float64))
    return LikelihoodCase(f"poisson_{n_outputs}", poisson_class()(), model, X, y, _poisson_nll)


CASES: dict[str, Callable[[], LikelihoodCase]] = {
    "binary": binary_case,
    "multilabel_3": lambda: binary_case(3, seed=3),
    "heteroscedastic_2": heteroscedastic_case,
    "poisson_2": poisson_case,
}


class LikelihoodOracle:
    """Dense float64 references of a case's trainable parameters ``θ`` (in model order)."""

    def __init__(self, case: LikelihoodCase) -> None:
        self.case = case
        named = [(n, p) for n, p in case.model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.theta = torch.cat([p.detach().flatten() for _, p in named])

    def f(self, theta: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        params, i = {}, 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            params[name] = theta[i : i + shape.numel()].view(shape)
            i += shape.numel()
        return functional_call(self.case.model, params, (X,))

    def jacobian(self, X: torch.Tensor) -> torch.Tensor:
        """(B, C, P)."""
        return jacrev(lambda t: self.f(t, X))(self.theta)

    def output_curvature(self, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``Λ`` (B, C, C): the Fisher where the case defines one, else the NLL's Hessian."""
        if self.case.fisher is not None:
            return self.case.fisher(f)
        return _nll_hessians(self.case.nll, f, y)

    def ggn(self, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        J = self.jacobian(X)
        Lam = self.output_curvature(self.f(self.theta, X).detach(), y)
        return torch.einsum("bcp,bcd,bdq->pq", J, Lam, J)

    def nll(self, X: torch.Tensor, y: torch.Tensor, theta: torch.Tensor | None = None):
        theta = self.theta if theta is None else theta
        return self.case.nll(self.f(theta, X), y).sum()

    def ef(self, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        def single(t, x, yy):
            return self.case.nll(self.f(t, x[None]), yy[None]).sum()

        G = vmap(jacrev(single), in_dims=(None, 0, 0))(self.theta, X, y)
        return G.T @ G

    def glm_moments(self, X: torch.Tensor, precision: torch.Tensor):
        """``(f_mu (B, C), J P⁻¹ Jᵀ (B, C, C))`` of the linearised network."""
        J = self.jacobian(X)
        covariance = torch.linalg.inv(precision)
        return self.f(self.theta, X).detach(), J @ covariance @ J.transpose(1, 2)

    def log_marglik(self, X, y, prior_precision: float, ggn: torch.Tensor) -> torch.Tensor:
        """Laplace evidence with a zero prior mean and an isotropic prior ``δ``."""
        n_params = len(self.theta)
        precision = ggn + prior_precision * torch.eye(n_params, dtype=ggn.dtype)
        log_det_ratio = torch.logdet(precision) - n_params * math.log(prior_precision)
        scatter = prior_precision * self.theta.square().sum()
        return -self.nll(X, y) - 0.5 * (log_det_ratio + scatter)
