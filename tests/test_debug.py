"""Post-mortem debugging of one rank from the notebook (`%colossal debug`), on a real 2-engine gloo
world: pdb on the frames where rank 1's error was raised, in a function the notebook defined and
shipped by value and up in the cell, with their own source lines; the other rank untouched; the
frames (and the locals they keep alive) released at the next successful cell or on --clear."""
from __future__ import annotations

import re

from colab_par.cluster import EngineError

FUNCTION = ("def scale(x, r):\n"
            "    y = x * 10\n"
            "    if r == 1:\n"
            "        raise ValueError(f'bad scale {y}')\n"
            "    return y\n")
CELL = "a = rank + 100\nb = scale(a, rank)\n"
# an engine-defined function whose frame holds a tensor that only a kept error keeps alive
HOLDS = ("import weakref, torch\n"
         "def hold(r):\n"
         "    activations = torch.ones(1000)\n"
         "    refs.append(weakref.ref(activations))\n"
         "    if r == 1:\n"
         "        raise RuntimeError('out of luck')\n"
         "refs = []\n"
         "hold(rank)\n")


def engine_values(*names):
    from IPython import get_ipython

    return [get_ipython().user_ns.get(name) for name in names]


def alive_refs():
    import gc

    from IPython import get_ipython

    gc.collect()
    return [ref() is not None for ref in get_ipython().user_ns["refs"]]


def fail_on_rank_1(shell) -> EngineError:
    """Run the cells as a notebook does (with history: each cell gets the next number, so the
    failing cell's differs from the engines' own count of the cells they ran)."""
    shell.run_cell(FUNCTION, store_history=True)
    error = shell.run_cell("%%colossal\n" + CELL, store_history=True).error_in_exec
    assert isinstance(error, EngineError) and [group[:2] for group in error.groups] == [([1], "ValueError")]
    return error


def test_debug_inspects_a_notebook_function_and_its_cell_on_the_failed_rank(on_cluster, cluster2, capsys):
    error = fail_on_rank_1(on_cluster)
    number = on_cluster.execution_count - 1  # what the notebook shows beside the failed cell
    # the shipped function's own lines now show in the engine's traceback too, and the cell by
    # the notebook's number (not the engine's own count)
    shown = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    assert "raise ValueError(f'bad scale {y}')" in shown and f"Cell In[{number}], line 2" in shown, shown
    capsys.readouterr()
    on_cluster.run_line_magic("colossal", "debug --rank 1 --commands 'p x; p y; l; n; up; p a; ll; !a = -1'")
    out = capsys.readouterr().out
    assert "colab_par: post-mortem of rank 1: ValueError: bad scale 1010" in out
    assert re.search(r"> <notebook In\[\d+\]>\(4\)scale\(\)\n-> raise ValueError\(f'bad scale \{y\}'\)", out), out
    assert "(Pdb rank 1) p x\n101\n(Pdb rank 1) p y\n1010\n" in out
    assert "  2  \t    y = x * 10\n" in out and "  4  ->\t        raise ValueError(f'bad scale {y}')\n" in out
    assert "*** n: this is a post-mortem" in out
    assert f"(Pdb rank 1) up\n> Cell In[{number}](2)<module>()\n-> b = scale(a, rank)\n" in out, out
    assert "(Pdb rank 1) p a\n101\n" in out
    assert "  1  \ta = rank + 100\n  2  ->\tb = scale(a, rank)\n" in out
    # the statement ran in rank 1's own namespace; rank 0 was never involved
    assert cluster2.run(engine_values, "a", "b") == [[100, 1000], [-1, None]]


def test_debug_picks_the_failed_rank_and_says_when_a_rank_has_no_error(on_cluster, cluster2, capsys):
    fail_on_rank_1(on_cluster)
    capsys.readouterr()
    on_cluster.run_line_magic("colossal", "debug --rank 0")
    assert "rank 0 has no error to debug" in capsys.readouterr().out
    on_cluster.run_line_magic("colossal", "debug --commands 'p r'")  # no --rank: the one that failed
    assert "post-mortem of rank 1: ValueError" in (out := capsys.readouterr().out) and "p r\n1\n" in out
    cluster2.debug(1, commands=["u", "p b"])  # the same from Python
    assert "(Pdb rank 1) p b\n*** NameError: name 'b' is not defined\n" in capsys.readouterr().out


def test_kept_frames_are_released_at_the_next_successful_cell_and_on_clear(on_cluster, cluster2, capsys):
    assert isinstance(on_cluster.run_cell("%%colossal\n" + HOLDS).error_in_exec, EngineError)
    assert cluster2.run(alive_refs) == [[False], [True]]  # rank 1's error keeps its frame's locals
    on_cluster.run_cell_magic("colossal", "--targets 0", "pass")  # succeeds on rank 0 only
    assert cluster2.run(alive_refs) == [[False], [True]]
    on_cluster.run_cell_magic("colossal", "", "pass")
    assert cluster2.run(alive_refs) == [[False], [False]]
    capsys.readouterr()
    on_cluster.run_line_magic("colossal", "debug --rank 1")
    assert "rank 1 has no error to debug" in capsys.readouterr().out

    assert isinstance(on_cluster.run_cell("%%colossal\n" + HOLDS).error_in_exec, EngineError)
    assert cluster2.run(alive_refs) == [[False], [True]]
    capsys.readouterr()
    on_cluster.run_line_magic("colossal", "debug --clear")
    assert "released the kept error of rank(s) 1" in capsys.readouterr().out
    assert cluster2.run(alive_refs) == [[False], [False]]
