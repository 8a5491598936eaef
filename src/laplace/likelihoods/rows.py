"""The model-output face of a likelihood: outputs of any layout, the maths on rows (B·T, C).

A likelihood object writes its maths (:meth:`per_sample_loss`, :meth:`loss_gradient`, the
output Hessian, target checks) for rows (B, C). :class:`OutputRows` gives it the methods the
fits and backends call with a batch of model outputs (B, …) — the summed loss, the gradient of
the summed loss w.r.t. the outputs, the target check, the number of outputs — through its
:class:`~laplace.utils.outputs.OutputAdapter` (see :mod:`laplace.utils.outputs`): outputs with
extra dimensions become rows, positions an ``ignore_index`` drops count nothing. Outputs (B, C) are
their own rows.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

from torch import Tensor, nn

from laplace.utils.outputs import OutputAdapter, OutputLayout, PositionTargets

__all__ = ["LossModule", "OutputRows", "ReducedLoss"]


class OutputRows:
    """Model-level loss, gradient and target checks of a likelihood written for rows (B, C)."""

    #: How targets relate to outputs with extra dimensions; None: outputs (B, C) only.
    position_targets: PositionTargets | None = None
    #: The likelihood's name, for messages (see ``LikelihoodModel.name``).
    name: str

    def __init__(self) -> None:
        #: The user's ``class_dim`` / ``ignore_index`` and the class dimension found from data.
        self.outputs = OutputAdapter()

    def layout(self, output_shape: Sequence[int], y: Tensor | None = None) -> OutputLayout:
        """The rows of outputs of ``output_shape`` (B, …), for targets ``y`` (None: predicting).

        Raises:
            ValueError: See :meth:`laplace.utils.outputs.OutputAdapter.layout`.
        """
        return self.outputs.layout(output_shape, y, self.position_targets, self.name)

    def output_count(self, output_shape: Sequence[int], y: Tensor | None = None) -> int:
        """``la.n_outputs`` for outputs of ``output_shape``: C, the outputs of one row."""
        return self.layout(output_shape, y).n_classes

    def check_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        """Refuse targets that cannot belong to outputs of shape ``output_shape`` (B, …).

        Cheap (no model call): the data loops run it on every batch before any curvature work,
        with the output shape of the first batch (the batch size is not compared). Labels equal
        to ``ignore_index`` are accepted (their positions are dropped).

        Raises:
            ValueError: Naming the problem (shape, label range, an ambiguous class dimension);
                a :class:`~laplace.utils.errors.DataError` (also a ``RuntimeError``) for targets of
                the wrong kind, a :class:`~laplace.utils.errors.LabelError` (also an
                ``IndexError``) for a class label outside ``[0, C)``.
        """
        layout = self.layout(output_shape, y)
        targets, _ = layout.labelled(y)
        row_shape = output_shape if layout.plain else (len(targets), layout.n_classes)
        self.check_row_targets(targets, row_shape)

    def loss(self, f: Tensor, y: Tensor) -> Tensor:
        """Summed loss of a batch of outputs (B, …) over its data points and kept positions."""
        return self.point_losses(f, y).sum()

    def point_losses(self, f: Tensor, y: Tensor) -> Tensor:
        """Loss of each data point of a batch of outputs (B, …), summed over its kept positions.

        Returns:
            Shape (B,).
        """
        rows, targets, keep = self.layout(f.shape, y).split(f, y)
        per_row = self.per_sample_loss(rows, targets)
        if keep is not None:
            per_row = per_row * keep
        return per_row.reshape(len(f), -1).sum(1)

    def output_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        """Gradient of the summed loss w.r.t. the outputs, shape of ``f`` (B, …)."""
        layout = self.layout(f.shape, y)
        rows, targets, keep = layout.split(f, y)
        gradient = self.loss_gradient(rows, targets)
        if keep is not None:
            gradient = gradient * keep.unsqueeze(-1)
        return layout.restore(gradient)

    @abstractmethod
    def per_sample_loss(self, f: Tensor, y: Tensor) -> Tensor:
        """Negative log-likelihood of rows (B, C) up to constants, shape (B,)."""

    @abstractmethod
    def loss_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        """Gradient of the per-row loss w.r.t. rows ``f`` (B, C), shape (B, C)."""

    @abstractmethod
    def check_row_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        """Refuse targets that cannot belong to rows of shape ``output_shape`` (B, C).

        Raises:
            ValueError: As :meth:`check_targets`.
        """


class ReducedLoss(nn.Module):
    """A torch loss module that reduces a loss of each data point as torch's losses do.

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Raises:
        ValueError: For another ``reduction``.
    """

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")
        self.reduction = reduction

    def reduce(self, loss: Tensor) -> Tensor:
        """The mean or sum of ``loss``, or ``loss`` itself with ``"none"``."""
        if self.reduction == "mean":
            return loss.mean()
        return loss.sum() if self.reduction == "sum" else loss


class LossModule(ReducedLoss):
    """A likelihood object's negative log-likelihood as a torch loss ``(f, y) → loss``.

    For the torch-loss routes (curvlinops' operators, training loops) of likelihoods without a
    torch loss of their own, and of outputs of any layout.

    Args:
        likelihood: The likelihood object.
        reduction: ``"mean"`` (over data points), ``"sum"`` or ``"none"`` (shape (B,)).
    """

    def __init__(self, likelihood: OutputRows, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.likelihood = likelihood

    def forward(self, f: Tensor, y: Tensor) -> Tensor:
        """The loss of outputs ``f`` (B, …) and targets ``y``."""
        return self.reduce(self.likelihood.point_losses(f, y))
