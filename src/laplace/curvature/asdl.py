"""ASDL backends (the ``asdl`` module of the ``asdfghjkl==0.1a4`` package).

As everywhere in the library, the curvature is σ-free and of the library loss; two ASDL
conventions are corrected here (its empirical Fisher squares gradients of the unscaled loss, its
``n_mc_samples > 1`` Monte-Carlo Fisher divides by S twice). Every call leaves the model clean
(``isolated``). See ``docs/backends.md``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from laplace.curvature.curvature import CurvatureInterface, EFInterface, GGNInterface
from laplace.curvature.engine.layer_rules import ModuleCall
from laplace.curvature.registry import check_library
from laplace.curvature.third_party import (
    KroneckerLayersOnly,
    TargetCall,
    check_attribution,
    isolated,
    kron_blocks,
    target_call,
)
from laplace.utils.data import Inputs, batch_size_of
from laplace.utils.enums import Likelihood
from laplace.utils.matrix import Kron

if TYPE_CHECKING:
    from asdl.grad_maker import GradientMaker

__all__ = ["AsdlEF", "AsdlGGN", "AsdlHessian", "AsdlInterface"]

# ASDL's names of its Fisher types, matrix shapes and losses (``asdl.matrices``, ``grad_maker``)
FISHER_EMP, FISHER_EXACT, FISHER_MC = "fisher_emp", "fisher_exact", "fisher_mc"
SHAPE_DIAG, SHAPE_FULL, SHAPE_KRON = "diag", "full", "kron"
LOSS_CROSS_ENTROPY, LOSS_MSE = "cross_entropy", "mse"


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence torch's warning about ASDL's (non-full) module backward hooks."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*non-full backward hook.*")
        yield


def _check_asdl_support(model: nn.Module) -> None:
    """Refuse trainable parameters of modules ASDL has no rules for.

    Raises:
        ValueError: Naming the unsupported module types and the backend to use instead.
    """
    from asdl.core import _supported_module_classes

    unsupported = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))
            and not isinstance(m, _supported_module_classes)
        }
    )
    if unsupported:
        supported = ", ".join(c.__name__ for c in _supported_module_classes)
        raise ValueError(
            f"ASDL cannot differentiate the trainable parameters of {unsupported} (it supports "
            f"{supported}); use backend=CurvlinopsGGN, which handles any module."
        )


def _trainable(module: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """Every trainable parameter's owning submodule and name, in ``module.parameters()`` order."""
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False):
            if p.requires_grad:
                yield sub, name


def _diag_vector(module: nn.Module, attr: str) -> Tensor:
    """The per-parameter diagonals ASDL stored as ``<submodule>.<attr>.diag``, shape (P,).

    Raises:
        ValueError: If ASDL stored nothing for a trainable parameter.
    """
    parts = []
    for sub, name in _trainable(module):
        value = getattr(getattr(getattr(sub, attr, None), "diag", None), name, None)
        if value is None:
            raise ValueError(
                f"ASDL computed no curvature for parameter {name!r} of {type(sub).__name__}; "
                "use backend=CurvlinopsGGN."
            )
        parts.append(value.flatten())
    return torch.cat(parts)


