"""``state_dict`` / ``load_state_dict`` of the Laplace approximations.

The state holds only tensors and plain Python values, so ``torch.load(path, weights_only=True)``
reads it, and it moves across devices with ``map_location``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from laplace.core.priors import check_temperature
from laplace.utils.distributed import unwrap_model
from laplace.utils.errors import ArgumentTypeError, MissingKeyError, check_bool, check_positive_int
from laplace.utils.outputs import OutputAdapter

__all__ = [
    "ParametricState",
    "StateFormat",
    "check_state_dict",
    "identity_mismatch",
    "module_tree",
    "trainable_coordinates",
]

#: Tolerance when checking that the model's weights are the saved posterior mean.
MEAN_MATCH_ATOL = 1e-6
#: Why a state cannot load when an identity entry differs, by entry.
IDENTITY_REASONS = {
    "param_names": "the trainable coordinates (the parameters the posterior covers) differ",
    "param_shapes": "the trainable coordinates (the parameters the posterior covers) differ",
    "dict_key_x": "the inputs of dict-like batches (and VaLLA's inducing inputs) are read by "
    "this key",
    "dict_key_y": "the targets of dict-like batches are read by this key",
    "module_tree": "the model's modules differ: a state loads into the same pretrained model only",
}
#: Identity entries whose representation is longer are reported by their first difference.
SHOWN_CHARACTERS = 200


def module_tree(model: nn.Module) -> list[list[str]]:
    """The modules of ``model`` as ``[name, class name, settings]`` rows, in registration order.

    The settings are the module's ``extra_repr()`` (sizes, activation slopes, dropout rates);
    the rows tell apart models whose parameters agree but whose functions differ (another
    activation, a module inserted without parameters). A ``DistributedDataParallel`` or
    ``DataParallel`` wrapper is looked through.
    """
    return [
        [name, type(module).__qualname__, module.extra_repr()]
        for name, module in unwrap_model(model).named_modules()
    ]


def identity_mismatch(key: str, saved: Any, current: Any) -> str:
    """The message refusing a state whose identity entry ``key`` is ``saved``, not ``current``.

    Short values are shown whole; longer lists by their first differing entry.
    """
    shown = f"is {saved!r}, expected {current!r}"
    long_lists = isinstance(saved, list) and isinstance(current, list)
    if long_lists and max(len(repr(saved)), len(repr(current))) > SHOWN_CHARACTERS:
        shown = _first_difference(saved, current)
    reason = IDENTITY_REASONS.get(key)
    return f"state_dict does not match this Laplace approximation: its {key} {shown}" + (
        f" ({reason})." if reason else "."
    )


def _leaves(value: Any) -> Iterator[Any]:
    """The tensors (and anything else that is not a container) in nested lists and dicts."""
    if isinstance(value, Mapping):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def check_state_dict(
    state_dict: Any, required: Iterable[str], tensors: Iterable[str], counts: Iterable[str]
) -> None:
    """Refuse a state that ``state_dict`` cannot have written, before anything is loaded.

    Args:
        state_dict: The candidate, e.g. from ``torch.load(path, weights_only=True)``.
        required: The entries it must have.
        tensors: Entries holding floating-point tensors (or nested lists/dicts of them), which
            must be finite.
        counts: Entries holding positive integers.

    Raises:
        ArgumentTypeError: (a ``ValueError`` and a ``TypeError``) if it is not a mapping, or
            an entry has the wrong type.
        MissingKeyError: (a ``KeyError`` and a ``ValueError``) for missing entries, e.g. a
            model's own ``state_dict`` or a truncated one.
        ValueError: For NaN/inf tensors or non-positive counts.
    """
    if not isinstance(state_dict, Mapping):
        raise ArgumentTypeError(
            "state_dict must be the dict returned by state_dict() (e.g. from "
            f"torch.load(path, weights_only=True)), got {type(state_dict).__name__}."
        )
    missing = [key for key in required if key not in state_dict]
    if missing:
        raise MissingKeyError(
            f"state_dict is missing the entries {missing}: it is not (or no longer) the state "
            f"of a fitted Laplace approximation; its keys are {sorted(map(str, state_dict))[:8]}."
        )
    for key in tensors:
        for leaf in _leaves(state_dict[key]):
            if not isinstance(leaf, Tensor) or not leaf.is_floating_point():
                kind = leaf.dtype if isinstance(leaf, Tensor) else type(leaf).__name__
                raise ArgumentTypeError(
                    f"state_dict[{key!r}] must hold floating-point tensors, got {kind}."
                )
            if not bool(torch.isfinite(leaf).all()):
                raise ValueError(
                    f"state_dict[{key!r}] contains NaN or inf values: the state was altered "
                    "or saved from a broken fit."
                )
    for key in counts:
        check_positive_int(state_dict[key], f"state_dict[{key!r}]")


def _first_difference(saved: list[Any], current: list[Any]) -> str:
    """Where two lists first differ, as ``identity_mismatch`` words it."""
    index = next(
        (i for i, (a, b) in enumerate(zip(saved, current)) if a != b),
        min(len(saved), len(current)),
    )
    saved_entry = repr(saved[index]) if index < len(saved) else "none"
    current_entry = repr(current[index]) if index < len(current) else "none"
    return (
        f"differs at entry {index} (of {len(saved)} saved, {len(current)} here): "
        f"{saved_entry} saved, {current_entry} here"
    )


class StateFormat:
    """What the state of a Laplace class holds besides its identity and mean, and how it loads.

    By default the attributes the class names in ``_state_plain`` (saved as they are),
    ``_state_tensors`` (floating-point tensors, saved detached and restored on the model's
    device and dtype, through their setters) and ``_state_parameters`` (trainable
    ``nn.Parameter`` attributes, restored as new ones); ``_state_other_tensors`` and
    ``_state_counts`` name further entries that hold floating-point tensors and positive
    integers. A class whose state needs more passes its own format object.
    """

    def identity(self, la: Any) -> dict[str, Any]:
        """Entries a loaded state must equal, in the order they are compared.

        The class and likelihood, the class's ``identity_entries`` and the ``module_tree``.
        """
        return {
            "cls_name": type(la).__name__,
            "likelihood": la._likelihood_model.name,
            **self.identity_entries(la),
            "module_tree": module_tree(la.model),
        }

    def identity_entries(self, la: Any) -> dict[str, Any]:
        """Identity entries a class adds (its parameters, its input keys); none by default."""
        return {}

    def value_keys(self, la: Any) -> tuple[str, ...]:
        """The entries ``values`` writes."""
        return (*la._state_plain, *la._state_tensors, *la._state_parameters)

    def tensor_keys(self, la: Any) -> tuple[str, ...]:
        """Entries holding floating-point tensors (checked finite before loading)."""
        return (*la._state_tensors, *la._state_other_tensors)

    def count_keys(self, la: Any) -> tuple[str, ...]:
        """Entries holding positive integers."""
        return la._state_counts

    def values(self, la: Any) -> dict[str, Any]:
        """The fitted posterior and hyperparameters, besides the identity and the mean."""
        values = {name: getattr(la, name) for name in la._state_plain}
        values.update({name: getattr(la, name).detach() for name in la._state_tensors})
        for name in la._state_parameters:
            parameter = getattr(la, name)
            values[name] = None if parameter is None else parameter.detach().clone()
        return values

    def prepare(self, la: Any, state_dict: dict[str, Any]) -> None:
        """Make the parameters known before the mean is compared (e.g. find the last layer)."""

    def check(self, la: Any, state_dict: dict[str, Any]) -> None:
        """Refuse entries ``load`` cannot take, before anything is loaded."""

    def load(self, la: Any, state_dict: dict[str, Any]) -> None:
        """Assign the checked entries of ``values``."""
        for name in la._state_plain:
            setattr(la, name, state_dict[name])
        for name in la._state_tensors:
            setattr(la, name, state_dict[name].to(device=la._device, dtype=la._dtype))
        for name in la._state_parameters:
            if state_dict[name] is not None:
                value = state_dict[name].to(device=la._device, dtype=la._dtype)
                setattr(la, name, nn.Parameter(value.clone()))


def trainable_coordinates(la: Any) -> dict[str, list[Any]]:
    """``param_names`` and ``param_shapes``: the parameters the posterior of ``la`` covers."""
    return {
        "param_names": list(la._subset.names),
        "param_shapes": [list(p.shape) for p in la._subset.params],
    }


class ParametricState(StateFormat):
    """The state of a parametric Laplace: the curvature, loss, data count and hyperparameters.

    The identity also holds the names and shapes of the parameters (the architecture); the
    curvature is saved as the posterior structure saves it.
    """

    def identity_entries(self, la: Any) -> dict[str, Any]:
        """The names and shapes of the parameters (``trainable_coordinates``)."""
        return trainable_coordinates(la)

    def value_keys(self, la: Any) -> tuple[str, ...]:
        """The curvature and the class's entries."""
        return ("H", *super().value_keys(la))

    def tensor_keys(self, la: Any) -> tuple[str, ...]:
        """The curvature and the class's tensors (loss and hyperparameters)."""
        return ("H", *super().tensor_keys(la))

    def values(self, la: Any) -> dict[str, Any]:
        """The curvature as the structure saves it, the loss, counts and hyperparameters."""
        layout = la._likelihood_model.outputs.found
        return {
            **({} if layout is None else {"output_layout": layout}),
            "H": self.curvature_state(la),
            **super().values(la),
        }

    def check(self, la: Any, state_dict: dict[str, Any]) -> None:
        """Refuse a bad temperature, a non-boolean ``enable_backprop``, an unknown layout."""
        check_temperature(state_dict["temperature"])
        check_bool(state_dict["enable_backprop"], "state_dict['enable_backprop']")
        OutputAdapter.check_found(state_dict.get("output_layout"))

    def load(self, la: Any, state_dict: dict[str, Any]) -> None:
        """Assign the curvature, loss, counts and hyperparameters."""
        la.H = self.load_curvature(la, state_dict["H"])
        super().load(la, state_dict)
        la._likelihood_model.outputs.remember(state_dict.get("output_layout"))
        la._posterior_cache = None

    def curvature_state(self, la: Any) -> Any:
        """The fitted curvature as the posterior structure saves it."""
        return la._posterior_cls.state(la.H)

    def load_curvature(self, la: Any, state: Any) -> Any:
        """The fitted curvature from a saved one, checked by the posterior structure."""
        return la._posterior_cls.load_state(state, la._zero_curvature(), **la._structure_options)
