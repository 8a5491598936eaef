"""What every Laplace approximation is made of, weight space or function space.

`base` (`BaseLaplace`: hyperparameters, backend, batches, prediction options), `subsets` (which
weights), `priors` (prior precision shapes), `data_loop` and `distributed` (one pass over the
data, reduced across processes), `serialization` and `transaction` (state dicts, calls that
change nothing when they fail), `tuning` (prior precision by marginal likelihood or grid search).
"""
