"""``evaluate``: calibration metrics of a Laplace predictive, or of any predictive, on a loader.

One pass over the data, batch by batch on the model's device: each batch's predictions update
the running metrics of the likelihood's evaluation (``LikelihoodModel.evaluation``) and are then
dropped, so memory does not grow with the data beyond what torchmetrics' calibration error and
the out-of-distribution scores keep (one or two numbers per point). ``ood_metrics`` turns the
entropies of in- and out-of-distribution points into AUROC, AUPR, FPR95 and a histogram.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, MutableMapping, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchmetrics import Metric
from torchmetrics.functional.classification import (
    binary_auroc,
    binary_average_precision,
    binary_roc,
)
from torchmetrics.utilities import dim_zero_cat
from typing_extensions import Unpack

from laplace.core.passes.data_loop import progress
from laplace.likelihoods import LikelihoodModel, make_likelihood
from laplace.likelihoods.likelihood_model import Prediction
from laplace.likelihoods.protocol import Likelihood as UserLikelihood
from laplace.likelihoods.scoring import (
    N_BINS,
    Evaluation,
    EvaluationOptions,
    MetricOptions,
    Metrics,
    to_plain,
)
from laplace.utils import distributed as distributed_utils
from laplace.utils.data import Inputs, move_inputs, split_batch
from laplace.utils.enums import Likelihood
from laplace.utils.errors import check_positive_int
from laplace.utils.outputs import IGNORE_INDEX

__all__ = [
    "ENTROPY_BINS",
    "FPR95_TPR",
    "Metrics",
    "evaluate",
    "model_device",
    "ood_metrics",
    "predict_detached",
]

#: Equal-width bins of ``entropy_histogram``.
ENTROPY_BINS = 20
#: The share of out-of-distribution points flagged at the threshold of ``ood_fpr95``.
FPR95_TPR = 0.95


def model_device(predictive: Callable) -> torch.device | None:
    """Device of the parameters of ``predictive.model`` (or of ``predictive`` if a module)."""
    model = getattr(predictive, "model", predictive)
    param = next(model.parameters(), None) if isinstance(model, nn.Module) else None
    return None if param is None else param.device


def _check_options(n_bins: object, coverage_levels: Sequence[float], kwargs: dict) -> None:
    check_positive_int(n_bins, "n_bins")
    levels = list(coverage_levels)
    if not levels or not all(isinstance(lv, numbers.Real) and 0 < lv < 1 for lv in levels):
        raise ValueError(
            f"coverage_levels must be numbers strictly between 0 and 1, got {coverage_levels!r}."
        )
    if kwargs.get("joint", False):
        raise ValueError(
            "evaluate scores each point's marginal predictive; joint=True is not supported."
        )


def _inputs(batch: object, dict_key_x: str, dict_key_y: str) -> Inputs:
    """Model inputs of a batch that may lack targets (out-of-distribution loaders)."""
    if isinstance(batch, (Tensor, MutableMapping)):
        return batch
    if isinstance(batch, (tuple, list)) and len(batch) == 1:  # TensorDataset of inputs only
        return batch[0]
    return split_batch(batch, dict_key_x, dict_key_y)[0]


def predict_detached(
    la: Callable[..., Prediction], X: Inputs, device: torch.device | None, kwargs: dict
) -> Prediction:
    """``la(X, **kwargs)`` on the model's device, without the autograd graph of its output."""
    out = la(X if device is None else move_inputs(X, device), **kwargs)
    return tuple(item.detach() for item in out) if isinstance(out, tuple) else out.detach()


def _ranking_scores(entropy: Tensor) -> Tensor:
    """Entropies mapped monotonically into (0, 1) in float64, the scores the ranking metrics take.

    torchmetrics' ranking metrics pass scores outside [0, 1] through a sigmoid, which rounds large
    entropies to 1 and so ties them; this map keeps their order.
    """
    entropy = entropy.to(torch.float64)
    return 0.5 + 0.5 * entropy / (1 + entropy.abs())


