"""Laplace on a (tiny) Hugging Face language model with dict inputs.

A two-layer GPT-2 is built from ``GPT2Config`` with random weights, so nothing is downloaded, and
wrapped so that its forward takes the dict batches a Hugging Face data loader yields
(``input_ids``, ``attention_mask``, ``labels``). The task is synthetic: classify whether a
sequence of random tokens contains more even than odd token ids. After a short MAP training:

1. last-layer Laplace (``subset_of_weights="last_layer"``) with ``feature_reduction="pick_last"``
   (the features of the last token feed the classification head);
2. a subset of weights chosen with ``requires_grad``: only the head is trainable and
   ``subset_of_weights="all"`` then means "all trainable weights";
3. LoRA adapters made with ``peft`` on the attention weights, the base model frozen, fitted with
   ``AsdlGGN`` (when the ``asdl`` extra is installed; otherwise the default backend).

Each is scored with ``laplace.evaluation.evaluate`` (accuracy, NLL, ECE, mean confidence) and
drawn as a reliability diagram. Writes ``metrics.json`` and ``reliability.png`` under
``outputs/huggingface_example/`` (or ``--output DIR``) and prints the folder.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import MutableMapping
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import matplotlib.pyplot as plt
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2ForSequenceClassification

from laplace import Laplace
from laplace.curvature import CURVATURE_BACKENDS
from laplace.evaluation import evaluate, plot_reliability_diagram

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "outputs" / "huggingface_example"
VOCAB, SEQ_LEN, PAD = 64, 12, 0


class MyGPT2(nn.Module):
    """GPT-2 sequence classifier whose forward takes a dict batch and returns logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ_LEN,
            n_embd=32,
            n_layer=2,
            n_head=2,
            num_labels=2,
            pad_token_id=PAD,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.hf_model = GPT2ForSequenceClassification(config)

    def forward(self, data: MutableMapping) -> torch.Tensor:
        device = next(self.parameters()).device
        out = self.hf_model(
            input_ids=data["input_ids"].to(device),
            attention_mask=data["attention_mask"].to(device),
        )
        return out.logits


def toy_dataset(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Random token sequences (no padding); label 1 if even ids outnumber odd ones."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=gen)
    labels = ((ids % 2 == 0).sum(-1) > SEQ_LEN // 2).long()
    return [
        {"input_ids": i, "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long), "labels": y}
        for i, y in zip(ids, labels)
    ]


def train(model: nn.Module, loader: DataLoader, n_epochs: int) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=3e-3)
    model.train()
    for _ in range(n_epochs):
        for batch in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(batch), batch["labels"]).backward()
            optimizer.step()
    model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    train_loader = DataLoader(toy_dataset(512, 0), batch_size=32, shuffle=True)
    fit_loader = DataLoader(toy_dataset(512, 0), batch_size=64)
    test_loader = DataLoader(toy_dataset(256, 1), batch_size=64)
    results, seconds = {}, {}

    model = MyGPT2()
    train(model, train_loader, args.epochs)
    results["MAP"] = evaluate(lambda b: model(b).softmax(-1), test_loader)

    # 1. Last-layer Laplace; the head sees the features of the last token.
    start = time.perf_counter()
    la = Laplace(
        model,
        "classification",
        subset_of_weights="last_layer",
        hessian_structure="full",
        feature_reduction="pick_last",
    )
    la.fit(fit_loader)
    la.optimize_prior_precision(method="marglik")
    seconds["LA last-layer"] = time.perf_counter() - start
    results["LA last-layer"] = evaluate(la, test_loader)

    # 2. Subset of weights by requires_grad: only the classification head.
    for p in model.hf_model.parameters():
        p.requires_grad_(False)
    for p in model.hf_model.score.parameters():
        p.requires_grad_(True)
    start = time.perf_counter()
    la_subset = Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag")
    la_subset.fit(fit_loader)
    la_subset.optimize_prior_precision(method="marglik")
    seconds["LA head via requires_grad"] = time.perf_counter() - start
    name = "LA head via requires_grad"
    results[name] = evaluate(la_subset, test_loader)

    # 3. LoRA adapters on the attention weights; the base model is frozen by peft.
    base = MyGPT2()
    config = LoraConfig(
        r=4, lora_alpha=16, target_modules=["c_attn"], bias="none", fan_in_fan_out=True
    )
    lora_model = get_peft_model(base, config)
    train(lora_model, train_loader, args.epochs)
    results["LoRA MAP"] = evaluate(lambda b: lora_model(b).softmax(-1), test_loader)
    backend_name = "asdl_ggn" if "asdl_ggn" in CURVATURE_BACKENDS else "curvlinops_ggn"
    backend = CURVATURE_BACKENDS[backend_name]
    start = time.perf_counter()
    lora_la = Laplace(
        lora_model,
        "classification",
        subset_of_weights="all",
        hessian_structure="kron",
        backend=backend,
    )
    lora_la.fit(fit_loader)
    lora_la.optimize_prior_precision(method="marglik")
    seconds["LA LoRA"] = time.perf_counter() - start
    results["LA LoRA"] = evaluate(lora_la, test_loader)

    n_params = {
        "LA last-layer": la.n_params,
        "LA head via requires_grad": la_subset.n_params,
        "LA LoRA": lora_la.n_params,
    }
    summary = {
        "results": results,
        "n_params": n_params,
        "seconds": seconds,
        "lora_backend": backend_name,
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "metrics.json").write_text(json.dumps(summary, indent=2))
    fig, axes = plt.subplots(
        2, len(results), figsize=(2.9 * len(results), 4.4), gridspec_kw={"height_ratios": (3, 1)}
    )
    for col, (name, result) in enumerate(results.items()):
        plot_reliability_diagram(result, axes[0, col], axes[1, col], title=name)
    fig.tight_layout()
    fig.savefig(args.output / "reliability.png", dpi=110)

    print("Tiny GPT-2 (2 layers, random init), synthetic parity-count task:")
    header = f"  {'method':28s} {'acc':>7s} {'NLL':>7s} {'ECE':>7s} {'conf':>7s} {'weights':>8s}"
    print(header)
    for name, m in results.items():
        p = n_params.get(name, "")
        print(
            f"  {name:28s} {m['accuracy']:7.4f} {m['nll']:7.4f} {m['ece']:7.4f} "
            f"{m['confidence']:7.4f} {p!s:>8s}"
        )
    print(f"LoRA Laplace backend: {backend_name}")
    print(f"figures and metrics written to {args.output}/ (reliability.png, metrics.json)")


if __name__ == "__main__":
    main()
