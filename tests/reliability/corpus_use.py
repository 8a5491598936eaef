"""Bad calls on fitted approximations: predictives, sampling, tuning, the marginal likelihood."""

from __future__ import annotations

import torch
from corpus import BadInput, fitted, loader, reg

from laplace.utils.errors import ArgumentTypeError, DataError, LabelError, MetaDeviceError

#: Fitted approximations the predictive rows run on: (label, subset, structure, extra).
PREDICTORS = [
    ("full", "all", "full", {}),
    ("kron", "all", "kron", {}),
    ("last-layer diag", "last_layer", "diag", {}),
    ("subnetwork", "subnetwork", "full", {}),
    ("GP", "all", "gp", {}),
]


def _on(subset, structure, extra, call):
    def setup():
        return fitted(subset, structure, **extra)

    return setup, lambda context: call(*context)


#: (what is wrong, call(case, la), error, words), tried on every predictor.
PREDICTIONS = [
    ("unknown pred_type", lambda c, la: la(c.X[:2], pred_type="bayes"), ValueError,
     ("pred_type='bayes'", "'glm'")),
    ("unknown link_approx", lambda c, la: la(c.X[:2], link_approx="logit"), ValueError,
     ("link_approx='logit'", "'probit'", "'bridge'")),
    ("empty inputs", lambda c, la: la(c.X[:0]), ValueError,
     ("at least one input", "empty batch")),
    ("NaN inputs", lambda c, la: la(c.X[:3] * float("nan")), DataError,
     ("inputs of the prediction", "NaN or inf")),
    ("inputs on the meta device", lambda c, la: la(c.X[:3].to("meta")), MetaDeviceError,
     ("inputs", "meta device")),
    ("inputs as a list", lambda c, la: la(c.X[:3].tolist()), ArgumentTypeError,
     ("inputs", "torch.Tensor", "dict-like", "list")),
    ("an integer generator", lambda c, la: la(c.X[:3], link_approx="mc", generator=3),
     ArgumentTypeError, ("generator", "torch.Generator", "manual_seed")),
    ("joint=True for class probabilities", lambda c, la: la(c.X[:3], joint=True), ValueError,
     ("joint=True", "class probabilities", "joint=False")),
    ("n_samples=0 with the MC link",
     lambda c, la: la(c.X[:3], link_approx="mc", n_samples=0), ValueError,
     ("n_samples", "positive integer", "0")),
    ("fractional n_samples", lambda c, la: la(c.X[:3], link_approx="mc", n_samples=2.5),
     TypeError, ("n_samples", "positive integer", "2.5")),
]  # fmt: skip

GLM_ONLY = [
    ("pred_type='nn' with the probit link", lambda c, la: la(c.X[:2], pred_type="nn"),
     ValueError, ("pred_type='nn'", "link_approx='mc'")),
    ("pred_type='gp' for a weight-space posterior", lambda c, la: la(c.X[:2], pred_type="gp"),
     ValueError, ("pred_type='gp'", "'glm' or 'nn'")),
    ("functional_samples with n_samples=-1",
     lambda c, la: la.functional_samples(c.X[:2], n_samples=-1), ValueError,
     ("n_samples", "positive integer", "-1")),
    ("predictive_samples of NaN inputs",
     lambda c, la: la.predictive_samples(c.X[:2] / 0.0, n_samples=3), DataError,
     ("functional_samples", "NaN or inf")),
    ("the NN predictive of meta-device inputs",
     lambda c, la: la._nn_predictive_samples(c.X[:2].to("meta"), 3), MetaDeviceError,
     ("meta device",)),
]  # fmt: skip

SAMPLING = [
    ("sample(0)", lambda c, la: la.sample(0), ValueError, ("n_samples", "positive integer")),
    ("sample(-2)", lambda c, la: la.sample(-2), ValueError, ("n_samples", "-2")),
    ("sample('3')", lambda c, la: la.sample("3"), TypeError, ("n_samples", "'3'")),
    ("sample(2.5)", lambda c, la: la.sample(2.5), TypeError, ("n_samples", "2.5")),
    ("sample with a seed as generator", lambda c, la: la.sample(3, generator=0), TypeError,
     ("generator", "torch.Generator")),
]  # fmt: skip


def _rows() -> list[BadInput]:
    rows = []
    for label, subset, structure, extra in PREDICTORS:
        table = PREDICTIONS + (GLM_ONLY if structure != "gp" else [])
        for what, call, error, words in table:
            setup, act = _on(subset, structure, extra, call)
            rows.append(BadInput("predictive", f"{label}: {what}", act, error, words, setup=setup))
        if structure == "gp":
            continue
        for what, call, error, words in SAMPLING:
            setup, act = _on(subset, structure, extra, call)
            rows.append(BadInput("sample", f"{label}: {what}", act, error, words, setup=setup))
    return rows


def _tune(**kwargs):
    def call(case, la):
        la.optimize_prior_precision(**kwargs)

    return call


def _grid(**kwargs):
    def call(case, la):
        la.optimize_prior_precision(
            method="gridsearch", val_loader=case.loader(), **{"grid_size": 3, **kwargs}
        )

    return call


def _val_labels(case, la):
    y = case.y.clone()
    y[0] = 7
    la.optimize_prior_precision(method="gridsearch", val_loader=loader(case.X, y), grid_size=3)


