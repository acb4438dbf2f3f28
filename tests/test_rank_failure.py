"""One rank's error, or a collective it skipped, while the others wait in a collective, on a real
2-engine gloo world of its own.

The cell must fail within seconds (not the process-group timeout), say what failed (or that the
cell could never finish) and where the other ranks waited, bring the world back by itself and say
what that cost; the user never sees the transport errors of the ranks that merely waited.
"""
from __future__ import annotations

import re
import time

import pytest
from IPython.core.interactiveshell import InteractiveShell

from colab_par import Cluster
from colab_par.notebook import magics
from colab_par.cluster.output import CollectiveDeadlockError, RankFailureError

FAIL_WITHIN_S = 10.0
RAW_TRANSPORT = ("gloo", "Connection closed", "Timed out waiting", "DistBackendError", "RuntimeError")
SETUP = ("import torch, torch.distributed as dist\n"
         "from torch.distributed.device_mesh import init_device_mesh\n"
         "kept = 41 + rank\n"
         "mesh = init_device_mesh('cpu', (2,))\n")
# rank 1 fails before the all_reduce that rank 0 waits in, at line 5
ONE_RANK_FAILS = ("t = torch.tensor([rank + 1.0])\n"
                  "if rank == 1:\n"
                  "    raise ValueError('bad shard on rank 1')\n"
                  "\n"
                  "dist.all_reduce(t)\n")
WORLD_WORKS = "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nprint('sum', t.item(), 'kept', kept)"


@pytest.fixture(scope="module")
def world():
    cluster = Cluster(n=2, timeout=60.0, interrupt_grace=4.0, dashboard=False).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def shell(world):
    ip = InteractiveShell.instance()  # the one shell of this process, whoever made it first
    ip.run_line_magic("load_ext", "colab_par")
    magics.use_cluster(world)
    world.execute(SETUP)  # each test starts from a set-up world, whatever the one before left
    yield ip
    magics._default = None


def assert_world_works(shell, capsys, kept=(41, 42)):
    shell.run_cell_magic("colossal", "--all-output", WORLD_WORKS)
    out = capsys.readouterr().out
    assert f"sum 3.0 kept {kept[0]}" in out and f"[rank 1] sum 3.0 kept {kept[1]}" in out


def assert_no_raw_transport_error(text):
    assert not [raw for raw in RAW_TRANSPORT if raw in text], text


def test_notebook_cell_fails_fast_shows_where_rank_0_waited_and_recovers(shell, capsys):
    shell.run_cell_magic("colossal", "", SETUP)
    started = time.monotonic()
    result = shell.run_cell("%%colossal\n" + ONE_RANK_FAILS)  # as a notebook runs it
    elapsed = time.monotonic() - started
    shown = capsys.readouterr().out  # what IPython printed for the failed cell
    assert elapsed < FAIL_WITHIN_S, (elapsed, shown)
    error = result.error_in_exec
    assert isinstance(error, RankFailureError)
    assert [group[:3] for group in error.groups] == [([1], "ValueError", "bad shard on rank 1")]
    assert "ValueError: bad shard on rank 1" in shown
    assert "rank 0: in all_reduce (distributed_c10d.py" in shown
    assert "at cell line 5: dist.all_reduce(t)" in shown
    assert "re-initialised" in shown and "mesh holds the old group and must be rebuilt" in shown
    assert_no_raw_transport_error(shown)
    assert_world_works(shell, capsys)


def test_execute_reports_the_cell_line_inside_a_function_of_the_cell(world, shell, capsys):
    started = time.monotonic()
    with pytest.raises(RankFailureError) as info:
        world.execute("def combine(t):\n    dist.all_reduce(t)\n    return t\n"
                      "if rank == 1:\n    raise ValueError('bad shard on rank 1')\n"
                      "combine(torch.ones(1))\n")
    assert time.monotonic() - started < FAIL_WITHIN_S
    assert list(info.value.waiting) == [0]
    assert re.fullmatch(r"in all_reduce \(distributed_c10d\.py:\d+\) at cell line 2: dist\.all_reduce\(t\)",
                        info.value.waiting[0])
    assert_no_raw_transport_error("\n".join(info.value._render_traceback_()))
    assert_world_works(shell, capsys)


def waits_in_all_reduce():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("missing batch")
    dist.all_reduce(torch.ones(1))


def test_run_reports_the_function_line_and_recovers(world, shell, capsys):
    started = time.monotonic()
    with pytest.raises(RankFailureError) as info:
        world.run(waits_in_all_reduce)
    assert time.monotonic() - started < FAIL_WITHIN_S
    assert [group[:2] for group in info.value.groups] == [([1], "KeyError")]
    where = info.value.waiting[0]
    assert where.startswith("in all_reduce (") and where.endswith(
        f"{__file__}:{waits_in_all_reduce.__code__.co_firstlineno + 6} in waits_in_all_reduce: "
        "dist.all_reduce(torch.ones(1))")
    assert_world_works(shell, capsys)


