"""Marginal-likelihood training: fit the network and its hyperparameters jointly.

Algorithm 1 of Immer et al. (ICML 2021): the weights θ minimise the negative log joint
``(ℓ(θ) + ½ θᵀP₀θ · c/T) / N`` (ℓ the summed loss, ``c = 2σ²`` for regression, 1 otherwise);
every ``marglik_frequency`` epochs a Laplace fit at the current weights and ``n_hypersteps`` Adam
steps on ``log p₀`` (and ``log σ``) ascend its log marginal likelihood; the best weights are kept.
"""

from __future__ import annotations

import logging
import warnings
from copy import deepcopy
from numbers import Number
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Adam, Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from laplace.core.base_laplace import BaseLaplace
from laplace.core.passes.data_loop import DataLoop, progress
from laplace.core.priors import expand_to_diagonal, fix_prior_prec_structure
from laplace.curvature import CurvatureInterface, CurvlinopsGGN
from laplace.curvature.registry import available_optional, load_optional
from laplace.laplace import Laplace
from laplace.likelihoods import LikelihoodModel, make_likelihood
from laplace.likelihoods.protocol import Likelihood as UserLikelihood
from laplace.utils import distributed as distributed_utils
from laplace.utils.data import Inputs
from laplace.utils.enums import HessianStructure, Likelihood, PriorStructure
from laplace.utils.errors import (
    check_finite_result,
    check_int_at_least,
    check_mapping,
    check_positive_float,
)

__all__ = ["default_backend", "marglik_training"]

logger = logging.getLogger(__name__)


#: What takes outputs with extra dimensions where ``marglik_training`` does not.
_FIT_INSTEAD = (
    "a Laplace approximation of the trained network: Laplace(...).fit(train_loader), then "
    "optimize_prior_precision(method='marglik')"
)


def default_backend(
    likelihood: Likelihood | str | UserLikelihood | LikelihoodModel = Likelihood.CLASSIFICATION,
    sigma_noise_init: float | Tensor = 1.0,
) -> type[CurvatureInterface]:
    """laplace-torch's default ``AsdlGGN`` where installed and applicable, else ``CurvlinopsGGN``.

    Both give the same curvature; ASDL takes neither other likelihoods nor one σ per output
    (``likelihood`` and ``sigma_noise_init`` as given to ``marglik_training``).
    """
    if "AsdlGGN" not in available_optional() or torch.as_tensor(sigma_noise_init).numel() > 1:
        return CurvlinopsGGN
    asdl = load_optional("AsdlGGN")
    try:
        make_likelihood(likelihood).fit_likelihood.check_backend(asdl)
    except ValueError:
        return CurvlinopsGGN
    return asdl