class AsdlInterface(KroneckerLayersOnly, CurvatureInterface):
    """Base of the ASDL backends.

    Takes the arguments of ``CurvatureInterface``, and:

    Args:
        asdl_fisher_kwargs: Extra fields of ASDL's ``FisherConfig`` (e.g. ``n_mc_samples``),
            used by ``full``, ``diag`` and ``kron``; the keyword arguments of those calls
            override them.

    Raises:
        ImportError: If ASDL (the ``asdl`` extra) is not installed, with the install command.
        ValueError: If a module owning trainable parameters is not one ASDL supports.
    """

    #: ``Laplace(..., asdl_fisher_kwargs=...)`` reaches only backends that set this.
    accepts_asdl_fisher_kwargs = True
    supported_losses = (nn.MSELoss, nn.CrossEntropyLoss)
    library = "ASDL"
    #: ASDL's Fisher type of the backend's curvature (None: it has no ASDL Fisher).
    fisher_type: str | None = None

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        *,
        asdl_fisher_kwargs: Mapping[str, object] | None = None,
    ) -> None:
        check_library(type(self).__name__, "asdl", "asdl")
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y)
        self.asdl_fisher_kwargs = dict(asdl_fisher_kwargs or {})
        _check_asdl_support(self._model)

    @property
    def loss_type(self) -> str:
        """ASDL's name of the loss: ``"mse"`` or ``"cross_entropy"``."""
        return LOSS_MSE if isinstance(self.lossfunc, nn.MSELoss) else LOSS_CROSS_ENTROPY

    def _targets(self, y: Tensor) -> Tensor:
        """Targets shaped for ``lossfunc`` on (B, C) outputs: (B, C) values or (B,) classes.

        One-hot integer rows are read as classes (the likelihood's ``loss_targets``).
        """
        if self.loss_type == LOSS_MSE:
            return y.reshape(len(y), -1)
        return self.fit_likelihood.loss_targets(y, y.dtype).reshape(-1)

    def _batch_gradients(
        self, target: TargetCall, closure: Callable[[], Tensor]
    ) -> tuple[Tensor, Tensor]:
        """ASDL's per-sample gradients (B, P) of what ``closure`` backpropagates, and its value."""
        from asdl.gradient import batch_gradient

        batch = batch_size_of(target.inputs, self.dict_key_x)
        with isolated(target.module), _quiet():
            grads, value = batch_gradient(
                target.module, closure, return_outputs=True, batch_size=batch
            )
        return self._select(grads), value.detach()

    def jacobians(self, x: Inputs, enable_backprop: bool = False) -> tuple[Tensor, Tensor]:
        """As ``CurvatureInterface.jacobians``, by ASDL's per-sample gradients per output.

        With ``enable_backprop`` they come from the native engine (ASDL detaches what it records).
        """
        if enable_backprop:
            return super().jacobians(x, enable_backprop=True)
        check_attribution(self, x)
        target = target_call(self.model, x, self.last_layer)
        with torch.no_grad():
            n_out = target.module(target.inputs).shape[-1]
        rows, f = [], None
        for k in range(n_out):

            def closure(k: int = k) -> Tensor:
                out = target.module(target.inputs)
                out[:, k].sum().backward()
                return out

            J_k, f = self._batch_gradients(target, closure)
            rows.append(J_k)
        return torch.stack(rows, dim=1), f

    def gradients(self, x: Inputs, y: Tensor) -> tuple[Tensor, Tensor]:
        """As ``CurvatureInterface.gradients``, by ASDL."""
        check_attribution(self, x)
        target = target_call(self.model, x, self.last_layer)

        def closure() -> Tensor:
            f = target.module(target.inputs)
            loss = self.factor * self.lossfunc(f, self._targets(y))
            loss.backward()
            return loss

        return self._batch_gradients(target, closure)

    def _maker(
        self, module: nn.Module, shape: str, options: dict[str, object]
    ) -> tuple[GradientMaker, str, float]:
        """ASDL's Fisher maker of the backend's curvature in ``shape`` on ``module``.

        Returns:
            The maker, the attribute ASDL stores its result in, and the factor from ASDL's Fisher
            to the library's curvature.

        Raises:
            NotImplementedError: For a backend without an ASDL Fisher type.
        """
        from asdl.fisher import FisherConfig, get_fisher_maker

        if self.fisher_type is None:
            raise NotImplementedError(f"{type(self).__name__} has no ASDL Fisher type.")
        options.pop("N", None)
        sampled = {"n_mc_samples": self.num_samples} if self.fisher_type == FISHER_MC else {}
        config = FisherConfig(
            fisher_type=self.fisher_type,
            loss_type=self.loss_type,
            fisher_shapes=[shape],
            data_size=1,
            **{**sampled, **self.asdl_fisher_kwargs, **options},
        )
        # ASDL divides each sampled loss by S before squaring its gradient (undo one 1/S), and
        # its EF squares gradients of the unscaled loss (factor² brings them to the library's).
        scale = {FISHER_MC: float(config.n_mc_samples), FISHER_EMP: self.factor**2}
        return get_fisher_maker(module, config), "fisher", scale.get(self.fisher_type, 1.0)

    def _curvature(
        self, x: Inputs, y: Tensor, shape: str, n_data: int = 1, **options: object
    ) -> tuple[Tensor, Tensor | Kron]:
        """Run ASDL's curvature of one shape and read it off the modules before they are cleaned.

        ``shape`` is ASDL's: the dense matrix (P, P), the diagonal (P,) (both restricted to the
        subnetwork) or the ``Kron`` of a data set of ``n_data`` points; ``options`` are extra
        ``FisherConfig`` fields.
        """
        per_sample = self.fisher_type is not None and shape != SHAPE_KRON
        check_attribution(self, x, positions_as_points if per_sample else None)
        target = target_call(self.model, x, self.last_layer)
        with isolated(target.module), _quiet():
            maker, attr, scale = self._maker(target.module, shape, options)
            dummy = maker.setup_model_call(target.module, target.inputs)
            maker.setup_loss_call(self.lossfunc, dummy, self._targets(y))
            maker.forward_and_backward()
            if shape == SHAPE_KRON:  # ASDL's factors B (outputs) and A (inputs), batch sums
                factors = [(sub.fisher.kron, name) for sub, name in _trainable(target.module)]
                blocks = [(scale * F.B, F.A if name == "weight" else None) for F, name in factors]
                result = kron_blocks(blocks, n_data, self.factor)
            elif shape == SHAPE_FULL:
                H = getattr(target.module, attr).data
                result = self._select(self._select(scale * H).T).detach()
            else:
                result = self._select(scale * _diag_vector(target.module, attr)).detach()
        return self.batch_loss(maker.model_output, y), result

    def full(self, x: Inputs, y: Tensor, **kwargs: object) -> tuple[Tensor, Tensor]:
        """As ``CurvatureInterface.full``, by ASDL (its Fisher; AsdlHessian: the Hessian).

        Keyword arguments are extra ``FisherConfig`` fields (they override ``asdl_fisher_kwargs``).
        """
        loss, H = self._curvature(x, y, SHAPE_FULL, **kwargs)
        return loss, cast(Tensor, H)  # the dense shape's

    def diag(self, x: Inputs, y: Tensor, **kwargs: object) -> tuple[Tensor, Tensor]:
        """As ``CurvatureInterface.diag``, by ASDL (the diagonal of ``full``'s matrix).

        Keyword arguments are extra ``FisherConfig`` fields (they override ``asdl_fisher_kwargs``).
        """
        loss, h = self._curvature(x, y, SHAPE_DIAG, **kwargs)
        return loss, cast(Tensor, h)  # the diagonal shape's

    def kron(self, x: Inputs, y: Tensor, N: int, **kwargs: object) -> tuple[Tensor, Kron]:
        """As ``CurvatureInterface.kron``, by ASDL's Kronecker-factored Fisher.

        Keyword arguments are extra ``FisherConfig`` fields (they override ``asdl_fisher_kwargs``).

        Raises:
            ValueError: For a subnetwork or a layer ASDL cannot factor (before any work).
        """
        self.kron_shapes()  # refuses a subnetwork and layers ASDL cannot factor
        loss, H = self._curvature(x, y, SHAPE_KRON, N, **kwargs)
        return loss, cast(Kron, H)  # the Kronecker shape's


