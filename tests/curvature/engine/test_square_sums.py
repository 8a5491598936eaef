"""Square sums of per-sample gradients without forming them (``SQUARE_SUM_RULES``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import assert_close
from laplace.curvature.engine import layer_rules


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_square_sum_equals_the_squared_per_sample_gradients(padding_idx):
    from laplace.curvature.engine.square_sums import SQUARE_SUM_RULES

    gen = torch.Generator().manual_seed(0)
    module = nn.Embedding(6, 3, padding_idx=padding_idx).double()
    tokens = torch.randint(0, 6, (4, 7), generator=gen)  # tokens repeat within rows
    tokens[0, :3] = 2  # the padding token, and a token three times in one row
    out = module(tokens)
    grads = torch.randn(5, *out.shape, dtype=torch.float64, generator=gen)  # 5 columns
    call = layer_rules.ModuleCall(module, (tokens,), {}, [out], [0], ["weight"])
    rule = SQUARE_SUM_RULES[nn.Embedding]
    assert rule.applies(call)
    per_sample = torch.stack([layer_rules.per_sample_grads(call, [g])["weight"] for g in grads])
    two_chunks = rule.partial(call, grads[:2]) + rule.partial(call, grads[2:])
    assert_close(rule.finish(call, two_chunks)["weight"], per_sample.square().sum((0, 1)))
