"""Parameter subsets (``laplace.core.subsets``): a model must have parameters to approximate."""

from __future__ import annotations

import pytest

from laplace import DiagLaplace


def test_model_without_trainable_parameters(clf):
    for p in clf.model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        DiagLaplace(clf.model, "classification")
