"""Prior-precision tuning (``laplace.core.tuning``): marginal likelihood, grid search, bayesopt.

Bayesian optimisation (``method="bayesopt"``, Optuna's GPSampler) needs the ``bayesopt`` extra:
its tests skip without Optuna (``needs_optuna``), the others run anyway.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import os
import socket
import sys
import traceback
import warnings
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from conftest import CASE_BUILDERS, assert_close
from laplace import DiagLaplace, FullLaplace, FunctionalLaplace, KronLaplace
from laplace.structures import NotPositiveDefiniteError

#: Bayesian optimisation needs Optuna (the ``bayesopt`` extra); its tests skip without it.
needs_optuna = pytest.mark.skipif(
    importlib.util.find_spec("optuna") is None, reason="needs optuna (the bayesopt extra)"
)


#: Evaluations of a Bayesian-optimisation search, and the grid it must match.
N_STEPS, GRID_SIZE = 15, 21


#: A search "no worse" than the grid: its best validation NLL at most this much above the grid's.
NLL_TOL = 1e-9


#: The grid must matter: its validation NLLs must spread by more than this.
MIN_GRID_SPREAD = 0.02


#: The loss of the chosen setting, recomputed, against the best seen (same float64 computation).
REPRODUCE_TOL = 1e-12


#: The search ranges (exponents of 10) on which the trained networks' NLL has an interior minimum.
RANGES = {"classification": (-6, 2), "regression": (-4, 4)}


def _blobs(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Three overlapping Gaussian classes in 2-D: inputs (n, 2), labels (n,)."""
    y = torch.randint(0, 3, (n,), generator=generator)
    centres = torch.tensor([[0.0, 1.5], [1.3, -0.8], [-1.3, -0.8]], dtype=torch.float64)
    return centres[y] + 0.9 * torch.randn(n, 2, generator=generator, dtype=torch.float64), y


def _sine(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy ``sin(2x)`` on [-2, 2]: inputs (n, 1), targets (n, 1)."""
    X = 4 * torch.rand(n, 1, generator=generator, dtype=torch.float64) - 2
    return X, torch.sin(2 * X) + 0.2 * torch.randn(n, 1, generator=generator, dtype=torch.float64)


def _trained(likelihood: str) -> tuple[nn.Module, DataLoader, DataLoader]:
    """A fresh copy of an MLP trained on generated data, its training and validation loaders."""
    model, train, val = _trained_once(likelihood)
    return copy.deepcopy(model), train, val


@functools.cache
def _trained_once(likelihood: str, seed: int = 0) -> tuple[nn.Module, DataLoader, DataLoader]:
    """An MLP trained on generated data, with its training and validation loaders (60 each)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    classification = likelihood == "classification"
    data = _blobs if classification else _sine
    (X, y), (X_val, y_val) = data(60, generator), data(60, generator)
    n_in, n_out = (2, 3) if classification else (1, 1)
    model = nn.Sequential(nn.Linear(n_in, 16), nn.Tanh(), nn.Linear(16, n_out)).double()
    objective = nn.functional.cross_entropy if classification else nn.functional.mse_loss
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05 if classification else 0.03)
    for _ in range(300 if classification else 500):
        optimizer.zero_grad()
        objective(model(X), y).backward()
        optimizer.step()
    train = DataLoader(TensorDataset(X, y), batch_size=20)
    return model, train, DataLoader(TensorDataset(X_val, y_val), batch_size=20)


class RecordingNLL:
    """The validation NLL as a callable loss that records every value it returns.

    Classification: ``loss(probs (B, C), y (B,))``; regression: ``loss(f_mu (B, 1),
    f_var (B, 1, 1), y (B, 1))`` with the observation noise ``sigma_noise`` added.
    """

    def __init__(self, sigma_noise: float | None = None) -> None:
        self.sigma_noise = sigma_noise
        self.values: list[float] = []

    def __call__(self, *predictions_and_targets: torch.Tensor) -> torch.Tensor:
        if self.sigma_noise is None:
            probs, y = predictions_and_targets
            value = -probs[torch.arange(len(y)), y].log().mean()
        else:
            f_mu, f_var, y = predictions_and_targets
            variance = f_var.reshape(len(y), -1) + self.sigma_noise**2
            value = 0.5 * ((y - f_mu).square() / variance + variance.log() + math.log(2 * math.pi))
            value = value.mean()
        self.values.append(float(value))
        return value


