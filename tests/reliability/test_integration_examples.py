"""The integration examples (Hugging Face Trainer + PEFT, Lightning) run end to end, briefly."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHORT_RUNS = {
    "hf_trainer_example.py": ["--epochs", "1", "--n-train", "64"],
    "lightning_example.py": ["--epochs", "1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SHORT_RUNS))
def test_integration_example_writes_finite_metrics_for_map_and_laplace(script, tmp_path):
    pytest.importorskip("lightning" if script.startswith("lightning") else "peft")
    command = [sys.executable, str(EXAMPLES / script), "--output", str(tmp_path)]
    result = subprocess.run(command + SHORT_RUNS[script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert str(tmp_path) in result.stdout  # the example says where its outputs are
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    predictives = {k: v for k, v in metrics.items() if isinstance(v, dict) and "nll" in v}
    assert any(k.startswith("MAP") for k in predictives)
    assert sum(k.startswith("Laplace") for k in predictives) >= 1
    for name, values in predictives.items():
        assert 0.0 <= values["accuracy"] <= 1.0, name
        assert math.isfinite(values["nll"]) and values["nll"] > 0, name
        assert 0.0 <= values["ece"] <= 1.0, name
