"""Real sizes (``run.py --large``): a 1.1B-parameter Llama with LoRA, fits against their floor.

The model is TinyLlama-1.1B's architecture built from a ``LlamaConfig`` (no download, random
weights, eval mode): 22 layers of width 2,048 (32 query heads, 4 key-value heads, MLP 5,632),
a 32,000-token vocabulary, untied embedding and output layer, 1,100,048,384 weights. LoRA
adapters (peft, rank 8, on ``q_proj`` and ``v_proj``) are added; only they require gradients.
The data are ``N_SEQUENCES`` = 8 sequences of ``SEQ_LEN`` = 128 random token ids, in batches
of ``BATCH_SEQUENCES`` sequences, with next-token labels (−100 at the last position).

The model follows laplace-ng's recipe for language models (``docs/tutorials/llm_lora.md``):
its forward returns next-token logits (B, T, C) for labels (B, T), every token one output over
the 32,000-token vocabulary.

- ``fit-lora-kron-llama-1b``: ``KronLaplace`` over the LoRA weights (88 matrices, 1.1M weights)
  with the Monte-Carlo Fisher (``backend_kwargs={"stochastic": True}``: one sampled label per
  token, as the exact GGN would need 32,000 backward passes per token). Its floor is what that
  fit needs at least, ``1 fwd + 1 bwd``: one forward pass and one backward pass of the sampled
  labels' loss to the LoRA weights, per batch. Then the first ``pred_type="nn"`` predictive of
  ``N_TEST_SEQUENCES`` sequences (``N_PREDICTIVE_SAMPLES`` weight samples, one forward pass
  each), the one-off eigendecomposition of the factors included; the GLM predictive would need
  32,000 Jacobian rows per token and is refused at this vocabulary (``docs/large_outputs.md``).
- ``fit-ll-llama-1b``: last-layer ``KronLaplace`` of the 32,000 × 2,048 output layer (65.5M
  weights, made trainable, as when it is fine-tuned with the adapters; a frozen head gives the
  same posterior): its
  input factor dense (2,048²), its vocabulary-side factor the exact ``diag(Σ p) − P Pᵀ`` of the
  softmax GGN kept as a diagonal plus a rank-32 part. A diagonal posterior over the head is
  possible too (65.5M numbers), a full one is not (65.5M² numbers). Floor: ``1 fwd`` (no
  gradient). Then the first GLM probit predictive of ``N_TEST_SEQUENCES`` sequences, in closed
  form (per token the variances (C,) only).

Each case reports the fit's median time over the repeats against the floor measured in the same
process (alternating, as ``harness.against_floor``), the peak resident memory of the first fit
above the level after building the model and the data (``harness.PeakRSS``), that peak as a
share of the model's own weights (``weights_MB``: every parameter, the frozen base included),
and the library's estimate of the fitted state (``_fit_bytes``, from shapes alone). The
predictive's peak is above the level after the fits, whose freed memory the process keeps. A
floor and a fit of the 1.1B model take minutes on 2 CPU cores, so the cases time at most
``MAX_REPEATS`` floor/fit pairs.

bfloat16: the ``-bf16`` variants convert the frozen base to bfloat16 (the LoRA weights and the
curvature stay float32). The cases run on the CPU, the bfloat16 ones only where it has native
bfloat16 products (``avx512_bf16`` or ``amx_bf16``); elsewhere their row says so and times
nothing, as emulated bfloat16 products cost 7–10× float32's (``docs/performance.md``).

Usage: ``python benchmarks/large_llm.py [--size 1b|tiny] [--cases NAME ...] [--repeats R]``
(``tiny``: 2 layers of width 64, vocabulary 4,096, for checking the cases in seconds: above
``LARGE_OUTPUT_THRESHOLD``, so the head takes the path of the 32,000-token one).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from functools import partial

import torch
from harness import PeakRSS, against_floor, forward_pass, timed
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

#: Fitting data (sequences, tokens, sequences per batch) and the predictive's.
N_SEQUENCES, SEQ_LEN, BATCH_SEQUENCES, N_TEST_SEQUENCES = 8, 128, 2, 2
#: LoRA rank and the projections it adapts; weight samples of the NN predictive.
LORA_RANK, LORA_TARGETS, N_PREDICTIVE_SAMPLES = 8, ("q_proj", "v_proj"), 2
#: Floor/fit pairs timed at most (a 1.1B fit takes minutes on 2 CPU cores).
MAX_REPEATS = 1
IGNORE_INDEX = -100

#: Llama shapes: TinyLlama-1.1B, and a tiny one for checking the cases quickly.
LLAMA_SIZES = {
    "1b": {
        "vocab_size": 32_000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
    },
    "tiny": {
        "vocab_size": 4096,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}


class CausalLM(nn.Module):
    """A Llama language model mapping token ids (B, T) to next-token logits (B, T, C)."""

    def __init__(self, size: str) -> None:
        super().__init__()
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            **LLAMA_SIZES[size], max_position_embeddings=SEQ_LEN, tie_word_embeddings=False
        )
        self.lm = LlamaForCausalLM(config)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.lm(input_ids=input_ids).logits


def lora_llama(size: str, dtype: torch.dtype, trainable_head: bool) -> nn.Module:
    """The Llama of ``size`` in ``dtype`` with float32 LoRA adapters, in eval mode.

    The adapters require gradients, and the output layer too if ``trainable_head`` (as after
    fine-tuning it with them); the rest of the base is frozen.
    """
    from peft import LoraConfig, get_peft_model

    base = CausalLM(size).to(dtype)
    config = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=list(LORA_TARGETS))
    model = get_peft_model(base, config)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.float()
    model.base_model.model.lm.lm_head.requires_grad_(trainable_head)
    return model.eval()


def token_loader(vocab_size: int, n_sequences: int, seed: int) -> DataLoader:
    """Random token ids (n, T) and their next tokens (n, T), −100 at the last position."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n_sequences, SEQ_LEN), generator=generator)
    labels = torch.cat([ids[:, 1:], torch.full((n_sequences, 1), IGNORE_INDEX)], 1)
    return DataLoader(TensorDataset(ids, labels), batch_size=BATCH_SEQUENCES)


