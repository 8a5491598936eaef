"""Last-layer Laplace over an LLM-size vocabulary: a head d = 256 → C = 32,000.

The acceptance case of issue 16 (large output dimensions): 64 sequences × 32 tokens of 256
features, a head onto 32,000 classes (8.2M parameters), last-layer Kron: fit, 100 marginal-
likelihood steps (``optimize_prior_precision``) and the GLM probit predictive of 8 sequences.
The dense C × C output factor alone would take 4 GB (float32); the structured factor keeps
``diag(Σ p) − P Pᵀ`` with a rank-k low-rank part (``output_factor_rank``). Peak memory is the
resident memory above the level after building the model and the data (``PeakRSS`` of the
harness), over all three steps together. ``structure="diag"`` runs the same for a diagonal
last layer.

The model maps per-token features (B, T, 256) to sequence logits (B, T, C) with next-token
targets (B, T), Hugging Face's convention; the last token of every sequence has no next token
and is labelled −100 (``ignore_index``), so it counts in neither the loss nor the curvature.

Usage: ``python benchmarks/large_vocab.py [--structure kron|diag] [--rank K] [--threads T]``;
prints one line and writes ``benchmarks/results/large_vocab.json``. ``benchmarks/run.py`` runs
it as the case ``large-vocab-ll-kron``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import PeakRSS
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N_SEQUENCES, N_TOKENS, N_FEATURES, VOCABULARY = 64, 32, 256, 32_000
BATCH_SEQUENCES, TEST_SEQUENCES, MARGLIK_STEPS = 8, 8, 100
RESULTS = Path(__file__).resolve().parent / "results"


def language_head(seed: int = 0) -> nn.Module:
    """A body on per-token features and the vocabulary head, with peaked softmax outputs."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(N_FEATURES, N_FEATURES), nn.GELU(), nn.Linear(N_FEATURES, VOCABULARY)
    )
    with torch.no_grad():
        model[-1].weight.mul_(8.0)
    return model.eval()


def token_sequences(n_sequences: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token features (n, T, 256) and next-token targets (n, T), the last one −100."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n_sequences, N_TOKENS, N_FEATURES, generator=gen)
    y = torch.randint(0, VOCABULARY, (n_sequences, N_TOKENS), generator=gen)
    y[:, -1] = -100
    return X, y


def timed_steps(steps: dict[str, Callable[[], Any]]) -> tuple[Any, dict]:
    """Run the steps in order; the last step's result and a row of their times and peak memory.

    The row has ``{name}_s`` (wall) and ``{name}_cpu_s`` (process CPU) per step, their wall
    total ``seconds``, the peak resident memory above the start (``peak_extra_MB``) and the
    size the dense C × C output factor would have (``dense_output_factor_MB``).
    """
    times = {}
    with PeakRSS() as mem:
        for name, step in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            out = step()
            times[f"{name}_s"] = time.perf_counter() - wall
            times[f"{name}_cpu_s"] = time.process_time() - cpu
    row = {
        "seconds": sum(times[f"{name}_s"] for name in steps),
        **times,
        "peak_extra_MB": mem.extra / 2**20,
        "dense_output_factor_MB": VOCABULARY**2 * 4 / 2**20,
    }
    return out, row


def report(row: dict, steps: dict[str, str], threads: int, name: str) -> None:
    """Print one line for the row (``steps``: step name → description) and write its JSON."""
    row.update(threads=threads, load_avg_1min=os.getloadavg()[0])
    timings = ", ".join(
        f"{what} {row[f'{key}_s']:.2f} s ({row[f'{key}_cpu_s']:.2f} s CPU)"
        for key, what in steps.items()
    )
    print(
        f"{row['case']}: {timings}; peak +{row['peak_extra_MB']:.0f} MB, the dense C x C "
        f"factor alone {row['dense_output_factor_MB']:.0f} MB; {row.get('note', '')}; load "
        f"{row['load_avg_1min']:.1f}"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(row, indent=2))


def case_large_vocab(structure: str = "kron", rank: int | None = None) -> dict:
    """Fit, marginal-likelihood tuning and predictive of a last layer over 32,000 classes."""
    from laplace import Laplace

    model = language_head()
    X, y = token_sequences(N_SEQUENCES, 0)
    loader = DataLoader(TensorDataset(X, y), batch_size=BATCH_SEQUENCES)
    X_test, _ = token_sequences(TEST_SEQUENCES, 1)
    options = {} if rank is None else {"output_factor_rank": rank}
    la = Laplace(model, "classification", "last_layer", structure, **options)
    steps = {
        "fit": lambda: la.fit(loader),
        "marglik": lambda: la.optimize_prior_precision(method="marglik", n_steps=MARGLIK_STEPS),
        "predict": lambda: la(X_test, link_approx="probit"),
    }
    out, row = timed_steps(steps)
    assert out.shape == (TEST_SEQUENCES, N_TOKENS, VOCABULARY)
    row = {
        "case": f"large vocabulary last-layer {structure} C={VOCABULARY}",
        "n_params": la.n_params,
        **row,
        "prior_precision": la.prior_precision.tolist(),
    }
    if structure == "kron":
        G = la.H_facs.kfacs[0][0]
        row["note"] = f"output factor rank {G.rank}, dropped trace {float(G.dropped):.3g}"
    return row


#: The case of ``benchmarks/run.py`` (one run: the marginal-likelihood steps dominate).
LARGE_VOCAB_CASES = {
    "large-vocab-ll-kron": (lambda _, structure, repeats: case_large_vocab(structure), "", "kron")
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--structure", choices=["kron", "diag"], default="kron")
    parser.add_argument("--rank", type=int, default=None, help="output_factor_rank (kron)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    row = case_large_vocab(args.structure, args.rank)
    steps = {
        "fit": "fit",
        "marglik": f"{MARGLIK_STEPS} marglik steps",
        "predict": f"GLM probit predictive of {TEST_SEQUENCES} sequences",
    }
    report(row, steps, args.threads, "large_vocab")


if __name__ == "__main__":
    main()
