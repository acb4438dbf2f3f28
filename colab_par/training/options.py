"""The Trainer's optional parts, each one small value: what to evaluate, where to checkpoint (and
how to survive a lost engine), what to log. `Trainer(pm, data, steps=200)` needs none of them;
each checks itself when built, so a wrong option fails before any engine work."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

from colab_par.profiling.steps import ProfileSteps

__all__ = ["Evaluation", "Checkpoints", "Logs", "ON_FAILURE", "check_positive", "grouped_legacy_options"]

ON_FAILURE = ("raise", "restart")


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


@dataclass(frozen=True)
class Evaluation:
    """Held-out `data` evaluated every `every` steps and after the last (`ParallelModel.evaluate`):
    a `TokenDataset` with `batches` global batches, a `BatchList` or a list of global batches, or
    held-out rows of the kinds the Trainer's data takes (read whole each time, split over dp
    without a row read twice: `colab_par.data.eval_rows`)."""

    data: Any
    every: int
    batches: int | None = None

    def __post_init__(self) -> None:
        if self.data is None:
            raise ValueError("Evaluation(data=None): pass the held-out batches or rows")
        check_positive(every=self.every)


@dataclass(frozen=True)
class Checkpoints:
    """DCP checkpoints in `dir` (a folder every rank sees) at the end of every `fit` and every
    `every` steps. `on_failure="restart"` (needs `every`): when an engine dies while the cell runs,
    the kit restarts the engines and runs the cell again, whose `fit` resumes from the last
    committed checkpoint, at most `max_restarts` times (`Cluster.execute`); "raise" fails the cell.
    `asynchronous=True`: a save pauses the step only to copy the state to host memory and is
    written and committed beside training (`checkpoint_async.py`); `fit` waits for it at its end.

    Under "restart" the engines' memory is tried before the disk (`training/resilience`): where dp
    peers hold the same state (no ZeRO, tiers or experts) a peer's live state replaces the lost
    rank's and no step is lost; `snapshot_every=K` also copies every rank's state to a buddy rank's
    host memory every K steps ("auto": K such that snapshots cost <= 3 % of the step time), and a
    lost rank of any layout restarts from its buddy's copy, losing the steps since."""

    dir: str | os.PathLike
    every: int | None = None
    on_failure: str = "raise"
    max_restarts: int = 3
    asynchronous: bool = False
    snapshot_every: int | str | None = None

    def __post_init__(self) -> None:
        if self.dir is None:
            raise ValueError("Checkpoints(dir=None): pass a folder every rank sees, e.g. Checkpoints('ckpt')")
        if self.every is not None:
            check_positive(every=self.every)
        if self.on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure={self.on_failure!r} is not one of {', '.join(ON_FAILURE)}")
        if self.on_failure == "restart" and self.every is None:
            raise ValueError("on_failure='restart' resumes from the last checkpoint: pass every= "
                             "(e.g. Checkpoints(dir, every=50, on_failure='restart'))")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts!r} must be a whole number >= 0, e.g. 3")
        if not isinstance(self.asynchronous, bool):
            raise ValueError(f"asynchronous={self.asynchronous!r} must be True or False")
        if self.snapshot_every is not None:
            every = self.snapshot_every
            if every != "auto" and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
                raise ValueError(f"snapshot_every={every!r} must be a positive integer (steps) or 'auto'")
            if self.on_failure != "restart":
                raise ValueError("snapshot_every= keeps state for recovery: pass on_failure='restart' too "
                                 "(e.g. Checkpoints(dir, every=50, on_failure='restart', snapshot_every=5))")


