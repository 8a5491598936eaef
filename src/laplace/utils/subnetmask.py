"""Subnetwork masks: ways to choose which weights a subnetwork Laplace treats probabilistically.

``SubnetMask.select`` returns sorted ``long`` indices into the flattened trainable parameters
(``model.named_parameters()`` order), the ``subnetwork_indices`` of ``SubnetLaplace``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from laplace.likelihoods import make_likelihood
from laplace.utils.enums import Likelihood
from laplace.utils.errors import (
    ArgumentTypeError,
    check_module,
    check_positive_float,
    check_positive_int,
)
from laplace.utils.feature_extractor import FeatureExtractor
from laplace.utils.swag import fit_diagonal_swag_var, trainable_vector

if TYPE_CHECKING:
    from laplace.parametric.diag_laplace import DiagLaplace

__all__ = [
    "LargestMagnitudeSubnetMask",
    "LargestVarianceDiagLaplaceSubnetMask",
    "LargestVarianceSWAGSubnetMask",
    "LastLayerSubnetMask",
    "ModuleNameSubnetMask",
    "ParamNameSubnetMask",
    "RandomSubnetMask",
    "ScoreBasedSubnetMask",
    "SubnetMask",
]

_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class SubnetMask:
    """Base of the masks of a trained ``model``; subclasses implement ``get_subnet_mask``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = check_module(model)
        self.parameter_vector = trainable_vector(model)
        self._n_params = len(self.parameter_vector)
        self._indices: Tensor | None = None

    @property
    def indices(self) -> Tensor:
        """The selected indices, shape (K,).

        Raises:
            AttributeError: Before ``select``.
        """
        if self._indices is None:
            raise AttributeError("the subnetwork mask is not selected yet: call select() first.")
        return self._indices

    @property
    def n_params_subnet(self) -> int:
        """Number K of selected parameters."""
        return len(self.indices)

    def convert_subnet_mask_to_indices(self, subnet_mask: Tensor) -> Tensor:
        """Sorted ``long`` indices (K,) of the ones of a boolean or 0/1 mask (P,).

        Raises:
            ValueError: If the mask is not a binary 1-D tensor of length P.
        """
        if not isinstance(subnet_mask, Tensor):
            raise ValueError(f"subnet_mask must be a torch.Tensor, got {type(subnet_mask)}.")
        if subnet_mask.dtype not in _MASK_DTYPES or subnet_mask.dim() != 1:
            raise ValueError(
                "subnet_mask must be a 1-D boolean or integer tensor, got dtype "
                f"{subnet_mask.dtype} and shape {tuple(subnet_mask.shape)}."
            )
        if len(subnet_mask) != self._n_params or not bool(
            ((subnet_mask == 0) | (subnet_mask == 1)).all()
        ):
            raise ValueError(
                f"subnet_mask must be a binary vector of length n_params={self._n_params} "
                "with ones at the subnetwork's entries of the flattened trainable parameters."
            )
        return subnet_mask.nonzero(as_tuple=True)[0]

    def select(self, train_loader: DataLoader | None = None) -> Tensor:
        """Choose the subnetwork (once), with ``train_loader`` for masks that need it.

        Returns:
            ``long`` indices (K,) into the flattened trainable parameters.

        Raises:
            ValueError: If called a second time.
        """
        if self._indices is not None:
            raise ValueError("the subnetwork mask is already selected.")
        self._indices = self.convert_subnet_mask_to_indices(self.get_subnet_mask(train_loader))
        return self._indices

    def get_subnet_mask(self, train_loader: DataLoader | None) -> Tensor:
        """Binary mask (P,) with ones at the subnetwork's entries."""
        raise NotImplementedError