def positions_as_points(call: ModuleCall) -> str | None:
    """Why ASDL's Fisher misreads a call whose inputs have positions, or None.

    ASDL's diagonal and full Fisher (exact, Monte-Carlo, empirical) take every row of a Linear,
    LayerNorm or Embedding input as a data point of its own, so a sequence's positions each
    get a per-sample gradient, squared apart instead of summed first: silently wrong for
    any input with positions (its Kronecker factors sum positions as KFAC's expand does, and
    its per-sample gradients, Jacobians and Hessian are exact).
    """
    m, a = call.module, call.args[0] if call.args else None
    if not isinstance(a, Tensor):
        return None
    if isinstance(m, nn.Linear):
        points = 2
    elif isinstance(m, nn.Embedding):
        points = 1
    elif isinstance(m, nn.LayerNorm):
        points = 1 + len(m.normalized_shape)
    else:
        return None
    if a.dim() <= points:
        return None
    return (
        f"takes inputs of shape {tuple(a.shape)}, whose positions ASDL's diagonal and full "
        "Fisher take as data points of their own (hessian_structure='kron' with ASDL sums "
        "them)"
    )


class AsdlGGN(AsdlInterface, GGNInterface):
    """Exact GGN by ASDL (``fisher_exact``), or its Monte-Carlo Fisher with ``stochastic=True``.

    Takes the arguments of ``CurvatureInterface``, and:

    Args:
        stochastic: Monte-Carlo Fisher (``fisher_mc``) instead of the exact GGN.
        num_samples: Sampled targets per data point when stochastic (ASDL's ``n_mc_samples``).
        asdl_fisher_kwargs: See [`AsdlInterface`][laplace.curvature.asdl.AsdlInterface].
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        stochastic: bool = False,
        num_samples: int = 1,
        *,
        asdl_fisher_kwargs: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(
            model,
            likelihood,
            last_layer,
            subnetwork_indices,
            dict_key_x,
            dict_key_y,
            asdl_fisher_kwargs=asdl_fisher_kwargs,
        )
        self.stochastic = stochastic
        self.num_samples = num_samples

    @property
    def fisher_type(self) -> str:  # type: ignore[override]
        """``fisher_mc`` when ``stochastic``, else ``fisher_exact``."""
        return FISHER_MC if self.stochastic else FISHER_EXACT


class _KeywordSubnetwork(AsdlInterface):
    """``AsdlInterface`` with ``subnetwork_indices`` keyword-only.

    laplace-torch's ``AsdlEF`` and ``AsdlHessian`` take no ``subnetwork_indices``; here the
    curvature is restricted to those entries when given.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        last_layer: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        *,
        subnetwork_indices: torch.LongTensor | None = None,
        asdl_fisher_kwargs: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(
            model,
            likelihood,
            last_layer,
            subnetwork_indices,
            dict_key_x,
            dict_key_y,
            asdl_fisher_kwargs=asdl_fisher_kwargs,
        )


