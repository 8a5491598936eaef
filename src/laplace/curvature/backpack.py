"""BackPACK backends (``backpack-for-pytorch``) for ``nn.Sequential`` models of standard layers.

Hooks live only for the duration of each call and everything BackPACK writes is removed
afterwards (``isolated``). See ``docs/backends.md``.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import Tensor, nn

from laplace.curvature.curvature import (
    CurvatureInterface,
    EFInterface,
    GGNInterface,
    check_dict_inputs,
)
from laplace.curvature.registry import check_library
from laplace.curvature.third_party import (
    KroneckerLayersOnly,
    TargetCall,
    check_attribution,
    isolated,
    kron_blocks,
    target_call,
)
from laplace.utils.data import Inputs
from laplace.utils.matrix import Kron

if TYPE_CHECKING:
    from backpack.extensions.backprop_extension import BackpropExtension

__all__ = ["BackPackEF", "BackPackGGN", "BackPackInterface"]

T = TypeVar("T")


def _library(module: str = "backpack") -> ModuleType:
    """BackPACK's ``module`` (``backpack``, ``backpack.extensions``, ...), imported on first use.

    Raises:
        ImportError: If BackPACK (the ``backpack`` extra) is not installed, with the install
            command.
    """
    check_library("BackPACK", "backpack", "backpack")
    return importlib.import_module(module)


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
    layer is a module without children. torch's warning that a full backward hook fires without
    input gradients is expected here (the first layer's inputs are data) and is silenced.
    """
    library = _library()
    is_no_op = _library("backpack.utils.module_classification").is_no_op
    with isolated(*modules) as handles, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
        for root in modules:
            for module in root.modules():
                if not (is_no_op(module) or any(True for _ in module.children())):
                    handles.append(module.register_forward_hook(library.hook_store_io))
                    handles.append(module.register_full_backward_hook(library.hook_run_extensions))
        yield


#: BackPACK's extensions (in ``backpack.extensions``) and their attributes per form: (exact GGN,
#: Monte-Carlo Fisher).
_GGN_EXTENSIONS: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "full": (("SqrtGGNExact", "sqrt_ggn_exact"), ("SqrtGGNMC", "sqrt_ggn_mc")),
    "diag": (("DiagGGNExact", "diag_ggn_exact"), ("DiagGGNMC", "diag_ggn_mc")),
    "kron": (("KFLR", "kflr"), ("KFAC", "kfac")),
}


