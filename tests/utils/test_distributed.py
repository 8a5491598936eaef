"""Distributed fit, tuning and prediction on 2 CPU processes (gloo) against one process.

One spawn of two ranks fits every configuration on uneven shards of the data and writes its
results to ``tmp_path``; the tests compare them with single-process fits made here.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from conftest import CASE_BUILDERS, assert_close
from laplace import Laplace, marglik_training
from laplace.curvature import CurvlinopsGGN
from laplace.evaluation import evaluate
from laplace.structures import large_output
from laplace.utils.distributed import DistributedFitError, all_gather, shard_dataset
from laplace.utils.matrix import KronDecomposed, StructuredKron

WORLD = 2
RTOL, ATOL = 1e-9, 1e-10
RTOL_F32 = 1e-6

#: (id, subset_of_weights, hessian_structure, case, sharding)
CONFIGS = [
    ("all-full", "all", "full", "mlp_classification", "uneven"),
    ("all-diag", "all", "diag", "mlp_classification", "uneven"),
    ("all-kron", "all", "kron", "mlp_classification", "uneven"),
    ("all-kron-cnn", "all", "kron", "cnn_classification", "uneven"),
    ("all-full-regression", "all", "full", "mlp_regression_3out", "uneven"),
    ("all-kron-regression", "all", "kron", "mlp_regression_3out", "uneven"),
    ("ll-full", "last_layer", "full", "mlp_classification", "uneven"),
    ("ll-diag", "last_layer", "diag", "mlp_classification", "uneven"),
    ("ll-kron", "last_layer", "kron", "mlp_classification", "uneven"),
    ("ll-kron-large", "last_layer", "kron", "mlp_classification", "uneven"),
    ("all-kron-large", "all", "kron", "mlp_classification", "uneven"),
    ("subnet-full", "subnetwork", "full", "mlp_classification", "uneven"),
    ("subnet-diag", "subnetwork", "diag", "mlp_classification", "uneven"),
    ("all-lowrank", "all", "lowrank", "mlp_classification", "uneven"),
    ("all-ekfac", "all", "ekfac", "mlp_classification", "uneven"),
    ("all-ekfac-cnn", "all", "ekfac", "cnn_classification", "uneven"),
    ("ll-ekfac", "last_layer", "ekfac", "mlp_classification", "uneven"),
    ("all-diag_lowrank", "all", "diag_lowrank", "mlp_classification", "uneven"),
    ("all-full-sampler", "all", "full", "mlp_classification", "sampler"),
    ("all-diag-ddp", "all", "diag", "mlp_classification", "ddp"),
]
IDS = [c[0] for c in CONFIGS]
#: Configurations fitted with the large-output threshold lowered: below the 4 classes, or
#: (all weights) below the hidden layer's 5 outputs only, so the exact GGN stays affordable.
LARGE_OUTPUT = {"ll-kron-large": 2, "all-kron-large": 4}


@contextmanager
def _large_output_threshold(config):
    """Lower ``LARGE_OUTPUT_THRESHOLD`` for the configurations in :data:`LARGE_OUTPUT`."""
    saved = large_output.LARGE_OUTPUT_THRESHOLD
    if config[0] in LARGE_OUTPUT:
        large_output.LARGE_OUTPUT_THRESHOLD = LARGE_OUTPUT[config[0]]
    try:
        yield
    finally:
        large_output.LARGE_OUTPUT_THRESHOLD = saved


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(config):
    _, subset, structure, case_name, _ = config
    case = CASE_BUILDERS[case_name]()
    kwargs = {}
    if subset == "subnetwork":
        kwargs["subnetwork_indices"] = torch.tensor([0, 3, 5, 8, 13, 21, 30, 34, 40, 43])
    if structure in ("lowrank", "diag_lowrank"):
        kwargs["backend_kwargs"] = {"n_eigenvalues": 5}
    if config[0] in LARGE_OUTPUT and subset == "all":  # no truncation: sums in any order agree
        kwargs["output_factor_rank"] = 1000
    torch.manual_seed(7)
    X_test = torch.randn(9, *case.X.shape[1:], dtype=torch.float64)
    return case, kwargs, X_test


def _laplace(case, model, config, kwargs):
    _, subset, structure, _, _ = config
    return Laplace(
        model,
        case.likelihood,
        subset_of_weights=subset,
        hessian_structure=structure,
        prior_precision=0.7,
        **kwargs,
    )


def _precision(la) -> torch.Tensor:
    P = la.posterior_precision
    if isinstance(P, KronDecomposed):
        return P.to_matrix()
    if isinstance(P, tuple):  # low-rank ((U, λ), p₀): compare U diag(λ) Uᵀ (sign-free)
        (U, lam), prior = P
        return U @ torch.diag(lam) @ U.T + torch.diag(prior)
    return P


def _predict(la, X):
    out = la(X, pred_type="glm", link_approx="probit")
    return out if isinstance(out, torch.Tensor) else torch.cat([out[0], out[1].flatten(1)], 1)


def _calibration(la, case, val, distributed):
    """Grid search by a calibration metric, then ``evaluate``, on (sharded) validation data."""
    loss = "ece" if case.likelihood == "classification" else "crps"
    la.optimize_prior_precision(method="gridsearch", val_loader=val, grid_size=7, loss=loss)
    result = evaluate(la, val, distributed=distributed)
    metrics = ("ece", "mce", "nll", "brier") if loss == "ece" else ("crps", "nll", "rmse")
    return {
        "prior_grid_calibration": la.prior_precision.detach().clone(),
        "evaluate": torch.tensor([result[key] for key in metrics], dtype=torch.float64),
    }


def _local_loaders(case, config, rank):
    sharding = config[4]
    data = TensorDataset(case.X, case.y)
    val = TensorDataset(case.X[:15], case.y[:15])
    if sharding == "sampler":
        sampler = DistributedSampler(data, WORLD, rank, shuffle=False)
        return DataLoader(data, batch_size=4, sampler=sampler), None
    split = 2 * len(data) // 3  # uneven shards: rank 0 holds two thirds
    part = range(split) if rank == 0 else range(split, len(data))
    train = DataLoader(Subset(data, list(part)), batch_size=5)
    return train, DataLoader(shard_dataset(val, rank, WORLD), batch_size=4)


def _worker(rank: int, port: int, out_dir: str, configs, fail: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=20)
    )
    results = {}
    try:
        if fail:
            results["failure"] = _failing_fit(rank, fail)
        for config in configs:
            if config == MARGLIK_TRAINING:
                results[config] = _marglik_training(rank)
                continue
            with _large_output_threshold(config):
                results[config[0]] = _distributed_fit(rank, config)
    except Exception:  # reported to the parent through the results file
        results["error"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _distributed_fit(rank: int, config) -> dict:
    """This rank's fit of ``config`` on its shard, and what it then computes."""
    case, kwargs, X_test = _build(config)
    train, val = _local_loaders(case, config, rank)
    model = case.model
    if config[4] == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    la = _laplace(case, model, config, kwargs)
    distributed = None if config[4] == "sampler" else True
    la.fit(train, distributed=distributed)
    shard = X_test[rank::WORLD]
    res = {
        "precision": _precision(la).detach().clone(),
        "marglik": la.log_marginal_likelihood().detach().clone(),
        "n_data": la.n_data,
        "pred": all_gather(_predict(la, shard)),
        "structured_factor": isinstance(getattr(la, "H_facs", None), StructuredKron),
    }
    la.optimize_prior_precision(method="marglik", n_steps=15)
    res["prior_marglik"] = la.prior_precision.detach().clone()
    if val is not None:
        la.optimize_prior_precision(method="gridsearch", val_loader=val, grid_size=7)
        res["prior_grid"] = la.prior_precision.detach().clone()
        res.update(_calibration(la, case, val, distributed=True))
    return res


