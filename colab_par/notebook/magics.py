"""``%colossal`` / ``%%colossal``: argument parsing and IPython registration only.

Everything here is a thin layer over `colab_par.Cluster` and `colab_par.cluster.ship`, so a Python user
can do the same without magics.
"""
from __future__ import annotations

import argparse
import shlex
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from colab_par.cluster import ranks
from colab_par.cluster import Cluster
from colab_par.cluster.debugger import split_commands
from colab_par.cluster.output import size_text
from colab_par.cluster.persist import running_clusters
from colab_par.cluster.launchers import SSH, Launcher, Slurm
from colab_par.cluster.ship import names_assigned, values_to_ship

__all__ = ["ColossalMagics", "default_cluster", "use_cluster", "shutdown_default_cluster", "parse_ranks",
           "relayout_engine_variable", "parse_line", "parse_cell_line"]

_default: Cluster | None = None
_NOT_STARTED = ("No engines are running. Start them first with `%colossal start` "
                "(e.g. `%colossal start -n 2`).")


def default_cluster() -> Cluster | None:
    """The cluster `%colossal start` made in this kernel, if any."""
    return _default


def use_cluster(cluster: Cluster) -> None:
    """Adopt a running `Cluster` made in Python as the one `%%colossal` cells run on."""
    global _default
    if not cluster.running:
        raise ValueError("that cluster is not running; call cluster.start() first")
    _default = cluster


def shutdown_default_cluster() -> None:
    global _default
    if _default is not None:
        _default.stop()
        _default = None


def parse_ranks(text: str, world: int) -> list[int]:
    """`colab_par.cluster.ranks.parse_ranks`, its refusals shown as the magic's usage errors."""
    try:
        return ranks.parse_ranks(text, world)
    except ValueError as error:
        raise UsageError(str(error)) from None


def relayout_engine_variable(model: str, layout: str, trainer: str, scratch_dir: str | None = None) -> str:
    """On each engine: replace the ParallelModel in variable `model` by the same model re-laid out
    as `layout` (`colab_par.training.checkpoint.relayout`, staging in `scratch_dir`), re-pointing the Trainer
    in `trainer` if any."""
    from IPython import get_ipython

    from colab_par.training.checkpoint import relayout

    user_ns = get_ipython().user_ns
    if model not in user_ns:
        raise NameError(f"no engine variable {model!r}: name the one holding your ParallelModel "
                        "with --model NAME")
    user_ns[model] = relayout(user_ns[model], layout, trainer=user_ns.get(trainer), scratch_dir=scratch_dir)
    return str(user_ns[model].layout)


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as IPython UsageError instead of exiting the kernel."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")


def line_parser() -> _Parser:
    """`%colossal`'s arguments (`parse_line` reads a line with them)."""
    parser = _Parser(prog="%colossal", add_help=False)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    start = sub.add_parser("start", add_help=False)
    start.add_argument("-n", type=int, default=None, help="engines (default: one per GPU, or 2 on CPU)")
    start.add_argument("--backend", choices=["nccl", "gloo"], default=None)
    start.add_argument("--launcher", choices=["local", "mpi", "slurm", "ssh"], default="local")
    start.add_argument("--timeout", type=float, default=300.0)
    start.add_argument("--seed", type=int, default=0, help="engines' torch and random seed (default 0)")
    for option in _SLURM_OPTIONS:
        start.add_argument(f"--{option.replace('_', '-')}", default=None,
                           type=int if option in ("nodes", "gpus_per_node") else str,
                           help="with --launcher slurm: the job's " + option.replace("_", " "))
    start.add_argument("--hosts", default=None, help="with --launcher ssh: node1:2,node2:2")
    start.add_argument("--persist", action="store_true",
                       help="leave the engines running when the kernel exits (join them with attach)")
    sub.add_parser("status", add_help=False)
    stop = sub.add_parser("stop", add_help=False)
    stop.add_argument("id", nargs="?", default=None, help="a persisted cluster (see list); default: this kernel's")
    restart = sub.add_parser("restart", add_help=False)
    restart.add_argument("--dead", action="store_true",
                         help="replace only the dead engines; the other ranks keep their variables")
    attach = sub.add_parser("attach", add_help=False)
    attach.add_argument("id", nargs="?", default=None, help="a persisted cluster's id (default: the newest)")
    sub.add_parser("list", add_help=False)
    debug = sub.add_parser("debug", add_help=False)
    debug.add_argument("--rank", type=int, default=None,
                       help="the rank to debug (default: the first whose error is its own)")
    debug.add_argument("--commands", default=None, help='pdb commands, e.g. "p x; up; p y" (default: asked)')
    debug.add_argument("--clear", action="store_true", help="release the kept errors' frames instead")
    pull = sub.add_parser("pull", add_help=False)
    pull.add_argument("name", help="engine variable, or a dotted path (pm.model.lm_head.weight)")
    pull.add_argument("--rank", type=int, default=0)
    pull.add_argument("--as", dest="target", default=None, help="notebook variable to set (default: the name)")
    relayout = sub.add_parser("relayout", add_help=False)
    relayout.add_argument("layout", help='new layout, e.g. "tp2"')
    relayout.add_argument("--model", default="pm", help="engine variable holding the ParallelModel")
    relayout.add_argument("--trainer", default="trainer",
                          help="engine variable holding its Trainer, re-pointed if it exists")
    relayout.add_argument("--scratch-dir", default=None,
                          help="folder every engine can read to stage the move in (required when "
                               "the engines span several hosts; default: the system temp dir)")
    return parser


