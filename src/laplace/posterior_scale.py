"""laplace-torch's posterior-scale hooks of the full and low-rank Laplace classes.

laplace-torch caches the scale ``S`` (``S Sᵀ = P⁻¹``) of these posteriors in
``_posterior_scale``, fills it in ``_compute_scale()`` and samples with it; downstream code reads
and assigns that attribute. Here the posterior structure owns the scale (computed once per
posterior, see :mod:`laplace.posteriors`), and an assigned scale is kept next to the posterior
it was assigned for: it is used by ``posterior_scale`` and :meth:`sample` until the curvature or
a hyperparameter changes, as laplace-torch resets its cache then.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["PosteriorScaleMixin"]


class PosteriorScaleMixin:
    """``posterior_scale``, ``_compute_scale()`` and ``_posterior_scale`` (P, P).

    For a parametric Laplace class whose posterior structure has a dense ``scale``.
    """

    _posterior: Any
    #: The assigned scale and the posterior object it belongs to.
    _assigned_scale: tuple[Any, Tensor] | None = None

    @property
    def posterior_scale(self) -> Tensor:
        """``S`` (P, P) with ``S Sᵀ = P⁻¹``: the assigned ``_posterior_scale``, else computed."""
        assigned = self._current_assigned_scale()
        return assigned if assigned is not None else self._posterior.scale

    def _compute_scale(self) -> None:
        """Compute the posterior scale (laplace-torch's hook); an assigned one is dropped."""
        self._assigned_scale = None
        _ = self._posterior.scale

    @property
    def _posterior_scale(self) -> Tensor:
        """The scale laplace-torch caches here; readable and assignable (None resets it)."""
        return self.posterior_scale

    @_posterior_scale.setter
    def _posterior_scale(self, value: Tensor | None) -> None:
        self._assigned_scale = None if value is None else (self._posterior, value)

    def _current_assigned_scale(self) -> Tensor | None:
        """The assigned scale while the posterior it was assigned for is current."""
        if self._assigned_scale is None:
            return None
        posterior, scale = self._assigned_scale
        return scale if posterior is self._posterior else None

    def _draw_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        assigned = self._current_assigned_scale()
        if assigned is None:
            return super()._draw_deviations(n_samples, generator)
        z = torch.randn(
            (n_samples, assigned.shape[-1]),
            generator=generator,
            device=assigned.device,
            dtype=assigned.dtype,
        )
        return z @ assigned.T
