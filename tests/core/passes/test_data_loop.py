"""The one data loop (laplace.core.passes.data_loop): batches, sums, checks, gathering, cycling."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import laplace
from conftest import CASE_BUILDERS, DictDataset, assert_close
from laplace import DiagLaplace, FullLaplace, Laplace, marglik_training
from laplace.core.passes.data_loop import DataLoop, Gather
from laplace.curvature import CurvlinopsGGN

CPU = torch.device("cpu")


def loader(n: int = 10, batch_size: int = 4) -> DataLoader:
    X = torch.arange(2 * n, dtype=torch.float64).reshape(n, 2)
    return DataLoader(TensorDataset(X, torch.arange(n)), batch_size=batch_size)


def test_run_sums_the_statistics_of_every_batch():
    loop = DataLoop(None, "labels", CPU, step=lambda X, y: (X.sum(), len(y)))
    total, count = loop.run(loader())
    assert_close(total, torch.arange(20, dtype=torch.float64).sum())
    assert count == 10


def test_a_subclass_implements_the_hooks():
    class Mean(DataLoop):
        def start(self):
            return torch.zeros(2, dtype=torch.float64), 0

        def step(self, X, y):
            return X.sum(0), len(X)

        def finish(self, total):
            return total[0] / total[1]

    assert_close(Mean(None, "labels", CPU).run(loader()), torch.tensor([9.0, 10.0]))


def test_empty_loader_and_non_finite_statistics_are_refused():
    empty = DataLoader(TensorDataset(torch.zeros(0, 2), torch.zeros(0)), batch_size=3)
    with pytest.raises(ValueError, match="nothing to do"):
        DataLoop(
            None, "labels", CPU, step=lambda X, y: X.sum(), empty_message="nothing to do"
        ).run(empty)
    assert (
        DataLoop(None, "labels", CPU, step=lambda X, y: len(y), empty_message=None).run(empty)
        is None
    )
    nan_step = DataLoop(None, "labels", CPU, step=lambda X, y: X.sum() * float("nan"), what="test")
    with pytest.raises(RuntimeError, match="batch of the test contains NaN"):
        nan_step.run(loader())


def test_batches_are_prepared_and_checked_before_the_step():
    seen = []
    bad = DataLoader(TensorDataset(torch.full((3, 2), float("nan")), torch.zeros(3)))
    loop = DataLoop(None, "labels", CPU, step=lambda X, y: seen.append(X) or X.sum())
    with pytest.raises(ValueError, match="NaN"):
        loop.run(bad)
    assert seen == []

    def refuse(X):
        raise ValueError("refused inputs")

    with pytest.raises(ValueError, match="refused inputs"):
        DataLoop(None, "labels", CPU, check_inputs=refuse, step=lambda X, y: len(y)).run(loader())


def test_gather_concatenates_dict_batches_and_steps_keep_their_order():
    data = DictDataset(torch.randn(7, 3), torch.arange(7))
    X, y = Gather("input_ids", "labels", CPU).run(DataLoader(data, batch_size=3))
    assert_close(X["input_ids"], data.x)
    assert_close(y, data.y)
    (doubled,) = Gather(None, "labels", CPU, step=lambda X, y: (2 * y,)).run(loader())
    assert_close(doubled, 2 * torch.arange(10))


def test_cycle_restarts_the_loader_and_refuses_an_empty_one():
    labels = [y.tolist() for _, y in DataLoop(None, "labels", CPU).cycle(loader(5, 2), 5)]
    assert labels == [[0, 1], [2, 3], [4], [0, 1], [2, 3]]
    empty = DataLoader(TensorDataset(torch.zeros(0, 2), torch.zeros(0)), batch_size=3)
    with pytest.raises(ValueError, match="no batches"):
        list(DataLoop(None, "labels", CPU).cycle(empty, 2))


def test_passes_is_re_iterable_with_prepared_batches_and_a_step():
    data = DataLoader(DictDataset(torch.arange(6.0).reshape(3, 2), torch.arange(3)), batch_size=2)
    passes = DataLoop("input_ids", "labels", CPU).passes(data, lambda X, y: (X["input_ids"], y))
    first, second = list(passes), list(passes)
    assert [y.tolist() for _, y in first] == [[0, 1], [2]]
    for (X1, y1), (X2, y2) in zip(first, second, strict=True):
        assert_close(X1, X2)
        assert torch.equal(y1, y2)
    bad = DataLoader(TensorDataset(torch.full((2, 2), float("nan")), torch.zeros(2)))
    with pytest.raises(ValueError, match="NaN"):
        list(DataLoop(None, "labels", CPU).passes(bad))


@pytest.fixture
def loop_runs(monkeypatch) -> list[str]:
    """The class names of the data loops run, in order."""
    runs = []
    original = DataLoop.run

    def counted(self, data):
        runs.append(type(self).__name__)
        return original(self, data)

    monkeypatch.setattr(DataLoop, "run", counted)
    return runs


def test_the_parametric_fit_is_one_pass_of_the_data_loop(loop_runs):
    case = CASE_BUILDERS["mlp_regression_1out"]()
    FullLaplace(case.model, "regression").fit(case.loader())
    assert loop_runs == ["CurvatureSum"]


@pytest.mark.parametrize(
    ("subset", "structure", "expected"),
    [
        ("all", "kron", ["CurvatureSum"]),
        ("subnetwork", "full", ["CurvatureSum"]),
        ("last_layer", "full", ["HeadCurvatureSum"]),
        ("all", "lowrank", ["TopEigenpairs"]),
    ],
)
def test_every_fit_is_one_pass_of_the_data_loop(loop_runs, subset, structure, expected):
    case = CASE_BUILDERS["mlp_classification"]()
    kwargs = {"subnetwork_indices": torch.arange(0, 30, 3)} if subset == "subnetwork" else {}
    Laplace(case.model, case.likelihood, subset, structure, **kwargs).fit(case.loader())
    assert loop_runs == expected


def test_marglik_training_epochs_are_data_loops(loop_runs):
    case = CASE_BUILDERS["mlp_classification"]()
    model = case.model.float()
    data = DataLoader(TensorDataset(case.X.float(), case.y), batch_size=5)
    marglik_training(
        model, data, hessian_structure="diag", backend=CurvlinopsGGN, n_epochs=2, n_hypersteps=1
    )
    epoch = ["TrainingEpoch", "CurvatureSum"]  # training, then the Laplace fit for the marglik
    assert loop_runs == [*epoch, *epoch, "CurvatureSum"]


# ---------------------------------------------------------------- the global progress-bar switch
@pytest.fixture
def progress_switch():
    """Restores the per-call flags after a test that sets the global switch."""
    yield laplace.set_progress_bars
    laplace.set_progress_bars(None)


@pytest.mark.parametrize(
    ("switch", "per_call", "shown"),
    [(None, True, True), (None, False, False), (False, True, False), (True, False, True)],
)
def test_the_global_switch_overrides_the_per_call_progress_bar_flag(
    progress_switch, capsys, switch, per_call, shown
):
    case = CASE_BUILDERS["mlp_regression_1out"]()
    progress_switch(switch)
    la = Laplace(case.model, "regression", subset_of_weights="all", hessian_structure="diag")
    la.fit(case.loader(), progress_bar=per_call)
    la.optimize_prior_precision(method="marglik", n_steps=3, progress_bar=per_call)
    err = capsys.readouterr().err
    assert ("fit" in err and "marglik tuning" in err) is shown, err


def test_the_switch_refuses_what_is_not_a_bool_or_none(progress_switch):
    with pytest.raises(TypeError, match="True, False or None"):
        progress_switch("yes")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0", "False"), ("on", "True"), ("", "None"), ("maybe", "LAPLACE_PROGRESS_BARS='maybe'")],
)
def test_the_environment_variable_sets_the_switch_at_import(value, expected):
    code = "import laplace.core.passes.data_loop as d; print(d._progress_bars)"
    env = {**os.environ, "LAPLACE_PROGRESS_BARS": value}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert expected in result.stdout + result.stderr


def test_empty_loader(clf):
    la = DiagLaplace(clf.model, "classification")
    empty = DataLoader(TensorDataset(clf.X[:0], clf.y[:0]), batch_size=4)
    with pytest.raises(ValueError, match="empty"):
        la.fit(empty)
