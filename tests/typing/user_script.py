"""A user's script, type-checked by ``make lint`` (mypy): the factory, fit, tuning, prediction.

Not collected by pytest; mypy reads it as a user's code would be read, with laplace-ng installed.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace import Laplace, marglik_training
from laplace.baselaplace import FullLaplace
from laplace.evaluation import evaluate

X, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
loader = DataLoader(TensorDataset(X, y), batch_size=16)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))

la = Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure="kron")
la.fit(loader)
la.optimize_prior_precision(method="marglik")
la.optimize_prior_precision(method="gridsearch", val_loader=loader)
log_marglik: torch.Tensor = la.log_marginal_likelihood()
probs = la(X, pred_type="glm", link_approx="probit")
assert isinstance(probs, torch.Tensor)  # classification: probabilities; regression: (mean, var)
predicted_class = probs.argmax(-1)
samples: torch.Tensor = la.predictive_samples(X, n_samples=10)
weights: torch.Tensor = la.sample(n_samples=5)
state = la.state_dict()
la.load_state_dict(state)
posterior_precision = la.posterior_precision
print(la.prior_precision, la.n_data, la.mean, float(log_marglik), predicted_class)

full = Laplace(model, "regression", subset_of_weights="all", hessian_structure="full")
assert isinstance(full, FullLaplace)
full.fit(DataLoader(TensorDataset(X, torch.randn(64, 3)), batch_size=16))
f_mu, f_var = full(X, pred_type="glm")
print(f_mu.shape, f_var.shape, full.posterior_covariance.shape, full.sigma_noise)

gp = Laplace(model, "classification", subset_of_weights="all", hessian_structure="gp", n_subset=32)
gp.fit(loader)
gp_probs = gp(X)
gp_log_marglik: torch.Tensor = gp.log_marginal_likelihood()

ekfac = Laplace(model, "classification", subset_of_weights="all", hessian_structure="ekfac")
ekfac.fit(loader)
ekfac.optimize_prior_precision(method="bayesopt", val_loader=loader, n_steps=3, seed=1)
inf = Laplace(model, "classification", "all", "diag_lowrank", backend_kwargs={"n_eigenvalues": 3})
inf.fit(loader)
shifted = evaluate(inf, loader, ood_loader=loader)
print(shifted["ood_fpr95"], float(ekfac.log_marginal_likelihood()))

metrics: dict = evaluate(la, loader, pred_type="glm", link_approx="probit")
print(metrics["nll"], gp_probs, float(gp_log_marglik), samples.shape, weights.shape)

la_trained, trained_model, margliks, losses = marglik_training(
    model, loader, likelihood="classification", hessian_structure="kron", n_epochs=1
)
print(la_trained.prior_precision, len(margliks), len(losses), trained_model)