class BackPackInterface(KroneckerLayersOnly, CurvatureInterface):
    """Base of the BackPACK backends (see ``CurvatureInterface`` for the arguments)."""

    library = "BackPACK"
    accepts_dict_inputs = False
    supported_losses = (nn.MSELoss, nn.CrossEntropyLoss, nn.BCEWithLogitsLoss)

    def _target(self, x: Inputs) -> TargetCall:
        check_dict_inputs(type(self), x)
        check_attribution(self, x)
        return target_call(self.model, x, self.last_layer)

    def _collect(self, module: nn.Module, attr: str, flatten_from: int) -> Tensor:
        """Concatenate the ``attr`` that BackPACK stored on each parameter (in ``params`` order).

        Returns:
            Shape (*leading, P) (``flatten_from`` leading dimensions), restricted to the
            subnetwork when one is set.
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
        return self._select(torch.cat(parts, dim=-1))

    def jacobians(self, x: Inputs, enable_backprop: bool = False) -> tuple[Tensor, Tensor]:
        """As ``CurvatureInterface.jacobians``, by ``BatchGrad``: one backward pass per output.

        Raises:
            ValueError: For dict-like inputs.
        """
        target = self._target(x)
        input_grad = x.grad if x.is_leaf else None
        library, extensions = _library(), _library("backpack.extensions")
        rows = []
        with _extended(target.module), torch.enable_grad():
            f = target.module(target.inputs)
            for k in range(f.shape[-1]):
                with library.backpack(extensions.BatchGrad(), retain_graph=True):
                    f[:, k].sum().backward(create_graph=enable_backprop, retain_graph=True)
                rows.append(self._collect(target.module, "grad_batch", 1))
                for p in self.params:
                    p.grad = None
                    del p.grad_batch
        if x.is_leaf:
            x.grad = input_grad
        Js = torch.stack(rows, dim=1)
        return (Js, f) if enable_backprop else (Js.detach(), f.detach())

    def gradients(self, x: Inputs, y: Tensor) -> tuple[Tensor, Tensor]:
        """As ``CurvatureInterface.gradients``, by ``BatchGrad``.

        Raises:
            ValueError: For dict-like inputs.
        """
        batch_grad = _library("backpack.extensions").BatchGrad()
        loss, Gs = self._backpropagate(
            x, y, batch_grad, lambda m: self._collect(m, "grad_batch", 1)
        )
        return Gs.detach(), loss

    def _backpropagate(
        self,
        x: Inputs,
        y: Tensor,
        extension: BackpropExtension,
        read: Callable[[nn.Module], T],
        quantity: str = "",
    ) -> tuple[Tensor, T]:
        """Backpropagate the loss with ``extension`` and ``read(module)`` the result.

        A first-order extension differentiates the library loss; a second-order one (named by
        ``quantity`` for messages) the torch loss module, which it hooks: its result is of the
        unscaled loss.

        Returns:
            The summed library loss and what ``read`` returns.

        Raises:
            ValueError: For dict-like inputs, and a second-order quantity of a non-sequential
                model or of the binary cross-entropy of several labels.
        """
        target = self._target(x)
        if quantity and not _is_chain(target.module):
            raise ValueError(
                f"BackPACK computes {quantity} only for nn.Sequential models of standard "
                f"layers, not for {type(target.module).__name__}; use backend=CurvlinopsGGN "
                "or AsdlGGN."
            )
        with _extended(target.module, *([self.lossfunc] if quantity else [])):
            f = target.module(target.inputs)
            if quantity and isinstance(self.lossfunc, nn.BCEWithLogitsLoss) and f.shape[-1] != 1:
                raise ValueError(
                    f"BackPACK computes {quantity} of the binary cross-entropy for one output "
                    f"only; the model has {f.shape[-1]} labels: use backend=CurvlinopsGGN."
                )
            loss = self.lossfunc(f, self.fit_likelihood.prepare_targets(f, y))
            if not quantity:
                loss = self.factor * loss
            with _library().backpack(extension):
                loss.backward()
            value = read(target.module)
        return (self.factor if quantity else 1) * loss.detach(), value


class BackPackGGN(BackPackInterface, GGNInterface):
    """Exact GGN by BackPACK, or its Monte-Carlo Fisher with ``stochastic=True``.

    ``diag`` uses ``DiagGGNExact`` / ``DiagGGNMC``, ``full`` the symmetric factorisation
    ``G = Vᵀ V`` of ``SqrtGGNExact`` / ``SqrtGGNMC`` (V of shape (C·B, P), or (S·B, P) with S
    samples), ``kron`` the ``KFLR`` / ``KFAC`` factors.

    Takes the arguments of ``CurvatureInterface``, and:

    Args:
        stochastic: Monte-Carlo Fisher instead of the exact GGN.
        num_samples: Sampled targets per data point when stochastic (BackPACK's
            ``mc_samples``).
    """

    def _extension(self, form: str) -> tuple[BackpropExtension, str]:
        """BackPACK's extension of the GGN (or MC Fisher) in ``form``, and its attribute."""
        name, attr = _GGN_EXTENSIONS[form][self.stochastic]
        cls = getattr(_library("backpack.extensions"), name)
        return (cls(mc_samples=self.num_samples) if self.stochastic else cls()), attr

    def full(self, x: Inputs, y: Tensor, **kwargs: object) -> tuple[Tensor, Tensor]:
        """As ``CurvatureInterface.full``: ``Vᵀ V`` from BackPACK's GGN square root ``V``.

        Keyword arguments are accepted and ignored.

        Raises:
            ValueError: For dict-like inputs or a non-sequential model.
        """
        extension, attr = self._extension("full")

        def read(module: nn.Module) -> Tensor:
            V = self._collect(module, attr, 2).flatten(0, 1)
            return V.T @ V

        loss, H = self._backpropagate(x, y, extension, read, "the GGN")
        return loss, (self.factor * H).detach()

    def diag(self, x: Inputs, y: Tensor, **kwargs: object) -> tuple[Tensor, Tensor]:
        """As ``CurvatureInterface.diag``, by ``DiagGGNExact`` (or ``DiagGGNMC``).

        Keyword arguments are accepted and ignored.

        Raises:
            ValueError: For dict-like inputs or a non-sequential model.
        """
        extension, attr = self._extension("diag")
        loss, h = self._backpropagate(
            x, y, extension, lambda m: self._collect(m, attr, 0), "the GGN diagonal"
        )
        return loss, (self.factor * h).detach()

    def kron(self, x: Inputs, y: Tensor, N: int, **kwargs: object) -> tuple[Tensor, Kron]:
        """As ``CurvatureInterface.kron``, by ``KFLR`` (or the Monte-Carlo ``KFAC``).

        Keyword arguments are accepted and ignored.

        Raises:
            ValueError: For dict-like inputs, a non-sequential model, a subnetwork or a layer other
                than Linear and convolution layers.
        """
        self.kron_shapes()  # refuses a subnetwork and layers BackPACK cannot factor
        extension, attr = self._extension("kron")

        def read(module: nn.Module) -> Kron:
            # BackPACK's factors: G of the unscaled loss (1/c times ours) summed over the
            # batch, A averaged over it; a bias has G only.
            batch, c = len(x), self.factor
            factors = [getattr(p, attr) for p in self.params]
            blocks = [(c * F[0], F[1] * batch if len(F) == 2 else None) for F in factors]
            return kron_blocks(blocks, N, c)

        return self._backpropagate(x, y, extension, read, "Kronecker factors")


