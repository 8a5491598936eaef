"""``LastLayerMixin``: the hooks that put a Laplace posterior on the linear head of a model."""

from __future__ import annotations

from typing import Any

from torch import nn

from laplace.subsets import LastLayer
from laplace.utils.feature_extractor import (
    FeatureExtractor,
    FeatureReduction,
    as_feature_extractor,
)

__all__ = ["LastLayerMixin"]


class LastLayerMixin:
    """Hooks of the Laplace classes over the last layer: wrap the model, use its head's weights.

    The class sets ``self._feature_options = (last_layer_name, feature_reduction)`` before
    :class:`~laplace.base.BaseLaplace` builds it; ``la.model`` is then a
    :class:`~laplace.utils.feature_extractor.FeatureExtractor` and the backend works on the
    last layer.
    """

    _feature_options: tuple[str | None, FeatureReduction | str | None]
    model: FeatureExtractor

    def _prepare_model(self, model: nn.Module) -> FeatureExtractor:
        return as_feature_extractor(model, *self._feature_options)

    def _make_subset(self, model: FeatureExtractor) -> LastLayer:
        return LastLayer(model)

    def _backend_options(self, backend_kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**backend_kwargs, "last_layer": True}

    def _transaction_parts(self) -> tuple[Any, ...]:
        # A failed fit forgets a last layer it found (the extractor holds it).
        return (*super()._transaction_parts(), self.model)

    @property
    def last_layer_name(self) -> str | None:
        """Name of the last layer in the model (None until it is found)."""
        return self.model.last_layer_name

    @property
    def feature_reduction(self) -> FeatureReduction | None:
        """How features of shape (B, ..., D) are reduced to (B, D); see ``FeatureExtractor``."""
        return self.model.feature_reduction

    @property
    def enable_backprop(self) -> bool:
        """Keep predictives (and the features) differentiable w.r.t. the inputs."""
        return self.model.enable_backprop

    @enable_backprop.setter
    def enable_backprop(self, value: bool) -> None:
        self.model.enable_backprop = bool(value)
