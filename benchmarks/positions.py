"""Benchmark cases of outputs with extra dimensions: a segmentation net and a sequence model.

Per-pixel logits (B, C, H, W) of a small convolutional segmentation net and token logits
(B, T, C) of a small sequence model (a position-wise layer, a causal mixing of positions, a
linear head). Fits are timed against the dense reference a user would write otherwise: the
``torch.func`` Jacobian of every output (``jacrev``) and ``Σ Jᵀ Λ J`` per batch (the exact GGN
of the summed per-position loss, what the full and diagonal structures compute); predictives
are the GLM probit on test batches.
"""

from __future__ import annotations

from functools import partial

import torch
from harness import PeakRSS, against_floor, timed
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader, TensorDataset

#: Segmentation: images, classes, side of an image.
SEG_TRAIN, SEG_CLASSES, SEG_SIDE = 64, 4, 8
#: Sequences: sequences, classes, tokens per sequence, features per token.
SEQ_TRAIN, SEQ_CLASSES, SEQ_TOKENS, SEQ_FEATURES = 128, 10, 16, 16
#: Test points of the predictive cases.
N_TEST = 64


def segmentation_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, SEG_CLASSES, 1),
    )


class SequenceNet(nn.Module):
    """Token logits (B, T, C): every token sees the mean of the tokens before it."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(SEQ_FEATURES, width)
        self.head = nn.Linear(width, SEQ_CLASSES)
        causal = torch.tril(torch.ones(SEQ_TOKENS, SEQ_TOKENS))
        self.register_buffer("mixing", causal / causal.sum(1, keepdim=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        return self.head(h + self.mixing @ h)


def _data(kind: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if kind == "seg":
        X = torch.randn(n, 1, SEG_SIDE, SEG_SIDE, generator=generator)
        y = torch.randint(0, SEG_CLASSES, (n, SEG_SIDE, SEG_SIDE), generator=generator)
        y[:, :, -1] = -100  # an unlabelled border
        return X, y
    X = torch.randn(n, SEQ_TOKENS, SEQ_FEATURES, generator=generator)
    y = torch.randint(0, SEQ_CLASSES, (n, SEQ_TOKENS), generator=generator)
    y[: n // 2, -4:] = -100  # padding
    return X, y


MODELS = {"seg": segmentation_net, "seq": SequenceNet}
CLASS_DIMS = {"seg": 1, "seq": 2}


def _loader(kind: str) -> DataLoader:
    X, y = _data(kind, SEG_TRAIN if kind == "seg" else SEQ_TRAIN, 0)
    return DataLoader(TensorDataset(X, y), batch_size=32)


def dense_ggn(model: nn.Module, loader: DataLoader, class_dim: int) -> torch.Tensor:
    """``Σ Jᵀ Λ J`` from ``torch.func`` Jacobians of every output, batch by batch."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    total = None
    for X, y in loader:
        jac = jacrev(lambda p, X=X: functional_call(model, p, (X,)), chunk_size=64)(params)
        J = torch.cat([j.flatten(y.dim() + 1) for j in jac.values()], -1)  # (*f.shape, P)
        f = functional_call(model, params, (X,)).detach().movedim(class_dim, -1)
        p = torch.softmax(f, -1).reshape(-1, f.shape[-1]) * (y.reshape(-1, 1) != -100)
        rows = J.movedim(class_dim, -2).reshape(-1, f.shape[-1], J.shape[-1])
        Lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
        ggn = torch.einsum("rcp,rcd,rdq->pq", rows, Lam, rows)
        total = ggn if total is None else total + ggn
    return total


def case_fit(
    kind: str, structure: str, repeats: int, subset: str = "all", sampled: bool = False
) -> dict:
    from laplace import Laplace

    torch.manual_seed(0)
    model, loader = MODELS[kind]().eval(), _loader(kind)
    options = {"stochastic": True} if sampled else {}
    la = Laplace(model, "classification", subset, structure, backend_kwargs=options)
    with PeakRSS() as mem:
        la.fit(loader)
    label = " (MC Fisher, 1 sample)" if sampled else ""
    row = {"case": f"fit {structure} {subset} {kind}{label}", "n_params": la.n_params}
    if subset == "all" and structure in ("full", "diag"):
        floor = partial(dense_ggn, model, loader, CLASS_DIMS[kind])
        row.update(against_floor(partial(la.fit, loader), floor, repeats))
        row["floor"] = "torch.func dense GGN"
    else:
        row["seconds"] = timed(partial(la.fit, loader), repeats)
    return {**row, "peak_extra_MB": mem.extra / 2**20}


def case_predict(kind: str, structure: str, repeats: int, subset: str = "all") -> dict:
    from laplace import Laplace

    torch.manual_seed(0)
    model = MODELS[kind]().eval()
    la = Laplace(model, "classification", subset, structure)
    la.fit(_loader(kind))
    X_test, _ = _data(kind, N_TEST, 1)
    la(X_test[:2])  # warm the posterior factorisation
    with PeakRSS() as mem:
        seconds = timed(lambda: la(X_test, link_approx="probit"), repeats)
    return {
        "case": f"glm probit {structure} {subset} {kind} ({N_TEST} points)",
        "n_params": la.n_params,
        "seconds": seconds,
        "peak_extra_MB": mem.extra / 2**20,
    }


POSITION_CASES = {
    "positions-fit-diag-seg": (case_fit, "seg", "diag"),
    "positions-fit-diag-mc-seg": (partial(case_fit, sampled=True), "seg", "diag"),
    "positions-fit-full-seg": (case_fit, "seg", "full"),
    "positions-fit-kron-seg": (case_fit, "seg", "kron"),
    "positions-predict-diag-seg": (case_predict, "seg", "diag"),
    "positions-fit-diag-seq": (case_fit, "seq", "diag"),
    "positions-fit-kron-seq": (case_fit, "seq", "kron"),
    "positions-fit-ll-full-seq": (partial(case_fit, subset="last_layer"), "seq", "full"),
    "positions-predict-kron-seq": (case_predict, "seq", "kron"),
    "positions-predict-ll-full-seq": (partial(case_predict, subset="last_layer"), "seq", "full"),
}
