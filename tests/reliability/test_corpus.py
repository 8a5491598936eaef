"""Every bad input of the corpus gets its clear error, before any curvature is computed."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from corpus import BadInput, clf, no_curvature
from corpus_constructors import CASES as CONSTRUCTOR_CASES
from corpus_fit import CASES as FIT_CASES
from corpus_tools import CASES as TOOL_CASES
from corpus_use import CASES as USE_CASES

from laplace import FullLaplace

CORPUS: list[BadInput] = [*CONSTRUCTOR_CASES, *FIT_CASES, *USE_CASES, *TOOL_CASES]


@pytest.mark.parametrize("bad", CORPUS, ids=[bad.id for bad in CORPUS])
def test_bad_input_gets_a_clear_error_before_curvature(bad: BadInput):
    context = bad.setup()
    trap = no_curvature() if bad.spied else contextlib.nullcontext()
    with trap, pytest.raises(bad.error) as raised:
        bad.act(context)
    message = str(raised.value)
    missing = [word for word in bad.words if word not in message]
    assert not missing, f"the message {message!r} lacks {missing}"


#: The public entry points the corpus must cover.
ENTRY_POINTS = {
    "constructor",
    "Laplace()",
    "fit",
    "distributed fit",
    "predictive",
    "sample",
    "optimize_prior_precision",
    "log_marginal_likelihood",
    "marglik_training",
    "state_dict",
    "load_state_dict",
    "FeatureExtractor",
    "SubnetMask",
    "backend",
}


def test_corpus_covers_every_entry_point_with_200_cases():
    ids = [bad.id for bad in CORPUS]
    assert len(ids) == len(set(ids)), "duplicate corpus ids"
    counts = Counter(bad.entry for bad in CORPUS)
    assert set(counts) == ENTRY_POINTS, counts
    assert len(CORPUS) >= 200, counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_data_and_hyperparameters_for_a_cuda_model_are_moved_not_refused():
    """Mixed devices that hold values are not bad input: they move to the model's device."""
    case = clf()
    model = case.model.cuda()
    la = FullLaplace(model, "classification", prior_precision=torch.tensor([2.0]))
    la.fit(case.loader())  # CPU batches
    assert la.H.device.type == "cuda" and la.prior_precision.device.type == "cuda"
    assert la(case.X[:3]).device.type == "cuda"
