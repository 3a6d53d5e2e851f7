"""optim."""
