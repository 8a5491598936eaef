"""The examples `make demo` runs: a short run of each writes the outputs its docs describe."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
