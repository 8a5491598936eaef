"""BackPACK backends (``backpack-for-pytorch``).

BackPACK extends the backward pass of ``nn.Sequential`` models of standard layers with
per-sample gradients (``BatchGrad``), their squared sum (``SumGradSquared``), the exact and
Monte-Carlo GGN diagonal (``DiagGGNExact``, ``DiagGGNMC``), a symmetric factorisation of the
GGN (``SqrtGGNExact``, ``SqrtGGNMC``, for the dense matrix) and KFLR / KFAC Kronecker factors.
Its per-sample gradients can be built with ``create_graph``, which makes it the backend for
Jacobians that are differentiated further (``enable_backprop=True``, e.g. Bayesian
optimisation).

The hooks are installed only for the duration of each call and everything BackPACK writes onto
modules and parameters is removed afterwards (:mod:`.third_party`), so a model fitted with
BackPACK can later be fitted with ASDL or curvlinops. Dict inputs and second-order quantities of
non-sequential models are refused with the backend to use instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from backpack import backpack, hook_run_extensions, hook_store_io
from backpack.extensions import (
    KFAC,
    KFLR,
    BatchGrad,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
)
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.utils.module_classification import is_no_op
from torch import Tensor, nn

from laplace.curvature.curvature import (
    CurvatureInterface,
    EFInterface,
    GGNInterface,
    check_dict_inputs,
)
from laplace.curvature.kfac import check_kfac_support
from laplace.curvature.third_party import TargetCall, isolated, kron_blocks, target_call
from laplace.data import Inputs
from laplace.likelihoods import LikelihoodModel
from laplace.utils.matrix import Kron

__all__ = ["BackPackEF", "BackPackGGN", "BackPackInterface"]


def _is_chain(module: nn.Module) -> bool:
    """Whether ``module`` is a layer or an ``nn.Sequential`` of chains.

    Chains are what BackPACK's second-order extensions backpropagate through.
    """
    children = list(module.children())
    if not children:
        return True
    return isinstance(module, nn.Sequential) and all(_is_chain(c) for c in children)


@contextmanager
def _extended(*modules: nn.Module) -> Iterator[None]:
    """Install BackPACK's hooks on every layer of ``modules`` for the duration of a block.

    The hooks are BackPACK's I/O-storing forward hook and extension-running backward hook; a
    layer is a module without children.
    """
    with isolated(*modules) as handles:
        for root in modules:
            for module in root.modules():
                if not (is_no_op(module) or any(True for _ in module.children())):
                    handles.append(module.register_forward_hook(hook_store_io))
                    handles.append(module.register_full_backward_hook(hook_run_extensions))
        yield


class BackPackInterface(CurvatureInterface):
    """Base of the BackPACK backends (see :class:`CurvatureInterface` for the arguments)."""

    accepts_dict_inputs = False
    supported_losses = (nn.MSELoss, nn.CrossEntropyLoss, nn.BCEWithLogitsLoss)

    def _target(self, x: Inputs) -> TargetCall:
        check_dict_inputs(type(self), x)
        return target_call(self.model, x, self.last_layer)

    def _require_chain(self, target: TargetCall, quantity: str) -> None:
        if not _is_chain(target.module):
            raise ValueError(
                f"BackPACK computes {quantity} only for nn.Sequential models of standard "
                f"layers, not for {type(target.module).__name__}; use backend=CurvlinopsGGN "
                "or AsdlGGN."
            )

    def _collect(self, module: nn.Module, attr: str, flatten_from: int) -> Tensor:
        """Concatenate the ``attr`` that BackPACK stored on each parameter (in ``params`` order).

        Args:
            module: The module run (for the error message).
            attr: BackPACK's attribute name, e.g. ``"grad_batch"``.
            flatten_from: Leading dimensions to keep (1 for per-sample quantities).

        Returns:
            Shape (*leading, P), restricted to the subnetwork when one is set.
        """
        parts = []
        for p in self.params:
            value = getattr(p, attr, None)
            if value is None:
                raise ValueError(
                    f"BackPACK computed no {attr} for a parameter of {type(module).__name__}: "
                    "one of its layers is not supported; use backend=CurvlinopsGGN."
                )
            parts.append(value.flatten(flatten_from))
        flat = torch.cat(parts, dim=-1)
        if self.subnetwork_indices is not None:
            flat = flat[..., self.subnetwork_indices.to(flat.device)]
        return flat

    def jacobians(self, x: Inputs, enable_backprop: bool = False) -> tuple[Tensor, Tensor]:
        """Jacobians by BackPACK's ``BatchGrad``: one forward pass, one backward per output.

        Args:
            x: Inputs, shape (B, ...).
            enable_backprop: Keep ``Js`` and ``f`` differentiable w.r.t. ``x``.

        Returns:
            ``Js`` of shape (B, C, P) and outputs ``f`` of shape (B, C).

        Raises:
            ValueError: For dict-like inputs.
        """
        target = self._target(x)
        input_grad = x.grad if x.is_leaf else None
        rows = []
        with _extended(target.module), torch.enable_grad():
            f = target.module(target.inputs)
            for k in range(f.shape[-1]):
                with backpack(BatchGrad(), retain_graph=True):
                    f[:, k].sum().backward(create_graph=enable_backprop, retain_graph=True)
                rows.append(self._collect(target.module, "grad_batch", 1))
                for p in self.params:
                    p.grad = None
                    del p.grad_batch
        if x.is_leaf:
            x.grad = input_grad
        Js = torch.stack(rows, dim=1)
        return (Js, f) if enable_backprop else (Js.detach(), f.detach())

    def _first_order(
        self, x: Inputs, y: Tensor, extension: BackpropExtension, attr: str, leading: int
    ) -> tuple[Tensor, Tensor]:
        """Backpropagate the library loss with a first-order extension and collect ``attr``."""
        target = self._target(x)
        with _extended(target.module):
            f = target.module(target.inputs)
            loss = self.factor * self._torch_loss(f, y)
            with backpack(extension):
                loss.backward()
            value = self._collect(target.module, attr, leading)
        return value.detach(), loss.detach()

    def _torch_loss(self, f: Tensor, y: Tensor) -> Tensor:
        """``lossfunc`` (the module BackPACK hooks) with targets shaped like the outputs."""
        likelihood: LikelihoodModel = self.fit_likelihood
        return self.lossfunc(f, likelihood.prepare_targets(f, y))

    def gradients(self, x: Inputs, y: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample gradients of the library loss by BackPACK's ``BatchGrad``.

        Args:
            x: Inputs, shape (B, ...).
            y: Targets, shape (B, ...).

        Returns:
            ``Gs`` of shape (B, P) and the summed batch loss (a scalar).

        Raises:
            ValueError: For dict-like inputs.
        """
        return self._first_order(x, y, BatchGrad(), "grad_batch", 1)

    def _second_order(
        self, x: Inputs, y: Tensor, extension: BackpropExtension, read: Any, quantity: str
    ) -> tuple[Tensor, Any]:
        """Backpropagate ``lossfunc`` with a second-order extension; ``read()`` the result."""
        target = self._target(x)
        self._require_chain(target, quantity)
        with _extended(target.module, self.lossfunc):
            f = target.module(target.inputs)
            if isinstance(self.lossfunc, nn.BCEWithLogitsLoss) and f.shape[-1] != 1:
                raise ValueError(
                    f"BackPACK computes {quantity} of the binary cross-entropy for one output "
                    f"only; the model has {f.shape[-1]} labels: use backend=CurvlinopsGGN."
                )
            loss = self._torch_loss(f, y)
            with backpack(extension):
                loss.backward()
            value = read(target.module)
        return self.factor * loss.detach(), value


