"""Parameter subsets: which weights the posterior covers and how a weight vector drives the model.

``AllWeights`` covers every parameter with ``requires_grad=True``; ``Subnetwork`` chosen entries
of their flattened vector; ``LastLayer`` the linear head of a
``FeatureExtractor``, which may only be found on the first
forward pass (``resolved`` tells). All implement the abstract ``ParameterSubset``: the
parameters and their flattened vector, ``resolve``, ``forward_samples`` (the model run with
other weights) and ``linearize``: the model's outputs and Jacobian in the kind
(``laplace.structures.jacobians``) that suits the posterior, for the GLM predictive.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import Tensor, nn
from torch.func import functional_call

from laplace.structures.jacobians import (
    HeadFeatures,
    Jacobian,
    JacobianRows,
    backend_kind,
    backend_linearization,
)
from laplace.structures.large_output import variances_only_reason
from laplace.structures.last_layer import head_features
from laplace.utils.data import HALF_DTYPES, Inputs, posterior_dtype, upcast
from laplace.utils.errors import ArgumentTypeError, MetaDeviceError, NotFittedError
from laplace.utils.feature_extractor import FeatureExtractor, as_feature_extractor
from laplace.utils.outputs import OutputLayout

if TYPE_CHECKING:
    from laplace.curvature.curvature_backend import CurvatureBackend
    from laplace.likelihoods.likelihood_model import LikelihoodModel
    from laplace.utils.feature_extractor import FeatureReduction

__all__ = [
    "MISSING_SUBNETWORK_INDICES",
    "AllWeights",
    "LastLayer",
    "ParameterSubset",
    "Subnetwork",
    "check_parameters",
    "check_posterior_dtype",
    "check_subnetwork_indices",
    "extractor_property",
]

#: Floating-point types a posterior can be computed in.
POSTERIOR_DTYPES = (torch.float32, torch.float64)

#: Message for a subnetwork Laplace built without ``subnetwork_indices``.
MISSING_SUBNETWORK_INDICES = (
    "subnetwork Laplace needs subnetwork_indices: a 1-D torch.long tensor of indices into the "
    "flattened trainable parameters (e.g. torch.tensor([0, 5, 9]) or "
    "SubnetMask(...).select(train_loader))."
)


def check_posterior_dtype(dtype: object) -> torch.dtype | None:
    """The ``dtype`` argument of a Laplace class: None, ``torch.float32`` or ``torch.float64``.

    Raises:
        ArgumentTypeError: (a ``ValueError`` and a ``TypeError``) for anything else.
    """
    if dtype is not None and dtype not in POSTERIOR_DTYPES:
        raise ArgumentTypeError(
            f"dtype must be None (the parameters' type, float32 for a half-precision network), "
            f"torch.float32 or torch.float64, got {dtype!r}."
        )
    return dtype


def check_parameters(named: list[tuple[str, Tensor]]) -> None:
    """Refuse parameters a posterior cannot be computed over.

    Args:
        named: ``(name, parameter)`` pairs of the weights the posterior covers.

    Raises:
        MetaDeviceError: If a parameter is on the ``meta`` device (it holds no values).
        ArgumentTypeError: (a ``ValueError`` and a ``TypeError``) for mixed floating-point
            types, or a type other than float32, float64, bfloat16 and float16 (a
            half-precision network gets a float32 posterior).
        ValueError: If the parameters lie on several devices.
    """
    meta = [n for n, p in named if p.device.type == "meta"]
    if meta:
        raise MetaDeviceError(
            f"the model's parameters {meta[:3]} are on the meta device and hold no values; "
            "materialise the model (e.g. model.to_empty(device=...) and load its weights) first."
        )
    dtypes = {p.dtype for _, p in named}
    if not dtypes <= {*POSTERIOR_DTYPES, *HALF_DTYPES} or len(dtypes) > 1:
        found = sorted(str(d) for d in dtypes)
        raise ArgumentTypeError(
            f"the posterior needs parameters of one dtype, float32, float64, bfloat16 or "
            f"float16; the model's are {found}. Convert the model (e.g. model.float()) or "
            "freeze the parameters the posterior should not cover."
        )
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(
            f"the model's parameters lie on several devices {sorted(map(str, devices))}; "
            "move the model to one device."
        )


class _ExtractorOwner(Protocol):
    """A last-layer approximation: its ``model`` is a feature extractor."""

    model: FeatureExtractor


def extractor_property(name: str, doc: str, settable: bool = False) -> property:
    """A property of a last-layer approximation read from its feature extractor ``la.model``.

    Args:
        name: The attribute of ``FeatureExtractor``.
        doc: The property's docstring.
        settable: Whether assigning it sets the extractor's attribute.
    """

    def fset(la: _ExtractorOwner, value: object) -> None:
        setattr(la.model, name, value)

    return property(lambda la: getattr(la.model, name), fset if settable else None, doc=doc)


class ParameterSubset(ABC):
    """The weights a posterior covers, and how a weight vector drives the model.

    A subset knows its parameters ``params`` (named ``names``) and flattens them into one
    vector of P entries, in that order (``vector``, ``unflatten``); it names the tensors the
    curvature's blocks are shaped as (``curvature_params``) and the lengths of the priors it
    takes. What a subclass implements is how the model meets the weights: ``resolve`` finds
    parameters known only from a forward pass, ``forward_samples`` runs the model with sampled
    weights, and ``linearize`` gives the outputs and the Jacobian w.r.t. the subset in the
    kind that ``jacobian_kind`` names for a posterior's closed forms. A Laplace class names its
    subset by its ``_subset_kind`` and builds it with ``for_model(model, likelihood,
    **_subset_options)``.

    Shapes: inputs ``X`` (B, ...) (or a dict-like batch), outputs (B, C), weight vectors (P,),
    weight samples (S, P).

    Attributes:
        params: The parameter tensors (raises until the subset is ``resolved``).
        names: Their names in the model.
        model: The network the subset belongs to.
        backend_options: Keyword arguments the subset adds to the backend's constructor.
        stateful_parts: Objects besides the approximation that a failed call must restore.
        requested_dtype: The posterior's type asked for; None: from the parameters.
    """

    params: list[Tensor]
    names: list[str]
    model: nn.Module
    #: Keyword arguments the subset adds to the backend's constructor.
    backend_options: ClassVar[Mapping[str, object]] = {}
    #: Objects besides the approximation that a failed call must restore (a last layer found).
    stateful_parts: tuple[object, ...] = ()
    #: The posterior's type asked for (the ``dtype`` argument); None: from the parameters.
    requested_dtype: torch.dtype | None = None

    @property
    @abstractmethod
    def resolved(self) -> bool:
        """Whether the parameters are known (a last layer is found on the first forward pass)."""

    @abstractmethod
    def resolve(self, X: Inputs) -> None:
        """Make the parameters known from a forward pass on inputs ``X`` (B, ...) if they are not.

        Args:
            X: A batch of inputs (its first data point suffices).
        """

    @abstractmethod
    def forward_samples(self, thetas: Tensor, X: Inputs, **model_kwargs: object) -> Tensor:
        """Model outputs for weight samples, leaving the model unchanged.

        Args:
            thetas: Weight samples (S, P) of the subset (the other weights stay as they are).
            X: Inputs (B, ...), or a dict-like batch.
            **model_kwargs: Keyword arguments of the model's forward.

        Returns:
            Outputs (S, B, C), in the posterior's type.
        """

    @abstractmethod
    def jacobian_kind(self, closed_forms: Collection[type[Jacobian]]) -> type[Jacobian]:
        """The Jacobian kind ``linearize`` returns for a posterior with these closed forms.

        Args:
            closed_forms: The Jacobian kinds the posterior has closed forms for.
        """

    @abstractmethod
    def linearize(
        self,
        X: Inputs,
        backend: CurvatureBackend,
        closed_forms: Collection[type[Jacobian]],
        backprop: bool,
    ) -> tuple[Tensor, Jacobian]:
        """Outputs ``f`` (B, C) and the Jacobian ``J`` of the model w.r.t. the subset.

        From one forward pass, in the kind ``jacobian_kind(closed_forms)`` names.

        Args:
            X: Inputs (B, ...), or a dict-like batch.
            backend: The curvature backend over these parameters.
            closed_forms: The Jacobian kinds the posterior has closed forms for.
            backprop: Keep the results differentiable w.r.t. the inputs.
        """

    @property
    def prior_lengths(self) -> tuple[int | None, int | None]:
        """Lengths of a layer-wise and of a diagonal prior (n_layers, n_params)."""
        return self.n_layers, self.n_params

    @property
    def prior_sizes(self) -> list[int]:
        """Weights under each entry of a layer-wise prior (the posterior's layers)."""
        return self.sizes

    def prior_mean_vector(self, prior_mean: Tensor) -> Tensor:
        """The prior mean expanded to the posterior's weight vector, shape (P,)."""
        return torch.broadcast_to(prior_mean, (self.n_params,)).clone()

    def variances_only_reason(self, n_outputs: int) -> str | None:
        """Why the GLM predictive gives only output variances (B, C); None: covariances too."""
        return None

    @property
    def sizes(self) -> list[int]:
        """Number of entries of each parameter tensor."""
        return [p.numel() for p in self.params]

    @property
    def n_params(self) -> int:
        """Number of weights P covered by the posterior."""
        return sum(self.sizes)

    @property
    def n_layers(self) -> int:
        """Number of parameter tensors (a Linear layer with bias counts twice)."""
        return len(self.params)

    @property
    def device(self) -> torch.device:
        """Device of the parameters."""
        return self.params[0].device

    @property
    def dtype(self) -> torch.dtype:
        """Floating-point type of the posterior: as asked, else the parameters' (half: float32)."""
        return self.requested_dtype or posterior_dtype(self.params[0].dtype)

    @property
    def curvature_params(self) -> list[Tensor]:
        """Tensors shaped as the blocks of the curvature over the subset, in the posterior's type.

        The parameters themselves; float32 copies of half-precision ones.
        """
        return [p if p.dtype == self.dtype else p.detach().to(self.dtype) for p in self.params]

    def vector(self) -> Tensor:
        """The current weights as one vector in the posterior's type, shape (P,)."""
        return torch.cat([p.reshape(-1) for p in self.params]).to(self.dtype)

    def unflatten(self, theta: Tensor) -> dict[str, Tensor]:
        """Split a vector (P,) into named parameter tensors (in the parameters' own types)."""
        chunks = torch.split(theta, self.sizes)
        return {n: c.view_as(p).to(p.dtype) for n, c, p in zip(self.names, chunks, self.params)}


class AllWeights(ParameterSubset):
    """All trainable parameters of ``model``, flattened in ``model.named_parameters()`` order.

    Args:
        model: The network; parameters with ``requires_grad=False`` stay at their values.

    Raises:
        ValueError: If the model has no trainable parameters.
    """

    #: The parameters are known from construction.
    resolved = True

    @classmethod
    def for_model(cls, model: nn.Module, likelihood: LikelihoodModel) -> AllWeights:
        """The subset of ``model`` a Laplace class builds (``likelihood``: its likelihood)."""
        return cls(model)

    def __init__(self, model: nn.Module) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "the model has no parameters with requires_grad=True: nothing to put a "
                "posterior on."
            )
        self.model = model
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]

    def resolve(self, X: Inputs) -> None:
        """Nothing to find: the parameters are known from construction."""

    def forward_samples(self, thetas: Tensor, X: Inputs, **model_kwargs: object) -> Tensor:
        """Model outputs for weight samples (S, P) → (S, B, C), leaving the model unchanged."""
        outputs = [
            functional_call(self.model, self.unflatten(t), (X,), model_kwargs) for t in thetas
        ]
        return upcast(torch.stack(outputs), self.dtype)

    def jacobian_kind(self, closed_forms: Collection[type[Jacobian]]) -> type[Jacobian]:
        """The Jacobian kind ``linearize`` returns, given the posterior's closed forms."""
        return backend_kind(closed_forms)

    def linearize(
        self,
        X: Inputs,
        backend: CurvatureBackend,
        closed_forms: Collection[type[Jacobian]],
        backprop: bool,
    ) -> tuple[Tensor, Jacobian]:
        """Outputs ``f`` (B, C) and Jacobian ``J`` of the model from one forward pass.

        Args:
            X: Inputs (B, ...), or a dict-like batch.
            backend: The curvature backend over these parameters.
            closed_forms: The Jacobian kinds the posterior has closed forms for.
            backprop: Keep the results differentiable w.r.t. the inputs.
        """
        kind = self.jacobian_kind(closed_forms)
        return backend_linearization(backend, X, kind, backprop)


