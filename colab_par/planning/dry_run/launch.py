"""`dry_run`: one rank of any world size, traced in a fresh process.

Fresh and spawned because the caller may already be a rank of a real world (an engine) or hold
threads a fork would copy half-way; the fake world, its process groups and the model live and die
in the child, and nothing of them reaches the caller but the report.
"""
from __future__ import annotations

import multiprocessing
from typing import Any

from colab_par.layout import Layout
from colab_par.planning.dry_run.report import DryRunReport
from colab_par.planning.dry_run.run import child_main, model_factory

__all__ = ["dry_run"]


def dry_run(model: Any, layout: "Layout | str", world_size: int, *, rank: int = 0,
            batch: tuple[int, int], tensors: str = "real", steps: int = 2, seed: int = 0,
            timeout: float = 600.0) -> DryRunReport:
    """Trace rank `rank`'s training step of `model` under `layout` in a `world_size` world.

    `model`: a GPTConfig, a Hugging Face config or a picklable zero-argument factory (it is built
    in the child, on meta first, by the kit's `parallelize`). `batch`: the GLOBAL (batch, seq) of
    token batches. `tensors`: "real" allocates the rank's tensors for real (small models: what
    a real world of the same size measures), "fake" allocates nothing (`FakeTensorMode`: any size).
    The child runs `steps` (>= 2) steps and traces the last (from the second on, Adam's
    state exists; the one before counts the FLOPs). Raises ValueError (LayoutError) before starting anything for a layout that does
    not fit the world, RuntimeError with the child's traceback if the step fails, TimeoutError
    after `timeout` seconds. (A script calling it needs the `if __name__ == "__main__":` guard
    every spawned process needs; a notebook does not.)"""
    layout = Layout.parse(layout)
    if layout.world_size != world_size:
        raise ValueError(f"layout {layout} spans {layout.world_size} ranks, not world_size={world_size}; "
                         f"give a layout whose sizes multiply to {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside a world of {world_size}; choose 0..{world_size - 1}")
    if tensors not in ("real", "fake"):
        raise ValueError(f"tensors={tensors!r}; choose 'real' (allocated: small models) or 'fake' (no storage)")
    if steps < 2 or len(batch) != 2 or min(batch) < 1:
        raise ValueError(f"steps={steps}, batch={batch!r}: give steps >= 2 (the traced step needs one before "
                         "it) and batch=(global batch, seq len)")
    model_factory(model)  # refuses what cannot cross to the child, before it starts
    if not callable(model):  # a config: the layout's rules apply before any process starts
        layout.validate(world_size, model, global_batch=batch[0])
    request = dict(model=model, layout=str(layout), world_size=world_size, rank=rank,
                   batch=tuple(batch), tensors=tensors, steps=steps, seed=seed)
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=child_main, args=(request, send), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(timeout):
            raise TimeoutError(f"the dry run of {layout} (rank {rank} of {world_size}) took over {timeout:.0f} s; "
                               "give a larger timeout= or a smaller batch")
        status, value = receive.recv()
    except EOFError:
        child.join(5)
        raise RuntimeError(f"the dry run's process died (exit code {child.exitcode}) before answering, "
                           "e.g. out of host memory: try a smaller model or batch") from None
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join()
    if status == "error":
        raise RuntimeError(f"the dry run of {layout} (rank {rank} of {world_size}) failed in its process:\n{value}")
    return value
