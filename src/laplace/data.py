"""Batches as users give them: ``(X, y)`` tuples or dict-like (HuggingFace) mappings."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace.errors import MissingKeyError

__all__ = ["Inputs", "batch_size_of", "dataset_size", "move_inputs", "split_batch"]

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
    """Move model inputs to ``device``; mappings are moved value by value."""
    if isinstance(X, MutableMapping):
        moved = type(X)() if type(X) is dict else X.__class__(X)
        for key, value in X.items():
            moved[key] = value.to(device) if isinstance(value, Tensor) else value
        return moved
    return X.to(device)


def dataset_size(loader: DataLoader) -> int:
    """``len(loader.dataset)``, with a clear error when the loader has no sized dataset."""
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError) as error:
        raise ValueError(
            "the training data count is taken from len(train_loader.dataset); this loader's "
            "dataset has no length."
        ) from error
