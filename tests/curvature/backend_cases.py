"""The backend-contract case table: which backend family computes which quantity on which model.

Each :class:`Backend` row names a backend class, the curvature it computes (``"ggn"``, ``"ef"``
or ``"hessian"``), the structures it supports, and whether it takes dict inputs and
non-sequential models. Tests parametrise over these rows instead of branching on class names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from conftest import Oracle
from laplace.curvature import (
    AsdlEF,
    AsdlGGN,
    AsdlHessian,
    BackPackEF,
    BackPackGGN,
    CurvatureInterface,
    CurvlinopsEF,
    CurvlinopsGGN,
    CurvlinopsHessian,
)


@dataclass(frozen=True)
class Backend:
    """One backend class and what it supports."""

    cls: type[CurvatureInterface]
    kind: str  # "ggn", "ef" or "hessian"
    structures: tuple[str, ...] = ("full", "diag")
    dict_inputs: bool = True
    any_model: bool = True

    @property
    def id(self) -> str:
        return self.cls.__name__

    def reference(self, oracle: Oracle, X, y) -> torch.Tensor:
        """The dense oracle curvature of this backend's kind."""
        if self.kind == "ggn":
            return oracle.ggn(X)
        if self.kind == "ef":
            return oracle.ef(X, y)
        return oracle.hessian(X, y)


KRON = ("full", "diag", "kron")
BACKENDS = [
    Backend(CurvlinopsGGN, "ggn", KRON),
    Backend(CurvlinopsEF, "ef", KRON),
    Backend(CurvlinopsHessian, "hessian"),
    Backend(AsdlGGN, "ggn", KRON),
    Backend(AsdlEF, "ef", KRON),
    Backend(AsdlHessian, "hessian"),
    Backend(BackPackGGN, "ggn", KRON, dict_inputs=False, any_model=False),
    Backend(BackPackEF, "ef", dict_inputs=False),
]
GGN_BACKENDS = [b for b in BACKENDS if b.kind == "ggn"]
THIRD_PARTY = [b for b in BACKENDS if not b.id.startswith("Curvlinops")]


def ids(rows: list[Backend]) -> list[str]:
    return [row.id for row in rows]


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``B A`` (LoRA)."""

    def __init__(self, n_in: int, n_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(n_in, n_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(n_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, n_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoRAModel(nn.Module):
    """A two-layer network whose layers are LoRA-adapted; only the adapters train."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = LoRALinear(3, 6)
        self.layer2 = LoRALinear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.tanh(self.layer1(x)))


def lora_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A LoRA model (float64) with classification data."""
    torch.manual_seed(5)
    model = LoRAModel().double()
    X = torch.randn(14, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (14,))
    return model, X, y


def dict_per_sample_gradients(model: nn.Module, X: dict, y: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy gradients of a dict-input model, one backward each, (B, P)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for n in range(len(y)):
        f = model({"input_ids": X["input_ids"][n : n + 1]})
        loss = nn.functional.cross_entropy(f, y[n : n + 1], reduction="sum")
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)
