"""The fits the function-space tests share: ELLA, VaLLA and the subset-of-data GP.

``regression_data`` is the one-output regression case (26 parameters) with 40 points;
``ella`` and ``valla`` build those approximations through the ``Laplace`` factory,
``_functional`` / ``_fitted_functional`` through their classes, and ``fitted_gp`` fits the
subset-of-data GP (``FunctionalLaplace`` or ``FunctionalLLLaplace``) on every point.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, PairScorer
from laplace import ELLA, Laplace, VaLLA

HYPER = {"sigma_noise": 0.6, "prior_precision": 1.7, "temperature": 0.9}


def regression_data(n: int = 40, seed: int = 0):
    case = CASE_BUILDERS["mlp_regression_1out"]()  # 26 parameters
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, dtype=torch.float64, generator=g)
    y = torch.randn(n, 1, dtype=torch.float64, generator=g)
    return case.model, X, DataLoader(TensorDataset(X, y), batch_size=7)


def ella(model, loader, subsample_size, n_eigenvalues, **kwargs):
    la = Laplace(
        model,
        kwargs.pop("likelihood", "regression"),
        "all",
        "gp",
        functional_approximation="nystrom",
        subsample_size=subsample_size,
        n_eigenvalues=n_eigenvalues,
        **kwargs,
    )
    la.fit(loader)
    return la


def valla(model, X, likelihood="regression", **kwargs):
    return Laplace(
        model,
        likelihood,
        "all",
        "gp",
        functional_approximation="variational",
        inducing_locations=X[:4].clone(),
        **kwargs,
    )


def reward_setup():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(14, 2, 3, dtype=torch.float64, generator=g)
    y = torch.randint(0, 2, (14,), generator=g)
    return PairScorer().double(), X, DataLoader(TensorDataset(X, y), batch_size=5)


def _functional(structure, model, X, **kwargs):
    if structure == "nystrom":
        return ELLA(model, "regression", subsample_size=6, n_eigenvalues=3, **kwargs)
    return VaLLA(model, "regression", X[:3].clone(), **kwargs)


def _fitted_functional(structure, model, X, loader, **kwargs):
    la = _functional(structure, model, X, **kwargs)
    la.fit(loader, **({"iterations": 2} if structure == "variational" else {}))
    return la


def fitted_gp(case, subset="all", n_subset=None, **kwargs):
    la = Laplace(
        case.model,
        case.likelihood,
        subset,
        "gp",
        n_subset=n_subset or len(case.X),
        **kwargs,
    )
    la.fit(case.loader())
    return la
