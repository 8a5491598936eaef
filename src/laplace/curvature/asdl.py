"""ASDL backends (``asdl`` module of the ``asdfghjkl==0.1a4`` package).

ASDL computes per-sample gradients, the exact / Monte-Carlo / empirical Fisher in full,
diagonal and Kronecker form, and the Hessian, by module hooks on ``nn.Linear``, ``nn.Conv2d``,
``nn.BatchNorm``, ``nn.LayerNorm`` and ``nn.Embedding``. It is the backend laplace-torch advises
for large models with parameter-efficient fine-tuning (frozen weights cost nothing) and for
dict-input (HuggingFace-style) models.

Conventions, as in the rest of the library: the curvature is σ-free and of the library loss
(``½ Σ‖y − f‖²`` or ``Σ CE``), the EF is ``Σ gₙ gₙᵀ`` of that loss's per-sample gradients.
Two ASDL quirks are corrected here: its empirical Fisher squares gradients of the unscaled
squared error (4× ours for regression), and its ``n_mc_samples > 1`` Monte-Carlo Fisher divides
by the sample count twice. Every call leaves the model clean (:mod:`.third_party`).

ASDL detaches the activations it records, so Jacobians that are differentiable w.r.t. the
inputs (``enable_backprop=True``) come from the native engine; use BackPACK for those if you
want them from a third-party library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from asdl.fisher import FisherConfig, get_fisher_maker
from asdl.grad_maker import LOSS_CROSS_ENTROPY, LOSS_MSE
from asdl.gradient import batch_gradient
from asdl.hessian import HessianConfig, HessianMaker
from asdl.matrices import FISHER_EMP, FISHER_EXACT, FISHER_MC, SHAPE_DIAG, SHAPE_FULL, SHAPE_KRON
from torch import Tensor, nn

from laplace.curvature.asdl_support import check_asdl_support, diag_vector, kron_from_asdl, quiet
from laplace.curvature.curvature import CurvatureInterface, EFInterface, GGNInterface
from laplace.curvature.third_party import TargetCall, isolated, target_call
from laplace.data import Inputs, batch_size_of
from laplace.utils.enums import Likelihood
from laplace.utils.matrix import Kron

__all__ = ["AsdlEF", "AsdlGGN", "AsdlHessian", "AsdlInterface"]


class AsdlInterface(CurvatureInterface):
    """Base of the ASDL backends (see :class:`CurvatureInterface` for the arguments).

    Args:
        model: See :class:`CurvatureInterface`.
        likelihood: See :class:`CurvatureInterface`.
        last_layer: See :class:`CurvatureInterface`.
        subnetwork_indices: See :class:`CurvatureInterface`.
        dict_key_x: See :class:`CurvatureInterface`.
        dict_key_y: See :class:`CurvatureInterface`.
        asdl_fisher_kwargs: Extra fields of ASDL's ``FisherConfig`` (e.g. ``n_mc_samples``),
            used by ``diag`` and ``kron``; the keyword arguments of those calls override them.

    Raises:
        ValueError: If a module owning trainable parameters is not one ASDL supports.
    """

    #: ``Laplace(..., asdl_fisher_kwargs=...)`` reaches only backends that set this.
    accepts_asdl_fisher_kwargs = True
    supported_losses = (nn.MSELoss, nn.CrossEntropyLoss)

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        *,
        asdl_fisher_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y)
        self.asdl_fisher_kwargs = dict(asdl_fisher_kwargs or {})
        check_asdl_support(self._model)

    @property
    def loss_type(self) -> str:
        """ASDL's name of the loss: ``"mse"`` or ``"cross_entropy"``."""
        return LOSS_MSE if isinstance(self.lossfunc, nn.MSELoss) else LOSS_CROSS_ENTROPY

    def _targets(self, y: Tensor) -> Tensor:
        """Targets shaped for ``lossfunc`` on (B, C) outputs: (B, C) values or (B,) classes."""
        return y.reshape(len(y), -1) if self.loss_type == LOSS_MSE else y.reshape(-1)

    def _torch_loss(self, f: Tensor, y: Tensor) -> Tensor:
        """``lossfunc`` (unscaled), the loss ASDL differentiates."""
        return self.lossfunc(f, self._targets(y))

    def _select(self, flat: Tensor) -> Tensor:
        """Restrict the last dimension (the parameter vector) to the subnetwork."""
        if self.subnetwork_indices is None:
            return flat
        return flat[..., self.subnetwork_indices.to(flat.device)]

    def _batch_gradients(
        self, target: TargetCall, closure: Callable[[], Tensor]
    ) -> tuple[Tensor, Tensor]:
        """ASDL's per-sample gradients (B, P) of what ``closure`` backpropagates, and its value."""
        batch = batch_size_of(target.inputs, self.dict_key_x)
        with isolated(target.module), quiet():
            grads, value = batch_gradient(
                target.module, closure, return_outputs=True, batch_size=batch
            )
        return self._select(grads), value.detach()

    def jacobians(self, x: Inputs, enable_backprop: bool = False) -> tuple[Tensor, Tensor]:
        """Jacobians by ASDL's per-sample gradients, one backward pass per output.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            enable_backprop: Keep ``Js`` and ``f`` differentiable w.r.t. ``x`` (computed by
                the native engine, since ASDL detaches what it records).

        Returns:
            ``Js`` of shape (B, C, P) and outputs ``f`` of shape (B, C).
        """
        if enable_backprop:
            return super().jacobians(x, enable_backprop=True)
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
        """Per-sample gradients of the library loss by ASDL.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            y: Targets, shape (B, ...).

        Returns:
            ``Gs`` of shape (B, P) and the summed batch loss (a scalar).
        """
        target = target_call(self.model, x, self.last_layer)

        def closure() -> Tensor:
            loss = self.factor * self._torch_loss(target.module(target.inputs), y)
            loss.backward()
            return loss

        return self._batch_gradients(target, closure)

    # ---------------------------------------------------------------------------- Fisher
    @property
    def _fisher_type(self) -> str:
        """ASDL's Fisher type (exact, MC or empirical)."""
        raise NotImplementedError(f"{type(self).__name__} has no ASDL Fisher type.")

    def _fisher_scale(self, config: FisherConfig) -> float:
        """Factor from ASDL's Fisher (run with ``config``) to the library's curvature."""
        return 1.0

    def _fisher(
        self,
        x: Inputs,
        y: Tensor,
        shape: str,
        extract: Callable[[nn.Module, float], Any],
        **kwargs: Any,
    ) -> tuple[Tensor, Any]:
        """Run ASDL's Fisher of one shape and read it off the modules before they are cleaned.

        Args:
            x: Inputs.
            y: Targets.
            shape: ASDL's Fisher shape.
            extract: ``extract(module, scale)`` reads the result, multiplying it by ``scale``
                (from ASDL's Fisher to the library's curvature).
            **kwargs: Extra ``FisherConfig`` fields.

        Returns:
            The summed library loss and what ``extract`` returns.
        """
        kwargs.pop("N", None)
        target = target_call(self.model, x, self.last_layer)
        config = FisherConfig(
            fisher_type=self._fisher_type,
            loss_type=self.loss_type,
            fisher_shapes=[shape],
            data_size=1,
            **{**self._default_fisher_kwargs, **self.asdl_fisher_kwargs, **kwargs},
        )
        with isolated(target.module), quiet():
            maker = get_fisher_maker(target.module, config)
            dummy = maker.setup_model_call(target.module, target.inputs)
            maker.setup_loss_call(self.lossfunc, dummy, self._targets(y))
            f, _ = maker.forward_and_backward()
            result = extract(target.module, self._fisher_scale(config))
        return self.batch_loss(f, y), result

    @property
    def _default_fisher_kwargs(self) -> dict[str, Any]:
        return {}

    def full(self, x: Inputs, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Dense batch curvature by ASDL's full Fisher.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            y: Targets, shape (B, ...).
            **kwargs: Extra ``FisherConfig`` fields (override ``asdl_fisher_kwargs``).

        Returns:
            The summed batch loss and the curvature of shape (P, P).
        """
        loss, H = self._fisher(x, y, SHAPE_FULL, lambda m, scale: scale * m.fisher.data, **kwargs)
        return loss, self._select(self._select(H).T).detach()

    def diag(self, x: Inputs, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Diagonal of the batch curvature by ASDL's diagonal Fisher.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            y: Targets, shape (B, ...).
            **kwargs: Extra ``FisherConfig`` fields (override ``asdl_fisher_kwargs``).

        Returns:
            The summed batch loss and the diagonal of shape (P,).
        """
        loss, h = self._fisher(
            x, y, SHAPE_DIAG, lambda m, scale: scale * diag_vector(m, "fisher"), **kwargs
        )
        return loss, self._select(h).detach()

    def kron(self, x: Inputs, y: Tensor, N: int, **kwargs: Any) -> tuple[Tensor, Kron]:
        """Kronecker-factored batch curvature (KFAC) by ASDL's Kronecker Fisher.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            y: Targets, shape (B, ...).
            N: Number of data points of the whole data set.
            **kwargs: Extra ``FisherConfig`` fields (override ``asdl_fisher_kwargs``).

        Returns:
            The summed batch loss and a :class:`~laplace.utils.matrix.Kron`.

        Raises:
            ValueError: With a subnetwork, which has no Kronecker structure.
        """
        if self.subnetwork_indices is not None:
            raise ValueError("a subnetwork has no Kronecker structure; use diag or full.")

        def extract(module: nn.Module, scale: float) -> Kron:
            return kron_from_asdl(module, N, self.factor, scale)

        return self._fisher(x, y, SHAPE_KRON, extract, **kwargs)


class AsdlGGN(AsdlInterface, GGNInterface):
    """Exact GGN by ASDL (``fisher_exact``), or its Monte-Carlo Fisher with ``stochastic=True``.

    Args:
        model: See :class:`CurvatureInterface`.
        likelihood: See :class:`CurvatureInterface`.
        last_layer: See :class:`CurvatureInterface`.
        subnetwork_indices: See :class:`CurvatureInterface`.
        dict_key_x: See :class:`CurvatureInterface`.
        dict_key_y: See :class:`CurvatureInterface`.
        stochastic: Monte-Carlo Fisher (``fisher_mc``) instead of the exact GGN.
        num_samples: Sampled targets per data point when stochastic (ASDL's ``n_mc_samples``).
        asdl_fisher_kwargs: See :class:`AsdlInterface`.
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
        asdl_fisher_kwargs: dict[str, Any] | None = None,
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
    def _fisher_type(self) -> str:
        return FISHER_MC if self.stochastic else FISHER_EXACT

    @property
    def _default_fisher_kwargs(self) -> dict[str, Any]:
        return {"n_mc_samples": self.num_samples} if self.stochastic else {}

    def _fisher_scale(self, config: FisherConfig) -> float:
        # ASDL divides each sample's loss by S before squaring its gradient: undo one 1/S.
        return float(config.n_mc_samples) if self.stochastic else 1.0


class _KeywordSubnetwork(AsdlInterface):
    """:class:`AsdlInterface` with ``subnetwork_indices`` keyword-only.

    The positional arguments are laplace-torch's for ``AsdlEF`` and ``AsdlHessian``, which have
    no ``subnetwork_indices`` (so its subnetwork Laplace cannot use ``AsdlEF``); here the
    curvature is restricted to those entries.
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
        asdl_fisher_kwargs: dict[str, Any] | None = None,
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

    Takes the arguments of :class:`AsdlInterface`, ``subnetwork_indices`` keyword-only.
    """

    @property
    def _fisher_type(self) -> str:
        return FISHER_EMP

    def _fisher_scale(self, config: FisherConfig) -> float:
        # ASDL squares gradients of the unscaled loss: factor² brings them to the library's.
        return self.factor**2


class AsdlHessian(_KeywordSubnetwork):
    """Exact Hessian of the summed library loss by ASDL (full, or its diagonal).

    ASDL forms the Hessian by double backpropagation, one pass per parameter: use it on small
    models or the last layer. It has no Kronecker form. Takes the arguments of
    :class:`AsdlInterface`, ``subnetwork_indices`` keyword-only; ``asdl_fisher_kwargs`` is
    accepted for a uniform interface and unused.
    """

    def _hessian(self, x: Inputs, y: Tensor, shape: str) -> tuple[Tensor, Tensor]:
        target = target_call(self.model, x, self.last_layer)
        maker = HessianMaker(target.module, HessianConfig(hessian_shapes=[shape]))
        with isolated(target.module), quiet():
            dummy = maker.setup_model_call(target.module, target.inputs)
            maker.setup_loss_call(self.lossfunc, dummy, self._targets(y))
            maker.forward_and_backward()
            f = maker.model_output
            if shape == SHAPE_FULL:
                H = self._select(self._select(target.module.hessian.data).T)
            else:
                H = self._select(diag_vector(target.module, "hessian"))
        return self.batch_loss(f, y), (self.factor * H).detach()

    def full(self, x: Inputs, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Dense Hessian of the summed batch loss, shape (P, P), with the loss."""
        return self._hessian(x, y, SHAPE_FULL)

    def diag(self, x: Inputs, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Hessian diagonal of the summed batch loss, shape (P,), with the loss."""
        return self._hessian(x, y, SHAPE_DIAG)

    def kron(self, x: Inputs, y: Tensor, N: int, **kwargs: Any) -> tuple[Tensor, Any]:
        """Not available: the Hessian has no Kronecker factorisation.

        Raises:
            NotImplementedError: Always, naming the backends that give KFAC.
        """
        raise NotImplementedError(
            "AsdlHessian has no Kronecker-factored form; for hessian_structure='kron' use "
            "backend=CurvlinopsGGN, AsdlGGN or BackPackGGN (GGN) or AsdlEF (empirical Fisher)."
        )
