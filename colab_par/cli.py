"""`colab-par demo`: the whole kit in one command, from engines to a summary table; and
`colab-par export`: a notebook as a torchrun script (`colab_par/notebook/export.py`).

Starts engines (one per GPU, or 2 CPU engines on gloo), asks the planner for the best layout of the
reference GPT on this machine, trains it on real text (the Python standard library's sources),
shows the dashboard's progress lines, prints a summary, writes the dashboard PNG and a CSV of every
rank's rows, and stops the engines. Every option is checked before an engine starts.
"""
from __future__ import annotations

import argparse
import csv
import io
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main", "DemoSettings", "demo_settings", "choose_layout", "train_on_engine", "run_export"]


@dataclass(frozen=True)
class DemoSettings:
    """What the demo trains: model sizes and batch, sized for a small CPU or for GPUs."""

    engines: int
    device: str  # planner catalogue name, or "cpu" (measured)
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int
    global_batch: int
    steps: int
    lr: float
    max_text_bytes: int

    def model_config(self) -> Any:
        from colab_par.models import GPTConfig

        return GPTConfig(vocab_size=256, seq_len=self.seq_len, n_layer=self.n_layer,
                         n_head=self.n_head, d_model=self.d_model)


def demo_settings(engines: int | None, steps: int | None) -> DemoSettings:
    """A GPT that trains visibly within a minute on 2 CPU cores, or a GPT-2-small-sized one on GPUs."""
    gpus = _visible_gpus()
    if gpus:
        return DemoSettings(engines or gpus, _catalogue_name(), n_layer=12, n_head=12, d_model=768,
                            seq_len=512, global_batch=8 * (engines or gpus), steps=steps or 300,
                            lr=6e-4, max_text_bytes=64 << 20)
    return DemoSettings(engines or 2, "cpu", n_layer=4, n_head=4, d_model=128, seq_len=64,
                        global_batch=8, steps=steps or 40, lr=2e-3, max_text_bytes=4 << 20)


def choose_layout(settings: DemoSettings, requested: str | None) -> Any:
    """The requested layout validated for this world and model, or the planner's best plan."""
    from colab_par.layout import Layout
    from colab_par.planning.planner import plan

    config = settings.model_config()
    if requested is not None:
        return Layout.parse(requested).validate(settings.engines, config,
                                                global_batch=settings.global_batch)
    best = plan(config, settings.engines, device=settings.device, global_batch=settings.global_batch,
                seq_len=settings.seq_len, top=1)[0]
    return best.layout


