"""Shared pieces of the benchmarks: models, data, timing against a floor, peak memory.

Set-up of the foundation issue: CPU, 2 threads, N=2000, 10 classes, batch 100, an MLP
64-256-256-10 (85k params, on 64 input features) and a CNN on 28×28 inputs (conv 16 s2,
conv 32 s2, linear 128, linear 10; 207k params). ``width`` scales every hidden width (the
scaling table).

A fit is timed against a *floor* measured in the same process: one forward and 10 backward
passes (one per class) over the same data, the cost of any curvature that needs each output's
gradient. Floor and fit alternate, and the ratio reported is the median of the per-repeat ratios,
so that load from other processes affects both alike.

``use_device("cuda")`` puts the models and data on a GPU: times then wait for the device
(``torch.cuda.synchronize``) and peak memory is the device's (``torch.cuda.max_memory_allocated``)
instead of the process's resident memory.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N_TRAIN, N_TEST, N_CLASSES, BATCH = 2000, 1000, 10, 100
#: Where models and data live (``use_device``).
DEVICE = torch.device("cpu")


def use_device(name: str) -> None:
    """Build models and data on ``name`` (``"cpu"`` or ``"cuda"``) from now on."""
    global DEVICE
    DEVICE = torch.device(name)


def synchronize() -> None:
    """Wait for the device's queued work, so a clock read after it counts that work."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def mlp(width: int = 1) -> nn.Module:
    hidden = 256 * width
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, N_CLASSES),
    ).to(DEVICE)


