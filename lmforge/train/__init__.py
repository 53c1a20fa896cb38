"""Training: the one training loop, parallelism, checkpoints, optimizers, losses and metrics."""
