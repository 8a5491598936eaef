"""The contract every posterior structure (dense, diagonal, Kronecker, low-rank) implements.

A structure owns two things: the accumulator of a fit (how the curvature of a batch is obtained
from a backend, summed over batches, added to an earlier fit, stored and saved), and the Gaussian
posterior ``N(θ_MAP, P⁻¹)`` with ``P = h·H + diag(p₀)`` once the curvature ``H``, the likelihood
factor ``h = 1/(σ²T)`` and the prior precision ``p₀`` are known. Fits, predictives, the marginal
likelihood, hyperparameter tuning and saved states only talk to this interface, so they never
branch on the structure.

The functional variance ``J P⁻¹ Jᵀ`` is a double dispatch: a parameter subset linearises the model
into one of a few Jacobian kinds (``laplace.structures.jacobians``), and each structure maps the
kinds it has a closed form for to that closed form (``closed_forms``); any other kind, or a closed
form that does not apply (returns None), goes through the kind's dense rows
(``Posterior.rows_variance``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import torch
from torch import Tensor

from laplace.structures.jacobians import Jacobian
from laplace.structures.memory_budgets import JACOBIAN_CHUNK_BYTES
from laplace.utils.data import Inputs

if TYPE_CHECKING:
    from laplace.curvature.curvature_backend import CurvatureBackend

__all__ = [
    "ClosedForm",
    "Curvature",
    "NotPositiveDefiniteError",
    "Posterior",
    "expand_to_diagonal",
    "glm_prediction_bytes",
    "running_sum",
]


def running_sum(backend: CurvatureBackend, route: str, total: Curvature | None) -> dict:
    """``{"into": total}`` for the backend's ``route`` where it adds a batch to it, else ``{}``.

    The native engine's routes add a batch to the running sum they are handed in place
    (``native_engine``); a route a subclass defines for itself outside this library keeps its
    own signature and is handed nothing.
    """
    method = getattr(type(backend), route, None)
    own = getattr(method, "__module__", "").startswith("laplace.")
    native = bool(getattr(backend, "native_engine", False)) and own
    return {"into": total} if native and total is not None else {}


#: ``J P⁻¹ Jᵀ`` (B, C, C) of a posterior for one Jacobian kind, or None where it does not apply:
#: ``(posterior, J)`` of the structure and the kind it is listed under.
ClosedForm = Callable[..., Tensor | None]
#: A curvature (or a precision) in a structure's own representation: a tensor (dense (P, P),
#: diagonal (P,)), a ``Kron`` summed or a ``KronDecomposed`` stored (Kronecker), eigenpairs (low
#: rank), a ``MatFreeCurvature``. Each structure's methods name their own; the fits, passes and
#: states hand it between a structure's methods without looking inside, so the contract leaves
#: it open.
Curvature: TypeAlias = Any


class NotPositiveDefiniteError(RuntimeError):
    """The posterior precision could not be factorised: it is not positive definite."""


def expand_to_diagonal(prior_precision: Tensor, layer_sizes: Sequence[int]) -> Tensor:
    """Expand a scalar, layer-wise or diagonal precision to the diagonal, shape (P,).

    Where lengths coincide, diagonal wins, then scalar.
    """
    n_params = sum(layer_sizes)
    if len(prior_precision) == n_params:
        return prior_precision
    if len(prior_precision) == 1:
        return prior_precision.expand(n_params)
    sizes = torch.as_tensor(layer_sizes, device=prior_precision.device)
    return torch.repeat_interleave(prior_precision, sizes)


def glm_prediction_bytes(
    n_rows: int,
    n_outputs: int,
    n_params: int,
    itemsize: int,
    joint: bool,
    variances_only: bool = False,
    jacobian_rows: bool = True,
) -> int:
    """Bytes a GLM prediction holds besides the posterior, from the shapes alone.

    The moments ``f_mu`` (R, C) and ``f_var`` (R, C, C) (``variances_only``: (R, C)), and a
    chunk of Jacobian rows with their solve (two (R·C, P) blocks within
    ``JACOBIAN_CHUNK_BYTES`` each); ``joint``: the covariance (R·C, R·C) and the rows of all
    points at once.

    Args:
        n_rows: Output rows R (test points, times the positions of outputs with extra
            dimensions).
        n_outputs: Outputs per row C.
        n_params: Parameters P.
        itemsize: Bytes per number (the model's dtype).
        joint: Whether the joint covariance of all rows is formed.
        variances_only: Whether the prediction gives each row's variances (R, C) only (a last
            layer with many outputs, ``large_output.variances_only_reason``).
        jacobian_rows: Whether Jacobian rows are formed (not by a closed form that needs none).
    """
    values = n_rows * n_outputs
    rows = values * n_params * itemsize if jacobian_rows else 0
    if joint:
        return (values + values**2) * itemsize + 2 * rows
    variances = values if variances_only else values * n_outputs
    return (values + variances) * itemsize + 2 * min(rows, JACOBIAN_CHUNK_BYTES)


@cache
def _prior_dependent(cls: type[Posterior]) -> frozenset[str]:
    """The cached attributes of a structure that ``with_prior`` computes anew."""
    names = {name for klass in cls.__mro__ for name, value in vars(klass).items()}
    cached = {name for name in names if isinstance(getattr(cls, name, None), cached_property)}
    return frozenset(cached - set(cls.prior_free))


class Posterior(ABC):
    """Gaussian posterior with precision ``P = h·H + diag(p₀)`` over P parameters.

    The prior precision is kept as given (``prior_precision``) and expanded to its diagonal
    (``prior_diag``) where a structure needs it; a structure constant on blocks reads the
    given one. ``with_prior`` gives the posterior of another prior precision sharing what the
    structure computed from ``H`` and ``h`` alone (``prior_free``): marglik tuning changes the
    prior at every step, nothing else.

    Args:
        H: Curvature in the structure's own representation (summed over the data).
        h_factor: Scalar likelihood factor ``h = 1/(σ²T)``, shape () or (1,).
        prior_precision: The prior precision: its diagonal, shape (P,); or, with
            ``prior_sizes``, a scalar (1,) or one value per entry of ``prior_sizes``.
        prior_sizes: Weights under each entry of a layer-wise prior; None: ``prior_precision``
            is the diagonal.
    """

    #: The backend method (``full``, ``diag``, ``kron``) giving a batch's curvature in this form.
    backend_route: ClassVar[str]
    #: Closed forms of ``J P⁻¹ Jᵀ`` by Jacobian kind; other kinds go through their dense rows.
    closed_forms: ClassVar[Mapping[type[Jacobian], ClosedForm]] = {}
    #: Kinds of ``closed_forms`` whose closed form forms no Jacobian rows (what it forms is
    #: counted by ``held_bytes``).
    rowless_kinds: ClassVar[frozenset[type[Jacobian]]] = frozenset()
    #: Why ``fit(override=False)`` cannot update a fit of this structure; None: it can.
    update_refusal: ClassVar[str | None] = None
    #: The closed form of a linear head's curvature in this structure's form, equal to its
    #: ``backend_route`` (``laplace.structures.last_layer.head_curvature``); None: none.
    head_curvature: ClassVar[Callable[..., Curvature] | None] = None

    #: Cached attributes computed from ``H`` and ``h_factor`` alone, which ``with_prior``
    #: shares (every other cached attribute is recomputed for the new prior).
    prior_free: ClassVar[tuple[str, ...]] = ()

    #: What would fit where a fit or a prediction of this structure does not (for the refusal).
    lighter: ClassVar[str] = "fewer weights (subset_of_weights='last_layer' or a subnetwork)"

    def __init__(
        self,
        H: Curvature,
        h_factor: Tensor,
        prior_precision: Tensor,
        prior_sizes: Sequence[int] | None = None,
    ) -> None:
        self.H = H
        self.h_factor = h_factor.reshape(())
        self._set_prior(prior_precision, prior_sizes)

    def _set_prior(self, prior_precision: Tensor, prior_sizes: Sequence[int] | None) -> None:
        self.prior_precision, self.prior_sizes = prior_precision, prior_sizes
        if prior_sizes is None:
            self.prior_diag = prior_precision

    @cached_property
    def prior_diag(self) -> Tensor:
        """The prior precision's diagonal, shape (P,)."""
        return expand_to_diagonal(self.prior_precision, self.prior_sizes)

    def with_prior(
        self, prior_precision: Tensor, prior_sizes: Sequence[int] | None = None
    ) -> Posterior:
        """The posterior of the same curvature and ``h`` with another prior precision.

        The attributes the constructor set and the cached ones named in ``prior_free`` (computed
        now if they were not) are shared with this posterior; every other cached attribute is
        computed anew when asked.

        Args:
            prior_precision: See the class.
            prior_sizes: See the class.
        """
        for name in self.prior_free:  # computed here first, so that every copy shares them
            getattr(self, name)
        cls = type(self)
        dropped = _prior_dependent(cls)
        out = cls.__new__(cls)
        kept = vars(out)
        for name, value in vars(self).items():
            if name not in dropped:
                kept[name] = value
        out._set_prior(prior_precision, prior_sizes)
        return out

    # ---------------------------------------------------------------- curvature accumulation
    # A fit is a sum over batches in the structure's representation: ``zeros`` is the empty
    # sum, ``batch_curvature`` a batch's summand from a backend (a parameter subset may give it
    # in closed form instead), ``add`` sums it in; ``merge`` adds a new sum to an earlier fit
    # (``fit(override=False)``), ``finalize`` turns a sum into the stored curvature, and
    # ``state`` / ``load_state`` write and read the stored curvature as plain tensors.
    @staticmethod
    @abstractmethod
    def zeros(params: Sequence[Tensor]) -> Curvature:
        """Empty curvature for the parameter tensors ``params`` (on their device and dtype)."""

    @classmethod
    def batch_curvature(
        cls,
        backend: CurvatureBackend,
        X: Inputs,
        y: Tensor,
        n_data: int,
        total: Curvature | None = None,
    ) -> tuple[Tensor, Curvature]:
        """``(loss, H_batch)`` of one batch from a curvature backend (its ``backend_route``).

        Args:
            backend: A curvature backend (a
                [`CurvatureInterface`][laplace.curvature.CurvatureInterface]).
            X: Inputs of the batch.
            y: Targets of the batch.
            n_data: Number of data points of the whole training set (KFAC rescaling).
            total: The pass's running sum, which the native engine adds the batch to in place
                and returns as ``H_batch`` where it can.
        """
        route = cls.backend_route
        return getattr(backend, route)(X, y, **running_sum(backend, route, total))

    @staticmethod
    def add(total: Curvature, H: Curvature) -> Curvature:
        """``total + H``, summed into ``total`` (a sum the caller owns) where it can be."""
        total += H
        return total

    @staticmethod
    def is_finite(H: Curvature) -> bool:
        """Whether every entry of the curvature is finite.

        A sum is finite iff every summand is (barring overflow), so one reduction suffices.
        """
        return bool(torch.isfinite(H.sum()))

    @staticmethod
    def merge(previous: Curvature, H: Curvature, n_before: int, n_data: int) -> Curvature:
        """The sum of a stored fit over ``n_before`` points and a new sum, over ``n_data`` points.

        Args:
            previous: The stored curvature of the earlier fits.
            H: The new sum (normalised, where the structure normalises, for ``n_data`` points).
            n_before: Data points of the earlier fits.
            n_data: Data points of the earlier fits and the new sum together.
        """
        return previous + H

    @staticmethod
    def finalize(H: Curvature, **options: object) -> Curvature:
        """The curvature as stored after a fit (e.g. eigen-decomposed); identity by default.

        Args:
            H: The summed curvature.
            **options: The structure's options (Kronecker: ``damping``).
        """
        return H

    @staticmethod
    def state(H: Curvature) -> object:
        """The stored curvature as detached tensors (nested in lists or dicts), for a state."""
        return H.detach()

    @classmethod
    def load_state(cls, state: object, zeros: Curvature, **options: object) -> Curvature:
        """The stored curvature from ``state``'s value, checked against ``zeros``.

        Args:
            state: The saved value.
            zeros: ``zeros`` of the parameters (shapes, device and dtype to load into).
            **options: As ``finalize``.

        Raises:
            ValueError: If ``state`` does not have the structure or the shapes of ``zeros``.
        """
        if not isinstance(state, Tensor):
            raise ValueError("state_dict['H'] must be a tensor for this structure.")
        if tuple(state.shape) != tuple(zeros.shape):
            raise ValueError(
                f"state_dict['H'] has shape {tuple(state.shape)}, expected {tuple(zeros.shape)}."
            )
        return state.to(device=zeros.device, dtype=zeros.dtype)

    # ------------------------------------------------------------------- memory estimates
    # From shapes alone, so that a request that cannot fit is refused before any allocation
    # (``laplace.utils.errors.check_fits_in_memory``). What the estimates count is what stays
    # in memory as tensors; the transient work of a solver or an eigendecomposition is not.
    @classmethod
    @abstractmethod
    def fit_bytes(cls, params: Sequence[Tensor], **options: object) -> int:
        """Bytes of a fit over the parameter tensors ``params`` (their shapes and dtype only).

        The summed curvature in the structure's representation plus what ``finalize`` and the
        posterior's factorisation keep (a Cholesky factor, eigendecompositions).

        Args:
            params: The parameter tensors the curvature is over (nothing is allocated).
            **options: The fit pass's options (low rank: ``solver``; matrix-free:
                ``options``) and, for Kronecker, the backend's block ``shapes``.
        """

    def prediction_bytes(
        self,
        n_rows: int,
        n_outputs: int,
        kind: type[Jacobian],
        joint: bool = False,
        variances_only: bool = False,
    ) -> int:
        """Bytes of a GLM prediction of ``n_rows`` output rows of ``n_outputs`` outputs.

        The fitted state with its factorisation, what the structure forms for the Jacobian
        ``kind`` (e.g. a dense covariance for a head's features) and the prediction's own
        moments and Jacobian rows (``glm_prediction_bytes``); shapes alone.

        Args:
            n_rows: Output rows R (test points times the positions of each).
            n_outputs: Outputs per row C.
            kind: The Jacobian kind the subset gives the posterior.
            joint: Whether the joint covariance (R·C, R·C) is formed.
            variances_only: Whether only the variances (R, C) are formed, not (R, C, C).
        """
        own = self.held_bytes(n_rows, n_outputs, kind, joint)
        n_params, itemsize = len(self.prior_diag), self.itemsize
        rows = kind not in self.closed_forms or kind not in self.rowless_kinds
        shapes = (n_rows, n_outputs, n_params, itemsize, joint, variances_only, rows)
        return own + glm_prediction_bytes(*shapes)

    @abstractmethod
    def held_bytes(
        self, n_rows: int, n_outputs: int, kind: type[Jacobian], joint: bool = False
    ) -> int:
        """Bytes the structure holds for a GLM prediction, from shapes alone.

        Its fitted state with its factorisation and what it forms for the Jacobian ``kind``;
        the arguments as ``prediction_bytes``.
        """

    @property
    def itemsize(self) -> int:
        """Bytes per number of the posterior (the model's dtype)."""
        return self.prior_precision.element_size()

    # ------------------------------------------------------------------------ the posterior
    @property
    @abstractmethod
    def precision(self) -> Curvature:
        """The posterior precision ``P`` in the structure's representation."""

    @property
    @abstractmethod
    def log_det(self) -> Tensor:
        """``log det P``, a scalar."""

    @abstractmethod
    def square_form(self, delta: Tensor) -> Tensor:
        """``Δᵀ P Δ`` for ``delta`` of shape (P,), a scalar."""

    def functional_variance(self, J: Tensor | Jacobian) -> Tensor:
        """``J P⁻¹ Jᵀ`` per point, shape (B, C, C).

        Args:
            J: Dense Jacobian rows (B, C, P), or a Jacobian kind: its closed form in
                ``closed_forms`` where there is one that applies, else its dense rows.
        """
        if isinstance(J, Tensor):
            return self.rows_variance(J)
        closed_form = self.closed_forms.get(type(J))
        f_var = None if closed_form is None else closed_form(self, J)
        return self.rows_variance(J.dense()) if f_var is None else f_var

    @abstractmethod
    def rows_variance(self, Js: Tensor) -> Tensor:
        """``J P⁻¹ Jᵀ`` per point from dense Jacobian rows: ``Js`` (B, C, P) → (B, C, C)."""

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """Joint ``J P⁻¹ Jᵀ`` over all rows: ``Js`` (N, P) → (N, N)."""
        return self.rows_variance(Js.unsqueeze(0)).squeeze(0)

    @abstractmethod
    def sample_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        """Draws of ``θ − θ_MAP ~ N(0, P⁻¹)``, shape (n_samples, P)."""

    def _standard_normal(
        self, shape: tuple[int, ...], generator: torch.Generator | None
    ) -> Tensor:
        like = self.prior_precision
        return torch.randn(shape, generator=generator, device=like.device, dtype=like.dtype)
