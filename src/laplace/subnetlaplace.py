r"""Subnetwork Laplace: a Gaussian posterior over chosen entries of the weight vector.

Daxberger et al., *Bayesian Deep Learning via Subnetwork Inference*, ICML 2021. With
``θ_S = θ[indices]`` the K chosen entries of the flattened trainable parameters θ (P entries)
and the others fixed at the MAP, ``P_S = H_S / (σ² T) + diag(p₀)`` with ``H_S`` the (K, K) block
of the curvature, computed for the selected columns only. ``la.mean`` is the full MAP vector
(P,), ``la.mean_subnet`` its subnetwork part (K,), and ``sample`` returns full vectors (S, P).

Example:
    >>> from laplace.utils import LargestMagnitudeSubnetMask
    >>> indices = LargestMagnitudeSubnetMask(model, n_params_subnet=128).select()
    >>> la = Laplace(model, "classification", subset_of_weights="subnetwork",
    ...              hessian_structure="full", subnetwork_indices=indices)
    >>> la.fit(train_loader)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor, nn

from laplace.core.base_laplace import BaseLaplace, arguments_for
from laplace.core.priors import prior_weighted_sum
from laplace.core.serialization import StateDict, check_state_dict
from laplace.core.subsets import Subnetwork
from laplace.curvature import CurvatureInterface, EFInterface, GGNInterface
from laplace.parametric.diag_laplace import DiagLaplace
from laplace.parametric.full_laplace import FullLaplace
from laplace.parametric.parametric_laplace import ParametricLaplace
from laplace.utils.enums import HessianStructure, Likelihood, PriorStructure, SubsetOfWeights
from laplace.utils.outputs import IGNORE_INDEX

__all__ = ["DiagSubnetLaplace", "FullSubnetLaplace", "SubnetLaplace"]


class SubnetLaplace(ParametricLaplace):
    """Base of the subnetwork Laplace approximations; subclasses choose the structure.

    Arguments not listed are those of [`BaseLaplace`][laplace.core.base_laplace.BaseLaplace];
    ``enable_backprop``, ``dict_key_x``, ``dict_key_y``, ``class_dim`` and ``ignore_index`` are
    keyword only (laplace-torch's subnetwork Laplace has none of them).

    Args:
        likelihood: ``"classification"`` or ``"regression"``.
        subnetwork_indices: 1-D ``torch.long`` tensor of K distinct indices into the flattened
            trainable parameters (``model.named_parameters()`` order), e.g. from a
            [`SubnetMask`][laplace.utils.subnetmask.SubnetMask].
        prior_precision: A scalar or one value per subnetwork entry (K,).
        prior_mean: A scalar or one value per subnetwork entry (K,).
        backend: A GGN or empirical-Fisher backend (default ``CurvlinopsGGN``).
        asdl_fisher_kwargs: Not supported (must be None).

    Raises:
        TypeError: Without ``subnetwork_indices`` (None raises an error that is a
            ``TypeError`` and a ``ValueError``).
        ValueError: For invalid indices, a backend that is neither GGN nor EF, or
            ``asdl_fisher_kwargs``.
    """

    _abstract = "use FullSubnetLaplace or DiagSubnetLaplace."
    _subset_kind = Subnetwork
    _refused_prior_structures: ClassVar[dict[PriorStructure, str]] = {
        PriorStructure.LAYERWISE: "subnetwork Laplace supports prior_structure='scalar' or "
        "'diag' (one value per subnetwork entry), not 'layerwise'."
    }

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        subnetwork_indices: torch.LongTensor,
        sigma_noise: float | Tensor = 1.0,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        backend: type[CurvatureInterface] | None = None,
        backend_kwargs: Mapping[str, object] | None = None,
        asdl_fisher_kwargs: Mapping[str, object] | None = None,
        *,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        class_dim: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        dtype: torch.dtype | None = None,
    ) -> None:
        if asdl_fisher_kwargs is not None:
            raise ValueError("subnetwork Laplace does not support asdl_fisher_kwargs.")
        if backend is not None and not issubclass(
            backend if isinstance(backend, type) else type(backend), (GGNInterface, EFInterface)
        ):
            raise ValueError(
                "subnetwork Laplace needs a GGN or empirical-Fisher backend (e.g. CurvlinopsGGN, "
                f"CurvlinopsEF, AsdlGGN, AsdlEF, BackPackGGN), got {backend!r}."
            )
        self._subset_options = {"indices": subnetwork_indices}
        BaseLaplace.__init__(self, **arguments_for(BaseLaplace.__init__, locals()))

    @property
    def subnetwork_indices(self) -> torch.LongTensor:
        """Indices (K,) of the subnetwork in the flattened trainable parameters."""
        return self._subset.indices

    @property
    def n_params_subnet(self) -> int:
        """Number K of parameters in the subnetwork."""
        return self._subset.n_subnet

    @property
    def mean_subnet(self) -> Tensor:
        """MAP values of the subnetwork, shape (K,)."""
        return self._subset.select(self.mean)

    # ------------------------------------------------------------------------------ prior
    @property
    def scatter(self) -> Tensor:
        """``(θ*_S − μ₀)ᵀ diag(p₀) (θ*_S − μ₀)`` over the subnetwork."""
        delta = self.mean_subnet - self.prior_mean
        return prior_weighted_sum(self.prior_precision, delta.square(), [self.n_params_subnet])

    # ------------------------------------------------------------------- samples and values
    def assemble_full_samples(self, subnet_samples: Tensor) -> Tensor:
        """Full weight vectors (S, P) from subnetwork values (S, K); other entries at the MAP."""
        return self._subset.assemble(self.mean, subnet_samples)

    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """Draw full weight vectors, shape (n_samples, P).

        The subnetwork entries come from its posterior, every other entry is the MAP.
        """
        deviations = self._sample_deviations(n_samples, generator)
        return self.assemble_full_samples(self.mean_subnet + deviations)

    def square_norm(self, value: Tensor) -> Tensor:
        """``(θ_S − θ*_S)ᵀ P_S (θ_S − θ*_S)`` for subnetwork values (K,) or full vectors (P,)."""
        if value.shape[-1] == self.n_params and self.n_params != self.n_params_subnet:
            value = self._subset.select(value)
        return self._posterior.square_form(value - self.mean_subnet)

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> StateDict:
        """See ``ParametricLaplace.state_dict``; adds the indices."""
        state = super().state_dict()
        state["subnetwork_indices"] = self._subset.indices.detach().cpu()
        return state

    def load_state_dict(self, state_dict: StateDict) -> None:
        """See ``ParametricLaplace.load_state_dict``.

        Raises:
            ValueError: If the state was saved for other subnetwork indices.
        """
        check_state_dict(state_dict, ("subnetwork_indices",), (), ())
        saved = state_dict["subnetwork_indices"]
        if not isinstance(saved, Tensor) or not torch.equal(
            saved.cpu(), self._subset.indices.cpu()
        ):
            raise ValueError(
                "state_dict was saved for other subnetwork_indices than this approximation's "
                "(or is not a subnetwork Laplace state)."
            )
        super().load_state_dict(state_dict)


class FullSubnetLaplace(SubnetLaplace, FullLaplace):
    """Subnetwork Laplace with a dense (K, K) curvature and posterior precision."""

    _key = (SubsetOfWeights.SUBNETWORK, HessianStructure.FULL)


class DiagSubnetLaplace(SubnetLaplace, DiagLaplace):
    """Subnetwork Laplace with a diagonal (K,) curvature and posterior precision."""

    _key = (SubsetOfWeights.SUBNETWORK, HessianStructure.DIAG)