class ScoreBasedSubnetMask(SubnetMask):
    """Keep the ``n_params_subnet`` (K, 1 ≤ K ≤ P) weights of ``model`` with the highest scores.

    Raises:
        ValueError: If K is missing or outside [1, P].
    """

    def __init__(self, model: nn.Module, n_params_subnet: int) -> None:
        super().__init__(model)
        check_positive_int(n_params_subnet, "n_params_subnet")
        if not n_params_subnet <= self._n_params:
            raise ValueError(
                f"n_params_subnet must be between 1 and the number of trainable weights "
                f"{self._n_params}, got {n_params_subnet!r}."
            )
        self._n_params_subnet = int(n_params_subnet)
        self._param_scores: Tensor | None = None

    @property
    def n_params_subnet(self) -> int:
        """Number K of weights to keep (known before ``select``)."""
        return self._n_params_subnet

    def compute_param_scores(self, train_loader: DataLoader | None) -> Tensor:
        """Score of every weight, shape (P,)."""
        raise NotImplementedError

    def get_subnet_mask(self, train_loader: DataLoader | None) -> Tensor:
        """Mask of the K highest-scoring weights."""
        if self._param_scores is None:
            self._param_scores = self.compute_param_scores(train_loader)
        if self._param_scores.shape != self.parameter_vector.shape:
            raise ValueError(
                f"parameter scores have shape {tuple(self._param_scores.shape)}, expected "
                f"{tuple(self.parameter_vector.shape)}."
            )
        top = torch.topk(self._param_scores, self._n_params_subnet).indices
        mask = torch.zeros_like(self.parameter_vector, dtype=torch.bool)
        mask[top] = True
        return mask


class RandomSubnetMask(ScoreBasedSubnetMask):
    """K weights chosen uniformly at random (from torch's global generator; seed it)."""

    def compute_param_scores(self, train_loader: DataLoader | None) -> Tensor:
        """Uniform random scores."""
        return torch.rand_like(self.parameter_vector)


class LargestMagnitudeSubnetMask(ScoreBasedSubnetMask):
    """The K weights of largest magnitude ``|θ|``."""

    def compute_param_scores(self, train_loader: DataLoader | None) -> Tensor:
        """``|θ|``."""
        return self.parameter_vector.abs()


def _require_loader(train_loader: DataLoader | None) -> DataLoader:
    if train_loader is None:
        raise ValueError("this subnetwork mask needs the train_loader: call select(train_loader).")
    return train_loader


class LargestVarianceDiagLaplaceSubnetMask(ScoreBasedSubnetMask):
    """The K weights of largest marginal variance under ``diag_laplace_model``.

    ``diag_laplace_model`` is a ``DiagLaplace`` of ``model``, fitted on ``select``'s loader.
    """

    def __init__(
        self, model: nn.Module, n_params_subnet: int, diag_laplace_model: DiagLaplace
    ) -> None:
        super().__init__(model, n_params_subnet)
        if not hasattr(type(diag_laplace_model), "posterior_variance"):
            raise TypeError(
                "diag_laplace_model must be a DiagLaplace of the model (it gives the posterior "
                f"variances), got {type(diag_laplace_model).__name__}."
            )
        self.diag_laplace_model = diag_laplace_model

    def compute_param_scores(self, train_loader: DataLoader | None) -> Tensor:
        """Posterior variances of the fitted diagonal Laplace, shape (P,)."""
        self.diag_laplace_model.fit(_require_loader(train_loader))
        return self.diag_laplace_model.posterior_variance


class LargestVarianceSWAGSubnetMask(ScoreBasedSubnetMask):
    """The K weights of largest marginal variance under diagonal SWAG.

    ``likelihood`` is ``"classification"`` or ``"regression"``; the ``swag_*`` arguments are
    ``fit_diagonal_swag_var``'s number of snapshots, epochs between them and learning rate.

    Raises:
        ValueError: For another likelihood.
    """

    def __init__(
        self,
        model: nn.Module,
        n_params_subnet: int,
        likelihood: Likelihood | str = Likelihood.CLASSIFICATION,
        swag_n_snapshots: int = 40,
        swag_snapshot_freq: int = 1,
        swag_lr: float = 0.01,
    ) -> None:
        likelihood_model = make_likelihood(likelihood)
        if likelihood_model.is_composite:  # SWAG trains on one loss
            raise ValueError(
                "LargestVarianceSWAGSubnetMask supports likelihood 'classification' or "
                f"'regression', got {likelihood_model.name!r}."
            )
        super().__init__(model, n_params_subnet)
        self.likelihood = likelihood_model.kind
        self._likelihood_model = likelihood_model
        self.swag_n_snapshots = check_positive_int(swag_n_snapshots, "swag_n_snapshots")
        self.swag_snapshot_freq = check_positive_int(swag_snapshot_freq, "swag_snapshot_freq")
        self.swag_lr = check_positive_float(swag_lr, "swag_lr")

    def compute_param_scores(self, train_loader: DataLoader | None) -> Tensor:
        """Diagonal SWAG variances, shape (P,)."""
        likelihood = self._likelihood_model
        loss = likelihood.loss_module()
        return fit_diagonal_swag_var(
            self.model,
            _require_loader(train_loader),
            lambda f, y: loss(f, likelihood.loss_targets(y, f.dtype)),
            n_snapshots_total=self.swag_n_snapshots,
            snapshot_freq=self.swag_snapshot_freq,
            lr=self.swag_lr,
        )


