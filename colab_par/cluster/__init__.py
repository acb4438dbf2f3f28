"""The engines' lifecycle: ipyparallel controller + engines, device binding, process group, health.

One `Cluster` owns one ipyparallel cluster whose engines are the ranks of one torch.distributed
world (rank = engine order). It knows nothing about models or layouts: it starts, runs code,
reports, interrupts, restarts and stops. `Cluster` (facade.py) is a façade over rooms with one job
each, sharing one `ClusterState` (state.py):

  processes.py    this host's processes: alive, descendants, reaping (no cluster)
  health.py       which ranks died, and what a crash left in its stack file
  calls.py        reaching ranks: checked targets, direct-channel tasks, control requests, signals
  world.py        the process group: ranks by host, device binding, seeding, rendezvous
  persistence.py  the record a later kernel attaches by
  lifecycle.py    start, stop, restart: launch config, waiting for engines, reaping
  faults.py       recovery: replacing dead engines, freeing stuck ranks, re-forming the world
  execution.py    running functions and cells, the wait that never hangs, interrupts
  inspection.py   status, names, devices, post-mortem debugging, pulling variables

and the rooms both sides of the wire use:

  engine.py engine_setup.py backend.py probe.py   what runs on each engine to bind, seed and join
  launchers.py warm_pool.py idle_imports.py      how engines start (local, SSH, Slurm, MPI; pre-forked,
                                                  the pool's imports yielding to cells)
  ship.py direct.py direct_call.py lean_wire.py   names shipped by value; the direct channel
  deadlock.py task_watch.py                       divergent ranks caught in seconds
  output.py ranks.py script.py persist.py         engines' output and errors, rank lists, torchrun
                                                  scripts, the record a later kernel attaches by
  debugger.py postmortem.py pull.py               a rank debugged in place, variables pulled
  generator_engines.py                            GRPO's generator engines: a second cluster joined
                                                  to the trainers' by a bridge, one controller here
"""
import importlib
from typing import Any

_EXPORTS = {"Cluster": "colab_par.cluster.facade", "descendant_pids": "colab_par.cluster.processes",
            "EngineError": "colab_par.cluster.output", "DeadEngineError": "colab_par.cluster.output",
            "RecoveryError": "colab_par.cluster.output"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Lazily, so that an engine importing one room (`cluster.engine`) does not load the client."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'colab_par.cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