def split_arguments(line: str, prog: str) -> list[str]:
    """A magic line's words as a shell splits them: quotes group, and an unquoted `#` starts a
    comment, so a line copied with its trailing `# ...` note runs as it reads."""
    try:
        return shlex.split(line, comments=True)
    except ValueError as error:  # shlex's only refusals: an open quote, a trailing backslash
        raise UsageError(f"{prog}: cannot split {line.strip()!r} into arguments ({str(error).lower()}); "
                         'close every quote (a value with spaces goes in one pair: "tp2 sp") and end '
                         "the line without a backslash") from None


def parse_line(line: str) -> argparse.Namespace:
    """`%colossal`'s arguments from its line (also read by `colab-par export`)."""
    args, extra = line_parser().parse_known_args(split_arguments(line, "%colossal"))
    if extra:
        hint = (f'; a layout with spaces goes in quotes: %colossal relayout "{args.layout} {" ".join(extra)}"'
                if args.command == "relayout" and not any(word.startswith("-") for word in extra) else
                "; a note after the arguments starts with #")
        prog = " ".join(filter(None, ("%colossal", args.command)))
        raise UsageError(f"{prog}: unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def parse_cell_line(line: str) -> argparse.Namespace:
    """`%%colossal`'s arguments from its first line (also read by `colab-par export`)."""
    return cell_parser().parse_args(split_arguments(line, "%%colossal"))


def cell_parser() -> _Parser:
    """`%%colossal`'s arguments (`parse_cell_line` reads a line with them)."""
    parser = _Parser(prog="%%colossal", add_help=False)
    parser.add_argument("--targets", default="all", help="ranks to run on: 0 | 0,1 | 0-3 | all")
    parser.add_argument("--all-output", action="store_true", help="show every rank's output")
    parser.add_argument("--layout", default=None,
                        help="notebook variable holding a LayoutPicker, a Layout or a layout string")
    parser.add_argument("--profile", nargs="?", const="", default=None, metavar="DIR",
                        help="record the cell with torch.profiler on every rank and show the timeline; "
                             "traces go to DIR (default: a new folder under ./colab_par_traces)")
    return parser


_SLURM_OPTIONS = ("partition", "account", "time", "nodes", "gpus_per_node")


def _launcher(args: argparse.Namespace) -> str | Launcher:
    """`--launcher` with the options that belong to it; an option for another launcher is refused."""
    slurm = {key: getattr(args, key) for key in _SLURM_OPTIONS if getattr(args, key) is not None}
    if slurm and args.launcher != "slurm":
        raise UsageError(f"--{next(iter(slurm)).replace('_', '-')} is a Slurm job option; add "
                         "--launcher slurm")
    if args.hosts is not None and args.launcher != "ssh":
        raise UsageError("--hosts names the hosts of --launcher ssh; add --launcher ssh")
    if args.launcher == "slurm":
        return Slurm(**slurm)
    if args.launcher == "ssh":
        if not args.hosts:
            raise UsageError("--launcher ssh needs --hosts, e.g. --hosts node1:2,node2:2")
        try:
            return SSH({host: int(count or 1) for host, _, count in
                        (item.partition(":") for item in args.hosts.split(","))})
        except ValueError:
            raise UsageError(f"--hosts {args.hosts} is not host:engines,...; e.g. "
                             "--hosts node1:2,node2:2") from None
    return args.launcher


@magics_class
class ColossalMagics(Magics):
    """`%colossal start|status|stop|restart|attach|list|debug|pull|relayout` and `%%colossal`."""

    def __init__(self, shell: Any):
        super().__init__(shell)
        self._engine_names: set[str] = set()
        self._generation = 0

    @line_cell_magic
    def colossal(self, line: str, cell: str | None = None) -> None:
        if cell is None:
            return self._line(line)
        return self._cell(line, cell)

    # ---- line magic -----------------------------------------------------------------------------
    def _line(self, line: str) -> None:
        global _default
        args = parse_line(line)
        if args.command is None:
            raise UsageError("usage: %colossal start [-n N] [--backend B] [--launcher L] [--persist] | "
                             "status | stop [ID] | restart [--dead] | attach [ID] | list | "
                             "debug [--rank R] [--commands C] [--clear] | pull NAME [--rank R] | "
                             "relayout LAYOUT")
        if args.command == "start":
            if _default is None or not _default.running:
                _default = Cluster(args.n, backend=args.backend, launcher=_launcher(args),
                                   timeout=args.timeout, seed=args.seed, persist=args.persist)
            _default.start()
            print(f"colab_par: {_default.n} engines ready ({_default.backend}, "
                  f"devices {', '.join(_default.devices)})"
                  + (f"; they outlive this kernel: join them from another with `%colossal attach "
                     f"{_default.cluster_id}`, end them with `%colossal stop`" if _default.persist else ""))
            return
        if args.command == "list":
            return _print_clusters(running_clusters())
        if args.command == "attach":
            return self._attach(args.id)
        if args.command == "stop":
            if args.id is not None and (_default is None or _default.cluster_id != args.id):
                Cluster.attach(args.id).stop()
                print(f"colab_par: cluster {args.id} stopped")
                return
            self._cluster()
            shutdown_default_cluster()
            print("colab_par: engines stopped")
            return
        cluster = self._cluster()
        if args.command == "restart" and args.dead:
            print(f"colab_par: {cluster.replace_dead()}")
        elif args.command == "restart":
            cluster.restart()
            print(f"colab_par: {cluster.n} fresh engines ready; engine variables were cleared")
        elif args.command == "debug" and args.clear:
            released = cluster.clear_errors(None if args.rank is None else [args.rank])
            print(f"colab_par: released the kept error of rank(s) {', '.join(map(str, released))}"
                  if released else "colab_par: no rank kept an error")
        elif args.command == "debug":
            cluster.debug(args.rank, None if args.commands is None else split_commands(args.commands))
        elif args.command == "pull":
            target = args.target or args.name.rsplit(".", 1)[-1]
            if not target.isidentifier():
                raise UsageError(f"--as {target!r} is not a Python name; e.g. --as weights")
            self.shell.user_ns[target] = cluster.pull(args.name, args.rank)
            print(f"colab_par: {target} = {args.name} of rank {args.rank} ({_summary(self.shell.user_ns[target])})")
        elif args.command == "status":
            _print_status(cluster.status())
        elif args.command == "relayout":
            from colab_par.layout import Layout

            layout = Layout.parse(args.layout).validate(cluster.n)
            now = cluster.run(relayout_engine_variable, args.model, str(layout), args.trainer,
                              args.scratch_dir)[0]
            print(f"colab_par: {args.model} now runs as {now}")

    # ---- cell magic -----------------------------------------------------------------------------
    def _cell(self, line: str, cell: str) -> None:
        args = parse_cell_line(line)
        cluster = self._cluster()
        if cluster.generation != self._generation:  # fresh engines know none of the old names
            self._engine_names, self._generation = set(), cluster.generation
        targets = parse_ranks(args.targets, cluster.n)
        user_ns = self.shell.user_ns
        namespace = values_to_ship(cell, user_ns, self._engine_names, on_skip=_warn_skipped)
        if args.layout is not None:
            namespace["layout"] = _resolve_layout(args.layout, user_ns, cluster.n)
        # a notebook runs each cell with history: the count already names the next cell
        options = dict(targets=targets, all_output=args.all_output, namespace=namespace,
                       cell_number=self.shell.execution_count - 1,
                       fresh_namespace=lambda: {**values_to_ship(cell, user_ns, (), on_skip=_warn_skipped),
                                                **namespace})
        try:
            if args.profile is None:
                cluster.execute(cell, **options)
            else:
                display(cluster.profile(cell, trace_dir=args.profile or None, **options))
        finally:
            if cluster.generation != self._generation:  # restarted during the cell: its names alone live
                self._engine_names, self._generation = set(), cluster.generation
            self._engine_names |= names_assigned(cell)

    def _attach(self, cluster_id: str | None) -> None:
        global _default
        if _default is not None and _default.running:
            if _default.cluster_id == cluster_id or cluster_id is None and _default.persist:
                print(f"colab_par: already attached to cluster {_default.cluster_id}")
                return
            raise UsageError(f"this kernel already runs cluster {_default.cluster_id}; `%colossal stop` "
                             "it first (or attach from another notebook)")
        _default = Cluster.attach(cluster_id)
        self._engine_names, self._generation = set(_default.names(0)), _default.generation
        print(f"colab_par: attached to cluster {_default.cluster_id}: {_default.n} engines "
              f"({_default.backend}, devices {', '.join(_default.devices)}), started "
              f"{_age(time.time() - _default.created)} ago; engine variables are where they were")

    def _cluster(self) -> Cluster:
        if _default is None or not _default.running:
            raise UsageError(_NOT_STARTED)
        return _default


def _resolve_layout(name: str, user_ns: dict[str, Any], world: int) -> Any:
    """A picker, a Layout or a layout string -> a Layout validated for this world, in the notebook."""
    from colab_par.layout import Layout

    if name in user_ns:
        value = user_ns[name]
        layout = value.layout if hasattr(value, "layout") and not isinstance(value, Layout) else value
    else:
        layout = name  # a literal like --layout "dp2 zero3"
    return Layout.parse(layout).validate(world)


def _warn_skipped(name: str, reason: str) -> None:
    print(f"colab_par: not shipping {name!r} to the engines (cannot be pickled: {reason})")


def _print_clusters(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("colab_par: no persisted cluster is running on this host")
        return
    print(f"{'id':<18} {'age':>9} {'engines':>8} {'backend':<8} {'launcher':<8} {'memory':>11}  started by")
    for row in rows:
        print(f"{row['id']:<18} {_age(row['age_s']):>9} {row['engines_alive']:>4}/{row['engines']:<3} "
              f"{row['backend']:<8} {row['launcher']:<8} {size_text(row['memory_bytes']):>11}  "
              f"pid {row['started_by_pid']}")


def _age(seconds: float) -> str:
    minutes, hours = int(seconds // 60), int(seconds // 3600)
    return f"{hours}h {minutes % 60:02d}m" if hours else f"{minutes}m {int(seconds) % 60:02d}s"


def _summary(value: Any) -> str:
    """A few words on a pulled value: a tensor's dtype and shape, a state dict's size."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        size = sum(v.numel() * v.element_size() for v in value.values())
        return f"state dict of {len(value)} tensors, {size_text(size)}"
    return type(value).__name__


def _print_status(rows: list[dict[str, Any]]) -> None:
    print(f"{'rank':>4} {'host':<16} {'pid':>8} {'device':<8} {'alive':<6} {'memory':>10}")
    for row in rows:
        memory = "busy" if row.get("busy") else (
            f"{row['memory_bytes'] / 2**20:.0f} MiB" if row["memory_bytes"] is not None else "-")
        print(f"{row['rank']:>4} {row['host'][:16]:<16} {row['pid']:>8} {row['device']:<8} "
              f"{'yes' if row['alive'] else 'DEAD':<6} {memory:>10}")
