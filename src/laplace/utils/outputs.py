"""Outputs with extra dimensions: how a model's outputs map to the likelihood's independent rows.

Outputs (B, C, H, W) or (B, T, C) are seen by the likelihood as rows (B·T, C): the class
dimension moved last, batch and positions flattened (docs/outputs.md). ``OutputAdapter`` finds
the class dimension, ``OutputLayout`` maps one output shape to rows and back, and
``PositionColumns`` are the output-space columns of the exact GGN of the summed per-position loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from laplace.utils.errors import DataError

__all__ = [
    "IGNORE_INDEX",
    "OutputAdapter",
    "OutputLayout",
    "PositionColumns",
    "PositionTargets",
]

#: The label that drops a position, as ``nn.CrossEntropyLoss`` and Hugging Face models use it.
IGNORE_INDEX = -100


class PositionTargets(str, Enum):
    """How a likelihood's targets relate to outputs with extra dimensions.

    ``LABELS`` lack the class dimension (softmax); ``VALUES`` have the outputs' shape.
    """

    LABELS = "labels"
    VALUES = "values"


@dataclass(frozen=True)
class OutputLayout:
    """The rows of one output shape.

    Attributes:
        shape: The outputs of one data point, without the batch dimension.
        class_dim: Index of the class (output) dimension in ``shape``.
        ignore_index: The label that drops a position; None where targets are not labels.
    """

    shape: tuple[int, ...]
    class_dim: int
    ignore_index: int | None = None

    @property
    def plain(self) -> bool:
        """Whether the outputs are (B, C): rows are the outputs themselves."""
        return len(self.shape) == 1

    @property
    def n_classes(self) -> int:
        """C, the size of the class dimension."""
        return self.shape[self.class_dim]

    @property
    def n_positions(self) -> int:
        """T, the number of positions (rows) per data point."""
        return self.size // self.n_classes

    @property
    def size(self) -> int:
        """Outputs per data point, T·C."""
        return math.prod(self.shape)

    def rows(self, f: Tensor) -> Tensor:
        """Outputs (..., B, *shape) as rows (..., B·T, C), rows in (data point, position) order."""
        if self.plain:
            return f
        k = len(self.shape)
        moved = f.movedim(self.class_dim - k, -1)
        return moved.reshape(*f.shape[: f.dim() - k - 1], -1, self.n_classes)

    def restore(self, rows: Tensor) -> Tensor:
        """Rows (..., B·T, C) back to outputs (..., B, *shape); inverse of ``rows``."""
        if self.plain:
            return rows
        positions = self.shape[: self.class_dim] + self.shape[self.class_dim + 1 :]
        out = rows.reshape(*rows.shape[:-2], -1, *positions, self.n_classes)
        return out.movedim(-1, self.class_dim - len(self.shape))

    def targets(self, y: Tensor) -> Tensor:
        """Targets of the rows: labels (B·T,), or values / class probabilities (B·T, C)."""
        if self.plain:
            return y
        if tuple(y.shape[1:]) == self.shape:
            return self.rows(y)
        if self.ignore_index is None:
            raise DataError(
                f"targets of shape {tuple(y.shape)} do not match the outputs of shape "
                f"(B, {', '.join(map(str, self.shape))}): give targets of the outputs' shape."
            )
        return y.reshape(-1)

    def split(self, f: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Rows (B·T, C) of outputs ``f`` (B, *shape), their targets and which rows count.

        Returns:
            The rows, their targets (dropped labels set to 0), and a boolean mask (B·T,) of the
            rows that count, or None when all do.
        """
        return (self.rows(f), *self.labelled(y))

    def labelled(self, y: Tensor) -> tuple[Tensor, Tensor | None]:
        """Targets of the rows with dropped labels set to 0, and the mask of ``kept``."""
        targets = self.targets(y)
        keep = self.kept(targets)
        if keep is not None:
            targets = targets.masked_fill(~keep.reshape(targets.shape), 0)
        return targets, keep

    def kept(self, targets: Tensor) -> Tensor | None:
        """Mask (rows,) of rows whose label is not ``ignore_index``; None when none is dropped."""
        if self.ignore_index is None or targets.is_floating_point() or targets.dtype == torch.bool:
            return None
        keep = targets.reshape(-1) != self.ignore_index
        return None if bool(keep.all()) else keep

    def columns(self, V: Tensor, separate: bool) -> Tensor | PositionColumns:
        """Output-space columns ``(K', B, *shape)`` from row columns ``V`` (B·T, C, K).

        ``separate`` gives one column per position and row column (``PositionColumns``, the
        exact GGN of the summed loss); otherwise column k covers every position at once.
        """
        if separate and not self.plain and self.n_positions > 1:
            return PositionColumns(V, self)
        return self.restore(V.movedim(-1, 0))

    def jacobian_rows(self, Js: Tensor) -> Tensor:
        """Jacobians (B, T·C, P) of the flattened outputs as rows (B·T, C, P)."""
        if self.plain:
            return Js
        grid = Js.reshape(Js.shape[0], *self.shape, Js.shape[-1]).movedim(-1, 0)
        return self.rows(grid).movedim(0, -1)


