"""Collectives that can never complete fail the cell within seconds; collectives that are merely
long, or wait for a slow peer, or run on subgroups while other ranks have returned, do not.

On the module's real 4-engine gloo world (`cluster4`): the detector repairs the world itself, so
every test here leaves it usable for the next one, which proves that too.
"""
from __future__ import annotations

import time

import pytest

from colab_par.cluster.deadlock import Wait, Watch
from colab_par.cluster.output import CollectiveDeadlockError

FAIL_WITHIN_S = 10.0
SETUP = ("import time, torch, torch.distributed as dist\n"
         "from torch.distributed.device_mesh import init_device_mesh\n"
         "kept = 10 + rank\n"
         "mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))\n")


@pytest.fixture
def world(cluster4):
    cluster4.execute(SETUP)
    return cluster4


def fails_fast(world, cell: str, **options) -> CollectiveDeadlockError:
    started = time.monotonic()
    with pytest.raises(CollectiveDeadlockError) as info:
        world.execute(cell, **options)
    assert time.monotonic() - started < FAIL_WITHIN_S
    return info.value


def assert_world_restored(world, capsys):
    generation = world.generation
    capsys.readouterr()
    world.execute("t = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item(), 'kept', kept)",
                  all_output=True)
    out = capsys.readouterr().out
    assert "sum 4.0 kept 10" in out and "[rank 3] sum 4.0 kept 13" in out
    assert world.generation == generation  # the same engines: nothing was restarted


def test_a_rank_alone_in_a_collective_fails_fast_naming_where_and_who_returned(world, capsys):
    error = fails_fast(world, "t = torch.ones(1)\n"
                              "if rank == 0:\n"
                              "    dist.all_reduce(t)\n")
    assert error.stuck.keys() == {0}
    assert "its all_reduce on the group of ranks 0,1,2,3 cannot complete: rank 1 returned" in error.stuck[0]
    assert error.gone == dict.fromkeys((1, 2, 3), "returned from the cell")
    shown = "\n".join(error._render_traceback_())
    assert "rank 0: in all_reduce (distributed_c10d.py:" in shown
    assert "at cell line 3: dist.all_reduce(t)" in shown
    assert "rank 2: returned from the cell" in shown
    assert "re-initialised" in shown and "mesh holds the old group and must be rebuilt" in shown
    assert "Connection closed" not in shown and "gloo" not in shown
    assert_world_restored(world, capsys)


def test_ranks_in_different_collectives_of_one_group_fail_fast(world, capsys):
    error = fails_fast(world, "t = torch.ones(1)\n"
                              "if rank == 0:\n"
                              "    dist.all_reduce(t)\n"
                              "else:\n"
                              "    dist.broadcast(t, src=0)\n")
    assert error.stuck.keys() == {0, 1, 2, 3} and not error.gone
    assert "rank 1 waits in broadcast on the same group" in error.stuck[0]
    assert error.waiting[0].endswith("at cell line 3: dist.all_reduce(t)")
    assert error.waiting[2].endswith("at cell line 5: dist.broadcast(t, src=0)")
    assert "its broadcast from rank 0 on the group of ranks 0,1,2,3 cannot complete" in error.stuck[2]
    assert_world_restored(world, capsys)


def test_a_subgroup_collective_whose_peer_returned_fails_fast(world, capsys):
    error = fails_fast(world, "t = torch.ones(1)\n"
                              "if rank == 0:\n"
                              "    dist.all_reduce(t, group=mesh['tp'].get_group())\n")
    assert error.stuck.keys() == {0}
    assert "on the group of ranks 0,1 cannot complete: rank 1 returned from the cell" in error.stuck[0]
    assert_world_restored(world, capsys)


def test_two_ranks_that_only_receive_fail_fast(world, capsys):
    error = fails_fast(world, "t = torch.ones(1)\n"
                              "if rank < 2:\n"
                              "    dist.recv(t, src=1 - rank)\n")
    assert error.stuck.keys() == {0, 1}
    assert "its recv from rank 1 on the group of ranks 0,1,2,3 cannot complete: rank 1 waits in recv" \
        in error.stuck[0]
    assert_world_restored(world, capsys)


def test_a_cell_on_some_ranks_that_needs_the_others_fails_fast(world, capsys):
    error = fails_fast(world, "dist.all_reduce(torch.ones(1))\n", targets=[0, 1])
    assert error.stuck.keys() == {0, 1}
    assert error.gone == {2: "is not running the cell", 3: "is not running the cell"}
    assert_world_restored(world, capsys)


def test_run_names_the_function_line_of_a_rank_left_alone(world, capsys):
    def reduce_on_rank_0():
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))

    started = time.monotonic()
    with pytest.raises(CollectiveDeadlockError) as info:
        world.run(reduce_on_rank_0)
    assert time.monotonic() - started < FAIL_WITHIN_S
    line = reduce_on_rank_0.__code__.co_firstlineno + 5
    assert info.value.waiting[0].endswith(
        f"{__file__}:{line} in reduce_on_rank_0: dist.all_reduce(torch.ones(1))")
    assert info.value.gone[3] == "returned from the function"
    assert_world_restored(world, capsys)


LONGER_THAN_THE_GRACE_S = 3.5  # the watch starts at 0.5 s and needs 1.5 s of no progress


UNTIL_ALL_STOP = ("    flag = torch.tensor([float(time.monotonic() < end)])\n"
                  "    dist.all_reduce(flag, op=dist.ReduceOp.MIN{group})\n"  # the ranks agree to stop
                  "    if not flag.item(): break\n")