class BackPackGGN(BackPackInterface, GGNInterface):
    """Exact GGN by BackPACK, or its Monte-Carlo Fisher with ``stochastic=True``.

    ``diag`` uses ``DiagGGNExact`` / ``DiagGGNMC``, ``full`` the symmetric factorisation
    ``G = Vᵀ V`` of ``SqrtGGNExact`` / ``SqrtGGNMC`` (V of shape (C·B, P), or (S·B, P) with S
    samples), ``kron`` the ``KFLR`` / ``KFAC`` factors.

    Args:
        model: See :class:`CurvatureInterface`.
        likelihood: See :class:`CurvatureInterface`.
        last_layer: See :class:`CurvatureInterface`.
        subnetwork_indices: See :class:`CurvatureInterface`.
        dict_key_x: See :class:`CurvatureInterface`.
        dict_key_y: See :class:`CurvatureInterface`.
        stochastic: Monte-Carlo Fisher instead of the exact GGN.
        num_samples: Sampled targets per data point when stochastic (BackPACK's
            ``mc_samples``).
    """

    def full(self, x: Inputs, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Dense batch GGN ``Vᵀ V`` from BackPACK's GGN square root.

        Args:
            x: Inputs, shape (B, ...).
            y: Targets, shape (B, ...).
            **kwargs: Ignored (accepted for interface compatibility).

        Returns:
            The summed batch loss and the GGN of shape (P, P).

        Raises:
            ValueError: For dict-like inputs or a non-sequential model.
        """
        extension, attr = (
            (SqrtGGNMC(mc_samples=self.num_samples), "sqrt_ggn_mc")
            if self.stochastic
            else (SqrtGGNExact(), "sqrt_ggn_exact")
        )

        def read(module: nn.Module) -> Tensor:
            V = self._collect(module, attr, 2).flatten(0, 1)
            return V.T @ V

        loss, H = self._second_order(x, y, extension, read, "the GGN")
        return loss, (self.factor * H).detach()

    def diag(self, x: Inputs, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Diagonal of the batch GGN by ``DiagGGNExact`` (or ``DiagGGNMC``).

        Args:
            x: Inputs, shape (B, ...).
            y: Targets, shape (B, ...).
            **kwargs: Ignored (accepted for interface compatibility).

        Returns:
            The summed batch loss and the diagonal of shape (P,).

        Raises:
            ValueError: For dict-like inputs or a non-sequential model.
        """
        extension, attr = (
            (DiagGGNMC(mc_samples=self.num_samples), "diag_ggn_mc")
            if self.stochastic
            else (DiagGGNExact(), "diag_ggn_exact")
        )
        loss, h = self._second_order(
            x, y, extension, lambda m: self._collect(m, attr, 0), "the GGN diagonal"
        )
        return loss, (self.factor * h).detach()

    def kron(self, x: Inputs, y: Tensor, N: int, **kwargs: Any) -> tuple[Tensor, Kron]:
        """Kronecker-factored batch GGN by ``KFLR`` (or the MC ``KFAC``).

        Args:
            x: Inputs, shape (B, ...).
            y: Targets, shape (B, ...).
            N: Number of data points of the whole data set.
            **kwargs: Ignored (accepted for interface compatibility).

        Returns:
            The summed batch loss and a :class:`~laplace.utils.matrix.Kron`.

        Raises:
            ValueError: For dict-like inputs, a non-sequential model or a subnetwork.
        """
        if self.subnetwork_indices is not None:
            raise ValueError("a subnetwork has no Kronecker structure; use diag or full.")
        extension, attr = (
            (KFAC(mc_samples=self.num_samples), "kfac") if self.stochastic else (KFLR(), "kflr")
        )
        check_kfac_support(self._model, self.params)

        def read(module: nn.Module) -> Kron:
            # BackPACK's factors: G of the unscaled loss (1/c times ours) summed over the
            # batch, A averaged over it; a bias has G only.
            batch, c = len(x), self.factor
            factors = [getattr(p, attr) for p in self.params]
            blocks = [(c * F[0], F[1] * batch if len(F) == 2 else None) for F in factors]
            return kron_blocks(blocks, N, c)

        return self._second_order(x, y, extension, read, "Kronecker factors")


class BackPackEF(BackPackInterface, EFInterface):
    """Empirical Fisher by BackPACK.

    ``BatchGrad`` gives the dense matrix, ``SumGradSquared`` its diagonal. BackPACK has no
    Kronecker-factored EF (use :class:`AsdlEF`).
    """

    def full(self, x: Inputs, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Dense batch EF ``Σ gₙ gₙᵀ`` from BackPACK's per-sample gradients.

        Args:
            x: Inputs, shape (B, ...).
            y: Targets, shape (B, ...).
            **kwargs: Ignored (accepted for interface compatibility).

        Returns:
            The summed batch loss and the EF of shape (P, P).
        """
        Gs, loss = self.gradients(x, y)
        return loss, Gs.T @ Gs

    def diag(self, x: Inputs, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Diagonal of the batch EF by ``SumGradSquared``.

        Args:
            x: Inputs, shape (B, ...).
            y: Targets, shape (B, ...).
            **kwargs: Ignored (accepted for interface compatibility).

        Returns:
            The summed batch loss and the diagonal of shape (P,).
        """
        h, loss = self._first_order(x, y, SumGradSquared(), "sum_grad_squared", 0)
        return loss, h

    def kron(self, x: Inputs, y: Tensor, N: int, **kwargs: Any) -> tuple[Tensor, Any]:
        """Not available in BackPACK.

        Raises:
            NotImplementedError: Always, naming the backends that give a Kronecker EF.
        """
        raise NotImplementedError(
            "BackPACK has no Kronecker-factored empirical Fisher; use backend=AsdlEF, or "
            "BackPackGGN / CurvlinopsGGN for the Kronecker-factored GGN."
        )
