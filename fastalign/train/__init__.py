"""The training engine: loop, distribution, memory, checkpoints and objectives."""
