"""The ``Laplace`` factory: pick the Laplace class for a subset of weights and a structure."""

from __future__ import annotations

from typing import Any, Literal, cast, overload

from torch import nn

from laplace.core.base_laplace import REGISTRY
from laplace.core.subsets import MISSING_SUBNETWORK_INDICES
from laplace.functional import ELLA, FunctionalLaplace, VaLLA
from laplace.likelihoods import check_structure, likelihood_class
from laplace.lllaplace import LLLaplace  # noqa: F401  (registers the last-layer classes)
from laplace.parametric.lowrank_laplace import LowRankLaplace  # noqa: F401  (registers the class)
from laplace.parametric.matfree_laplace import MatFreeLaplace  # noqa: F401  (registers the class)
from laplace.parametric.parametric_laplace import ParametricLaplace
from laplace.subnetlaplace import SubnetLaplace  # noqa: F401  (registers the classes)
from laplace.utils.enums import (
    FunctionalApproximation,
    HessianStructure,
    Likelihood,
    SubsetOfWeights,
)
from laplace.utils.errors import ArgumentTypeError

__all__ = ["REGISTRY", "Laplace"]

S, H = SubsetOfWeights, HessianStructure

#: Function-space approximations other than subset of data (all weights only).
FUNCTIONAL: dict[FunctionalApproximation, type[ELLA] | type[VaLLA]] = {
    FunctionalApproximation.NYSTROM: ELLA,
    FunctionalApproximation.VARIATIONAL: VaLLA,
}

#: ``hessian_structure`` values that give a weight-space (parametric) approximation.
WeightSpaceStructure = Literal[
    "full",
    "kron",
    "diag",
    "lowrank",
    "ekfac",
    "diag_lowrank",
    "matfree",
    HessianStructure.FULL,
    HessianStructure.KRON,
    HessianStructure.DIAG,
    HessianStructure.LOWRANK,
    HessianStructure.EKFAC,
    HessianStructure.DIAG_LOWRANK,
    HessianStructure.MATFREE,
]
#: ``hessian_structure`` values that give a function-space approximation.
FunctionSpaceStructure = Literal["gp", HessianStructure.GP]
#: What ``hessian_structure="gp"`` gives: a function-space approximation that can be fitted.
FunctionSpaceLaplace = FunctionalLaplace | ELLA | VaLLA


@overload
def Laplace(
    model: nn.Module,
    likelihood: Likelihood | str,
    subset_of_weights: SubsetOfWeights | str = ...,
    hessian_structure: WeightSpaceStructure = ...,
    *args: Any,
    functional_approximation: FunctionalApproximation | str = ...,
    **kwargs: Any,
) -> ParametricLaplace: ...


@overload
def Laplace(
    model: nn.Module,
    likelihood: Likelihood | str,
    subset_of_weights: SubsetOfWeights | str,
    hessian_structure: FunctionSpaceStructure,
    *args: Any,
    functional_approximation: FunctionalApproximation | str = ...,
    **kwargs: Any,
) -> FunctionSpaceLaplace: ...


@overload
def Laplace(
    model: nn.Module,
    likelihood: Likelihood | str,
    subset_of_weights: SubsetOfWeights | str = ...,
    *,
    hessian_structure: FunctionSpaceStructure,
    functional_approximation: FunctionalApproximation | str = ...,
    **kwargs: Any,
) -> FunctionSpaceLaplace: ...


@overload
def Laplace(
    model: nn.Module,
    likelihood: Likelihood | str,
    subset_of_weights: SubsetOfWeights | str = ...,
    hessian_structure: HessianStructure | str = ...,
    *args: Any,
    functional_approximation: FunctionalApproximation | str = ...,
    **kwargs: Any,
) -> ParametricLaplace | FunctionSpaceLaplace: ...


def Laplace(
    model: nn.Module,
    likelihood: Likelihood | str,
    subset_of_weights: SubsetOfWeights | str = SubsetOfWeights.LAST_LAYER,
    hessian_structure: HessianStructure | str = HessianStructure.KRON,
    *args: Any,
    functional_approximation: FunctionalApproximation | str = FunctionalApproximation.SOD,
    **kwargs: Any,
) -> ParametricLaplace | FunctionSpaceLaplace:
    """Build the Laplace approximation for a subset of weights and a curvature structure.

    Args:
        model: The trained network.
        likelihood: ``"classification"``, ``"regression"``, ``"reward_modeling"``,
            ``"binary_classification"``, ``"heteroscedastic_regression"``, or an instance of a
            ``laplace.likelihoods.Likelihood`` subclass (your own).
        subset_of_weights: ``"all"``, ``"last_layer"`` or ``"subnetwork"``.
        hessian_structure: ``"full"``, ``"kron"``, ``"diag"``, ``"lowrank"``, ``"gp"``, and
            beyond laplace-torch ``"ekfac"``, ``"diag_lowrank"`` and ``"matfree"``.
        *args: Passed on to the chosen class.
        functional_approximation: With ``hessian_structure="gp"``: ``"sod"`` (subset of data,
            ``FunctionalLaplace`` / ``FunctionalLLLaplace``, needs ``n_subset``),
            ``"nystrom"`` (ELLA) or ``"variational"`` (VaLLA), both over all weights only.
        **kwargs: Passed on to the chosen class.

    Returns:
        An instance of the chosen Laplace class. For type checkers: a
        ``ParametricLaplace`` for the weight-space structures, a function-space class
        (``FunctionalLaplace``, ``ELLA`` or ``VaLLA``) for ``"gp"``.

    Raises:
        ValueError: For unknown options or a combination no Laplace class supports.
        TypeError: For ``subset_of_weights="subnetwork"`` without ``subnetwork_indices`` (a
            required argument of the subnetwork classes); also a ``ValueError``.
        NotImplementedError: For a supported combination that a later release adds.
    """
    likelihood_class(likelihood)  # an unknown likelihood is refused first
    subset = SubsetOfWeights(subset_of_weights)
    structure = HessianStructure(hessian_structure)
    approximation = FunctionalApproximation(functional_approximation)
    key = (subset, structure)
    if approximation != FunctionalApproximation.SOD:
        if structure != H.GP:
            raise ValueError(
                f"functional_approximation={approximation.value!r} requires "
                "hessian_structure='gp'."
            )
        if subset != S.ALL:
            raise ValueError(
                f"functional_approximation={approximation.value!r} needs subset_of_weights='all'."
            )
        return FUNCTIONAL[approximation](model, likelihood, *args, **kwargs)
    if key not in REGISTRY:
        valid = sorted(h.value for s, h in REGISTRY if s == subset)
        raise ValueError(
            f"subset_of_weights={subset.value!r} does not support "
            f"hessian_structure={structure.value!r}; valid structures for this subset: "
            f"{', '.join(valid)}."
        )
    check_structure(likelihood, structure)
    if subset == S.SUBNETWORK and not args and "subnetwork_indices" not in kwargs:
        raise ArgumentTypeError(MISSING_SUBNETWORK_INDICES)
    laplace = REGISTRY[key](model, likelihood, *args, **kwargs)
    return cast(ParametricLaplace | FunctionSpaceLaplace, laplace)
