"""The examples `make demo` runs, the BERT and shift examples (slow): short runs write outputs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("accuracy", "ece", "nll", "brier")


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def test_calibration_example_quick_writes_metrics_and_figure(tmp_path):
    done = run_example("calibration_example.py", "--quick", "--output", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert str(tmp_path) in done.stdout
    assert (tmp_path / "reliability.png").stat().st_size > 0
    summary = json.loads((tmp_path / "metrics.json").read_text())
    metrics = summary["metrics"]
    assert set(metrics) == {"clean", "shifted"}
    models = list(metrics["clean"])
    assert models[0] == "MAP"
    assert "LA last-layer KFAC (marglik)" in models
    assert list(metrics["shifted"]) == models
    for split in metrics.values():
        for model, result in split.items():
            for key in METRICS:
                value = result[key]
                assert isinstance(value, float) and math.isfinite(value), (model, key, value)
            assert 0.0 <= result["accuracy"] <= 1.0 and 0.0 <= result["ece"] <= 1.0
    assert math.isfinite(metrics["clean"]["MAP"]["ood_auroc"])


@pytest.mark.slow
def test_bert_example_quick_writes_metrics_for_every_approximation(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    done = run_example("bert_example.py", "--quick", "--output", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(tmp_path) in done.stdout
    assert (tmp_path / "reliability.png").stat().st_size > 0
    summary = json.loads((tmp_path / "metrics.json").read_text())
    metrics = summary["metrics"]
    expected = {"MAP", "MAP LoRA", "MAP bf16", *summary["laplace"]}
    assert set(summary["laplace"]) == {
        "LA last-layer KFAC",
        "LA all-weights diag",
        "LA all-weights KFAC",
        "LA LoRA + head KFAC",
        "LA last-layer KFAC, bf16",
        "LA all-weights KFAC, bf16",
    }
    assert set(metrics["clean"]) == set(metrics["shifted"]) == expected
    for split in metrics.values():
        for name, result in split.items():
            for key in ("accuracy", "ece", "nll"):
                value = result[key]
                assert isinstance(value, float) and math.isfinite(value), (name, key, value)
            assert 0.0 <= result["accuracy"] <= 1.0 and 0.0 <= result["ece"] <= 1.0
    for name, result in metrics["clean"].items():
        assert 0.0 <= result["ood_auroc"] <= 1.0, name
    for name, fitted in summary["laplace"].items():
        assert fitted["n_params"] > 0 and fitted["prior_precision"] > 0, name


@pytest.mark.slow
def test_shift_example_quick_writes_metrics_sweep_and_figures(tmp_path):
    done = run_example("shift_example.py", "--quick", "--output", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(tmp_path) in done.stdout
    for figure in ("entropy.png", "adversarial.png", "reliability.png"):
        assert (tmp_path / figure).stat().st_size > 0, figure
    summary = json.loads((tmp_path / "metrics.json").read_text())
    metrics, sweep = summary["metrics"], summary["adversarial"]
    laplaces = [
        "LA all-weights diag",
        "LA all-weights KFAC",
        "LA all-weights EKFAC",
        "LA all-weights INF",
        "LA all-weights matfree",
        "LA last-layer KFAC",
        "LA all-weights KFAC (val. NLL)",
    ]
    predictives = [
        "MAP",
        *laplaces,
        "LA all-weights KFAC, MC link",
        "LA last-layer KFAC, MC link",
    ]
    assert list(summary["fit_seconds"]) == list(summary["prior_precision"]) == laplaces
    assert set(metrics) == {"clean", "rotated"}
    assert list(metrics["clean"]) == list(metrics["rotated"]) == predictives
    for split in metrics.values():
        for name, result in split.items():
            for key in ("accuracy", "nll", "ece"):
                value = result[key]
                assert isinstance(value, float) and math.isfinite(value), (name, key, value)
            assert 0.0 <= result["accuracy"] <= 1.0 and 0.0 <= result["ece"] <= 1.0
    for name, result in metrics["clean"].items():
        assert 0.0 <= result["ood_auroc"] <= 1.0 and 0.0 <= result["ood_fpr95"] <= 1.0, name
    assert sweep["attack"] == "fgsm" and sweep["epsilons"][0] == 0.0
    assert list(sweep["results"]) == predictives
    for name, result in sweep["results"].items():
        for key in ("accuracy", "confidence", "ece"):
            assert len(result[key]) == len(sweep["epsilons"]), (name, key)
            assert all(math.isfinite(value) for value in result[key]), (name, key)
        if not name.endswith("MC link"):  # sampled anew for each evaluation
            clean_accuracy = metrics["clean"][name]["accuracy"]
            assert result["accuracy"][0] == pytest.approx(clean_accuracy), name
    for name in laplaces:
        assert summary["fit_seconds"][name] > 0 and summary["prior_precision"][name] > 0, name
