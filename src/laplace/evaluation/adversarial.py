r"""Adversarial inputs: FGSM and PGD attacks on a network, and predictives scored along ε.

The attacks are untargeted and bounded in L∞: they move each input at most ε per entry in the
direction that raises the network's loss (cross-entropy by default). They are written here in
a few lines on purpose: no maintained attack library is a core dependency of laplace-ng.
``adversarial_sweep`` perturbs a test set once per ε against the MAP network that the Laplace
approximations share, and scores every predictive on the same perturbed inputs with the
classification evaluation that ``evaluate`` uses, so its numbers at ε = 0 are ``evaluate``'s.
Classification only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from laplace.core.passes.data_loop import progress
from laplace.evaluation.evaluate import model_device, predict_detached
from laplace.likelihoods import make_likelihood
from laplace.likelihoods.scoring import N_BINS, EvaluationOptions, Metrics
from laplace.utils.data import split_batch
from laplace.utils.errors import check_bool, check_generator, check_module, check_positive_int

__all__ = ["ATTACKS", "SWEEP_METRICS", "adversarial_sweep", "fgsm", "pgd"]

#: The metrics of ``adversarial_sweep``, from the classification evaluation.
SWEEP_METRICS = ("accuracy", "confidence", "ece", "nll", "brier")

#: A loss of the attacks: ``(logits (B, C), labels (B,)) → scalar``.
LossFn = Callable[[Tensor, Tensor], Tensor]


def _summed_cross_entropy(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits, y.long(), reduction="sum")


def _check_epsilon(epsilon: object, name: str = "epsilon") -> float:
    if isinstance(epsilon, Tensor) and epsilon.numel() == 1:
        epsilon = epsilon.item()
    if (
        isinstance(epsilon, bool)
        or not isinstance(epsilon, numbers.Real)
        or not math.isfinite(epsilon)
        or epsilon < 0
    ):
        raise ValueError(f"{name} must be a finite real number >= 0, got {epsilon!r}.")
    return float(epsilon)


def _check_clamp(clamp: object) -> tuple[float, float] | None:
    if clamp is None:
        return None
    accepted = "None or a pair (low, high) of finite real numbers with low < high"
    if not (isinstance(clamp, Sequence) and len(clamp) == 2) or not all(
        isinstance(bound, numbers.Real) and not isinstance(bound, bool) and math.isfinite(bound)
        for bound in clamp
    ):
        raise ValueError(f"clamp must be {accepted}, got {clamp!r}.")
    low, high = (float(bound) for bound in clamp)
    if not low < high:
        raise ValueError(f"clamp must be {accepted}, got {clamp!r}.")
    return low, high


def _check_inputs(X: object) -> Tensor:
    if not isinstance(X, Tensor) or not X.is_floating_point():
        kind = f"a {X.dtype} tensor" if isinstance(X, Tensor) else type(X).__name__
        raise ValueError(f"X must be a floating-point tensor of inputs, got {kind}.")
    return X


def _clamped(X: Tensor, clamp: tuple[float, float] | None) -> Tensor:
    return X if clamp is None else X.clamp(*clamp)


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """The model in eval mode inside; each submodule's own mode restored after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _input_gradient(model: nn.Module, X: Tensor, y: Tensor, loss_fn: LossFn) -> Tensor:
    """``∇ₓ loss_fn(model(X), y)``; the parameters' ``.grad`` stay as they were."""
    with torch.enable_grad():
        X = X.detach().requires_grad_(True)
        logits = model(X)
        (gradient,) = torch.autograd.grad(loss_fn(logits, y.to(logits.device)), X)
    return gradient


def fgsm(
    model: nn.Module,
    X: Tensor,
    y: Tensor,
    epsilon: float,
    loss_fn: LossFn | None = None,
    clamp: tuple[float, float] | None = None,
) -> Tensor:
    r"""Fast gradient sign method: one L∞ step of size ε up the loss.

    ``X_adv = clamp(X + ε · sign(∇ₓ loss(model(X), y)))`` (Goodfellow et al., 2015), with the
    model in eval mode (each module's mode is restored after). Hand-written on purpose (a few
    lines): no maintained attack library is a core dependency. At ε = 0 no gradient is taken.

    Args:
        model: The network; returns logits (B, C) for inputs (B, ...).
        X: Inputs (B, ...), floating point, on the model's device.
        y: Labels (B,).
        epsilon: The L∞ radius ε ≥ 0 of the perturbation.
        loss_fn: ``(logits, y) → scalar`` loss to raise; default the summed cross-entropy.
        clamp: ``(low, high)``: the perturbed inputs are clipped to this range (e.g. ``(0, 1)``
            for images); None: no clipping.

    Returns:
        The perturbed inputs (B, ...), detached, in the dtype and on the device of ``X``.

    Raises:
        ValueError: For a negative or non-finite ``epsilon``, a bad ``clamp`` or non-float
            ``X``.
    """
    epsilon, clamp = _check_epsilon(epsilon), _check_clamp(clamp)
    _check_inputs(X)
    check_module(model)
    if epsilon == 0:
        return _clamped(X.detach().clone(), clamp)
    with _eval_mode(model):
        gradient = _input_gradient(model, X, y, loss_fn or _summed_cross_entropy)
    return _clamped(X.detach() + epsilon * gradient.sign(), clamp)


