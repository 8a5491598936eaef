"""Inputs that move: out-of-distribution metrics, adversarial attacks and the ε sweep."""

from __future__ import annotations

import json
import math

import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.utils.data import DataLoader, TensorDataset

from laplace.evaluation import categorical_entropy, evaluate, ood_metrics

#: torchmetrics computes the rates of its curves in float32; scikit-learn in float64.
RTOL_RANKING = 1e-6
OOD_KEYS = {"ood_auroc", "ood_aupr", "ood_fpr95", "entropy_histogram"}


# ----------------------------------------------------------------------------------- OOD
def _random_scores(seed: int, n_in: int = 57, n_out: int = 41) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    in_scores = torch.randn(n_in, generator=gen, dtype=torch.float64)
    out_scores = 0.8 + torch.randn(n_out, generator=gen, dtype=torch.float64)
    return in_scores, out_scores


def _tied_scores(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)  # 5 distinct values: many ties within and across
    in_scores = torch.randint(0, 4, (60,), generator=gen).double()
    out_scores = torch.randint(1, 5, (40,), generator=gen).double()
    return in_scores, out_scores


def _sklearn_fpr95(in_scores: torch.Tensor, out_scores: torch.Tensor) -> float:
    """FPR at the largest threshold whose TPR reaches 95%, read off scikit-learn's ROC curve."""
    from sklearn.metrics import roc_curve

    labels = [0] * len(in_scores) + [1] * len(out_scores)
    fpr, tpr, _ = roc_curve(labels, torch.cat([in_scores, out_scores]).numpy())
    needed = math.ceil(0.95 * len(out_scores) - 1e-9)
    index = next(i for i, rate in enumerate(tpr) if round(rate * len(out_scores)) >= needed)
    return float(fpr[index])


@pytest.mark.parametrize("scores", ["random", "tied", "shifted_large"])
def test_ood_metrics_match_scikit_learn(scores):
    in_scores, out_scores = {
        "random": lambda: _random_scores(0),
        "tied": lambda: _tied_scores(1),
        # large entropies (Gaussian predictives): a sigmoid would tie them, the map must not
        "shifted_large": lambda: tuple(40 + 3 * s for s in _random_scores(2)),
    }[scores]()
    result = ood_metrics(in_scores, out_scores)
    labels = [0] * len(in_scores) + [1] * len(out_scores)
    joined = torch.cat([in_scores, out_scores]).numpy()
    assert result["ood_auroc"] == pytest.approx(roc_auc_score(labels, joined), rel=RTOL_RANKING)
    expected_ap = average_precision_score(labels, joined)
    assert result["ood_aupr"] == pytest.approx(expected_ap, rel=RTOL_RANKING)
    expected_fpr = _sklearn_fpr95(in_scores, out_scores)
    assert result["ood_fpr95"] == pytest.approx(expected_fpr, rel=RTOL_RANKING)
    assert 0.0 < result["ood_fpr95"] < 1.0  # the case is neither separable nor hopeless


def test_fpr95_by_hand():
    # 20 OOD points 1..20: flagging 95% (19 of them) needs the threshold 2. In-distribution
    # points 0, 1.5, 2, 2.5, 30: those ≥ 2 are 2, 2.5, 30, so FPR95 = 3/5.
    out_scores = torch.arange(1, 21, dtype=torch.float64)
    in_scores = torch.tensor([0.0, 1.5, 2.0, 2.5, 30.0], dtype=torch.float64)
    assert ood_metrics(in_scores, out_scores)["ood_fpr95"] == pytest.approx(3 / 5)
    # with 19 OOD points 95% is 18.05 of them: 19 must be flagged, threshold 1
    in_scores = torch.tensor([0.0, 0.5, 1.0, 25.0], dtype=torch.float64)
    result = ood_metrics(in_scores, out_scores[:19])
    assert result["ood_fpr95"] == pytest.approx(2 / 4)


def test_entropy_histogram_spans_the_scores_and_counts_every_point():
    in_scores, out_scores = _random_scores(3)
    histogram = ood_metrics(in_scores, out_scores, n_bins=7)["entropy_histogram"]
    edges = histogram["edges"]
    assert len(edges) == 8 and len(histogram["in"]) == len(histogram["out"]) == 7
    low, high = torch.cat([in_scores, out_scores]).aminmax()
    assert edges[0] == pytest.approx(low.item()) and edges[-1] == pytest.approx(high.item())
    expected_in = torch.histogram(in_scores, torch.tensor(edges, dtype=torch.float64))[0]
    assert histogram["in"] == expected_in.long().tolist()
    assert sum(histogram["out"]) == len(out_scores)
    # all scores equal: one bin of width 1 around them still holds every point
    same = ood_metrics(torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    assert sum(same["entropy_histogram"]["in"]) == 3 and same["ood_auroc"] == 0.5


@pytest.mark.parametrize(
    ("in_scores", "out_scores", "name"),
    [
        (torch.zeros(0), torch.ones(3), "in_scores"),
        (torch.zeros(3), torch.ones(3, 1), "out_scores"),
        (torch.tensor([0.0, float("nan")]), torch.ones(3), "in_scores"),
        (torch.zeros(3), torch.tensor([float("inf")]), "out_scores"),
    ],
    ids=["empty", "2-d", "nan", "inf"],
)
def test_ood_metrics_refuse_bad_scores(in_scores, out_scores, name):
    with pytest.raises(ValueError, match=name):
        ood_metrics(in_scores, out_scores)


def test_evaluate_with_an_ood_loader_reports_the_ood_metrics_of_the_entropies():
    gen = torch.Generator().manual_seed(4)
    in_probs = torch.softmax(4 * torch.randn(45, 5, generator=gen, dtype=torch.float64), -1)
    ood_probs = torch.softmax(torch.randn(33, 5, generator=gen, dtype=torch.float64), -1)
    y = in_probs.argmax(-1)
    in_loader = DataLoader(TensorDataset(in_probs, y), batch_size=10)
    ood_loader = DataLoader(TensorDataset(ood_probs), batch_size=8)
    result = evaluate(lambda p: p, in_loader, ood_loader=ood_loader)
    clean = evaluate(lambda p: p, in_loader)
    assert set(result) == set(clean) | OOD_KEYS
    assert {key: result[key] for key in clean} == clean
    expected = ood_metrics(categorical_entropy(in_probs), categorical_entropy(ood_probs))
    assert {key: result[key] for key in OOD_KEYS} == expected
    histogram = result["entropy_histogram"]
    assert sum(histogram["in"]) == len(in_probs) and sum(histogram["out"]) == len(ood_probs)
    assert histogram["edges"][0] >= 0 and histogram["edges"][-1] <= math.log(5)
    assert json.loads(json.dumps(result)) == result


def test_evaluate_refuses_an_empty_ood_loader():
    probs = torch.full((4, 2), 0.5, dtype=torch.float64)
    loader = DataLoader(TensorDataset(probs, torch.zeros(4, dtype=torch.long)))
    with pytest.raises(ValueError, match="ood_loader"):
        evaluate(lambda p: p, loader, ood_loader=DataLoader(TensorDataset(probs[:0])))
