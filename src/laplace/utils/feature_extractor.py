"""``FeatureExtractor``: a model wrapper that also returns the inputs of its linear last layer.

Last-layer Laplace treats a network as ``f(x) = W φ(x) + b``. The head is found by name or as
the last leaf module run in a forward pass; ``φ(x)`` is captured by a hook that lives for one
call only, so the wrapped model is never left modified.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from torch import Tensor, nn

from laplace.utils.data import Inputs
from laplace.utils.enums import FeatureReduction
from laplace.utils.errors import MissingKeyError, check_module
from laplace.utils.public import at_public_path

__all__ = ["FeatureExtractor", "FeatureReduction", "as_feature_extractor"]


def _run_recording_inputs(
    model: nn.Module, modules: dict[str, nn.Module], x: Inputs, kwargs: Mapping[str, object]
) -> tuple[Tensor, dict[str, Tensor | None], list[str]]:
    """``model(x, **kwargs)``, the inputs of ``modules`` that ran (by name) and their order.

    Each module's hook keeps the first positional input of its call (None if not a tensor);
    the hooks live for this call only.
    """
    inputs: dict[str, Tensor | None] = {}
    order: list[str] = []

    def record(name: str, module: nn.Module, args: tuple, output: object) -> None:
        first = args[0] if args else None
        inputs[name] = first if isinstance(first, Tensor) else None
        order.append(name)

    handles = [
        module.register_forward_hook(partial(record, name)) for name, module in modules.items()
    ]
    try:
        out = model(x, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return out, inputs, order


class FeatureExtractor(nn.Module):
    """Wrap ``model`` to return its output together with the features entering its last layer.

    Args:
        model: The network; its last layer must be an ``nn.Linear``.
        last_layer_name: Name of the last layer in ``model.named_modules()``; when None it is
            found on the first forward pass as the last leaf module that runs.
        enable_backprop: Keep the features attached to the graph (for gradients w.r.t. inputs).
        feature_reduction: ``"pick_first"``, ``"pick_last"`` or ``"average"`` over the middle
            dimensions of features (B, ..., D), mirroring the model's reduction of its outputs.

    Attributes:
        last_layer: The linear head (None until found); an unregistered alias of a submodule.

    Raises:
        MissingKeyError: For a ``last_layer_name`` that is not a module of the model.
        ValueError: For an unknown ``feature_reduction`` or a ``last_layer_name`` that is not a
            linear layer.
    """

    def __init__(
        self,
        model: nn.Module,
        last_layer_name: str | None = None,
        enable_backprop: bool = False,
        feature_reduction: FeatureReduction | str | None = None,
    ) -> None:
        super().__init__()
        self.model = check_module(model)
        self.enable_backprop = enable_backprop
        self.feature_reduction = (
            None if feature_reduction is None else FeatureReduction(feature_reduction)
        )
        self._last_layer_name: str | None = None
        object.__setattr__(self, "last_layer", None)
        if last_layer_name is not None:
            self.set_last_layer(last_layer_name)

    @property
    def last_layer_name(self) -> str | None:
        """Name of the last layer in ``model.named_modules()`` (None until found)."""
        return self._last_layer_name

    def set_last_layer(self, last_layer_name: str) -> None:
        """Use the module called ``last_layer_name`` as the last layer.

        Raises:
            MissingKeyError: If the model has no such module.
            ValueError: If it is not an ``nn.Linear``.
        """
        modules = dict(self.model.named_modules())
        linear = [name for name, m in modules.items() if isinstance(m, nn.Linear)]
        if last_layer_name not in modules:
            raise MissingKeyError(
                f"last_layer_name={last_layer_name!r} is not a module of the model; its linear "
                f"layers are {linear}."
            )
        layer = modules[last_layer_name]
        if not isinstance(layer, nn.Linear):
            raise ValueError(
                f"last-layer Laplace needs a linear last layer, but {last_layer_name!r} is a "
                f"{type(layer).__name__}; the model's linear layers are {linear} (pass one of "
                "them as last_layer_name)."
            )
        self._last_layer_name = last_layer_name
        object.__setattr__(self, "last_layer", layer)

    def find_last_layer(self, x: Inputs) -> Tensor:
        """Return ``model(x)``, taking the last leaf module that ran as the last layer.

        Raises:
            ValueError: If the last layer is already known, or the last leaf module that ran
                is not an ``nn.Linear``.
        """
        if self.last_layer is not None:
            raise ValueError(f"the last layer is already known: {self._last_layer_name!r}.")
        out, _ = self._detect(x)
        return out

    def forward(self, x: Inputs, **kwargs: object) -> Tensor:
        """Model output; finds the last layer first if it is not known yet."""
        if self.last_layer is None:
            return self._detect(x, **kwargs)[0]
        return self.model(x, **kwargs)

    def forward_with_features(self, x: Inputs, **kwargs: object) -> tuple[Tensor, Tensor]:
        """Model output (B, C) and last-layer features (B, D) of ``model(x, **kwargs)``."""
        if self.last_layer is None:
            out, phi = self._detect(x, **kwargs)
        else:
            name = self._last_layer_name
            out, inputs, _ = _run_recording_inputs(self.model, {name: self.last_layer}, x, kwargs)
            if name not in inputs:
                raise RuntimeError(f"the last layer {name!r} did not run in the forward pass.")
            phi = inputs[name]
        return out, self._reduce(phi)

    def _detect(self, x: Inputs, **kwargs: object) -> tuple[Tensor, Tensor]:
        leaves = {
            name: module
            for name, module in self.model.named_modules()
            if next(module.children(), None) is None
        }
        out, inputs, order = _run_recording_inputs(self.model, leaves, x, kwargs)
        if not order:
            raise ValueError("no leaf module ran in the forward pass: no last layer to find.")
        self.set_last_layer(order[-1])
        return out, inputs[order[-1]]

    def _reduce(self, phi: Tensor) -> Tensor:
        if not self.enable_backprop:
            phi = phi.detach()
        if phi.dim() <= 2 or self.feature_reduction is None:
            return phi
        middle = tuple(range(1, phi.dim() - 1))
        if self.feature_reduction == FeatureReduction.AVERAGE:
            return phi.mean(dim=middle)
        index = 0 if self.feature_reduction == FeatureReduction.PICK_FIRST else -1
        return phi[(slice(None), *([index] * len(middle)), slice(None))]


def as_feature_extractor(
    model: nn.Module,
    last_layer_name: str | None,
    feature_reduction: FeatureReduction | str | None,
) -> FeatureExtractor:
    """A new ``FeatureExtractor`` around ``model`` for a last-layer Laplace.

    A ``model`` that is a ``FeatureExtractor`` is unwrapped, its last layer kept unless named.
    """
    if isinstance(model, FeatureExtractor):
        last_layer_name = last_layer_name or model.last_layer_name
        model = model.model
    return FeatureExtractor(model, last_layer_name, feature_reduction=feature_reduction)


at_public_path(__name__, FeatureReduction)