def pgd(
    model: nn.Module,
    X: Tensor,
    y: Tensor,
    epsilon: float,
    steps: int = 10,
    step_size: float | None = None,
    loss_fn: LossFn | None = None,
    clamp: tuple[float, float] | None = None,
    random_start: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""Projected gradient descent in the L∞ ball: ``steps`` signed gradient steps up the loss.

    From ``X₀ = X`` (or a uniform random point of the ball with ``random_start``), each step is
    ``X_{k+1} = clamp(X + Π_ε(X_k + α · sign(∇ₓ loss(model(X_k), y)) − X))`` with ``Π_ε`` the
    entrywise clipping to [−ε, ε] (Madry et al., 2018), the model in eval mode (each module's
    mode is restored after). Hand-written on purpose (a few lines): no maintained attack
    library is a core dependency. Every iterate lies in the ε-ball around ``X`` (and in
    ``clamp`` when ``X`` does).

    Args:
        model: The network; returns logits (B, C) for inputs (B, ...).
        X: Inputs (B, ...), floating point, on the model's device.
        y: Labels (B,).
        epsilon: The L∞ radius ε ≥ 0 of the perturbation.
        steps: Number of gradient steps, at least 1.
        step_size: Step α; default ``2.5 ε / steps``.
        loss_fn: ``(logits, y) → scalar`` loss to raise; default the summed cross-entropy.
        clamp: ``(low, high)``: the inputs are clipped to this range after each step; None:
            no clipping.
        random_start: Start from a uniform random point of the ε-ball instead of ``X``.
        generator: Random generator of the start, on the device of ``X``.

    Returns:
        The perturbed inputs (B, ...), detached, in the dtype and on the device of ``X``.

    Raises:
        ValueError: For a negative or non-finite ``epsilon`` or ``step_size``, ``steps`` < 1,
            a bad ``clamp``, ``random_start`` or ``generator``, or non-float ``X``.
    """
    epsilon, clamp = _check_epsilon(epsilon), _check_clamp(clamp)
    check_positive_int(steps, "steps")
    check_bool(random_start, "random_start")
    check_generator(generator)
    step = 2.5 * epsilon / steps if step_size is None else _check_epsilon(step_size, "step_size")
    _check_inputs(X)
    check_module(model)
    X = X.detach()
    if epsilon == 0:
        return _clamped(X.clone(), clamp)
    loss_fn = loss_fn or _summed_cross_entropy
    X_adv = X
    if random_start:
        noise = torch.rand(X.shape, generator=generator, dtype=X.dtype, device=X.device)
        X_adv = _clamped(X + epsilon * (2 * noise - 1), clamp)
    with _eval_mode(model):
        for _ in range(steps):
            moved = X_adv + step * _input_gradient(model, X_adv, y, loss_fn).sign()
            X_adv = _clamped(X + (moved - X).clamp(-epsilon, epsilon), clamp)
    return X_adv


#: The attacks of ``adversarial_sweep`` by name.
ATTACKS: dict[str, Callable[..., Tensor]] = {"fgsm": fgsm, "pgd": pgd}


def _check_predictives(predictives: object) -> dict[str, Callable]:
    if not isinstance(predictives, Mapping) or not predictives:
        raise ValueError(
            "predictives must be a non-empty mapping of names to callables returning class "
            f"probabilities, e.g. {{'MAP': lambda x: model(x).softmax(-1)}}; got {predictives!r}."
        )
    for name, predictive in predictives.items():
        if not isinstance(name, str) or not callable(predictive):
            raise ValueError(
                f"predictives must map names (str) to callables; {name!r} maps to "
                f"{type(predictive).__name__}."
            )
    return dict(predictives)


def _check_epsilons(epsilons: object) -> list[float]:
    if isinstance(epsilons, Tensor):
        epsilons = epsilons.reshape(-1).tolist()
    if not isinstance(epsilons, Sequence) or isinstance(epsilons, str) or not epsilons:
        raise ValueError(
            f"epsilons must be a non-empty sequence of finite real numbers >= 0, got {epsilons!r}."
        )
    return [_check_epsilon(epsilon, "epsilons") for epsilon in epsilons]


def adversarial_sweep(
    predictives: Mapping[str, Callable[[Tensor], Tensor]],
    model: nn.Module,
    loader: DataLoader,
    epsilons: Sequence[float],
    attack: str = "fgsm",
    pgd_steps: int = 10,
    pgd_step_size: float | None = None,
    clamp: tuple[float, float] | None = None,
    loss_fn: LossFn | None = None,
    n_bins: int = N_BINS,
    random_start: bool = False,
    generator: torch.Generator | None = None,
    progress_bar: bool = False,
) -> Metrics:
    r"""Calibration of several classification predictives on adversarial inputs, per ε.

    For each ε, each batch of ``loader`` is perturbed once against ``model`` (the MAP network
    the approximations share) with ``attack``, and every predictive is scored on the same
    perturbed inputs by the classification evaluation of ``evaluate``: at ε = 0 (inputs
    unperturbed, up to ``clamp``) each predictive's numbers are those of
    ``evaluate(predictive, loader)``. Classification only: each predictive returns class
    probabilities (B, C), e.g. ``{"MAP": lambda x: model(x).softmax(-1), "KFAC": lambda x:
    la(x, link_approx="probit")}``; it runs in the caller's autograd mode and its outputs are
    detached. Inputs are moved to the device of ``model``.

    Args:
        predictives: Names to callables ``x (B, ...) → probabilities (B, C)``.
        model: The network attacked; returns logits (B, C).
        loader: ``(X, y)`` batches of float input tensors and labels (B,).
        epsilons: The L∞ radii ε ≥ 0 to sweep, in the units of the inputs.
        attack: ``"fgsm"`` or ``"pgd"`` (see ``fgsm`` and ``pgd``).
        pgd_steps: Steps of PGD, at least 1.
        pgd_step_size: Step of PGD; default ``2.5 ε / pgd_steps``.
        clamp: ``(low, high)`` range of valid inputs the attacks clip to; None: none.
        loss_fn: ``(logits, y) → scalar`` loss the attacks raise; default the cross-entropy.
        n_bins: Bins of the calibration error.
        random_start: PGD starts from a random point of the ε-ball.
        generator: Random generator of PGD's start, on the model's device.
        progress_bar: Show a progress bar over batches.

    Returns:
        ``{"epsilons": [...], "attack": str, "steps": int, "results": {name: {metric:
        [one value per ε]}}}`` with the metrics ``SWEEP_METRICS`` (accuracy, mean top-label
        confidence, ECE, NLL, Brier score), JSON-serialisable.

    Raises:
        ValueError: Before any prediction, for empty or non-callable ``predictives``, empty,
            negative or non-finite ``epsilons``, an unknown ``attack``, ``pgd_steps`` < 1, a
            bad ``clamp``, ``n_bins``, ``random_start`` or ``generator``; and for an empty
            loader, inputs that are not float tensors, or predictions that are not
            probabilities (B, C).

    Example:
        >>> sweep = adversarial_sweep(  # doctest: +SKIP
        ...     {"MAP": lambda x: model(x).softmax(-1), "KFAC": lambda x: la(x)},
        ...     model, test_loader, epsilons=[0.0, 0.01, 0.05], clamp=(0.0, 1.0),
        ... )
        >>> {name: m["accuracy"] for name, m in sweep["results"].items()}  # doctest: +SKIP
    """
    predictives = _check_predictives(predictives)
    check_module(model)
    epsilons = _check_epsilons(epsilons)
    if attack not in ATTACKS:
        accepted = ", ".join(map(repr, ATTACKS))
        raise ValueError(f"attack={attack!r} is not supported; accepted values: {accepted}.")
    clamp = _check_clamp(clamp)
    check_positive_int(n_bins, "n_bins")
    options: dict[str, object] = {"clamp": clamp, "loss_fn": loss_fn}
    steps = 1
    if attack == "pgd":
        steps = check_positive_int(pgd_steps, "pgd_steps")
        step_size = pgd_step_size
        if step_size is not None:
            step_size = _check_epsilon(step_size, "pgd_step_size")
        check_bool(random_start, "random_start")
        check_generator(generator)
        options.update(
            steps=steps, step_size=step_size, random_start=random_start, generator=generator
        )
    device = model_device(model)
    likelihood = make_likelihood("classification").predictive_likelihood
    evaluation_options = EvaluationOptions(n_bins)
    results: dict[str, dict[str, list[float]]] = {
        name: {metric: [] for metric in SWEEP_METRICS} for name in predictives
    }
    for epsilon in epsilons:
        evaluations = {name: likelihood.evaluation(evaluation_options) for name in predictives}
        for batch in progress(loader, progress_bar, f"adversarial ε={epsilon:g}"):
            inputs, y = split_batch(batch, None, "labels")
            X = _check_inputs(inputs)
            X = X if device is None else X.to(device)
            X_adv = ATTACKS[attack](model, X, y, epsilon, **options)
            for name, predictive in predictives.items():
                out = predict_detached(predictive, X_adv, model_device(predictive), {})
                evaluations[name].update(out, y)
        for name, evaluation in evaluations.items():
            summary = evaluation.compute()
            for metric in SWEEP_METRICS:
                results[name][metric].append(summary[metric])
    return {"epsilons": epsilons, "attack": attack, "steps": steps, "results": results}