def _names(names: Iterable[str], what: str) -> list[str]:
    """``names`` as a list of strings (a single string is refused, not split into letters)."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ArgumentTypeError(f"{what}_names must be a list of names (strings), got {names!r}.")
    return list(names)


def _mask(model: nn.Module, chosen: set[int]) -> Tensor:
    """Boolean mask (P,) of the trainable parameters whose ``id`` is in ``chosen``."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.cat(
        [torch.full((p.numel(),), id(p) in chosen, device=p.device) for p in trainable]
    )


def _missing(wanted: list[str], present: list[str], what: str) -> None:
    if len(wanted) == 0:
        raise ValueError(f"the list of {what} names must not be empty.")
    missing = [name for name in wanted if name not in present]
    if missing:
        raise ValueError(f"{what}s {missing} do not exist in the model (or are not trainable).")


class ParamNameSubnetMask(SubnetMask):
    """Whole parameter tensors chosen by ``parameter_names`` (``model.named_parameters()``)."""

    def __init__(self, model: nn.Module, parameter_names: list[str]) -> None:
        super().__init__(model)
        self.parameter_names = _names(parameter_names, "parameter")

    def get_subnet_mask(self, train_loader: DataLoader | None) -> Tensor:
        """Ones on the named parameters' entries."""
        named = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        _missing(self.parameter_names, list(named), "parameter")
        return _mask(self.model, {id(named[n]) for n in self.parameter_names})


class ModuleNameSubnetMask(SubnetMask):
    """All trainable parameters of the leaf modules named ``module_names``.

    Raises:
        ValueError: (on ``select``) for an empty list, unknown names, modules with children
            or without parameters.
    """

    def __init__(self, model: nn.Module, module_names: list[str]) -> None:
        super().__init__(model)
        self.module_names = _names(module_names, "module")

    def get_subnet_mask(self, train_loader: DataLoader | None) -> Tensor:
        """Ones on the named modules' parameter entries."""
        modules = dict(self.model.named_modules())
        _missing(self.module_names, list(modules), "module")
        for name in self.module_names:
            if any(True for _ in modules[name].children()):
                raise ValueError(f"module {name!r} has children; name its leaf modules instead.")
            if not any(p.requires_grad for p in modules[name].parameters()):
                raise ValueError(f"module {name!r} has no trainable parameters.")
        return _mask(
            self.model, {id(p) for n in self.module_names for p in modules[n].parameters()}
        )


class LastLayerSubnetMask(ModuleNameSubnetMask):
    """The last linear layer's parameters; ``last_layer_name`` None: found on ``select``."""

    def __init__(self, model: nn.Module, last_layer_name: str | None = None) -> None:
        super().__init__(model, [])
        self._feature_extractor = FeatureExtractor(model, last_layer_name=last_layer_name)

    @property
    def last_layer_name(self) -> str | None:
        """Name of the last layer (None until it is found)."""
        return self._feature_extractor.last_layer_name

    def get_subnet_mask(self, train_loader: DataLoader | None) -> Tensor:
        """Ones on the last layer's entries."""
        extractor = self._feature_extractor
        if extractor.last_layer is None:
            X = next(iter(_require_loader(train_loader)))[0]
            device = next(self.model.parameters()).device
            with torch.no_grad():
                extractor.find_last_layer(X[:1].to(device))
        self.module_names = [extractor.last_layer_name]
        return super().get_subnet_mask(train_loader)