def check_subnetwork_indices(indices: object, n_params: int) -> Tensor:
    """Validate subnetwork indices into a flattened parameter vector of length ``n_params``.

    Args:
        indices: Candidate indices.
        n_params: Length of the flattened trainable parameter vector.

    Returns:
        ``indices`` unchanged (a 1-D ``torch.long`` tensor).

    Raises:
        ArgumentTypeError: (a ``ValueError`` and a ``TypeError``) if ``indices`` is None.
        ValueError: If ``indices`` is not a 1-D ``torch.long`` tensor, empty, out of
            ``[0, n_params)`` or has duplicates (ValueError for all, as in laplace-torch), or
            on the meta device.
    """
    hint = "e.g. torch.tensor([0, 5, 9]) or SubnetMask(...).select(train_loader)"
    if indices is None:
        raise ArgumentTypeError(MISSING_SUBNETWORK_INDICES)
    if not isinstance(indices, Tensor) or indices.dtype != torch.long:
        kind = indices.dtype if isinstance(indices, Tensor) else type(indices).__name__
        raise ValueError(f"subnetwork_indices must be a torch.long tensor ({hint}), got {kind}.")
    if indices.device.type == "meta":
        raise MetaDeviceError("subnetwork_indices are on the meta device: they hold no values.")
    if indices.dim() != 1 or indices.numel() == 0:
        raise ValueError(
            f"subnetwork_indices must be a non-empty 1-D tensor, got shape {tuple(indices.shape)}."
        )
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= n_params:
        raise ValueError(
            f"subnetwork_indices must lie in [0, n_params={n_params}), got values from {low} "
            f"to {high}."
        )
    if len(indices.unique()) != len(indices):
        raise ValueError("subnetwork_indices must not contain duplicate entries.")
    return indices


