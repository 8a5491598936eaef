"""Jacobian kinds of the function-space approximations (``laplace.functional.ntk``).

Factored Jacobians (per-layer inputs and output gradients) against the dense float64 oracle
Jacobian, and the dense rows of the same pass where a layer has no factored form.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import CASE_BUILDERS, Oracle, assert_close
from laplace.curvature.engine.per_sample import PerSampleEngine
from laplace.functional.ntk import DenseJacobian, FactoredJacobian, trace_jacobian

#: Kernels of the two kinds are sums of the same products in another order.
KERNEL_RTOL, KERNEL_ATOL = 1e-10, 1e-12


def jacobians(case, X):
    engine = PerSampleEngine(case.model, [p for p in case.model.parameters() if p.requires_grad])
    return trace_jacobian(engine, X)


@pytest.mark.parametrize("name", ["mlp_regression_3out", "mlp_classification"])
def test_factored_jacobian_equals_the_dense_oracle(name):
    case = CASE_BUILDERS[name]()
    J, f = jacobians(case, case.X[:6])
    assert isinstance(J, FactoredJacobian)
    oracle = Oracle(case.model, case.likelihood)
    rows = oracle.jacobian(case.X[:6])
    other = oracle.jacobian(case.X[6:11])
    assert_close(f, oracle.f(oracle.theta, case.X[:6]))
    assert_close(J.dense(), rows, KERNEL_RTOL, KERNEL_ATOL)
    J_other, _ = jacobians(case, case.X[6:11])
    B, C, _ = rows.shape
    cross = rows.flatten(0, 1) @ other.flatten(0, 1).T
    assert_close(J.cross(J_other, False), cross, KERNEL_RTOL, KERNEL_ATOL)
    independent = torch.einsum("bcp,mcp->cbm", rows, other)
    assert_close(J.cross(J_other, True), independent, KERNEL_RTOL, KERNEL_ATOL)
    assert_close(J.output_blocks(), rows @ rows.transpose(1, 2), KERNEL_RTOL, KERNEL_ATOL)
    assert_close(J.output_variances(), rows.square().sum(-1), KERNEL_RTOL, KERNEL_ATOL)
    v = torch.randn(rows.shape[-1], dtype=torch.float64)
    assert_close(J.matvec(v), rows @ v, KERNEL_RTOL, KERNEL_ATOL)
    assert J.shape == (B, C)
    # a kernel between the two kinds goes through the dense rows
    assert_close(J.cross(DenseJacobian(other), False), cross, KERNEL_RTOL, KERNEL_ATOL)


def test_a_frozen_layer_and_bias_free_layers_are_factored_too():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    model = nn.Sequential(nn.Linear(3, 5, bias=False), nn.Tanh(), nn.Linear(5, 3)).double()
    model[2].bias.requires_grad_(False)
    case.model = model
    J, _ = jacobians(case, case.X[:4])
    assert isinstance(J, FactoredJacobian)
    assert_close(J.dense(), Oracle(model, "regression").jacobian(case.X[:4]))


def test_convolutions_over_positions_use_dense_rows_of_the_same_pass():
    case = CASE_BUILDERS["cnn_classification"]()
    J, _ = jacobians(case, case.X[:3])
    assert isinstance(J, DenseJacobian)
    assert_close(J.dense(), Oracle(case.model, case.likelihood).jacobian(case.X[:3]))
