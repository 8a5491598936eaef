"""The path of a fit and of a GLM prediction through the package: the modules they enter.

Traces every call into ``laplace.*`` (``sys.setprofile``) while a small MLP classifier is fitted
on one batch and predicted on eight points, for each posterior structure over all weights and
a last-layer Kron, and prints the modules entered in order and the number of calls. A reviewer's
measure of how far a reader follows the code for one operation (``python benchmarks/paths.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace import Laplace

CASES = [("all", "kron"), ("all", "diag"), ("all", "full"), ("last_layer", "kron")]


def modules_entered(operation: Callable[[], object]) -> tuple[list[str], int]:
    """The ``laplace`` modules ``operation`` calls into, in order of first entry, and the calls."""
    modules: list[str] = []
    calls = 0

    def profile(frame, event, arg) -> None:
        nonlocal calls
        name = frame.f_globals.get("__name__", "")
        if event == "call" and name.startswith("laplace"):
            calls += 1
            if name not in modules:
                modules.append(name)

    sys.setprofile(profile)
    try:
        operation()
    finally:
        sys.setprofile(None)
    return modules, calls


def main() -> None:
    torch.manual_seed(0)
    X, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    loader = DataLoader(TensorDataset(X, y), batch_size=64)
    for subset, structure in CASES:
        la = Laplace(model, "classification", subset, structure)
        for what, operation in (("fit", partial(la.fit, loader)), ("glm", partial(la, X[:8]))):
            modules, calls = modules_entered(operation)
            names = " ".join(m.removeprefix("laplace.") for m in modules)
            print(f"{what} {subset} {structure}: {len(modules)} modules, {calls} calls: {names}")


if __name__ == "__main__":
    main()
