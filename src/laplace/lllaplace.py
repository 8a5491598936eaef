r"""Last-layer Laplace: a Gaussian posterior over the linear head ``f = W φ(x) + b`` only.

The network is wrapped in a [`FeatureExtractor`][laplace.utils.feature_extractor.FeatureExtractor]
(``la.model``); the body ``φ`` stays at its trained weights. Because the head is linear, the
curvature, the marginal likelihood and the GLM predictive have closed forms in the features
(``laplace.structures.last_layer``); backends with their own curvature routes (ASDL, BackPACK,
the exact Hessian, Monte-Carlo Fisher) are used as they are.

Unlike laplace-torch 0.3, the model is not deep-copied (the wrapper never modifies it) and
``fit(override=False)`` accumulates like the all-weights classes do.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from laplace.core.base_laplace import BaseLaplace, arguments_for
from laplace.core.passes.eigenvalue_correction import EigenvalueCorrectedHeadSum
from laplace.core.passes.head_curvature_sum import HeadCurvatureSum
from laplace.core.serialization import StateDict, check_state_dict
from laplace.core.subsets import LastLayer, extractor_property
from laplace.curvature import CurvatureInterface
from laplace.functional import FunctionalLLLaplace
from laplace.parametric.diag_laplace import DiagLaplace
from laplace.parametric.full_laplace import FullLaplace
from laplace.parametric.kron_laplace import EKFACLaplace, KronLaplace
from laplace.parametric.parametric_laplace import ParametricLaplace
from laplace.structures.large_output import OUTPUT_FACTOR_RANK
from laplace.utils.data import Inputs, move_inputs
from laplace.utils.enums import HessianStructure, Likelihood, SubsetOfWeights
from laplace.utils.errors import check_positive_int
from laplace.utils.feature_extractor import FeatureExtractor, FeatureReduction
from laplace.utils.outputs import IGNORE_INDEX
from laplace.utils.public import at_public_path

__all__ = [
    "DiagLLLaplace",
    "EKFACLLLaplace",
    "FeatureExtractor",
    "FeatureReduction",
    "FullLLLaplace",
    "FunctionalLLLaplace",
    "KronLLLaplace",
    "LLLaplace",
]


class LLLaplace(ParametricLaplace):
    """Base of the last-layer Laplace approximations; subclasses choose the structure.

    ``mean``, ``n_params``, ``prior_precision`` and ``H`` refer to the last layer (an
    ``nn.Linear``) only. When ``last_layer_name`` is None the layer is found on the first batch
    of ``fit``; until then ``n_params``, ``n_layers``, ``mean`` and ``H`` are None (as in
    laplace-torch). Arguments not listed below are those of
    [`BaseLaplace`][laplace.core.base_laplace.BaseLaplace].

    Args:
        model: The trained network, ending in a linear layer.
        likelihood: ``"classification"``, ``"regression"`` or ``"reward_modeling"``.
        feature_reduction: ``"pick_first"``, ``"pick_last"`` or ``"average"`` for last-layer
            inputs of shape (B, ..., D), see ``FeatureExtractor``.
        backend: The default GGN and the empirical Fisher use the closed forms.
        last_layer_name: Name of the last layer in ``model.named_modules()``.
        asdl_fisher_kwargs: Not supported for last-layer Laplace (must be None).

    Raises:
        ValueError: For ``asdl_fisher_kwargs``, or a ``last_layer_name`` that is not a linear
            layer of the model.
    """

    _abstract = "use FullLLLaplace, KronLLLaplace or DiagLLLaplace."
    _curvature_pass = HeadCurvatureSum
    _subset_kind = LastLayer
    model: FeatureExtractor
    #: Rank kept of a structured output factor above the large-output threshold (kron only).
    output_factor_rank: int | None = None

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        sigma_noise: float | Tensor = 1.0,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        feature_reduction: FeatureReduction | str | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: type[CurvatureInterface] | None = None,
        last_layer_name: str | None = None,
        backend_kwargs: Mapping[str, object] | None = None,
        asdl_fisher_kwargs: Mapping[str, object] | None = None,
        class_dim: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        dtype: torch.dtype | None = None,
    ) -> None:
        if asdl_fisher_kwargs is not None:
            raise ValueError("last-layer Laplace does not support asdl_fisher_kwargs.")
        self._subset_options = {
            "last_layer_name": last_layer_name,
            "feature_reduction": feature_reduction,
        }
        BaseLaplace.__init__(self, **arguments_for(BaseLaplace.__init__, locals()))

    @property
    def backend(self) -> CurvatureInterface | type[CurvatureInterface]:
        """The curvature backend over the last layer; its class while the layer is not known.

        Before ``fit`` finds the last layer there is no model for a backend instance yet, so the
        class the approximation was built with is returned (code that rebuilds an approximation
        from its attributes passes it on as ``backend=``). laplace-torch raises here instead.
        """
        if not self._subset.resolved:
            return self._backend_cls
        return ParametricLaplace.backend.fget(self)

    # ----------------------------------------------------------------------- the last layer
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

    # --------------------------------------------------------------------------- predictive
    def functional_variance_fast(self, X: Inputs) -> tuple[Tensor, Tensor]:
        """Output means (B, C) and variances (B, C) of the GLM predictive, from the features.

        Args:
            X: Test inputs, or a dict-like batch.
        """
        self._check_fitted("functional_variance_fast")
        f_mu, f_var = self._functional_moments(move_inputs(X, self._device))
        layout = self._likelihood_model.layout(f_mu.shape)
        variances = f_var if f_var.dim() == 2 else f_var.diagonal(dim1=-2, dim2=-1)
        return f_mu, layout.restore(variances)

    # -------------------------------------------------------------------------------- state
    def state_dict(self) -> StateDict:
        """See ``ParametricLaplace.state_dict``; adds the layer name."""
        state = super().state_dict()
        state["last_layer_name"] = self.model.last_layer_name
        return state

    def load_state_dict(self, state_dict: StateDict) -> None:
        """See ``ParametricLaplace.load_state_dict``.

        Raises:
            ValueError: If the state was saved for another last layer.
        """
        check_state_dict(state_dict, ("last_layer_name",), (), ())
        name = state_dict["last_layer_name"]
        if not self._subset.resolved:
            self.model.set_last_layer(name)
            self._on_resolved()
        elif self.model.last_layer_name != name:
            raise ValueError(
                f"state_dict was saved for the last layer {name!r}, this approximation uses "
                f"{self.model.last_layer_name!r}."
            )
        super().load_state_dict(state_dict)


class FullLLLaplace(LLLaplace, FullLaplace):
    """Last-layer Laplace with a dense (P, P) curvature of the head."""

    _key = (SubsetOfWeights.LAST_LAYER, HessianStructure.FULL)


class DiagLLLaplace(LLLaplace, DiagLaplace):
    """Last-layer Laplace with a diagonal curvature of the head."""

    _key = (SubsetOfWeights.LAST_LAYER, HessianStructure.DIAG)


class KronLLLaplace(LLLaplace, KronLaplace):
    """Last-layer Laplace with a Kronecker-factored (KFAC) curvature of the head.

    Above ``LARGE_OUTPUT_THRESHOLD`` outputs the output-side
    factor ``G = Σₙ Λₙ`` is never a dense C × C matrix but ``diag(Σ p) − U Uᵀ`` (softmax), ``U``
    the top ``output_factor_rank`` singular directions of ``P = [p₁ … p_N]`` (exact while the data
    give no more rank; beyond, ``G`` is over-estimated by a PSD part of trace
    ``H_facs.kfacs[0][0].dropped``); the posterior and GLM variances go through that structure (see
    ``laplace.structures.large_output``).

    Args:
        damping: Mix the prior into each Kronecker factor (see ``KronLaplace``).
        output_factor_rank: Largest rank of the low-rank term of the output factor above the
            large-output threshold (default
            ``OUTPUT_FACTOR_RANK``); a marginal-likelihood
            step costs O(D·C·k²) for D features, C outputs, rank k. The other arguments are those
            of [`LLLaplace`][laplace.LLLaplace].

    Raises:
        ValueError: For an ``output_factor_rank`` that is not a positive integer.
    """

    _key = (SubsetOfWeights.LAST_LAYER, HessianStructure.KRON)

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        sigma_noise: float | Tensor = 1.0,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        feature_reduction: FeatureReduction | str | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: type[CurvatureInterface] | None = None,
        last_layer_name: str | None = None,
        damping: bool = False,
        backend_kwargs: Mapping[str, object] | None = None,
        asdl_fisher_kwargs: Mapping[str, object] | None = None,
        class_dim: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        output_factor_rank: int = OUTPUT_FACTOR_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.damping = damping
        self.output_factor_rank = check_positive_int(output_factor_rank, "output_factor_rank")
        LLLaplace.__init__(self, **arguments_for(LLLaplace.__init__, locals()))


class EKFACLLLaplace(KronLLLaplace, EKFACLaplace):
    """Last-layer Laplace with an eigenvalue-corrected KFAC (EKFAC) curvature of the head.

    The head's KFAC factors from its features (as ``KronLLLaplace``), then its eigenvalues
    re-fitted in their eigenbasis to the head's exact curvature, in closed form from the kept
    features and output curvatures (see
    [`EKFACLaplace`][laplace.parametric.kron_laplace.EKFACLaplace]). Arguments are those of
    [`KronLLLaplace`][laplace.KronLLLaplace]; a head with more outputs than the large-output
    threshold is refused (its output factor would not be dense).
    """

    _key = (SubsetOfWeights.LAST_LAYER, HessianStructure.EKFAC)

    _curvature_pass = EigenvalueCorrectedHeadSum


at_public_path(__name__, FunctionalLLLaplace)