class BackPackEF(BackPackInterface, EFInterface):
    """Empirical Fisher by BackPACK.

    ``BatchGrad`` gives the dense matrix, ``SumGradSquared`` its diagonal. BackPACK has no
    Kronecker-factored EF (use [`AsdlEF`][laplace.curvature.asdl.AsdlEF]).
    """

    def full(self, x: Inputs, y: Tensor, **kwargs: object) -> tuple[Tensor, Tensor]:
        """As ``CurvatureInterface.full``: ``Σ gₙ gₙᵀ`` of ``BatchGrad``'s gradients ``gₙ``."""
        Gs, loss = self.gradients(x, y)
        return loss, Gs.T @ Gs

    def diag(self, x: Inputs, y: Tensor, **kwargs: object) -> tuple[Tensor, Tensor]:
        """As ``CurvatureInterface.diag``, by ``SumGradSquared``."""
        sum_grad_squared = _library("backpack.extensions").SumGradSquared()
        loss, h = self._backpropagate(
            x, y, sum_grad_squared, lambda m: self._collect(m, "sum_grad_squared", 0)
        )
        return loss, h.detach()

    def kron(self, x: Inputs, y: Tensor, N: int, **kwargs: object) -> tuple[Tensor, Kron]:
        """Not available in BackPACK.

        Raises:
            NotImplementedError: Always, naming the backends that give a Kronecker EF.
        """
        raise NotImplementedError(
            "BackPACK has no Kronecker-factored empirical Fisher; use backend=AsdlEF, or "
            "BackPackGGN / CurvlinopsGGN for the Kronecker-factored GGN."
        )
