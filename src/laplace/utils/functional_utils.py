"""Input, target and sampling helpers of the function-space estimators (ELLA, VaLLA).

The names and behaviour are laplace-torch 0.3's ``laplace.utils.functional_utils``.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from functools import wraps
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import (
    DataLoader,
    RandomSampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
)

from laplace import data
from laplace.data import batch_size_of
from laplace.likelihoods import GaussianRegression

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


def preserve_model_gradients(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a method of an object with a ``model`` so it leaves ``param.grad`` untouched.

    The ``.grad`` of every parameter (``None`` included) is restored after the call, also when
    it raises.
    """

    @wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = list(self.model.parameters())
        saved = [None if p.grad is None else p.grad.detach().clone() for p in params]
        try:
            return method(self, *args, **kwargs)
        finally:
            for p, grad in zip(params, saved):
                p.grad = grad

    return wrapped


def same_configuration(left: Any, right: Any) -> bool:
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


def _psd_root(cov: Tensor) -> Tensor:
    """A root ``R`` with ``R Rᵀ = cov`` of a symmetric PSD matrix (batch), singular allowed."""
    root, info = torch.linalg.cholesky_ex(cov)
    if not bool((info != 0).any()):
        return root
    values, vectors = torch.linalg.eigh(cov.detach() if cov.requires_grad else cov)
    size = cov.shape[-1]
    tol = 10 * torch.finfo(cov.dtype).eps * size * values.abs().amax(-1, keepdim=True)
    if bool((values < -tol).any()):
        raise torch.linalg.LinAlgError("the covariance has negative eigenvalues: it is not PSD.")
    if not cov.requires_grad:
        return vectors * values.clamp_min(0).sqrt().unsqueeze(-2)
    # Differentiable: the smallest diagonal jitter that makes the Cholesky succeed.
    scale = cov.diagonal(dim1=-2, dim2=-1).detach().abs().amax(-1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    shift = -values.amin(-1).clamp_max(0)
    eye = torch.eye(size, dtype=cov.dtype, device=cov.device)
    for multiplier in (1, 10, 100):
        jitter = shift + multiplier * torch.finfo(cov.dtype).eps * scale
        root, info = torch.linalg.cholesky_ex(cov + jitter[..., None, None] * eye)
        if not bool((info != 0).any()):
            return root
    raise RuntimeError("could not factor the differentiable covariance, even with jitter.")


def draw_gaussian(
    mean: Tensor, covariance: Tensor, n_samples: int, generator: torch.Generator | None
) -> Tensor:
    """Draw from ``N(mean, covariance)``, also when the covariance is singular.

    Args:
        mean: (B, C), or a joint mean (B·C,).
        covariance: (B, C, C), or a joint covariance (B·C, B·C).
        n_samples: Number of draws S.
        generator: Random number generator on the device of ``mean``.

    Returns:
        Draws (S, B, C), or (S, B·C) for a joint mean.

    Raises:
        torch.linalg.LinAlgError: If the covariance has clearly negative eigenvalues.
        RuntimeError: If a covariance that requires grad cannot be factored with jitter.
    """
    root = _psd_root((covariance + covariance.transpose(-1, -2)) / 2)
    noise = torch.randn(
        (n_samples, *mean.shape), dtype=mean.dtype, device=mean.device, generator=generator
    )
    if mean.dim() == 1:
        return mean + noise @ root.T
    return mean + torch.einsum("bij,sbj->sbi", root, noise)


def to_device(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Move the tensors of a nested input to ``device``; floating tensors also to ``dtype``.

    Mappings become ``dict``; lists and tuples keep their type; other values are returned as
    they are.
    """
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else None)
    if isinstance(value, MutableMapping):
        return {k: to_device(v, device, dtype) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device, dtype) for v in value)
    return value


def split_batch(batch: Any, dict_key_y: str, dict_key_x: str | None = None) -> tuple[Any, Tensor]:
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
    if targets.dim() == 2:
        targets = targets[:, 0] if targets.shape[1] == 1 else targets.argmax(-1)
    if targets.dim() != 1:
        raise ValueError(
            f"classification targets must have shape (B,) or (B, C), got {tuple(targets.shape)}."
        )
    return targets.long()


def training_indices(loader: DataLoader) -> Tensor:
    """Dataset indices the loader's sampler can reach, shape (n,), ``long``.

    A sequential sampler gives ``0..N-1`` (cut to whole batches with ``drop_last``); a random
    permutation sampler the same without consuming its generator; a ``SubsetRandomSampler`` its
    indices; any other sampler is iterated once.

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


def batch_size(inputs: Any, dict_key_x: str) -> int:
    """Leading dimension of a tensor, or of ``inputs[dict_key_x]`` for a mapping."""
    return batch_size_of(inputs, dict_key_x)


def concatenate_rows(chunks: list[Any]) -> Any:
    """Concatenate batches of inputs row-wise.

    Tensors are concatenated along dim 0, mappings key by key, lists and tuples (one entry per
    row) chained; other values must be equal in every chunk and are kept once.

    Raises:
        ValueError: For mappings with different keys or differing non-batched values.
    """
    first = chunks[0]
    if isinstance(first, Tensor):
        return torch.cat(chunks)
    if isinstance(first, MutableMapping):
        if any(c.keys() != first.keys() for c in chunks):
            raise ValueError("mapping batches must have the same keys to be concatenated.")
        return {k: concatenate_rows([c[k] for c in chunks]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(item for c in chunks for item in c)
    if all(c == first for c in chunks):
        return first
    raise ValueError("non-batched values differ between the batches; cannot concatenate.")


def select_rows(inputs: Any, indices: Tensor, batch_size: int) -> Any:
    """Rows ``indices`` of every batched value (leading size ``batch_size``) of ``inputs``.

    Values without that leading size (constants, metadata) are returned unchanged.
    """
    if isinstance(inputs, MutableMapping):
        return {k: select_rows(v, indices, batch_size) for k, v in inputs.items()}
    if isinstance(inputs, Tensor):
        return inputs[indices] if inputs.dim() and inputs.shape[0] == batch_size else inputs
    if isinstance(inputs, (list, tuple)) and len(inputs) == batch_size:
        return type(inputs)(inputs[i] for i in indices.detach().cpu().tolist())
    return inputs