def _fitted(likelihood: str, cls=DiagLaplace, **kwargs):
    """A fitted Laplace on a trained MLP, its validation loader and a recording NLL."""
    model, train, val = _trained(likelihood)
    sigma = {"sigma_noise": 0.2} if likelihood == "regression" else {}
    la = cls(model, likelihood, **sigma, **kwargs)
    la.fit(train)
    return la, val, RecordingNLL(sigma.get("sigma_noise"))


def _search(la, val, loss, likelihood, **kwargs) -> None:
    low, high = RANGES[likelihood]
    la.optimize_prior_precision(
        val_loader=val, loss=loss, log_prior_prec_min=low, log_prior_prec_max=high, **kwargs
    )


def _loss_now(la, val, loss) -> float:
    """The validation loss of the current setting, from the predictive on all of ``val``."""
    value = float(loss(*_predictions(la, val)))
    loss.values.pop()
    return value


def _predictions(la, val) -> tuple[torch.Tensor, ...]:
    X = torch.cat([X for X, _ in val])
    y = torch.cat([y for _, y in val])
    out = la(X, link_approx="probit", fitting=True)
    return (*(out if isinstance(out, tuple) else (out,)), y)


@needs_optuna
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_bayesopt_matches_a_finer_grid_with_fewer_evaluations(likelihood):
    la, val, grid_loss = _fitted(likelihood)
    _search(la, val, grid_loss, likelihood, method="gridsearch", grid_size=GRID_SIZE)
    assert len(grid_loss.values) == GRID_SIZE
    assert max(grid_loss.values) - min(grid_loss.values) > MIN_GRID_SPREAD, "the grid must matter"
    best_index = grid_loss.values.index(min(grid_loss.values))
    assert 0 < best_index < GRID_SIZE - 1, "an interior optimum: the search has to find it"

    search_loss = RecordingNLL(grid_loss.sigma_noise)
    _search(la, val, search_loss, likelihood, method="bayesopt", n_steps=N_STEPS, seed=0)
    assert len(search_loss.values) == N_STEPS
    assert min(search_loss.values) <= min(grid_loss.values) + NLL_TOL
    assert la.prior_precision.shape == (1,)
    assert _loss_now(la, val, search_loss) == pytest.approx(
        min(search_loss.values), rel=0, abs=REPRODUCE_TOL
    )


@needs_optuna
def test_bayesopt_is_reproducible_and_the_seed_matters():
    """The search draws from its own seeded generators, not NumPy's global one.

    (Torch's global generator advances as in grid search: each pass over a DataLoader draws a
    base seed from it.)
    """
    runs = {}
    for seed in (0, 0, 1):
        la, val, loss = _fitted("classification")
        numpy_state = np.random.get_state()[1]
        _search(la, val, loss, "classification", method="bayesopt", n_steps=6, seed=seed)
        assert (np.random.get_state()[1] == numpy_state).all()
        runs.setdefault(seed, []).append(loss.values)
    assert runs[0][0] == runs[0][1]
    assert runs[0][0] != runs[1][0]


@needs_optuna
def test_bayesopt_layerwise_sets_one_prior_precision_per_parameter_tensor():
    la, val, loss = _fitted("classification")
    dtype = la.prior_precision.dtype
    candidates = []

    def loss_recording_the_candidate(probs, y):
        candidates.append(la.prior_precision.clone())
        return loss(probs, y)

    _search(
        la,
        val,
        loss_recording_the_candidate,
        "classification",
        method="bayesopt",
        prior_structure="layerwise",
        n_steps=N_STEPS,
    )
    low, high = RANGES["classification"]
    assert la.prior_precision.shape == (la.n_layers,) == (4,)
    assert la.prior_precision.dtype == dtype
    assert bool(((la.prior_precision >= 10.0**low) & (la.prior_precision <= 10.0**high)).all())
    assert len(loss.values) == len(candidates) == N_STEPS
    assert all(c.shape == (4,) for c in candidates)
    assert any(c.unique().numel() == 4 for c in candidates), "each layer searched on its own"
    best = loss.values.index(min(loss.values))
    assert torch.equal(la.prior_precision, candidates[best])
    assert _loss_now(la, val, loss) == pytest.approx(min(loss.values), rel=0, abs=REPRODUCE_TOL)


