"""Calibration figures: reliability, PIT curve, predictive band, OOD entropies, attacks.

The reliability diagram, the PIT calibration curve, the 1-D predictive band, the entropy
histograms of in- and out-of-distribution points, and metrics against an attack's ε.
matplotlib is optional (``pip install 'laplace-ng[plot]'``) and imported when a plot is drawn.
Each function draws into ``ax`` when given (else into a new figure) and returns the figure.
All but the predictive band take the result of ``evaluate`` or ``adversarial_sweep``, so a
saved JSON result can be plotted again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from laplace.evaluation.evaluate import model_device, predict_detached
from laplace.likelihoods.likelihood_model import Prediction
from laplace.likelihoods.scoring import Metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "plot_adversarial_sweep",
    "plot_calibration_curve",
    "plot_entropy_histograms",
    "plot_predictive_band",
    "plot_reliability_diagram",
]


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "laplace.evaluation's plots need matplotlib: pip install 'laplace-ng[plot]'."
        ) from error
    return plt


def _axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax
    return _pyplot().subplots(figsize=figsize)


def _section(result: Metrics, key: str, producer: str) -> Metrics:
    if key not in result:
        raise ValueError(
            f"the result has no {key!r} entry; pass the dict that evaluate() returns for "
            f"{producer}."
        )
    return result[key]


def plot_reliability_diagram(
    result: Metrics,
    ax: Axes | None = None,
    hist_ax: Axes | None = None,
    title: str | None = None,
) -> Figure:
    """Accuracy against confidence per bin, above the histogram of confidences.

    One bar per bin (height: accuracy of the bin's points; empty bins have height 0), the
    bins' mean confidence as markers and the diagonal of perfect calibration; the title
    reports the ECE. The histogram has one bar per bin with the fraction of points in it.

    Args:
        result: ``evaluate``'s result for a classification predictive.
        ax: Axes of the diagram. When None, a new figure holds the diagram above the
            histogram.
        hist_ax: Axes of the histogram when ``ax`` is given (no histogram when None).
        title: Title; ``"ECE x.x%"`` is appended on a new line.

    Returns:
        The figure.

    Raises:
        ValueError: If ``result`` has no reliability bins.
        ImportError: Without matplotlib.
    """
    bins = _section(result, "reliability", "a classification predictive")
    if ax is None:
        _, (ax, hist_ax) = _pyplot().subplots(
            2, 1, figsize=(4.0, 5.0), sharex=True, gridspec_kw={"height_ratios": (3, 1)}
        )
    edges, count, confidence = (
        torch.tensor(bins[key], dtype=torch.float64)
        for key in ("bin_edges", "count", "confidence")
    )
    centres, widths = (edges[1:] + edges[:-1]) / 2, (edges[1:] - edges[:-1]).tolist()
    ax.bar(centres.tolist(), bins["accuracy"], width=widths, edgecolor="k", label="accuracy")
    seen = count > 0
    centres_seen, confidence_seen = centres[seen].tolist(), confidence[seen].tolist()
    ax.plot(centres_seen, confidence_seen, "o", color="tab:red", ms=4, label="mean confidence")
    ax.plot([0, 1], [0, 1], "k--", lw=1)
    xlabel = "" if hist_ax is not None else "confidence"  # the histogram's x-axis
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel=xlabel, ylabel="accuracy")
    ece = f"ECE {100 * result['ece']:.1f}%" if "ece" in result else ""
    ax.set_title(f"{title}\n{ece}" if title else ece, fontsize=9)
    if hist_ax is not None:
        fraction = (count / count.sum().clamp_min(1)).tolist()
        hist_ax.bar(centres.tolist(), fraction, width=widths, color="0.6", edgecolor="k")
        hist_ax.set(xlim=(0, 1), xlabel="confidence", ylabel="fraction of points")
    return ax.figure


def plot_calibration_curve(
    result: Metrics,
    ax: Axes | None = None,
    title: str | None = None,
    label: str | None = None,
) -> Figure:
    """Observed against expected fraction of targets below each predictive quantile (PIT).

    A calibrated regression predictive lies on the diagonal; a curve below it at low levels and
    above it at high levels means too wide intervals, the reverse too narrow ones. The legend
    entry lists the interval coverages; draw several results into one ``ax`` to compare them.

    Args:
        result: ``evaluate``'s result for a regression predictive.
        ax: Axes to draw into; a new figure when None.
        title: Title of the axes.
        label: Name of the predictive in the legend.

    Returns:
        The figure.

    Raises:
        ValueError: If ``result`` has no calibration curve.
        ImportError: Without matplotlib.
    """
    curve = _section(result, "calibration_curve", "a regression predictive")
    fig, ax = _axes(ax, (4.0, 4.0))
    coverage = ", ".join(
        f"{100 * float(level):g}%: {100 * fraction:.1f}%"
        for level, fraction in result.get("coverage", {}).items()
    )
    entry = f"{label} ({coverage})" if label and coverage else label or coverage
    ax.plot(curve["expected"], curve["observed"], "o-", ms=3, label=entry or None)
    if not any(line.get_label() == "_diagonal" for line in ax.lines):
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="_diagonal")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="expected quantile level")
    ax.set_ylabel("observed fraction of targets below")
    if entry:
        ax.legend(title="interval coverage", loc="upper left", fontsize=8)
    if title:
        ax.set_title(title)
    return fig


def plot_predictive_band(
    la: Callable[..., Prediction],
    x: Tensor,
    data: tuple[Tensor, Tensor] | None = None,
    ax: Axes | None = None,
    n_std: float = 2.0,
    sigma_noise: float | Tensor | None = None,
    title: str | None = None,
    **predictive_kwargs: object,
) -> Figure:
    """Predictive mean and ±``n_std`` standard deviations of a 1-D regression predictive.

    ``la(x, **predictive_kwargs)`` must return ``(f_mu, f_var)`` with one output. The band of
    the predictive ``f_var + σ²`` is drawn, and inside it the epistemic band of ``f_var``
    alone when σ > 0 (σ = ``sigma_noise``, default ``la.sigma_noise``, else 0).

    Args:
        la: A fitted regression Laplace approximation or a callable returning ``(mean, var)``.
        x: Test inputs, shape (N,) or (N, 1), sorted along the x-axis.
        data: Training data ``(X, y)`` to scatter.
        ax: Axes to draw into; a new figure when None.
        n_std: Half-width of the bands in standard deviations.
        sigma_noise: Observation noise σ; default ``la.sigma_noise`` (0 if absent).
        title: Title of the axes.
        **predictive_kwargs: Passed to ``la``.

    Returns:
        The figure.

    Raises:
        ValueError: If the inputs or the predictive are not one-dimensional.
        ImportError: Without matplotlib.
    """
    if x.dim() not in (1, 2) or (x.dim() == 2 and x.shape[1] != 1):
        raise ValueError(f"x must have shape (N,) or (N, 1), got {tuple(x.shape)}.")
    out = predict_detached(la, x.reshape(-1, 1), model_device(la), predictive_kwargs)
    if not (isinstance(out, tuple) and out[0].numel() == len(x)):
        raise ValueError("plot_predictive_band needs a predictive (mean, var) with one output.")
    mean, f_var = (value.reshape(-1).double().cpu() for value in out[:2])
    if sigma_noise is None:
        sigma_noise = getattr(la, "sigma_noise", 0.0)
    noise = float(torch.as_tensor(sigma_noise).detach()) ** 2
    fig, ax = _axes(ax, (6.0, 4.0))
    xs = x.reshape(-1).double().cpu()
    bands = [("predictive", f_var + noise, 0.2, "tab:blue")]
    if noise > 0:
        bands.append(("epistemic", f_var, 0.3, "tab:orange"))
    for name, variance, alpha, color in bands:
        half_width = n_std * variance.sqrt()
        label = f"±{n_std:g} std, {name}"
        ax.fill_between(
            xs, mean - half_width, mean + half_width, alpha=alpha, color=color, label=label
        )
    ax.plot(xs, mean, color="tab:blue", lw=2, label="predictive mean")
    if data is not None:
        X, y = data
        ax.scatter(X.reshape(-1).cpu(), y.reshape(-1).cpu(), s=8, c="k", alpha=0.6, label="data")
    ax.set(xlim=(float(xs.min()), float(xs.max())), xlabel="x", ylabel="y")
    if title:
        ax.set_title(title)
    return fig


def plot_entropy_histograms(
    result: Metrics, ax: Axes | None = None, title: str | None = None
) -> Figure:
    """Histograms of the predictive entropy of in- and out-of-distribution points.

    Each set is drawn as a step histogram of the fraction of its points per bin (so sets of
    different sizes compare), over the bins of ``result["entropy_histogram"]``; the title
    reports the AUROC and FPR95 when ``result`` has them.

    Args:
        result: ``evaluate``'s result with ``ood_loader``, or ``ood_metrics``'s.
        ax: Axes to draw into; a new figure when None.
        title: Title; ``"AUROC x.xxx, FPR95 x.x%"`` is appended on a new line.

    Returns:
        The figure.

    Raises:
        ValueError: If ``result`` has no entropy histogram.
        ImportError: Without matplotlib.
    """
    histogram = _section(result, "entropy_histogram", "an ood_loader")
    fig, ax = _axes(ax, (5.0, 3.5))
    for key, label, color in (
        ("in", "in-distribution", "tab:blue"),
        ("out", "out-of-distribution", "tab:red"),
    ):
        counts = torch.tensor(histogram[key], dtype=torch.float64)
        fraction = (counts / counts.sum().clamp_min(1)).tolist()
        n = int(counts.sum())
        ax.stairs(fraction, histogram["edges"], color=color, lw=2, label=f"{label} (n={n})")
    ax.set(xlabel="predictive entropy", ylabel="fraction of points")
    ax.legend(fontsize=8)
    scores = ", ".join(
        f"{name} {fmt(result[key])}"
        for key, name, fmt in (
            ("ood_auroc", "AUROC", "{:.3f}".format),
            ("ood_fpr95", "FPR95", lambda value: f"{100 * value:.1f}%"),
        )
        if key in result
    )
    ax.set_title(f"{title}\n{scores}" if title and scores else title or scores, fontsize=9)
    return fig


def plot_adversarial_sweep(
    result: Metrics,
    metrics: Sequence[str] = ("accuracy", "confidence", "ece"),
    axes: Sequence[Axes] | None = None,
    title: str | None = None,
) -> Figure:
    """Metrics of each predictive against the attack's radius ε: one panel per metric.

    Args:
        result: ``adversarial_sweep``'s result.
        metrics: The metrics to draw, each a key of the result's per-predictive entries
            (``accuracy``, ``confidence``, ``ece``, ``nll``, ``brier``).
        axes: One axes per metric; a new figure with a row of panels when None.
        title: Title of the figure.

    Returns:
        The figure.

    Raises:
        ValueError: If ``result`` is not a sweep, ``metrics`` is empty or names a metric the
            sweep lacks, or ``axes`` does not hold one axes per metric.
        ImportError: Without matplotlib.
    """
    if "results" not in result or "epsilons" not in result:
        raise ValueError(
            "the result has no 'results' and 'epsilons' entries; pass the dict that "
            "adversarial_sweep() returns."
        )
    results = result["results"]
    metrics = list(metrics)
    available = sorted({metric for entry in results.values() for metric in entry})
    unknown = [metric for metric in metrics if metric not in available]
    if not metrics or unknown:
        raise ValueError(
            f"metrics must name metrics of the sweep, got {metrics!r}; accepted values: "
            f"{', '.join(map(repr, available))}."
        )
    if axes is None:
        fig, axes = _pyplot().subplots(
            1, len(metrics), figsize=(3.5 * len(metrics), 3.2), squeeze=False
        )
        axes = list(axes[0])
    elif len(axes) != len(metrics):
        raise ValueError(f"axes must hold one axes per metric ({len(metrics)}), got {len(axes)}.")
    attack = str(result.get("attack", "")).upper()
    for ax, metric in zip(axes, metrics, strict=True):
        for name, entry in results.items():
            ax.plot(result["epsilons"], entry[metric], "o-", ms=3, label=name)
        ax.set(xlabel=f"ε ({attack})" if attack else "ε", ylabel=metric)
    axes[0].legend(fontsize=8)
    fig = axes[0].figure
    if title:
        fig.suptitle(title)
    return fig
