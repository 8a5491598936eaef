r"""Jacobian-free GLM output covariance ``J P⁻¹ Jᵀ`` for Kronecker or diagonal precisions.

For a layer applied at positions ``t`` with inputs ``aₙₜ`` and gradients ``gₙcₜ = ∂fₙc/∂zₙₜ`` of
output ``c`` w.r.t. its outputs, the Jacobian of ``fₙc`` w.r.t. the weight is
``Σₜ gₙcₜ ⊗ aₙₜ`` and w.r.t. the bias ``Σₜ gₙcₜ``. In the eigenbasis of a weight block,
``P = (Q_G ⊗ Q_A) diag(s) (Q_G ⊗ Q_A)ᵀ``, with ``g̃ = Q_Gᵀ g`` and ``ã = Q_Aᵀ a``:

- one position (``T = 1``): ``Jc P⁻¹ Jdᵀ = Σᵢ g̃cᵢ g̃dᵢ wᵢ`` with ``wᵢ = Σⱼ ãⱼ² / sᵢⱼ``, so no
  (out × in) object per output is ever formed;
- several positions: ``Mc = Σₜ g̃cₜ ãₜᵀ`` (out × in) and ``Jc P⁻¹ Jdᵀ = Σᵢⱼ Mcᵢⱼ Mdᵢⱼ / sᵢⱼ``;
- bias: ``ḡc = Q_Gᵀ Σₜ gcₜ`` and ``Σᵢ ḡcᵢ ḡdᵢ / sᵢ``.

A diagonal precision is the special case ``Q_G = I``, ``Q_A = I`` with ``s`` the precision of
each weight entry. A low-rank precision ``P = U diag(h·λ) Uᵀ + D`` has ``P⁻¹ = D⁻¹ − Z Zᵀ``
(Woodbury, ``Z`` of shape (P, k)): the diagonal case minus ``(J Z)(J Z)ᵀ``, where ``J Z`` is the
inner product of every output's per-sample gradient with the k columns of ``Z``
(:class:`~laplace.curvature.block_product.SampleVectors`, per layer). All of it comes from one
recorded forward pass and one backward pass per output (w.r.t. layer outputs only): the memory
is that of the activations, never the (B, C, P) Jacobian.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from laplace.curvature.block_product import ParameterBlock, SampleVectors
from laplace.curvature.capture import OutputGradients
from laplace.curvature.kfac import KFAC_RULES
from laplace.curvature.per_sample import PerSampleTrace
from laplace.utils.matrix import KronDecomposed

__all__ = [
    "LAYERWISE_CHUNK_ROWS",
    "diag_functional_variance",
    "kron_functional_variance",
    "layerwise_chunk_rows",
    "layerwise_supported",
    "lowrank_functional_variance",
]

#: Test points per chunk of the layer-wise GLM predictive (it holds activations, not Jacobians).
LAYERWISE_CHUNK_ROWS = 256

#: Per parameter slot: (Q_G or None, Q_A or None, inverse spectrum (out, in) or (out,)).
BlockInverse = Callable[[int], tuple[Tensor | None, Tensor | None, Tensor]]


def kron_functional_variance(
    trace: PerSampleTrace, precision: KronDecomposed, create_graph: bool = False
) -> Tensor | None:
    """``f_var = J P⁻¹ Jᵀ`` (B, C, C) of the linearised network from a recorded forward.

    Args:
        trace: Recorded forward over the test inputs (all parameters, no subnetwork).
        precision: Posterior precision, one block per parameter in ``trace.engine`` order.
        create_graph: Keep the result differentiable w.r.t. the inputs.

    Returns:
        The covariances, or None when a layer does not see the data points along its first
        dimension (the caller then falls back to Jacobians).
    """

    def block(i: int) -> tuple[Tensor | None, Tensor | None, Tensor]:
        Qs = precision.eigenvectors[i]
        return Qs[0], Qs[1] if len(Qs) > 1 else None, precision.spectrum(i).reciprocal()

    return _layerwise_variance(trace, block, create_graph)


def diag_functional_variance(
    trace: PerSampleTrace, precision: Tensor, create_graph: bool = False
) -> Tensor | None:
    """Same as :func:`kron_functional_variance` for a diagonal precision (P,).

    Returns:
        The covariances, or None when a layer is not Linear/Conv or does not see the data points
        along its first dimension (the caller then falls back to Jacobians).
    """
    if trace.engine.indices is not None:  # a subnetwork: blocks are not whole tensors
        return None
    params = trace.engine.needed
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())

    def block(i: int) -> tuple[Tensor | None, Tensor | None, Tensor]:
        p = params[i]
        inv = precision[offsets[i] : offsets[i + 1]].reciprocal()
        return None, None, inv.reshape(p.shape[0], -1) if p.dim() > 1 else inv

    return _layerwise_variance(trace, block, create_graph)


def layerwise_supported(module: nn.Module) -> bool:
    """Whether the layer-wise route models ``module`` (ungrouped Linear and Conv layers)."""
    rule = KFAC_RULES.get(type(module))
    return rule is not None and rule.check(module) is None


def layerwise_chunk_rows(model: nn.Module, params: list[Tensor], jacobian_rows: int) -> int:
    """Test points per chunk of a GLM predictive that takes the layer-wise route when it can.

    Args:
        model: The network.
        params: Its parameters of interest.
        jacobian_rows: Rows per chunk of the Jacobian route (the fallback).

    Returns:
        :data:`LAYERWISE_CHUNK_ROWS` when every module owning one of ``params`` is supported
        (chunks then hold activations, not Jacobians), else ``jacobian_rows``.
    """
    wanted = {id(p) for p in params}
    owners = [
        m for m in model.modules() if any(id(p) in wanted for p in m.parameters(recurse=False))
    ]
    return LAYERWISE_CHUNK_ROWS if all(map(layerwise_supported, owners)) else jacobian_rows


def lowrank_functional_variance(
    trace: PerSampleTrace, prior_diag: Tensor, basis: Tensor, create_graph: bool = False
) -> Tensor | None:
    """Same as :func:`kron_functional_variance` for ``P⁻¹ = diag(prior_diag)⁻¹ − Z Zᵀ``.

    Args:
        trace: Recorded forward over the test inputs (all parameters).
        prior_diag: The diagonal ``D`` of the precision, shape (P,).
        basis: ``Z``, shape (P, k).
        create_graph: Keep the result differentiable w.r.t. the inputs.

    Returns:
        The covariances, or None when the diagonal route does not apply (the caller then
        falls back to Jacobians).
    """
    f_var = diag_functional_variance(trace, prior_diag, create_graph)
    if f_var is None:
        return None
    B, C, _ = f_var.shape
    eye = torch.eye(C, dtype=f_var.dtype, device=f_var.device)
    columns = eye[:, None, :].expand(C, B, C).reshape(C, *trace.f.shape)
    JZ = SampleVectors(trace, columns).project(ParameterBlock(trace.engine, basis))
    JZ = JZ.transpose(0, 1)  # (B, C, k)
    return f_var - JZ @ JZ.transpose(1, 2)


def _rotate(t: Tensor, Q: Tensor | None) -> Tensor:
    return t if Q is None else t @ Q


def _layerwise_variance(
    trace: PerSampleTrace, block_inverse: BlockInverse, create_graph: bool
) -> Tensor | None:
    f, calls, engine = trace.f, trace.calls, trace.engine
    B = f.shape[0]
    if not all(
        call.outputs[0].shape[0] == B and layerwise_supported(call.module) for call in calls
    ):
        return None
    C = f.reshape(B, -1).shape[1]
    rule = {call.module: KFAC_RULES[type(call.module)] for call in calls}
    inputs: dict[nn.Module, Tensor] = {}
    for call in calls:  # a module called repeatedly: its positions are concatenated
        if "weight" in call.names:
            a = rule[call.module].inputs(call)
            inputs[call.module] = (
                torch.cat([inputs[call.module], a], 1) if call.module in inputs else a
            )
    blocks = {
        (module, name): engine.slot[module, name]
        for module, names in engine.owners.items()
        for name in names
    }
    inverse = {key: block_inverse(i) for key, i in blocks.items()}
    rotated_a = {module: _rotate(a, inverse[module, "weight"][1]) for module, a in inputs.items()}
    per_output: dict[tuple[nn.Module, str], list[Tensor]] = {key: [] for key in blocks}
    grads = OutputGradients(f, calls, create_graph)
    eye = torch.eye(C, dtype=f.dtype, device=f.device)
    for c in range(C):
        g_calls = grads(eye[c].expand(B, C).reshape(f.shape))
        gs: dict[nn.Module, Tensor] = {}
        for call, (g,) in zip(calls, g_calls):
            g = rule[call.module].grads(call, g)
            gs[call.module] = torch.cat([gs[call.module], g], 1) if call.module in gs else g
        for module, name in blocks:
            if module not in gs:
                continue
            Q_G = inverse[module, name][0]
            if name == "bias":
                per_output[module, name].append(_rotate(gs[module].sum(1), Q_G))
            elif rotated_a[module].shape[1] == 1:
                per_output[module, name].append(_rotate(gs[module][:, 0], Q_G))
            else:
                M = _rotate(gs[module], Q_G).transpose(1, 2) @ rotated_a[module]
                per_output[module, name].append(M.flatten(1))
    f_var = f.new_zeros(B, C, C)
    for module, name in blocks:
        if not per_output[module, name]:
            continue
        U = torch.stack(per_output[module, name], dim=1)  # (B, C, out) or (B, C, out·in)
        inv = inverse[module, name][2]
        if name == "bias":
            weights = inv.expand(B, -1)
        elif rotated_a[module].shape[1] == 1:  # one position: w = ã² (1/s)ᵀ, shape (B, out)
            weights = rotated_a[module][:, 0].square() @ inv.T
        else:
            weights = inv.flatten().expand(B, -1)
        f_var = f_var + (U * weights.unsqueeze(1)) @ U.transpose(1, 2)
    return f_var
