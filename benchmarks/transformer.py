"""All-weights Kron on tiny transformers built from a config (no download): fit and predictive.

A 2-layer Llama (rotary positions, RMSNorm, SiLU MLP) and a 2-layer GPT-2 (transformers'
``Conv1D`` projections, LayerNorm, learned position embeddings, frozen: they are looked up once
for the whole batch), each with a linear head on the last token's hidden state scoring
``N_CLASSES`` classes, on random token sequences. Every parameter is in the posterior:
embeddings (diagonal token-count factor), attention and MLP projections (Kronecker factors),
normalisation layers (exact dense blocks) and the head. The fit is timed against the floor of
the harness (one forward and ``N_CLASSES`` backward passes over the same data).
"""

from __future__ import annotations

from functools import partial

import torch
from harness import BATCH, N_CLASSES, PeakRSS, forward_plus_10_backward, measure_fit, timed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: Sequences (train, test), their length and the vocabulary.
N_SEQUENCES, N_TEST_SEQUENCES, SEQ_LEN, VOCAB = 512, 256, 32, 512
WIDTH, LAYERS, HEADS = 64, 2, 4


class LastTokenClassifier(nn.Module):
    """A transformer body and a linear head on the hidden state of the last token."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body
        self.head = nn.Linear(WIDTH, N_CLASSES)

    def forward(self, tokens):
        return self.head(self.body(input_ids=tokens).last_hidden_state[:, -1])


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=4 * WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=SEQ_LEN,
        attn_implementation="eager",
    )
    return LlamaModel(config)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ_LEN,
        n_embd=WIDTH,
        n_layer=LAYERS,
        n_head=HEADS,
        attn_implementation="eager",
    )
    body = GPT2Model(config)
    body.wpe.weight.requires_grad_(False)
    return body


BODIES = {"llama": _llama, "gpt2": _gpt2}


def _model_and_data(name: str, n: int, seed: int) -> tuple[nn.Module, DataLoader]:
    torch.manual_seed(0)
    model = LastTokenClassifier(BODIES[name]()).eval()
    gen = torch.Generator().manual_seed(seed)
    X = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=gen)
    y = torch.randint(0, N_CLASSES, (n,), generator=gen)
    return model, DataLoader(TensorDataset(X, y), batch_size=BATCH // 4)


def case_fit_transformer(name: str, approx: str, repeats: int) -> dict:
    from laplace import KronLaplace

    model, loader = _model_and_data(name, N_SEQUENCES, 0)
    la = KronLaplace(model, "classification", backend_kwargs={"kfac_approx": approx})
    floor = partial(forward_plus_10_backward, model, loader)
    case = f"fit kron ({approx}) {name} {N_SEQUENCES}×{SEQ_LEN} tokens"
    return {**measure_fit(la, loader, repeats, case, floor), "floor": "1 fwd + 10 bwd"}


def case_predict_transformer(name: str, approx: str, repeats: int) -> dict:
    from laplace import KronLaplace

    model, loader = _model_and_data(name, N_SEQUENCES, 0)
    la = KronLaplace(model, "classification", backend_kwargs={"kfac_approx": approx})
    la.fit(loader)
    X = torch.cat([X for X, _ in _model_and_data(name, N_TEST_SEQUENCES, 1)[1]])
    la(X[:8], link_approx="probit")  # warm the posterior factorisation
    with PeakRSS() as mem:
        seconds = timed(lambda: la(X, pred_type="glm", link_approx="probit"), repeats)
    return {
        "case": f"glm probit kron {name} ({N_TEST_SEQUENCES} sequences)",
        "n_params": la.n_params,
        "seconds": seconds,
        "peak_extra_MB": mem.extra / 2**20,
    }


class TokenBag(nn.Module):
    """A 32,000-token embedding, averaged over the sequence, and a linear head."""

    def __init__(self, vocabulary: int = 32_000, width: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.head = nn.Linear(width, N_CLASSES)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


def case_fit_diag_embedding(_: str, __: str, repeats: int) -> dict:
    """Diagonal GGN over a 32,000 × 128 embedding: squared gradients per (sequence, token)."""
    from laplace import DiagLaplace

    torch.manual_seed(0)
    model = TokenBag().eval()
    gen = torch.Generator().manual_seed(0)
    X = torch.randint(0, 32_000, (256, 16), generator=gen)
    y = torch.randint(0, N_CLASSES, (256,), generator=gen)
    loader = DataLoader(TensorDataset(X, y), batch_size=32)
    la = DiagLaplace(model, "classification")
    floor = partial(forward_plus_10_backward, model, loader)
    case = "fit diag embedding 32,000 x 128, 256 x 16 tokens"
    return {**measure_fit(la, loader, repeats, case, floor), "floor": "1 fwd + 10 bwd"}


TRANSFORMER_CASES = {
    "fit-diag-embedding": (case_fit_diag_embedding, "", ""),
    "fit-kron-llama": (case_fit_transformer, "llama", "expand"),
    "fit-kron-llama-reduce": (case_fit_transformer, "llama", "reduce"),
    "fit-kron-gpt2": (case_fit_transformer, "gpt2", "expand"),
    "predict-kron-llama": (case_predict_transformer, "llama", "expand"),
}