LEGITIMATE = {
    "thousands of collectives of every kind among all ranks":
        "end = time.monotonic() + {s}\nt = torch.ones(1)\ncount = 0\nwhile True:\n"
        "    dist.all_reduce(t); dist.broadcast(t, src=count % 4); dist.barrier(); count += 1\n"
        + UNTIL_ALL_STOP.replace("{group}", ""),
    "dp and tp groups of a mesh in turn":
        "end = time.monotonic() + {s}\nt = torch.ones(1)\nwhile True:\n"
        "    dist.all_reduce(t, group=mesh['dp'].get_group())\n"
        "    dist.all_reduce(t, group=mesh['tp'].get_group())\n"
        + UNTIL_ALL_STOP.replace("{group}", ""),
    "a tp group at work while the other has returned":
        "end = time.monotonic() + {s}\nt = torch.ones(1)\nwhile rank < 2:\n"
        "    dist.all_reduce(t, group=mesh['tp'].get_group())\n"
        + UNTIL_ALL_STOP.replace("{group}", ", group=mesh['tp'].get_group()"),
    "a rank waiting for a slow peer of its subgroup while the others returned":
        "t = torch.ones(1)\nif rank == 1:\n    time.sleep({s})\n"
        "if rank < 2:\n    dist.all_reduce(t, group=mesh['tp'].get_group())\n",
    "every rank waits long for the last to arrive":
        "t = torch.ones(1)\nif rank == 3:\n    time.sleep({s})\ndist.barrier()\ndist.all_reduce(t)\n",
}


@pytest.mark.parametrize("cell", LEGITIMATE.values(), ids=LEGITIMATE.keys())
def test_long_legitimate_collective_work_is_not_failed(world, cell):
    answered = world.run(where_answers)
    started = time.monotonic()
    world.execute(cell.format(s=LONGER_THAN_THE_GRACE_S))
    assert time.monotonic() - started > LONGER_THAN_THE_GRACE_S
    # the watch looked all along (rank 0 works or waits to the end), and found nothing stuck
    assert world.run(where_answers)[0] - answered[0] >= 3


def where_answers() -> int:
    from colab_par.cluster import probe

    return probe.ANSWERED["where"]


# ---- the decision on its own: cases the engines above do not produce on demand -------------------
def wait(op: str, ranks=(0, 1, 2, 3), seq: int = 7, root: int | None = None, group: str = "0") -> Wait:
    return Wait(op, group, tuple(ranks), seq, root)


def watch_of(states: dict, gone=(), grace: float = 1.0) -> Watch:
    """Ranks seen in `states` at t=0 and t=2 (blocked), `gone` ranks returned at t=0."""
    watch = Watch(grace)
    for rank in gone:
        watch.gone(rank, "returned from the cell", 0.0)
    for now in (0.0, 2.0):
        for rank, state in states.items():
            watch.observe(rank, state, now)
    return watch


def test_a_broadcast_whose_root_returned_waits_while_a_relay_may_still_come():
    # ranks 1 and 3 in the broadcast, root 0 returned (it may have sent), rank 2 still computing
    receivers = {1: wait("broadcast", root=0), 3: wait("broadcast", root=0)}
    assert watch_of({**receivers, 2: None}, gone=[0]).stuck() == {}
    stuck = watch_of({1: wait("broadcast", root=0), 2: wait("broadcast", root=0),
                      3: wait("broadcast", root=0)}, gone=[0]).stuck()
    assert stuck.keys() == {1, 2, 3}  # all there, root gone past the grace: its data never came


def test_a_symmetric_collective_with_a_peer_running_or_blocked_elsewhere_that_can_finish():
    states = {0: wait("all_reduce", ranks=(0, 2), group="dp"),  # waits for 2 ...
              2: wait("all_reduce", ranks=(2, 3), group="tp")}  # ... which waits for 3, still running
    assert watch_of({**states, 3: None}).stuck() == {}
    stuck = watch_of({**states, 3: wait("all_reduce", ranks=(2, 3), group="tp", seq=9)}).stuck()
    assert stuck == {}  # 3 is in 2's collective (another seq count: p2p skews them): they finish


def test_a_cycle_of_waits_across_groups_is_stuck():
    stuck = watch_of({0: wait("all_reduce", ranks=(0, 1), group="a"),
                      1: wait("all_reduce", ranks=(0, 1), group="b")}).stuck()
    assert stuck.keys() == {0, 1} and "rank 1 waits in all_reduce on the group of ranks 0,1" in stuck[0]


def test_a_peer_that_returned_only_just_now_is_given_the_grace():
    watch = Watch(1.0)
    watch.observe(0, wait("all_reduce", ranks=(0, 1)), 0.0)
    watch.gone(1, "returned from the cell", 1.5)
    watch.observe(0, wait("all_reduce", ranks=(0, 1)), 2.0)
    assert watch.stuck() == {}  # rank 0's call may have completed with rank 1's data meanwhile
    watch.observe(0, wait("all_reduce", ranks=(0, 1)), 2.6)
    assert watch.stuck().keys() == {0}


def test_progress_on_a_group_is_never_stuck():
    watch = Watch(1.0)
    watch.gone(1, "returned from the cell", 0.0)
    for now, seq in ((0.0, 1), (1.0, 2), (2.0, 3), (3.0, 4)):  # a new call every time it is seen
        watch.observe(0, wait("all_reduce", ranks=(0, 1), seq=seq), now)
    assert watch.stuck() == {}
