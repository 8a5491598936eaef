"""The curvature backend contract and its GGN and empirical-Fisher families.

Every curvature of the native routes is ``Σₙ Σₖ (Jₙᵀ vₙₖ)(Jₙᵀ vₙₖ)ᵀ`` for output-space columns
``vₖ``: a family (GGN, empirical Fisher) says which columns each row of the outputs has
(``CurvatureInterface.row_columns``), and the native per-sample engine sums the outer products.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from typing import cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev
from typing_extensions import Unpack

from laplace.curvature.curvature_backend import CurvatureOptions, KronOptions
from laplace.curvature.engine.kfac import KfacStatistics, curvature_like, kfac, kfac_eigenvalues
from laplace.curvature.engine.kfac_rules import (
    KFAC_DENSE_LIMIT,
    block_shapes,
    check_output_columns,
    plan_blocks,
)
from laplace.curvature.engine.per_sample import Columns, PerSampleEngine, PerSampleTrace
from laplace.likelihoods import make_likelihood
from laplace.likelihoods.likelihood_model import LikelihoodModel
from laplace.likelihoods.protocol import Likelihood as UserLikelihood
from laplace.utils.data import Inputs
from laplace.utils.enums import Likelihood
from laplace.utils.errors import check_fits_in_memory, check_module, check_positive_int
from laplace.utils.feature_extractor import FeatureExtractor
from laplace.utils.matrix import Kron

__all__ = ["CurvatureInterface", "EFInterface", "GGNInterface", "check_dict_inputs"]


def check_dict_inputs(backend_cls: type[CurvatureInterface], x: object) -> None:
    """Refuse dict-like inputs for a backend that cannot take them.

    Args:
        backend_cls: The backend class.
        x: Model inputs of one batch.

    Raises:
        ValueError: If ``x`` is a mapping and ``backend_cls.accepts_dict_inputs`` is False.
    """
    if isinstance(x, MutableMapping) and not backend_cls.accepts_dict_inputs:
        raise ValueError(
            f"{backend_cls.__name__} cannot take dict-like inputs; use backend=CurvlinopsGGN "
            "or AsdlGGN (CurvlinopsEF or AsdlEF for the empirical Fisher), which take "
            "mapping-style batches."
        )


class CurvatureInterface:
    """Access to curvature of a model under a likelihood.

    Args:
        model: The network, or a feature extractor exposing ``last_layer`` and
            ``forward_with_features(x) -> (f, phi)`` when ``last_layer=True``.
        likelihood: A likelihood name (``"regression"``, ``"classification"``,
            ``"reward_modeling"``, fitted as classification, ``"binary_classification"``,
            ``"heteroscedastic_regression"``) or a likelihood object (see
            [`laplace.likelihoods.make_likelihood`][laplace.likelihoods.make_likelihood]).
        last_layer: Restrict to the parameters of ``model.last_layer``.
        subnetwork_indices: LongTensor of indices into the flattened trainable parameters;
            results are restricted to these entries.
        dict_key_x: Key of the input tensor when the model takes a mapping.
        dict_key_y: Key of the targets when batches are mappings.

    Attributes:
        params: The trainable parameters (``requires_grad``) considered, in model order; in
            last-layer mode every parameter of the head, frozen or not (as its subset covers).
        engine: The native per-sample engine over ``params`` (restricted to the subnetwork).
        fit_likelihood: The likelihood object the curvature and the loss are computed with.
        lossfunc: The likelihood's summed torch loss (``MSELoss``, ``CrossEntropyLoss``, ...).
        factor: ``lossfunc`` times ``factor`` is the library's loss (½ for regression, else 1).
        kfac_approx: Weight-sharing approximation of ``kron``, ``"expand"`` or ``"reduce"``.
    """

    kfac_approx: str = "expand"
    kfac_dense_limit: int = KFAC_DENSE_LIMIT  #: Largest exact kron block kept dense.
    #: Whether the model may take dict-like (HuggingFace) inputs with this backend.
    accepts_dict_inputs: bool = True
    #: Whether the routes run on the native engine: ``kron`` can keep the output factors of
    #: large layers low rank (``low_rank_above``), and ``full``, ``diag`` and ``kron`` add a
    #: batch to a running sum in place (``into``); third-party libraries form a new batch.
    native_engine: bool = True
    #: The torch losses (likelihoods' ``loss_module``) a third-party library supports; None: all.
    supported_losses: tuple[type[nn.Module], ...] | None = None
    #: Whether a row's columns are the square root of that row's own curvature (the exact
    #: GGN), so every position of outputs with extra dimensions gets columns of its own;
    #: otherwise a column covers the summed loss of a data point (loss gradients).
    separable_columns: bool = False

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str | UserLikelihood | LikelihoodModel,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
    ) -> None:
        likelihood_model = make_likelihood(likelihood)
        self.likelihood = likelihood_model.kind
        self.model = check_module(model)
        self.last_layer = last_layer
        self.subnetwork_indices = subnetwork_indices
        self.dict_key_x, self.dict_key_y = dict_key_x, dict_key_y
        self.fit_likelihood = likelihood_model.fit_likelihood
        self.fit_likelihood.check_backend(type(self))
        self.lossfunc: nn.Module = self.fit_likelihood.loss_module(reduction="sum")
        self.factor = self.fit_likelihood.loss_scale
        # a last layer is covered whole (as its subset is), frozen or not
        self.params: list[nn.Parameter] = [
            p for p in self._model.parameters() if p.requires_grad or last_layer
        ]
        self.engine = PerSampleEngine(model, self.params, subnetwork_indices)

    @property
    def _model(self) -> nn.Module:
        """The module whose parameters are considered."""
        # in last-layer mode the model is a feature extractor whose head is known
        return cast(nn.Module, self.model.last_layer) if self.last_layer else self.model

    def _select(self, flat: Tensor) -> Tensor:
        """Restrict the last dimension (the parameter vector) to the subnetwork, if one is set."""
        if self.subnetwork_indices is None:
            return flat
        return flat[..., self.subnetwork_indices.to(flat.device)]

    def trace(self, x: Inputs, create_graph: bool = False) -> PerSampleTrace:
        """One recorded forward pass of the native engine over ``x``.

        The trace turns output columns into per-sample parameter quantities (Jacobians,
        curvature sums, block products; see ``laplace.curvature.engine.per_sample``), restricted to
        ``subnetwork_indices`` when set.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            create_graph: Keep results differentiable w.r.t. ``x`` and the parameters.
        """
        return self.engine.trace(x, create_graph)

    def batch_loss(self, f: Tensor, y: Tensor) -> Tensor:
        """Summed library loss of a batch with outputs ``f`` (B, C), detached."""
        return self.fit_likelihood.loss(f.detach(), y)

    def jacobians(self, x: Inputs, enable_backprop: bool = False) -> tuple[Tensor, Tensor]:
        """Jacobians of the outputs w.r.t. the parameters at their current values.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            enable_backprop: Keep ``Js`` and ``f`` differentiable w.r.t. ``x``.

        Returns:
            ``Js`` of shape (B, C, P) and outputs ``f`` of shape (B, C).
        """
        trace = self.trace(x, create_graph=enable_backprop)
        Js = trace.jacobians()
        return (Js, trace.f) if enable_backprop else (Js.detach(), trace.f.detach())

    def selected_output_jacobians(
        self, x: Inputs, outputs: Tensor, enable_backprop: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Jacobians of chosen outputs of each input: rows ``J[b, outputs[b, k]]``.

        One per-sample product per chosen output (``PerSampleTrace.per_sample_columns``), never
        the C rows of the full Jacobian; for every backend, from the native engine.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            outputs: Output indices per input, shape (B,) or (B, K).
            enable_backprop: Keep ``Js`` and ``f`` differentiable w.r.t. ``x``.

        Returns:
            ``Js`` of shape (B, K) + (P,) (K = 1 for indices of shape (B,)) and the outputs
            ``f`` of shape (B, C).

        Raises:
            ValueError: If ``outputs`` is not (B,) or (B, K) for the batch of ``x``.
        """
        index = outputs.reshape(-1, 1) if outputs.dim() == 1 else outputs
        if index.dim() != 2:
            raise ValueError(
                f"outputs must have shape (B,) or (B, K), got {tuple(outputs.shape)}."
            )
        trace = self.trace(x, create_graph=enable_backprop)
        f = trace.f.reshape(len(trace.f), -1)
        if index.shape[0] != f.shape[0]:
            raise ValueError(
                f"outputs must have shape (B,) or (B, K) with B = {f.shape[0]} inputs, got "
                f"{tuple(outputs.shape)}."
            )
        # one column per selected output: K products, never the C rows of the full Jacobian
        index = index.to(device=f.device, dtype=torch.long).T.unsqueeze(-1)  # (K, B, 1)
        columns = f.new_zeros(index.shape[0], *f.shape).scatter_(2, index, 1.0)
        Js = trace.per_sample_columns(columns.reshape(-1, *trace.f.shape), dim=1)
        return (Js, trace.f) if enable_backprop else (Js.detach(), trace.f.detach())

    def functorch_jacobians(
        self, x: Inputs, enable_backprop: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Same as ``jacobians``, by reverse-mode ``torch.func.jacrev`` over the batch.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            enable_backprop: Keep ``Js`` and ``f`` differentiable w.r.t. ``x``.

        Returns:
            ``Js`` of shape (B, C, P) and outputs ``f`` of shape (B, C).
        """
        wanted = {id(p) for p in self.params}
        named = {n: p for n, p in self.model.named_parameters() if id(p) in wanted}

        def outputs(theta: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
            f = functional_call(self.model, theta, (x,))
            return f, f

        with torch.enable_grad():
            jac, f = jacrev(outputs, has_aux=True)(named)
        Js = self._select(torch.cat([jac[n].flatten(2) for n in named], dim=2))
        return (Js, f) if enable_backprop else (Js.detach(), f.detach())

    def last_layer_jacobians(
        self, x: Inputs, enable_backprop: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Closed-form Jacobians w.r.t. a linear last layer: ``Jₙ = [I_C ⊗ φₙᵀ, I_C]``.

        Args:
            x: Inputs, passed to ``model.forward_with_features``.
            enable_backprop: Keep ``Js`` and ``f`` differentiable w.r.t. ``x``.

        Returns:
            ``Js`` of shape (B, C, C·D (+ C with a bias)) and outputs ``f`` of shape (B, C).
        """
        extractor = cast(FeatureExtractor, self.model)
        f, phi = extractor.forward_with_features(x)
        batch, n_out = phi.shape[0], f.numel() // phi.shape[0]
        eye = torch.eye(n_out, dtype=phi.dtype, device=phi.device)
        Js = (eye[None, :, :, None] * phi[:, None, None, :]).reshape(batch, n_out, -1)
        if cast(nn.Linear, extractor.last_layer).bias is not None:
            Js = torch.cat([Js, eye.expand(batch, -1, -1)], dim=2)
        return (Js, f) if enable_backprop else (Js.detach(), f.detach())

    def gradients(self, x: Inputs, y: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample gradients of the library loss (``½‖y − f‖²`` or CE) per data point.

        laplace-torch 0.3 differentiates the unscaled squared error here (twice these gradients
        for regression, with twice the loss); we keep gradients and loss consistent with the
        loss that the curvature and ``la.loss`` use.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            y: Targets, shape (B, ...).

        Returns:
            ``Gs`` of shape (B, P) and the summed batch loss (a scalar).
        """
        trace = self.trace(x)
        f = trace.f.detach()
        Gs = trace.per_sample(self.fit_likelihood.output_gradient(f, y))
        return Gs.detach(), self.batch_loss(f, y)

    def curvature_columns(
        self,
        f: Tensor,
        y: Tensor,
        generator: torch.Generator | None = None,
        mc_samples: int | None = None,
        separate_positions: bool = True,
    ) -> Columns:
        """Output-space columns ``vₖ`` whose per-sample outer products sum to the curvature.

        The dense and diagonal curvatures are ``Σₙ Σₖ (Jₙᵀ vₖₙ)(Jₙᵀ vₖₙ)ᵀ``; a family (GGN, EF)
        only says which columns each row of the outputs has (``row_columns``). For outputs
        with extra dimensions (``laplace.utils.outputs``) positions an ``ignore_index`` drops
        get zero columns, and with ``separate_positions`` the exact GGN gets one column per
        position and row column (the GGN of the summed per-position loss; KFAC's weight sharing
        instead lets each column cover all positions).

        Args:
            f: Detached outputs of the batch, shape (B, ...).
            y: Targets of the batch.
            generator: Random generator of sampled columns (Monte-Carlo Fisher); torch's global
                generator when None.
            mc_samples: Monte-Carlo samples per data point, for a stochastic curvature only.
            separate_positions: Give positions columns of their own where the family's are
                per row (``separable_columns``).

        Returns:
            The columns, sliced and iterated like a tensor (K, B, ...).

        Raises:
            ValueError: For ``mc_samples`` with a curvature that is not sampled.
        """
        layout = self.fit_likelihood.layout(f.shape, y)
        rows, targets, keep = layout.split(f, y)
        V = self.row_columns(rows, targets, generator, mc_samples)
        if keep is not None:
            V = V * keep[:, None, None]
        return layout.columns(V, separate_positions and self.separable_columns)

    def row_columns(
        self,
        f: Tensor,
        y: Tensor,
        generator: torch.Generator | None = None,
        mc_samples: int | None = None,
    ) -> Tensor:
        """The family's columns of rows ``f`` (R, C) with targets ``y``, shape (R, C, K).

        Arguments as ``curvature_columns``.
        """
        raise NotImplementedError(f"{type(self).__name__} defines no curvature.")

    def _traced_columns(
        self,
        x: Inputs,
        y: Tensor,
        kwargs: Mapping[str, object],
        separate_positions: bool = True,
        column_limit: int | None = None,
    ) -> tuple[PerSampleTrace, Tensor, Columns]:
        """The batch's trace, its detached outputs and curvature columns.

        With ``column_limit``, columns of each row's own curvature (the exact GGN: one per
        output) are refused before they are formed where the outputs per position exceed it
        ([`check_output_columns`][laplace.curvature.engine.kfac_rules.check_output_columns]).

        Raises:
            ValueError: For keyword arguments other than ``mc_samples`` (positive) and ``N``.
        """
        options = {key: value for key, value in kwargs.items() if key != "N"}
        samples = options.pop("mc_samples", None)
        if options:
            raise ValueError(
                f"unknown keyword arguments {sorted(options)}; the curvature routes accept "
                "mc_samples (stochastic GGN), kfac_approx (kron) and N."
            )
        mc_samples = None if samples is None else check_positive_int(samples, "mc_samples")
        trace = self.trace(x)
        f = trace.f.detach()
        if column_limit is not None and self.separable_columns:
            n_columns = self.fit_likelihood.layout(f.shape, y).n_classes
            check_output_columns(trace.engine, n_columns, column_limit)
        columns = self.curvature_columns(
            f, y, mc_samples=mc_samples, separate_positions=separate_positions
        )
        return trace, f, columns

    def full(
        self, x: Inputs, y: Tensor, **kwargs: Unpack[CurvatureOptions]
    ) -> tuple[Tensor, Tensor]:
        """Dense batch curvature, summed over data points.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            y: Targets, shape (B, ...).
            **kwargs: ``mc_samples`` (Monte-Carlo samples per data point, stochastic GGN only)
                overrides the backend's ``num_samples``; ``N`` is accepted and unused (as in
                laplace-torch); ``into``, a running sum (P, P), is added to in place where it
                can be (``PerSampleTrace.gram``).

        Returns:
            The summed batch loss and the curvature of shape (P, P) (``into`` where the batch
            was added to it).

        Raises:
            ValueError: For ``mc_samples`` with a curvature that is not sampled, or another
                keyword argument.
        """
        into = kwargs.pop("into", None)
        trace, f, columns = self._traced_columns(x, y, kwargs)
        H = trace.gram(columns, into)
        return self.batch_loss(f, y), H if H is into else H.detach()

    def kron(
        self, x: Inputs, y: Tensor, N: int, **kwargs: Unpack[KronOptions]
    ) -> tuple[Tensor, Kron]:
        """Kronecker-factored batch curvature (KFAC) of the family's curvature columns.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            y: Targets, shape (B, ...).
            N: Number of data points of the whole data set (normalises the factors, see
                ``laplace.curvature.engine.kfac``, so those of all batches sum to the data's).
            **kwargs: ``kfac_approx`` (``"expand"`` or ``"reduce"``) overrides the backend's;
                ``mc_samples`` (stochastic GGN only) overrides its ``num_samples``;
                ``low_rank_above`` keeps the output factor of layers with more outputs
                diagonal plus low rank, of rank at most ``output_factor_rank``
                (``laplace.structures.large_output``); ``into``, a running sum of the same
                blocks, is added to in place where its factors allow (``kfac``).

        Returns:
            The summed batch loss and the [`Kron`][laplace.utils.matrix.Kron] of the batch
            (a [`StructuredKron`][laplace.utils.matrix.StructuredKron] with low-rank factors),
            or ``into`` with the batch added.

        Raises:
            ValueError: With ``subnetwork_indices`` or an unknown keyword argument, and for the
                exact GGN of more outputs per position than ``low_rank_above``.
        """
        approx = kwargs.pop("kfac_approx", self.kfac_approx)
        above = kwargs.pop("low_rank_above", None)
        max_rank = kwargs.pop("output_factor_rank", None)
        into = kwargs.pop("into", None)
        trace, f, columns = self._traced_columns(x, y, kwargs, False, column_limit=above)
        blocks = kfac(
            trace,
            columns,
            N,
            approx,
            self.factor,
            None,
            self.kfac_dense_limit,
            above,
            max_rank,
            into=into,
        )
        return self.batch_loss(f, y), blocks

    def kron_statistics(
        self, x: Inputs, y: Tensor, N: int, **kwargs: Unpack[KronOptions]
    ) -> tuple[Tensor, Kron, KfacStatistics]:
        """``kron`` of a batch, with the inputs and gradients its factors are formed from.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            y: Targets, shape (B, ...).
            N: Number of data points of the whole data set.
            **kwargs: As ``kron`` (no low-rank output factors; ``into`` as there).

        Returns:
            The summed batch loss, the ``Kron`` of the batch (``into`` where the batch was
            added to it) and its ``KfacStatistics`` (for EKFAC's eigenvalues once the
            eigenbasis is known).
        """
        approx = kwargs.pop("kfac_approx", self.kfac_approx)
        into = kwargs.pop("into", None)
        trace, f, columns = self._traced_columns(x, y, kwargs, False)
        statistics = KfacStatistics(
            plan_blocks(self.engine, self.kfac_dense_limit),
            self.kron_shapes(),
            curvature_like(self.engine),
        )
        blocks = kfac(
            trace,
            columns,
            N,
            approx,
            self.factor,
            dense_limit=self.kfac_dense_limit,
            statistics=statistics,
            into=into,
        )
        return self.batch_loss(f, y), blocks, statistics

    def kron_eigenvalues(
        self,
        x: Inputs,
        y: Tensor,
        bases: list[list[Tensor | None]],
        **kwargs: Unpack[CurvatureOptions],
    ) -> list[Tensor | None]:
        """EKFAC's eigenvalues of a batch in the KFAC eigenbasis ``bases`` (``.kfac``).

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            y: Targets, shape (B, ...).
            bases: Per block the eigenvector matrices of its factors (None: the identity).
            **kwargs: ``mc_samples`` as in ``full``.

        Returns:
            Per block ``diag(Qᵀ H_batch Q)`` in the shape of its spectrum, None for the exact
            (dense or diagonal) blocks.
        """
        trace, _, columns = self._traced_columns(x, y, kwargs, False)
        return kfac_eigenvalues(trace, columns, bases, self.kfac_dense_limit)

    def kron_shapes(self, low_rank_above: int | None = None) -> list[list[tuple[int, ...]]]:
        """Per parameter the shapes of its ``kron`` block's factors (``.kfac_rules``).

        Args:
            low_rank_above: Mark the output factors ``kron`` keeps low rank for it
                (``LowRankShape``).
        """
        plan = plan_blocks(self.engine, self.kfac_dense_limit, low_rank_above)
        return block_shapes(plan, self.engine.needed)

    def diag(
        self, x: Inputs, y: Tensor, **kwargs: Unpack[CurvatureOptions]
    ) -> tuple[Tensor, Tensor]:
        """Diagonal of the batch curvature, summed over data points.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            y: Targets, shape (B, ...).
            **kwargs: ``mc_samples``, ``N`` and ``into`` (a running sum (P,)) as in ``full``.

        Returns:
            The summed batch loss and the diagonal of shape (P,) (``into`` where the batch was
            added to it).

        Raises:
            ValueError: As ``full``.
        """
        into = kwargs.pop("into", None)
        trace, f, columns = self._traced_columns(x, y, kwargs)
        H = trace.square_sum(columns, into=into)
        return self.batch_loss(f, y), H if H is into else H.detach()


class GGNInterface(CurvatureInterface):
    """Generalised Gauss–Newton ``Σₙ Jₙᵀ Λₙ Jₙ``, exact or as a Monte-Carlo Fisher.

    ``Λₙ`` is the Hessian of the loss w.r.t. the outputs (``I`` for regression,
    ``diag(p) − p pᵀ`` for classification). With ``stochastic=True`` it is replaced by the
    Monte-Carlo estimate ``(1/S) Σₛ ∇_f ℓ(fₙ, ŷₛ) ∇_f ℓ(fₙ, ŷₛ)ᵀ`` with ``ŷₛ ~ p(y | fₙ)``
    drawn from torch's global generator.

    Takes the arguments of ``CurvatureInterface``, and:

    Args:
        stochastic: Use the Monte-Carlo Fisher instead of the exact GGN.
        num_samples: Number of sampled targets ``S`` per data point when stochastic.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        stochastic: bool = False,
        num_samples: int = 1,
    ) -> None:
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y)
        self.stochastic = stochastic
        self.num_samples = num_samples

    @property
    def separable_columns(self) -> bool:  # type: ignore[override]
        """The exact GGN's columns are per row; sampled loss gradients are not."""
        return not self.stochastic

    def row_columns(
        self,
        f: Tensor,
        y: Tensor,
        generator: torch.Generator | None = None,
        mc_samples: int | None = None,
    ) -> Tensor:
        """Columns (R, C, K) with ``Σₖ vₖ vₖᵀ = Λ`` (or its MC estimate) per row.

        Arguments as ``CurvatureInterface.curvature_columns`` (``y`` is unused; sampled
        targets use ``generator``, ``mc_samples`` defaults to ``num_samples``).
        """
        if mc_samples is not None and not self.stochastic:
            raise ValueError(
                "mc_samples needs the Monte-Carlo Fisher (backend_kwargs={'stochastic': True}); "
                "the exact GGN is not sampled."
            )
        if not self.stochastic:
            n_rows, n_out = f.shape[0], f.shape[-1]
            check_fits_in_memory(
                n_rows * n_out * n_out * f.element_size(),
                f.device,
                f"the exact GGN's output-space columns of {n_rows:,} rows of C={n_out:,} outputs "
                f"((R, C, C) in {f.dtype}; C backward passes per batch)",
                "use the Monte-Carlo Fisher (backend_kwargs={'stochastic': True}), "
                "backend=CurvlinopsEF, subset_of_weights='last_layer' (closed forms for many "
                "outputs) or smaller batches.",
            )
            return self.fit_likelihood.output_hessian_sqrt(f)
        n_samples = self.num_samples if mc_samples is None else mc_samples
        scale = 1.0 / math.sqrt(n_samples)
        draws = [
            scale
            * self.fit_likelihood.loss_gradient(
                f, self.fit_likelihood.sample_targets(f, generator)
            )
            for _ in range(n_samples)
        ]
        return torch.stack(draws, dim=-1)


class EFInterface(CurvatureInterface):
    """Empirical Fisher ``Σₙ gₙ gₙᵀ`` of per-sample loss gradients ``gₙ = Jₙᵀ ∇_f ℓ(fₙ, yₙ)``.

    The loss is the library's (``½‖y − f‖²`` for regression), so the regression EF is
    ``Σₙ ‖yₙ − fₙ‖²``-weighted as the Gaussian likelihood with σ = 1 implies. laplace-torch 0.3
    instead squares gradients of the unscaled squared error and then halves, which gives twice
    this matrix for regression; classification agrees.
    """

    def row_columns(
        self,
        f: Tensor,
        y: Tensor,
        generator: torch.Generator | None = None,
        mc_samples: int | None = None,
    ) -> Tensor:
        """The single column ``∇_f ℓ(fₙ, yₙ)`` (R, C, 1); ``mc_samples`` is refused."""
        if mc_samples is not None:
            raise ValueError("mc_samples applies to the Monte-Carlo Fisher, not the EF.")
        return self.fit_likelihood.loss_gradient(f, y).unsqueeze(-1)