@needs_optuna
def test_bayesopt_tunes_the_temperature_within_its_range(capsys):
    la, val, loss = _fitted("classification", temperature=1.0)
    temperature_range = (0.2, 5.0)
    _search(
        la,
        val,
        loss,
        "classification",
        method="bayesopt",
        temperature_range=temperature_range,
        n_steps=N_STEPS,
        verbose=True,
    )
    assert f"and temperature {la.temperature}." in capsys.readouterr().out
    assert la.temperature != 1.0
    assert temperature_range[0] <= la.temperature <= temperature_range[1]
    assert len(loss.values) == N_STEPS
    assert _loss_now(la, val, loss) == pytest.approx(min(loss.values), rel=0, abs=REPRODUCE_TOL)
    chosen = _loss_now(la, val, loss)
    la.temperature = 1.0
    assert _loss_now(la, val, loss) != pytest.approx(chosen, rel=0, abs=REPRODUCE_TOL), (
        "the temperature must change the loss for this test to bite"
    )


@needs_optuna
def test_bayesopt_works_for_a_float32_model():
    model, train, val = _trained("classification")
    model = model.float()
    as_float32 = [
        TensorDataset(X.float(), y) for X, y in (train.dataset.tensors, val.dataset.tensors)
    ]
    la = DiagLaplace(model, "classification")
    la.fit(DataLoader(as_float32[0], batch_size=20))
    la.optimize_prior_precision(
        method="bayesopt",
        val_loader=DataLoader(as_float32[1], batch_size=20),
        prior_structure="layerwise",
        n_steps=3,
    )
    assert la.prior_precision.dtype == torch.float32
    assert la.prior_precision.shape == (la.n_layers,)


@needs_optuna
def test_bayesopt_by_metric_name_matches_the_callable():
    """A named loss goes through the likelihood's metric; the same search, the same choice."""
    la, val, loss = _fitted("classification")
    _search(la, val, loss, "classification", method="bayesopt", n_steps=8)
    by_callable = la.prior_precision.clone()
    _search(la, val, "nll", "classification", method="bayesopt", n_steps=8)
    assert torch.allclose(la.prior_precision, by_callable, rtol=1e-6, atol=0)


@needs_optuna
def test_bayesopt_scores_unfactorisable_candidates_as_infinite():
    """As grid search: a candidate whose posterior cannot be factorised is skipped."""
    la, val, loss = _fitted("classification")
    threshold = 1e-2
    failures = []

    def loss_failing_for_small_priors(probs, y):
        if la.prior_precision.item() < threshold:
            failures.append(la.prior_precision.item())
            raise NotPositiveDefiniteError("not positive definite")
        return loss(probs, y)

    with warnings.catch_warnings():  # Optuna's warning on clipped inf scores is silenced
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="By default `link_approx` is `probit`")
        _search(
            la, val, loss_failing_for_small_priors, "classification", method="bayesopt", n_steps=8
        )
    assert failures, "some candidates must fail for this test to bite"
    assert len(failures) + len(loss.values) == 8
    assert la.prior_precision.item() >= threshold
    assert _loss_now(la, val, loss) == pytest.approx(min(loss.values), rel=0, abs=REPRODUCE_TOL)


