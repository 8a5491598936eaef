"""``state_dict`` / ``load_state_dict`` of the Laplace approximations.

The state holds only tensors and plain Python values, so ``torch.load(path, weights_only=True)``
reads it, and it moves across devices with ``map_location``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeAlias, TypeVar

import torch
from torch import Tensor, nn

from laplace.core.priors import check_temperature
from laplace.utils.distributed import unwrap_model
from laplace.utils.errors import ArgumentTypeError, MissingKeyError, check_bool, check_positive_int
from laplace.utils.outputs import OutputAdapter

if TYPE_CHECKING:
    from laplace.core.subsets import ParameterSubset
    from laplace.likelihoods.likelihood_model import LikelihoodModel
    from laplace.structures.posterior import Curvature, Posterior

__all__ = [
    "ParametricState",
    "SavedApproximation",
    "StateDict",
    "StateFormat",
    "check_state_dict",
    "identity_mismatch",
    "module_tree",
    "trainable_coordinates",
]

#: A state as ``state_dict`` writes it: entries by name, each a tensor, a plain Python value or
#: nested lists and dicts of them, of a type set by its key (``torch.load`` gives it back as is).
StateDict: TypeAlias = dict[str, Any]


class SavedApproximation(Protocol):
    """What every state format reads of the Laplace approximation it saves and loads."""

    @property
    def model(self) -> nn.Module:
        """The network."""
        ...

    @property
    def _likelihood_model(self) -> LikelihoodModel:
        """The likelihood object (its name, its output layout)."""
        ...

    @property
    def _subset(self) -> ParameterSubset:
        """The parameters the posterior covers."""
        ...

    #: The device tensors are loaded onto.
    _device: torch.device
    #: The floating-point type tensors are loaded in.
    _dtype: torch.dtype


class SavedParametric(SavedApproximation, Protocol):
    """What ``ParametricState`` reads of a parametric approximation besides."""

    H: Curvature

    #: The posterior built from ``H`` and the hyperparameters (None: rebuilt when read).
    _posterior_cache: object

    @property
    def _posterior_cls(self) -> type[Posterior]:
        """The posterior structure."""
        ...

    @property
    def _structure_options(self) -> Mapping[str, object]:
        """The structure's options (Kronecker: ``damping``)."""
        ...

    def _zero_curvature(self) -> Curvature:
        """The zero curvature of the parameters, in the structure's form."""
        ...


#: The approximation a state format saves.
A = TypeVar("A", bound=SavedApproximation)
#: The parametric approximation ``ParametricState`` saves.
P = TypeVar("P", bound=SavedParametric)

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


def identity_mismatch(key: str, saved: object, current: object) -> str:
    """The message refusing a state whose identity entry ``key`` is ``saved``, not ``current``.

    Short values are shown whole; longer lists by their first differing entry.
    """
    shown = f"is {saved!r}, expected {current!r}"
    if (
        isinstance(saved, list)
        and isinstance(current, list)
        and max(len(repr(saved)), len(repr(current))) > SHOWN_CHARACTERS
    ):
        shown = _first_difference(saved, current)
    reason = IDENTITY_REASONS.get(key)
    return f"state_dict does not match this Laplace approximation: its {key} {shown}" + (
        f" ({reason})." if reason else "."
    )


def _leaves(value: object) -> Iterator[object]:
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
    state_dict: object, required: Iterable[str], tensors: Iterable[str], counts: Iterable[str]
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


def _first_difference(saved: list[object], current: list[object]) -> str:
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


