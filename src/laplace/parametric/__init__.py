"""Weight-space Laplace approximations: full, diagonal, Kronecker-factored and low-rank posteriors.

`base` holds `ParametricLaplace` (fit, GLM and sampled predictives) with `FullLaplace` and
`DiagLaplace`; `kron` and `lowrank` the other structures; `fit` the curvature pass over the data.
laplace-torch's paths for these classes are `laplace` and `laplace.baselaplace`.
"""
