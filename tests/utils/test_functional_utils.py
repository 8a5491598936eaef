"""laplace-torch 0.3's ``laplace.utils.functional_utils`` helpers defined there.

Configurations compared, batches split, regression and classification targets read.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close
from laplace.utils import (
    classification_targets,
    regression_targets,
    same_configuration,
    split_batch,
)


def test_same_configuration_compares_nested_values():
    a = {"k": [torch.ones(2), 1], "s": "x"}
    assert same_configuration(a, {"k": [torch.ones(2), 1], "s": "x"})
    assert not same_configuration(a, {"k": [torch.zeros(2), 1], "s": "x"})
    assert not same_configuration(a, {"k": (torch.ones(2), 1), "s": "x"})
    assert not same_configuration(torch.ones(1), 1.0)


def test_split_batch_keeps_mappings_whole():
    batch = {"input_ids": torch.ones(2), "labels": torch.zeros(2)}
    x, y = split_batch(batch, "labels")
    assert x is batch and y is batch["labels"]
    x, y = split_batch((torch.ones(2), torch.zeros(2)), "labels")
    assert_close(x, torch.ones(2))


def test_regression_targets_are_never_reshaped_or_broadcast():
    assert regression_targets(torch.ones(3, 1), torch.zeros(3, 1)).shape == (3, 1)
    for targets, outputs in [
        (torch.ones(3), torch.zeros(3, 1)),
        (torch.ones(3), torch.zeros(3, 2)),
    ]:
        with pytest.raises(ValueError, match="regression targets"):
            regression_targets(targets, outputs)


def test_classification_targets_from_indices_columns_and_one_hot():
    assert classification_targets(torch.tensor([[2], [0]])).tolist() == [2, 0]
    assert classification_targets(torch.tensor([[0.0, 1.0], [1.0, 0.0]])).tolist() == [1, 0]
    assert classification_targets(torch.tensor([1.0, 0.0])).dtype == torch.long
    with pytest.raises(ValueError, match="classification targets"):
        classification_targets(torch.zeros(2, 2, 2))