TUNING = [
    ("unknown method", _tune(method="bayes"), ValueError, ("method='bayes'", "'marglik'")),
    ("unknown prior_structure", _tune(prior_structure="block"), ValueError,
     ("prior_structure='block'", "'layerwise'")),
    ("negative n_steps", _tune(n_steps=-1), ValueError, ("n_steps", "integer >= 0", "-1")),
    ("fractional n_steps", _tune(n_steps=2.5), TypeError, ("n_steps", "2.5")),
    ("lr=0", _tune(lr=0.0), ValueError, ("lr", "positive, finite")),
    ("NaN lr", _tune(lr=float("nan")), ValueError, ("lr", "nan")),
    ("negative init_prior_prec", _tune(init_prior_prec=-1.0), ValueError,
     ("init_prior_prec", "positive")),
    ("init_prior_prec of the wrong length", _tune(init_prior_prec=torch.ones(7)), ValueError,
     ("prior_precision has length 7", "n_layers=4", "n_params=44")),
    ("grid search without val_loader", _tune(method="gridsearch"), ValueError,
     ("gridsearch", "val_loader")),
    ("grid_size=0", _grid(grid_size=0), ValueError, ("grid_size", "positive integer")),
    ("negative grid base", _grid(log_prior_prec_base=-10), ValueError,
     ("log_prior_prec_base", "positive")),
    ("grid base 1", _grid(log_prior_prec_base=1), ValueError, ("log_prior_prec_base", "1")),
    ("infinite grid end", _grid(log_prior_prec_max=float("inf")), ValueError,
     ("log_prior_prec_max", "finite")),
    ("string grid start", _grid(log_prior_prec_min="-4"), TypeError,
     ("log_prior_prec_min", "real number")),
    ("a loss that is not callable", _grid(loss=3), TypeError, ("loss", "callable", "int")),
    ("empty validation loader",
     lambda c, la: la.optimize_prior_precision(method="gridsearch", grid_size=3,
                                               val_loader=loader(c.X[:0], c.y[:0])),
     ValueError, ("val_loader", "no batches")),
    ("validation label out of range", _val_labels, LabelError,
     ("class label 7", "C=4")),
    ("unknown link_approx in grid search", _grid(link_approx="softmax"), ValueError,
     ("link_approx='softmax'",)),
    ("n_samples=0 in MC grid search", _grid(link_approx="mc", n_samples=0), ValueError,
     ("n_samples", "positive integer")),
]  # fmt: skip

MARGLIK = [
    ("negative prior_precision", lambda c, la: la.log_marginal_likelihood(-1.0), ValueError,
     ("prior_precision", "positive")),
    ("prior_precision of the wrong length",
     lambda c, la: la.log_marginal_likelihood(torch.ones(7)), ValueError,
     ("prior_precision has length 7",)),
    ("string prior_precision", lambda c, la: la.log_marginal_likelihood("1"), TypeError,
     ("prior_precision", "str")),
    ("sigma_noise for classification",
     lambda c, la: la.log_marginal_likelihood(sigma_noise=torch.tensor(2.0)), ValueError,
     ("sigma_noise must be 1",)),
    ("complex prior_precision",
     lambda c, la: la.log_marginal_likelihood(torch.tensor([1 + 2j])), TypeError,
     ("prior_precision", "complex")),
]  # fmt: skip


def _tuning_rows() -> list[BadInput]:
    rows = []
    for structure in ("full", "diag"):
        for what, call, error, words in TUNING:
            setup, act = _on("all", structure, {}, call)
            rows.append(
                BadInput(
                    "optimize_prior_precision",
                    f"{structure}: {what}",
                    act,
                    error,
                    words,
                    setup=setup,
                )
            )
    for structure in ("full", "kron", "gp"):
        for what, call, error, words in MARGLIK:
            if structure == "gp" and "wrong length" in what:
                continue
            setup, act = _on("all", structure, {}, call)
            rows.append(
                BadInput(
                    "log_marginal_likelihood",
                    f"{structure}: {what}",
                    act,
                    error,
                    words,
                    setup=setup,
                )
            )
    return rows


def _row(entry, name, call, error, words, subset="all", structure="full", case=None):
    def setup():
        return fitted(subset, structure, case() if case else None)

    return BadInput(entry, name, lambda context: call(*context), error, words, setup=setup)


SPECIFIC = [
    _row("optimize_prior_precision", "subnetwork with a layer-wise prior",
         _tune(prior_structure="layerwise"), ValueError,
         ("subnetwork", "'scalar' or 'diag'", "not 'layerwise'"), "subnetwork", "diag"),
    _row("optimize_prior_precision", "GP with a diagonal prior", _tune(prior_structure="diag"),
         ValueError, ("FunctionalLaplace", "prior_structure='scalar'"), "all", "gp"),
    _row("optimize_prior_precision", "GP with pred_type='glm'", _tune(pred_type="glm"),
         ValueError, ("FunctionalLaplace", "pred_type='gp'"), "all", "gp"),
    _row("optimize_prior_precision", "kron with a diagonal prior",
         _tune(prior_structure="diag"), ValueError, ("KronLaplace", "n_layers=4"), "all",
         "kron"),
    _row("log_marginal_likelihood", "regression with a negative sigma_noise",
         lambda c, la: la.log_marginal_likelihood(sigma_noise=-0.5), ValueError,
         ("sigma_noise", "positive"), "all", "diag", reg),
    _row("log_marginal_likelihood", "regression with a matrix sigma_noise",
         lambda c, la: la.log_marginal_likelihood(sigma_noise=torch.ones(2, 2)), ValueError,
         ("sigma_noise must be a scalar", "(2, 2)"), "last_layer", "kron", reg),
]  # fmt: skip

CASES = [*_rows(), *_tuning_rows(), *SPECIFIC]
