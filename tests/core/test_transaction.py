"""Transactions (``laplace.core.transaction``): a model's gradients are restored, even on error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import assert_close
from laplace.utils import preserve_model_gradients


def test_preserve_model_gradients_restores_grads_even_on_error():
    class Holder:
        model = nn.Linear(2, 1)

        @preserve_model_gradients
        def run(self, fail: bool):
            self.model(torch.ones(1, 2)).sum().backward()
            if fail:
                raise RuntimeError("boom")
            return 3

    holder = Holder()
    holder.model.weight.grad = torch.full((1, 2), 7.0)
    assert holder.run(False) == 3
    assert_close(holder.model.weight.grad, torch.full((1, 2), 7.0))
    assert holder.model.bias.grad is None
    with pytest.raises(RuntimeError, match="boom"):
        holder.run(True)
    assert holder.model.bias.grad is None
