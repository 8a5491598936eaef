"""Laplace after a Hugging Face ``Trainer`` run: a BERT classifier fine-tuned with LoRA (peft).

Nothing is downloaded: a two-layer BERT is built from a ``BertConfig`` with random weights. The
task is synthetic: does a sequence of random tokens hold more ids from the lower half of the
vocabulary than from the upper half? LoRA adapters (rank 8 on the attention's query and value),
the token embeddings and the classification head are trained by ``transformers.Trainer``; then

1. a KFAC Laplace approximation over the trainable weights (the adapters, the embeddings and the
   head; the frozen base stays at its values), fitted on ``trainer.get_train_dataloader()``;
2. a last-layer KFAC Laplace approximation over the head alone.

Each has its prior precision tuned by the marginal likelihood and is scored with
``laplace.evaluation.evaluate`` on held-out sequences. The only glue is ``HFClassifier``: a module
whose forward takes the batch dict the Trainer's data loader yields and returns the logits.
Writes ``metrics.json`` under ``outputs/hf_trainer_example/`` (or ``--output DIR``) and prints
the folder. About a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from peft import LoraConfig, get_peft_model
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from laplace import Laplace
from laplace.evaluation import evaluate

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "outputs" / "hf_trainer_example"
VOCAB, SEQ_LEN = 1_000, 16


def token_data(n: int, seed: int) -> list[dict[str, Tensor]]:
    """Random token sequences, labelled 1 when most ids lie in the lower half of the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=gen)
    labels = ((ids < VOCAB // 2).sum(1) > SEQ_LEN // 2).long()
    mask = torch.ones(SEQ_LEN, dtype=torch.long)
    return [{"input_ids": i, "attention_mask": mask, "labels": y} for i, y in zip(ids, labels)]


# --8<-- [start:wrapper]
class HFClassifier(nn.Module):
    """A Hugging Face classifier whose forward takes the batch dict and returns logits (B, C)."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf_model = hf_model

    def forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        return self.hf_model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits


# --8<-- [end:wrapper]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--n-train", type=int, default=2048)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=SEQ_LEN,
        num_labels=2,
    )
    # --8<-- [start:trainer]
    lora = LoraConfig(
        r=8, target_modules=["query", "value"], modules_to_save=["classifier", "word_embeddings"]
    )
    model = get_peft_model(BertForSequenceClassification(config), lora)
    with tempfile.TemporaryDirectory() as scratch:
        training = TrainingArguments(
            output_dir=scratch,
            num_train_epochs=args.epochs,
            per_device_train_batch_size=32,
            learning_rate=3e-3,
            weight_decay=1e-2,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training, train_dataset=token_data(args.n_train, 0))
        trainer.train()
        train_loader = trainer.get_train_dataloader()

        classifier = HFClassifier(trainer.model).eval()
        la = Laplace(
            classifier, "classification", subset_of_weights="all", hessian_structure="kron"
        )
        la.fit(train_loader)
        la.optimize_prior_precision(method="marglik")
        head = Laplace(classifier, "classification", subset_of_weights="last_layer")
        head.fit(train_loader)
        head.optimize_prior_precision(method="marglik")
    # --8<-- [end:trainer]

    test_loader = DataLoader(token_data(256, 1), batch_size=64)

    def map_predictive(batch: Mapping[str, Tensor]) -> Tensor:
        with torch.no_grad():
            return classifier(batch).softmax(-1)

    results = {
        "MAP (Trainer + LoRA)": evaluate(map_predictive, test_loader),
        "Laplace, LoRA + head (KFAC)": evaluate(la, test_loader, link_approx="probit"),
        "Laplace, head (last-layer KFAC)": evaluate(head, test_loader, link_approx="probit"),
    }
    summary = {
        name: {m: result[m] for m in ("accuracy", "nll", "ece", "n")}
        for name, result in results.items()
    }
    summary["n_params"] = {"LoRA + head": la.n_params, "head": head.n_params}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "metrics.json").write_text(json.dumps(summary, indent=2))
    print(f"{'predictive':34s} {'acc':>7s} {'NLL':>7s} {'ECE':>7s}")
    for name, m in results.items():
        print(f"{name:34s} {m['accuracy']:7.4f} {m['nll']:7.4f} {m['ece']:7.4f}")
    print(f"metrics written to {args.output}/ (metrics.json)")


if __name__ == "__main__":
    main()