class PositionColumns:
    """The T·K position-separated columns of a block-diagonal output Hessian, formed lazily.

    Column ``(t, k)`` is column k of row ``t``'s factor in ``V`` (B·T, C, K), zero at other
    positions; all-zero columns are skipped. Sliced like a tensor (T·K, B, *shape).
    """

    def __init__(self, V: Tensor, layout: OutputLayout) -> None:
        T, C = layout.n_positions, layout.n_classes
        self.layout = layout
        self.factors = V.reshape(-1, T, C, V.shape[-1])
        active = self.factors.detach().abs().amax(dim=(0, 2)) > 0  # (T, K)
        self.index = active.flatten().nonzero().squeeze(1)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, key: int | slice) -> Tensor:
        index = self.index[key]
        if index.dim() == 0:
            return self[key : key + 1 or None][0]
        B, T, C, K = self.factors.shape
        t, k = index // K, index % K
        out = self.factors.new_zeros(len(index), B, T, C)
        out[torch.arange(len(index), device=out.device), :, t, :] = self.factors[:, t, :, k]
        return self.layout.restore(out.reshape(len(index), B * T, C)).contiguous()

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class OutputAdapter:
    """The user's ``class_dim`` and ``ignore_index``, and the class dimension found from data.

    Args:
        class_dim: Dimension of the outputs (B, …) that holds the classes, as torch's ``dim``
            (``1`` for (B, C, H, W)); None: the one the targets lack, else the last one.
        ignore_index: Class label whose positions are dropped (classification targets).

    Raises:
        ValueError: If ``class_dim`` is not an int or None, or ``ignore_index`` not an int.
    """

    def __init__(self, class_dim: int | None = None, ignore_index: int = IGNORE_INDEX) -> None:
        if class_dim is not None and (
            isinstance(class_dim, bool) or not isinstance(class_dim, int)
        ):
            raise ValueError(f"class_dim must be an int or None, got {class_dim!r}.")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise ValueError(f"ignore_index must be an int, got {ignore_index!r}.")
        self.class_dim = class_dim
        self.ignore_index = ignore_index
        #: (rank of the outputs, class dimension) found on the training targets.
        self._found: tuple[int, int] | None = None
        #: Outputs per data point of the last layout with extra dimensions (chunk sizes).
        self.last_size: int | None = None
        #: The backend that takes outputs (B, C) only, if the likelihood is fitted with one.
        self.plain_only: str | None = None

    def layout(
        self,
        output_shape: Sequence[int],
        y: Tensor | None,
        targets: PositionTargets | None,
        name: str,
    ) -> OutputLayout:
        """The layout of outputs of ``output_shape`` (B, …) for targets ``y``.

        Args:
            output_shape: Shape of a batch of outputs.
            y: Targets of the batch, or None at prediction time.
            targets: The likelihood's target convention; None: outputs (B, C) only.
            name: The likelihood's name, for messages.

        Raises:
            ValueError: For extra dimensions a likelihood does not take, a ``class_dim``
                outside the outputs, or an ambiguous class dimension.
            DataError: For targets that do not fit the outputs.
        """
        rank = len(output_shape)
        shape = tuple(int(d) for d in output_shape[1:])
        labels = targets == PositionTargets.LABELS
        ignore = self.ignore_index if labels else None
        if self.plain_only is not None:
            self.require_plain(
                output_shape,
                f"backend={self.plain_only}",
                "backend=CurvlinopsGGN (or CurvlinopsEF, CurvlinopsHessian)",
            )
        if targets is None:
            self.require_plain(
                output_shape,
                f"likelihood={name!r}",
                "'classification', 'regression' and 'binary_classification'",
            )
        explicit = None if self.class_dim is None else self._normalised(self.class_dim, rank)
        if rank <= 2:
            return OutputLayout(shape, 0, ignore)
        found = self._found[1] if self._found is not None and self._found[0] == rank else None
        chosen = explicit if explicit is not None else found
        if labels and y is not None and not (y.is_floating_point() and y.shape[1:] == shape):
            dim = self._class_dim_of_labels(chosen, output_shape, y)
        elif chosen is None and labels:
            what = "class probabilities" if y is not None else "no targets (a prediction)"
            raise ValueError(
                f"outputs of shape {tuple(output_shape)} with {what}: the class dimension "
                "cannot be found from targets; pass class_dim=... (e.g. class_dim=1 for "
                "(B, C, H, W), class_dim=-1 for (B, T, C)) to the Laplace constructor, or "
                "fit first."
            )
        else:
            dim = rank - 2 if chosen is None else chosen
        if y is not None:
            self._found = (rank, dim)
        self.last_size = math.prod(shape)
        return OutputLayout(shape, dim, ignore)

    @property
    def found(self) -> list[int] | None:
        """``[rank, class dim, outputs per point]`` found in the fit, for ``state_dict``."""
        return None if self._found is None else [*self._found, int(self.last_size or 0)]

    def remember(self, found: Sequence[int] | None) -> None:
        """Take over what ``found`` returned (a loaded state, ``check_found`` first); None: no."""
        if found is not None:
            rank, dim, size = found
            self._found, self.last_size = (rank, dim), size or None

    @staticmethod
    def check_found(found: Sequence[int] | None) -> None:
        """Refuse a saved layout that is neither None nor what ``found`` returns.

        Raises:
            ValueError: For anything else.
        """
        if found is not None and not (
            len(found) == 3 and all(isinstance(v, int) and v >= 0 for v in found)
        ):
            raise ValueError(
                f"the saved output layout must be [rank, class_dim, size], got {found!r}."
            )

    @staticmethod
    def require_plain(
        output_shape: Sequence[int],
        what: str,
        alternative: str = "the weight-space Laplace approximations (hessian_structure="
        "'full', 'diag', 'kron' or 'lowrank')",
    ) -> None:
        """Refuse outputs with extra dimensions where ``what`` takes outputs (B, C) only.

        Raises:
            ValueError: Naming ``alternative``, which takes them.
        """
        if len(output_shape) > 2:
            raise ValueError(
                f"{what} takes model outputs of shape (B, C); the model returned outputs of "
                f"shape {tuple(output_shape)}. Outputs with extra dimensions work with "
                f"{alternative}."
            )

    def per_point(self, n_outputs: int) -> int:
        """Outputs per data point, for chunk sizes: T·C of outputs with extra dimensions."""
        return n_outputs if self.last_size is None else self.last_size

    def _normalised(self, class_dim: int, rank: int) -> int:
        """``class_dim`` as an index into the per-point shape (without the batch dimension)."""
        dim = class_dim + rank if class_dim < 0 else class_dim
        if not 1 <= dim < rank:
            raise ValueError(
                f"class_dim={class_dim} is not a dimension of outputs with {rank} dimensions "
                "other than the batch (dimension 0)."
            )
        return dim - 1

    def _class_dim_of_labels(
        self, chosen: int | None, output_shape: Sequence[int], y: Tensor
    ) -> int:
        """The class dimension of label targets: the one they lack, checked against ``chosen``.

        ``chosen`` comes from ``class_dim`` or from earlier batches (None: neither).
        """
        shape = tuple(output_shape[1:])
        candidates = [d for d in range(len(shape)) if shape[:d] + shape[d + 1 :] == y.shape[1:]]
        shapes = f"outputs of shape {tuple(output_shape)} and targets of shape {tuple(y.shape)}"
        if chosen is not None and chosen in candidates:
            return chosen
        if chosen is not None or not candidates:
            expected = ""
            if chosen is not None:
                source = (
                    f"class_dim={self.class_dim}"
                    if self.class_dim is not None
                    else "the class dimension of earlier batches"
                )
                shape = (*output_shape[: chosen + 1], *output_shape[chosen + 2 :])
                expected = f" ({source}: targets of shape {shape})"
            raise DataError(
                f"classification {shapes} do not fit: the targets must have the outputs' shape "
                f"without the class dimension{expected}, e.g. outputs (B, C, H, W) with targets "
                "(B, H, W), or outputs (B, T, C) with targets (B, T)."
            )
        if len(candidates) > 1:
            dims = ", ".join(str(d + 1) for d in candidates)
            raise ValueError(
                f"{shapes}: the class dimension is ambiguous (dimensions {dims} of the outputs "
                "could be the one the targets lack); pass class_dim=... to the Laplace "
                "constructor."
            )
        return candidates[0]
