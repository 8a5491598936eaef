"""Laplace across processes: DDP training, a distributed KFAC fit, tuning and sharded prediction.

Run with ``torchrun --nproc_per_node=2 examples/distributed_example.py`` (CPU: gloo backend;
with one GPU per process: NCCL). Each rank

1. trains a small CNN under ``DistributedDataParallel`` on its ``DistributedSampler`` shard of a
   synthetic 10-class image data set,
2. fits a KFAC Laplace approximation on its shard; the Kronecker factors, the loss and the data
   count are all-reduced, so every rank holds the posterior of the whole data set,
3. tunes the prior precision by marginal likelihood (identical on every rank) and by grid search
   on its shard of the validation set,
4. evaluates its shard of the test set with ``laplace.evaluation.evaluate``
   (``distributed=True``): the metrics' sums are all-reduced, so every rank gets the accuracy,
   NLL and ECE of the whole test set.

Rank 0 then fits the same approximation in one process on the whole training set, to show what
the distributed fit buys: its time against the time per rank, and the same posterior (the log
marginal likelihood at the tuned prior agrees to float32 round-off).

Rank 0 writes ``metrics.json`` under ``outputs/distributed_example/`` (or ``--output DIR``) and
prints the folder. Without torchrun the script runs as a single process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from laplace import Laplace
from laplace.evaluation import evaluate
from laplace.utils.distributed import shard_dataset

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "outputs" / "distributed_example"


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def synthetic_images(n: int, seed: int) -> TensorDataset:
    """16×16 images whose class sets the position of a bright 4×3 blob, in unit pixel noise."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=gen)
    X = torch.randn(n, 1, 16, 16, generator=gen)
    for i, label in enumerate(y.tolist()):
        r, c = divmod(label, 5)
        X[i, 0, 3 + 6 * r : 7 + 6 * r, 1 + 3 * c : 4 + 3 * c] += 1.0
    return TensorDataset(X, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()

    distributed = "RANK" in os.environ  # set by torchrun
    if distributed:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # A timeout makes a rank that died fail the others instead of letting them wait.
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device(
        f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    train, val, test = (
        synthetic_images(2000, 0),
        synthetic_images(500, 1),
        synthetic_images(500, 2),
    )
    sampler = DistributedSampler(train, world, rank, seed=0) if distributed else None
    # 64 points per optimiser step whatever the number of processes: the same training as one.
    train_loader = DataLoader(
        train, batch_size=64 // world, sampler=sampler, shuffle=sampler is None
    )

    torch.manual_seed(0)
    model = cnn().to(device)
    ddp_model = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=3e-3, weight_decay=1e-4)
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for X, y in train_loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp_model(X.to(device)), y.to(device)).backward()
            optimizer.step()

    # The fit: the loader's DistributedSampler opts in (distributed=None); the DDP wrapper is
    # unwrapped. 2000 is a multiple of the world size here, so no sample is repeated.
    fit_loader = DataLoader(train, batch_size=100, sampler=sampler)
    la = Laplace(ddp_model, "classification", hessian_structure="kron")
    start = time.perf_counter()
    la.fit(fit_loader)
    fit_seconds = time.perf_counter() - start
    la.optimize_prior_precision(method="marglik", n_steps=50)
    marglik_prior = la.prior_precision.item()
    # Grid search on this rank's validation shard; the losses are averaged over all ranks.
    val_loader = DataLoader(shard_dataset(val, rank, world), batch_size=100)
    la.optimize_prior_precision(method="gridsearch", val_loader=val_loader, grid_size=20)

    # Metrics of a sharded test set: each rank predicts its shard, the sums are all-reduced.
    test_loader = DataLoader(shard_dataset(test, rank, world), batch_size=100)
    result = evaluate(
        la, test_loader, pred_type="glm", link_approx="probit", distributed=distributed
    )

    if rank == 0:
        # The same fit in one process over the whole training set: the reference posterior.
        single = Laplace(model, "classification", hessian_structure="kron")
        start = time.perf_counter()
        single.fit(DataLoader(train, batch_size=100))
        single_seconds = time.perf_counter() - start
        prior = la.prior_precision
        log_marglik_gap = abs(
            la.log_marginal_likelihood(prior).item() - single.log_marginal_likelihood(prior).item()
        )
        args.output.mkdir(parents=True, exist_ok=True)
        metrics = {
            "world_size": world,
            "fit_seconds_per_rank": round(fit_seconds, 3),
            "fit_seconds_one_process": round(single_seconds, 3),
            "log_marglik_gap_to_one_process": log_marglik_gap,
            "n_data": la.n_data,
            "log_marglik": la.log_marginal_likelihood().item(),
            "prior_precision_marglik": marglik_prior,
            "prior_precision_gridsearch": la.prior_precision.item(),
            "test_accuracy": result["accuracy"],
            "test_nll": result["nll"],
            "test_ece": result["ece"],
        }
        (args.output / "metrics.json").write_text(json.dumps(metrics, indent=2))
        print(json.dumps(metrics, indent=2))
        print(f"metrics written to {args.output}/ (metrics.json)")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