def test_collective_timeout_is_explained_and_the_sleeping_rank_interrupted(world, shell, capsys):
    started = time.monotonic()
    with pytest.raises(RankFailureError) as info:
        world.execute("import datetime, time\n"
                      "short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))\n"
                      "if rank == 0:\n    dist.all_reduce(torch.ones(1), group=short)\n"
                      "else:\n    time.sleep(60)\n")
    assert time.monotonic() - started < 2.0 + FAIL_WITHIN_S
    error = info.value
    assert [(g[0], g[1]) for g in error.groups] == [([0], "BrokenProcessGroup")]
    assert "timed out in a collective" in error.groups[0][2]
    assert error.waiting == {1: "cell line 6: time.sleep(60)"}  # a C function: no frame of its own
    rendered = "\n".join(error._render_traceback_())
    assert "mesh, short hold the old group" in rendered
    assert_no_raw_transport_error(rendered)
    assert_world_works(shell, capsys)


def test_waits_the_watch_cannot_name_time_out_and_the_group_is_repaired(world, shell, capsys):
    # both ranks only receive, through work handles of their own: no torch.distributed collective
    # call to name, so only the group's (short) timeout ends it
    with pytest.raises(RankFailureError) as info:
        world.execute("import datetime\n"
                      "short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))\n"
                      "dist.irecv(torch.ones(1), src=1 - rank, group=short).wait()\n")
    error = info.value
    # the first time-out is the cause; the other rank's lost connection is its consequence
    assert len(error.groups) == 1 and error.groups[0][1] == "BrokenProcessGroup"
    assert error.groups[0][2].startswith("timed out in a collective")
    assert "re-initialised" in error.recovery
    assert_no_raw_transport_error("\n".join(error._render_traceback_()))
    assert_world_works(shell, capsys)


def test_notebook_cell_where_one_rank_skipped_a_collective_fails_fast_and_recovers(shell, capsys):
    started = time.monotonic()
    result = shell.run_cell("%%colossal\nt = torch.tensor([rank + 1.0])\nif rank == 0:\n"
                            "    dist.all_reduce(t)\n")
    elapsed = time.monotonic() - started
    shown = capsys.readouterr().out
    assert elapsed < FAIL_WITHIN_S, (elapsed, shown)
    assert isinstance(result.error_in_exec, CollectiveDeadlockError)
    assert re.search(r"rank 0: in all_reduce \(distributed_c10d\.py:\d+\) at cell line 3: dist\.all_reduce\(t\)\n"
                     r" +its all_reduce on the group of ranks 0,1 cannot complete: rank 1 returned from the cell\n"
                     r"  rank 1: returned from the cell\n", shown), shown
    assert "re-initialised" in shown and re.search(r"but mesh\b.* the old group and must be rebuilt", shown)
    assert_no_raw_transport_error(shown)
    assert_world_works(shell, capsys)


def test_rank_stuck_where_nothing_reaches_it_gets_fresh_engines(world, shell, capsys):
    generation = world.generation
    with pytest.raises(RankFailureError) as info:
        # rank 0 blocks inside C++ (a store wait) that neither the group's abort nor SIGINT ends
        world.execute("import datetime\n"
                      "store = dist.HashStore()\nstore.set_timeout(datetime.timedelta(seconds=120))\n"
                      "if rank == 0:\n    store.wait(['never set'])\n"
                      "else:\n    raise ValueError('bad shard on rank 1')\n")
    assert world.generation == generation + 1
    assert info.value.waiting == {0: "cell line 5: store.wait(['never set'])"}
    assert "engines and the process group were restarted" in info.value.recovery
    shell.run_cell_magic("colossal", "", "import torch, torch.distributed as dist\nkept = 'new'")
    assert_world_works(shell, capsys, kept=("new", "new"))


GRPO_SETUP = ("from colab_par import GRPO, Completions, parallelize\n"
              "from colab_par.models import GPT, GPTConfig\n"
              "torch.manual_seed(0)\n"
              "pm = parallelize(GPT(GPTConfig(vocab_size=32, seq_len=16, n_layer=1, n_head=2, d_model=16,\n"
              "                               kernels='torch')), 'dp2')\n"
              "def fussy(prompts, completions, **columns):\n"
              "    if rank == 1 and [7, 8] in prompts:\n"
              "        raise ValueError('no score for this prompt on rank 1')\n"
              "    return [float(len(c)) for c in completions]\n"
              "grpo = GRPO(pm, [[3, 4], [7, 8]], fussy, group_size=2, max_completion_length=4, steps=1,\n"
              "            prompts_per_step=2, seed=0, completions=Completions(eos_token_id=2))\n")


def test_a_grpo_reward_raising_on_one_rank_fails_the_cell_within_seconds_naming_it(world, shell, capsys):
    """Rank 0 scores its rows and waits in the rewards' agreement check; rank 1's reward raises."""
    shell.run_cell_magic("colossal", "", GRPO_SETUP)
    capsys.readouterr()
    started = time.monotonic()
    result = shell.run_cell("%%colossal\ngrpo.fit()\n")
    elapsed = time.monotonic() - started
    shown = capsys.readouterr().out
    assert elapsed < FAIL_WITHIN_S, (elapsed, shown)
    error = result.error_in_exec
    assert isinstance(error, RankFailureError), shown
    [(ranks, kind, message, *_)] = error.groups
    assert (ranks, kind) == ([1], "RewardFunctionError")
    assert message.startswith("reward function 'fussy' raised ValueError: no score for this prompt on rank 1 "
                              "on row 2 (prompt [7, 8]"), message
    assert "rank 0: in all_reduce" in shown and "_check_ranks_agree" in shown
    assert_no_raw_transport_error(shown)
    assert_world_works(shell, capsys)