def _entropy_histogram(in_scores: Tensor, out_scores: Tensor, n_bins: int) -> dict[str, list]:
    """Counts (ints) of both sets over ``n_bins`` equal-width bins spanning all scores' range."""
    scores = torch.cat([in_scores, out_scores]).to(torch.float64)
    low, high = scores.min(), scores.max()
    if low == high:  # one value: a bin of width 1 around it
        low, high = low - 0.5, high + 0.5
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64, device=scores.device)
    edges = low + (high - low) * edges

    def counts(values: Tensor) -> list[int]:
        position = (values.to(torch.float64) - low) / (high - low) * n_bins
        return torch.bincount(position.long().clamp(0, n_bins - 1), minlength=n_bins).tolist()

    return {"edges": edges.tolist(), "in": counts(in_scores), "out": counts(out_scores)}


def ood_metrics(
    in_scores: Tensor, out_scores: Tensor, n_bins: int = ENTROPY_BINS
) -> dict[str, object]:
    r"""How well a score (e.g. the predictive entropy) tells out-of-distribution points apart.

    Out-of-distribution points are the positives, and a higher score flags a point as such.
    The ranking metrics are torchmetrics' (``binary_auroc``, ``binary_average_precision``,
    ``binary_roc``) on the scores mapped monotonically into (0, 1), so that no sigmoid ties
    large scores: ties count half in the AUROC, and each distinct score is one threshold.

    - ``ood_auroc``: the probability that a random out-of-distribution point scores higher
      than a random in-distribution one (ties ½); 0.5 is chance, 1 a perfect separation.
    - ``ood_aupr``: average precision ``Σ_k (R_k − R_{k−1}) P_k`` over the thresholds, the
      area under the precision-recall curve of the out-of-distribution points; chance is their
      share of all points.
    - ``ood_fpr95``: with ``t`` the highest threshold that flags at least 95% of the
      out-of-distribution points (score ≥ ``t``), the fraction of in-distribution points with
      score ≥ ``t``; 0 is a perfect separation.
    - ``entropy_histogram``: ``{"edges": (n_bins + 1,), "in": (n_bins,), "out": (n_bins,)}``,
      the counts of each set over equal-width bins spanning the observed range of all scores
      (for class probabilities it lies in [0, log C]); each bin holds ``[edge_k, edge_{k+1})``,
      the last also its right edge.

    Args:
        in_scores: Scores of the in-distribution points, shape (N,).
        out_scores: Scores of the out-of-distribution points, shape (M,).
        n_bins: Number of bins of the histogram.

    Returns:
        The four entries above as Python floats, ints and lists (JSON-serialisable).

    Raises:
        ValueError: If a set of scores is empty, not one-dimensional or not finite, or
            ``n_bins`` is not a positive integer.
    """
    check_positive_int(n_bins, "n_bins")
    for name, scores in (("in_scores", in_scores), ("out_scores", out_scores)):
        if scores.dim() != 1 or not scores.numel():
            raise ValueError(
                f"{name} must be a non-empty tensor of shape (N,), got "
                f"shape {tuple(scores.shape)}."
            )
        if not bool(torch.isfinite(scores).all()):
            raise ValueError(f"{name} must be finite; it holds NaN or infinite scores.")
    out_scores = out_scores.to(in_scores.device)
    ranking = _ranking_scores(torch.cat([in_scores, out_scores]))
    is_out = torch.cat([torch.zeros_like(in_scores), torch.ones_like(out_scores)]).long()
    _, tpr, thresholds = binary_roc(ranking, is_out)
    # the first ROC point (highest threshold) that flags FPR95_TPR of the OOD points, compared
    # in counts: torchmetrics' rates are float32, and 0.95·M may round to just above an integer
    flagged = (tpr.to(torch.float64) * len(out_scores)).round()
    needed = math.ceil(round(FPR95_TPR * len(out_scores), 9))
    threshold = thresholds[int(torch.nonzero(flagged >= needed)[0, 0])]
    in_flagged = ranking[: len(in_scores)] >= threshold
    rates = {
        "ood_auroc": binary_auroc(ranking, is_out),
        "ood_aupr": binary_average_precision(ranking, is_out),
        "ood_fpr95": in_flagged.to(torch.float64).mean(),
    }
    histogram = _entropy_histogram(in_scores, out_scores, n_bins)
    return {**to_plain(rates), "entropy_histogram": histogram}


