"""Modules whose output is shared by the batch (position embeddings) and recurrent layers.

BERT and GPT-2 look their position embeddings up once per batch, (1, T, D), and broadcast them
over the data points; an RNN returns its hidden states batched along dim 1. The native engine
records both with the data points along dim 0, so every per-sample quantity (KFAC factors, the
diagonal, exact blocks, Jacobians, subnetwork columns) is that of the dense float64 oracle.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import Oracle, assert_close, kron_dense_blocks
from laplace import DiagLaplace, FullLaplace, KronLaplace
from laplace.curvature import CurvlinopsGGN
from laplace.curvature.engine.capture import OutputGradients, record_forward, recurrent_cut
from laplace.curvature.engine.layer_rules import recurrent_pullback
from laplace.subnetlaplace import FullSubnetLaplace

transformers = pytest.importorskip("transformers")

VOCAB, N_CLASSES = 11, 3
#: Kronecker blocks and the GGN they equal are both sums of a few float64 products.
RTOL, ATOL = 1e-8, 1e-11


class Classifier(nn.Module):
    """Logits (B, C) of a Hugging Face model on token ids (B, T)."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, tokens):
        out = self.body(input_ids=tokens)
        return out.logits if out.logits.dim() == 2 else out.logits[:, -1, :N_CLASSES]


def tiny(name: str) -> nn.Module:
    """A one-layer BERT or GPT-2 from a config, trainable position embeddings included."""
    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=4, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=4, max_position_embeddings=6, type_vocab_size=1,
            num_labels=N_CLASSES, attn_implementation="eager",
        )  # fmt: skip
        body = transformers.BertForSequenceClassification(config)
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=6, n_embd=4, n_layer=1, n_head=2,
            bos_token_id=0, eos_token_id=0, attn_implementation="eager",
        )  # fmt: skip
        body = transformers.GPT2LMHeadModel(config)
    return Classifier(body).double().eval()


def position_embedding(model: nn.Module) -> nn.Embedding:
    body = model.body
    if hasattr(body, "bert"):
        return body.bert.embeddings.position_embeddings
    return body.transformer.wpe


