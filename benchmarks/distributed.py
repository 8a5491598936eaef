"""Benchmark: distributed fit time with 1 vs 2 processes on the CNN of ``benchmarks/run.py``.

The CNN (207k params) and its N=2000 training set of the foundation issue; every process fits
its ``shard_dataset`` shard with ``fit(distributed=True)`` (gloo on CPU) and the time from a
barrier to the end of the all-reduced fit is taken, best of ``--repeats``. Configurations: one
process with 1 and with 2 threads, and two processes with 1 thread each (the same 2 cores as
1 process × 2 threads).

Usage: ``python benchmarks/distributed.py [--structures kron diag] [--repeats R]``; launches
``torchrun`` for each configuration, prints a table and writes
``benchmarks/results/distributed.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CONFIGS = [(1, 1), (1, 2), (2, 1)]  # (processes, threads per process)


def worker(structure: str, repeats: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(HERE))
    from harness import BATCH, MODELS, N_TRAIN, data

    from laplace import Laplace
    from laplace.utils.distributed import shard_dataset

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MODELS["cnn"]().eval()
    dataset = TensorDataset(*data("cnn", N_TRAIN, 0))
    loader = DataLoader(shard_dataset(dataset, rank, world), batch_size=BATCH)
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        la.fit(loader, distributed=True)
        best = min(best, time.perf_counter() - start)
    seconds = torch.tensor([best], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank sets the time
    if rank == 0:
        out.write_text(json.dumps({"seconds": seconds.item(), "n_data": la.n_data}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--structures", nargs="+", default=["kron", "diag"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("STRUCTURE", "OUT"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.repeats, Path(args.worker[1]))
        return
    torchrun = Path(sys.executable).with_name("torchrun")
    rows = []
    for structure in args.structures:
        for nproc, threads in CONFIGS:
            out = RESULTS / f".distributed_{structure}_{nproc}.json"
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            cmd = [str(torchrun), "--standalone", f"--nproc_per_node={nproc}", __file__]
            cmd += ["--repeats", str(args.repeats), "--worker", structure, str(out)]
            load = os.getloadavg()[0]
            subprocess.run(cmd, env=env, check=True, capture_output=True)
            result = json.loads(out.read_text())
            out.unlink()
            rows.append(
                {
                    "case": f"fit {structure} cnn",
                    "processes": nproc,
                    "threads_per_process": threads,
                    "seconds": result["seconds"],
                    "load_1min_before": load,
                }
            )
            print(
                f"{rows[-1]['case']:<14} {nproc} proc × {threads} thr  "
                f"{result['seconds']:.3f} s   (load {load:.2f})"
            )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "distributed.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
