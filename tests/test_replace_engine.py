"""Losing one engine, not the session: SIGKILL one of 4 real engines, `%colossal restart --dead`
replaces it in its rank's place, the three others keep their variables (and their processes), the
world has 4 ranks again, and a dp4 training run matches one-process training."""
from __future__ import annotations

import os
import signal
import sys
import time

import cloudpickle
import pytest
from IPython.core.interactiveshell import InteractiveShell

from colab_par import Cluster
from colab_par.notebook import magics
from colab_par.cluster import DeadEngineError, descendant_pids
from colab_par.cluster.engine import stack_file
from parity import assert_parity, engine_run, reference_run

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 3
SETUP = ("import torch\n"
         "from torch.distributed.device_mesh import init_device_mesh\n"
         "kept = rank * 7\n"
         "mesh = init_device_mesh('cpu', (4,))\n")


def identity():
    import os

    import torch
    import torch.distributed as dist
    from IPython import get_ipython

    ns = get_ipython().user_ns
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"kept": ns.get("kept"), "rank": ns["rank"], "local_rank": ns["local_rank"],
            "env": os.environ["LOCAL_RANK"], "world": dist.get_world_size(), "sum": total.item()}


@pytest.fixture
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "colab_par")
    yield ip
    magics._default = None


def test_a_killed_engine_is_replaced_and_the_other_ranks_keep_their_variables(shell, capsys):
    before_start = descendant_pids()
    cluster = Cluster(n=4, backend="gloo", timeout=120.0, dashboard=False).start()
    try:
        magics.use_cluster(cluster)
        shell.run_cell_magic("colossal", "", SETUP)
        pids = [row["pid"] for row in cluster.status()]
        assert all(os.path.exists(stack_file(pid)) for pid in pids)
        os.kill(pids[2], signal.SIGKILL)
        with pytest.raises(DeadEngineError, match=r"rank\(s\) 2 died"):
            shell.run_cell_magic("colossal", "", "print(kept)")
        generation = cluster.generation
        capsys.readouterr()
        started = time.monotonic()
        shell.run_line_magic("colossal", "restart --dead")
        took = time.monotonic() - started
        said = capsys.readouterr().out
        assert "colab_par: replaced the dead engine of rank 2 on " in said
        assert "The variables of rank(s) 2 are gone; it lacks init_device_mesh, kept, mesh, torch, which " \
               "the other ranks hold" in said
        assert "engine variables are kept, but mesh holds the old group and must be rebuilt" in said
        assert took < 30.0, took
        now = [row["pid"] for row in cluster.status()]
        assert [now[r] for r in (0, 1, 3)] == [pids[r] for r in (0, 1, 3)] and now[2] != pids[2]
        assert not os.path.exists(stack_file(pids[2])) and os.path.exists(stack_file(now[2]))
        assert cluster.generation == generation and cluster.devices == ["cpu"] * 4
        assert cluster.run(identity) == [
            {"kept": kept, "rank": r, "local_rank": r, "env": str(r), "world": 4, "sum": 4.0}
            for r, kept in enumerate([0, 7, None, 21])]
        assert_parity(cluster.run(engine_run, "dp4", "gpt", STEPS), reference_run("gpt", STEPS))
        assert cluster.replace_dead().startswith("no engine is dead")
    finally:
        cluster.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and descendant_pids() - before_start:
        time.sleep(0.1)
    assert not descendant_pids() - before_start  # the replacement engine is stopped with the rest
    assert not [pid for pid in {*pids, *now} if os.path.exists(stack_file(pid))]
