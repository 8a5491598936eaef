"""Batches and loaders (``laplace.utils.data``): preparation, checks, subsets, rows, devices."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from conftest import assert_close
from laplace import DiagLaplace
from laplace.utils import (
    SoDSampler,
    batch_size,
    concatenate_rows,
    select_rows,
    subset_loader,
    to_device,
    training_indices,
)


def test_nan_in_data(clf):
    X = clf.X.clone()
    X[3, 1] = float("nan")
    la = DiagLaplace(clf.model, "classification")
    with pytest.raises(ValueError, match="NaN"):
        la.fit(DataLoader(TensorDataset(X, clf.y), batch_size=4))


def test_bad_batches(clf):
    la = DiagLaplace(clf.model, "classification")
    with pytest.raises(ValueError, match="dict_key_y"):
        la.fit(DataLoader([{"input_ids": clf.X[0], "y": clf.y[0]}], batch_size=1))


def loader(n: int = 10, batch_size: int = 4) -> DataLoader:
    X = torch.arange(2 * n, dtype=torch.float64).reshape(n, 2)
    return DataLoader(TensorDataset(X, torch.arange(n)), batch_size=batch_size)


def test_training_indices_and_subset_loader():
    data = loader(10, 3)
    assert training_indices(data).tolist() == list(range(10))
    subset = subset_loader(data, torch.tensor([7, 2, 5]))
    assert [y.tolist() for _, y in subset] == [[7, 2, 5]]


def test_to_device_casts_floats_only_and_keeps_structure():
    out = to_device(
        {"x": torch.ones(2), "i": torch.ones(2, dtype=torch.long), "m": [torch.ones(1)], "s": 3},
        torch.device("cpu"),
        torch.float64,
    )
    assert out["x"].dtype == torch.float64 and out["i"].dtype == torch.long
    assert isinstance(out["m"], list) and out["m"][0].dtype == torch.float64 and out["s"] == 3


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


def test_sod_sampler_draws_distinct_indices_deterministically():
    sampler = SoDSampler(20, 6, seed=1)
    idx = [int(i) for i in sampler]
    assert len(sampler) == 6 and len(set(idx)) == 6
    assert all(0 <= i < 20 for i in idx)
    assert idx == [int(i) for i in SoDSampler(20, 6, seed=1)]
    with pytest.raises(ValueError, match="M"):
        SoDSampler(5, 6)
