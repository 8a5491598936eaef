"""Real sizes (``run.py --large``): a ResNet-50-size CNN, fits against their floor and memory.

The network is ResNet-50's architecture written from modules (torchvision's layout: a 7×7 stem,
bottleneck stages of 3, 4, 6 and 3 blocks, 23.5M weights with a 10-class head; torchvision is
not a dependency), in eval mode (batch norm with its running statistics), on 64 × 64 synthetic
images. Each case reports the fit's time against the floor measured in the same process
(``1 fwd + 10 bwd``, the GGN's passes for 10 classes; ``1 fwd`` for the last layer), the peak
extra memory of the first fit, the peak until the fitted posterior's first use (its
factorisation: Kron's eigendecomposition, which the fit leaves to it) and the library's own
estimate of that fitted state (``fit_bytes`` of the posterior structure, from shapes alone).
"""

from __future__ import annotations

from functools import partial

import torch
from harness import (
    PeakRSS,
    against_floor,
    forward_pass,
    forward_plus_10_backward,
    recheck,
    timed,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: Images of the ResNet cases: batches × batch size, side, classes.
RESNET_BATCHES, RESNET_BATCH, RESNET_SIDE, RESNET_CLASSES = 2, 16, 64, 10


class Bottleneck(nn.Module):
    """ResNet's bottleneck block: 1×1, 3×3 (strided), 1×1 convolutions, 4× expansion."""

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet50(n_classes: int = RESNET_CLASSES) -> nn.Sequential:
    """ResNet-50 (torchvision's layout), random weights, in eval mode."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    in_channels = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for block in range(blocks):
            layers.append(Bottleneck(in_channels, width, stride if block == 0 else 1))
            in_channels = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, n_classes)]
    return nn.Sequential(*layers).eval()


def resnet_loader() -> DataLoader:
    """Synthetic 64 × 64 images and labels, ``RESNET_BATCHES`` batches."""
    generator = torch.Generator().manual_seed(0)
    n = RESNET_BATCHES * RESNET_BATCH
    X = torch.randn(n, 3, RESNET_SIDE, RESNET_SIDE, generator=generator)
    y = torch.randint(0, RESNET_CLASSES, (n,), generator=generator)
    return DataLoader(TensorDataset(X, y), batch_size=RESNET_BATCH)


def case_fit_resnet(structure: str, subset: str, repeats: int) -> dict:
    """A fit of ResNet-50 against its floor, peak memory beside the library's estimate."""
    from laplace import Laplace

    model, loader = resnet50(), resnet_loader()
    la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure)
    with PeakRSS() as first_use:
        with PeakRSS() as mem:
            la.fit(loader)
        la.log_marginal_likelihood()  # the first use: the factorisation the estimate counts
    estimate = la._fit_bytes()
    last_layer = subset == "last_layer"
    floor = partial(forward_pass if last_layer else forward_plus_10_backward, model, loader)
    times = against_floor(partial(la.fit, loader), floor, repeats)
    recheck(la, loader)
    return {
        "case": f"fit {'last-layer ' if last_layer else ''}{structure} resnet50 "
        f"{RESNET_BATCHES}x{RESNET_BATCH} images {RESNET_SIDE}px",
        "n_params": la.n_params,
        **times,
        "floor": "1 fwd" if last_layer else "1 fwd + 10 bwd",
        "peak_extra_MB": mem.extra / 2**20,
        "first_use_peak_extra_MB": first_use.extra / 2**20,
        "estimate_MB": estimate / 2**20,
    }


def case_predict_resnet(structure: str, subset: str, repeats: int, n_test: int = 100) -> dict:
    """GLM probit predictive of ``n_test`` images with the ``structure`` over ``subset``."""
    from laplace import Laplace

    model = resnet50()
    la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure)
    la.fit(resnet_loader())
    generator = torch.Generator().manual_seed(1)
    X_test = torch.randn(n_test, 3, RESNET_SIDE, RESNET_SIDE, generator=generator)
    la(X_test[:2], link_approx="probit")  # warm the posterior factorisation
    with PeakRSS() as mem:
        seconds = timed(lambda: la(X_test, pred_type="glm", link_approx="probit"), repeats)
    return {
        "case": f"glm probit {structure} resnet50 ({n_test} images)",
        "n_params": la.n_params,
        "seconds": seconds,
        "peak_extra_MB": mem.extra / 2**20,
    }


#: ``run.py --large`` cases: name → (function, structure, subset), as ``run.CASES``.
LARGE_CASES = {
    "large-fit-kron-resnet50": (case_fit_resnet, "kron", "all"),
    "large-fit-diag-resnet50": (case_fit_resnet, "diag", "all"),
    "large-fit-ll-kron-resnet50": (case_fit_resnet, "kron", "last_layer"),
    "large-predict-kron-resnet50": (case_predict_resnet, "kron", "all"),
}
