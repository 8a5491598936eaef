"""``marglik_training``: joint MAP and marginal-likelihood hyperparameter training."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace import FullLaplace, marglik_training
from laplace.curvature import CurvlinopsGGN
from laplace.marglik_training import default_backend
from laplace.utils.enums import PriorStructure

SIGMA = 0.3


def sinusoid(n: int = 150, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 1, generator=g) * 8
    y = torch.sin(X) + SIGMA * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(X, y), batch_size=50, shuffle=True, generator=g)


def mlp(n_out: int = 1, seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, n_out))


def test_recovers_the_noise_of_a_sinusoid_and_increases_the_marglik():
    la, model, margliks, losses = marglik_training(
        mlp(),
        sinusoid(),
        "regression",
        "full",
        backend=CurvlinopsGGN,
        n_epochs=100,
        marglik_frequency=10,
        optimizer_kwargs={"lr": 3e-2},
        prior_structure="scalar",
    )
    assert isinstance(la, FullLaplace)
    assert abs(la.sigma_noise.item() - SIGMA) < 0.2 * SIGMA
    # margliks are negative log marginal likelihoods (as in laplace-torch): they decrease.
    assert len(margliks) == 10 * 10 and len(losses) == 100
    log_margliks = -torch.tensor(margliks)
    assert log_margliks[-10:].mean() > log_margliks[:10].mean()
    assert losses[-1] < losses[0]
    # The returned Laplace sits at the returned model's weights.
    theta = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(la.mean, theta)


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
@pytest.mark.parametrize("prior_structure", list(PriorStructure))
def test_every_prior_structure(structure, prior_structure):
    model = mlp()
    n_layers = len(list(model.parameters()))
    n_params = sum(p.numel() for p in model.parameters())

    def train():
        return marglik_training(
            model,
            sinusoid(60),
            "regression",
            structure,
            backend=CurvlinopsGGN,
            n_epochs=3,
            n_hypersteps=2,
            prior_structure=prior_structure,
        )

    if structure == "kron" and prior_structure == "diag":  # as laplace-torch: no eigenbasis
        with pytest.raises(ValueError, match="diagonal prior"):
            train()
        return
    la, _, margliks, losses = train()
    expected = {"scalar": 1, "layerwise": n_layers, "diag": n_params}[prior_structure.value]
    assert la.prior_precision.shape == (expected,)
    assert len(margliks) == 6 and len(losses) == 3
    assert all(torch.isfinite(torch.tensor(margliks)))


def test_classification_keeps_sigma_one_and_burnin_frequency_are_respected():
    torch.manual_seed(0)
    X = torch.randn(40, 2)
    y = (X[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
    loader = DataLoader(TensorDataset(X, y), batch_size=20)
    la, _, margliks, losses = marglik_training(
        model,
        loader,
        backend=CurvlinopsGGN,
        n_epochs=6,
        n_epochs_burnin=2,
        marglik_frequency=2,
        n_hypersteps=1,
        enable_backprop=True,
    )
    assert la.sigma_noise.item() == 1.0 and la.enable_backprop
    assert len(margliks) == 3 and len(losses) == 6  # epochs 2, 4, 6


def test_fixed_sigma_and_weight_decay_warning():
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    with pytest.warns(UserWarning, match="Weight decay is handled and optimized"):
        la, *_ = marglik_training(
            mlp(),
            sinusoid(30),
            "regression",
            "diag",
            backend=CurvlinopsGGN,
            optimizer_kwargs=kwargs,
            n_epochs=2,
            sigma_noise_init=0.5,
            fix_sigma_noise=True,
        )
    assert la.sigma_noise.item() == 0.5
    assert kwargs["weight_decay"] == 0.1  # the caller's dict is not modified


def test_default_backend_is_asdl_when_installed():
    pytest.importorskip("asdl")
    assert default_backend().__name__ == "AsdlGGN"


def test_bad_options():
    with pytest.raises(ValueError, match="prior_structure"):
        marglik_training(mlp(), sinusoid(10), "regression", prior_structure="blocks")
    with pytest.raises(ValueError, match="marglik_frequency"):
        marglik_training(mlp(), sinusoid(10), "regression", marglik_frequency=0)


def test_a_diverging_training_loss_is_refused_naming_the_training():
    class Exploding(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(1, 1)

        def forward(self, x):
            return self.linear(x) * float("inf")

    with pytest.raises(RuntimeError, match="marglik training contains NaN or inf"):
        marglik_training(Exploding(), sinusoid(20), "regression", "diag", n_epochs=1)