class _OODScores(Metric):
    """The scores of in- and out-of-distribution points, gathered across processes."""

    is_differentiable = False
    full_state_update = False
    in_scores: list[Tensor]
    out_scores: list[Tensor]

    def __init__(self, **kwargs: Unpack[MetricOptions]) -> None:
        super().__init__(**kwargs)
        self.add_state("in_scores", default=[], dist_reduce_fx="cat")
        self.add_state("out_scores", default=[], dist_reduce_fx="cat")

    def update(self, scores: Tensor, ood: bool) -> None:
        """Add the scores (B,) of a batch of in- (``ood=False``) or out-of-distribution points."""
        (self.out_scores if ood else self.in_scores).append(scores.detach().to(torch.float64))

    def compute(self) -> dict[str, object]:
        """``ood_metrics`` of all scores."""
        return ood_metrics(dim_zero_cat(self.in_scores), dim_zero_cat(self.out_scores))


def evaluate(
    la: Callable[..., Prediction],
    loader: DataLoader,
    *,
    ood_loader: DataLoader | None = None,
    likelihood: str | None = None,
    n_bins: int = N_BINS,
    coverage_levels: Sequence[float] = (0.5, 0.9, 0.95),
    sigma_noise: float | Tensor | None = None,
    dict_key_x: str | None = None,
    dict_key_y: str | None = None,
    class_dim: int | None = None,
    ignore_index: int | None = None,
    distributed: bool | None = None,
    progress_bar: bool = False,
    **predictive_kwargs: object,
) -> Metrics:
    r"""Calibration metrics of a predictive on ``loader``, in one batched pass.

    ``la(X, **predictive_kwargs)`` is called on each batch's inputs (moved to the device of
    ``la.model``); it returns class probabilities (B, C) for classification or a Gaussian
    ``(f_mu (B, C), f_var (B, C, C) or (B, C))`` for regression, as a fitted Laplace
    approximation does; or the same with extra output dimensions (probabilities (B, C, d₁, …)
    or (B, T, C) for labels (B, d₁, …) / (B, T), a Gaussian with means and variances
    (B, d₁, …)). Every callable that returns the same works, e.g.
    ``lambda x: model(x).softmax(-1)`` for the MAP network. The predictive runs in the
    caller's autograd mode (wrap a plain network's call in ``torch.no_grad`` to save its
    graph) and its outputs are detached.

    The result's keys per likelihood (``accuracy``, ``nll``, ``ece``, ... for classification;
    ``nll``, ``rmse``, ``crps``, ``coverage``, ... for regression) are listed in
    ``docs/evaluation.md`` and defined by each likelihood's ``evaluation``. With ``ood_loader``,
    the predictive entropy of each point scores how out-of-distribution it is: ``ood_auroc``,
    ``ood_aupr``, ``ood_fpr95`` and ``entropy_histogram`` (see ``ood_metrics``) tell the
    points of ``ood_loader`` (positives) from those of ``loader``.

    Args:
        la: A fitted Laplace approximation or any callable returning predictions.
        loader: ``(X, y)`` pairs or dict-like batches.
        ood_loader: Out-of-distribution inputs: ``(X, y)`` pairs, ``X`` alone (a tensor or a
            1-tuple) or dict batches.
        likelihood: ``"classification"``, ``"regression"`` or another built-in likelihood
            name: the predictive of its likelihood object is evaluated
            (``LikelihoodModel.evaluation``); default ``la.likelihood``, else inferred from the
            predictions (a pair: regression, a tensor: classification).
        n_bins: Calibration bins (classification) or points of the PIT curve (regression).
        coverage_levels: Levels of the central predictive intervals (regression).
        sigma_noise: Observation noise σ of regression, scored as ``N(f_mu, f_var + σ²I)``;
            default ``la.sigma_noise`` or 0.
        dict_key_x: Key of the inputs in dict batches; default ``la.dict_key_x``.
        dict_key_y: Key of the targets in dict batches; default ``la.dict_key_y``.
        class_dim: Classification predictions with extra dimensions, (B, C, d₁, …) or
            (B, T, C): the class dimension; default ``la.class_dim``, else the dimension the
            targets lack. Such predictions are scored position by position.
        ignore_index: Label of the positions (or points) left out; default
            ``la.ignore_index``, else -100 (as ``CrossEntropyLoss``).
        distributed: Add the metrics over the processes of ``torch.distributed``, each
            evaluating its shard of the data; None: when the process group is initialised and
            the loader uses a ``DistributedSampler`` (see ``laplace.utils.distributed``).
        progress_bar: Show a progress bar over batches.
        **predictive_kwargs: Passed to ``la`` on every batch (``pred_type``, ``link_approx``,
            ``n_samples``, ...).

    Returns:
        A dict of Python floats, ints, lists and dicts (JSON-serialisable).

    Raises:
        ValueError: For bad options, an unknown likelihood, an empty loader, or predictions or
            targets of the wrong shape.

    Example:
        >>> result = evaluate(la, test_loader, link_approx="probit")  # doctest: +SKIP
        >>> result["ece"], result["nll"]  # doctest: +SKIP
    """
    _check_options(n_bins, coverage_levels, predictive_kwargs)
    key_x = dict_key_x or getattr(la, "dict_key_x", "input_ids")
    key_y = dict_key_y or getattr(la, "dict_key_y", "labels")
    device = model_device(la)
    sync = distributed_utils.resolve(distributed, loader)
    if class_dim is None:
        class_dim = getattr(la, "class_dim", None)
    if ignore_index is None:
        ignore_index = getattr(la, "ignore_index", IGNORE_INDEX)
    if sigma_noise is None:
        sigma_noise = getattr(la, "sigma_noise", 0.0)

    levels = tuple(float(level) for level in coverage_levels)
    options = EvaluationOptions(int(n_bins), levels, sigma_noise, sync)

    def evaluation(name: Likelihood | str | UserLikelihood | LikelihoodModel) -> Evaluation:
        model = make_likelihood(name, class_dim, ignore_index)
        return model.predictive_likelihood.evaluation(options)

    likelihood = likelihood if likelihood is not None else getattr(la, "likelihood", None)
    task = evaluation(likelihood) if likelihood is not None else None  # fails before predicting
    ood = _OODScores(sync_on_compute=sync) if ood_loader is not None else None
    n_batches = 0
    for batch in progress(loader, progress_bar, "evaluate"):
        X, y = split_batch(batch, key_x, key_y)
        out = predict_detached(la, X, device, predictive_kwargs)
        if task is None:
            task = evaluation("regression" if isinstance(out, tuple) else "classification")
        task.update(out, y)
        n_batches += 1
        if ood is not None:
            ood.update(task.entropy(out), ood=False)
    if not n_batches:
        raise ValueError("loader yielded no batches: evaluate needs at least one.")
    result = task.compute()
    if ood is not None:
        for batch in progress(ood_loader, progress_bar, "evaluate OOD"):
            out = predict_detached(la, _inputs(batch, key_x, key_y), device, predictive_kwargs)
            ood.update(task.entropy(out), ood=True)
        if not ood.out_scores:
            raise ValueError("ood_loader yielded no batches: evaluate needs at least one.")
        result.update(ood.compute())
    return result
