"""Bad training data, models and options given to ``fit``, for every structure and subset."""

from __future__ import annotations

import torch
from corpus import (
    BadInput,
    DictModel,
    TupleModel,
    VectorModel,
    approximation,
    clf,
    loader,
    reg,
)
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from conftest import DictDataset, dict_case
from laplace import Laplace
from laplace.curvature import AsdlHessian, BackPackGGN, CurvlinopsHessian
from laplace.utils.errors import (
    ArgumentTypeError,
    DataError,
    LabelError,
    MetaDeviceError,
    MissingKeyError,
    ModelOutputError,
)

#: (subset, structure, extra arguments) of every fit there is.
STRUCTURES = [
    ("all", "full", {}),
    ("all", "diag", {}),
    ("all", "kron", {}),
    ("all", "lowrank", {}),
    ("last_layer", "full", {}),
    ("last_layer", "diag", {}),
    ("last_layer", "kron", {}),
    ("subnetwork", "full", {}),
    ("subnetwork", "diag", {}),
    ("all", "gp", {}),
    ("last_layer", "gp", {}),
    ("all", "gp", {"functional_approximation": "nystrom", "subsample_size": 5,
                   "n_eigenvalues": 2}),
    ("all", "gp", {"functional_approximation": "variational", "inducing_locations": "random",
                   "num_inducing": 3}),
]  # fmt: skip


def _label(subset: str, structure: str, extra: dict) -> str:
    return f"{subset}/{extra.get('functional_approximation', structure)}"


def _with(change):
    """Setup: the classification case, then ``change(X, y)`` gives the bad data."""

    def setup():
        case = clf()
        return case, change(case.X.clone(), case.y.clone())

    return setup


# Every point is bad: batches are checked one by one before their own curvature (a pre-pass
# would read the data twice), and the GP subsets are random, so the first batch must be bad.
def _nan_inputs(X, y):
    X[:, 1] = float("nan")
    return X, y


def _label_4(X, y):
    y[:] = 4  # C = 4
    return X, y


#: (what is wrong, setup giving (case, (X, y)), error, words), tried on every structure.
DATA = [
    ("NaN inputs", _with(_nan_inputs), DataError, ("training inputs", "NaN or inf")),
    ("label 4 of 4 classes", _with(_label_4), LabelError, ("class label 4", "[0, C)", "C=4")),
    ("float class labels", _with(lambda X, y: (X, y.double())), DataError,
     ("integer class labels", "float64", "y.long()")),
    ("inputs on the meta device", _with(lambda X, y: (X.to("meta"), y)), MetaDeviceError,
     ("inputs", "meta device")),
    ("more targets than inputs", _with(lambda X, y: (X, y)), DataError,
     ("inputs but targets of shape", "one row per input")),
]  # fmt: skip


def _data_rows() -> list[BadInput]:
    rows = []
    for subset, structure, extra in STRUCTURES:
        label = _label(subset, structure, extra)
        for what, setup, error, words in DATA:
            if what.startswith("more targets"):
                act = _mismatched_fit(subset, structure, extra)
            else:
                act = _fit_on(subset, structure, extra)
            rows.append(BadInput("fit", f"{label} on {what}", act, error, words, setup=setup))
        rows.append(
            BadInput(
                "fit",
                f"{label} of a model returning a tuple",
                _fit_model(subset, structure, extra, TupleModel),
                ModelOutputError,
                ("return a tensor of outputs", "tuple", "out[0]"),
                setup=clf,
            )
        )
        rows.append(
            BadInput(
                "fit",
                f"{label} with a list as train_loader",
                lambda case, s=subset, h=structure, e=extra: approximation(s, h, case, **e).fit(
                    [(case.X, case.y)]
                ),
                ArgumentTypeError,
                ("train_loader", "DataLoader", "list"),
                setup=clf,
            )
        )
    return rows


def _fit_on(subset, structure, extra):
    def act(context):
        case, (X, y) = context
        approximation(subset, structure, case, **extra).fit(loader(X, y))

    return act


def _extra_target(items):
    """Collate that repeats the first target of every batch (a broken custom collate_fn)."""
    X, y = zip(*items)
    return torch.stack(X), torch.stack(y + y[:1])


