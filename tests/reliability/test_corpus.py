"""Every bad input of the corpus gets its clear error, before any curvature is computed."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
from corpus import BadInput, no_curvature
from corpus_constructors import CASES as CONSTRUCTOR_CASES
from corpus_fit import CASES as FIT_CASES
from corpus_tools import CASES as TOOL_CASES
from corpus_use import CASES as USE_CASES

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


def test_corpus_covers_every_entry_point_with_200_cases():
    ids = [bad.id for bad in CORPUS]
    assert len(ids) == len(set(ids)), "duplicate corpus ids"
    counts = Counter(bad.entry for bad in CORPUS)
    assert len(CORPUS) >= 200, counts