class Subnetwork(AllWeights):
    """Chosen entries ``θ[indices]`` of the flattened trainable parameters; the rest stay at MAP.

    ``params``, ``names``, ``vector()`` and ``forward_samples`` refer to the whole trainable
    vector (length P, as ``la.mean`` in laplace-torch); ``select`` and ``assemble``
    move between it and the subnetwork values (length K, in the order of ``indices``).

    Args:
        model: The network.
        indices: 1-D ``torch.long`` tensor of K distinct indices into the flattened trainable
            parameters (``model.named_parameters()`` order).

    Raises:
        ValueError: For invalid indices (see ``check_subnetwork_indices``).
    """

    @classmethod
    def for_model(
        cls, model: nn.Module, likelihood: LikelihoodModel, indices: Tensor
    ) -> Subnetwork:
        """The subnetwork ``indices`` of ``model`` (see ``AllWeights.for_model``)."""
        return cls(model, indices)

    def __init__(self, model: nn.Module, indices: Tensor) -> None:
        super().__init__(model)
        self.indices = check_subnetwork_indices(indices, self.n_params).to(self.device)
        self.backend_options = {"subnetwork_indices": self.indices}

    @property
    def n_subnet(self) -> int:
        """Number K of parameters in the subnetwork."""
        return len(self.indices)

    @property
    def prior_lengths(self) -> tuple[int | None, int | None]:
        """Scalar or diagonal over the subnetwork: no layer-wise prior (None, K)."""
        return None, self.n_subnet

    @property
    def prior_sizes(self) -> list[int]:
        """The prior covers the subnetwork's K entries."""
        return [self.n_subnet]

    def prior_mean_vector(self, prior_mean: Tensor) -> Tensor:
        """Weights (P,) with the subnetwork at its prior mean and the rest at the MAP."""
        prior = torch.broadcast_to(prior_mean, (self.n_subnet,))
        return self.assemble(self.vector().detach(), prior.unsqueeze(0))[0]

    @property
    def curvature_params(self) -> list[Tensor]:
        """One vector of K entries: the curvature covers the subnetwork only."""
        return [self.params[0].new_empty(self.n_subnet, dtype=self.dtype)]

    def select(self, theta: Tensor) -> Tensor:
        """Subnetwork entries of full vectors: (..., P) → (..., K)."""
        return theta[..., self.indices]

    def assemble(self, theta: Tensor, subnet_values: Tensor) -> Tensor:
        """Copies (S, P) of ``theta`` (P,) with the subnetwork set to ``subnet_values`` (S, K)."""
        full = theta.expand(len(subnet_values), -1).clone()
        full[:, self.indices] = subnet_values
        return full

    def jacobian_kind(self, closed_forms: Collection[type[Jacobian]]) -> type[Jacobian]:
        """Dense rows: the layer-wise closed forms cover whole parameter tensors only."""
        return JacobianRows


