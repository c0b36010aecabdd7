"""Resumable training on top of save/load: TrainState, data position, RNG, CheckpointManager."""
