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
"""
from colab_par.cluster.facade import Cluster
from colab_par.cluster.processes import descendant_pids
from colab_par.output import DeadEngineError, EngineError, RecoveryError

__all__ = ["Cluster", "EngineError", "DeadEngineError", "RecoveryError", "descendant_pids"]