def train_on_engine(settings: DemoSettings, layout: str) -> dict:
    """Runs on every engine: parallelize the GPT, train it on stdlib text, return this rank's rows."""
    import torch
    import colab_par
    from colab_par.data import TextDataset
    from colab_par.models import GPT
    from colab_par.training.trainer import WarmupCosine

    torch.manual_seed(0)
    pm = colab_par.parallelize(GPT(settings.model_config()), layout,
                               optimizer_fn=lambda params: torch.optim.AdamW(params, lr=settings.lr))
    data = TextDataset(seq_len=settings.seq_len, batch_size=settings.global_batch,
                       max_bytes=settings.max_text_bytes)
    trainer = colab_par.Trainer(pm, data, steps=settings.steps, grad_clip=1.0,
                                lr_schedule=WarmupCosine(max(1, settings.steps // 10), settings.steps))
    trainer.fit()
    return {"rows": trainer.history}


# ---- reporting -------------------------------------------------------------------------------
def summary_table(results: list[dict], layout: str, seconds: float) -> str:
    """Loss first/last, tokens/s and per-rank memory, as plain text."""
    rows0 = results[0]["rows"]
    steady = [r["tokens_per_s"] for r in rows0[1:] if r.get("tokens_per_s")] or \
             [r["tokens_per_s"] for r in rows0 if r.get("tokens_per_s")]
    lines = [f"layout {layout} · {len(results)} ranks · {len(rows0)} steps in {seconds:.1f} s",
             f"loss first {rows0[0]['loss']:.4f} · last {rows0[-1]['loss']:.4f}",
             f"tokens/s (mean after step 1) {sum(steady) / max(len(steady), 1):,.0f}",
             "", f"{'rank':>4} {'params':>9} {'grads':>9} {'optimizer':>9} {'activations':>11} "
             f"{'total':>9} {'on host':>9}  (MiB at the last step, measured on each rank)"]
    for rank, result in enumerate(results):
        last = result["rows"][-1]
        activations = last.get("mem_activations") or 0
        lines.append(f"{rank:>4} {_mib(last['mem_params']):>9} {_mib(last['mem_grads']):>9} "
                     f"{_mib(last['mem_optimizer']):>9} {_mib(activations):>11} "
                     f"{_mib(last['mem_total'] + activations):>9} {_mib(last.get('mem_host_total') or 0):>9}")
    return "\n".join(lines)


def write_csv(results: list[dict], path: Path) -> None:
    """Every rank's rows in one file, ordered by step then rank."""
    rows = sorted((row for result in results for row in result["rows"]), key=lambda r: (r["step"], r["rank"]))
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def dashboard_png(results: list[dict], steps: int) -> bytes:
    """The live dashboard's final frame, drawn from the rows the engines returned."""
    from colab_par.views.dashboard import LiveDashboard
    from colab_par.training.telemetry import metrics_data

    dashboard = LiveDashboard(mode="text", stream=io.StringIO())
    dashboard.update([metrics_data({"rank": rank, "total_steps": steps, "done": True}, result["rows"])
                      for rank, result in enumerate(results)])
    return dashboard.png()


# ---- command line ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="colab-par", description="colab_par from a terminal.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="train the reference GPT on real text with the planner's layout",
        description="Start engines, train the reference GPT on the Python standard library's "
                    "sources with a layout chosen by the planner, print a summary, write the "
                    "dashboard PNG and a CSV, stop the engines.")
    demo.add_argument("--engines", type=_positive_int, default=None,
                      help="number of engines (default: one per GPU, or 2 CPU engines on gloo)")
    demo.add_argument("--layout", default=None,
                      help='parallel layout, e.g. "dp2 zero3" or "tp2 sp" (default: the planner\'s '
                           "best layout for this machine)")
    demo.add_argument("--steps", type=_positive_int, default=None,
                      help="optimizer steps (default: 40 on CPU, 300 on GPUs)")
    demo.add_argument("--out", type=Path, default=Path("out/demo"),
                      help="folder for dashboard.png and run.csv (default: out/demo)")
    demo.set_defaults(handler=run_demo, parser=demo)
    export = commands.add_parser(
        "export", help="write a notebook's training as one torchrun script",
        description="Translate a notebook into a standalone script: ordinary cells run once on rank "
                    "0, %%%%colossal cells on every rank with the notebook values they use. Run it "
                    "with `torchrun --nproc-per-node N SCRIPT`. Lines that only a notebook can run "
                    "(other magics, widgets, plots) are named and stop the export unless "
                    "--drop-unsupported.")
    export.add_argument("notebook", type=Path, help="the .ipynb to export")
    export.add_argument("-o", "--output", type=Path, default=None,
                        help="script to write (default: the notebook's name with .py)")
    export.add_argument("--drop-unsupported", action="store_true",
                        help="comment out (and list) the lines a script cannot run instead of stopping")
    export.add_argument("--slurm", action="store_true", help="also write SCRIPT.sbatch (srun + torchrun)")
    export.add_argument("--nodes", type=_positive_int, default=1, help="--slurm: nodes (default 1)")
    export.add_argument("--procs-per-node", type=_positive_int, default=None,
                        help="--slurm: processes per node (default: --gpus-per-node, else the "
                             "notebook's engine count, else 2)")
    export.add_argument("--gpus-per-node", type=int, default=0, help="--slurm: GPUs per node (default 0)")
    export.add_argument("--partition", default=None, help="--slurm: partition")
    export.add_argument("--account", default=None, help="--slurm: account")
    export.add_argument("--time", default="01:00:00", help="--slurm: time limit (default 01:00:00)")
    export.set_defaults(handler=run_export, parser=export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args.parser, args)


def run_demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Checks every option, then engines up -> train -> summary and files -> engines down."""
    from colab_par.cluster import Cluster, EngineError
    from colab_par.layout import LayoutError

    settings = demo_settings(args.engines, args.steps)
    try:
        layout = choose_layout(settings, args.layout)
    except (LayoutError, ValueError) as error:  # (ValueError: a GPU the planner does not know)
        parser.error(f"--layout {args.layout!r}: {error}")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--out {str(args.out)!r} cannot be created: {error}")
    source = "requested" if args.layout else "chosen by the planner"
    print(f"colab-par demo: GPT {settings.n_layer} layers × d_model {settings.d_model} "
          f"({settings.model_config().num_params() / 1e6:.2f} M params) on {settings.engines} engines "
          f"({settings.device}); layout {layout} ({source}); {settings.steps} steps of "
          f"{settings.global_batch} × {settings.seq_len} tokens", flush=True)
    started = time.perf_counter()
    with Cluster(n=settings.engines) as cluster:
        print(f"colab-par demo: {cluster.n} engines ready ({cluster.backend}) in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        train_started = time.perf_counter()
        try:
            results = cluster.run(train_on_engine, settings, str(layout))
        except EngineError as error:
            print(f"colab-par demo: training failed on the engines, which are now stopped:\n{error}",
                  file=sys.stderr)
            return 1
        train_seconds = time.perf_counter() - train_started
    png_path, csv_path = args.out / "dashboard.png", args.out / "run.csv"
    png_path.write_bytes(dashboard_png(results, settings.steps))
    write_csv(results, csv_path)
    print()
    print(summary_table(results, str(layout), train_seconds))
    print(f"\nwrote {png_path} and {csv_path}; engines stopped; total "
          f"{time.perf_counter() - started:.1f} s")
    return 0


def run_export(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Notebook -> script (and sbatch file); every unsupported line named, with its cell and line."""
    from colab_par.notebook.export import ExportError, export_notebook, sbatch_script
    from colab_par.cluster.launchers import Slurm

    if not args.notebook.is_file():
        parser.error(f"{str(args.notebook)!r} is not a notebook file")
    try:
        result = export_notebook(args.notebook, drop_unsupported=args.drop_unsupported)
    except ExportError as error:
        print(f"colab-par export: {error}", file=sys.stderr)
        return 2
    output = args.output or args.notebook.with_suffix(".py")
    output.write_text(result.script)
    for problem in result.dropped:
        print(f"colab-par export: left out {problem}", file=sys.stderr)
    print(f"wrote {output}; run it with torchrun --nproc-per-node {result.engines or 2} {output}")
    if args.slurm:
        procs = args.procs_per_node or args.gpus_per_node or result.engines or 2
        sbatch = output.with_suffix(".sbatch")
        job = Slurm(partition=args.partition, account=args.account, time=args.time,
                    nodes=args.nodes, gpus_per_node=args.gpus_per_node or None)
        sbatch.write_text(sbatch_script(str(output), job, procs_per_node=procs))
        print(f"wrote {sbatch}; submit it with sbatch {sbatch}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; use e.g. 2") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _mib(value: float) -> str:
    return f"{value / 2 ** 20:.2f}"


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _catalogue_name() -> str:
    """The planner's catalogue entry for this GPU, by its exact product name; for a GPU the
    catalogue does not list, its product name (the planner refuses it: --layout is then needed)."""
    import torch

    from colab_par.planning.devices import device_for_product

    product = torch.cuda.get_device_name(0)
    entry = device_for_product(product)
    if entry is None:
        print(f"colab-par demo: {product!r} is not in the device catalogue, so the planner cannot "
              "price layouts for it; pass --layout (e.g. --layout dp2)", file=sys.stderr)
        return product
    return entry.name


if __name__ == "__main__":
    sys.exit(main())
