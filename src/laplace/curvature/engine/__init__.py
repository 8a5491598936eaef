"""laplace-ng's native curvature engine: the per-sample layer rules read from module calls."""
