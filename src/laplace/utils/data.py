"""Batches as users give them: ``(X, y)`` tuples or dict-like (HuggingFace) mappings."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any, TypeVar, cast, overload

import numpy as np
import torch
from torch import Tensor
from torch.utils._pytree import tree_map_only
from torch.utils.data import (
    DataLoader,
    RandomSampler,
    Sampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
)

from laplace.utils.errors import (
    ArgumentTypeError,
    DataError,
    MetaDeviceError,
    MissingKeyError,
    ModelOutputError,
)

__all__ = [
    "HALF_DTYPES",
    "Inputs",
    "SoDSampler",
    "batch_size_of",
    "check_outputs",
    "concatenate_rows",
    "dataset_size",
    "input_chunks",
    "move_inputs",
    "posterior_dtype",
    "prepare_batch",
    "prepare_inputs",
    "select_rows",
    "slice_inputs",
    "split_batch",
    "subset_loader",
    "to_device",
    "training_indices",
    "upcast",
]

#: Model inputs: a tensor, or a mapping whose values the model reads by key. The values are of
#: any type, and not typed as ``object``: mappings are invariant in their values, and a user's
#: ``dict[str, Tensor]`` must be one.
Inputs = Tensor | MutableMapping[str, Any]

T = TypeVar("T")


#: Half-precision types a network may run in; curvature and posterior are computed in float32.
HALF_DTYPES = (torch.bfloat16, torch.float16)


def posterior_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type quantities of a network running in ``dtype`` are computed in (float32 for half)."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def upcast(value: T, dtype: torch.dtype | None = None) -> T:
    """Floating-point tensors of a pytree in ``dtype`` (None: half precision in float32)."""

    def cast(t: Tensor) -> Tensor:
        return t.to(dtype or posterior_dtype(t.dtype)) if t.is_floating_point() else t

    return tree_map_only(Tensor, cast, value)


def split_batch(batch: object, dict_key_x: str | None, dict_key_y: str) -> tuple[Inputs, Tensor]:
    """Split a loader batch, ``(X, y)`` or a mapping (then the whole model input), into ``(X, y)``.

    ``dict_key_x`` (None: not checked) and ``dict_key_y`` are the keys of a mapping batch.

    Raises:
        MissingKeyError: If a mapping batch lacks ``dict_key_x`` or ``dict_key_y``.
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
        return len(next(v for v in X.values() if isinstance(v, Tensor)))
    return len(X)


@overload
def move_inputs(X: Tensor, device: torch.device) -> Tensor: ...


@overload
def move_inputs(X: Inputs, device: torch.device) -> Inputs: ...


def move_inputs(X: Inputs, device: torch.device) -> Inputs:
    """Move model inputs to ``device``; mappings are moved value by value.

    Raises:
        ArgumentTypeError: If ``X`` is neither a tensor nor a dict-like batch.
        MetaDeviceError: For tensors on the ``meta`` device.
    """
    if isinstance(X, MutableMapping):
        moved = X.__class__(X)
        for key, value in X.items():
            moved[key] = _to_device(value, device, f"inputs[{key!r}]")
        return moved
    if not isinstance(X, Tensor):
        raise ArgumentTypeError(
            f"inputs must be a torch.Tensor of shape (B, ...) or a dict-like batch, got "
            f"{type(X).__name__}."
        )
    return _to_device(X, device, "inputs")


@overload
def _to_device(value: Tensor, device: torch.device, name: str) -> Tensor: ...


@overload
def _to_device(value: object, device: torch.device, name: str) -> object: ...


def _to_device(value: object, device: torch.device, name: str) -> object:
    if not isinstance(value, Tensor):
        return value
    if value.device.type == "meta" and torch.device(device).type != "meta":
        raise MetaDeviceError(
            f"the {name} are on the meta device and hold no values; give tensors with values "
            f"(on any device: they are moved to the model's device, {device})."
        )
    return value.to(device)


