"""What every Laplace approximation is made of, weight space or function space."""