def forward_plus_sampled_backward(model: nn.Module, loader: DataLoader) -> None:
    """One forward pass and one backward pass of sampled labels' loss to the trainable weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    for X, _ in loader:
        logits = model(X).float()
        with torch.no_grad():
            sampled = torch.distributions.Categorical(logits=logits).sample()
        loss = nn.functional.cross_entropy(
            logits.flatten(0, 1), sampled.flatten(), reduction="sum"
        )
        torch.autograd.grad(loss, params)


def native_bfloat16() -> bool:
    """Whether this machine's CPU, where the cases run, multiplies bfloat16 natively."""
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def weights_bytes(model: nn.Module) -> int:
    """Bytes of every parameter of ``model``, the frozen ones included."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def case_fit_llama(subset: str, size: str, dtype_name: str, repeats: int) -> dict:
    """A Kron fit over ``subset`` of the LoRA Llama against its floor, then a predictive.

    Args:
        subset: ``"all"`` (the LoRA weights, Monte-Carlo Fisher) or ``"last_layer"`` (the head).
        size: A key of ``LLAMA_SIZES``.
        dtype_name: The base model's type, ``"float32"`` or ``"bfloat16"``.
        repeats: Floor/fit pairs to time (at most ``MAX_REPEATS``).

    Returns:
        The row of ``run.py``: times, ratio, peak memory and its share of the weights, the
        library's estimate, the predictive's time and peak memory.
    """
    from laplace import Laplace

    what = "LoRA Kron (MC Fisher)" if subset == "all" else "last-layer Kron"
    case = f"fit {what} llama-{size} {dtype_name} {N_SEQUENCES}x{SEQ_LEN} tokens"
    if dtype_name == "bfloat16" and not native_bfloat16():
        note = "skipped: this CPU has no native bfloat16 (no avx512_bf16 or amx_bf16)"
        return {"case": case, "seconds": 0.0, "peak_extra_MB": 0.0, "note": note}
    model = lora_llama(size, getattr(torch, dtype_name), trainable_head=subset == "last_layer")
    vocab_size = LLAMA_SIZES[size]["vocab_size"]
    loader = token_loader(vocab_size, N_SEQUENCES, 0)
    X_test = next(iter(token_loader(vocab_size, N_TEST_SEQUENCES, 1)))[0]
    if subset == "last_layer":
        la = Laplace(model, "classification", "last_layer", "kron")
        floor: Callable[[], None] = partial(forward_pass, model, loader)
        floor_name = "1 fwd"
        predict = {"pred_type": "glm", "link_approx": "probit"}
    else:
        la = Laplace(
            model,
            "classification",
            subset_of_weights="all",
            hessian_structure="kron",
            backend_kwargs={"stochastic": True},
        )
        floor = partial(forward_plus_sampled_backward, model, loader)
        floor_name = "1 fwd + 1 bwd"
        predict = {"pred_type": "nn", "link_approx": "mc", "n_samples": N_PREDICTIVE_SAMPLES}
    weights = weights_bytes(model)
    with PeakRSS() as fit_memory:
        la.fit(loader)
    times = against_floor(partial(la.fit, loader), floor, min(repeats, MAX_REPEATS))
    with PeakRSS() as predict_memory:
        predict_seconds = timed(lambda: la(X_test, **predict), 1)
    return {
        "case": case,
        "n_params": la.n_params,
        "model_params": sum(p.numel() for p in model.parameters()),
        **times,
        "floor": floor_name,
        "peak_extra_MB": fit_memory.extra / 2**20,
        "weights_MB": weights / 2**20,
        "peak_share_of_weights": fit_memory.extra / weights,
        "estimate_MB": la._fit_bytes() / 2**20,
        "predict": f"{predict['pred_type']} {predict['link_approx']}",
        "predict_s": predict_seconds,
        "predict_peak_extra_MB": predict_memory.extra / 2**20,
        "note": f"peak {fit_memory.extra / weights:.0%} of the weights "
        f"({weights / 2**30:.2f} GiB), estimate {la._fit_bytes() / 2**20:.0f} MB; "
        f"{predict['pred_type']} predictive of "
        f"{N_TEST_SEQUENCES} sequences {predict_seconds:.1f} s, "
        f"peak +{predict_memory.extra / 2**20:.0f} MB",
    }


#: ``run.py --large`` cases: name → (function, size, base model type), as ``run.CASES``.
LARGE_LLM_CASES = {
    "fit-lora-kron-llama-1b": (partial(case_fit_llama, "all"), "1b", "float32"),
    "fit-ll-llama-1b": (partial(case_fit_llama, "last_layer"), "1b", "float32"),
    "fit-lora-kron-llama-1b-bf16": (partial(case_fit_llama, "all"), "1b", "bfloat16"),
    "fit-ll-llama-1b-bf16": (partial(case_fit_llama, "last_layer"), "1b", "bfloat16"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(LLAMA_SIZES), default="1b")
    parser.add_argument("--cases", nargs="*", default=list(LARGE_LLM_CASES))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.cases:
        fn, _, dtype_name = LARGE_LLM_CASES[name]
        print(json.dumps(fn(args.size, dtype_name, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