@dataclass(frozen=True)
class Logs:
    """What the Trainer records: a row every `every` steps (with `telemetry`, a logged step also
    measures memory, activations, FLOPs and the grad norm), TensorBoard event files in
    `tensorboard` (rank 0), more `loggers` of the same rows (`colab_par.training.loggers`), and
    `profile_steps` (a step, ``(first, last)`` or a `ProfileSteps`) recorded with torch.profiler on
    every rank (`colab_par.profiling`)."""

    every: int = 1
    telemetry: bool = True
    tensorboard: str | os.PathLike | None = None
    loggers: tuple = ()
    profile_steps: int | tuple[int, int] | ProfileSteps | None = None

    def __post_init__(self) -> None:
        check_positive(every=self.every)
        object.__setattr__(self, "loggers", tuple(self.loggers or ()))


# the flat keywords of 0.1, each the field of one group; still taken for one release
_LEGACY = {"eval_data": ("evaluation", "data"), "eval_every": ("evaluation", "every"),
           "eval_batches": ("evaluation", "batches"), "ckpt_dir": ("checkpoints", "dir"),
           "ckpt_every": ("checkpoints", "every"), "on_failure": ("checkpoints", "on_failure"),
           "max_restarts": ("checkpoints", "max_restarts"), "log_every": ("logs", "every"),
           "telemetry": ("logs", "telemetry"), "log_dir": ("logs", "tensorboard"),
           "loggers": ("logs", "loggers"), "profile_steps": ("logs", "profile_steps")}
_GROUPS = {"evaluation": Evaluation, "checkpoints": Checkpoints, "logs": Logs}


def grouped_legacy_options(old: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The groups for a call that still uses the flat keywords (`old`), merged with the groups it
    passed (`given`), with one DeprecationWarning naming the new spelling; an unknown keyword
    raises TypeError as any call would."""
    unknown = sorted(set(old) - set(_LEGACY))
    if unknown:
        raise TypeError(f"Trainer() got unexpected keyword argument(s) {', '.join(unknown)}; its options are "
                        "steps, batch_size, lr_schedule, grad_clip, grad_accum, seed, evaluation=Evaluation(...), "
                        "checkpoints=Checkpoints(...), logs=Logs(...)")
    fields: dict[str, dict[str, Any]] = {}
    for name, value in old.items():
        group, field = _LEGACY[name]
        if given.get(group) is not None:
            raise TypeError(f"Trainer(): {name}= and {group}= both given; put {field}= in the {group} value")
        fields.setdefault(group, {})[field] = value
    if "evaluation" in fields and fields["evaluation"].get("data") is None:
        if fields["evaluation"].get("every") is not None:
            raise ValueError("eval_every is set but eval_data is None; pass "
                             "evaluation=Evaluation(held_out, every=k)")
        del fields["evaluation"]
    if "checkpoints" in fields and fields["checkpoints"].get("dir") is None:
        on_failure = fields["checkpoints"].get("on_failure", "raise")
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure={on_failure!r} is not one of {', '.join(ON_FAILURE)}")
        if fields["checkpoints"].get("every") is not None:
            raise ValueError("ckpt_every is set but ckpt_dir is None; pass checkpoints=Checkpoints('<folder>', every=k)")
        if fields["checkpoints"].get("on_failure", "raise") == "restart":
            raise ValueError("on_failure='restart' resumes from the last checkpoint: pass "
                             "checkpoints=Checkpoints('<folder>', every=50, on_failure='restart')")
        del fields["checkpoints"]
    if "evaluation" in fields and fields["evaluation"].get("every") is None:
        raise ValueError("eval_data is set but eval_every is None; pass evaluation=Evaluation(held_out, every=k)")
    spelled = ", ".join(f"{group}={_GROUPS[group].__name__}({', '.join(f'{k}=...' for k in f)})"
                        for group, f in fields.items())
    warnings.warn(f"Trainer({', '.join(f'{name}=' for name in old)}) is the 0.1 spelling; pass {spelled or 'nothing'} "
                  "(colab_par.training.options)", DeprecationWarning, stacklevel=3)
    return {**given, **{group: _GROUPS[group](**f) for group, f in fields.items()}}
