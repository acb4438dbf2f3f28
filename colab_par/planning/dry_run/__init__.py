"""The dry run at scale: one rank of any world size runs the kit's real `parallelize` and training
step in a fresh process, over torch's `fake` process group, traced by torch's memory tracker and
the kit's collective counter; `compare` sets the planner's prediction beside it.

  launch.py       `dry_run(model, layout, world_size, ...)`: the spawned child, its answer
  run.py          the child: fake world, build, `traced_step` (also what a real world's ranks run)
  collectives.py  collectives per mesh dimension, with their bytes
  report.py       `DryRunReport`, the per-rank value
  compare.py      the planner beside the trace, relative error per kind of memory
"""
from colab_par.planning.dry_run.launch import dry_run
from colab_par.planning.dry_run.report import CollectiveCount, DryRunReport, MemoryKinds

__all__ = ["dry_run", "DryRunReport", "MemoryKinds", "CollectiveCount"]