class LastLayer(ParameterSubset):
    """Weight and bias of a linear head ``f = W φ + b``, flattened as W (C, D) row-major, b (C,).

    Args:
        extractor: The wrapped model; its last layer may still be unknown (``resolved``).
        layout: The rows of outputs of a shape (the likelihood's ``layout``), for outputs
            with extra dimensions (``laplace.utils.outputs``); None: outputs (B, C) only.
    """

    backend_options: ClassVar[Mapping[str, object]] = {"last_layer": True}
    model: FeatureExtractor

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        likelihood: LikelihoodModel,
        last_layer_name: str | None = None,
        feature_reduction: FeatureReduction | str | None = None,
    ) -> LastLayer:
        """The head of ``model`` wrapped in a feature extractor (see ``AllWeights.for_model``).

        Args:
            model: The network, or a ``FeatureExtractor`` of it.
            likelihood: The approximation's likelihood model (its ``layout`` of outputs).
            last_layer_name: Name of the head in ``model.named_modules()``; None: found on the
                first forward pass.
            feature_reduction: How features (B, ..., D) are reduced to (B, D).
        """
        extractor = as_feature_extractor(model, last_layer_name, feature_reduction)
        return cls(extractor, likelihood.layout)

    def __init__(
        self,
        extractor: FeatureExtractor,
        layout: Callable[[Sequence[int]], OutputLayout] | None = None,
    ) -> None:
        self.model = extractor
        self.layout = layout
        self.stateful_parts = (extractor,)

    def variances_only_reason(self, n_outputs: int) -> str | None:
        """A head above the large-output threshold: its closed forms give output variances."""
        return variances_only_reason(n_outputs)

    @property
    def resolved(self) -> bool:
        """Whether the last layer is known."""
        return self.model.last_layer is not None

    def resolve(self, X: Inputs) -> None:
        """Find the last layer with one forward pass on ``X`` if it is not known yet."""
        if not self.resolved:
            with torch.no_grad():
                self.model.find_last_layer(X)

    @property
    def layer(self) -> nn.Linear:
        """The linear head.

        Raises:
            NotFittedError: (a ``RuntimeError`` and an ``AttributeError``) if it has not been
                found yet.
        """
        if self.model.last_layer is None:
            raise NotFittedError(
                "the last layer is not known yet: it is found on the first batch of fit() "
                "(call fit() first, or pass last_layer_name=...)."
            )
        return self.model.last_layer

    @property
    def params(self) -> list[Tensor]:
        """Weight, then bias if the head has one."""
        return list(self.layer.parameters())

    @property
    def names(self) -> list[str]:
        """Parameter names in the wrapped model (e.g. ``"head.weight"``)."""
        prefix = f"{self.model.last_layer_name}." if self.model.last_layer_name else ""
        return [prefix + name for name, _ in self.layer.named_parameters()]

    @property
    def device(self) -> torch.device:
        """Device of the head, or of the model while the head is unknown."""
        return super().device if self.resolved else next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Floating-point type of the head, or of the model while the head is unknown."""
        if self.resolved:
            return super().dtype
        return self.requested_dtype or posterior_dtype(next(self.model.parameters()).dtype)

    def outputs_and_features(self, X: Inputs, **model_kwargs: object) -> tuple[Tensor, Tensor]:
        """Model outputs (B, C) and head inputs φ from one forward pass.

        φ is (B, D) when the head maps each data point's features to its outputs (the closed
        forms apply); otherwise (e.g. (B, T, D) without ``feature_reduction``, or reward pairs)
        callers fall back to autograd routes.
        """
        return upcast(self.model.forward_with_features(X, **model_kwargs), self.dtype)

    def head(self, thetas: Tensor, phi: Tensor) -> Tensor:
        """Head outputs for weight samples: thetas (S, P), features (B, D) → (S, B, C)."""
        n_out, n_in = self.layer.out_features, self.layer.in_features
        W = thetas[:, : n_out * n_in].reshape(-1, n_out, n_in)
        f = torch.einsum("bd,scd->sbc", phi, W)
        if self.layer.bias is not None:
            f = f + thetas[:, n_out * n_in :].unsqueeze(1)
        return f

    def forward_samples(self, thetas: Tensor, X: Inputs, **model_kwargs: object) -> Tensor:
        """Outputs for head samples thetas (S, P) → (S, B, C), from one feature pass."""
        f, phi = self.outputs_and_features(X, **model_kwargs)
        if self.one_row_per_point(f, phi):
            return self.head(thetas, phi)
        net = self.model.model
        outputs = [functional_call(net, self.unflatten(t), (X,), model_kwargs) for t in thetas]
        return upcast(torch.stack(outputs), self.dtype)

    @staticmethod
    def one_row_per_point(f: Tensor, phi: Tensor) -> bool:
        """Whether the head maps each data point's features φ (B, D) to its outputs (B, C).

        Otherwise (sequence features (B, T, D), reward pairs reshaped to (2B, D) inside the
        model) the closed forms in the features do not apply.
        """
        return f.dim() == 2 and phi.dim() == 2 and phi.shape[0] == f.shape[0]

    def jacobian_kind(self, closed_forms: Collection[type[Jacobian]]) -> type[Jacobian]:
        """The head's features (when it sees one row per data point)."""
        return HeadFeatures

    def linearize(
        self,
        X: Inputs,
        backend: CurvatureBackend,
        closed_forms: Collection[type[Jacobian]],
        backprop: bool,
    ) -> tuple[Tensor, Jacobian]:
        """Outputs ``f`` (B, C) and the head's features φ (B, D), from one forward pass.

        Outputs with extra dimensions (B, …) whose head sees one feature vector per position
        give the features of their rows (B·T, D)
        (``head_features``) where the posterior has a closed
        form for them. A head that sees several rows per data point otherwise takes what the
        backend linearises into (``backend_linearization``).
        Arguments as for ``AllWeights.linearize``.
        """
        with torch.enable_grad() if backprop else torch.no_grad():
            f, phi = self.outputs_and_features(X)
        bias = self.layer.bias is not None
        if self.one_row_per_point(f, phi):
            return f, HeadFeatures(phi, f.shape[-1], bias)
        if f.dim() > 2 and self.layout is not None and HeadFeatures in closed_forms:
            layout = self.layout(f.shape)
            rows = head_features(self.layer, phi, layout.rows(f), layout.n_positions)
            if rows is not None:
                return f, HeadFeatures(rows, layout.n_classes, bias)
        return backend_linearization(backend, X, backend_kind(closed_forms), backprop)
