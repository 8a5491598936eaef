"""``state_dict`` / ``load_state_dict`` of the Laplace approximations.

The state holds only tensors and plain Python values, so ``torch.load(path, weights_only=True)``
reads it, and it moves across devices with ``map_location``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from laplace.errors import ArgumentTypeError, MissingKeyError, check_bool, check_positive_int
from laplace.outputs import OutputAdapter
from laplace.priors import check_temperature

__all__ = ["StateDict", "StateDictMixin", "check_state_dict"]

#: Tolerance when checking that the model's weights are the saved posterior mean.
MEAN_MATCH_ATOL = 1e-6

#: Entries of a parametric state besides its identity and mean.
PARAMETRIC_VALUES = (
    "H",
    "loss",
    "n_data",
    "n_outputs",
    "prior_mean",
    "prior_precision",
    "sigma_noise",
    "temperature",
    "enable_backprop",
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
    """Refuse a state that :meth:`state_dict` cannot have written, before anything is loaded.

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


class StateDict:
    """``state_dict`` / ``load_state_dict`` of every Laplace approximation.

    The state is the identity of the approximation (class, likelihood and what
    :meth:`_state_identity` adds), the posterior mean (checked against the model's weights when
    loading) and the entries :meth:`_state_values` returns: by default the attributes named in
    :attr:`_state_plain` (saved as they are) and :attr:`_state_tensors` (floating-point tensors,
    saved detached and restored on the model's device and dtype, through their setters) and
    :attr:`_state_parameters` (trainable ``nn.Parameter`` attributes, restored as new ones).
    Loading checks the identity, the entries (:func:`check_state_dict`, with
    :attr:`_state_counts` positive integers), the mean and the values
    (:meth:`_check_state_values`) before it assigns anything (:meth:`_load_state_values`); a
    state that fails a check changes nothing (see :mod:`laplace.transaction`).
    """

    #: Attributes saved and restored as they are (plain values).
    _state_plain: tuple[str, ...] = ()
    #: Floating-point tensor attributes saved and restored (checked finite when loading).
    _state_tensors: tuple[str, ...] = ()
    #: ``nn.Parameter`` attributes (or None) saved detached and restored as new parameters.
    _state_parameters: tuple[str, ...] = ()
    #: Other entries holding floating-point tensors, written and read by the class's own hooks.
    _state_other_tensors: tuple[str, ...] = ()
    #: Entries holding positive integers.
    _state_counts: tuple[str, ...] = ()

    def state_dict(self) -> dict[str, Any]:
        """The fitted state.

        Returns:
            A dict of tensors and plain values (loadable with ``weights_only=True``).
        """
        self._check_fitted("state_dict")
        return {**self._state_identity(), "mean": self.mean.detach(), **self._state_values()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`.

        A state that fails a check changes nothing (see :mod:`laplace.transaction`).

        Raises:
            ValueError: If the state belongs to another class, likelihood or architecture, if
                the model's weights are not the saved posterior mean, or if it is not a state
                :meth:`state_dict` writes (see :func:`check_state_dict`).
        """
        identity = self._state_identity()
        check_state_dict(state_dict, identity, (), ())
        for key, value in identity.items():
            if state_dict[key] != value:
                raise ValueError(
                    f"state_dict does not match this Laplace approximation: its {key} is "
                    f"{state_dict[key]!r}, expected {value!r}."
                )
        required = (*identity, "mean", *self._state_value_keys())
        tensors = ("mean", *self._state_tensors, *self._state_other_tensors)
        check_state_dict(state_dict, required, tensors, self._state_counts)
        self._prepare_state_load(state_dict)
        mean = state_dict["mean"].to(device=self._device, dtype=self._dtype)
        current = self._subset.vector().detach()
        if mean.shape != current.shape or not torch.allclose(
            mean, current, rtol=0, atol=MEAN_MATCH_ATOL
        ):
            raise ValueError(
                "the model's weights differ from the posterior mean stored in state_dict; "
                "load the model's own state_dict (the MAP weights) before the Laplace state."
            )
        self._check_state_values(state_dict)
        self._load_state_values(state_dict)
        self.mean = mean
        self._fitted = True

    # ------------------------------------------------------------------ hooks of the classes
    def _state_identity(self) -> dict[str, Any]:
        """Entries a loaded state must equal (class and likelihood, by default)."""
        return {"cls_name": type(self).__name__, "likelihood": self._likelihood_model.name}

    def _state_value_keys(self) -> tuple[str, ...]:
        """The entries :meth:`_state_values` writes."""
        return (*self._state_plain, *self._state_tensors, *self._state_parameters)

    def _state_values(self) -> dict[str, Any]:
        """The fitted posterior and hyperparameters, besides the identity and the mean."""
        values = {name: getattr(self, name) for name in self._state_plain}
        values.update({name: getattr(self, name).detach() for name in self._state_tensors})
        for name in self._state_parameters:
            parameter = getattr(self, name)
            values[name] = None if parameter is None else parameter.detach().clone()
        return values

    def _check_state_values(self, state_dict: dict[str, Any]) -> None:
        """Refuse entries :meth:`_load_state_values` cannot take, before anything is loaded."""

    def _prepare_state_load(self, state_dict: dict[str, Any]) -> None:
        """Make the parameters known before the mean is compared (e.g. find the last layer)."""

    def _load_state_values(self, state_dict: dict[str, Any]) -> None:
        """Assign the checked entries of :meth:`_state_values`."""
        for name in self._state_plain:
            setattr(self, name, state_dict[name])
        for name in self._state_tensors:
            setattr(self, name, state_dict[name].to(device=self._device, dtype=self._dtype))
        for name in self._state_parameters:
            if state_dict[name] is not None:
                value = state_dict[name].to(device=self._device, dtype=self._dtype)
                setattr(self, name, nn.Parameter(value.clone()))


class StateDictMixin(StateDict):
    """The state of a parametric Laplace: the curvature, loss, data count and hyperparameters.

    The identity also holds the names and shapes of the parameters (the architecture).
    """

    _state_other_tensors = ("H", "loss", "prior_mean", "prior_precision", "sigma_noise")
    _state_counts = ("n_data", "n_outputs")

    def _state_identity(self) -> dict[str, Any]:
        return {
            **super()._state_identity(),
            "param_names": list(self._subset.names),
            "param_shapes": [list(p.shape) for p in self._subset.params],
        }

    def _state_value_keys(self) -> tuple[str, ...]:
        return PARAMETRIC_VALUES

    def _state_values(self) -> dict[str, Any]:
        layout = self._likelihood_model.outputs.found
        return {
            **({} if layout is None else {"output_layout": layout}),
            "H": self._curvature_state(),
            "loss": torch.as_tensor(self.loss).detach(),
            "n_data": int(self.n_data),
            "n_outputs": int(self.n_outputs),
            "prior_mean": self.prior_mean.detach(),
            "prior_precision": self.prior_precision.detach(),
            "sigma_noise": self.sigma_noise.detach(),
            "temperature": float(self.temperature),
            "enable_backprop": bool(self.enable_backprop),
        }

    def _check_state_values(self, state_dict: dict[str, Any]) -> None:
        check_bool(state_dict["enable_backprop"], "state_dict['enable_backprop']")
        OutputAdapter.check_found(state_dict.get("output_layout"))

    def _load_state_values(self, state_dict: dict[str, Any]) -> None:
        self.H = self._load_curvature_state(state_dict["H"])
        self.loss = state_dict["loss"].to(device=self._device, dtype=self._dtype)
        self.n_data = int(state_dict["n_data"])
        self.n_outputs = int(state_dict["n_outputs"])
        self.prior_mean = state_dict["prior_mean"]
        self.prior_precision = state_dict["prior_precision"]
        self.sigma_noise = state_dict["sigma_noise"]
        self.temperature = float(check_temperature(state_dict["temperature"]))
        self.enable_backprop = bool(state_dict["enable_backprop"])
        self._likelihood_model.outputs.remember(state_dict.get("output_layout"))
        self._posterior_cache = None

    def _curvature_state(self) -> Any:
        """The fitted curvature as the posterior structure saves it."""
        return self._posterior_cls.state(self.H)

    def _load_curvature_state(self, state: Any) -> Any:
        """The fitted curvature from a saved one, checked by the posterior structure."""
        return self._posterior_cls.load_state(
            state, self._zero_curvature(), **self._structure_options
        )
