"""%colossal / %%colossal through a real IPython shell on a real 2-engine gloo cluster."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from colab_par.notebook import magics
from colab_par.cluster import EngineError


def test_cell_before_start_says_how_to_start(shell):
    magics._default = None
    with pytest.raises(UsageError, match="%colossal start"):
        shell.run_cell_magic("colossal", "", "print(1)")


def test_launcher_options_belong_to_their_launcher(shell):
    magics._default = None
    with pytest.raises(UsageError, match="--partition is a Slurm job option; add --launcher slurm"):
        shell.run_line_magic("colossal", "start --partition gpu")
    with pytest.raises(UsageError, match="--launcher ssh needs --hosts, e.g. --hosts node1:2"):
        shell.run_line_magic("colossal", "start --launcher ssh")
    with pytest.raises(UsageError, match="--hosts a:two is not host:engines"):
        shell.run_line_magic("colossal", "start --launcher ssh --hosts a:two")
    assert magics._launcher(magics.line_parser().parse_args(
        ["start", "--launcher", "ssh", "--hosts", "a:2,b"])).hosts == {"a": 2, "b": 1}


def test_magic_lines_take_a_trailing_comment_and_quoted_layouts(shell):
    assert magics.parse_line("start                 # 2 CPU engines (gloo) here, one per GPU").command == "start"
    assert magics.parse_line('relayout "tp2"        # same weights and optimizer state').layout == "tp2"
    args = magics.parse_line("relayout 'tp2 sp' --model m  # a note")
    assert (args.layout, args.model) == ("tp2 sp", "m")
    assert magics.parse_line('debug --commands "p x; # kept"  # dropped').commands == "p x; # kept"
    assert magics.parse_cell_line("--layout picker  # what the picker chose").layout == "picker"
    assert magics.parse_cell_line("# only a note").targets == "all"
    magics._default = None  # the magics themselves read the line so: they get as far as the cluster
    for line in ("stop                  # done", 'relayout "tp2"  # keep weights'):
        with pytest.raises(UsageError, match="No engines are running"):
            shell.run_line_magic("colossal", line)
    with pytest.raises(UsageError, match="No engines are running"):
        shell.run_cell_magic("colossal", "--targets 0  # rank 0 alone", "print(1)")


def test_unreadable_magic_lines_are_refused_with_the_way_out():
    with pytest.raises(UsageError, match='^%colossal relayout: unrecognized arguments: sp; a layout with '
                                         'spaces goes in quotes: %colossal relayout "tp2 sp"$'):
        magics.parse_line("relayout tp2 sp")
    with pytest.raises(UsageError, match="^%colossal start: unrecognized arguments: two; a note after "
                                         "the arguments starts with #$"):
        magics.parse_line("start -n 2 two")
    for parse, prog, line in ((magics.parse_line, "%colossal", 'relayout "tp2'),
                              (magics.parse_cell_line, "%%colossal", "--layout 'dp2 zero3")):
        with pytest.raises(UsageError, match=f"^{prog}: cannot split .* \\(no closing quotation\\); close "
                                             "every quote"):
            parse(line)


def test_notebook_class_and_closure_are_shipped(on_cluster, capsys):
    on_cluster.run_cell("class Counter:\n    def __init__(self, start):\n        self.value = start * 3\n")
    on_cluster.run_cell("def make_adder(k):\n    def add(x):\n        return x + k\n    return add\n"
                        "add5 = make_adder(5)\nscale = 100")
    on_cluster.run_cell_magic("colossal", "", "result = Counter(rank).value + add5(scale)\nprint('result', result)")
    out = capsys.readouterr().out
    assert "result 105" in out  # rank 0: 0*3 + 105
    assert "[rank 1] result 108" in out  # differs from rank 0, so shown with its prefix


def test_shipped_class_keeps_super_working(on_cluster, capsys):
    on_cluster.run_cell("class Base:\n    def __init__(self):\n        self.ready = True\n"
                        "class Child(Base):\n    def __init__(self):\n        super().__init__()\n")
    on_cluster.run_cell_magic("colossal", "", "print('ready', Child().ready)")
    assert "ready True" in capsys.readouterr().out


def test_names_defined_on_engines_stay_there(on_cluster, capsys):
    on_cluster.run_cell_magic("colossal", "", "kept = rank * 7")
    on_cluster.run_cell_magic("colossal", "--all-output", "print('kept', kept)")
    out = capsys.readouterr().out
    assert "kept 0" in out and "[rank 1] kept 7" in out


def test_all_reduce_in_a_cell(on_cluster, capsys):
    on_cluster.run_cell_magic("colossal", "", "import torch, torch.distributed as dist\n"
                              "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nprint('sum', t.item())")
    out = capsys.readouterr().out
    assert out.count("sum 3.0") == 1  # identical on both ranks: printed once, by rank 0


def test_targets_run_only_the_named_ranks(on_cluster, capsys):
    on_cluster.run_cell_magic("colossal", "--targets 1   # rank 1 alone", "print('only', rank)")
    assert capsys.readouterr().out.strip() == "only 1"
    with pytest.raises(UsageError, match="ranks are 0..1"):
        on_cluster.run_cell_magic("colossal", "--targets 5", "pass")


def test_identical_errors_are_grouped_with_user_line_numbers(on_cluster):
    with pytest.raises(EngineError) as info:
        on_cluster.run_cell_magic("colossal", "", "x = 1\ny = x / 0\n")
    groups = info.value.groups
    assert len(groups) == 1 and groups[0][0] == [0, 1] and groups[0][1] == "ZeroDivisionError"
    rendered = "\n".join(info.value._render_traceback_())
    assert "[ranks 0,1] ZeroDivisionError" in rendered and "line 2" in rendered


def test_distinct_errors_are_listed_per_rank_group(on_cluster):
    with pytest.raises(EngineError) as info:
        on_cluster.run_cell_magic("colossal", "", "raise ValueError(f'bad rank {rank}')")
    assert sorted((g[0], g[2]) for g in info.value.groups) == [([0], "bad rank 0"), ([1], "bad rank 1")]


def test_cell_error_fails_the_notebook_cell(on_cluster):
    result = on_cluster.run_cell("%%colossal\nraise KeyError('missing')\n")
    assert isinstance(result.error_in_exec, EngineError)


def test_layout_option_passes_a_validated_layout(on_cluster, capsys):
    on_cluster.run_cell("chosen = 'dp2 zero3'")
    on_cluster.run_cell_magic("colossal", "--layout chosen", "print(type(layout).__name__, layout)")
    assert "Layout dp2 zero3" in capsys.readouterr().out
    from colab_par.layout import LayoutError
    on_cluster.run_cell("wrong = 'dp4'")
    with pytest.raises(LayoutError, match="world has 2 ranks"):
        on_cluster.run_cell_magic("colossal", "--layout wrong", "pass")


def test_unpicklable_values_are_skipped_with_a_note(on_cluster, capsys):
    on_cluster.run_cell("import threading\nlock = threading.Lock()")
    on_cluster.run_cell_magic("colossal", "", "try:\n    lock\n    found = True\nexcept NameError:\n"
                              "    found = False\nprint('has lock', found)")
    out = capsys.readouterr().out
    assert "not shipping 'lock'" in out and "has lock False" in out


def test_status_line_magic(on_cluster, capsys):
    on_cluster.run_line_magic("colossal", "status")
    out = capsys.readouterr().out
    assert out.count("yes") == 2 and "cpu" in out


def test_relayout_line_magic_moves_the_engine_model_keeping_its_weights(on_cluster, capsys, tmp_path):
    on_cluster.run_cell_magic("colossal", "", "import torch\nfrom colab_par import parallelize\n"
                              "from colab_par.models.gpt import GPT, GPTConfig\ntorch.manual_seed(0)\n"
                              "pm = parallelize(GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, "
                              "d_model=32, kernels='torch')), 'dp2')\n"
                              "before = {k: v.clone() for k, v in pm.full_state_dict().items()}")
    on_cluster.run_line_magic("colossal", 'relayout "tp2"        # same weights, re-sharded')
    assert "colab_par: pm now runs as tp2" in capsys.readouterr().out
    on_cluster.run_cell_magic("colossal", "--all-output",
                              "after = pm.full_state_dict()\nprint('layout', pm.layout, 'tp', pm.layout.tp, 'same',"
                              " sorted(after) == sorted(before) and all(torch.equal(before[k], after[k]) for k in before))")
    out = capsys.readouterr().out
    assert "layout tp2 tp 2 same True" in out and "[rank 1] layout tp2 tp 2 same True" in out
    with pytest.raises(EngineError, match="no engine variable 'missing'.*--model NAME"):
        on_cluster.run_line_magic("colossal", 'relayout "tp2" --model missing')
    scratch = tmp_path / "shared"  # made by the move staged in it, left empty after it
    on_cluster.run_line_magic("colossal", f'relayout "dp2" --scratch-dir {scratch}')
    assert "colab_par: pm now runs as dp2" in capsys.readouterr().out
    assert scratch.is_dir() and list(scratch.iterdir()) == []