class AsdlEF(_KeywordSubnetwork, EFInterface):
    """Empirical Fisher by ASDL (``fisher_emp``), rescaled to the library loss.

    Takes the arguments of ``AsdlInterface``, ``subnetwork_indices`` keyword-only.
    """

    fisher_type = FISHER_EMP


class AsdlHessian(_KeywordSubnetwork):
    """Exact Hessian of the summed library loss by ASDL (full, or its diagonal).

    One double backpropagation per parameter: small models or the last layer. Takes the
    arguments of ``AsdlInterface``, ``subnetwork_indices`` keyword-only;
    ``asdl_fisher_kwargs`` is accepted for a uniform interface and unused.
    """

    def _maker(
        self, module: nn.Module, shape: str, options: dict[str, object]
    ) -> tuple[GradientMaker, str, float]:
        """ASDL's Hessian maker (``options`` unused): of ``lossfunc``, 1/factor times ours."""
        from asdl.hessian import HessianConfig, HessianMaker

        return HessianMaker(module, HessianConfig(hessian_shapes=[shape])), "hessian", self.factor

    def kron(self, x: Inputs, y: Tensor, N: int, **kwargs: object) -> tuple[Tensor, Kron]:
        """Not available: the Hessian has no Kronecker factorisation.

        Raises:
            NotImplementedError: Always, naming the backends that give KFAC.
        """
        raise NotImplementedError(
            "AsdlHessian has no Kronecker-factored form; for hessian_structure='kron' use "
            "backend=CurvlinopsGGN, AsdlGGN or BackPackGGN (GGN) or AsdlEF (empirical Fisher)."
        )