MARGLIK_TRAINING = "marglik_training"


def _marglik_training(rank: int | None):
    """marglik_training on DDP + DistributedSampler (rank) or in one process (None)."""
    case = CASE_BUILDERS["mlp_regression_3out"]()
    data = TensorDataset(case.X, case.y)
    model = case.model
    if rank is None:
        loader = DataLoader(data, batch_size=2 * 4)
    else:
        sampler = DistributedSampler(data, WORLD, rank, shuffle=False)
        loader = DataLoader(data, batch_size=4, sampler=sampler)
        model = torch.nn.parallel.DistributedDataParallel(model)
    la, model, margliks, losses = marglik_training(
        model,
        loader,
        likelihood="regression",
        hessian_structure="kron",
        backend=CurvlinopsGGN,
        n_epochs=4,
        n_hypersteps=3,
        optimizer_kwargs={"lr": 1e-2},
    )
    return {
        "margliks": torch.tensor(margliks),
        "losses": torch.tensor(losses),
        "prior": la.prior_precision.detach().clone(),
        "sigma": la.sigma_noise.detach().clone(),
        "marglik": la.log_marginal_likelihood().detach().clone(),
    }


class _Failing(Dataset):
    """Raises (``"raise"``) or kills its process (``"die"``) when item 6 is read."""

    def __init__(self, mode: str):
        self.mode = mode

    def __len__(self):
        return 10

    def __getitem__(self, i):
        if i == 6 and self.mode == "die":
            os._exit(0)  # exit code 0: mp.spawn keeps the other rank running
        if i == 6:
            raise OSError("disk read failed on this rank")
        return torch.randn(3, dtype=torch.float64), torch.tensor(0)