@needs_optuna
def test_bayesopt_works_for_a_functional_laplace():
    la, val, loss = _fitted("regression", FunctionalLaplace, n_subset=30, seed=0)
    _search(la, val, loss, "regression", method="bayesopt", pred_type="gp", n_steps=10)
    assert len(loss.values) == 10
    assert max(loss.values) - min(loss.values) > MIN_GRID_SPREAD, "the prior must matter"
    X = torch.cat([X for X, _ in val])
    y = torch.cat([y for _, y in val])
    f_mu, f_var = la(X, pred_type="gp", fitting=True)
    assert float(loss(f_mu, f_var, y)) == pytest.approx(min(loss.values[:-1]), abs=REPRODUCE_TOL)
    first = list(loss.values[:10])
    _search(la, val, loss, "regression", method="bayesopt", pred_type="gp", n_steps=10, seed=5)
    assert loss.values[-10:] != first  # the seed reaches the search through FunctionalLaplace
    _search(
        la,
        val,
        loss,
        "regression",
        method="bayesopt",
        pred_type="gp",
        n_steps=4,
        temperature_range=(0.5, 2.0),
    )
    assert 0.5 <= la.temperature <= 2.0


@pytest.fixture
def guarded():
    """A fitted Laplace (prior 0.3, temperature 1.7) whose network counts its forward passes."""
    la, val, loss = _fitted("classification", KronLaplace, prior_precision=0.3, temperature=1.7)
    forward_passes = []
    la.model.register_forward_pre_hook(lambda *_: forward_passes.append(1))
    return la, val, loss, forward_passes


def _unchanged(la, forward_passes, expect_predictions: bool = False) -> None:
    assert la.prior_precision.tolist() == [0.3]
    assert la.temperature == 1.7
    assert bool(forward_passes) == expect_predictions