def _mismatched_fit(subset, structure, extra):
    def act(context):
        case, (X, y) = context
        data = DataLoader(TensorDataset(X, y), batch_size=5, collate_fn=_extra_target)
        approximation(subset, structure, case, **extra).fit(data)

    return act


def _fit_model(subset, structure, extra, model_cls):
    def act(case):
        approximation(subset, structure, case, model_cls(), **extra).fit(case.loader())

    return act


class _Stream(IterableDataset):
    def __iter__(self):
        case = clf()
        yield from zip(case.X, case.y)


def _fit(subset="all", structure="diag", case=None, data=None, **kwargs):
    def act(c):
        case_ = case or c
        la = approximation(subset, structure, case_, **{**kwargs})
        la.fit(data(case_) if data else case_.loader())

    return act


def _first_label(label):
    def data(case):
        y = case.y.clone()
        y[0] = label
        return loader(case.X, y)

    return data


def _fit_with(**options):
    def act(case):
        approximation("all", "diag", case).fit(case.loader(), **options)

    return act


def _dict_loader(key_x="input_ids", key_y="labels"):
    model, _ = dict_case()
    X, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    return model, DataLoader(DictDataset(X, y, key_x, key_y), batch_size=4)


SPECIFIC = [
    BadInput("fit", "override given as a string", _fit_with(override="no"), ArgumentTypeError,
             ("override", "True or False", "'no'"), setup=clf),
    BadInput("distributed fit", "distributed given as a string", _fit_with(distributed="yes"),
             ArgumentTypeError, ("distributed", "True or False"), setup=clf),
    BadInput("distributed fit", "distributed=True without a process group",
             _fit_with(distributed=True), RuntimeError,
             ("distributed=True", "init_process_group"), setup=clf),
    BadInput("distributed fit", "low-rank, distributed=True without a process group",
             lambda c: approximation("all", "lowrank", c).fit(c.loader(), distributed=True),
             RuntimeError, ("init_process_group",), setup=clf),
    BadInput("fit", "low-rank update (override=False)",
             lambda c: approximation("all", "lowrank", c).fit(c.loader(), override=False),
             ValueError, ("LowRankLaplace", "override=False", "eigenpairs"), setup=clf),
    BadInput("fit", "GP subset larger than the data",
             lambda c: approximation("all", "gp", c, n_subset=21).fit(c.loader()), ValueError,
             ("n_subset=21", "N=20"), setup=clf),
    BadInput("fit", "empty loader", _fit(data=lambda c: loader(c.X[:0], c.y[:0])), ValueError,
             ("train_loader is empty",), setup=clf),
    BadInput("fit", "loader over a dataset without length",
             _fit(data=lambda c: DataLoader(_Stream(), batch_size=4)), ValueError,
             ("len(train_loader.dataset)", "no length"), setup=clf),
    BadInput("fit", "batches of three tensors",
             _fit(data=lambda c: DataLoader(TensorDataset(c.X, c.y, c.y), batch_size=4)),
             ValueError, ("(X, y) pair", "dict_key_x", "dict_key_y"), setup=clf),
    BadInput("fit", "targets that are a list",
             _fit(data=lambda c: DataLoader([(c.X[:4], [0, 1, 2, 3])], batch_size=None)),
             ArgumentTypeError, ("targets", "torch.Tensor", "list"), setup=clf),
    BadInput("fit", "dict batches without dict_key_y",
             lambda ml: Laplace(ml[0], "classification", "all", "diag").fit(ml[1]),
             MissingKeyError, ("dict_key_y='labels'", "'targets'"),
             setup=lambda: _dict_loader(key_y="targets")),
    BadInput("fit", "dict batches without dict_key_x",
             lambda ml: Laplace(ml[0], "classification", "last_layer", "kron").fit(ml[1]),
             MissingKeyError, ("dict_key_x='input_ids'", "'x'"),
             setup=lambda: _dict_loader(key_x="x")),
    BadInput("fit", "dict batches with BackPACK",
             lambda ml: Laplace(ml[0], "classification", "all", "diag",
                                backend=BackPackGGN).fit(ml[1]),
             ValueError, ("BackPackGGN cannot take dict-like inputs", "CurvlinopsGGN"),
             setup=_dict_loader),
    BadInput("fit", "infinite inputs", _fit(data=lambda c: loader(c.X / 0.0, c.y)), DataError,
             ("training inputs", "NaN or inf"), setup=clf),
    BadInput("fit", "complex inputs",
             _fit(data=lambda c: loader(c.X.to(torch.complex128), c.y)), DataError,
             ("training inputs", "complex"), setup=clf),
    BadInput("fit", "boolean class labels", _fit(data=lambda c: loader(c.X, c.y > 1)),
             DataError, ("integer class labels", "torch.bool"), setup=clf),
    BadInput("fit", "negative class label",
             _fit("all", "kron", data=_first_label(-1)),
             LabelError,
             ("class label -1", "[0, C)"), setup=clf),
    BadInput("fit", "class probabilities of the wrong width",
             _fit(data=lambda c: loader(c.X, torch.full((20, 3), 1 / 3, dtype=torch.float64))),
             DataError, ("class probabilities of shape (B, 4)", "(5, 3)"), setup=clf),
    BadInput("fit", "NaN regression targets",
             _fit("all", "full", data=lambda c: loader(c.X, c.y * float("nan"))), DataError,
             ("training targets", "NaN or inf"), setup=reg),
    BadInput("fit", "(N,) regression targets for (N, 1) outputs",
             _fit("all", "kron", data=lambda c: loader(c.X, c.y[:, 0])), ValueError,
             ("targets of shape (5,)", "output of shape (5, 1)", "not reshaped silently"),
             setup=reg),
    BadInput("fit", "boolean regression targets",
             _fit("last_layer", "full", data=lambda c: loader(c.X, c.y > 0)), DataError,
             ("regression targets", "real numbers", "torch.bool"), setup=reg),
    BadInput("fit", "regression targets with too many outputs",
             _fit("all", "diag", data=lambda c: loader(c.X, c.y.repeat(1, 2))), ValueError,
             ("targets of shape (5, 2)", "(B, 1)"), setup=reg),
    BadInput("fit", "float32 inputs for a float64 model",
             _fit(data=lambda c: loader(c.X.float(), c.y)), RuntimeError,
             ("same dtype", "Float", "Double"), setup=clf),
    BadInput("fit", "integer inputs for a float model",
             _fit("all", "full", data=lambda c: loader(c.X.long(), c.y)), RuntimeError,
             ("same dtype", "Long"), setup=clf),
    BadInput("fit", "inputs with the wrong number of features",
             _fit("last_layer", "diag", data=lambda c: loader(torch.randn(20, 5).double(), c.y)),
             RuntimeError, ("cannot be multiplied", "3x5"), setup=clf),
    BadInput("fit", "model returning a dict",
             lambda c: Laplace(DictModel(), "classification", "all", "kron").fit(c.loader()),
             ModelOutputError, ("return a tensor of outputs", "dict", "out['logits']"),
             setup=clf),
    BadInput("fit", "model returning one value per input (B,)",
             lambda c: Laplace(VectorModel(), "regression", "all", "diag").fit(
                 loader(c.X, c.y)), DataError, ("shape (5,)", "(B, C)", "(B, 1)"), setup=reg),
    BadInput("fit", "last layer: the last module is not linear",
             lambda c: Laplace(nn.Sequential(c.model, nn.Tanh()), "regression", "last_layer",
                               "full").fit(c.loader()),
             ValueError, ("linear last layer", "Tanh"), setup=reg),
    BadInput("fit", "KFAC with a Hessian backend",
             _fit("all", "kron", backend=CurvlinopsHessian), NotImplementedError,
             ("CurvlinopsHessian", "Kronecker-factored", "CurvlinopsGGN"), setup=clf),
    BadInput("fit", "last-layer KFAC with the ASDL Hessian",
             _fit("last_layer", "kron", backend=AsdlHessian), NotImplementedError,
             ("AsdlHessian", "Kronecker-factored"), setup=clf),
]  # fmt: skip

CASES = [*_data_rows(), *SPECIFIC]
