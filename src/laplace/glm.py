"""Predictives of parametric Laplace approximations: linearised (GLM) and sampled-network (NN).

The GLM predictive needs ``J P⁻¹ Jᵀ`` for the Jacobian ``J`` of the outputs w.r.t. the weights.
Per chunk of test points the parameter subset linearises the model into a Jacobian kind
(``subset.linearize``: dense rows, a linear head's features, or a recorded layer trace; see
:mod:`laplace.jacobians`) and the posterior computes ``J P⁻¹ Jᵀ`` for that kind
(``posterior.functional_variance``). The chunks are as large as the kind allows within a memory
budget, so predicting on many points never materialises the whole (B, C, P) Jacobian.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor

from laplace import large_output
from laplace.data import Inputs, batch_size_of, check_outputs, input_chunks, prepare_inputs
from laplace.errors import check_generator, check_positive_int
from laplace.jacobians import HeadFeatures, position_rows, row_kind
from laplace.likelihoods import LikelihoodModel
from laplace.nn_predictive import NNPredictiveMixin
from laplace.predictive import gaussian_output_samples
from laplace.utils.enums import LinkApprox, PredType, parse_enum

__all__ = ["GLMPredictiveMixin", "jacobian_chunk_rows"]

#: Bytes of Jacobian held at once by the GLM predictive.
JACOBIAN_CHUNK_BYTES = 256 * 2**20


def jacobian_chunk_rows(n_outputs: int, n_params: int, dtype: torch.dtype) -> int:
    """Data points whose (rows, C, P) Jacobian fits in :data:`JACOBIAN_CHUNK_BYTES`, at least 1."""
    itemsize = torch.finfo(dtype).bits // 8
    return max(1, JACOBIAN_CHUNK_BYTES // max(1, n_outputs * n_params * itemsize))


class GLMPredictiveMixin(NNPredictiveMixin):
    """``__call__``, ``predictive_samples`` and ``functional_samples`` of parametric Laplace.

    The linearised (GLM) predictive is here; ``pred_type="nn"`` samples networks through
    :class:`~laplace.nn_predictive.NNPredictiveMixin`.
    """

    def __call__(
        self,
        x: Inputs,
        pred_type: PredType | str = PredType.GLM,
        joint: bool = False,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        fitting: bool = False,
        **model_kwargs: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Posterior predictive at inputs ``x``.

        Args:
            x: Test inputs (B, ...) or a dict-like batch.
            pred_type: ``"glm"`` (linearised network) or ``"nn"`` (sampled weights).
            joint: Regression GLM only: return the joint ``(f_mu (B·C,), f_cov (B·C, B·C))``.
            link_approx: Classification link: ``"probit"``, ``"bridge"``, ``"bridge_norm"`` or
                ``"mc"``; ``pred_type="nn"`` needs ``"mc"``.
            n_samples: Samples for ``"mc"`` and ``"nn"``.
            diagonal_output: Regression GLM: return variances (B, C) instead of (B, C, C).
            generator: Random number generator for sampling.
            fitting: Reward modelling: predict as during fitting (classification).
            **model_kwargs: Extra keyword arguments for the model's forward (NN predictive).

        Returns:
            What the likelihood predicts: classification class probabilities (B, C); binary
            classification label probabilities (B, K); regression ``(f_mu, f_var)``;
            heteroscedastic regression a
            :class:`~laplace.likelihoods.HeteroscedasticPrediction`; your own likelihood what
            its ``predictive`` returns.

        Raises:
            ValueError: For unknown or incompatible ``pred_type`` / ``link_approx`` (binary
                classification takes ``"probit"`` or ``"mc"``), an ``n_samples`` that is not
                a positive integer where samples are drawn, ``joint=True`` with a predictive
                other than regression's, or empty or non-finite inputs.
            RuntimeError: Before :meth:`fit`.
        """
        pred_type = parse_enum(PredType, pred_type, "pred_type")
        link_approx = parse_enum(LinkApprox, link_approx, "link_approx")
        if pred_type == PredType.GP:
            raise ValueError("pred_type='gp' needs a functional (GP) Laplace; use 'glm' or 'nn'.")
        if pred_type == PredType.NN and link_approx != LinkApprox.MC:
            raise ValueError(
                "pred_type='nn' samples networks and supports only link_approx='mc' "
                f"(got {link_approx.value!r})."
            )
        if pred_type == PredType.NN or link_approx == LinkApprox.MC:
            check_positive_int(n_samples, "n_samples")
        check_generator(generator)
        likelihood = self._prediction_likelihood(fitting)
        likelihood.check_prediction(link_approx, joint)
        self._check_fitted("prediction")
        reason = self._output_variances_only()
        if reason is not None and pred_type == PredType.GLM:
            likelihood.check_variance_prediction(link_approx, joint, diagonal_output, reason)
        x = prepare_inputs(x, self.dict_key_x, self._device, "prediction")
        if pred_type == PredType.NN:
            groups = self._nn_sample_groups(x, n_samples, generator, **model_kwargs)
            return likelihood.sampled_predictive_of(groups)
        moments = partial(self._glm_predictive_distribution, x)
        return likelihood.predict(
            moments, joint, diagonal_output, link_approx, n_samples, generator
        )

    def predictive(self, x: Inputs, pred_type="glm", link_approx="probit", n_samples=100):
        """Alias of ``__call__`` kept from older laplace-torch versions."""
        return self(x, pred_type=pred_type, link_approx=link_approx, n_samples=n_samples)

    def _prediction_likelihood(self, fitting: bool) -> LikelihoodModel:
        model = self._likelihood_model
        return model.fit_likelihood if fitting else model.predictive_likelihood

    # ----------------------------------------------------------------------------- GLM
    def _chunk_rows(self) -> int:
        """Test points per chunk, from the Jacobian kind the subset gives this posterior."""
        posterior, subset, outputs = self._posterior, self._subset, self._likelihood_model.outputs
        kind = row_kind(subset.jacobian_kind(posterior.closed_forms), outputs)
        per_point = outputs.per_point(self.n_outputs)
        rows = jacobian_chunk_rows(per_point, len(posterior.prior_diag), self._dtype)
        return kind.chunk_rows(rows, subset.model, subset.params)

    def _output_variances_only(self) -> str | None:
        """Why the GLM predictive computes only output variances (B, C); None if it does not."""
        return None

    def _glm_refusal(self) -> str | None:
        """Why the GLM predictive cannot be computed at all; None if it can."""
        has_closed_form = self._subset.jacobian_kind(self._posterior.closed_forms) is HeadFeatures
        return None if has_closed_form else large_output.glm_refusal(self.n_outputs)

    def _glm_predictive_distribution(
        self, X: Inputs, joint: bool = False, diagonal_output: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Mean and covariance of the linearised network's outputs.

        Returns:
            ``(f_mu (B, C), f_var (B, C, C))``; ``(B, C)`` variances if ``diagonal_output``;
            ``(f_mu (B·C,), f_cov (B·C, B·C))`` if ``joint``.

        Raises:
            ValueError: Where the approximation refuses the GLM predictive (``_glm_refusal``).
        """
        refusal = self._glm_refusal()
        if refusal is not None:
            raise ValueError(refusal)
        if joint:
            f_mu, J = self._subset.linearize(X, self.backend, (), self.enable_backprop)
            return self._detached(f_mu.reshape(-1), self.functional_covariance(J.dense()))
        means, variances = [], []
        for chunk in input_chunks(X, self._chunk_rows(), self.dict_key_x):
            f_mu, f_var = self._functional_moments(chunk)
            check_outputs(f_mu, batch_size_of(chunk, self.dict_key_x))
            self._checked_finite(f_var, "predictive variance")
            means.append(f_mu)
            if diagonal_output and f_var.dim() == 3:
                f_var = f_var.diagonal(dim1=-2, dim2=-1)
            variances.append(f_var)
        return torch.cat(means), torch.cat(variances)

    def _functional_moments(self, X: Inputs) -> tuple[Tensor, Tensor]:
        """``(f_mu (B, C), f_var (B, C, C))`` of the linearised network on one chunk of inputs.

        The subset linearises the model into the Jacobian kind the posterior has a closed form
        for (else dense rows), and the posterior computes ``J P⁻¹ Jᵀ`` for it. Outputs with
        extra dimensions give ``f_mu`` in their shape (B, …) and the covariances of their rows
        (B·T, C, C) (:mod:`laplace.outputs`).
        """
        posterior = self._posterior
        f_mu, J = self._subset.linearize(
            X, self.backend, posterior.closed_forms, self.enable_backprop
        )
        J = position_rows(J, self._likelihood_model.layout(f_mu.shape))
        return self._detached(f_mu, posterior.functional_variance(J))

    def _detached(self, f_mu: Tensor, f_var: Tensor) -> tuple[Tensor, Tensor]:
        """The moments, detached from the graph unless ``enable_backprop``."""
        return (f_mu, f_var) if self.enable_backprop else (f_mu.detach(), f_var.detach())

    def functional_samples(
        self,
        x: Inputs,
        pred_type: PredType | str = PredType.GLM,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Samples of the network outputs ``f`` (before any link), shape (S, B, C).

        Raises:
            ValueError: For an unknown ``pred_type`` or a non-positive ``n_samples``, or GLM
                samples without ``diagonal_output=True`` where only output variances are
                computed.
        """
        pred_type = parse_enum(PredType, pred_type, "pred_type")
        check_positive_int(n_samples, "n_samples")
        check_generator(generator)
        self._check_fitted("functional_samples")
        reason = self._output_variances_only()
        if reason is not None and pred_type == PredType.GLM and not diagonal_output:
            raise ValueError(
                f"{reason}: GLM samples need diagonal_output=True (independent outputs), or "
                "use pred_type='nn', which samples the weights from the posterior."
            )
        x = prepare_inputs(x, self.dict_key_x, self._device, "functional_samples")
        if pred_type == PredType.NN:
            return self._nn_functional_samples(x, n_samples, generator)
        f_mu, f_var = self._glm_predictive_distribution(x, diagonal_output=diagonal_output)
        layout = self._likelihood_model.layout(f_mu.shape)
        return layout.restore(
            gaussian_output_samples(layout.rows(f_mu), f_var, n_samples, generator)
        )

    def predictive_samples(
        self,
        x: Inputs,
        pred_type: PredType | str = PredType.GLM,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Samples of the predictive: probabilities for classification, outputs for regression.

        Heteroscedastic regression draws ``y = μ + e^{s/2} ε`` per sampled output (the noise
        included); your own likelihood applies its ``inverse_link``.

        Returns:
            Samples, shape (S, B, C).
        """
        f = self.functional_samples(x, pred_type, n_samples, diagonal_output, generator)
        return self._link_samples(f, generator)
