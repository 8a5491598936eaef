"""The argument checks of ``laplace.utils.errors``."""

from __future__ import annotations

import pytest
import torch

from laplace.utils import _is_valid_scalar


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (1, True),
        (2.5, True),
        (True, True),
        (torch.tensor(1.0), True),
        (torch.tensor([1.0]), True),
        (torch.tensor([1.0, 2.0]), False),
        (torch.ones(1, 1), False),
        ("a", False),
        (1j, False),
        (None, False),
        ([1.0], False),
    ],
)
def test_is_valid_scalar(value, valid):
    assert _is_valid_scalar(value) is valid
