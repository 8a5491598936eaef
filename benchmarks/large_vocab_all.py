"""All-weights Kron Laplace over an LLM-size vocabulary: sequence logits (B, T, 32,000).

A token model of width 64 (two hidden Linear layers on per-token features (B, T, 64)) ending in
a 64 → 32,000 Linear head, 64 sequences × 32 tokens, batches of 8 sequences, float32.
All-weights ``KronLaplace`` with the Monte-Carlo Fisher (``backend_kwargs={"stochastic":
True}``, one sampled label per token): the head's output factor is a diagonal plus a low-rank
term of at most ``output_factor_rank`` columns (:mod:`laplace.structures.large_output`), the hidden
layers' factors dense. Steps: ``fit``, ``MARGLIK_STEPS`` marginal-likelihood steps of a layer-wise
prior (``optimize_prior_precision``) and ``pred_type="nn"`` (``N_PREDICTIVE_SAMPLES`` weight
samples, one forward pass each) on 8 sequences, returning probabilities (8, 32, 32,000). The exact
GGN (32,000 columns per token) and the GLM predictive (32,000 Jacobian rows per token) are refused
above the threshold. Peak memory is the resident memory above the level after building the model
and the data (``PeakRSS`` of the harness), over the three steps together.

Usage: ``python benchmarks/large_vocab_all.py [--rank K] [--threads T]``; prints one line and
writes ``benchmarks/results/large_vocab_all.json``. ``benchmarks/run.py`` runs it as the case
``large-vocab-all-kron``.
"""

from __future__ import annotations

import argparse

import torch
from large_vocab import (
    BATCH_SEQUENCES,
    N_SEQUENCES,
    N_TOKENS,
    TEST_SEQUENCES,
    VOCABULARY,
    report,
    timed_steps,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WIDTH, MARGLIK_STEPS, N_PREDICTIVE_SAMPLES = 64, 20, 10


def token_model(seed: int = 0) -> nn.Module:
    """Two hidden layers of width 64 on every token, then the vocabulary head: (B, T, C)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH),
        nn.GELU(),
        nn.Linear(WIDTH, WIDTH),
        nn.GELU(),
        nn.Linear(WIDTH, VOCABULARY),
    ).eval()


def sequences(n_sequences: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token features (n, T, 64) and next-token targets (n, T)."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n_sequences, N_TOKENS, WIDTH, generator=gen)
    return X, torch.randint(0, VOCABULARY, (n_sequences, N_TOKENS), generator=gen)


def case_large_vocab_all(rank: int | None = None) -> dict:
    """Fit, marglik tuning and NN predictive of all-weights Kron over 32,000 classes."""
    from laplace import Laplace

    model = token_model()
    X, y = sequences(N_SEQUENCES, 0)
    loader = DataLoader(TensorDataset(X, y), batch_size=BATCH_SEQUENCES)
    X_test, _ = sequences(TEST_SEQUENCES, 1)
    options = {} if rank is None else {"output_factor_rank": rank}
    la = Laplace(
        model, "classification", "all", "kron", backend_kwargs={"stochastic": True}, **options
    )
    la.prior_precision = torch.ones(la.n_layers)
    predict = {"pred_type": "nn", "link_approx": "mc", "n_samples": N_PREDICTIVE_SAMPLES}
    steps = {
        "fit": lambda: la.fit(loader),
        "marglik": lambda: la.optimize_prior_precision(method="marglik", n_steps=MARGLIK_STEPS),
        "predict": lambda: la(X_test, **predict),
    }
    out, row = timed_steps(steps)
    assert out.shape == (TEST_SEQUENCES, N_TOKENS, VOCABULARY)
    G = la.H_facs.kfacs[-2][0]
    return {
        "case": f"large vocabulary all-weights kron (MC Fisher) C={VOCABULARY}",
        "n_params": la.n_params,
        **row,
        "prior_precision": la.prior_precision.tolist(),
        "note": (
            f"head output factor rank {G.rank}, trace in the low-rank part "
            f"{float(G.U.square().sum()):.3g}, moved to the diagonal {float(G.dropped):.3g}"
        ),
    }


#: The case of ``benchmarks/run.py`` (one run).
LARGE_VOCAB_ALL_CASES = {
    "large-vocab-all-kron": (lambda _, __, repeats: case_large_vocab_all(), "", "kron")
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=None, help="output_factor_rank")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    row = case_large_vocab_all(args.rank)
    steps = {
        "fit": "fit",
        "marglik": f"{MARGLIK_STEPS} marglik steps",
        "predict": f"NN predictive ({N_PREDICTIVE_SAMPLES} samples, {TEST_SEQUENCES} sequences)",
    }
    report(row, steps, args.threads, "large_vocab_all")


if __name__ == "__main__":
    main()
