"""``state_dict`` / ``load_state_dict`` for parametric Laplace approximations.

The state holds only tensors and plain Python values, so ``torch.load(path, weights_only=True)``
reads it, and it moves across devices with ``map_location``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["StateDictMixin"]

#: Tolerance when checking that the model's weights are the saved posterior mean.
MEAN_MATCH_ATOL = 1e-6


class StateDictMixin:
    """Save and restore a fitted posterior, validating it against the model it is loaded into."""

    def state_dict(self) -> dict[str, Any]:
        """The fitted state: curvature, loss, data count and hyperparameters.

        Returns:
            A dict of tensors and plain values (loadable with ``weights_only=True``).
        """
        self._check_fitted("state_dict")
        return {
            "cls_name": type(self).__name__,
            "likelihood": self.likelihood.value,
            "param_names": list(self._subset.names),
            "param_shapes": [list(p.shape) for p in self._subset.params],
            "mean": self.mean.detach(),
            "H": self._curvature_state(),
            "loss": torch.as_tensor(self.loss).detach(),
            "n_data": int(self.n_data),
            "n_outputs": int(self.n_outputs),
            "prior_mean": self.prior_mean.detach(),
            "prior_precision": self.prior_precision.detach(),
            "sigma_noise": self.sigma_noise.detach(),
            "temperature": float(self.temperature),
            "enable_backprop": bool(self.enable_backprop),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`.

        Raises:
            ValueError: If the state belongs to another class, likelihood or architecture, or
                if the model's weights are not the saved posterior mean.
        """
        expected = {
            "cls_name": type(self).__name__,
            "likelihood": self.likelihood.value,
            "param_names": list(self._subset.names),
            "param_shapes": [list(p.shape) for p in self._subset.params],
        }
        missing = [k for k in (*expected, "mean", "H", "loss", "n_data") if k not in state_dict]
        if missing:
            raise ValueError(f"state_dict is missing the entries {missing}.")
        for key, value in expected.items():
            if state_dict[key] != value:
                raise ValueError(
                    f"state_dict does not match this Laplace approximation: its {key} is "
                    f"{state_dict[key]!r}, expected {value!r}."
                )
        mean = state_dict["mean"].to(device=self._device, dtype=self._dtype)
        current = self._subset.vector().detach()
        if not torch.allclose(mean, current, rtol=0, atol=MEAN_MATCH_ATOL):
            raise ValueError(
                "the model's weights differ from the posterior mean stored in state_dict; "
                "load the model's own state_dict (the MAP weights) before the Laplace state."
            )
        self.mean = mean
        self.H = self._load_curvature_state(state_dict["H"])
        self.loss = state_dict["loss"].to(device=self._device, dtype=self._dtype)
        self.n_data = int(state_dict["n_data"])
        self.n_outputs = int(state_dict["n_outputs"])
        self.prior_mean = state_dict["prior_mean"]
        self.prior_precision = state_dict["prior_precision"]
        self.sigma_noise = state_dict["sigma_noise"]
        self.temperature = float(state_dict["temperature"])
        self.enable_backprop = bool(state_dict["enable_backprop"])
        self._posterior_cache = None
        self._fitted = True

    def _curvature_state(self) -> Any:
        return self.H.detach()

    def _load_curvature_state(self, state: Any) -> Any:
        if not isinstance(state, Tensor):
            raise ValueError("state_dict['H'] must be a tensor for this structure.")
        shape = tuple(self._zero_curvature().shape)
        if tuple(state.shape) != shape:
            raise ValueError(f"state_dict['H'] has shape {tuple(state.shape)}, expected {shape}.")
        return state.to(device=self._device, dtype=self._dtype)