@overload
def to_device(value: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor: ...


@overload
def to_device(value: Inputs, device: torch.device, dtype: torch.dtype) -> Inputs: ...


@overload
def to_device(value: object, device: torch.device, dtype: torch.dtype) -> object: ...


def to_device(value: object, device: torch.device, dtype: torch.dtype) -> object:
    """Move a nested input's tensors to ``device``, floating ones to ``dtype``; mappings: dict."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else None)
    if isinstance(value, MutableMapping):
        return {k: to_device(v, device, dtype) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device, dtype) for v in value)
    return value


def slice_inputs(X: Inputs, start: int, stop: int, n: int) -> Inputs:
    """Rows ``start:stop`` of inputs with ``n`` rows; mapping values without n rows are kept."""
    if isinstance(X, MutableMapping):
        out = X.__class__(X)
        for key, value in X.items():
            if isinstance(value, Tensor) and value.dim() > 0 and len(value) == n:
                out[key] = value[start:stop]
        return out
    return X[start:stop]


def input_chunks(X: Inputs, rows: int, dict_key_x: str) -> Iterator[Inputs]:
    """Consecutive chunks of at most ``rows`` data points of ``X``."""
    n = batch_size_of(X, dict_key_x)
    for start in range(0, n, rows):
        yield slice_inputs(X, start, start + rows, n)


@overload
def select_rows(inputs: Inputs, indices: Tensor, batch_size: int) -> Inputs: ...


@overload
def select_rows(inputs: object, indices: Tensor, batch_size: int) -> object: ...


def select_rows(inputs: object, indices: Tensor, batch_size: int) -> object:
    """Rows ``indices`` of every value of ``inputs`` with leading size ``batch_size``."""
    if isinstance(inputs, MutableMapping):
        return {k: select_rows(v, indices, batch_size) for k, v in inputs.items()}
    if isinstance(inputs, Tensor):
        return inputs[indices] if inputs.dim() and inputs.shape[0] == batch_size else inputs
    if isinstance(inputs, (list, tuple)) and len(inputs) == batch_size:
        return type(inputs)(inputs[i] for i in indices.detach().cpu().tolist())
    return inputs


@overload
def concatenate_rows(chunks: list[Tensor]) -> Tensor: ...


@overload
def concatenate_rows(chunks: list[Inputs]) -> Inputs: ...


@overload
def concatenate_rows(chunks: list[object]) -> object: ...


def concatenate_rows(chunks: Sequence[object]) -> object:
    """Concatenate batches of inputs row-wise (mappings key by key; non-batched values once).

    Every chunk is of the kind of the first (the batches of one loader).

    Raises:
        ValueError: For mappings with different keys or differing non-batched values.
    """
    first = chunks[0]
    if isinstance(first, Tensor):
        return torch.cat(cast(list[Tensor], chunks))
    if isinstance(first, MutableMapping):
        mappings = cast(list[MutableMapping[str, object]], chunks)
        if any(c.keys() != first.keys() for c in mappings):
            raise ValueError("mapping batches must have the same keys to be concatenated.")
        return {k: concatenate_rows([c[k] for c in mappings]) for k in first}
    if isinstance(first, (list, tuple)):
        sequences = cast(list[Sequence[object]], chunks)
        return type(first)(item for c in sequences for item in c)
    if all(c == first for c in chunks):
        return first
    raise ValueError("non-batched values differ between the batches; cannot concatenate.")


def _check_finite(X: Inputs, what: str) -> None:
    """Refuse inputs with NaN, inf or complex entries (a ``DataError`` naming ``what``)."""
    for t in X.values() if isinstance(X, MutableMapping) else [X]:
        if not isinstance(t, Tensor):
            continue
        if t.is_complex() or (t.is_floating_point() and not bool(torch.isfinite(t).all())):
            kind = "complex values" if t.is_complex() else "NaN or inf values"
            raise DataError(f"the {what} contain {kind}.")


def prepare_batch(
    batch: object, dict_key_x: str | None, dict_key_y: str, device: torch.device
) -> tuple[Inputs, Tensor]:
    """A loader batch as ``(X, y)`` on ``device`` (``split_batch``), checked before any model call.

    Raises:
        DataError: For NaN/inf or complex values, or inputs and targets of different lengths.
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
        ValueError: For an empty batch.
        DataError: For NaN/inf values.
        ArgumentTypeError: If ``X`` is neither a tensor nor a dict-like batch.
        MetaDeviceError: For tensors on the ``meta`` device.
    """
    X = move_inputs(X, device)
    if batch_size_of(X, dict_key_x) == 0:
        raise ValueError(f"{what} needs at least one input, got an empty batch.")
    _check_finite(X, f"inputs of the {what}")
    return X


def check_outputs(f: object, n_inputs: int) -> Tensor:
    """Return the model's output ``f`` for ``n_inputs`` data points if it is (B, C, ...).

    Raises:
        ModelOutputError: If it is not a tensor, e.g. a tuple or a dict of outputs.
        DataError: If it is not a floating-point tensor (B, C, ...) with B = ``n_inputs``.
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
        ArgumentTypeError: If ``loader`` has no ``dataset``.
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


class SoDSampler(Sampler):
    """Sampler over ``M`` of ``N`` indices, drawn once without replacement (numpy, ``seed``).

    Raises:
        ValueError: If ``M`` is negative or larger than ``N``.
    """

    def __init__(self, N: int, M: int, seed: int = 0):
        if not 0 <= M <= N:
            raise ValueError(f"need 0 <= M <= N, got N={N}, M={M}.")
        self.N, self.M, self.seed = N, M, seed
        rng = np.random.default_rng(seed)
        self.indices = torch.as_tensor(rng.choice(N, M, replace=False))

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def training_indices(loader: DataLoader) -> Tensor:
    """Dataset indices (n,) the loader's sampler can reach; a permutation is not drawn.

    Raises:
        ValueError: For an empty sampler, out-of-range indices, or a ``drop_last`` batch sampler
            without a positive batch size.
    """
    batch_sampler = loader.batch_sampler
    sampler = loader.sampler if batch_sampler is None else getattr(batch_sampler, "sampler", None)
    n = len(loader.dataset)
    if sampler is None:
        indices = [i for batch in batch_sampler for i in batch]
    elif isinstance(sampler, SequentialSampler):
        indices = list(range(n))
        if getattr(batch_sampler, "drop_last", False):
            size = getattr(batch_sampler, "batch_size", None)
            if not isinstance(size, int) or size <= 0:
                raise ValueError("a drop_last batch sampler needs a positive batch_size.")
            indices = indices[: len(batch_sampler) * size]
    elif (
        isinstance(sampler, RandomSampler) and not sampler.replacement and sampler.num_samples == n
    ):
        indices = list(range(n))
    elif isinstance(sampler, SubsetRandomSampler):
        indices = list(sampler.indices)
    else:
        indices = list(sampler)
    result = torch.as_tensor(indices, dtype=torch.long)
    if result.dim() != 1 or result.numel() == 0:
        raise ValueError("the training loader's sampler yields no indices.")
    if bool((result < 0).any()) or bool((result >= n).any()):
        raise ValueError(f"the training sampler yields indices outside [0, {n}).")
    return result


def subset_loader(loader: DataLoader, indices: Tensor) -> DataLoader:
    """A non-shuffled loader over ``loader.dataset[indices]``, same batch size and collate."""
    size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", 1)
    return DataLoader(
        Subset(loader.dataset, indices.cpu().tolist()),
        batch_size=size,
        collate_fn=loader.collate_fn,
        shuffle=False,
    )


def in_fixed_order(loader: DataLoader) -> DataLoader:
    """``loader``, or a loader over the same points in order where it shuffles on every pass.

    Iterative solvers multiply with the curvature over many passes and keep some batches
    between them, so every pass must yield the same batches; a ``RandomSampler`` (``shuffle``)
    or ``SubsetRandomSampler`` draws a new order each time and is read in order instead.
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(loader, "sampler", None) if batch_sampler is None else None
    sampler = getattr(batch_sampler, "sampler", sampler)
    if isinstance(sampler, (RandomSampler, SubsetRandomSampler)):
        return subset_loader(loader, training_indices(loader))
    return loader
