"""Fitting and tuning across the processes of ``torch.distributed``.

Each rank sums over its shard, the sums are all-reduced, and every rank holds the posterior of
the whole data (docs/distributed.md: the opt-in rule, shards, failures).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from laplace.utils.data import dataset_size
from laplace.utils.errors import check_bool

__all__ = [
    "DistributedFitError",
    "all_gather",
    "all_reduce_sum",
    "check_consistent",
    "data_count",
    "guard",
    "is_distributed",
    "resolve",
    "shard_dataset",
    "total_data_count",
    "unwrap_model",
]

T = TypeVar("T")


class DistributedFitError(RuntimeError):
    """Another rank failed during a distributed fit, prediction or tuning step."""


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is initialised with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def resolve(distributed: bool | None, loader: DataLoader | None = None) -> bool:
    """Whether a pass is distributed (all-reduces its sums).

    ``distributed`` None: whether the process group has several ranks and ``loader``'s sampler
    is a ``DistributedSampler``.

    Raises:
        RuntimeError: For ``distributed=True`` without an initialised process group.
        ArgumentTypeError: For a value other than None, True or False.
    """
    if distributed is None:
        sampler = getattr(loader, "sampler", None)
        return is_distributed() and isinstance(sampler, DistributedSampler)
    check_bool(distributed, "distributed")
    if distributed and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "distributed=True needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first (e.g. under torchrun)."
        )
    return distributed


def data_count(loader: DataLoader) -> int:
    """Data points of this rank: ``len(sampler)`` for a DistributedSampler, else the dataset's."""
    if isinstance(getattr(loader, "sampler", None), DistributedSampler):
        return len(loader.sampler)
    return dataset_size(loader)


def total_data_count(loader: DataLoader, distributed: bool) -> int:
    """Data points of all ranks together when ``distributed``, else those of ``loader``."""
    return all_reduce_sum(data_count(loader)) if distributed else dataset_size(loader)


def _reduce(tensor: Tensor, op: dist.ReduceOp.RedOpType | None = None) -> Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op)
    return tensor


def all_reduce_sum(value: T, device: torch.device | None = None) -> T:
    """Sum ``value`` over all ranks, without modifying it; every rank gets the result.

    ``value`` is a tensor, a number, a ``Kron``, a ``DiagLowRank`` (its diagonal summed, its
    columns gathered) or a nested list/tuple of these; one flat buffer per dtype.
    """
    from laplace.utils.diag_lowrank import DiagLowRank
    from laplace.utils.matrix import Kron

    if isinstance(value, (int, float)):
        dtype = torch.float64 if isinstance(value, float) else torch.int64
        out = _reduce(torch.tensor([value], dtype=dtype, device=_collective_device(device)))
        return cast(T, type(value)(out.item()))
    if isinstance(value, Tensor):
        return cast(T, _reduce(value.detach().clone()))
    leaves: list[Tensor] = []

    def collect(v: object) -> None:
        if isinstance(v, Kron):
            collect(v.kfacs)
        elif isinstance(v, DiagLowRank):  # the sign of a rank with columns wins the sum
            sign = v.diag.new_tensor([float(v.sign) if v.rank else 0.0])
            leaves.extend([v.diag.detach(), v.dropped.detach().reshape(1), sign])
        elif isinstance(v, (list, tuple)):
            for item in v:
                collect(item)
        elif isinstance(v, Tensor):
            leaves.append(v.detach())
        else:
            raise TypeError(f"cannot all-reduce a {type(v).__name__}.")

    collect(value)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_dtype.setdefault(leaf.dtype, []).append(i)
    reduced: list[Tensor | None] = [None] * len(leaves)
    for indices in by_dtype.values():
        flat = _reduce(torch.cat([leaves[i].reshape(-1) for i in indices]))
        for i, chunk in zip(
            indices, flat.split([leaves[i].numel() for i in indices]), strict=True
        ):
            reduced[i] = chunk.reshape(leaves[i].shape)
    it = iter(reduced)

    def rebuild(v: object) -> object:
        if isinstance(v, Kron):
            return type(v)(cast(list[list[Tensor]], rebuild(v.kfacs)))
        if isinstance(v, DiagLowRank):
            diag, dropped, sign = next(it), next(it), next(it)
            U = all_gather(v.U.detach().T.contiguous()).T
            return DiagLowRank(diag, U, -1 if sign < 0 else 1, v.max_rank, dropped.reshape(()))
        if isinstance(v, (list, tuple)):
            return type(v)(rebuild(item) for item in v)
        return next(it)

    return cast(T, rebuild(value))


