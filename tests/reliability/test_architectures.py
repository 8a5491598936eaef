"""Random architectures from a grammar of patterns against the dense float64 oracle.

Hypothesis composes tiny float64 models (``architecture_grammar``): modules called twice,
weights tied through a shared module or used as a bare tensor, raw parameters in custom
modules, adapters calling ``F.linear`` on a base layer's weight, position tables broadcast or
looked up without a batch dimension (with T equal to the batch size or not), a table's row
read off its weight or its weight held by a second table, attention and
encoder layers in either layout with masks, LSTM, GRU and RNN layers (one or two directions,
with or without a connection around them), activation checkpointing, in-place ops, norms in
eval mode, dict inputs and tiny Hugging Face GPT-2, BERT and Llama. On each, the native engine
must give the exact GGN (``conftest.Oracle``) in diag, full, the GLM variances, low rank and
last-layer form, exact Kron blocks where it plans them (or refuse a Kronecker-factored weight
by name), and the third-party backends must agree with the oracle or raise. The silent
mismatches the grammar found (the randomized low-rank solver on GGNs of low rank, ASDL on
reused modules and broadcast tables) are fixed; their blueprints stay pinned as examples.

Examples (``LAPLACE_HYPOTHESIS_PROFILE``): 200 under ``ci`` (``make test``), 2,000 under
``thorough`` (``make test-all``), shared among the test functions by ``SHARES``. Derandomised,
no example database: every run tries the same examples.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from architecture_grammar import (
    Block,
    Blueprint,
    Example,
    blueprints,
    build,
    without_checkpointing,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import example as pinned

from conftest import Oracle, assert_close, freeze_all_but
from laplace import Laplace
from laplace.curvature import AsdlGGN, BackPackGGN
from laplace.curvature.engine.kfac_rules import plan_blocks
from laplace.curvature.solvers.eigen import EIGENVALUE_THRESHOLD

#: Examples of all the test functions together, per profile.
EXAMPLES = {"ci": 200, "thorough": 2000}[os.environ.get("LAPLACE_HYPOTHESIS_PROFILE", "ci")]
#: Seconds a test function may take per example of ``EXAMPLES`` (the suite's 600 s under ``ci``).
SECONDS_PER_EXAMPLE = 3

pytestmark = [
    pytest.mark.oracle,
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    pytest.mark.timeout(SECONDS_PER_EXAMPLE * EXAMPLES),
]
#: Each test function's share of ``EXAMPLES``.
SHARES = {
    "diag_full": 0.25,
    "glm": 0.15,
    "kron": 0.25,
    "lowrank": 0.05,
    "last_layer": 0.2,
    "third_party": 0.1,
}

#: The acceptance tolerance of the issue: diag, full and exact Kron blocks equal the GGN.
RTOL = 1e-8
ATOL = 1e-10
#: GLM variances go through a Cholesky factor of the posterior precision.
RTOL_VARIANCE = 1e-7
#: Low-rank eigenvalues come from an iterative eigensolver.
RTOL_EIGEN = 1e-6
ATOL_EIGEN = 1e-9
#: Hugging Face's Llama casts hidden states to float32 in its RMSNorm, so its gradients carry
#: float32 round-off: entries agree to this fraction of the largest entry.
RTOL_FLOAT32_CASTS = 1e-5

#: Third-party backends: each must agree with the oracle or raise.
THIRD_PARTY_BACKENDS = {"asdl": AsdlGGN, "backpack": BackPackGGN}


def examples(share: str):
    """Hypothesis settings giving the test ``SHARES[share]`` of ``EXAMPLES``."""
    return settings(
        max_examples=round(EXAMPLES * SHARES[share]),
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # a blueprint is small: report it unshrunk
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def assert_equals_oracle(
    example: Example, actual, expected: torch.Tensor, rtol: float = RTOL, atol: float = ATOL
):
    """``actual`` equals the oracle's ``expected`` to ``rtol``/``atol`` (float32 round-off of
    the largest entry for Llama, ``RTOL_FLOAT32_CASTS``)."""
    if example.blueprint.inputs == "hf-llama":
        rtol = max(rtol, RTOL_FLOAT32_CASTS)
        atol = max(atol, RTOL_FLOAT32_CASTS * float(expected.abs().max()))
    assert_close(actual, expected, rtol=rtol, atol=atol)


def oracle(example: Example, only: str | None = None) -> Oracle:
    """The dense oracle over all trainable parameters, or those of module ``only``."""
    model = without_checkpointing(example.model)
    if only is not None:
        model = freeze_all_but(model, only)
    return Oracle(model, example.blueprint.likelihood)


def fitted(example: Example, subset: str, structure: str, **kwargs) -> Laplace:
    """A Laplace of ``example``'s model fitted on its loader."""
    la = Laplace(example.model, example.blueprint.likelihood, subset, structure, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(example.loader)
    return la


def parameter_rows(model: torch.nn.Module):
    """Per trainable parameter (a tied weight once): its name and its rows in the GGN."""
    start = 0
    for name, p in model.named_parameters():
        yield name, slice(start, start + p.numel())
        start += p.numel()


#: Recurrent layers whichever way the columns' backward pass goes: cut at the layer (an
#: embedding and positions reaching the output only through a bidirectional sequence-first
#: LSTM), or through the fused kernels (a connection around a GRU; two recurrent layers).
RECURRENT = [
    Blueprint(
        "tokens",
        "classification",
        width=3,
        seq_len=4,
        n_points=5,
        batch_size=3,
        n_out=3,
        positions="broadcast",
        blocks=(Block("recurrent", batch_first=False, cell="lstm", bidirectional=True),),
        readout="last",
    ),
    Blueprint(
        "dict",
        "regression",
        width=2,
        seq_len=3,
        n_points=4,
        batch_size=2,
        n_out=2,
        blocks=(Block("recurrent", cell="gru", residual=True),),
    ),
    Blueprint(
        "sequence",
        "classification",
        width=2,
        seq_len=3,
        n_points=3,
        batch_size=3,
        n_out=3,
        blocks=(Block("recurrent", cell="rnn"), Block("recurrent", cell="lstm")),
    ),
]


#: A GRU and a sequence-first encoder layer on batches of 2 sequences of 2 tokens: the
#: layer's feed-forward outputs (T, B, 3) have the batch's size in front, their rows are
#: positions. Dead units of the first batch hid the mix from the gradients' scale check, and
#: the full GGN of the later batches was wrong until the rows' values were checked too.
MIXED_BEHIND_DEAD_UNITS = Blueprint(
    "dict",
    "classification",
    width=5,
    seq_len=2,
    n_points=7,
    batch_size=2,
    positions="broadcast",
    blocks=(
        Block("recurrent", batch_first=False, cell="gru"),
        Block("encoder-layer", batch_first=False),
    ),
    readout="last",
    head="bare",
    vocab=5,
    seed=25536,
)

#: Found by the grammar run outside the suite: a table looked up without a batch dimension,
#: ``wpe(arange(T))`` (2, 2), with T, the width and the batch all 2. Every unit after the table
#: was inactive on the first batch (the table got no gradient there), and its rows do not
#: change with a data point's inputs; the full GGN's cross terms of the table were 0 (0.21 in
#: the GGN) until a call whose rows stay where they are when the batch is shifted by one data
#: point was no longer read as one row per data point (``guard._rows_of_no_data_point``).
POSITIONS_BEHIND_DEAD_UNITS = Blueprint(
    "dict",
    "classification",
    width=2,
    seq_len=2,
    n_points=4,
    batch_size=2,
    positions="batchless",
    blocks=(
        Block("recurrent", batch_first=False, cell="rnn", bidirectional=True, residual=True),
        Block("in-place"),
    ),
    head="shared",
    vocab=4,
    seed=45731,
)


@examples("diag_full")
@pinned(MIXED_BEHIND_DEAD_UNITS)
@pinned(POSITIONS_BEHIND_DEAD_UNITS)
@pinned(RECURRENT[0])
@pinned(RECURRENT[1])
@pinned(RECURRENT[2])
@given(blueprints())
def test_diag_and_full_equal_the_dense_ggn(blueprint: Blueprint):
    example = build(blueprint)
    ggn = oracle(example).ggn(example.X)
    assert_equals_oracle(example, fitted(example, "all", "diag").H, ggn.diagonal())
    assert_equals_oracle(example, fitted(example, "all", "full").H, ggn)


@examples("glm")
@pinned(RECURRENT[0])
@pinned(RECURRENT[1])
@given(blueprints())
def test_glm_variances_of_full_are_j_inverse_precision_jt(blueprint: Blueprint):
    example = build(blueprint)
    la = fitted(example, "all", "full")
    J = oracle(example).jacobian(example.X)
    expected = J @ torch.linalg.inv(la.posterior_precision) @ J.transpose(1, 2)
    variances = la._functional_moments(example.X)[1]
    assert_equals_oracle(example, variances, expected, rtol=RTOL_VARIANCE)


#: A sequence-first encoder layer on batches of one point: its outputs (T, 1, D) have T rows
#: for one data point (a folded batch), whose norm layers' exact blocks took the positions as
#: data points (a Gram of rows instead of one of their sums) before they came from autograd.
FOLDED_BATCH = Blueprint(
    "sequence",
    "regression",
    width=3,
    seq_len=4,
    n_points=2,
    batch_size=1,
    blocks=(Block("encoder-layer", batch_first=False),),
)


@examples("kron")
@pinned(FOLDED_BATCH)
@pinned(RECURRENT[0])
@pinned(RECURRENT[2])
@given(blueprints())
def test_kron_blocks_are_exact_or_refused(blueprint: Blueprint):
    """Every curved parameter has a nonzero block and its planned exact blocks equal the
    GGN's, or a Kronecker-factored weight is refused by name."""
    example = build(blueprint)
    try:
        la = fitted(example, "all", "kron")
    except ValueError as refusal:
        assert "Kronecker block, but" in str(refusal)
        return
    ggn = oracle(example).ggn(example.X)
    plan = plan_blocks(la.backend.engine)
    rows = parameter_rows(example.model)
    for (name, slots), block, kind in zip(rows, la.H_facs.kfacs, plan, strict=True):
        exact = ggn[slots, slots]
        if kind.kind == "dense":
            assert_equals_oracle(example, block[0], exact)
        elif kind.kind == "diag":
            assert_equals_oracle(example, block[0], exact.diagonal())
        if bool(exact.abs().amax() > 1e-12):
            assert any(bool(F.abs().amax() > 0) for F in block), f"{name} has no curvature"


#: GGNs of low rank on which the default (randomized) low-rank solver returned eigenvalues
#: above the GGN's largest from a non-orthonormal U, silently, before its Householder
#: completion was taken off the Krylov basis; the third, a GRU's, after a completion that
#: kept a column half on the basis (now every column is checked orthogonal to it).
RANK_DEFICIENT_GGNS = [
    Blueprint(
        "vector",
        "classification",
        width=2,
        seq_len=2,
        n_points=2,
        batch_size=2,
        blocks=(Block("reuse"), Block("in-place"), Block("norm")),
        seed=0,
    ),
    Blueprint(
        "tokens",
        "classification",
        width=2,
        seq_len=2,
        n_points=2,
        batch_size=2,
        blocks=(Block("reuse"),),
        vocab=3,
        seed=0,
    ),
    Blueprint(
        "tokens",
        "classification",
        width=2,
        seq_len=4,
        n_points=3,
        batch_size=3,
        positions="batchless",
        blocks=(Block("norm", norm="batch"), Block("recurrent", cell="gru")),
        readout="first",
        table="row",
        vocab=3,
        seed=5260,
    ),
]


@examples("lowrank")
@pinned(RANK_DEFICIENT_GGNS[0])
@pinned(RANK_DEFICIENT_GGNS[1])
@pinned(RANK_DEFICIENT_GGNS[2])
@given(blueprints())
def test_lowrank_is_the_top_of_the_dense_ggn(blueprint: Blueprint):
    """Two eigenvalues: the top two of the GGN, those at or below ``EIGENVALUE_THRESHOLD``
    dropped (as laplace-torch does)."""
    example = build(blueprint)
    ggn = oracle(example).ggn(example.X)
    la = fitted(example, "all", "lowrank", backend_kwargs={"n_eigenvalues": 2})
    _, values = la.H
    top = torch.linalg.eigvalsh(ggn).flip(0)[:2]
    assert_equals_oracle(example, values, top[: len(values)], rtol=RTOL_EIGEN, atol=ATOL_EIGEN)
    dropped = top[len(values) :]
    assert bool((dropped <= EIGENVALUE_THRESHOLD * (1 + RTOL_EIGEN) + ATOL_EIGEN).all())


@examples("last_layer")
@given(blueprints())
def test_last_layer_equals_the_dense_ggn_of_the_head(blueprint: Blueprint):
    """Models ending in a Linear head: diag and full are the GGN of the head's parameters."""
    example = build(blueprint)
    if example.head_name is None:
        return
    ggn = oracle(example, only=example.head_name).ggn(example.X)
    assert_equals_oracle(example, fitted(example, "last_layer", "diag").H, ggn.diagonal())
    assert_equals_oracle(example, fitted(example, "last_layer", "full").H, ggn)


#: Models on which ASDL's diag GGN was wrong without an error, before the third-party backends
#: asked the native guard: a Linear called twice, a Hugging Face BERT (its position table,
#: looked up (1, T) and broadcast over the batch), and Linear and LayerNorm layers on a
#: sequence (B, T, D), whose positions ASDL's diagonal takes as data points. All are refused.
MISREAD_BY_ASDL = [
    Blueprint(
        "vector",
        "classification",
        width=2,
        seq_len=2,
        n_points=3,
        batch_size=3,
        blocks=(Block("reuse"),),
    ),
    Blueprint("hf-bert", "classification", width=4, seq_len=3, n_points=3, batch_size=3),
    Blueprint(
        "sequence",
        "classification",
        width=3,
        seq_len=2,
        n_points=3,
        batch_size=2,
        blocks=(Block("norm"),),
        n_out=3,
        seed=55,
    ),
]


@examples("third_party")
@pinned(MISREAD_BY_ASDL[0])
@pinned(MISREAD_BY_ASDL[1])
@pinned(MISREAD_BY_ASDL[2])
@given(blueprints())
def test_third_party_diag_agrees_or_raises(blueprint: Blueprint):
    """ASDL and BackPACK diag: the GGN diagonal, or an error with a message."""
    if blueprint.inputs == "hf-bert" and blueprint.batch_size == 1:
        return  # ASDL's own deviation on BERT: test_asdl_on_bert_batches_of_one
    example = build(blueprint)
    diagonal = oracle(example).ggn(example.X).diagonal()
    for name, backend in THIRD_PARTY_BACKENDS.items():
        try:
            la = fitted(example, "all", "diag", backend=backend)
        except Exception as error:  # any clear refusal is allowed, a silent mismatch is not
            assert str(error), f"{name} raised {type(error).__name__} without a message"
            continue
        assert_equals_oracle(example, la.H, diagonal)


@pytest.mark.xfail(
    strict=True,
    reason="ASDL's diagonal of a Hugging Face BERT on batches of one point differs from the "
    "exact GGN inside ASDL (5e-6 of the largest entry, 60% on the value projection's tiny "
    "entries); the native guard sees nothing wrong in the model (batches of several points "
    "are refused for the broadcast position table)",
)
def test_asdl_on_bert_batches_of_one():
    blueprint = Blueprint(
        "hf-bert", "classification", width=4, seq_len=3, n_points=2, batch_size=1, seed=1
    )
    example = build(blueprint)
    diagonal = oracle(example).ggn(example.X).diagonal()
    la = fitted(example, "all", "diag", backend=THIRD_PARTY_BACKENDS["asdl"])
    assert_equals_oracle(example, la.H, diagonal)


def test_a_use_outside_the_module_hidden_by_dead_units_on_the_checked_batch():
    """A row read off the table (``h + wte.weight[0]``) is a use outside the table's calls. On
    the checked first batch (one data point) the in-place ReLU after it is inactive at the
    position read out, so the gradient check sees nothing through it; the guard reads the use
    off the graph's structure (``guard._read_outside_calls``), and later batches are exact."""
    blueprint = Blueprint(
        "dict",
        "regression",
        width=2,
        seq_len=2,
        n_points=7,
        batch_size=1,
        blocks=(Block("in-place"), Block("norm", norm="batch"), Block("norm", norm="batch")),
        readout="first",
        head="shared",
        table="row",
        n_out=3,
        vocab=5,
        seed=400,
    )
    example = build(blueprint)
    diagonal = oracle(example).ggn(example.X).diagonal()
    assert_equals_oracle(example, fitted(example, "all", "diag").H, diagonal)


def test_lowrank_products_through_checkpointing_and_a_recurrent_layer():
    """The low-rank solver's batch products re-record batches after the fit. Recording checks
    differentiate while the hooks are on, and the checkpointed block, run again by them, had
    added calls: a batch as long as its sequences was then read sequence-first (products
    1.14 off on a norm of 5.3). Found by the grammar run outside the suite."""
    blueprint = Blueprint(
        "tokens",
        "classification",
        width=3,
        seq_len=3,
        n_points=5,
        batch_size=3,
        positions="broadcast",
        blocks=(Block("checkpoint"), Block("recurrent", cell="rnn", residual=True)),
        readout="first",
        table="row",
        vocab=4,
        seed=601,
    )
    example = build(blueprint)
    ggn = oracle(example).ggn(example.X)
    la = fitted(example, "all", "lowrank", backend_kwargs={"n_eigenvalues": 2})
    top = torch.linalg.eigvalsh(ggn).flip(0)[:2]
    assert_equals_oracle(example, la.H[1], top, rtol=RTOL_EIGEN, atol=ATOL_EIGEN)
