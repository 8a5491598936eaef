"""What the ASDL and BackPACK adapters share: leaving no trace, what they run on, KFAC blocks.

Every backend call runs inside ``isolated``, which undoes what the libraries write onto modules
and parameters (docs/backends.md).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple, Protocol

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from laplace.curvature.engine.kfac import KfacStatistics
from laplace.curvature.engine.kfac_rules import check_kronecker_layers, module_name
from laplace.curvature.engine.layer_rules import ModuleCall
from laplace.curvature.engine.per_sample import PerSampleEngine
from laplace.utils.data import Inputs
from laplace.utils.matrix import Kron

__all__ = [
    "KroneckerLayersOnly",
    "TargetCall",
    "check_attribution",
    "isolated",
    "kron_blocks",
    "target_call",
]


@contextmanager
def isolated(*modules: nn.Module) -> Iterator[list[RemovableHandle]]:
    """Run a block whose hooks and attributes on ``modules`` are all undone afterwards.

    The attributes, hook mode, gradients and ``requires_grad`` of the modules (with their
    submodules and parameters) are restored (ASDL switches ``requires_grad`` off around its
    backward passes without restoring it when they raise). The block runs with gradients
    enabled, also inside a caller's ``torch.no_grad()``.

    Args:
        *modules: The modules to keep clean.

    Yields:
        A list to which the block appends the handles of hooks it registers; they are removed
        on exit, even when the block raises.
    """
    every = list(dict.fromkeys(m for root in modules for m in root.modules()))
    params = list(dict.fromkeys(p for m in every for p in m.parameters(False)))
    module_states = [(m, set(vars(m)), m._is_full_backward_hook) for m in every]
    param_states = [(p, set(vars(p)), p.grad, p.requires_grad) for p in params]
    for param in params:
        param.grad = None
    handles: list[RemovableHandle] = []
    try:
        with torch.enable_grad():
            yield handles
    finally:
        for handle in handles:
            handle.remove()
        for module, keys, mode in module_states:
            for key in set(vars(module)) - keys:
                delattr(module, key)
            module._is_full_backward_hook = mode
        for param, keys, grad, flag in param_states:
            for key in set(vars(param)) - keys:
                delattr(param, key)
            param.grad = grad
            param.requires_grad_(flag)


class TargetCall(NamedTuple):
    """The module a library is run on and its input (the whole model, or the last layer).

    Attributes:
        module: ``model``, or ``model.last_layer`` in last-layer mode.
        inputs: ``x``, or the detached features ``φ(x)`` (B, D) in last-layer mode.
    """

    module: nn.Module
    inputs: Inputs


def target_call(model: nn.Module, x: Inputs, last_layer: bool) -> TargetCall:
    """The module and input to hand a curvature library.

    With ``last_layer`` the features are computed once, without a graph, so that the library
    only sees ``model.last_layer`` (a single ``nn.Linear``).
    """
    if not last_layer:
        return TargetCall(model, x)
    with torch.no_grad():
        _, phi = model.forward_with_features(x)
    return TargetCall(model.last_layer, phi)


def kron_blocks(blocks: list[tuple[Tensor, Tensor | None]], n_data: int, factor: float) -> Kron:
    """A [`Kron`][laplace.utils.Kron] from per-parameter factors, normalised like the native KFAC.

    Args:
        blocks: Per parameter tensor, in parameter order, ``(G, A)``: ``G`` (p_out, p_out) the
            output-gradient factor summed over the batch (of the library's σ-free curvature),
            ``A`` (p_in, p_in) the input factor summed over the batch (None for a bias).
        n_data: Number of data points N of the whole data set.
        factor: The backend's loss factor ``c``: weight blocks are ``[G/√c, √c·A/N]``.
    """
    root = math.sqrt(factor)
    return Kron([[G] if A is None else [G / root, A * (root / n_data)] for G, A in blocks])


class LibraryBackend(Protocol):
    """What ``check_attribution`` reads of a third-party backend."""

    @property
    def last_layer(self) -> bool:
        """Whether the library runs on the last layer alone."""
        ...

    @property
    def engine(self) -> PerSampleEngine:
        """The native per-sample engine over the backend's parameters."""
        ...

    @property
    def library(self) -> str:
        """The library's name, for messages."""
        ...


def check_attribution(
    backend: LibraryBackend,
    x: Inputs,
    misread_call: Callable[[ModuleCall], str | None] | None = None,
) -> None:
    """Refuse a model that a library reading curvature off module calls would get wrong.

    ASDL and BackPACK read each parameter's curvature from its module's calls, the rows of
    each call's outputs taken as data points; the native engine's attribution guard finds where
    that is wrong, and a module called several times in one forward pass is refused too (the
    libraries keep one call's quantities). Checked once per shape of the inputs.

    Args:
        backend: The library's backend (its ``engine``, ``last_layer``).
        x: Inputs of the batch.
        misread_call: Where given, what else the library reads wrong in a recorded call (a
            description), or None.

    Raises:
        ValueError: Naming the parameter or module, why, and the backend that is exact there.
    """
    if backend.last_layer:  # the library runs on the last layer alone, on features
        return
    leaves = tree_flatten(x)[0]
    key = (misread_call, *(tuple(v.shape) for v in leaves if isinstance(v, Tensor)))
    checked = backend.__dict__.setdefault("_attribution_checked", set())
    if key in checked:
        return
    engine = backend.engine
    trace = engine.trace(x)
    problems = [f"{engine.describe(s)}: {why}" for s, why in trace.exact_reasons.items()]
    problems += [
        f"module {module_name(engine.model, m)!r} ({type(m).__name__}): its outputs are not one "
        "row per data point (a table looked up once for the batch, or a sequence-first layout)"
        for m, mode in engine.shared.items()
        if mode
    ]
    if misread_call is not None:
        problems += [
            f"module {module_name(engine.model, call.module)!r} ({type(call.module).__name__}) "
            f"{why}"
            for call in trace.calls
            if (why := misread_call(call)) is not None
        ]
    calls = Counter(call.module for call in trace.calls)
    problems += [
        f"module {module_name(engine.model, m)!r} ({type(m).__name__}) is called {n} times in "
        "one forward pass"
        for m, n in calls.items()
        if n > 1
    ]
    if problems:
        raise ValueError(
            f"{type(backend).__name__} ({backend.library}) would read this model's curvature "
            f"wrong without an error: {'; '.join(problems)}. Use backend=CurvlinopsGGN or "
            "CurvlinopsEF (the default), which are exact on it."
        )
    checked.add(key)


class KroneckerLayersOnly:
    """The ``kron`` blocks of a library whose KFAC takes Linear and convolution layers only.

    A mixin of the third-party backends: unlike the native KFAC, ASDL's and BackPACK's have no
    exact fallback blocks, and ASDL's embedding factor is a dense V × V matrix.
    """

    #: The library's name, for messages.
    library: str = "this backend"
    #: The libraries form each batch's curvature anew (and ``kron`` dense output factors).
    native_engine = False

    def kron_eigenvalues(
        self, x: Inputs, y: Tensor, bases: list[list[Tensor | None]], **kwargs: object
    ) -> list[Tensor | None]:
        """Not available: the library's KFAC has no eigenvalue correction.

        Raises:
            ValueError: Always, naming the backends that have one.
        """
        raise ValueError(self._no_eigenvalue_correction())

    def kron_statistics(
        self, x: Inputs, y: Tensor, N: int, **kwargs: object
    ) -> tuple[Tensor, Kron, KfacStatistics]:
        """Not available, as ``kron_eigenvalues``.

        Raises:
            ValueError: Always, naming the backends that have an eigenvalue correction.
        """
        raise ValueError(self._no_eigenvalue_correction())

    def _no_eigenvalue_correction(self) -> str:
        return (
            f"hessian_structure='ekfac' needs the native KFAC of backend=CurvlinopsGGN or "
            f"CurvlinopsEF (the default); {type(self).__name__} ({self.library}) has no "
            "eigenvalue correction. Use hessian_structure='kron' with it."
        )

    def kron_shapes(self, low_rank_above: int | None = None) -> list[list[tuple[int, ...]]]:
        """As ``CurvatureInterface.kron_shapes``, for Linear and convolution layers only.

        Raises:
            ValueError: For a subnetwork, or naming a module (owning a parameter of interest) of
                another kind, and the alternatives.
        """
        if self.subnetwork_indices is not None:
            raise ValueError("a subnetwork has no Kronecker structure; use diag or full.")
        check_kronecker_layers(self._model, self.params, self.library)
        return super().kron_shapes(low_rank_above)
