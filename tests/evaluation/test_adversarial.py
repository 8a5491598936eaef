"""Inputs that move: adversarial attacks (FGSM, PGD) and the ε sweep."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS
from laplace import Laplace
from laplace.evaluation import SWEEP_METRICS, adversarial_sweep, evaluate, fgsm, pgd

# ----------------------------------------------------------------------------------- attacks
#: Accuracy the MAP network reaches on the clean separable task.
CLEAN_ACCURACY = 0.95


#: Entries may sit at the edge of the ε-ball up to float64 rounding of ``X + (X_adv − X)``.
ATOL_BALL = 1e-12


def _separable_task(seed: int = 0, n: int = 120) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Two Gaussian blobs at x₁ = ±2 (std 0.5) and an MLP trained on them, float64."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    X = 0.5 * torch.randn(n, 2, generator=gen, dtype=torch.float64)
    X[:, 0] += 4 * y - 2
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2)).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(100):
        optimizer.zero_grad()
        F.cross_entropy(model(X), y).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, X, y


@pytest.fixture(scope="module")
def separable():
    return _separable_task()


def _summed_loss(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return F.cross_entropy(model(X), y, reduction="sum").item()


@pytest.mark.parametrize("clamp", [None, (-1.0, 1.0)], ids=["free", "clamped"])
def test_fgsm_is_the_clamped_signed_gradient_step(clamp):
    case = CASE_BUILDERS["mlp_classification"]()
    model, X, y = case.model, case.X, case.y
    epsilon = 0.3
    gradient = torch.func.grad(lambda x: F.cross_entropy(model(x), y, reduction="sum"))(X)
    expected = X + epsilon * gradient.sign()
    if clamp is not None:
        expected = expected.clamp(*clamp)
        assert bool(((expected == -1) | (expected == 1)).any())  # the clamp is active
    adversarial = fgsm(model, X, y, epsilon, clamp=clamp)
    assert torch.equal(adversarial, expected)
    assert (adversarial - X).abs().max() > 0

    # a given loss replaces the cross-entropy: lowering the first logit
    def lower_first_logit(logits, _):
        return -logits[:, 0].sum()

    gradient = torch.func.grad(lambda x: lower_first_logit(model(x), y))(X)
    adversarial = fgsm(model, X, y, epsilon, loss_fn=lower_first_logit)
    assert torch.equal(adversarial, X + epsilon * gradient.sign())
    assert torch.equal(fgsm(model, X, y, 0.0), X)


def test_attacks_run_in_eval_mode_and_leave_the_model_as_it_was():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 4)).double()
    X = torch.randn(10, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (10,))
    model.eval()
    gradient = torch.func.grad(lambda x: F.cross_entropy(model(x), y, reduction="sum"))(X)
    model.train()
    model[0].eval()  # a submodule kept in eval mode (as a frozen batch norm would be)
    frozen = model[0].weight
    frozen.requires_grad_(False)
    with torch.no_grad():  # the attacks take their gradient even so
        adversarial = fgsm(model, X, y, 0.1)
        pgd(model, X, y, 0.1, steps=3, random_start=True)
    assert torch.equal(adversarial, X + 0.1 * gradient.sign())  # no dropout: eval mode
    assert [module.training for module in model.modules()] == [True, False, True, True, True]
    assert all(param.grad is None for param in model.parameters())
    assert not frozen.requires_grad and model[3].weight.requires_grad
    assert not adversarial.requires_grad


def test_attacks_follow_the_dtype_of_the_inputs():
    case = CASE_BUILDERS["mlp_classification"]()
    model, X = case.model.float(), case.X.float()
    for attack in (fgsm, pgd):
        adversarial = attack(model, X, case.y, 0.1)
        assert adversarial.dtype == torch.float32 and adversarial.device == X.device


def test_pgd_stays_in_the_ball_and_the_range_and_beats_fgsm(separable):
    model, X, y = separable
    clamp = (-2.5, 2.5)
    X = X.clamp(*clamp)
    epsilon = 1.5
    clean_loss = _summed_loss(model, X, y)
    fgsm_loss = _summed_loss(model, fgsm(model, X, y, epsilon, clamp=clamp), y)
    for random_start in (False, True):
        gen = torch.Generator().manual_seed(7)
        adversarial = pgd(
            model, X, y, epsilon, steps=10, clamp=clamp, random_start=random_start, generator=gen
        )
        assert (adversarial - X).abs().max() <= epsilon + ATOL_BALL
        assert adversarial.min() >= clamp[0] and adversarial.max() <= clamp[1]
        assert _summed_loss(model, adversarial, y) > clean_loss
    # from X (no random start), ten steps of 2.5 ε / 10 climb higher than FGSM's one step of ε
    adversarial = pgd(model, X, y, epsilon, steps=10, clamp=clamp)
    assert _summed_loss(model, adversarial, y) >= fgsm_loss
    # one step of size ε from X is FGSM
    one_step = pgd(model, X, y, epsilon, steps=1, step_size=epsilon)
    assert torch.equal(one_step, fgsm(model, X, y, epsilon))


@pytest.mark.parametrize(
    ("attack", "kwargs", "message"),
    [
        (fgsm, {"epsilon": -0.1}, "epsilon must be a finite real number >= 0"),
        (fgsm, {"epsilon": float("inf")}, "epsilon"),
        (fgsm, {"clamp": (1.0, 0.0)}, "clamp"),
        (pgd, {"steps": 0}, "steps"),
        (pgd, {"step_size": float("nan")}, "step_size"),
        (pgd, {"clamp": (0.0,)}, "clamp"),
    ],
)
def test_attacks_refuse_bad_arguments(attack, kwargs, message):
    case = CASE_BUILDERS["mlp_classification"]()
    arguments = {"epsilon": 0.1, **kwargs}
    with pytest.raises(ValueError, match=message):
        attack(case.model, case.X, case.y, **arguments)


# ----------------------------------------------------------------------------------- sweep
def _predictives(model: nn.Module, la: Laplace) -> dict:
    return {
        "MAP": lambda x: model(x).softmax(-1),
        "KFAC": lambda x: la(x, link_approx="probit"),
    }


@pytest.fixture(scope="module")
def separable_laplace(separable):
    model, X, y = separable
    la = Laplace(model, "classification", "all", "kron", prior_precision=1.0)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=40))
    return la


def test_the_sweep_at_epsilon_zero_is_evaluate(separable, separable_laplace):
    model, X, y = separable
    loader = DataLoader(TensorDataset(X, y), batch_size=32)
    predictives = _predictives(model, separable_laplace)
    sweep = adversarial_sweep(predictives, model, loader, epsilons=[0.0, 0.5], n_bins=10)
    assert sweep["epsilons"] == [0.0, 0.5] and sweep["attack"] == "fgsm"
    assert set(sweep["results"]) == {"MAP", "KFAC"}
    for name, predictive in predictives.items():
        expected = evaluate(predictive, loader, n_bins=10)
        for metric in SWEEP_METRICS:
            assert sweep["results"][name][metric][0] == expected[metric], (name, metric)
    assert json.loads(json.dumps(sweep)) == sweep


def test_every_predictive_is_scored_on_the_same_perturbed_inputs(separable):
    model, X, y = separable
    seen = {"first": [], "second": []}

    def recording(name):
        def predictive(x):
            seen[name].append(x.clone())
            return model(x).softmax(-1)

        return predictive

    loader = DataLoader(TensorDataset(X, y), batch_size=50)
    epsilons = [0.0, 0.5]
    adversarial_sweep({name: recording(name) for name in seen}, model, loader, epsilons)
    assert len(seen["first"]) == len(seen["second"]) == len(epsilons) * len(loader)
    for first, second in zip(seen["first"], seen["second"], strict=True):
        assert torch.equal(first, second)
    n_batches = len(loader)
    clean = torch.cat(seen["first"][:n_batches])
    attacked = torch.cat(seen["first"][n_batches:])
    assert torch.equal(clean, X)
    assert torch.equal(attacked, fgsm(model, X, y, 0.5))  # per batch = on all: no batch coupling


@pytest.mark.parametrize("attack", ["fgsm", "pgd"])
def test_accuracy_of_the_map_network_falls_as_epsilon_grows(separable, attack):
    model, X, y = separable
    model.train()
    loader = DataLoader(TensorDataset(X, y), batch_size=50)
    epsilons = [0.0, 1.0, 1.5, 2.5]  # blobs 4 apart: the boundary is ~2 away
    predictives = {"MAP": lambda x: model(x).softmax(-1)}
    sweep = adversarial_sweep(predictives, model, loader, epsilons, attack=attack, pgd_steps=5)
    accuracy = sweep["results"]["MAP"]["accuracy"]
    assert accuracy[0] >= CLEAN_ACCURACY
    assert all(later < earlier for earlier, later in itertools.pairwise(accuracy))
    assert accuracy[-1] < 0.5  # worse than chance: the attack pushes across the boundary
    assert sweep["steps"] == (5 if attack == "pgd" else 1)
    assert model.training and all(param.grad is None for param in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epsilons": []}, "epsilons must be a non-empty sequence"),
        ({"epsilons": [0.0, -0.1]}, "epsilons must be a finite real number >= 0"),
        ({"epsilons": [float("nan")]}, "epsilons"),
        ({"attack": "cw"}, "attack='cw' is not supported; accepted values: 'fgsm', 'pgd'"),
        ({"attack": "pgd", "pgd_steps": 0}, "pgd_steps must be a positive integer"),
        ({"attack": "pgd", "pgd_step_size": -1.0}, "pgd_step_size"),
        ({"predictives": {}}, "predictives must be a non-empty mapping"),
        ({"predictives": {"MAP": 3}}, "predictives must map names"),
        ({"clamp": (0.0, 0.0)}, "clamp must be None or a pair"),
        ({"clamp": (0.0, float("inf"))}, "clamp"),
        ({"clamp": 1.0}, "clamp"),
        ({"n_bins": 0}, "n_bins"),
        ({"attack": "pgd", "random_start": "yes"}, "random_start must be True or False"),
        ({"attack": "pgd", "generator": 0}, "generator must be a torch.Generator"),
    ],
    ids=lambda value: str(value)[:40] if isinstance(value, dict) else "",
)
def test_the_sweep_refuses_bad_arguments_before_predicting(kwargs, message):
    calls = []

    class Refusing(nn.Linear):
        def forward(self, x):
            calls.append(len(x))
            return super().forward(x)

    model = Refusing(2, 2).double()
    X = torch.randn(4, 2, dtype=torch.float64)
    arguments = {
        "predictives": {"MAP": lambda x: calls.append(len(x))},
        "model": model,
        "loader": DataLoader(TensorDataset(X, torch.zeros(4, dtype=torch.long))),
        "epsilons": [0.0, 0.1],
        **kwargs,
    }
    with pytest.raises(ValueError, match=re.escape(message)):
        adversarial_sweep(**arguments)
    assert not calls
