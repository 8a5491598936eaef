"""``evaluate``: one batched pass of a predictive, its metrics and the OOD metrics.

On fitted Laplace approximations, the predictive's numbers. On predictions with extra output
dimensions, scored position by position: segmentation probabilities (B, C, H, W) with labels
(B, H, W), sequence probabilities (B, T, C) with labels (B, T), ``ignore_index`` positions
left out, and dense regression; each must give the metrics of the same predictions flattened
to rows (B·positions, C) by hand. Out-of-distribution metrics against scikit-learn and
torchmetrics, also over sharded data.
"""

from __future__ import annotations

import json
import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy import stats
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.functional.classification import binary_auroc, multiclass_calibration_error

from cases.predictions import MomentsDataset, _evaluate_predictions, _labels, _probs
from conftest import CASE_BUILDERS, dict_case
from laplace import Laplace
from laplace.evaluation import categorical_entropy, evaluate, ood_metrics

#: torchmetrics' accuracy and calibration error are float32; NLL and Brier are float64 here.
RTOL_F32, RTOL_F64 = 1e-6, 1e-10


def _fitted(case_name: str, subset: str = "all", structure: str = "kron", **kwargs):
    case = CASE_BUILDERS[case_name]()
    la = Laplace(case.model, case.likelihood, subset, structure, **kwargs)
    la.fit(case.loader())
    return case, la


class CountingPredictive:
    """Wraps a Laplace approximation and records the batch sizes it is called with."""

    def __init__(self, la):
        self.la, self.calls = la, []
        self.model, self.likelihood, self.sigma_noise = la.model, la.likelihood, la.sigma_noise

    def __call__(self, x, **kwargs):
        self.calls.append(len(x))
        return self.la(x, **kwargs)


@pytest.mark.parametrize(
    ("subset", "structure"),
    [("all", "kron"), ("all", "diag"), ("last_layer", "full")],
    ids=["kron", "diag", "ll-full"],
)
@pytest.mark.parametrize("link_approx", ["probit", "bridge"])
def test_classification_metrics_are_those_of_the_predictive(subset, structure, link_approx):
    case, la = _fitted("mlp_classification", subset, structure, prior_precision=0.5)
    counting = CountingPredictive(la)
    result = evaluate(counting, case.loader(batch_size=6), link_approx=link_approx)
    assert counting.calls == [6, 6, 6, 2]  # one pass, batch by batch
    probs = la(case.X, link_approx=link_approx)
    y = case.y
    assert result["accuracy"] == pytest.approx((probs.argmax(-1) == y).double().mean().item())
    nll = -probs[torch.arange(len(y)), y].log().mean().item()
    assert result["nll"] == pytest.approx(nll, rel=1e-10)
    onehot = torch.nn.functional.one_hot(y, probs.shape[-1])
    assert result["brier"] == pytest.approx((probs - onehot).square().sum(-1).mean().item())
    ece = multiclass_calibration_error(probs, y, probs.shape[-1], n_bins=15).item()
    assert result["ece"] == pytest.approx(ece, rel=RTOL_F32)
    assert json.loads(json.dumps(result)) == result


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_regression_metrics_use_the_functional_variance_plus_sigma_squared(structure):
    case, la = _fitted("mlp_regression_3out", "all", structure, sigma_noise=0.6)
    result = evaluate(la, case.loader(batch_size=8), coverage_levels=(0.5, 0.9))
    f_mu, f_var = la(case.X)
    cov = f_var + 0.36 * torch.eye(3, dtype=f_var.dtype)
    nll = [
        -stats.multivariate_normal.logpdf(y.numpy(), m.numpy(), c.numpy())
        for y, m, c in zip(case.y, f_mu.detach(), cov.detach(), strict=True)
    ]
    assert result["nll"] == pytest.approx(sum(nll) / len(nll), rel=1e-10)
    rmse = (f_mu - case.y).square().mean().sqrt().item()
    assert result["rmse"] == pytest.approx(rmse, rel=1e-10)
    std = cov.diagonal(dim1=-2, dim2=-1).sqrt()
    z = ((case.y - f_mu) / std).detach().numpy()
    assert result["coverage"]["0.9"] == pytest.approx((abs(z) <= stats.norm.ppf(0.95)).mean())
    assert set(result) == {"nll", "rmse", "crps", "coverage", "calibration_curve", "n"}
    # an explicit sigma_noise replaces la.sigma_noise
    other = evaluate(la, case.loader(), sigma_noise=2.0)
    assert other["nll"] != pytest.approx(result["nll"])