def data(n: int, length: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    X = torch.randint(0, VOCAB, (n, length), generator=gen)
    return X, torch.randint(0, N_CLASSES, (n,), generator=gen)


def loader(X: torch.Tensor, y: torch.Tensor, batch_size: int = 3) -> DataLoader:
    return DataLoader(TensorDataset(X, y), batch_size=batch_size)


@pytest.mark.oracle
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_kron_blocks_are_the_exact_ggn_blocks_of_repeated_points_at_one_position(name):
    """N copies of one sequence of one token: KFAC is exact, the broadcast path included."""
    model = tiny(name)
    X, y = data(1, 1)
    X, y = X.expand(4, 1), y.expand(4)
    backend = CurvlinopsGGN(model, "classification")
    _, H = backend.kron(X, y, N=4)
    ggn = Oracle(model, "classification").ggn(X)
    start = 0
    for block in kron_dense_blocks(H):
        stop = start + len(block)
        assert_close(block, ggn[start:stop, start:stop], rtol=RTOL, atol=ATOL)
        start = stop
    assert start == len(ggn)
    assert position_embedding(model) in backend.engine.shared


@pytest.mark.oracle
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_diagonal_full_and_glm_variances_equal_the_oracle_over_a_batch(name):
    model = tiny(name)
    X, y = data(7, 4)
    oracle = Oracle(model, "classification")
    ggn = oracle.ggn(X)
    diag = DiagLaplace(model, "classification")
    diag.fit(loader(X, y))
    assert_close(diag.H, ggn.diagonal(), rtol=RTOL, atol=ATOL)
    full = FullLaplace(model, "classification", prior_precision=0.7)
    full.fit(loader(X, y))
    assert_close(full.H, ggn, rtol=RTOL, atol=ATOL)
    J = oracle.jacobian(X[:5])
    expected = J @ torch.linalg.inv(full.posterior_precision) @ J.transpose(1, 2)
    assert_close(full._functional_moments(X[:5])[1], expected, rtol=1e-7, atol=1e-10)
    kron = KronLaplace(model, "classification", prior_precision=0.7)
    kron.fit(loader(X, y))
    precision = kron.H_facs.to_matrix() + torch.diag(kron.prior_precision_diag)
    expected = J @ torch.linalg.inv(precision) @ J.transpose(1, 2)
    assert_close(kron._functional_moments(X[:5])[1], expected, rtol=1e-7, atol=1e-10)


@pytest.mark.oracle
def test_subnetwork_columns_in_the_position_embedding_equal_the_oracle():
    model = tiny("bert")
    X, y = data(6, 4)
    offsets, start = {}, 0
    for p_name, p in model.named_parameters():
        offsets[p_name] = start
        start += p.numel()
    first = offsets["body.bert.embeddings.position_embeddings.weight"]
    chosen = torch.cat([torch.arange(first, first + 8), torch.tensor([0, 5, start - 1])])
    indices = chosen.sort()[0]
    la = FullSubnetLaplace(model, "classification", subnetwork_indices=indices)
    la.fit(loader(X, y))
    ggn = Oracle(model, "classification").ggn(X)
    assert_close(la.H, ggn[indices][:, indices], rtol=RTOL, atol=ATOL)


class SharedThenReduced(nn.Module):
    """A module called on batch-independent inputs whose output is summed into every point."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        offset = self.shared(torch.zeros(1, dtype=torch.long, device=x.device))  # (1, 3)
        return self.head(x + offset.expand(len(x), -1).sum(0, keepdim=True))


def test_a_shared_output_that_is_not_only_broadcast_keeps_the_batched_path():
    torch.manual_seed(0)
    model = SharedThenReduced().double()
    X = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (5,))
    backend = CurvlinopsGGN(model, "classification")
    _, diag = backend.diag(X, y, N=5)
    assert_close(diag, Oracle(model, "classification").ggn(X).diagonal(), rtol=RTOL, atol=ATOL)
    assert backend.engine.shared == {model.shared: False}
    with pytest.raises(ValueError, match=r"'shared'.*\(1, 3\) for a batch of 5"):
        backend.kron(X, y, N=5)


class CheckpointedAfterPositions(nn.Module):
    """Tokens, a row of their table and a position table looked up once (1, T, D), then a
    Linear and tanh under ``checkpoint``: a backward pass runs the block's forward again, its
    hooks included."""

    def __init__(self, length: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, 3), nn.Embedding(length, 3)
        self.block = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
        self.head = nn.Linear(3, 2)  # outputs (B, 2): no size but the batch's repeats
        self.checkpointing = True  # the oracle's torch.func transforms do not run through it

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        h = self.tokens(tokens) + self.tokens.weight[0] + self.positions(positions)
        if self.checkpointing:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        else:
            h = self.block(h)
        return self.head(h[:, 0])


def test_a_checkpointed_block_run_again_by_a_backward_pass_is_not_recorded():
    """The recording's own checks differentiate while its hooks are on: the checkpointed
    block's repeated forward must not add calls, or a batch as long as its sequences (B = T)
    is later read sequence-first, its rows mixing data points (a diagonal entry of 2.8 read
    as 8.3)."""
    torch.manual_seed(0)
    length = 3
    model = CheckpointedAfterPositions(length).double().eval()
    X, y = data(5, length)
    y = y % 2
    backend = CurvlinopsGGN(model, "classification")
    diagonals = [backend.diag(X[batch], y[batch], N=5)[1] for batch in (slice(3), slice(3, 5))]
    diagonals.append(backend.diag(X[:3], y[:3], N=5)[1])
    model.checkpointing = False
    oracle = Oracle(model, "classification")
    for diagonal, batch in zip(diagonals, (slice(3), slice(3, 5), slice(3))):
        assert_close(diagonal, oracle.ggn(X[batch]).diagonal(), rtol=RTOL, atol=ATOL)
    assert backend.engine.shared == {model.positions: "expand"}


# ------------------------------------------------------------------------ recurrent layers
class Recurrent(nn.Module):
    """A recurrent classifier: (B, T, 3) → RNN → last step and last hidden state → (B, C)."""

    def __init__(self, kind: type[nn.RNNBase], batch_first: bool, bidirectional: bool, layers=1):
        super().__init__()
        self.batch_first = batch_first
        self.rnn = kind(3, 4, layers, batch_first=batch_first, bidirectional=bidirectional)
        self.head = nn.Linear(4 * (2 if bidirectional else 1), N_CLASSES)

    def forward(self, x):
        if not self.batch_first:
            x = x.transpose(0, 1)
        start = torch.ones(self.rnn.num_layers * (2 if self.rnn.bidirectional else 1), 1, 4)
        start = start.expand(-1, x.shape[0 if self.batch_first else 1], -1).to(x)
        hx = (start, start) if isinstance(self.rnn, nn.LSTM) else start
        out, state = self.rnn(x, hx)
        h_n = state[0] if isinstance(state, tuple) else state
        last = out[:, -1] if self.batch_first else out[-1]
        return self.head(last) + h_n[-1].sum(-1, keepdim=True)


RECURRENT = [
    (nn.LSTM, True, False, 1),
    (nn.LSTM, False, True, 2),
    (nn.GRU, True, True, 1),
    (nn.GRU, False, False, 2),
    (nn.RNN, True, False, 2),
]


def recurrent(kind, batch_first, bidirectional, layers) -> nn.Module:
    torch.manual_seed(0)
    return Recurrent(kind, batch_first, bidirectional, layers).double().eval()


@pytest.mark.oracle
@pytest.mark.parametrize(
    "kind, batch_first, bidirectional, layers",
    RECURRENT,
    ids=[f"{k.__name__}-{'bf' if b else 'tf'}-{d + 1}dir-{n}layers" for k, b, d, n in RECURRENT],
)
def test_recurrent_diag_exact_blocks_and_glm_variances_equal_the_oracle(
    kind, batch_first, bidirectional, layers
):
    model = recurrent(kind, batch_first, bidirectional, layers)
    gen = torch.Generator().manual_seed(2)
    X = torch.randn(7, 5, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, N_CLASSES, (7,), generator=gen)
    oracle = Oracle(model, "classification")
    ggn = oracle.ggn(X)
    diag = DiagLaplace(model, "classification")
    diag.fit(loader(X, y))
    assert_close(diag.H, ggn.diagonal(), rtol=RTOL, atol=ATOL)
    # the recurrent weights get exact blocks: dense up to the limit, their diagonal above it
    limit = 4 * 4 * (3 if kind is nn.GRU else 4 if kind is nn.LSTM else 1)
    kron = KronLaplace(model, "classification", backend_kwargs={"kfac_dense_limit": limit})
    kron.fit(loader(X, y))
    start, checked = 0, 0
    for (p_name, p), block in zip(model.named_parameters(), kron.H_facs.kfacs):
        stop = start + p.numel()
        if p_name.startswith("rnn."):
            expected = ggn[start:stop, start:stop]
            dense = p.numel() <= limit
            assert len(block) == 1 and block[0].ndim == (2 if dense else 1), p_name
            assert_close(
                block[0], expected if dense else expected.diagonal(), rtol=RTOL, atol=ATOL
            )
            checked += 1
        start = stop
    assert checked == sum(1 for n, _ in model.named_parameters() if n.startswith("rnn."))
    full = FullLaplace(model, "classification", prior_precision=0.7)
    full.fit(loader(X, y))
    J = oracle.jacobian(X[:4])
    expected = J @ torch.linalg.inv(full.posterior_precision) @ J.transpose(1, 2)
    assert_close(full._functional_moments(X[:4])[1], expected, rtol=1e-7, atol=1e-10)
    precision = kron.H_facs.to_matrix() + torch.diag(kron.prior_precision_diag)
    expected = J @ torch.linalg.inv(precision) @ J.transpose(1, 2)
    assert_close(kron._functional_moments(X[:4])[1], expected, rtol=1e-7, atol=1e-10)


@pytest.mark.oracle
@pytest.mark.parametrize("kind", [nn.LSTM, nn.RNN], ids=["LSTM", "RNN"])
def test_recurrent_weights_read_from_one_joined_product_give_kron_their_exact_diagonal(kind):
    """With no dense blocks, both weights of each direction of a layer whose cell reads
    ``ih + hh`` come from one product of the joined inputs; Kron's diagonal blocks of them are
    the GGN's diagonal."""
    model = recurrent(kind, True, True, 2)
    gen = torch.Generator().manual_seed(2)
    X = torch.randn(7, 5, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, N_CLASSES, (7,), generator=gen)
    ggn = Oracle(model, "classification").ggn(X)
    kron = KronLaplace(model, "classification", backend_kwargs={"kfac_dense_limit": 0})
    kron.fit(loader(X, y))
    start, checked = 0, 0
    for (p_name, p), block in zip(model.named_parameters(), kron.H_facs.kfacs):
        stop = start + p.numel()
        if p_name.startswith("rnn.weight"):
            assert len(block) == 1 and block[0].ndim == 1, p_name
            expected = ggn[start:stop, start:stop].diagonal()
            assert_close(block[0], expected, rtol=RTOL, atol=ATOL)
            checked += 1
        start = stop
    assert checked == 8  # ih and hh, 2 layers, 2 directions


class Packed(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 4, batch_first=True)
        self.head = nn.Linear(4, N_CLASSES)

    def forward(self, x):
        lengths = torch.arange(x.shape[1], 0, -1)[: len(x)].clamp_min(1)
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
        return self.head(self.rnn(packed)[1][-1])


def test_packed_sequences_work_for_diag_and_get_exact_kron_blocks():
    """A packed GRU's hidden state (layers, B, H) is not one row per data point: the guard
    sends its parameters through autograd, and Kron keeps their exact blocks."""
    torch.manual_seed(0)
    model = Packed().double().eval()
    X = torch.randn(4, 5, 3, dtype=torch.float64)
    y = torch.randint(0, N_CLASSES, (4,))
    diag = DiagLaplace(model, "classification")
    diag.fit(loader(X, y, batch_size=4))
    # torch.func cannot run a packed GRU: the Jacobian by plain autograd, row by row
    f = model(X)
    params = list(model.parameters())
    J = torch.stack(
        [torch.cat([g.flatten() for g in torch.autograd.grad(f_i, params, retain_graph=True)])
         for f_i in f.flatten()]
    ).reshape(*f.shape, -1)  # fmt: skip
    p = torch.softmax(f.detach(), -1)
    output_hessian = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    ggn = torch.einsum("bcp,bcd,bdq->pq", J, output_hessian, J)
    assert_close(diag.H, ggn.diagonal(), rtol=RTOL, atol=ATOL)
    kron = KronLaplace(model, "classification")
    kron.fit(loader(X, y, batch_size=4))
    start = 0
    for (p_name, p), block in zip(model.named_parameters(), kron.H_facs.kfacs):
        stop = start + p.numel()
        if p_name.startswith("rnn."):
            assert len(block) == 1
            assert_close(block[0], ggn[start:stop, start:stop], rtol=RTOL, atol=ATOL)
        start = stop


# ----------------------------------------------- a columns' backward pass cut at the layer
class AfterEmbedding(nn.Module):
    """Token ids (B, T) → embedding → Linear → recurrent layer → head → (B, C).

    ``around``: how earlier layers also reach the output other than through the recurrent
    layer: ``"skip"`` (the Linear's output added to the logits), ``"state"`` (the initial
    hidden state computed from the embedding), ``"second"`` (a second recurrent layer), or
    None (they reach it only through the layer). ``given_state``: an initial hidden state of
    constants (no gradient).
    """

    def __init__(
        self, kind, batch_first=True, bidirectional=False, layers=1, around=None, given_state=False
    ):
        super().__init__()
        self.batch_first, self.around, self.given_state = batch_first, around, given_state
        self.embed = nn.Embedding(VOCAB, 3)
        self.pre = nn.Linear(3, 3)
        directions = 2 if bidirectional else 1
        self.rnn = kind(3, 4, layers, batch_first=batch_first, bidirectional=bidirectional)
        self.second = kind(4 * directions, 4, batch_first=batch_first)
        self.head = nn.Linear(4 * directions, N_CLASSES)

    def forward(self, tokens):
        x = self.pre(self.embed(tokens))
        sequence = x if self.batch_first else x.transpose(0, 1)
        hx = None
        if self.given_state:
            directions = 2 if self.rnn.bidirectional else 1
            start = (
                torch.linspace(-0.5, 0.5, 4)
                .to(x)
                .expand(self.rnn.num_layers * directions, len(tokens), 4)
            )
            hx = (start, start.flip(-1)) if isinstance(self.rnn, nn.LSTM) else start
        if self.around == "state":
            start = x.mean(1)[:, :1].expand(-1, 4).unsqueeze(0).contiguous()
            hx = (start, start) if isinstance(self.rnn, nn.LSTM) else start
        out, _ = self.rnn(sequence, hx)
        if self.around == "second":
            out, _ = self.second(out)
        logits = self.head(out[:, -1] if self.batch_first else out[-1])
        return logits + x.sum((1, 2)).unsqueeze(-1) if self.around == "skip" else logits


def _recorded(model, tokens):
    """The engine's recorded pass of ``model`` on ``tokens``: ``(f, calls)``."""
    engine = CurvlinopsGGN(model, "classification").engine
    return record_forward(model, engine.owners, tokens, keep_input_graph=False)


def _autograd_columns(f, calls, columns):
    """The columns' gradients w.r.t. every recorded output, one plain backward pass each."""
    outputs = [z for call in calls for z in call.outputs]
    per_column = [
        torch.autograd.grad(f, outputs, v, retain_graph=True, allow_unused=True) for v in columns
    ]
    return [
        torch.stack([torch.zeros_like(z) if g is None else g for g in grads])
        for z, grads in zip(outputs, zip(*per_column))
    ]


CUT = [
    (nn.LSTM, True, False, 1, False),
    (nn.LSTM, False, True, 2, False),
    (nn.LSTM, False, True, 2, True),
    (nn.GRU, True, True, 2, False),
    (nn.GRU, True, False, 1, True),
    (nn.RNN, False, False, 1, False),
]


@pytest.mark.oracle
@pytest.mark.parametrize(
    "kind, batch_first, bidirectional, layers, given_state",
    CUT,
    ids=[
        f"{k.__name__}-{'bf' if b else 'tf'}-{d + 1}dir-{n}layers{'-state' if h else ''}"
        for k, b, d, n, h in CUT
    ],
)
def test_the_columns_backward_pass_goes_through_the_unrolled_recurrence_exactly(
    kind, batch_first, bidirectional, layers, given_state
):
    """After other layers, a recurrent layer cuts the pass: the earlier layers' output
    gradients come through its unrolling, equal autograd's, and its rule reuses the pullback;
    the fits equal the dense float64 GGN."""
    torch.manual_seed(0)
    model = AfterEmbedding(kind, batch_first, bidirectional, layers, None, given_state)
    model = model.double().eval()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (6, 5), generator=gen)
    f, calls = _recorded(model, tokens)
    layer = next(i for i, call in enumerate(calls) if call.module is model.rnn)
    assert layer == 2 and recurrent_cut(f, calls) == layer
    columns = torch.randn(4, *f.shape, generator=gen, dtype=torch.float64)
    got = [g for grads in OutputGradients(f, calls).columns(columns) for g in grads]
    for mine, expected in zip(got, _autograd_columns(f, calls, columns), strict=True):
        assert_close(mine, expected, rtol=1e-10, atol=1e-13)
    pulled = calls[layer].cache["pulled"][1]
    again = recurrent_pullback(calls[layer], [g.detach() for g in got[2 : 2 + 2]])
    assert again is pulled and "pulled" not in calls[layer].cache
    y = torch.randint(0, N_CLASSES, (6,), generator=gen)
    ggn = Oracle(model, "classification").ggn(tokens)
    diag = DiagLaplace(model, "classification")
    diag.fit(loader(tokens, y))
    assert_close(diag.H, ggn.diagonal(), rtol=RTOL, atol=ATOL)
    full = FullLaplace(model, "classification")
    full.fit(loader(tokens, y))
    assert_close(full.H, ggn, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("around", ["skip", "state", "second"])
def test_no_cut_where_earlier_layers_reach_the_output_around_the_recurrent_layer(around):
    """A skip connection, an initial state computed from earlier layers or a second recurrent
    layer: the pass is not cut, and the gradients are autograd's."""
    torch.manual_seed(0)
    model = AfterEmbedding(nn.LSTM, around=around).double().eval()
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (6, 5), generator=gen)
    f, calls = _recorded(model, tokens)
    assert recurrent_cut(f, calls) is None
    columns = torch.randn(3, *f.shape, generator=gen, dtype=torch.float64)
    got = [g for grads in OutputGradients(f, calls).columns(columns) for g in grads]
    for mine, expected in zip(got, _autograd_columns(f, calls, columns), strict=True):
        assert_close(mine, expected, rtol=1e-10, atol=1e-13)
    y = torch.randint(0, N_CLASSES, (6,), generator=gen)
    diag = DiagLaplace(model, "classification")
    diag.fit(loader(tokens, y))
    ggn = Oracle(model, "classification").ggn(tokens)
    assert_close(diag.H, ggn.diagonal(), rtol=RTOL, atol=ATOL)