def marglik_training(
    model: nn.Module,
    train_loader: DataLoader,
    likelihood: Likelihood | str = Likelihood.CLASSIFICATION,
    hessian_structure: HessianStructure | str = HessianStructure.KRON,
    backend: type[CurvatureInterface] | None = None,
    optimizer_cls: type[Optimizer] = Adam,
    optimizer_kwargs: dict[str, Any] | None = None,
    scheduler_cls: type[LRScheduler] | None = None,
    scheduler_kwargs: dict[str, Any] | None = None,
    n_epochs: int = 300,
    lr_hyp: float = 1e-1,
    prior_structure: PriorStructure | str = PriorStructure.LAYERWISE,
    n_epochs_burnin: int = 0,
    n_hypersteps: int = 10,
    marglik_frequency: int = 1,
    prior_prec_init: float = 1.0,
    sigma_noise_init: float | Tensor = 1.0,
    temperature: float = 1.0,
    fix_sigma_noise: bool = False,
    progress_bar: bool = False,
    enable_backprop: bool = False,
    dict_key_x: str = "input_ids",
    dict_key_y: str = "labels",
    distributed: bool | None = None,
) -> tuple[BaseLaplace, nn.Module, list[Number], list[Number]]:
    """Train ``model`` by MAP and its prior precision (and σ) by marginal likelihood.

    Args:
        model: The network (returns logits for classification); trained in place.
        train_loader: Training batches; ``len(train_loader.dataset)`` is N.
        likelihood: A likelihood name (``"classification"``, ``"regression"``, ...) or a
            ``laplace.likelihoods.Likelihood``; the network is trained with its loss.
        hessian_structure: ``"full"``, ``"kron"`` or ``"diag"`` over all weights.
        backend: Curvature backend; None: ``default_backend``.
        optimizer_cls: Optimiser of the network weights.
        optimizer_kwargs: Its keyword arguments; ``weight_decay`` is set to 0 (the learnt prior).
        scheduler_cls: Optional learning-rate scheduler, stepped after every batch.
        scheduler_kwargs: Its keyword arguments.
        n_epochs: Number of epochs.
        lr_hyp: Adam learning rate of the hyperparameters.
        prior_structure: ``"scalar"``, ``"layerwise"`` or ``"diag"`` prior precision.
        n_epochs_burnin: Epochs before the first marginal-likelihood step.
        n_hypersteps: Hyperparameter steps per marginal-likelihood estimate.
        marglik_frequency: Estimate the marginal likelihood every this many epochs.
        prior_prec_init: Initial prior precision (multiplied by ``temperature``).
        sigma_noise_init: Initial observation noise (regression): a number, or shape (C,) for
            one σ per output.
        temperature: Likelihood temperature.
        fix_sigma_noise: Keep σ at ``sigma_noise_init`` instead of learning it.
        progress_bar: Show a progress bar over epochs.
        enable_backprop: Make the returned Laplace differentiable w.r.t. its inputs.
        dict_key_x: Key of the inputs in dict-like batches.
        dict_key_y: Key of the targets in dict-like batches.
        distributed: Train on the shards of several processes (docs/distributed.md; wrap
            ``model`` in ``DistributedDataParallel``); None: automatic.

    Returns:
        ``(la, model, margliks, losses)``: the Laplace approximation fitted at the best weights
        and hyperparameters, the model holding those weights, the negative log marginal
        likelihood of every hyperparameter step, the mean negative log joint of every epoch.

    Raises:
        ValueError: Before any training step, for unknown options, an empty loader, negative
            counts or non-positive frequencies and rates.
        TypeError: For a model that is not a module or an optimiser that is not a class.
    """
    likelihood_model = make_likelihood(likelihood)
    hessian_structure = HessianStructure(hessian_structure)
    prior_structure = PriorStructure(prior_structure)
    if hessian_structure == HessianStructure.GP:
        raise ValueError(
            "marglik_training supports hessian_structure 'full', 'kron', 'diag' or 'lowrank' "
            "(a weight-space posterior over all weights), got 'gp'."
        )
    for name, value, minimum in (
        ("n_epochs", n_epochs, 0),
        ("n_hypersteps", n_hypersteps, 0),
        ("n_epochs_burnin", n_epochs_burnin, 0),
        ("marglik_frequency", marglik_frequency, 1),
    ):
        check_int_at_least(value, name, minimum)
    check_positive_float(lr_hyp, "lr_hyp")
    for name, cls in (("optimizer_cls", optimizer_cls), ("scheduler_cls", scheduler_cls)):
        if cls is not None and not callable(cls):
            raise TypeError(f"{name} must be a class (e.g. of torch.optim), got {cls!r}.")
    optimizer_kwargs = check_mapping(optimizer_kwargs, "optimizer_kwargs")
    scheduler_kwargs = check_mapping(scheduler_kwargs, "scheduler_kwargs")
    distributed = distributed_utils.resolve(distributed, train_loader)
    n_data = distributed_utils.total_data_count(train_loader, distributed)
    if n_data == 0:
        raise ValueError("train_loader is empty: marglik_training needs data.")
    backend = default_backend(likelihood, sigma_noise_init) if backend is None else backend

    def make_laplace(prior_prec: Tensor, sigma: Tensor | float, backprop: bool) -> BaseLaplace:
        return Laplace(
            model,
            likelihood,
            subset_of_weights="all",
            hessian_structure=hessian_structure,
            sigma_noise=sigma,
            prior_precision=prior_prec,
            temperature=temperature,
            enable_backprop=backprop,
            backend=backend,
            dict_key_x=dict_key_x,
            dict_key_y=dict_key_y,
        )

    # Every check of the Laplace constructor (backend, likelihood and structure, σ, T, the
    # prior, trainable parameters) before the first training step; its weights are trained.
    weights = make_laplace(
        check_positive_float(prior_prec_init, "prior_prec_init"), sigma_noise_init, False
    )._subset
    if "weight_decay" in optimizer_kwargs:
        warnings.warn("Weight decay is handled and optimized. Will be set to 0.", stacklevel=2)
        optimizer_kwargs["weight_decay"] = 0.0

    has_noise = likelihood_model.has_noise_hyperparameter
    learn_sigma = has_noise and not fix_sigma_noise
    log_prior_prec = fix_prior_prec_structure(
        temperature * prior_prec_init,
        prior_structure,
        *weights.prior_lengths,
        weights.device,
        weights.dtype,
    ).log()
    log_prior_prec.requires_grad_(True)
    # One σ, or one per output (C,): log σ in float64, then in the model's dtype.
    init = torch.as_tensor(sigma_noise_init).detach().to(torch.float64).reshape(-1)
    log_sigma = init.log().to(device=weights.device, dtype=weights.dtype)
    log_sigma.requires_grad_(learn_sigma)
    hyper_optimizer = Adam([log_prior_prec, *([log_sigma] if learn_sigma else [])], lr=lr_hyp)
    fixed_sigma = sigma_noise_init if has_noise else 1.0
    if torch.is_tensor(fixed_sigma):
        fixed_sigma = fixed_sigma.detach().clone()

    def hyperparameters() -> tuple[Tensor, Tensor | float]:
        """The current prior precision and σ, detached."""
        sigma = log_sigma.detach().exp() if learn_sigma else fixed_sigma
        return log_prior_prec.detach().exp(), sigma

    optimizer = optimizer_cls(model.parameters(), **optimizer_kwargs)
    scheduler = scheduler_cls(optimizer, **scheduler_kwargs) if scheduler_cls else None
    fit_likelihood = likelihood_model.fit_likelihood
    # Mean losses (MSE over all outputs, or cross-entropy), targets shaped by the likelihood.
    criterion = fit_likelihood.loss_module()

    def training_step(X: Inputs, y: Tensor) -> float:
        """One optimiser step on a batch; its loss times its size."""
        prior_precision, sigma = hyperparameters()
        optimizer.zero_grad()
        f = model(X)
        fit_likelihood.outputs.require_plain(f.shape, "marglik_training", _FIT_INSTEAD)
        targets = fit_likelihood.prepare_targets(f, y)
        if torch.is_tensor(sigma) and sigma.numel() > 1:
            # One σ per output: outputs and targets scaled by σ̄/σ_c weigh the squared
            # error of output c by σ̄²/σ_c², with σ̄² = 1/mean(1/σ²) in the prior term.
            precision = sigma.square().reciprocal()
            output_weights = (precision / precision.mean()).sqrt()
            f, targets = f * output_weights, targets * output_weights
            sigma2 = float(1 / precision.mean())
        else:
            sigma2 = float(sigma.square()) if torch.is_tensor(sigma) else sigma**2
        # The log joint per data point, in units of the mean loss: ½θᵀP₀θ · c / N with
        # c = σ² / (loss_scale · T), i.e. 2σ²/T for the MSE and 1/T for cross-entropy.
        prior_scale = sigma2 / fit_likelihood.loss_scale / temperature
        delta = expand_to_diagonal(prior_precision, weights.prior_sizes)
        theta = weights.vector()
        data_loss = criterion(f, targets)
        loss = data_loss + 0.5 * (delta * theta) @ theta * prior_scale / n_data
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        return loss.item() * len(y)

    epoch_loop = TrainingEpoch(
        dict_key_x,
        dict_key_y,
        weights.device,
        distributed=distributed,
        what="marglik training",
        empty_message="train_loader yielded no batches: marglik_training needs data.",
        step=training_step,
    )
    best: tuple[float, dict[str, Tensor], Tensor, Tensor | float] | None = None
    margliks: list[Number] = []
    losses: list[Number] = []
    for epoch in progress(range(1, n_epochs + 1), progress_bar, "marglik training"):
        model.train()
        losses.append(epoch_loop.run(train_loader) / n_data)
        logger.info("marglik training, epoch %d: loss %.4g", epoch, losses[-1])
        if epoch % marglik_frequency != 0 or epoch < n_epochs_burnin:
            continue

        model.eval()
        la = make_laplace(*hyperparameters(), False)
        la.fit(train_loader, distributed=distributed)
        for _ in range(n_hypersteps):
            hyper_optimizer.zero_grad()
            evaluated = hyperparameters()  # those of the marglik recorded last
            neg_marglik = -la.log_marginal_likelihood(
                log_prior_prec.exp(), log_sigma.exp() if learn_sigma else None
            )
            neg_marglik.backward()
            hyper_optimizer.step()
            margliks.append(neg_marglik.item())
        if n_hypersteps and (best is None or margliks[-1] < best[0]):
            best = (margliks[-1], deepcopy(model.state_dict()), *evaluated)
            logger.info("marglik training, epoch %d: new best %.4g", epoch, margliks[-1])

    model.eval()
    if best is not None:
        model.load_state_dict(best[1])
    la = make_laplace(*(best[2:] if best else hyperparameters()), enable_backprop)
    la.fit(train_loader, distributed=distributed)
    return la, model, margliks, losses


class TrainingEpoch(DataLoop):
    """One epoch of MAP training, summing what ``step`` returns over the data (and ranks).

    ``step`` takes an optimiser step on the negative log joint of a batch and returns it times
    the batch size.
    """

    def start(self) -> float:
        """The epoch's loss starts at zero."""
        return 0.0

    def check(self, stats: float) -> None:
        """Refuse a non-finite loss (a diverging optimiser), naming the training."""
        check_finite_result(stats, "loss of a batch of marglik training")
