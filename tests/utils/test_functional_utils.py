"""The function-space helpers exported from ``laplace.utils`` (laplace-torch 0.3 names)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from conftest import assert_close
from laplace.utils import (
    batch_size,
    classification_targets,
    concatenate_rows,
    draw_gaussian,
    preserve_model_gradients,
    regression_targets,
    same_configuration,
    select_rows,
    split_batch,
    subset_loader,
    to_device,
    training_indices,
)

#: Monte-Carlo tolerance for the covariance of 20 000 draws with unit-scale entries.
MC_ATOL = 0.05


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


def test_same_configuration_compares_nested_values():
    a = {"k": [torch.ones(2), 1], "s": "x"}
    assert same_configuration(a, {"k": [torch.ones(2), 1], "s": "x"})
    assert not same_configuration(a, {"k": [torch.zeros(2), 1], "s": "x"})
    assert not same_configuration(a, {"k": (torch.ones(2), 1), "s": "x"})
    assert not same_configuration(torch.ones(1), 1.0)


def test_draw_gaussian_handles_singular_and_joint_covariances():
    g = torch.Generator().manual_seed(0)
    mean = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    cov = torch.tensor([[[1.0, 1.0], [1.0, 1.0]]], dtype=torch.float64)  # rank one
    draws = draw_gaussian(mean, cov, 20000, g)
    assert draws.shape == (20000, 1, 2)
    centred = draws[:, 0] - mean
    assert_close(centred.T @ centred / 20000, cov[0], rtol=0.0, atol=MC_ATOL)
    assert draw_gaussian(mean.reshape(-1), cov[0], 4, g).shape == (4, 2)
    with pytest.raises(torch.linalg.LinAlgError):
        draw_gaussian(mean, -cov, 2, g)


def test_to_device_casts_floats_only_and_keeps_structure():
    out = to_device(
        {"x": torch.ones(2), "i": torch.ones(2, dtype=torch.long), "m": [torch.ones(1)], "s": 3},
        torch.device("cpu"),
        torch.float64,
    )
    assert out["x"].dtype == torch.float64 and out["i"].dtype == torch.long
    assert isinstance(out["m"], list) and out["m"][0].dtype == torch.float64 and out["s"] == 3


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


def test_training_indices_follow_the_sampler():
    data = TensorDataset(torch.arange(10.0))
    assert training_indices(DataLoader(data, batch_size=3)).tolist() == list(range(10))
    dropped = DataLoader(data, batch_size=3, drop_last=True)
    assert training_indices(dropped).tolist() == list(range(9))
    assert training_indices(DataLoader(data, shuffle=True)).tolist() == list(range(10))
    subset = DataLoader(data, sampler=SubsetRandomSampler([7, 2]))
    assert training_indices(subset).tolist() == [7, 2]
    with pytest.raises(ValueError, match="no indices"):
        training_indices(DataLoader(data, sampler=SubsetRandomSampler([])))


def test_subset_loader_and_batch_size():
    data = TensorDataset(torch.arange(10.0), torch.arange(10))
    loader = subset_loader(DataLoader(data, batch_size=2, shuffle=True), torch.tensor([5, 1, 3]))
    xs = [x for x, _ in loader]
    assert [len(x) for x in xs] == [2, 1]
    assert torch.cat(xs).tolist() == [5.0, 1.0, 3.0]
    assert batch_size({"input_ids": torch.ones(4, 2)}, "input_ids") == 4
    assert batch_size(torch.ones(3, 1), "input_ids") == 3


def test_concatenate_and_select_rows():
    a = {"input_ids": torch.ones(2, 1), "names": ["a", "b"], "const": 1}
    b = {"input_ids": torch.zeros(1, 1), "names": ["c"], "const": 1}
    rows = concatenate_rows([a, b])
    assert rows["input_ids"].shape == (3, 1) and rows["names"] == ["a", "b", "c"]
    assert rows["const"] == 1
    with pytest.raises(ValueError, match="non-batched"):
        concatenate_rows([a, {**b, "const": 2}])
    picked = select_rows(rows, torch.tensor([2, 0]), 3)
    assert picked["names"] == ["c", "a"] and picked["const"] == 1
    assert_close(picked["input_ids"], torch.tensor([[0.0], [1.0]]))
