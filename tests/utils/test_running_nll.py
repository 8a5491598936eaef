import math

import pytest
import torch

from conftest import assert_close
from laplace.utils import RunningNLLMetric


def _probs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)


# The metric accumulates in float32 (as laplace-torch does): compare with float32 tolerance.
RTOL_F32 = 1e-6


def test_running_nll_equals_mean_negative_log_prob_over_batches():
    probs = _probs((13, 4))
    targets = torch.randint(0, 4, (13,), generator=torch.Generator().manual_seed(1))
    metric = RunningNLLMetric()
    for idx in torch.arange(13).split(5):
        metric.update(probs[idx], targets[idx])
    expected = -torch.log(probs[torch.arange(13), targets]).mean()
    assert_close(metric.compute().double(), expected, rtol=RTOL_F32)


def test_running_nll_skips_ignore_index():
    probs = _probs((6, 3), seed=2)
    targets = torch.tensor([0, 2, -1, 1, -1, 2])
    metric = RunningNLLMetric(ignore_index=-1)
    metric.update(probs, targets)
    keep = targets != -1
    expected = -torch.log(probs[keep.nonzero().squeeze(-1), targets[keep]]).mean()
    assert_close(metric.compute().double(), expected, rtol=RTOL_F32)
    assert metric.n_valid_labels.item() == 4


def test_running_nll_flattens_leading_dimensions():
    probs = _probs((2, 5, 3), seed=3)  # e.g. (batch, tokens, vocabulary)
    targets = torch.randint(0, 3, (2, 5), generator=torch.Generator().manual_seed(4))
    metric = RunningNLLMetric()
    metric.update(probs, targets)
    expected = -probs.gather(-1, targets.unsqueeze(-1)).log().mean()
    assert_close(metric.compute().double(), expected, rtol=RTOL_F32)


def test_running_nll_reset_and_empty_state():
    metric = RunningNLLMetric()
    metric.update(torch.tensor([[0.25, 0.75]]), torch.tensor([1]))
    assert math.isclose(metric.compute().item(), -math.log(0.75), rel_tol=RTOL_F32)
    metric.reset()
    metric.update(torch.tensor([[0.5, 0.5]]), torch.tensor([0]))
    assert math.isclose(metric.compute().item(), math.log(2.0), rel_tol=RTOL_F32)


def test_running_nll_default_ignore_index():
    assert RunningNLLMetric().ignore_index == -100


def test_running_nll_rejects_mismatched_shapes():
    metric = RunningNLLMetric()
    with pytest.raises(ValueError, match="targets"):
        metric.update(torch.full((4, 3), 1 / 3), torch.zeros(5, dtype=torch.long))