@needs_optuna
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"val_loader": None}, "method='bayesopt' needs a val_loader"),
        ({"n_steps": 0}, "n_steps must be a positive integer"),
        ({"n_steps": 2.5}, "n_steps must be a positive integer"),
        ({"log_prior_prec_min": 3, "log_prior_prec_max": -3}, "min < max"),
        ({"log_prior_prec_min": 1, "log_prior_prec_max": 1}, "min < max"),
        ({"log_prior_prec_max": float("inf")}, "log_prior_prec_max must be finite"),
        ({"log_prior_prec_base": 1.0}, "log_prior_prec_base must not be 1"),
        ({"temperature_range": (2.0, 1.0)}, "temperature_range must be a pair"),
        ({"temperature_range": (0.0, 1.0)}, "temperature_range must be a positive"),
        ({"temperature_range": 5.0}, "temperature_range must be a pair"),
        ({"temperature_range": (1.0, 2.0, 3.0)}, "temperature_range must be a pair"),
        ({"prior_structure": "diag"}, "'scalar' or 'layerwise'.*too many"),
        ({"loss": "accuracy"}, "'brier', 'crps', 'ece', 'nll'"),
        ({"seed": 1.5}, r"seed must be an integer in \[0, 2\*\*32\)"),
        ({"seed": -1}, r"seed must be an integer in \[0, 2\*\*32\)"),
        ({"seed": True}, r"seed must be an integer"),
        ({"method": "gridsearch", "temperature_range": (0.5, 2.0)}, "method='bayesopt' only"),
    ],
)
def test_bayesopt_refuses_bad_arguments_before_any_prediction(guarded, kwargs, match):
    la, val, loss, forward_passes = guarded
    arguments = {"method": "bayesopt", "val_loader": val, "loss": loss, "n_steps": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        la.optimize_prior_precision(**arguments)
    assert not loss.values
    _unchanged(la, forward_passes)


@needs_optuna
def test_bayesopt_without_optuna_names_the_extra(guarded, monkeypatch):
    la, val, loss, forward_passes = guarded
    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(ImportError, match=r"pip install 'laplace-ng\[bayesopt\]'"):
        la.optimize_prior_precision(method="bayesopt", val_loader=val, loss=loss, n_steps=3)
    _unchanged(la, forward_passes)
    la.optimize_prior_precision(method="gridsearch", val_loader=val, loss=loss, grid_size=2)


@needs_optuna
def test_a_failing_bayesopt_search_changes_nothing(guarded):
    la, val, loss, forward_passes = guarded

    def loss_failing_on_the_third_call(probs, y):
        if len(loss.values) == 2:
            raise RuntimeError("the validation loss failed")
        return loss(probs, y)

    with pytest.raises(RuntimeError, match="validation loss failed"):
        la.optimize_prior_precision(
            method="bayesopt",
            val_loader=val,
            loss=loss_failing_on_the_third_call,
            temperature_range=(0.5, 4.0),
            n_steps=5,
        )
    _unchanged(la, forward_passes, expect_predictions=True)


@needs_optuna
def test_a_bayesopt_search_without_a_finite_loss_raises_and_changes_nothing(guarded):
    la, val, _, forward_passes = guarded
    with pytest.raises(RuntimeError, match="non-finite loss"):
        la.optimize_prior_precision(
            method="bayesopt",
            val_loader=val,
            loss=lambda probs, y: torch.tensor(float("nan")),
            temperature_range=(0.5, 4.0),
            n_steps=4,
        )
    _unchanged(la, forward_passes, expect_predictions=True)


@needs_optuna
def test_bayesopt_silences_optuna_only_during_the_call(capsys):
    """Optuna logs each finished trial at INFO; the search drops those, then restores the level."""
    import logging

    import optuna

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    optuna_logger = logging.getLogger("optuna")
    optuna_logger.addHandler(handler)
    root_level = logging.getLogger().level
    optuna.logging.set_verbosity(optuna.logging.INFO)
    try:
        la, val, loss = _fitted("classification", FullLaplace)
        _search(la, val, loss, "classification", method="bayesopt", n_steps=4, verbose=True)
        assert not [r for r in records if r.levelno < logging.WARNING]
        assert optuna.logging.get_verbosity() == optuna.logging.INFO
        assert logging.getLogger().level == root_level
        study = optuna.create_study()
        study.tell(study.ask(), 1.0)  # logs at INFO again
    finally:
        optuna_logger.removeHandler(handler)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    assert [r for r in records if r.levelno == logging.INFO], "optuna's INFO must reach us now"
    assert capsys.readouterr().out.startswith("Optimized prior precision is tensor([")


#: Two ranks' chosen prior precision against one process's: the averaged losses agree to
#: rounding, so the seeded searches propose (nearly) the same candidates.
DISTRIBUTED_RTOL = 1e-6


def _distributed_search(rank: int, port: int, out_dir: str) -> None:
    """One rank: a distributed fit on its uneven shard, then bayesopt on its validation shard."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        model, train, val = _trained("classification")
        train_part = range(40) if rank == 0 else range(40, 60)  # uneven shards
        val_part = range(35) if rank == 0 else range(35, 60)
        la = DiagLaplace(model, "classification")
        train_shard = DataLoader(Subset(train.dataset, list(train_part)), batch_size=20)
        la.fit(train_shard, distributed=True)
        val_shard = DataLoader(Subset(val.dataset, list(val_part)), batch_size=20)
        low, high = RANGES["classification"]
        la.optimize_prior_precision(
            method="bayesopt",
            val_loader=val_shard,
            log_prior_prec_min=low,
            log_prior_prec_max=high,
            temperature_range=(0.5, 2.0),
            n_steps=8,
        )
        result = {"prior_precision": la.prior_precision, "temperature": la.temperature}
    except Exception:  # reported to the parent through the results file
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@needs_optuna
@pytest.mark.slow  # two processes start torch, laplace and Optuna (about a minute on 2 cores)
def test_distributed_bayesopt_equals_single_process(tmp_path):
    """Every rank gets the search of one process on all the data (a rank proposing another
    candidate would raise)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_distributed_search, args=(port, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, result in enumerate(ranks):
        assert "error" not in result, f"rank {rank} raised:\n{result['error']}"
    la, val, _ = _fitted("classification")
    _search(
        la, val, None, "classification", method="bayesopt", temperature_range=(0.5, 2.0), n_steps=8
    )
    for result in ranks:
        assert torch.allclose(
            result["prior_precision"], la.prior_precision, rtol=DISTRIBUTED_RTOL, atol=0
        )
        assert result["temperature"] == pytest.approx(la.temperature, rel=DISTRIBUTED_RTOL)


@pytest.mark.parametrize("cls", [FullLaplace, DiagLaplace], ids=["full", "diag"])
@pytest.mark.parametrize("prior_structure", ["scalar", "layerwise", "diag"])
def test_marglik_tuning_increases_marglik(cls, prior_structure):
    case = CASE_BUILDERS["mlp_classification"]()
    la = cls(case.model, case.likelihood, prior_precision=1.0)
    la.fit(case.loader())
    before = la.log_marginal_likelihood().item()
    la.optimize_prior_precision(method="marglik", prior_structure=prior_structure, n_steps=50)
    expected_len = {"scalar": 1, "layerwise": la.n_layers, "diag": la.n_params}[prior_structure]
    assert la.prior_precision.shape == (expected_len,)
    assert not la.prior_precision.requires_grad
    assert la.log_marginal_likelihood().item() > before


def test_marglik_tuning_default_is_scalar():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = FullLaplace(case.model, case.likelihood)
    la.fit(case.loader())
    la.optimize_prior_precision()
    assert la.prior_precision.shape == (1,)


def test_marglik_tuning_keeps_structure_of_tensor_init():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = DiagLaplace(case.model, case.likelihood)
    la.fit(case.loader())
    init = torch.ones(la.n_layers, dtype=torch.float64)
    la.optimize_prior_precision(init_prior_prec=init, prior_structure="scalar", n_steps=5)
    assert la.prior_precision.shape == (la.n_layers,)


def test_gridsearch_accepts_callable_loss():
    case = CASE_BUILDERS["mlp_classification"]()
    la = FullLaplace(case.model, case.likelihood)
    la.fit(case.loader())
    calls = []

    def loss(probs, targets):
        calls.append(len(targets))
        return torch.nn.functional.nll_loss(probs.log(), targets)

    la.optimize_prior_precision(
        method="gridsearch", val_loader=case.loader(), loss=loss, grid_size=3
    )
    assert calls and la.prior_precision.shape == (1,)


def test_gridsearch_needs_val_loader():
    case = CASE_BUILDERS["mlp_classification"]()
    la = DiagLaplace(case.model, case.likelihood)
    la.fit(case.loader())
    with pytest.raises(ValueError, match="val_loader"):
        la.optimize_prior_precision(method="gridsearch")


def _validation_data(case, n=16, seed=5):
    gen = torch.Generator().manual_seed(seed)
    X = case.X[:n] + 0.5 * torch.randn(case.X[:n].shape, generator=gen, dtype=case.X.dtype)
    return X, case.y[:n]


def _classification_loss(probs, y, name):
    from torchmetrics.functional.classification import multiclass_calibration_error

    if name in ("nll", None):  # None: the default loss, the validation NLL
        return -probs[torch.arange(len(y)), y].log().mean().item()
    if name == "ece":
        return multiclass_calibration_error(probs, y, probs.shape[-1]).item()
    onehot = torch.nn.functional.one_hot(y, probs.shape[-1])
    return (probs - onehot).square().sum(-1).mean().item()


def _regression_loss(f_mu, cov, y, name):
    from scipy import stats

    mu, t = f_mu.detach().numpy(), y.numpy()
    if name is None:  # the default loss, the mean squared error
        return float(np.mean((mu - t) ** 2))
    if name == "crps":
        std = cov.diagonal(dim1=-2, dim2=-1).sqrt().detach().numpy()
        z = (t - mu) / std
        crps = std * (z * (2 * stats.norm.cdf(z) - 1) + 2 * stats.norm.pdf(z) - 1 / np.sqrt(np.pi))
        return float(crps.mean())
    cov = cov.detach().numpy()
    return float(
        np.mean([-stats.multivariate_normal.logpdf(t[i], mu[i], cov[i]) for i in range(len(t))])
    )


def _brute_force(la, grid, X, y, name):
    """The validation loss of each candidate from the predictive and independent formulas."""
    losses = []
    for p in grid:
        la.prior_precision = p
        if la.likelihood == "classification":
            losses.append(_classification_loss(la(X, link_approx="probit"), y, name))
        else:
            f_mu, f_var = la(X)
            noise = la.sigma_noise.item() ** 2 * torch.eye(f_var.shape[-1], dtype=f_var.dtype)
            losses.append(_regression_loss(f_mu, f_var + noise, y, name))
    return losses


@pytest.mark.parametrize(
    ("name", "loss"),
    [
        ("mlp_classification", "ece"),
        ("mlp_classification", "brier"),
        ("mlp_classification", "nll"),
        ("mlp_regression_3out", "crps"),
        ("mlp_regression_3out", "nll"),
        ("mlp_classification", None),
        ("mlp_regression_3out", None),
    ],
)
def test_gridsearch_picks_the_lowest_validation_loss(name, loss):
    case = CASE_BUILDERS[name]()
    kwargs = {"sigma_noise": 0.8} if case.likelihood == "regression" else {}
    la = DiagLaplace(case.model, case.likelihood, **kwargs)
    la.fit(case.loader())
    X_val, y_val = _validation_data(case)
    val_loader = DataLoader(TensorDataset(X_val, y_val), batch_size=5)
    la.optimize_prior_precision(
        method="gridsearch",
        val_loader=val_loader,
        loss=loss,
        grid_size=9,
        log_prior_prec_min=-3,
        log_prior_prec_max=3,
    )
    chosen = la.prior_precision.clone()
    grid = torch.logspace(-3, 3, 9, dtype=torch.float64)
    losses = torch.tensor(_brute_force(la, grid, X_val, y_val, loss))
    if not (loss is None and case.likelihood == "regression"):  # the GLM mean ignores the prior
        assert losses.max() - losses.min() > 1e-3, "the grid must matter for this test to bite"
    assert_close(chosen, grid[int(losses.argmin())].reshape(1))


def test_gridsearch_by_ece_differs_from_gridsearch_by_nll():
    """ECE and NLL disagree on this data, so picking by name really switches the metric."""
    case = CASE_BUILDERS["mlp_classification"]()
    la = DiagLaplace(case.model, case.likelihood)
    la.fit(case.loader())
    X_val, y_val = _validation_data(case)
    grid = torch.logspace(-3, 3, 9, dtype=torch.float64)
    ece = torch.tensor(_brute_force(la, grid, X_val, y_val, "ece"))
    nll = torch.tensor(_brute_force(la, grid, X_val, y_val, "nll"))
    assert int(ece.argmin()) != int(nll.argmin())


@pytest.mark.parametrize(
    ("name", "loss", "match"),
    [
        ("mlp_classification", "accuracy", "'brier', 'crps', 'ece', 'nll'"),
        ("mlp_classification", "crps", "likelihood='classification'.*'nll', 'brier', 'ece'"),
        ("mlp_regression_1out", "ece", "likelihood='regression'.*'nll', 'crps'"),
    ],
)
def test_gridsearch_rejects_unknown_metric_names_before_any_work(name, loss, match):
    case = CASE_BUILDERS[name]()
    la = DiagLaplace(case.model, case.likelihood, prior_precision=0.3)
    la.fit(case.loader())
    with pytest.raises(ValueError, match=match):
        la.optimize_prior_precision(method="gridsearch", val_loader=case.loader(), loss=loss)
    assert la.prior_precision.item() == pytest.approx(0.3)


# --------------------------------------------------------------------------- marglik steps
# A tuning step recomputes only what depends on the prior precision: the posterior keeps the
# curvature scaled by 1/(σ²T) (``Posterior.with_prior``), Kron its eigenvalue products, the
# approximation h = 1/(σ²T) and the MAP's squared deviations from the prior mean. These checks
# hold the steps to torch.optim.Adam on the public log marginal likelihood with every cache
# dropped, entry for entry, and the caches to every change they depend on.

TUNED = {
    "full": ("mlp_regression_3out", "all", "full"),
    "diag": ("mlp_regression_3out", "all", "diag"),
    "kron": ("mlp_classification", "all", "kron"),
    "ekfac": ("cnn_classification", "all", "ekfac"),
    "last_layer_kron": ("cnn_classification", "last_layer", "kron"),
    "last_layer_diag": ("mlp_regression_1out", "last_layer", "diag"),
    "subnetwork": ("mlp_classification", "subnetwork", "full"),
}


def _tuned(name: str, **kwargs):
    from laplace import Laplace

    case_name, subset, structure = TUNED[name]
    case = CASE_BUILDERS[case_name]()
    extra = {"subnetwork_indices": torch.tensor([0, 3, 7, 11])} if subset == "subnetwork" else {}
    sigma = {"sigma_noise": 0.7} if case.likelihood == "regression" else {}
    la = Laplace(case.model, case.likelihood, subset, structure, **extra, **sigma, **kwargs)
    la.fit(case.loader())
    return la


def _forget_caches(la) -> None:
    for name in ("_posterior_cache", "_deviation_cache", "_h_factor_cache"):
        la.__dict__.pop(name, None)


@pytest.mark.parametrize("prior_structure", ["scalar", "layerwise"])
@pytest.mark.parametrize("name", list(TUNED))
def test_marglik_steps_are_torch_adam_on_the_uncached_marglik(name, prior_structure):
    if name == "subnetwork" and prior_structure == "layerwise":
        pytest.skip("a subnetwork takes a scalar or diagonal prior")
    la = _tuned(name)
    init = 0.5
    la.optimize_prior_precision(n_steps=12, init_prior_prec=init, prior_structure=prior_structure)
    tuned = la.prior_precision

    reference = _tuned(name)
    n = 1 if prior_structure == "scalar" else reference.n_layers
    log_prior = torch.full((n,), init, dtype=torch.float64).log().requires_grad_(True)
    optimizer = torch.optim.Adam([log_prior], lr=0.1)
    for _ in range(12):
        _forget_caches(reference)
        optimizer.zero_grad()
        (-reference.log_marginal_likelihood(log_prior.exp())).backward()
        optimizer.step()
    assert torch.equal(tuned, log_prior.detach().exp())


def test_marglik_tuning_leaves_a_prior_without_gradient_unchanged(monkeypatch):
    """As torch.optim.Adam skips a parameter without a gradient."""
    la = _tuned("diag")
    constant = torch.zeros((), dtype=torch.float64, requires_grad=True)
    monkeypatch.setattr(la, "log_marginal_likelihood", lambda prior_precision: constant * 1)
    la.optimize_prior_precision(n_steps=3, init_prior_prec=0.25)
    assert torch.equal(la.prior_precision, torch.tensor([0.25], dtype=torch.float64))


@pytest.mark.parametrize("name", ["full", "diag", "kron", "last_layer_kron"])
def test_marglik_follows_in_place_changes_of_the_hyperparameters(name):
    la = _tuned(name)
    la.log_marginal_likelihood()  # fills the caches
    if la.likelihood == "regression":
        with torch.no_grad():
            la.sigma_noise.mul_(1.3)
    with torch.no_grad():
        la.prior_precision.mul_(2.0)
        la.prior_mean = torch.zeros(()) + 0.1
    cached = la.log_marginal_likelihood()
    _forget_caches(la)
    assert torch.equal(cached, la.log_marginal_likelihood())
    with torch.no_grad():
        la.prior_mean.add_(0.2)
    cached = la.log_marginal_likelihood()
    _forget_caches(la)
    assert torch.equal(cached, la.log_marginal_likelihood())


@pytest.mark.parametrize("name", ["diag", "kron", "ekfac"])
def test_a_tuning_step_shares_the_scaled_curvature(name):
    la = _tuned(name)
    posterior = la._posterior
    prior = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    la.prior_precision = prior
    stepped = la._posterior
    assert stepped is not posterior and stepped.scaled is posterior.scaled
    expected = type(posterior)(la.H, la._H_factor, prior, la._prior_sizes)
    assert torch.equal(stepped.log_det, expected.log_det)
    assert torch.equal(stepped.prior_diag, expected.prior_diag)
