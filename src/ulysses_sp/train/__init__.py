"""Training recipe behind ``ulysses-sp train``: config, data, checkpoints, loop and metrics."""