def test_functional_laplace_and_pred_type_nn():
    case, gp = _fitted("mlp_classification", "all", "gp", n_subset=10)
    assert 0 <= evaluate(gp, case.loader())["ece"] <= 1
    reg_case, la = _fitted("mlp_regression_1out", "all", "diag")
    torch.manual_seed(0)
    result = evaluate(la, reg_case.loader(), pred_type="nn", link_approx="mc", n_samples=50)
    assert result["n"] == 20 and result["crps"] > 0


def test_dict_batches_and_the_map_network_as_a_callable():
    model, loader = dict_case()
    la = Laplace(model, "classification", "all", "diag")
    la.fit(loader)
    assert evaluate(la, loader)["n"] == 16
    map_result = evaluate(lambda batch: model(batch).softmax(-1), loader)
    assert map_result["n"] == 16 and 0 <= map_result["accuracy"] <= 1


def test_inputs_are_moved_to_the_model_device(device):
    case = CASE_BUILDERS["mlp_classification"]()
    la = Laplace(case.model.to(device), "classification", "all", "diag")
    la.fit(DataLoader(TensorDataset(case.X.to(device), case.y.to(device)), batch_size=7))
    result = evaluate(la, case.loader())  # a CPU loader
    expected = evaluate(lambda x: la(x).cpu(), case.loader(), likelihood="classification")
    assert result == expected


def test_the_ood_loader_of_shifted_inputs_is_detected():
    case, la = _fitted("mlp_classification", "all", "kron", prior_precision=0.1)
    far = DataLoader(TensorDataset(50 * case.X), batch_size=8)
    result = evaluate(la, case.loader(), ood_loader=far)
    assert result["ood_auroc"] > 0.5
    assert evaluate(la, case.loader(), ood_loader=case.loader())["ood_auroc"] == 0.5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_bins": 0}, "n_bins"),
        ({"n_bins": 2.5}, "n_bins"),
        ({"coverage_levels": (0.5, 1.0)}, "coverage_levels"),
        ({"coverage_levels": ()}, "coverage_levels"),
        ({"joint": True}, "joint"),
        ({"likelihood": "poisson"}, "'classification', 'regression'"),
    ],
)
def test_bad_options_fail_before_any_prediction(kwargs, match):
    case, la = _fitted("mlp_classification", "all", "diag")
    counting = CountingPredictive(la)
    with pytest.raises(ValueError, match=match):
        evaluate(counting, case.loader(), **kwargs)
    assert counting.calls == []


def test_bad_data_fails_clearly():
    case, la = _fitted("mlp_classification", "all", "diag")
    empty = DataLoader(TensorDataset(case.X[:0], case.y[:0]), batch_size=4)
    with pytest.raises(ValueError, match="no batches"):
        evaluate(la, empty)
    soft = DataLoader(TensorDataset(case.X, torch.rand(20, 4, dtype=torch.float64)), batch_size=5)
    with pytest.raises(ValueError, match="integer labels"):
        evaluate(la, soft)
    _, reg = _fitted("mlp_regression_3out", "all", "diag")
    wrong = DataLoader(TensorDataset(case.X, torch.randn(20, 2)), batch_size=5)
    with pytest.raises(ValueError, match="do not match"):
        evaluate(reg, wrong)
    with pytest.raises(ValueError, match="probability tensor"):
        evaluate(reg, case.loader(), likelihood="classification")


def test_the_predictive_runs_in_the_callers_autograd_mode():
    """Backends such as ASDL need gradients to predict: evaluate must not switch them off."""
    pytest.importorskip("asdl")
    from laplace.curvature import CURVATURE_BACKENDS

    case = CASE_BUILDERS["mlp_classification"]()
    la = Laplace(
        case.model, case.likelihood, "all", "diag", backend=CURVATURE_BACKENDS["asdl_ggn"]
    )
    la.fit(case.loader())
    result = evaluate(la, case.loader())
    probs = la(case.X)
    assert result["nll"] == pytest.approx(-probs[torch.arange(20), case.y].log().mean().item())
    modes = []

    def predictive(x):
        modes.append(torch.is_grad_enabled())
        return case.model(x).softmax(-1)  # outputs with a graph: evaluate detaches them

    evaluate(predictive, case.loader())
    with torch.no_grad():
        evaluate(predictive, case.loader())
    assert modes == [True] * 3 + [False] * 3


