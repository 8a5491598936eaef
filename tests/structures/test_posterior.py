"""The posterior structures' curvature accumulators, and every fit as one pass of the data loop.

An accumulator (``laplace.structures.Posterior``) sums per-batch curvature (``zeros``, ``add``),
adds a new sum to an earlier fit (``merge``), stores it (``finalize``) and saves it (``state``,
``load_state``). Checked against dense float64 oracles (the exact GGN) and against one fit on
all the data, for every structure and its per-output variant.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, Case, Oracle, assert_close
from laplace import Laplace
from laplace.core.passes.data_loop import DataLoop
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN, CurvlinopsHessian
from laplace.structures import (
    DensePosterior,
    DiagonalPosterior,
    KronPosterior,
    LowRankPosterior,
    Posterior,
)
from laplace.structures.last_layer import head_curvature
from laplace.structures.per_output import noise_structure
from laplace.utils.matrix import Kron, KronDecomposed

#: Outputs of the regression case, for the per-output structures.
C = 3

BASES = {"full": DensePosterior, "diag": DiagonalPosterior, "kron": KronPosterior}


def _structures() -> dict[str, type[Posterior]]:
    per_output = {
        f"{name}_per_output": noise_structure(base, base, C, False, CurvlinopsGGN)
        for name, base in BASES.items()
    }
    return {**BASES, **per_output}


STRUCTURES = _structures()


def _case(name: str) -> Case:
    return CASE_BUILDERS["mlp_regression_3out" if "per_output" in name else "mlp_classification"]()


def _sum(structure: type[Posterior], case: Case, rows: slice, n_data: int, batch: int = 5):
    """``(loss, H)`` summed over batches of ``case``'s rows by the accumulator."""
    backend = CurvlinopsGGN(case.model, case.likelihood)
    params = [p for p in case.model.parameters() if p.requires_grad]
    total, loss = structure.zeros(params), 0.0
    X, y = case.X[rows], case.y[rows]
    for start in range(0, len(X), batch):
        part = slice(start, start + batch)
        batch_loss, H = structure.batch_curvature(backend, X[part], y[part], n_data)
        total, loss = structure.add(total, H), loss + batch_loss
    return loss, total


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of a saved state, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for key in sorted(value) for t in _tensors(value[key])]
    return [t for item in value for t in _tensors(item)]


