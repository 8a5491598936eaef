r"""Subset-of-data GP Laplace over the last layer: ``FunctionalLLLaplace``.

Internal module; the public path is :mod:`laplace.lllaplace`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.utils.data import DataLoader

from laplace.base import arguments_for
from laplace.curvature import CurvatureInterface
from laplace.data import move_inputs, split_batch
from laplace.functional.sod import FunctionalLaplace
from laplace.last_layer_mixin import LastLayerMixin
from laplace.utils.enums import Likelihood
from laplace.utils.feature_extractor import FeatureReduction

__all__ = ["FunctionalLLLaplace"]


class FunctionalLLLaplace(LastLayerMixin, FunctionalLaplace):
    """Subset-of-data GP Laplace over the last (linear) layer only.

    The kernel is ``J Jᵀ/δ`` with the head Jacobians ``Jₙ = [I_C ⊗ φₙᵀ, I_C]`` of the features
    ``φ`` (the body of the network is a fixed feature extractor), factored as the inputs ``φ``
    and output gradients ``I_C`` of the head (see :mod:`laplace.functional.ntk`). See
    :class:`FunctionalLaplace` for the GP and the other arguments.

    Args:
        feature_reduction: See :class:`~laplace.utils.feature_extractor.FeatureExtractor`.
        last_layer_name: Name of the last layer; found on the first batch of :meth:`fit` when
            None.
    """

    _key = ("last_layer", "gp")

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        n_subset: int,
        sigma_noise: float | Tensor = 1.0,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        feature_reduction: FeatureReduction | str | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        last_layer_name: str | None = None,
        backend: type[CurvatureInterface] | None = None,
        backend_kwargs: dict[str, Any] | None = None,
        independent_outputs: bool = False,
        seed: int = 0,
    ) -> None:
        self._feature_options = (last_layer_name, feature_reduction)
        super().__init__(**arguments_for(FunctionalLaplace.__init__, locals()))

    def _resolve_subset(self, train_loader: DataLoader) -> None:
        if not self._subset.resolved:
            X, _ = split_batch(next(iter(train_loader)), self.dict_key_x, self.dict_key_y)
            X = move_inputs(X, self._device)
            self.model.eval()
            self._subset.resolve(X[:1] if isinstance(X, Tensor) else X)
        self._bind_subset()
        self.prior_mean = self.prior_mean

    def _state_value_keys(self) -> tuple[str, ...]:
        return (*super()._state_value_keys(), "last_layer_name")

    def _state_values(self) -> dict[str, Any]:
        return {**super()._state_values(), "last_layer_name": self.model.last_layer_name}

    def _prepare_state_load(self, state_dict: dict[str, Any]) -> None:
        if not self._subset.resolved:
            self.model.set_last_layer(state_dict["last_layer_name"])
        self._bind_subset()
