"""Model selection: train many trials at once on a few engines (Hydra's shard parallelism, model
spilling and Sharded-LRTF scheduling), from a notebook cell or plain Python."""
from colab_par.selection.halving import Halving
from colab_par.selection.results import Span, SweepResult, TrialResult
from colab_par.selection.sweep import select
from colab_par.selection.trial import Trial, grid, train_alone

__all__ = ["Trial", "grid", "select", "train_alone", "Halving", "Span", "SweepResult", "TrialResult"]
