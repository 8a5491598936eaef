"""How a likelihood turns the network's outputs into predictions.

:class:`OutputPredictions` holds the prediction hooks of every likelihood object, with the
Gaussian regression predictive as default (the outputs' moments, or their samples);
:class:`ProbabilityPredictions` those of likelihoods whose predictions are probabilities of a
link of the outputs (softmax, sigmoid).

Outputs with extra dimensions (see :mod:`laplace.utils.outputs`) are predicted row by row, each
position an independent observation, and the predictions get the outputs' shape back.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from laplace.utils.enums import LinkApprox
from laplace.utils.outputs import OutputLayout

__all__ = ["OutputPredictions", "ProbabilityPredictions"]


class OutputPredictions:
    """Prediction hooks of a likelihood: from a Gaussian or samples of the outputs ``f``."""

    #: The ``link_approx`` values its GLM predictive accepts; None: the link is not used.
    links: tuple[LinkApprox, ...] | None = None
    #: Whether ``joint=True`` (the joint Gaussian over test outputs) applies to its predictive.
    supports_joint: bool = False
    #: What the predictive returns, for messages.
    predictions: str = "predictions"
    #: The likelihood's name, for messages (see ``LikelihoodModel.name``).
    name: str
    #: The rows of outputs of a shape (``OutputRows.layout`` of the likelihood object).
    layout: Callable[..., OutputLayout]

    def check_prediction(self, link_approx: LinkApprox, joint: bool) -> None:
        """Refuse predictive options that do not apply, before any work.

        Raises:
            ValueError: For ``joint=True`` without a joint form, or a ``link_approx`` outside
                :attr:`links`.
        """
        if joint and not self.supports_joint:
            raise ValueError(
                "joint=True gives the joint Gaussian over the outputs of a regression GLM "
                f"predictive; {self.predictions} have no joint form (use joint=False)."
            )
        if self.links is not None and link_approx not in self.links:
            raise ValueError(
                f"likelihood={self.name!r} accepts link_approx in "
                f"{[link.value for link in self.links]}, got {link_approx.value!r}."
            )

    def check_variance_prediction(
        self, link_approx: LinkApprox, joint: bool, diagonal_output: bool, reason: str
    ) -> None:
        """Refuse options that need covariances between outputs when only variances exist.

        Args:
            link_approx: The requested link approximation.
            joint: Whether the joint Gaussian over test outputs was requested.
            diagonal_output: Whether variances were requested.
            reason: Why only output variances (B, C) are computed, for the message.

        Raises:
            ValueError: Unless ``diagonal_output=True`` and ``joint=False``.
        """
        if joint or not diagonal_output:
            raise ValueError(
                f"{reason}: use diagonal_output=True (and joint=False) for the predictive "
                "variances, or pred_type='nn' with link_approx='mc' to sample weights."
            )

    def predict(
        self,
        f_mu: Tensor,
        f_var: Tensor,
        link_approx: LinkApprox,
        n_samples: int,
        generator: torch.Generator | None,
        diagonal_output: bool,
    ) -> Any:
        """The GLM predictive from the Gaussian over the outputs at the test inputs.

        Args:
            f_mu: Output means in the outputs' shape (B, …).
            f_var: Covariances (B·T, C, C) of their rows (``laplace.utils.outputs``), or variances
                where :meth:`diagonal_moments` asked for them.
            link_approx: See :meth:`glm_predictive`.
            n_samples: Monte-Carlo samples of ``"mc"``.
            generator: Random number generator of ``"mc"``.
            diagonal_output: Whether the caller asked for variances (the shape of ``f_var``
                already says it; :meth:`diagonal_moments` chose it).
        """
        layout = self.layout(f_mu.shape)
        prediction = self.glm_predictive(
            layout.rows(f_mu), f_var, link_approx, n_samples=n_samples, generator=generator
        )
        return prediction if layout.plain else self.restore_prediction(prediction, layout)

    def restore_prediction(self, prediction: Any, layout: OutputLayout) -> Any:
        """Predictions of rows in the outputs' shape (outputs with extra dimensions).

        Gaussian moments by default: the means (B, …) and each output's variance (B, …).
        """
        f_mu, f_var = prediction
        if f_var.dim() == f_mu.dim() + 1:
            f_var = f_var.diagonal(dim1=-2, dim2=-1)
        return layout.restore(f_mu), layout.restore(f_var)

    def diagonal_moments(self, diagonal_output: bool) -> bool:
        """Whether :meth:`glm_predictive` needs only the output variances (B, C)."""
        return diagonal_output

    def glm_predictive(
        self, f_mu: Tensor, f_var: Tensor, link_approx: LinkApprox, **sampling: Any
    ) -> Any:
        """Predictions from a Gaussian over the outputs (the linearised network).

        Args:
            f_mu: Output means (B, C).
            f_var: Output covariances (B, C, C), or variances (B, C) when
                :meth:`diagonal_moments` said so.
            link_approx: The link approximation (for likelihoods with :attr:`links`).
            **sampling: ``n_samples`` and ``generator`` of Monte-Carlo approximations.

        Returns:
            ``(f_mu, f_var)`` by default (Gaussian regression).
        """
        return f_mu, f_var

    def validation_rows(self, prediction: Any, y: Tensor) -> tuple[Any, Tensor]:
        """Predictions and targets of a validation batch as the validation metrics take them.

        Gaussian moments by default: means and variances flattened per data point (B, T·C)
        for outputs with extra dimensions (as given for outputs (B, C)).
        """
        if not isinstance(prediction, tuple) or self.layout(prediction[0].shape).plain:
            return prediction, y
        return tuple(p.reshape(len(p), -1) for p in prediction), y.reshape(len(y), -1)

    def sampled_predictive(self, f: Tensor) -> Any:
        """Predictions from sampled networks' outputs ``f`` (S, B, C) (``pred_type="nn"``).

        Returns:
            The mean (B, C) and variance (B, C) over the samples by default.
        """
        return f.mean(dim=0), f.var(dim=0)

    def sampled_predictive_of(self, groups: Iterable[Tensor]) -> Any:
        """:meth:`sampled_predictive` of outputs that come in groups of samples (Sᵢ, B, …).

        By default the groups are put together first; a prediction that is a mean over the
        samples overrides this to sum one group at a time.
        """
        return self.sampled_predictive(torch.cat(list(groups)))

    def predictive_sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One predictive draw per output sample ``f`` (S, B, C): the outputs by default."""
        return f


