"""Calibration plots render headless (Agg) and contain what they claim."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from laplace import Laplace
from laplace.evaluation import (
    SWEEP_METRICS,
    adversarial_sweep,
    evaluate,
    ood_metrics,
    plot_adversarial_sweep,
    plot_calibration_curve,
    plot_entropy_histograms,
    plot_predictive_band,
    plot_reliability_diagram,
)

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
plt = pytest.importorskip("matplotlib.pyplot")


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _classification_result(n_bins=15):
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(200, 4, generator=gen, dtype=torch.float64), -1)
    y = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    loader = DataLoader(TensorDataset(probs, y), batch_size=64)
    return evaluate(lambda p: p, loader, n_bins=n_bins)


def _regression_la():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    X = torch.linspace(-2, 2, 30).unsqueeze(-1)
    y = torch.sin(3 * X) + 0.1 * torch.randn(X.shape, generator=torch.Generator().manual_seed(1))
    la = Laplace(model, "regression", "all", "full", sigma_noise=0.3)
    loader = DataLoader(TensorDataset(X, y), batch_size=10)
    la.fit(loader)
    return la, X, y, loader


@pytest.mark.parametrize("n_bins", [15, 8])
def test_reliability_diagram_has_one_bar_per_bin_and_the_histogram(n_bins):
    result = _classification_result(n_bins)
    fig = plot_reliability_diagram(result, title="MAP")
    ax, hist_ax = fig.axes
    assert isinstance(fig, matplotlib.figure.Figure)
    assert ax.get_ylabel() == "accuracy"
    assert hist_ax.get_xlabel() == "confidence" and hist_ax.get_ylabel() == "fraction of points"
    (bars,) = ax.containers
    assert len(bars) == n_bins
    heights = [bar.get_height() for bar in bars]
    assert heights == pytest.approx(result["reliability"]["accuracy"])
    (hist,) = hist_ax.containers
    assert len(hist) == n_bins
    total = sum(result["reliability"]["count"])
    expected = [c / total for c in result["reliability"]["count"]]
    assert [bar.get_height() for bar in hist] == pytest.approx(expected)
    assert ax.get_title() == f"MAP\nECE {100 * result['ece']:.1f}%"
    fig.savefig(io.BytesIO(), format="png")  # renders headless


def test_reliability_diagram_draws_into_the_given_axes():
    fig, axes = plt.subplots(1, 3)
    returned = plot_reliability_diagram(_classification_result(), ax=axes[1])
    assert returned is fig
    assert len(axes[1].containers) == 1 and not axes[0].containers and not axes[2].containers
    assert axes[1].get_xlabel() == "confidence"
    plot_reliability_diagram(_classification_result(), ax=axes[0], hist_ax=axes[2])
    assert len(axes[2].containers[0]) == 15 and axes[2].get_ylabel() == "fraction of points"
    assert len(fig.axes) == 3


def test_calibration_curve_plots_the_pit_curve_and_the_coverage():
    la, _, _, loader = _regression_la()
    result = evaluate(la, loader, n_bins=10, coverage_levels=(0.5, 0.9))
    fig = plot_calibration_curve(result, title="PIT")
    (ax,) = fig.axes
    assert ax.get_xlabel() == "expected quantile level"
    assert ax.get_ylabel() == "observed fraction of targets below"
    curve, _diagonal = ax.lines
    assert list(curve.get_xdata()) == pytest.approx(result["calibration_curve"]["expected"])
    assert list(curve.get_ydata()) == pytest.approx(result["calibration_curve"]["observed"])
    assert len(curve.get_xdata()) == 11
    legend = ax.get_legend().get_texts()[0].get_text()
    assert legend.startswith("50%: ") and "90%: " in legend
    # a second predictive in the same axes: its own curve and legend entry, one diagonal
    plot_calibration_curve(evaluate(la, loader, sigma_noise=1.0), ax=ax, label="σ = 1")
    assert len(ax.lines) == 3
    entries = [text.get_text() for text in ax.get_legend().get_texts()]
    assert len(entries) == 2 and entries[1].startswith("σ = 1 (50%: ")


@pytest.mark.parametrize("laplace_object", [True, False], ids=["laplace", "callable"])
def test_predictive_band_shows_mean_and_bands(laplace_object):
    la, X, y, _ = _regression_la()
    x = torch.linspace(-3, 3, 50)
    if not laplace_object:  # a callable with the whole predictive variance: one band

        def predictive(x):
            f_mu, f_var = la(x)
            return f_mu, f_var + 0.09

        fig = plot_predictive_band(predictive, x, data=(X, y))
    else:
        fig = plot_predictive_band(la, x, data=(X, y))
    (ax,) = fig.axes
    assert ax.get_xlabel() == "x" and ax.get_ylabel() == "y"
    labels = [text.get_text() for text in ax.legend().get_texts()]
    n_bands = 2 if laplace_object else 1
    assert labels[:n_bands] == ["±2 std, predictive", "±2 std, epistemic"][:n_bands]
    assert "predictive mean" in labels and "data" in labels
    (mean_line,) = ax.lines
    f_mu, _ = la(x.reshape(-1, 1))
    assert list(mean_line.get_ydata()) == pytest.approx(f_mu.detach().reshape(-1).tolist())


def test_entropy_histograms_draw_both_sets_as_fractions():
    gen = torch.Generator().manual_seed(2)
    in_scores = torch.rand(40, generator=gen, dtype=torch.float64)
    out_scores = 0.5 + torch.rand(25, generator=gen, dtype=torch.float64)
    result = ood_metrics(in_scores, out_scores, n_bins=6)
    fig = plot_entropy_histograms(result, title="KFAC")
    (ax,) = fig.axes
    histogram = result["entropy_histogram"]
    steps = ax.patches
    assert len(steps) == 2
    for patch, key in zip(steps, ("in", "out"), strict=True):
        values, edges = patch.get_data().values, patch.get_data().edges
        assert list(edges) == pytest.approx(histogram["edges"])
        expected = [count / sum(histogram[key]) for count in histogram[key]]
        assert list(values) == pytest.approx(expected)
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels == ["in-distribution (n=40)", "out-of-distribution (n=25)"]
    auroc, fpr = result["ood_auroc"], result["ood_fpr95"]
    assert ax.get_title() == f"KFAC\nAUROC {auroc:.3f}, FPR95 {100 * fpr:.1f}%"
    fig.savefig(io.BytesIO(), format="png")


def _sweep():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    X, y = torch.randn(30, 2), torch.arange(30) % 3
    predictives = {
        "MAP": lambda x: model(x).softmax(-1),
        "T=2": lambda x: (model(x) / 2).softmax(-1),
    }
    loader = DataLoader(TensorDataset(X, y), batch_size=10)
    return adversarial_sweep(predictives, model, loader, [0.0, 0.1, 0.3])


def test_adversarial_sweep_has_one_panel_per_metric_and_one_line_per_predictive():
    result = _sweep()
    fig = plot_adversarial_sweep(result, metrics=("accuracy", "nll"), title="FGSM")
    assert len(fig.axes) == 2
    for ax, metric in zip(fig.axes, ("accuracy", "nll"), strict=True):
        assert ax.get_ylabel() == metric and ax.get_xlabel() == "ε (FGSM)"
        assert len(ax.lines) == 2
        for line, name in zip(ax.lines, ("MAP", "T=2"), strict=True):
            assert list(line.get_xdata()) == [0.0, 0.1, 0.3]
            assert list(line.get_ydata()) == pytest.approx(result["results"][name][metric])
    assert fig._suptitle.get_text() == "FGSM"
    fig.savefig(io.BytesIO(), format="png")
    _, axes = plt.subplots(1, len(SWEEP_METRICS))
    assert plot_adversarial_sweep(result, SWEEP_METRICS, axes=axes) is axes[0].figure


def test_plots_refuse_the_wrong_input():
    with pytest.raises(ValueError, match="entropy_histogram"):
        plot_entropy_histograms(_classification_result())
    with pytest.raises(ValueError, match="results"):
        plot_adversarial_sweep(_classification_result())
    with pytest.raises(ValueError, match=r"metrics must name metrics.*'accuracy'"):
        plot_adversarial_sweep(_sweep(), metrics=("auroc",))
    with pytest.raises(ValueError, match="one axes per metric"):
        plot_adversarial_sweep(_sweep(), axes=plt.subplots(1, 2)[1])
    with pytest.raises(ValueError, match="reliability"):
        plot_reliability_diagram({"nll": 1.0})
    with pytest.raises(ValueError, match="calibration_curve"):
        plot_calibration_curve(_classification_result())
    la, *_ = _regression_la()
    with pytest.raises(ValueError, match=r"\(N,\) or \(N, 1\)"):
        plot_predictive_band(la, torch.zeros(5, 2))


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"pip install 'laplace-ng\[plot\]'"):
        plot_reliability_diagram(_classification_result())