# ------------------------------------------------------------ outputs with extra dimensions
IGNORED = -100


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _rows_reference(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Metrics of rows (N, C) and labels (N,) computed directly (no torchmetrics)."""
    keep = labels != IGNORED
    probs, labels = probs[keep], labels[keep]
    onehot = torch.nn.functional.one_hot(labels, probs.shape[-1])
    return {
        "accuracy": (probs.argmax(-1) == labels).double().mean().item(),
        "nll": -probs[torch.arange(len(labels)), labels].log().mean().item(),
        "brier": (probs - onehot).square().sum(-1).mean().item(),
        "n": int(keep.sum()),
    }


def _dense_case(shape: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Probabilities, labels with some ignored positions, and the same as rows (N, C)."""
    gen = torch.Generator().manual_seed(seed)
    B, C, H, W, T = 6, 4, 3, 5, 7
    if shape == "segmentation":
        logits = torch.randn(B, C, H, W, generator=gen, dtype=torch.float64)
        probs = logits.softmax(1)
        labels = torch.randint(C, (B, H, W), generator=gen)
        rows = probs.movedim(1, -1).reshape(-1, C)
    else:
        probs = torch.randn(B, T, C, generator=gen, dtype=torch.float64).softmax(-1)
        labels = torch.randint(C, (B, T), generator=gen)
        rows = probs.reshape(-1, C)
    labels[torch.rand(labels.shape, generator=gen) < 0.25] = IGNORED
    return probs, labels, rows


@pytest.mark.parametrize("shape", ["segmentation", "sequence"])
def test_dense_classification_is_scored_per_kept_position(shape):
    probs, labels, rows = _dense_case(shape)
    loader = DataLoader(TensorDataset(probs, labels), batch_size=4)
    result = evaluate(_identity, loader, likelihood="classification")
    expected = _rows_reference(rows, labels.reshape(-1))
    assert result["n"] == expected["n"]
    assert result["accuracy"] == pytest.approx(expected["accuracy"], rel=RTOL_F32)
    for name in ("nll", "brier"):
        assert result[name] == pytest.approx(expected[name], rel=RTOL_F64)
    flat_loader = DataLoader(
        TensorDataset(rows, labels.reshape(-1)), batch_size=len(labels.reshape(-1))
    )
    flat = evaluate(_identity, flat_loader, likelihood="classification")
    assert result["ece"] == pytest.approx(flat["ece"], rel=RTOL_F32)


def test_dense_ood_scores_are_mean_entropies_over_positions():
    probs, labels, _ = _dense_case("segmentation")
    confident = torch.nn.functional.one_hot(probs.argmax(1), probs.shape[1]).movedim(-1, 1)
    confident = (0.97 * confident + 0.01).double()
    loader = DataLoader(TensorDataset(confident, labels), batch_size=3)
    ood = DataLoader(TensorDataset(probs, labels), batch_size=3)
    result = evaluate(_identity, loader, ood_loader=ood, likelihood="classification")
    assert result["ood_auroc"] == pytest.approx(1.0)


def test_ambiguous_class_dimension_needs_class_dim():
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(4, 3, 3, generator=gen, dtype=torch.float64).softmax(1)
    labels = torch.randint(3, (4, 3), generator=gen)
    loader = DataLoader(TensorDataset(probs, labels), batch_size=4)
    with pytest.raises(ValueError, match="class_dim"):
        evaluate(_identity, loader, likelihood="classification")
    result = evaluate(_identity, loader, likelihood="classification", class_dim=1)
    expected = _rows_reference(probs.movedim(1, -1).reshape(-1, 3), labels.reshape(-1))
    assert result["nll"] == pytest.approx(expected["nll"], rel=RTOL_F64)


def test_dense_regression_is_scored_as_independent_outputs():
    gen = torch.Generator().manual_seed(2)
    mean = torch.randn(5, 2, 3, generator=gen, dtype=torch.float64)
    var = torch.rand(5, 2, 3, generator=gen, dtype=torch.float64) + 0.1
    target = mean + var.sqrt() * torch.randn(5, 2, 3, generator=gen, dtype=torch.float64)

    def predictive(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, 0], x[:, 1]

    inputs = torch.stack([mean, var], 1)
    result = evaluate(predictive, DataLoader(TensorDataset(inputs, target), batch_size=2))
    normal = torch.distributions.Normal(mean, var.sqrt())
    nll = -normal.log_prob(target).flatten(1).sum(1).mean().item()
    assert result["nll"] == pytest.approx(nll, rel=RTOL_F64)
    rmse = (mean - target).square().mean().sqrt().item()
    assert result["rmse"] == pytest.approx(rmse, rel=RTOL_F64)


# ----------------------------------------------------------------------------------- OOD
def test_ood_auroc_of_predictive_entropy_equals_torchmetrics():
    in_probs = _probs(40, 4, seed=10, scale=4.0)
    ood_probs = _probs(30, 4, seed=11, scale=0.7)
    y = _labels(in_probs)
    result = _evaluate_predictions(
        in_probs, y, ood_loader=DataLoader(TensorDataset(ood_probs), batch_size=8)
    )

    def entropy(p):
        return -(p * p.log()).sum(-1)

    scores = torch.cat([entropy(in_probs), entropy(ood_probs)])
    labels = torch.cat([torch.zeros(40), torch.ones(30)]).long()
    expected = binary_auroc(scores / scores.max(), labels)  # in [0, 1]: no sigmoid applied
    assert result["ood_auroc"] == pytest.approx(expected.item(), rel=1e-6)
    assert 0.5 < result["ood_auroc"] <= 1.0


def test_ood_auroc_keeps_the_order_of_large_entropies():
    # Gaussian entropies ~ 24 (in) and ~ 36 (OOD): a sigmoid would round both to 1.
    mean = torch.zeros(20, 1, dtype=torch.float64)
    y = torch.zeros(20, 1, dtype=torch.float64)
    in_loader = DataLoader(MomentsDataset(mean, torch.full_like(mean, 1e20), y), batch_size=8)
    ood = DataLoader(MomentsDataset(mean, torch.full_like(mean, 1e30), y), batch_size=8)
    result = evaluate(lambda x: tuple(x), in_loader, ood_loader=ood)
    assert result["ood_auroc"] == 1.0


#: torchmetrics computes the rates of its curves in float32; scikit-learn in float64.
RTOL_RANKING = 1e-6


OOD_KEYS = {"ood_auroc", "ood_aupr", "ood_fpr95", "entropy_histogram"}


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
    labels = [0] * len(in_scores) + [1] * len(out_scores)
    joined = torch.cat([in_scores, out_scores]).numpy()
    fpr, tpr, _ = roc_curve(labels, joined, drop_intermediate=False)
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
    in_probs, y, ood_probs = _ood_predictions()
    in_loader = DataLoader(TensorDataset(in_probs, y), batch_size=10)
    ood_loader = DataLoader(TensorDataset(ood_probs), batch_size=8)
    result = evaluate(lambda p: p, in_loader, ood_loader=ood_loader)
    clean = evaluate(lambda p: p, in_loader)
    assert set(result) == set(clean) | OOD_KEYS
    assert {key: result[key] for key in clean} == clean
    expected = ood_metrics(categorical_entropy(in_probs), categorical_entropy(ood_probs))
    assert {key: result[key] for key in OOD_KEYS} == expected
    histogram = result["entropy_histogram"]
    assert all(isinstance(count, int) for count in histogram["in"] + histogram["out"])
    assert sum(histogram["in"]) == len(in_probs) and sum(histogram["out"]) == len(ood_probs)
    assert histogram["edges"][0] >= 0 and histogram["edges"][-1] <= math.log(5)
    assert json.loads(json.dumps(result)) == result


def _ood_predictions() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    in_probs = torch.softmax(4 * torch.randn(45, 5, generator=gen, dtype=torch.float64), -1)
    ood_probs = torch.softmax(torch.randn(33, 5, generator=gen, dtype=torch.float64), -1)
    return in_probs, in_probs.argmax(-1), ood_probs


def _sharded_ood_evaluation(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: ``evaluate`` with ``ood_loader`` on uneven shards of both sets."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        in_probs, y, ood_probs = _ood_predictions()
        in_shard, ood_shard = (
            (slice(0, 30), slice(0, 12)) if rank == 0 else (slice(30, 45), slice(12, 33))
        )
        result = evaluate(
            lambda p: p,
            DataLoader(TensorDataset(in_probs[in_shard], y[in_shard]), batch_size=8),
            ood_loader=DataLoader(TensorDataset(ood_probs[ood_shard]), batch_size=8),
            distributed=True,
        )
        with open(f"{out}/rank{rank}.json", "w") as file:
            json.dump(result, file)
    finally:
        dist.destroy_process_group()


def test_the_ood_metrics_of_sharded_data_are_those_of_all_of_it(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_sharded_ood_evaluation, args=(port, str(tmp_path)), nprocs=2)
    in_probs, _, ood_probs = _ood_predictions()
    expected = ood_metrics(categorical_entropy(in_probs), categorical_entropy(ood_probs))
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["entropy_histogram"] == expected["entropy_histogram"]
        for key in ("ood_auroc", "ood_aupr", "ood_fpr95"):
            assert result[key] == pytest.approx(expected[key], rel=RTOL_RANKING), key


def test_evaluate_refuses_an_empty_ood_loader():
    probs = torch.full((4, 2), 0.5, dtype=torch.float64)
    loader = DataLoader(TensorDataset(probs, torch.zeros(4, dtype=torch.long)))
    with pytest.raises(ValueError, match="ood_loader"):
        evaluate(lambda p: p, loader, ood_loader=DataLoader(TensorDataset(probs[:0])))
