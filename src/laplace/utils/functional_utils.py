"""laplace-torch 0.3's ``laplace.utils.functional_utils`` path: helpers of ELLA and VaLLA.

A façade for code that imports these names from here: each is the library's own helper from the
module that owns it (nothing inside the package imports this module).
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

import torch
from torch import Tensor

from laplace.core.transaction import preserve_model_gradients
from laplace.likelihoods import Categorical, GaussianRegression
from laplace.utils import data
from laplace.utils.data import (
    Inputs,
    batch_size_of,
    concatenate_rows,
    select_rows,
    subset_loader,
    to_device,
    training_indices,
)
from laplace.utils.predictive import draw_gaussian

__all__ = [
    "batch_size",
    "classification_targets",
    "concatenate_rows",
    "draw_gaussian",
    "preserve_model_gradients",
    "regression_targets",
    "same_configuration",
    "select_rows",
    "split_batch",
    "subset_loader",
    "to_device",
    "training_indices",
]


def same_configuration(left: object, right: object) -> bool:
    """Whether two nested settings (tensors, mappings, lists, tuples, plain values) are equal.

    Tensors compare equal only to tensors with the same shape and values; sequences only to
    sequences of the same type.
    """
    if isinstance(left, Tensor) or isinstance(right, Tensor):
        return isinstance(left, Tensor) and isinstance(right, Tensor) and torch.equal(left, right)
    if isinstance(left, MutableMapping) and isinstance(right, MutableMapping):
        return left.keys() == right.keys() and all(
            same_configuration(left[k], right[k]) for k in left
        )
    if isinstance(left, (tuple, list)) and isinstance(right, type(left)):
        return len(left) == len(right) and all(
            same_configuration(a, b) for a, b in zip(left, right)
        )
    return left == right


def split_batch(
    batch: Sequence[Tensor] | Inputs, dict_key_y: str, dict_key_x: str | None = None
) -> tuple[Inputs, Tensor]:
    """``(inputs, targets)`` of a batch: a mapping is kept whole as input, else ``batch[:2]``.

    Raises:
        MissingKeyError: (a ``KeyError`` and a ``ValueError``) if a mapping lacks
            ``dict_key_y`` or a given ``dict_key_x``.
    """
    if isinstance(batch, MutableMapping):
        return data.split_batch(batch, dict_key_x, dict_key_y)
    return batch[0], batch[1]


def regression_targets(targets: Tensor, outputs: Tensor) -> Tensor:
    """Targets of the shape of ``outputs`` (B, C), returned unchanged.

    Raises:
        ValueError: If the shapes differ (no reshaping, no broadcasting: (B,) targets for
            (B, 1) outputs are refused, as in the parametric classes).
    """
    return GaussianRegression().prepare_targets(outputs, targets)


def classification_targets(targets: Tensor) -> Tensor:
    """Class indices (B,) as ``long`` from indices (B,), a column (B, 1) or one-hot (B, C).

    Raises:
        ValueError: For any other shape.
    """
    return Categorical.class_indices(targets)


def batch_size(inputs: Inputs, dict_key_x: str) -> int:
    """Leading dimension of a tensor, or of ``inputs[dict_key_x]`` for a mapping."""
    return batch_size_of(inputs, dict_key_x)
