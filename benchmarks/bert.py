"""All-weights Kron and diag fits of a BERT and of an LSTM classifier, against their floor.

BERT: a 4-layer ``BertForSequenceClassification`` of hidden size 256 (4 heads, MLP 1,024,
BERT's 30,522-token vocabulary, eager attention) built from a config (no download), two
classes, on ``N_SEQUENCES`` = 2,048 random sequences of 64 tokens in Hugging Face dict batches
(``input_ids``, ``attention_mask``, ``labels``) of 32 sequences. Every parameter is in the
posterior, the learned position embeddings included (trainable, as in a fine-tuned BERT: their
lookup is shared by the batch, so their per-sample curvature is not the usual per-example
gradient); ``fit-kron-bert-frozen-positions`` freezes them, for reference. The ``-bf16`` cases
run the same model converted with ``model.to(torch.bfloat16)`` (the curvature is accumulated in
float32), their floor in bfloat16 too; on a CPU they run ``BF16_CPU_SEQUENCES`` = 64 sequences,
as CPUs without bfloat16 instructions emulate its products (10× the float32 time on the 2-core
reference machine), on a GPU (``--device cuda``) all 2,048.

LSTM: an embedding (vocabulary 1,000, width 64), a 2-layer ``nn.LSTM`` of hidden size 128
(batch first) and a linear head on the last hidden state, 10 classes, 1,024 sequences of 32
tokens in batches of 64: all-weights diag and Kron (the LSTM's weights have no Kronecker
factorisation: exact blocks where they are small enough, diagonal above the dense limit).

Each fit is timed against the harness's floor, one forward and ``C`` backward passes over the
same data (``C`` the number of classes: the cost of any curvature that needs each output's
gradient); the goal is at most 1.5× the floor. A BERT floor is about a minute on 2 CPU cores,
so the BERT cases time one floor/fit pair (``MAX_BERT_REPEATS``) and take the peak memory of
that fit; the LSTM cases follow ``--repeats``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import partial

import harness
import torch
from harness import PeakRSS, against_floor, measure_fit
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

#: BERT: sequences, tokens per sequence, classes, sequences per batch, one floor/fit pair.
N_SEQUENCES, SEQ_LEN, BERT_CLASSES, BERT_BATCH, MAX_BERT_REPEATS = 2048, 64, 2, 32, 1
#: Sequences of the bfloat16 cases on a CPU (bfloat16 products are emulated there).
BF16_CPU_SEQUENCES = 64
BERT_WIDTH, BERT_LAYERS, BERT_HEADS, BERT_VOCAB = 256, 4, 4, 30_522
#: LSTM: sequences, tokens, vocabulary, embedding width, hidden size, layers, classes, batch.
LSTM_SEQUENCES, LSTM_TOKENS, LSTM_VOCAB, LSTM_EMBED, LSTM_HIDDEN = 1024, 32, 1000, 64, 128
LSTM_LAYERS, LSTM_CLASSES, LSTM_BATCH = 2, 10, 64


class BertClassifier(nn.Module):
    """``BertForSequenceClassification`` taking the batch dict, returning logits (B, C)."""

    def __init__(self, trainable_positions: bool = True) -> None:
        super().__init__()
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=BERT_VOCAB,
            hidden_size=BERT_WIDTH,
            num_hidden_layers=BERT_LAYERS,
            num_attention_heads=BERT_HEADS,
            intermediate_size=4 * BERT_WIDTH,
            max_position_embeddings=SEQ_LEN,
            num_labels=BERT_CLASSES,
            attn_implementation="eager",
        )
        self.bert = BertForSequenceClassification(config)
        positions = self.bert.bert.embeddings.position_embeddings.weight
        positions.requires_grad_(trainable_positions)

    def forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        return self.bert(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits


class RecurrentClassifier(nn.Module):
    """Embedding, a multi-layer LSTM (or GRU) and a linear head on the last hidden state."""

    def __init__(self, cell: type[nn.RNNBase] = nn.LSTM) -> None:
        super().__init__()
        self.embed = nn.Embedding(LSTM_VOCAB, LSTM_EMBED)
        self.rnn = cell(LSTM_EMBED, LSTM_HIDDEN, num_layers=LSTM_LAYERS, batch_first=True)
        self.head = nn.Linear(LSTM_HIDDEN, LSTM_CLASSES)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(hidden[:, -1])


RECURRENT_CELLS = {"lstm": nn.LSTM, "gru": nn.GRU}


def recurrent_loader() -> DataLoader:
    """``LSTM_SEQUENCES`` random token sequences of ``LSTM_TOKENS`` with class targets."""
    gen = torch.Generator().manual_seed(0)
    X = torch.randint(0, LSTM_VOCAB, (LSTM_SEQUENCES, LSTM_TOKENS), generator=gen)
    y = torch.randint(0, LSTM_CLASSES, (LSTM_SEQUENCES,), generator=gen)
    X, y = X.to(harness.DEVICE), y.to(harness.DEVICE)
    return DataLoader(TensorDataset(X, y), batch_size=LSTM_BATCH)


def bert_loader(n: int = N_SEQUENCES, seed: int = 0) -> DataLoader:
    """``n`` random dict examples of ``SEQ_LEN`` tokens; half end in a quarter of padding."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, BERT_VOCAB, (n, SEQ_LEN), generator=gen)
    mask = torch.ones(n, SEQ_LEN, dtype=torch.long)
    mask[: n // 2, -SEQ_LEN // 4 :] = 0
    labels = torch.randint(0, BERT_CLASSES, (n,), generator=gen)
    ids, mask, labels = (t.to(harness.DEVICE) for t in (ids, mask, labels))
    examples = [
        {"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels)
    ]
    return DataLoader(examples, batch_size=BERT_BATCH)


def forward_plus_c_backward(model: nn.Module, loader: DataLoader, n_classes: int) -> None:
    """The floor: one forward and one backward pass per class over ``loader``."""
    params = [p for p in model.parameters() if p.requires_grad]
    for batch in loader:
        f = model(batch[0] if isinstance(batch, list | tuple) else batch)
        for c in range(n_classes):
            torch.autograd.grad(f[:, c].sum(), params, retain_graph=c < n_classes - 1)


def case_fit_bert(structure: str, variant: str, repeats: int) -> dict:
    """All-weights ``structure`` fit of the BERT (``variant``: "", "bf16", "frozen-positions")."""
    from laplace import Laplace

    torch.manual_seed(0)
    model = BertClassifier(trainable_positions=variant != "frozen-positions").eval()
    model = model.to(harness.DEVICE)
    n = N_SEQUENCES
    if variant == "bf16":
        model = model.to(torch.bfloat16)
        n = BF16_CPU_SEQUENCES if harness.DEVICE.type == "cpu" else N_SEQUENCES
    loader = bert_loader(n)
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure)
    floor = partial(forward_plus_c_backward, model, loader, BERT_CLASSES)
    with PeakRSS() as mem:
        times = against_floor(partial(la.fit, loader), floor, min(repeats, MAX_BERT_REPEATS))
    label = f" {variant}" if variant else ""
    return {
        "case": f"fit {structure} BERT-4x256{label} {n}x{SEQ_LEN} tokens",
        "n_params": la.n_params,
        **times,
        "peak_extra_MB": mem.extra / 2**20,
        "floor": f"1 fwd + {BERT_CLASSES} bwd",
    }


def case_fit_recurrent(structure: str, cell: str, repeats: int) -> dict:
    """All-weights ``structure`` fit of the recurrent classifier with ``cell`` (lstm, gru)."""
    from laplace import Laplace

    torch.manual_seed(0)
    model = RecurrentClassifier(RECURRENT_CELLS[cell]).eval().to(harness.DEVICE)
    loader = recurrent_loader()
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure)
    floor = partial(forward_plus_c_backward, model, loader, LSTM_CLASSES)
    name = cell.upper()
    case = f"fit {structure} {name} 2x{LSTM_HIDDEN} {LSTM_SEQUENCES}x{LSTM_TOKENS} tokens"
    return {
        **measure_fit(la, loader, repeats, case, floor),
        "floor": f"1 fwd + {LSTM_CLASSES} bwd",
    }