@dataclass(frozen=True)
class StateFormat(Generic[A]):
    """What the state of a Laplace class holds besides its identity and mean, and how it loads.

    A class names its state in one place, its ``_state_format``: by default the attributes
    named in ``plain``, ``tensors`` and ``parameters``, and the further entries of
    ``other_tensors`` and ``counts`` that a subclass of the format writes. A class whose state
    needs more has a subclass of the format (its ``values``, ``check``, ``load``, ...), generic in
    the approximation it saves.

    Args:
        plain: Attributes saved as they are.
        tensors: Floating-point tensor attributes, saved detached and restored on the model's
            device and dtype, through their setters.
        parameters: Trainable ``nn.Parameter`` attributes (or None), restored as new ones.
        other_tensors: Further entries that hold floating-point tensors (checked finite).
        counts: Entries that hold positive integers.
    """

    plain: tuple[str, ...] = ()
    tensors: tuple[str, ...] = ()
    parameters: tuple[str, ...] = ()
    other_tensors: tuple[str, ...] = ()
    counts: tuple[str, ...] = ()

    def identity(self, la: A) -> dict[str, object]:
        """Entries a loaded state must equal, in the order they are compared.

        The class and likelihood, the class's ``identity_entries`` and the ``module_tree``.
        """
        return {
            "cls_name": type(la).__name__,
            "likelihood": la._likelihood_model.name,
            **self.identity_entries(la),
            "module_tree": module_tree(la.model),
        }

    def identity_entries(self, la: A) -> dict[str, object]:
        """Identity entries a class adds (its parameters, its input keys); none by default."""
        return {}

    def value_keys(self, la: A) -> tuple[str, ...]:
        """The entries ``values`` writes."""
        return (*self.plain, *self.tensors, *self.parameters)

    def tensor_keys(self, la: A) -> tuple[str, ...]:
        """Entries holding floating-point tensors (checked finite before loading)."""
        return (*self.tensors, *self.other_tensors)

    def count_keys(self, la: A) -> tuple[str, ...]:
        """Entries holding positive integers."""
        return self.counts

    def values(self, la: A) -> StateDict:
        """The fitted posterior and hyperparameters, besides the identity and the mean."""
        values = {name: getattr(la, name) for name in self.plain}
        values.update({name: getattr(la, name).detach() for name in self.tensors})
        for name in self.parameters:
            parameter = getattr(la, name)
            values[name] = None if parameter is None else parameter.detach().clone()
        return values

    def prepare(self, la: A, state_dict: StateDict) -> None:
        """Make the parameters known before the mean is compared (e.g. find the last layer)."""

    def check(self, la: A, state_dict: StateDict) -> None:
        """Refuse entries ``load`` cannot take, before anything is loaded."""

    def load(self, la: A, state_dict: StateDict) -> None:
        """Assign the checked entries of ``values``."""
        for name in self.plain:
            setattr(la, name, state_dict[name])
        for name in self.tensors:
            setattr(la, name, state_dict[name].to(device=la._device, dtype=la._dtype))
        for name in self.parameters:
            if state_dict[name] is not None:
                value = state_dict[name].to(device=la._device, dtype=la._dtype)
                setattr(la, name, nn.Parameter(value.clone()))


def trainable_coordinates(la: SavedApproximation) -> dict[str, object]:
    """``param_names`` and ``param_shapes``: the parameters the posterior of ``la`` covers."""
    return {
        "param_names": list(la._subset.names),
        "param_shapes": [list(p.shape) for p in la._subset.params],
    }


@dataclass(frozen=True)
class ParametricState(StateFormat[P]):
    """The state of a parametric Laplace: the curvature, loss, data count and hyperparameters.

    The identity also holds the names and shapes of the parameters (the architecture); the
    curvature is saved as the posterior structure saves it. The named entries default to those
    of every parametric class (``ParametricLaplace``).
    """

    plain: tuple[str, ...] = ("n_data", "n_outputs", "temperature", "enable_backprop")
    tensors: tuple[str, ...] = ("loss", "prior_mean", "prior_precision", "sigma_noise")
    counts: tuple[str, ...] = ("n_data", "n_outputs")

    def identity_entries(self, la: P) -> dict[str, object]:
        """The names and shapes of the parameters (``trainable_coordinates``)."""
        return trainable_coordinates(la)

    def value_keys(self, la: P) -> tuple[str, ...]:
        """The curvature and the class's entries."""
        return ("H", *super().value_keys(la))

    def tensor_keys(self, la: P) -> tuple[str, ...]:
        """The curvature and the class's tensors (loss and hyperparameters)."""
        return ("H", *super().tensor_keys(la))

    def values(self, la: P) -> StateDict:
        """The curvature as the structure saves it, the loss, counts and hyperparameters."""
        layout = la._likelihood_model.outputs.found
        return {
            **({} if layout is None else {"output_layout": layout}),
            "H": self.curvature_state(la),
            **super().values(la),
        }

    def check(self, la: P, state_dict: StateDict) -> None:
        """Refuse a bad temperature, a non-boolean ``enable_backprop``, an unknown layout."""
        check_temperature(state_dict["temperature"])
        check_bool(state_dict["enable_backprop"], "state_dict['enable_backprop']")
        OutputAdapter.check_found(state_dict.get("output_layout"))

    def load(self, la: P, state_dict: StateDict) -> None:
        """Assign the curvature, loss, counts and hyperparameters."""
        la.H = self.load_curvature(la, state_dict["H"])
        super().load(la, state_dict)
        la._likelihood_model.outputs.remember(state_dict.get("output_layout"))
        la._posterior_cache = None

    def curvature_state(self, la: P) -> object:
        """The fitted curvature as the posterior structure saves it."""
        return la._posterior_cls.state(la.H)

    def load_curvature(self, la: P, state: object) -> Curvature:
        """The fitted curvature from a saved one, checked by the posterior structure."""
        return la._posterior_cls.load_state(state, la._zero_curvature(), **la._structure_options)