def _failing_fit(rank: int, mode: str) -> str:
    """``mode``: rank 1 raises (``"raise"``) or dies (``"die"``) mid-loader, or the ranks are
    built with different prior precisions (``"mismatch"``) or structures (``"structure"``)."""
    case = CASE_BUILDERS["mlp_classification"]()
    failing = mode in ("raise", "die") and rank == 1
    data = _Failing(mode) if failing else TensorDataset(case.X[:10], case.y[:10])
    kwargs = {"hessian_structure": "diag", "prior_precision": 1.0}
    if mode == "mismatch":
        kwargs["prior_precision"] = 1.0 + rank
    if mode == "structure":
        kwargs["hessian_structure"] = ("diag", "full")[rank]
    la = Laplace(case.model, "classification", **kwargs)
    try:
        la.fit(DataLoader(data, batch_size=3), distributed=True)
    except DistributedFitError as error:
        return f"DistributedFitError: {error}"
    except OSError as error:
        return f"OSError: {error}"
    except RuntimeError as error:  # the collective of a rank whose peer died
        return f"RuntimeError: {error}"
    return "no error"


def _spawn(tmp_path, configs, fail=None, ranks=range(WORLD)):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), configs, fail), nprocs=WORLD)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in ranks]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r} raised:\n{res['error']}"
    return results


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("dist"), [*CONFIGS, MARGLIK_TRAINING])


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_distributed_fit_equals_single_process(config, distributed_results, monkeypatch):
    if config[0] in LARGE_OUTPUT:
        monkeypatch.setattr(large_output, "LARGE_OUTPUT_THRESHOLD", LARGE_OUTPUT[config[0]])
    case, kwargs, X_test = _build(config)
    la = _laplace(case, case.model, config, kwargs)
    la.fit(case.loader(5))
    expected = {
        "precision": _precision(la).detach().clone(),
        "marglik": la.log_marginal_likelihood().detach().clone(),
        "n_data": la.n_data,
        "pred": _predict(la, torch.cat([X_test[0::2], X_test[1::2]])),
    }
    la.optimize_prior_precision(method="marglik", n_steps=15)
    expected["prior_marglik"] = la.prior_precision.detach().clone()
    if config[4] != "sampler":
        val = DataLoader(TensorDataset(case.X[:15], case.y[:15]), batch_size=4)
        la.optimize_prior_precision(method="gridsearch", val_loader=val, grid_size=7)
        expected["prior_grid"] = la.prior_precision.detach().clone()
        expected.update(_calibration(la, case, val, distributed=False))
    # low-rank: eigenpairs from sums in another order agree to the solver's accuracy, not bitwise
    rtol, atol = (1e-6, 1e-8) if config[2] in ("lowrank", "diag_lowrank") else (RTOL, ATOL)
    for rank, results in enumerate(distributed_results):
        got = results[config[0]]
        assert got["n_data"] == expected["n_data"], f"rank {rank}"
        for key in expected:
            if key == "evaluate":  # torchmetrics' calibration error bins in float32
                assert_close(got[key], expected[key], rtol=RTOL_F32, atol=RTOL_F32)
            elif key != "n_data":
                assert_close(got[key], expected[key], rtol=rtol, atol=atol)
    structured = [results[config[0]]["structured_factor"] for results in distributed_results]
    assert structured == [config[0] in LARGE_OUTPUT] * WORLD
    # every rank holds bitwise the same posterior
    for key in ("precision", "marglik", "prior_marglik"):
        assert torch.equal(
            distributed_results[0][config[0]][key], distributed_results[1][config[0]][key]
        )


def test_distributed_marglik_training_equals_single_process(distributed_results):
    expected = _marglik_training(None)
    for results in distributed_results:
        for key, value in expected.items():
            assert_close(results[MARGLIK_TRAINING][key], value, rtol=1e-7, atol=1e-9)


def test_failing_rank_raises_clear_error_on_the_others(tmp_path):
    start = time.perf_counter()
    results = _spawn(tmp_path, [], fail="raise")
    assert time.perf_counter() - start < 60
    assert results[1]["failure"].startswith("OSError: disk read failed")
    assert results[0]["failure"].startswith("DistributedFitError")
    assert "rank(s) [1] failed" in results[0]["failure"]


@pytest.mark.parametrize(
    ("mode", "differs"), [("mismatch", "['prior_precision']"), ("structure", "['class']")]
)
def test_ranks_with_different_hyperparameters_fail_on_every_rank(tmp_path, mode, differs):
    start = time.perf_counter()
    results = _spawn(tmp_path, [], fail=mode)
    for rank, result in enumerate(results):
        assert result["failure"].startswith("DistributedFitError"), result["failure"]
        assert f"the ranks hold different {differs} (rank {rank} has" in result["failure"]
    assert time.perf_counter() - start < 60


def test_dead_rank_makes_the_others_fail_not_hang(tmp_path):
    start = time.perf_counter()
    (result,) = _spawn(tmp_path, [], fail="die", ranks=[0])
    assert result["failure"].startswith("DistributedFitError"), result["failure"]
    assert "lost contact with the other ranks" in result["failure"]
    assert time.perf_counter() - start < 60


def test_distributed_true_needs_process_group(classification_case):
    la = Laplace(classification_case.model, "classification", hessian_structure="diag")
    with pytest.raises(RuntimeError, match="init_process_group"):
        la.fit(classification_case.loader(), distributed=True)
