"""The dry run at scale: one rank of any world size runs the kit's real `parallelize` and training
step in a fresh process, over torch's `fake` process group, traced by torch's memory tracker and
the kit's collective counter; `compare` sets the planner's prediction beside it.

  launch.py       `dry_run(model, layout, world_size, ...)`: the spawned child, its answer
  run.py          the child: fake world, build, `traced_step` (also what a real world's ranks run)
  collectives.py  collectives per mesh dimension, with their bytes
  report.py       `DryRunReport`, the per-rank value
  roles.py        `rank_roles`: one representative rank per distinct rank role (each pp rank)
  step_time.py    `traced_step_seconds`: the traced FLOPs and bytes through the planner's device model
  compare.py      the planner beside the trace: relative error per kind of memory, bytes per collective
  verify.py       `verify`: each rank role dry-run beside the planner (the picker's Verify, `plan(verify=k)`)
"""
from colab_par.planning.dry_run.launch import dry_run
from colab_par.planning.dry_run.report import CollectiveCount, DryRunReport, MemoryKinds
from colab_par.planning.dry_run.roles import rank_roles
from colab_par.planning.dry_run.step_time import traced_step_seconds
from colab_par.planning.dry_run.verify import RoleCheck, Verification, verify

__all__ = ["dry_run", "DryRunReport", "MemoryKinds", "CollectiveCount", "rank_roles", "traced_step_seconds",
           "verify", "Verification", "RoleCheck"]
