"""Bad input to marglik_training, state dicts, FeatureExtractor, SubnetMasks and backends."""

from __future__ import annotations

import io

import torch
from corpus import BadInput, approximation, clf, fitted, loader, reg
from torch import nn

from laplace import DiagLaplace, FullLaplace, marglik_training
from laplace.curvature import (
    AsdlGGN,
    BackPackEF,
    BackPackGGN,
    CurvlinopsEF,
    CurvlinopsGGN,
    CurvlinopsHessian,
)
from laplace.utils import (
    FeatureExtractor,
    LargestMagnitudeSubnetMask,
    LargestVarianceDiagLaplaceSubnetMask,
    LargestVarianceSWAGSubnetMask,
    LastLayerSubnetMask,
    ModuleNameSubnetMask,
    ParamNameSubnetMask,
    RandomSubnetMask,
)
from laplace.utils.errors import LabelError


def _train(case=None, train_loader=None, **kwargs):
    def act(c):
        c = case() if case else c
        marglik_training(
            c.model,
            train_loader(c) if train_loader else c.loader(),
            **{"likelihood": c.likelihood, "n_epochs": 1, "n_hypersteps": 1, **kwargs},
        )

    return act


MARGLIK_TRAINING = [
    ("unknown likelihood", _train(likelihood="poisson"), ValueError, ("likelihood='poisson'",)),
    ("hessian_structure='gp'", _train(hessian_structure="gp"), ValueError,
     ("marglik_training", "'full', 'kron', 'diag'", "'gp'")),
    ("unknown prior_structure", _train(prior_structure="block"), ValueError,
     ("prior_structure='block'",)),
    ("negative n_epochs", _train(n_epochs=-1), ValueError, ("n_epochs", "integer >= 0")),
    ("fractional n_epochs", _train(n_epochs=1.5), TypeError, ("n_epochs", "1.5")),
    ("marglik_frequency=0", _train(marglik_frequency=0), ValueError,
     ("marglik_frequency", "positive integer")),
    ("negative n_hypersteps", _train(n_hypersteps=-1), ValueError, ("n_hypersteps",)),
    ("negative n_epochs_burnin", _train(n_epochs_burnin=-2), ValueError, ("n_epochs_burnin",)),
    ("lr_hyp=0", _train(lr_hyp=0.0), ValueError, ("lr_hyp", "positive, finite")),
    ("prior_prec_init=0", _train(prior_prec_init=0.0), ValueError,
     ("prior_prec_init", "positive")),
    ("sigma_noise_init for classification", _train(sigma_noise_init=2.0), ValueError,
     ("sigma_noise must be 1",)),
    ("sigma_noise_init=0 for regression", _train(reg, sigma_noise_init=0.0), ValueError,
     ("sigma_noise", "positive")),
    ("temperature=0", _train(temperature=0.0), ValueError, ("temperature", "positive")),
    ("optimizer_cls as a string", _train(optimizer_cls="adam"), TypeError,
     ("optimizer_cls", "class")),
    ("optimizer_kwargs as a list", _train(optimizer_kwargs=[("lr", 1)]), TypeError,
     ("optimizer_kwargs", "dict")),
    ("scheduler_cls as a string", _train(scheduler_cls="cosine"), TypeError,
     ("scheduler_cls", "class")),
    ("backend that is not a backend", _train(backend=object), TypeError,
     ("backend", "CurvatureInterface")),
    ("reward modelling with full", _train(likelihood="reward_modeling",
                                          hessian_structure="full"),
     ValueError, ("reward_modeling", "'kron'")),
    ("model that is not a module", lambda c: marglik_training(None, c.loader()), TypeError,
     ("model", "torch.nn.Module", "NoneType")),
    ("model without trainable parameters",
     lambda c: marglik_training(c.model.requires_grad_(False), c.loader(), n_epochs=1),
     ValueError, ("requires_grad",)),
    ("empty loader", _train(train_loader=lambda c: loader(c.X[:0], c.y[:0])), ValueError,
     ("train_loader is empty",)),
    ("loader that is a list", _train(train_loader=lambda c: [(c.X, c.y)]), TypeError,
     ("train_loader", "DataLoader")),
    ("label out of range", _train(train_loader=lambda c: loader(c.X, c.y + 4)), LabelError,
     ("class label", "C=4")),
    ("NaN inputs", _train(train_loader=lambda c: loader(c.X * float("nan"), c.y)), ValueError,
     ("training inputs", "NaN")),
    ("distributed given as a string", _train(distributed="yes"), TypeError,
     ("distributed", "True or False")),
]  # fmt: skip