class ProbabilityPredictions(OutputPredictions):
    """Predictions that are probabilities ``link(f)`` of the outputs.

    The GLM predictive approximates ``E[link(f)]`` under the Gaussian over the outputs by one of
    the functions of :attr:`link_approximations`; sampled networks and predictive samples apply
    :meth:`link` to each draw.
    """

    #: ``link_approx`` → function of ``(f_mu, f_var, n_samples=, generator=)``.
    link_approximations: dict[LinkApprox, Callable[..., Tensor]]
    #: The link approximations that work from output variances (B, C) alone.
    variance_links: tuple[LinkApprox, ...] = (LinkApprox.PROBIT,)

    def check_variance_prediction(
        self, link_approx: LinkApprox, joint: bool, diagonal_output: bool, reason: str
    ) -> None:
        """Refuse a link approximation that needs covariances between outputs.

        Args:
            link_approx: The requested link approximation.
            joint: Unused (refused by :meth:`check_prediction`).
            diagonal_output: Unused (the predictions are probabilities).
            reason: Why only output variances (B, C) are computed, for the message.

        Raises:
            ValueError: For a ``link_approx`` outside :attr:`variance_links`.
        """
        if link_approx not in self.variance_links:
            raise ValueError(
                f"{reason}: link_approx={link_approx.value!r} needs the covariance between "
                f"outputs; use link_approx in {[link.value for link in self.variance_links]}, "
                "or pred_type='nn' with link_approx='mc', which samples the weights from the "
                "posterior."
            )

    @staticmethod
    @abstractmethod
    def link(f: Tensor) -> Tensor:
        """The probabilities of outputs ``f`` (..., C)."""

    @property
    def links(self) -> tuple[LinkApprox, ...]:  # type: ignore[override]
        """The link approximations the GLM predictive accepts."""
        return tuple(self.link_approximations)

    def glm_predictive(
        self, f_mu: Tensor, f_var: Tensor, link_approx: LinkApprox, **sampling: Any
    ) -> Tensor:
        """Probabilities (B, C) by the link approximation ``link_approx``."""
        return self.link_approximations[link_approx](f_mu, f_var, **sampling)

    def sampled_predictive(self, f: Tensor) -> Tensor:
        """The mean probabilities over sampled outputs (S, B, …), shape (B, …)."""
        return self.predictive_sample(f).mean(dim=0)

    def sampled_predictive_of(self, groups: Iterable[Tensor]) -> Tensor:
        """The mean probabilities over groups of sampled outputs, summed a group at a time."""
        total, count = 0, 0
        for f in groups:
            total = total + self.predictive_sample(f).sum(dim=0)
            count += len(f)
        return total / count

    def predictive_sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """The probabilities of each output sample (S, B, …), along the class dimension."""
        layout = self.layout(f.shape[1:])
        return layout.restore(self.link(layout.rows(f)))

    def restore_prediction(self, prediction: Tensor, layout: OutputLayout) -> Tensor:
        """Probabilities of rows (B·T, C) in the outputs' shape."""
        return layout.restore(prediction)

    def validation_rows(self, prediction: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Probabilities (B·T, C) and labels of the positions that count (not dropped)."""
        layout = self.layout(prediction.shape, y)
        targets, keep = layout.labelled(y)
        rows = layout.rows(prediction)
        return (rows, targets) if keep is None else (rows[keep], targets[keep])
