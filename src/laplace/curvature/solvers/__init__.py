"""Iterative solvers over curvature products: Krylov methods, eigensolvers, KFAC starts."""