def _state(structure="full", subset="all", case=clf):
    def setup():
        c, la = fitted(subset, structure, case())
        return c, la.state_dict(), subset, structure

    return setup


def _load(change):
    def act(context):
        case, state, subset, structure = context
        state = dict(state)
        change(state)
        approximation(subset, structure, case).load_state_dict(state)

    return act


def _truncated_file(context):
    case, state, subset, structure = context
    buffer = io.BytesIO()
    torch.save({k: v for k, v in state.items() if k != "H"}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    approximation(subset, structure, case).load_state_dict(loaded)


def _set(key, value):
    return lambda state: state.__setitem__(key, value)


def _drop(key):
    return lambda state: state.pop(key)


def _scale(key, factor):
    return lambda state: state.__setitem__(key, state[key] * factor)


STATE_DICTS = [
    ("None", _state(), lambda c: FullLaplace(c[0].model, "classification").load_state_dict(None),
     TypeError, ("state_dict", "dict", "NoneType")),
    ("the model's own state_dict", _state(),
     lambda c: FullLaplace(c[0].model, "classification").load_state_dict(
         c[0].model.state_dict()),
     KeyError, ("missing the entries", "'cls_name'", "'0.weight'")),
    ("without H (truncated file, weights_only=True)", _state(), _truncated_file, KeyError,
     ("missing the entries", "'H'")),
    ("without n_outputs", _state("diag"), _load(_drop("n_outputs")), KeyError,
     ("'n_outputs'",)),
    ("NaN curvature", _state(), _load(_scale("H", float("nan"))), ValueError,
     ("state_dict['H']", "NaN or inf")),
    ("integer curvature", _state("diag"), _load(lambda s: s.__setitem__("H", s["H"].long())),
     TypeError, ("state_dict['H']", "floating-point", "int64")),
    ("Kronecker factors with inf", _state("kron"),
     _load(lambda s: s["H"][0].__setitem__(0, s["H"][0][0] / 0.0)), ValueError,
     ("state_dict['H']", "NaN or inf")),
    ("curvature of the wrong shape", _state(), _load(lambda s: s.__setitem__("H", s["H"][:-1])),
     ValueError, ("state_dict['H']", "(43, 44)", "(44, 44)")),
    ("low-rank state without eigenvalues", _state("lowrank"),
     _load(lambda s: s.__setitem__("H", {"eigenvectors": s["H"]["eigenvectors"]})), ValueError,
     ("'eigenvectors' and 'eigenvalues'",)),
    ("NaN loss", _state(), _load(_set("loss", torch.tensor(float("nan")))), ValueError,
     ("state_dict['loss']", "NaN")),
    ("mean that is a string", _state(), _load(_set("mean", "θ")), TypeError,
     ("state_dict['mean']", "floating-point", "str")),
    ("negative n_data", _state(), _load(_set("n_data", -1)), ValueError,
     ("state_dict['n_data']", "positive integer")),
    ("n_data as a string", _state("diag"), _load(_set("n_data", "20")), TypeError,
     ("state_dict['n_data']", "'20'")),
    ("negative prior precision", _state(), _load(_scale("prior_precision", -1)), ValueError,
     ("prior_precision", "positive")),
    ("negative temperature", _state("diag"), _load(_set("temperature", -1.0)), ValueError,
     ("temperature", "positive")),
    ("enable_backprop as a string", _state(), _load(_set("enable_backprop", "no")), TypeError,
     ("enable_backprop", "True or False")),
    ("another class", _state(), _load(_set("cls_name", "DiagLaplace")), ValueError,
     ("cls_name", "'DiagLaplace'", "'FullLaplace'")),
    ("another likelihood", _state(), _load(_set("likelihood", "regression")), ValueError,
     ("likelihood", "'regression'", "'classification'")),
    ("another architecture", _state(), _load(_set("param_shapes", [[1]])), ValueError,
     ("param_shapes", "[[1]]")),
    ("other MAP weights", _state(), _load(_scale("mean", 2.0)), ValueError,
     ("weights differ from the posterior mean",)),
    ("last layer state without its layer", _state("diag", "last_layer"),
     _load(_drop("last_layer_name")), KeyError, ("'last_layer_name'",)),
    ("last layer state of another layer", _state("full", "last_layer"),
     _load(_set("last_layer_name", "0")), ValueError, ("param_names", "'2.weight'", "'0.weight'")),
    ("subnetwork state of other indices", _state("full", "subnetwork"),
     _load(_set("subnetwork_indices", torch.tensor([1, 2]))), ValueError,
     ("other subnetwork_indices",)),
    ("GP state without its kernel", _state("gp"), _load(_drop("K_MM")), KeyError,
     ("missing the entries", "'K_MM'")),
    ("GP state with NaN kernel", _state("gp"), _load(_scale("K_MM", float("nan"))),
     ValueError, ("state_dict['K_MM']", "NaN")),
    ("GP state that is a list", _state("gp"),
     lambda c: approximation("all", "gp", c[0]).load_state_dict([("mean", 1)]), TypeError,
     ("state_dict", "dict", "list")),
]  # fmt: skip


def _never_fitted(context):
    return FullLaplace(context.model, "classification").state_dict()


FEATURE_EXTRACTOR = [
    ("model None", lambda c: FeatureExtractor(None), TypeError, ("model", "nn.Module")),
    ("unknown last_layer_name", lambda c: FeatureExtractor(c.model, last_layer_name="fc"),
     KeyError, ("'fc'", "not a module", "['0', '2']")),
    ("last layer that is not linear", lambda c: FeatureExtractor(c.model, last_layer_name="1"),
     ValueError, ("linear last layer", "ReLU")),
    ("unknown feature_reduction",
     lambda c: FeatureExtractor(c.model, feature_reduction="sum"), ValueError,
     ("feature_reduction='sum'", "'pick_last'")),
    ("found twice",
     lambda c: FeatureExtractor(c.model, last_layer_name="2").find_last_layer(c.X[:2]),
     ValueError, ("already known", "'2'")),
    ("set to a missing layer",
     lambda c: FeatureExtractor(c.model).set_last_layer("head"), KeyError, ("'head'",)),
    ("last module not linear",
     lambda c: FeatureExtractor(nn.Sequential(c.model, nn.ReLU())).find_last_layer(c.X[:2]),
     ValueError, ("linear last layer", "ReLU")),
]  # fmt: skip

SUBNET_MASKS = [
    ("model None", lambda c: RandomSubnetMask(None, 3), TypeError, ("model", "nn.Module")),
    ("n_params_subnet=0", lambda c: RandomSubnetMask(c.model, 0), ValueError,
     ("n_params_subnet", "positive integer")),
    ("n_params_subnet larger than the model",
     lambda c: LargestMagnitudeSubnetMask(c.model, 45), ValueError,
     ("n_params_subnet", "44", "45")),
    ("fractional n_params_subnet", lambda c: RandomSubnetMask(c.model, 2.5), TypeError,
     ("n_params_subnet", "2.5")),
    ("n_params_subnet as a string", lambda c: RandomSubnetMask(c.model, "3"), TypeError,
     ("n_params_subnet", "'3'")),
    ("a full Laplace for the variance mask",
     lambda c: LargestVarianceDiagLaplaceSubnetMask(c.model, 3,
                                                    FullLaplace(c.model, "classification")),
     TypeError, ("diag_laplace_model", "DiagLaplace", "FullLaplace")),
    ("variance mask without a loader",
     lambda c: LargestVarianceDiagLaplaceSubnetMask(
         c.model, 3, DiagLaplace(c.model, "classification")).select(),
     ValueError, ("train_loader", "select(train_loader)")),
    ("SWAG with a negative learning rate",
     lambda c: LargestVarianceSWAGSubnetMask(c.model, 3, swag_lr=-0.1), ValueError,
     ("swag_lr", "positive")),
    ("SWAG with zero snapshots",
     lambda c: LargestVarianceSWAGSubnetMask(c.model, 3, swag_n_snapshots=0), ValueError,
     ("swag_n_snapshots", "positive integer")),
    ("SWAG with reward modelling",
     lambda c: LargestVarianceSWAGSubnetMask(c.model, 3, likelihood="reward_modeling"),
     ValueError, ("'classification' or 'regression'",)),
    ("parameter names as one string",
     lambda c: ParamNameSubnetMask(c.model, "0.weight"), TypeError,
     ("parameter_names", "list of names")),
    ("unknown parameter name", lambda c: ParamNameSubnetMask(c.model, ["fc.weight"]).select(),
     ValueError, ("['fc.weight']", "do not exist")),
    ("empty parameter names", lambda c: ParamNameSubnetMask(c.model, []).select(), ValueError,
     ("must not be empty",)),
    ("module name without parameters",
     lambda c: ModuleNameSubnetMask(c.model, ["1"]).select(), ValueError,
     ("'1'", "no trainable parameters")),
    ("module with children", lambda c: ModuleNameSubnetMask(c.model, [""]).select(),
     ValueError, ("has children", "leaf modules")),
    ("last layer mask of a missing layer",
     lambda c: LastLayerSubnetMask(c.model, "fc"), KeyError, ("'fc'",)),
    ("selected twice", lambda c: _select_twice(RandomSubnetMask(c.model, 3)), ValueError,
     ("already selected",)),
    ("float mask", lambda c: RandomSubnetMask(c.model, 3).convert_subnet_mask_to_indices(
        torch.ones(44)), ValueError, ("subnet_mask", "boolean or integer", "float32")),
    ("mask of the wrong length",
     lambda c: RandomSubnetMask(c.model, 3).convert_subnet_mask_to_indices(
         torch.ones(3, dtype=torch.bool)), ValueError, ("subnet_mask", "n_params=44")),
    ("indices before select", lambda c: RandomSubnetMask(c.model, 3).indices, AttributeError,
     ("not selected yet", "select()")),
]  # fmt: skip


def _select_twice(mask):
    mask.select()
    mask.select()


BACKENDS = [
    (f"{backend.__name__}: {what}", call, error, words)
    for backend in (CurvlinopsGGN, CurvlinopsEF, CurvlinopsHessian, AsdlGGN, BackPackGGN)
    for what, call, error, words in [
        ("unknown likelihood", lambda c, b=backend: b(c.model, "poisson"), ValueError,
         ("likelihood='poisson'",)),
        ("model None", lambda c, b=backend: b(None, "classification"), TypeError,
         ("model", "nn.Module")),
    ]
] + [
    ("CurvlinopsGGN: unknown kfac_approx",
     lambda c: CurvlinopsGGN(c.model, "classification", kfac_approx="mean"), ValueError,
     ("kfac_approx", "'expand'", "'reduce'")),
    ("CurvlinopsGGN: num_samples=0",
     lambda c: CurvlinopsGGN(c.model, "classification", stochastic=True, num_samples=0),
     ValueError, ("num_samples", "positive integer")),
    ("CurvlinopsGGN: mc_samples=0",
     lambda c: CurvlinopsGGN(c.model, "classification", stochastic=True).full(
         c.X, c.y, mc_samples=0), ValueError, ("mc_samples", "positive integer")),
    ("CurvlinopsGGN: label out of range",
     lambda c: CurvlinopsGGN(c.model, "classification").full(c.X, c.y + 4), LabelError,
     ("class label", "C=4")),
    ("CurvlinopsHessian: kron", lambda c: CurvlinopsHessian(c.model, "classification").kron(
        c.X, c.y, 20), NotImplementedError, ("Kronecker-factored",)),
    ("BackPackEF: kron", lambda c: BackPackEF(c.model, "classification").kron(c.X, c.y, 20),
     NotImplementedError, ("empirical Fisher", "AsdlEF")),
    ("CurvlinopsGGN: KFAC of a BatchNorm in training mode",
     lambda c: CurvlinopsGGN(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4),
                                           nn.Linear(4, 4)).double(),
                             "classification").kron(c.X, c.y, 20),
     ValueError, ("'1'", "BatchNorm1d", "batch statistics", "model.eval()")),
    ("CurvlinopsGGN: Jacobians of a list",
     lambda c: CurvlinopsGGN(c.model, "classification").jacobians([1.0, 2.0]), TypeError,
     ("list",)),
]  # fmt: skip

CASES = [
    *[BadInput("marglik_training", n, a, e, w, setup=clf) for n, a, e, w in MARGLIK_TRAINING],
    *[BadInput("load_state_dict", n, a, e, w, setup=s) for n, s, a, e, w in STATE_DICTS],
    BadInput("state_dict", "before fit", _never_fitted, RuntimeError, ("call fit",), setup=clf),
    BadInput("state_dict", "of a GP before fit",
             lambda c: approximation("all", "gp", c).state_dict(), AttributeError,
             ("call fit",), setup=clf),
    *[BadInput("FeatureExtractor", n, a, e, w, setup=clf) for n, a, e, w in FEATURE_EXTRACTOR],
    *[BadInput("SubnetMask", n, a, e, w, setup=clf) for n, a, e, w in SUBNET_MASKS],
    *[BadInput("backend", n, a, e, w, setup=clf, spied=False) for n, a, e, w in BACKENDS],
    BadInput("backend", "meta-device inputs to the Jacobians",
             lambda c: CurvlinopsGGN(c.model, "classification").jacobians(c.X.to("meta")),
             RuntimeError, ("meta",), setup=clf, spied=False),
]  # fmt: skip