def case_guard_overhead_bert(structure: str, model_name: str, repeats: int) -> dict:
    """The attribution guard's share of an all-weights fit of the BERT or the LSTM (``lstm``)."""
    from laplace import Laplace

    torch.manual_seed(0)
    if model_name == "bert":
        model, loader = BertClassifier().eval().to(harness.DEVICE), bert_loader()
    else:
        model = RecurrentClassifier(RECURRENT_CELLS[model_name]).eval().to(harness.DEVICE)
        loader = recurrent_loader()
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure)
    row = harness.guard_overhead(la, loader, min(repeats, 3 if model_name == "lstm" else 1))
    return {"case": f"guard overhead {structure} {model_name}", **row}


#: name: (function, structure, variant), the calling convention of ``run.py``'s cases.
BERT_CASES = {
    "fit-kron-bert": (case_fit_bert, "kron", ""),
    "fit-diag-bert": (case_fit_bert, "diag", ""),
    "fit-kron-bert-frozen-positions": (case_fit_bert, "kron", "frozen-positions"),
    "fit-kron-bert-bf16": (case_fit_bert, "kron", "bf16"),
    "fit-diag-bert-bf16": (case_fit_bert, "diag", "bf16"),
    "fit-diag-lstm": (case_fit_recurrent, "diag", "lstm"),
    "fit-kron-lstm": (case_fit_recurrent, "kron", "lstm"),
    "fit-diag-gru": (case_fit_recurrent, "diag", "gru"),
    "fit-kron-gru": (case_fit_recurrent, "kron", "gru"),
    "guard-overhead-kron-bert": (case_guard_overhead_bert, "kron", "bert"),
    "guard-overhead-diag-lstm": (case_guard_overhead_bert, "diag", "lstm"),
    "guard-overhead-kron-lstm": (case_guard_overhead_bert, "kron", "lstm"),
}
