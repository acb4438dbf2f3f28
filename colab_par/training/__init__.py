"""On the engines: the Trainer, its logs and telemetry, checkpoints and recovery."""