@contextmanager
def guard(active: bool, what: str = "fit", device: torch.device | None = None) -> Iterator[None]:
    """Run a local step; then every rank raises if any rank's step raised (when ``active``).

    The failed rank re-raises its own exception, the others a ``DistributedFitError`` naming it.
    """
    if not active:
        yield
        return
    error: BaseException | None = None
    try:
        yield
    except Exception as exc:  # every rank must reach the collective below
        error = exc
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = torch.zeros(world, dtype=torch.int64, device=_collective_device(device))
    failed[rank] = int(error is not None)
    try:
        _reduce(failed)
    except RuntimeError as lost:  # a peer crashed or the process group timed out
        raise DistributedFitError(
            f"distributed {what}: rank {rank} lost contact with the other ranks (one crashed "
            f"or did not reach the {what} within the process group's timeout): {lost}"
        ) from lost
    if error is not None:
        raise error
    if bool(failed.any()):
        ranks = failed.nonzero().flatten().tolist()
        raise DistributedFitError(
            f"distributed {what}: rank(s) {ranks} failed during the local pass (see their "
            f"error); rank {rank} stops too."
        )


def check_consistent(
    values: Mapping[str, object],
    what: str = "fit",
    remedy: str = "build the approximation with the same arguments on every rank",
) -> None:
    """Raise on every rank if ranks hold different ``values`` (name → number, string or tensor).

    ``remedy`` ends the message: what the user should do.

    Raises:
        DistributedFitError: Naming the values that differ, on every rank.
    """
    digests = [  # of the text, or of the float64 entries (a differing length differs too)
        zlib.crc32(
            value.encode()
            if isinstance(value, str)
            else torch.as_tensor(value, dtype=torch.float64).detach().cpu().numpy().tobytes()
        )
        for value in values.values()
    ]
    low = torch.tensor(digests, dtype=torch.float64, device=_collective_device(None))
    high = _reduce(low.clone(), dist.ReduceOp.MAX)
    _reduce(low, dist.ReduceOp.MIN)
    differ = [name for name, lo, hi in zip(values, low, high, strict=True) if lo != hi]
    if differ:
        mine = {name: values[name] for name in differ}
        raise DistributedFitError(
            f"distributed {what}: the ranks hold different {differ} (rank {dist.get_rank()} "
            f"has {mine}); {remedy}."
        )


def _collective_device(device: torch.device | None) -> torch.device:
    """CPU for gloo, the current CUDA device for NCCL (unless ``device`` is given)."""
    if device is not None:
        return device
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather(tensor: Tensor) -> Tensor:
    """Concatenate ``tensor`` (n_rank, ...) of every rank along dim 0, in rank order.

    Ranks may hold different numbers of rows; without a process group ``tensor`` is returned.
    """
    if not is_distributed():
        return tensor
    sizes = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    all_sizes = [torch.zeros_like(sizes) for _ in range(dist.get_world_size())]
    dist.all_gather(all_sizes, sizes)
    counts = [int(s.item()) for s in all_sizes]
    padded = tensor.new_zeros((max(counts), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor.detach()
    buffers = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(buffers, padded)
    return torch.cat([b[:n] for b, n in zip(buffers, counts, strict=True)])


def shard_dataset(dataset: Dataset, rank: int | None = None, world_size: int | None = None):
    """This rank's shard ``dataset[rank::world_size]`` as a ``Subset`` (no point repeated).

    Defaults: the current process group's rank and world size.
    """
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    return Subset(dataset, list(range(rank, len(dataset), world_size)))


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` (or ``DataParallel``) wrapper."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return model.module
    return model
