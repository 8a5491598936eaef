r"""Subset-of-data GP Laplace over the last layer: ``FunctionalLLLaplace``.

Internal module; the public path is [`laplace.lllaplace`][laplace.lllaplace].
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from laplace.core.base_laplace import arguments_for
from laplace.core.serialization import StateDict
from laplace.core.subsets import LastLayer, extractor_property
from laplace.curvature import CurvatureInterface
from laplace.functional.sod import FunctionalLaplace, SubsetGPState
from laplace.utils.enums import HessianStructure, Likelihood, SubsetOfWeights
from laplace.utils.feature_extractor import FeatureExtractor, FeatureReduction

__all__ = ["FunctionalLLLaplace"]


class LastLayerGPState(SubsetGPState["FunctionalLLLaplace"]):
    """The state of a last-layer GP Laplace: the subset-of-data GP's and the layer's name."""

    def value_keys(self, la: FunctionalLLLaplace) -> tuple[str, ...]:
        """The GP's entries and ``last_layer_name``."""
        return (*super().value_keys(la), "last_layer_name")

    def values(self, la: FunctionalLLLaplace) -> StateDict:
        """The GP's state and the name of the last layer."""
        return {**super().values(la), "last_layer_name": la.model.last_layer_name}

    def prepare(self, la: FunctionalLLLaplace, state_dict: StateDict) -> None:
        """Set the saved last layer if it is not known yet, before the mean is compared."""
        if not la._subset.resolved:
            la.model.set_last_layer(state_dict["last_layer_name"])
        la._bind_subset()


class FunctionalLLLaplace(FunctionalLaplace):
    """Subset-of-data GP Laplace over the last (linear) layer only.

    The kernel is ``J Jᵀ/δ`` with the head Jacobians ``Jₙ = [I_C ⊗ φₙᵀ, I_C]`` of the features
    ``φ`` (the body of the network is a fixed feature extractor), factored as the inputs ``φ``
    and output gradients ``I_C`` of the head (see ``laplace.functional.ntk``). See
    [`FunctionalLaplace`][laplace.FunctionalLaplace] for the GP and the other arguments.

    Args:
        feature_reduction: See ``FeatureExtractor``.
        last_layer_name: Name of the last layer; found on the first batch of ``fit`` when
            None.
    """

    _key = (SubsetOfWeights.LAST_LAYER, HessianStructure.GP)
    _subset_kind = LastLayer
    _state_format = LastLayerGPState()
    model: FeatureExtractor
    last_layer_name = extractor_property(
        "last_layer_name", "Name of the last layer in the model (None until it is found)."
    )
    feature_reduction = extractor_property(
        "feature_reduction", "How features (B, ..., D) are reduced to (B, D) (FeatureExtractor)."
    )
    enable_backprop = extractor_property(
        "enable_backprop",
        "Keep predictives (and features) differentiable w.r.t. the inputs.",
        True,
    )

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
        backend_kwargs: Mapping[str, object] | None = None,
        independent_outputs: bool = False,
        seed: int = 0,
    ) -> None:
        self._subset_options = {
            "last_layer_name": last_layer_name,
            "feature_reduction": feature_reduction,
        }
        super().__init__(**arguments_for(FunctionalLaplace.__init__, locals()))
