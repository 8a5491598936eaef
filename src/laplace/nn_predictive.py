"""Predictives of sampled networks (``pred_type="nn"``): weights drawn from the posterior.

Each sample is one forward pass of the network with weights ``θ ~ N(θ_MAP, P⁻¹)``
(``la.sample``, through the posterior structure's sampling root). The mean predictive sums a
group of samples at a time within :data:`NN_SAMPLE_BYTES`, so a 32,000-class model with many
samples never holds all (S, B, …) outputs. Internal module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from laplace.data import Inputs, batch_size_of, check_outputs, prepare_inputs

__all__ = ["NN_SAMPLE_BYTES", "NNPredictiveMixin"]

#: Memory of the weight samples and outputs ``pred_type="nn"`` holds at once (one sample at
#: least).
NN_SAMPLE_BYTES = 256 * 2**20


class NNPredictiveMixin:
    """Outputs and predictive draws of networks whose weights are sampled from the posterior."""

    def _link_samples(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Output samples (S, B, C) as predictive draws of the likelihood.

        Softmax or sigmoid probabilities for classification, the outputs for regression, draws
        of ``y`` for heteroscedastic regression.
        """
        return self._likelihood_model.predictive_likelihood.predictive_sample(f, generator)

    def _nn_functional_samples(
        self,
        X: Inputs,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        **model_kwargs: Any,
    ) -> Tensor:
        """Outputs of ``n_samples`` networks with weights drawn from the posterior (S, B, C)."""
        thetas = self.sample(n_samples, generator)
        context = torch.enable_grad() if self.enable_backprop else torch.no_grad()
        with context:
            f = self._subset.forward_samples(thetas, X, **model_kwargs)
        check_outputs(f[0], batch_size_of(X, self.dict_key_x))
        return f

    def _nn_sample_groups(
        self,
        X: Inputs,
        n_samples: int,
        generator: torch.Generator | None = None,
        **model_kwargs: Any,
    ) -> Iterator[Tensor]:
        """Outputs of ``n_samples`` sampled networks, in groups (Sᵢ, B, C) of bounded memory.

        All samples form one group while their weights fit in :data:`NN_SAMPLE_BYTES`; else
        (an LLM's head: 2M weights, (T, 32,000) logits per sequence) the first group is one
        sample, and the later ones as many as the weights and outputs of one sample allow.
        """
        per_weights = self.n_params * self.mean.element_size()
        size = n_samples if n_samples * per_weights <= NN_SAMPLE_BYTES else 1
        done = 0
        while done < n_samples:
            f = self._nn_functional_samples(
                X, min(size, n_samples - done), generator, **model_kwargs
            )
            done += len(f)
            yield f
            size = max(1, NN_SAMPLE_BYTES // (per_weights + f[0].numel() * f.element_size()))

    def _nn_predictive_samples(
        self,
        X: Inputs,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        **model_kwargs: Any,
    ) -> Tensor:
        """Predictive of ``n_samples`` sampled networks (S, B, C): probabilities or outputs.

        laplace-torch's hook, kept for code that calls it.
        """
        X = prepare_inputs(X, self.dict_key_x, self._device, "_nn_predictive_samples")
        return self._link_samples(
            self._nn_functional_samples(X, n_samples, generator, **model_kwargs), generator
        )