def cnn(width: int = 1) -> nn.Module:
    c1, c2, hidden = 16 * width, 32 * width, 128 * width
    return nn.Sequential(
        nn.Conv2d(1, c1, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(c1, c2, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(c2 * 7 * 7, hidden),
        nn.ReLU(),
        nn.Linear(hidden, N_CLASSES),
    ).to(DEVICE)


def regression_mlp() -> nn.Module:
    """laplace-torch's regression example: 1 → 50 (tanh) → 1, 151 weights."""
    return nn.Sequential(nn.Linear(1, 50), nn.Tanh(), nn.Linear(50, 1)).to(DEVICE)


def regression_loader(n: int = 150) -> DataLoader:
    """laplace-torch's regression example's data: ``sin(x) + 0.3 ε`` on ``x ∈ [0, 8]``."""
    gen = torch.Generator().manual_seed(0)
    X = torch.rand(n, 1, generator=gen) * 8
    y = torch.sin(X) + 0.3 * torch.randn(n, 1, generator=gen)
    return DataLoader(TensorDataset(X.to(DEVICE), y.to(DEVICE)), batch_size=n)


MODELS = {"mlp": mlp, "cnn": cnn}
INPUT_SHAPES = {"mlp": (64,), "cnn": (1, 28, 28)}


def data(model_name: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, *INPUT_SHAPES[model_name], generator=gen)
    y = torch.randint(0, N_CLASSES, (n,), generator=gen)
    return X.to(DEVICE), y.to(DEVICE)


def training_loader(model_name: str, n: int = N_TRAIN) -> DataLoader:
    return DataLoader(TensorDataset(*data(model_name, n, 0)), batch_size=BATCH)


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every 2 ms (bytes).

    On a CUDA ``DEVICE``, the peak of the device memory allocated by torch above the level at
    entry instead.
    """

    def __enter__(self):
        self.base = self.peak = self._rss()
        if DEVICE.type == "cuda":
            synchronize()
            torch.cuda.reset_peak_memory_stats(DEVICE)
            self.cuda_base = torch.cuda.memory_allocated(DEVICE)
        self._stop = False
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        if DEVICE.type == "cuda":
            synchronize()
            self.cuda_peak = torch.cuda.max_memory_allocated(DEVICE)

    @property
    def extra(self) -> int:
        if DEVICE.type == "cuda":
            return self.cuda_peak - self.cuda_base
        return self.peak - self.base

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _watch(self):
        while not self._stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)


#: The clocks a measurement can use: wall time, or this process's CPU time.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCKS["wall"]


def use_clock(name: str) -> None:
    """Measure with ``"wall"`` time (default) or process ``"cpu"`` time.

    CPU time of a single-threaded run hardly changes when other processes load the machine, so
    ratios measured with ``--threads 1 --clock cpu`` are the robust ones on a shared machine.
    """
    global _clock
    _clock = CLOCKS[name]


def seconds(fn: Callable[[], object]) -> float:
    synchronize()
    start = _clock()
    fn()
    synchronize()
    return _clock() - start


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls."""
    return statistics.median(seconds(fn) for _ in range(repeats))


def forward_plus_10_backward(model: nn.Module, loader: DataLoader) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    for X, _ in loader:
        f = model(X)
        for c in range(N_CLASSES):
            torch.autograd.grad(f[:, c].sum(), params, retain_graph=c < N_CLASSES - 1)


def forward_pass(model: nn.Module, loader: DataLoader) -> None:
    with torch.no_grad():
        for X, _ in loader:
            model(X)


def against_floor(fn: Callable[[], object], floor: Callable[[], object], repeats: int) -> dict:
    """Medians of ``fn``'s time, the floor's time and their per-repeat ratio, alternating."""
    pairs = [(seconds(floor), seconds(fn)) for _ in range(repeats)]
    return {
        "seconds": statistics.median(t for _, t in pairs),
        "floor_s": statistics.median(f for f, _ in pairs),
        "ratio": statistics.median(t / f for f, t in pairs),
    }


def guard_overhead(la, loader: DataLoader, repeats: int) -> dict:
    """A fit whose attribution guard checks its batches against the same fit with the
    verdicts cached, alternating in one process: ``ratio`` is 1 + the guard's share."""
    with PeakRSS() as mem:
        la.fit(loader)
    verdicts = la.backend.engine.verdicts

    def checked_fit() -> None:
        verdicts.clear()
        la.fit(loader)

    times = against_floor(checked_fit, partial(la.fit, loader), repeats)
    return {
        "n_params": la.n_params,
        **times,
        "peak_extra_MB": mem.extra / 2**20,
        "floor": "fit, verdicts cached",
    }


class GuardTimer:
    """Seconds the attribution guard spends checking recorded passes, per engine checked.

    Wraps ``guard.verify`` where the engine calls it; every case runs inside one
    (``run.py``), so each row says what the guard cost it beside what it timed. An engine's
    first check runs cold (the first batch of the process's first fit); cases that check
    again after their timed calls (``measure_fit``) also give a warm check, the cost a fit
    pays for the guard in a process that has run before (as in an A/B in one process).
    """

    def __enter__(self):
        self.per_engine: dict[int, list[float]] = {}
        try:
            from laplace.curvature.engine import per_sample
        except ImportError:  # laplace-torch (benchmarks/compare.py): no guard to time
            self.module = None
            return self
        self.module, self.verify = per_sample, per_sample.verify

        def timed_verify(engine, *pass_):  # the recorded pass (f, calls, and the inputs)
            start = time.perf_counter()
            try:
                return self.verify(engine, *pass_)
            finally:
                seconds = time.perf_counter() - start
                self.per_engine.setdefault(id(engine), []).append(seconds)

        per_sample.verify = timed_verify
        return self

    def __exit__(self, *exc):
        if self.module is not None:
            self.module.verify = self.verify

    def columns(self, seconds: float) -> dict:
        """Against ``seconds`` (the case's timed call), where the guard ran: ``guard_s`` (all
        checks), ``guard_checks``, ``guard_share`` (the first check of each engine, averaged
        over engines) and ``guard_warm_share`` (the last, where an engine checked again)."""
        if not self.per_engine:
            return {}
        checks = list(self.per_engine.values())
        row = {
            "guard_s": sum(map(sum, checks)),
            "guard_checks": sum(map(len, checks)),
            "guard_share": statistics.mean(c[0] for c in checks) / seconds,
        }
        warm = [c[-1] for c in checks if len(c) > 1]
        if warm:
            row["guard_warm_share"] = statistics.mean(warm) / seconds
        return row


def recheck(la, loader: DataLoader) -> None:
    """Fit once more with the guard's verdicts forgotten (a warm check for ``GuardTimer``)."""
    engine = getattr(getattr(la, "backend", None), "engine", None)
    if hasattr(engine, "verdicts"):
        engine.verdicts.clear()
        la.fit(loader)


def measure_fit(la, loader: DataLoader, repeats: int, case: str, floor=None) -> dict:
    """Peak extra memory of a first fit, then fit time (median) against ``floor`` if given;
    then one untimed fit that checks its batches again (``recheck``)."""
    with PeakRSS() as mem:
        la.fit(loader)
    fit = partial(la.fit, loader)
    times = against_floor(fit, floor, repeats) if floor else {"seconds": timed(fit, repeats)}
    recheck(la, loader)
    return {"case": case, "n_params": la.n_params, **times, "peak_extra_MB": mem.extra / 2**20}


def measure_predict(la, model_name: str, n_test: int, repeats: int, case: str) -> dict:
    """GLM probit predictive time (median) and peak extra memory on ``n_test`` points."""
    X_test, _ = data(model_name, n_test, 1)
    la(X_test[:10], link_approx="probit")  # warm the posterior factorisation
    with PeakRSS() as mem:
        pred_s = timed(lambda: la(X_test, pred_type="glm", link_approx="probit"), repeats)
    return {
        "case": case,
        "n_params": la.n_params,
        "seconds": pred_s,
        "peak_extra_MB": mem.extra / 2**20,
    }
