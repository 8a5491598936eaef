r"""The public protocol of a user-defined likelihood: subclass [`Likelihood`][laplace.Likelihood].

``Laplace(model, likelihood=MyLikelihood(), ...)`` then works with every structure the maths
allows (full, diagonal, Kronecker; all weights, last layer, subnetwork) and with the marginal
likelihood, prior tuning and ``marglik_training``, exactly like the built-in likelihoods.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from laplace.utils.predictive import gaussian_output_samples

__all__ = ["Likelihood"]


class Likelihood:
    r"""An observation model ``p(y | f)`` over network outputs ``f`` of shape (B, C).

    Implement ``loss`` and one of ``output_hessian`` or ``output_hessian_sqrt``;
    the other methods have defaults. The Laplace approximation then uses

    - the summed ``loss + log_normalizer`` over the training data as ``-log p(D | θ*)`` (its
      marginal likelihood and ``la.loss``);
    - the GGN ``Σₙ Jₙᵀ Λₙ Jₙ`` with ``Λₙ`` = ``output_hessian`` as curvature (with the
      empirical Fisher backends, the gradients of ``loss``; with the Monte-Carlo Fisher,
      gradients at targets drawn by ``sample``);
    - ``predictive`` to turn the linearised network's Gaussian over outputs into
      predictions, and ``inverse_link`` for sampled networks (``pred_type="nn"``) and
      ``predictive_samples``.

    There is no observation-noise hyperparameter (``sigma_noise`` must be 1).

    Attributes:
        name: Shown in messages and stored in a ``state_dict`` (default: the class name).
        predicts_probabilities: Whether the predictions are probabilities (classification).

    Example:
        Poisson regression with a log link (``docs/likelihoods.md`` has the worked example)::

            class Poisson(Likelihood):
                def loss(self, f, y):              # -log p(y | f) without log y!
                    return (f.exp() - y * f).sum(-1)

                def log_normalizer(self, y):       # log y!
                    return torch.lgamma(y + 1).sum(-1)

                def output_hessian(self, f):       # Hessian of the loss = Fisher: diag(e^f)
                    return torch.diag_embed(f.exp())

                def inverse_link(self, f):         # E[y | f]
                    return f.exp()
    """

    predicts_probabilities: bool = False

    @property
    def name(self) -> str:
        """Shown in messages and stored in a ``state_dict``; the class name by default."""
        return type(self).__name__

    def loss(self, f: Tensor, y: Tensor) -> Tensor:
        """Negative log-likelihood ``−log p(yₙ | fₙ)`` of each point up to its normaliser.

        Args:
            f: Outputs, shape (B, C); differentiable (the library takes its gradient).
            y: Targets of the batch.

        Returns:
            Shape (B,).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement loss(f, y).")

    def log_normalizer(self, y: Tensor) -> Tensor:
        """The part of ``−log p(yₙ | fₙ)`` that does not depend on ``f``, shape (B,); 0 default."""
        return torch.zeros(len(y), device=y.device)

    def output_hessian(self, f: Tensor) -> Tensor:
        """The output curvature ``Λₙ`` (Hessian or Fisher of the loss w.r.t. ``fₙ``), (B, C, C).

        Must be symmetric positive semi-definite. By default ``L Lᵀ`` of
        ``output_hessian_sqrt``.
        """
        L = self.output_hessian_sqrt(f)
        return L @ L.transpose(-1, -2)

    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        """A factor ``L`` with ``Λ = L Lᵀ``, shape (B, C, K).

        By default from the eigendecomposition of ``output_hessian`` (negative eigenvalues,
        which a positive semi-definite ``Λ`` has only from round-off, are set to 0).
        """
        eigenvalues, eigenvectors = torch.linalg.eigh(self.output_hessian(f))
        return eigenvectors * eigenvalues.clamp_min(0).sqrt().unsqueeze(-2)

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Draw targets ``y ~ p(y | f)``; needed only by the Monte-Carlo Fisher."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement sample(f, generator), which the "
            "Monte-Carlo Fisher (backend_kwargs={'stochastic': True}) needs; use the exact GGN."
        )

    def inverse_link(self, f: Tensor) -> Tensor:
        """The mean ``E[y | f]`` of the observation model, shape (B, C); ``f`` by default."""
        return f

    def predictive(
        self,
        f_mu: Tensor,
        f_var: Tensor,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Predictions from the Gaussian ``N(f_mu, f_var)`` over the outputs of each point.

        By default the Monte-Carlo estimate of ``E[inverse_link(f)]`` with ``n_samples``
        draws; override it with a closed form where one exists.

        Args:
            f_mu: Output means (B, C).
            f_var: Output covariances (B, C, C).
            n_samples: Monte-Carlo samples (``la(x, n_samples=...)``).
            generator: Random number generator (``la(x, generator=...)``).

        Returns:
            The predictions, e.g. the predictive mean (B, C).
        """
        samples = gaussian_output_samples(f_mu, f_var, n_samples, generator)
        return self.inverse_link(samples).mean(dim=0)

    def check_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        """Raise a ``ValueError`` for targets that cannot belong to outputs of ``output_shape``.

        Called on every batch before any curvature work; accepts everything by default.
        """
