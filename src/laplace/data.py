"""Batches as users give them: ``(X, y)`` tuples or dict-like (HuggingFace) mappings."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace.errors import (
    ArgumentTypeError,
    DataError,
    MetaDeviceError,
    MissingKeyError,
    ModelOutputError,
)

__all__ = [
    "Inputs",
    "batch_size_of",
    "check_outputs",
    "dataset_size",
    "move_inputs",
    "prepare_batch",
    "prepare_inputs",
    "split_batch",
]

#: Model inputs: a tensor, or a mapping whose values the model reads by key.
Inputs = Tensor | MutableMapping[str, Any]


def split_batch(batch: Any, dict_key_x: str | None, dict_key_y: str) -> tuple[Inputs, Tensor]:
    """Split a loader batch into model inputs and targets.

    Args:
        batch: ``(X, y)`` (tuple or list) or a mapping holding ``dict_key_x`` and ``dict_key_y``
            (the whole mapping is then the model input, as HuggingFace models expect).
        dict_key_x: Key of the input tensor in a mapping batch; None: not checked.
        dict_key_y: Key of the targets in a mapping batch.

    Returns:
        ``(X, y)``.

    Raises:
        MissingKeyError: (a ``KeyError`` and a ``ValueError``) if a mapping batch lacks
            ``dict_key_x`` or ``dict_key_y``.
        ValueError: If a tuple batch is not a pair.
    """
    if isinstance(batch, MutableMapping):
        for argument, key in (("dict_key_x", dict_key_x), ("dict_key_y", dict_key_y)):
            if key is not None and key not in batch:
                raise MissingKeyError(
                    f"dict-like batch has no entry under {argument}={key!r}; its keys are "
                    f"{sorted(batch.keys())}."
                )
        return batch, batch[dict_key_y]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        "each batch must be an (X, y) pair or a dict-like object with the keys "
        f"dict_key_x={dict_key_x!r} and dict_key_y={dict_key_y!r}; got {type(batch).__name__}."
    )


def batch_size_of(X: Inputs, dict_key_x: str) -> int:
    """Number of data points in model inputs ``X``."""
    if isinstance(X, MutableMapping):
        if dict_key_x in X:
            return len(X[dict_key_x])
        first = next(v for v in X.values() if isinstance(v, Tensor))
        return len(first)
    return len(X)


def move_inputs(X: Inputs, device: torch.device) -> Inputs:
    """Move model inputs to ``device``; mappings are moved value by value.

    Raises:
        ArgumentTypeError: (a ``ValueError`` and a ``TypeError``) if ``X`` is neither a tensor
            nor a dict-like batch.
        MetaDeviceError: For tensors on the ``meta`` device (they hold no values).
    """
    if isinstance(X, MutableMapping):
        moved = type(X)() if type(X) is dict else X.__class__(X)
        for key, value in X.items():
            moved[key] = _to_device(value, device, f"inputs[{key!r}]")
        return moved
    if not isinstance(X, Tensor):
        raise ArgumentTypeError(
            f"inputs must be a torch.Tensor of shape (B, ...) or a dict-like batch, got "
            f"{type(X).__name__}."
        )
    return _to_device(X, device, "inputs")


def _to_device(value: Any, device: torch.device, name: str) -> Any:
    if not isinstance(value, Tensor):
        return value
    if value.device.type == "meta" and torch.device(device).type != "meta":
        raise MetaDeviceError(
            f"the {name} are on the meta device and hold no values; give tensors with values "
            f"(on any device: they are moved to the model's device, {device})."
        )
    return value.to(device)


def _tensors(X: Inputs) -> list[Tensor]:
    if isinstance(X, MutableMapping):
        return [v for v in X.values() if isinstance(v, Tensor)]
    return [X]


def _check_finite(X: Inputs, what: str) -> None:
    """Refuse floating-point inputs with NaN or inf entries.

    Raises:
        DataError: (a ``ValueError`` and a ``RuntimeError``) naming ``what``.
    """
    for t in _tensors(X):
        if t.is_complex() or (t.is_floating_point() and not bool(torch.isfinite(t).all())):
            kind = "complex values" if t.is_complex() else "NaN or inf values"
            raise DataError(f"the {what} contain {kind}.")


def prepare_batch(
    batch: Any, dict_key_x: str | None, dict_key_y: str, device: torch.device
) -> tuple[Inputs, Tensor]:
    """A loader batch as ``(X, y)`` on ``device``, checked before any model call.

    Args:
        batch: ``(X, y)`` or a dict-like batch (see :func:`split_batch`).
        dict_key_x: Key of the inputs in a dict-like batch.
        dict_key_y: Key of the targets in a dict-like batch.
        device: The model's device.

    Raises:
        DataError: (a ``ValueError`` and a ``RuntimeError``) for NaN/inf or complex values, or
            inputs and targets with different numbers of data points.
        ArgumentTypeError: For targets that are not a tensor.
        MetaDeviceError: For tensors on the ``meta`` device.
    """
    X, y = split_batch(batch, dict_key_x, dict_key_y)
    if not isinstance(y, Tensor):
        raise ArgumentTypeError(f"the targets must be a torch.Tensor, got {type(y).__name__}.")
    X, y = move_inputs(X, device), _to_device(y, device, "targets")
    _check_finite(X, "training inputs")
    _check_finite(y, "training targets")
    n_inputs = batch_size_of(X, dict_key_x)
    if y.dim() == 0 or len(y) != n_inputs:
        raise DataError(
            f"a batch holds {n_inputs} inputs but targets of shape {tuple(y.shape)}; the "
            "targets need one row per input."
        )
    return X, y


def prepare_inputs(X: Inputs, dict_key_x: str, device: torch.device, what: str) -> Inputs:
    """Test inputs on ``device``, checked to hold at least one finite data point.

    Raises:
        ValueError: For an empty batch; a :class:`DataError` for NaN/inf values.
        ArgumentTypeError: If ``X`` is neither a tensor nor a dict-like batch.
        MetaDeviceError: For tensors on the ``meta`` device.
    """
    X = move_inputs(X, device)
    if batch_size_of(X, dict_key_x) == 0:
        raise ValueError(f"{what} needs at least one input, got an empty batch.")
    _check_finite(X, f"inputs of the {what}")
    return X


def check_outputs(f: Any, n_inputs: int) -> Tensor:
    """Return the model's output ``f`` for ``n_inputs`` data points if it is (B, C, ...).

    Raises:
        ModelOutputError: (a ``TypeError`` and an ``AttributeError``) if it is not a tensor,
            e.g. a tuple or a dict of outputs.
        DataError: (a ``ValueError`` and a ``RuntimeError``) if it is not a floating-point
            tensor with one row per input and an output dimension.
    """
    if not isinstance(f, Tensor):
        raise ModelOutputError(
            f"the model must return a tensor of outputs of shape (B, C); it returned a "
            f"{type(f).__name__}. Wrap it in a module whose forward returns only the outputs "
            "(e.g. out[0] or out['logits'])."
        )
    if f.dim() < 2 or f.shape[0] != n_inputs or not f.is_floating_point():
        raise DataError(
            f"the model returned a {f.dtype} tensor of shape {tuple(f.shape)} for a batch of "
            f"{n_inputs} inputs; it must return floating-point outputs of shape (B, C) with "
            f"B = {n_inputs} (shape (B, 1) for one output)."
        )
    return f


def dataset_size(loader: DataLoader) -> int:
    """``len(loader.dataset)``, with a clear error when the loader has no sized dataset.

    Raises:
        ArgumentTypeError: (a ``ValueError`` and a ``TypeError``) if ``loader`` is not a data
            loader (it has no ``dataset``).
        ValueError: If its dataset has no length.
    """
    if not hasattr(loader, "dataset"):
        raise ArgumentTypeError(
            "train_loader must be a torch.utils.data.DataLoader (the data count N is "
            f"len(train_loader.dataset)), got {type(loader).__name__}."
        )
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError) as error:
        raise ValueError(
            "the training data count is taken from len(train_loader.dataset); this loader's "
            "dataset has no length."
        ) from error