def _assert_same_state(structure: type[Posterior], actual, expected) -> None:
    for a, b in zip(_tensors(structure.state(actual)), _tensors(structure.state(expected))):
        assert_close(a, b, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- summing batches
@pytest.mark.parametrize("name", ["full", "diag"])
def test_summed_batches_are_the_exact_ggn(name):
    case = _case(name)
    _, H = _sum(STRUCTURES[name], case, slice(None), len(case.X))
    ggn = Oracle(case.model, case.likelihood).ggn(case.X)
    assert_close(H, ggn if name == "full" else ggn.diagonal())


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_batches_sum_to_the_curvature_of_all_the_data(name):
    structure, case = STRUCTURES[name], _case(name)
    loss, H = _sum(structure, case, slice(None), len(case.X))
    whole_loss, whole = _sum(structure, case, slice(None), len(case.X), batch=len(case.X))
    assert_close(loss, whole_loss)
    _assert_same_state(structure, structure.finalize(H), structure.finalize(whole))


# ------------------------------------------------------------------------- online updates
@pytest.mark.parametrize(
    ("name", "damping"),
    [*((name, False) for name in STRUCTURES), ("kron", True), ("kron_per_output", True)],
)
def test_merge_of_an_earlier_fit_equals_one_fit_on_all_the_data(name, damping):
    structure, case = STRUCTURES[name], _case(name)
    options = {"damping": damping} if "kron" in name else {}
    n, split = len(case.X), 8
    _, first = _sum(structure, case, slice(0, split), split)
    _, second = _sum(structure, case, slice(split, None), n)
    merged = structure.merge(structure.finalize(first, **options), second, split, n)
    _, once = _sum(structure, case, slice(None), n)
    ours, theirs = structure.finalize(merged, **options), structure.finalize(once, **options)
    _assert_same_state(structure, ours, theirs)
    if name == "full":
        assert_close(ours, Oracle(case.model, case.likelihood).ggn(case.X))
    if name == "kron":
        assert ours.damping is damping
        assert_close(ours.to_matrix(), theirs.to_matrix())


@pytest.mark.parametrize("damping", [False, True])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_kron_online_fit_equals_one_fit_on_all_the_data(subset, damping):
    case = CASE_BUILDERS["cnn_classification"]()
    once = Laplace(case.model, case.likelihood, subset, "kron", damping=damping)
    once.fit(case.loader())
    online = Laplace(case.model, case.likelihood, subset, "kron", damping=damping)
    for i, rows in enumerate([slice(0, 5), slice(5, None)]):
        part = DataLoader(TensorDataset(case.X[rows], case.y[rows]), batch_size=5)
        online.fit(part, override=i == 0)
    assert online.n_data == once.n_data == len(case.X)
    for ours, theirs in zip(online.H_facs.kfacs, once.H_facs.kfacs, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert online.H.damping is damping
    assert_close(online.log_marginal_likelihood(), once.log_marginal_likelihood())


def test_per_output_kron_online_fit_keeps_each_outputs_factors():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    sigma = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    once = Laplace(case.model, "regression", "all", "kron", sigma_noise=sigma)
    once.fit(case.loader())
    online = Laplace(case.model, "regression", "all", "kron", sigma_noise=sigma)
    online.fit(DataLoader(TensorDataset(case.X[:8], case.y[:8]), batch_size=5))
    online.fit(DataLoader(TensorDataset(case.X[8:], case.y[8:]), batch_size=5), override=False)
    assert online.H_facs.kfacs[0][0].shape[0] == C  # one output-gradient factor per output
    for ours, theirs in zip(online.H_facs.kfacs, once.H_facs.kfacs, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_only_low_rank_refuses_an_update_before_any_pass(monkeypatch):
    assert [s.update_refusal for s in STRUCTURES.values()] == [None] * len(STRUCTURES)
    assert "eigenpairs" in LowRankPosterior.update_refusal
    case = CASE_BUILDERS["mlp_classification"]()
    monkeypatch.setattr(DataLoop, "run", lambda self, data: pytest.fail("a pass ran"))
    la = Laplace(case.model, case.likelihood, "all", "lowrank")
    with pytest.raises(ValueError, match="LowRankLaplace cannot update a fit"):
        la.fit(case.loader(), override=False)


# ----------------------------------------------------------------------- storing and saving
def test_kron_fitted_curvature_keeps_its_factors():
    case = _case("kron")
    _, H = _sum(KronPosterior, case, slice(None), len(case.X))
    fitted = KronPosterior.finalize(H, damping=True)
    assert isinstance(fitted, KronDecomposed) and fitted.damping
    assert KronPosterior.factors(fitted) is H
    assert_close(fitted.to_matrix(), H.to_matrix())
    built = KronDecomposed(fitted.eigenvectors, fitted.eigenvalues)
    assert built.factors is None


def test_h_facs_is_none_before_a_fit_and_the_factors_after_fit_or_load():
    case = CASE_BUILDERS["mlp_classification"]()
    la = Laplace(case.model, case.likelihood, "all", "kron")
    assert la.H_facs is None and isinstance(la.H, Kron)
    la.fit(case.loader())
    assert la.H_facs is la.H.factors
    other = Laplace(case.model, case.likelihood, "all", "kron")
    other.load_state_dict(la.state_dict())
    assert isinstance(other.H, KronDecomposed)
    assert_close(other.H_facs.to_matrix(), la.H_facs.to_matrix())


@pytest.mark.parametrize("name", [*STRUCTURES, "lowrank"])
def test_state_round_trip_and_shape_check(name):
    case = _case(name)
    params = [p for p in case.model.parameters() if p.requires_grad]
    structure = LowRankPosterior if name == "lowrank" else STRUCTURES[name]
    zeros = structure.zeros(params)
    if name == "lowrank":
        U = torch.linalg.qr(torch.randn(zeros[0].shape[0], 4, dtype=torch.float64))[0]
        H = (U, torch.rand(4, dtype=torch.float64))
    else:
        H = structure.finalize(_sum(structure, case, slice(None), len(case.X))[1])
    loaded = structure.load_state(structure.state(H), zeros)
    _assert_same_state(structure, loaded, H)
    with pytest.raises(ValueError, match=r"state_dict\['H'\]"):
        fewer = structure.finalize(structure.zeros(params[:-1]))
        structure.load_state(structure.state(fewer), zeros)


# --------------------------------------------------------------- a last layer's closed forms
@pytest.mark.parametrize(
    ("backend", "kwargs", "structures"),
    [
        (CurvlinopsGGN, {}, BASES),
        (CurvlinopsEF, {}, BASES),
        (CurvlinopsGGN, {"stochastic": True}, {}),
        (CurvlinopsHessian, {}, {}),
    ],
    ids=["ggn", "ef", "mc_fisher", "hessian"],
)
def test_a_head_has_a_closed_form_where_it_is_the_backends_curvature(backend, kwargs, structures):
    case = _case("full")
    instance = backend(case.model, case.likelihood, **kwargs)
    for structure in [*STRUCTURES.values(), LowRankPosterior]:
        closed_form = head_curvature(structure, instance)
        assert (closed_form is not None) == (structure in structures.values()), structure
