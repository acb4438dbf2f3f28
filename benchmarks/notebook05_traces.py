"""The traced columns of notebook 05's tables (issue 41): each row's layout verified
(`colab_par.verify`: every rank role dry-run on fake tensors in a fake world of the row's size;
pipelines of many microbatches traced at k and 2k and scaled, `microbatch_scaling`), written to
notebooks/data/05_traced.json, which the notebook reads beside its predictions.

    python benchmarks/notebook05_traces.py           # rows not yet in the file, cheapest first
    python benchmarks/notebook05_traces.py --again   # every row again
    python benchmarks/notebook05_traces.py --list    # the rows and whether each is recorded
    python benchmarks/notebook05_traces.py --table   # the recorded rows against the planner (markdown)
    python benchmarks/notebook05_traces.py --part 1/2 & python benchmarks/notebook05_traces.py --part 2/2
                                                     # two processes, every other row each (2 cores)

A row is one (model, GPUs, layout) of the notebook: the planner's best layout per model and
cluster, and the 70B-on-512 candidates. Rows are kept by that key, so a planner whose choice
changes leaves the new layout untraced until this runs again. Each row takes minutes on 2 cores
(a 70B pipeline role ~3 min); the file is written after every row.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import colab_par  # noqa: E402
from colab_par.layout import Layout  # noqa: E402
from colab_par.models import GPTConfig  # noqa: E402
from colab_par.planning.dry_run.microbatch_scaling import shortest_k  # noqa: E402
from colab_par.planning.dry_run.roles import rank_roles  # noqa: E402
from colab_par.planning.dry_run.verify import Verification, verify  # noqa: E402
from colab_par.planning.layout_estimate import estimate  # noqa: E402

TRACED = Path(__file__).resolve().parent.parent / "notebooks" / "data" / "05_traced.json"
DEVICE, SEQ, GPUS_PER_NODE = "H100-80GB", 4096, 8
MODELS = {  # the notebook's (cell "MODELS = ")
    "1.3B": dict(n_layer=24, d_model=2048, n_head=16, vocab_size=50257),
    "7B": dict(n_layer=32, d_model=4096, n_head=32, ffn_hidden=11008, vocab_size=32000),
    "13B": dict(n_layer=40, d_model=5120, n_head=40, ffn_hidden=13824, vocab_size=32000),
    "70B": dict(n_layer=80, d_model=8192, n_head=64, n_kv_head=8, ffn_hidden=28672, vocab_size=32000),
    "175B": dict(n_layer=96, d_model=12288, n_head=96, ffn_hidden=32768, vocab_size=50257),
}
CLUSTERS = [8, 16, 64, 256, 1024, 4096]
BY_HAND_70B_512 = ["dp512 bf16", "dp512 zero1 bf16", "dp512 zero3 bf16 ac-full", "dp64 tp8 zero3 sp bf16 ac-selective"]


def rows() -> list[tuple[str, int, str, int]]:
    """(model, GPUs, layout, global batch) of every table row, as the notebook computes them."""
    found = []
    for name, sizes in MODELS.items():
        for gpus in CLUSTERS:
            best = colab_par.plan(sizes, gpus, device=DEVICE, global_batch=max(1024, gpus), seq_len=SEQ,
                                  gpus_per_node=GPUS_PER_NODE)[0]
            found.append((name, gpus, str(best.layout), max(1024, gpus)))
    options = dict(device=DEVICE, global_batch=1024, seq_len=SEQ, gpus_per_node=GPUS_PER_NODE)
    candidates = [str(Layout.parse(text)) for text in BY_HAND_70B_512]
    candidates += [str(p.layout) for p in colab_par.plan(MODELS["70B"], 512, top=3, **options)]
    found += [("70B", 512, layout, 1024) for layout in candidates if ("70B", 512, layout, 1024) not in found]
    return found


def key(name: str, gpus: int, layout: str) -> str:
    return f"{name} | {gpus} | {layout}"


def scaled_microbatches(layout: Layout) -> int | None:
    """k for `verify(microbatches=k)`: the schedule's warm-up, when the step runs over twice that."""
    k = shortest_k(layout)
    return k if layout.pp > 1 and 2 * k < layout.microbatches else None


def traced_roles(name: str, layout: Layout, gpus: int) -> list[str] | None:
    """The rank roles a row traces (None: every one). A pipeline of one stage a rank over 4 or more
    ranks, its layers split evenly, traces its first, second and last: a middle stage holds the
    second's layers and parameters with fewer microbatches in flight (1F1B: pp - i; GPipe: all,
    as many), so it never holds more (the 1.3B shape's 8-stage 1F1B in tests/data/dry_run_traces.json:
    381 MiB less each stage on, one microbatch's layers).
    The fullest role, which the notebook shows, is one of the three."""
    if layout.pp < 4 or layout.virtual_stages > 1 or MODELS[name]["n_layer"] % layout.pp:
        return None
    every = list(rank_roles(layout, gpus))
    return [every[0], every[1], every[-1]]


def cost(name: str, layout: Layout) -> float:
    """Layer passes the row's traces run (2 steps, the roles `traced_roles` picks), to run the cheap rows first."""
    microbatches = layout.microbatches if layout.pp > 1 else 1
    k = scaled_microbatches(layout)
    passes = 3 * k if k else microbatches
    stages = min(layout.pp, 3) if layout.pp >= 4 and layout.virtual_stages == 1 else layout.pp
    return MODELS[name]["n_layer"] / layout.pp * stages * passes * 2


def record(name: str, gpus: int, batch: int, checked: Verification, seconds: float) -> dict[str, Any]:
    return {"model": name, "sizes": MODELS[name], "gpus": gpus, "layout": checked.layout, "batch": [batch, SEQ],
            "device": DEVICE, "fits": checked.fits, "overflow": checked.overflow,
            "peak": checked.peak, "device_peak": max(c.report.device_peak for c in checked.roles),
            "traced_seconds": checked.traced_seconds, "predicted_seconds": checked.predicted_seconds,
            "roles_of": len(rank_roles(Layout.parse(checked.layout), gpus)),
            "roles": [{"role": c.role, "rank": c.rank, "peak": c.report.peak.total,
                       "device_peak": c.report.device_peak, "host": c.report.host.total,
                       "scaled_from": c.report.scaled_from, "planner_total": c.comparison.rows[-1].predicted,
                       "traced_seconds": c.traced_seconds, "seconds": round(c.report.seconds, 1)}
                      for c in checked.roles],
            "wall_seconds": round(seconds, 1), "date": date.today().isoformat(),
            "machine": f"{platform.machine()}, {platform.python_version()}, {_cores()} cores"}


def print_table(stored: dict[str, Any]) -> None:
    print("| model | GPUs | layout | planner GiB | traced GiB on the device (fullest role) | error | traced verdict | roles | "
          "scaled from | trace time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, gpus, text, batch in rows():
        row = stored.get(key(name, gpus, text))
        if row is None or "failed" in row:
            print(f"| {name} | {gpus} | `{text}` | | {'not traced' if row is None else 'trace failed'} | | | | | |")
            continue
        planned = estimate(MODELS[name], Layout.parse(text), device=DEVICE, global_batch=batch, seq_len=SEQ,
                           gpus_per_node=GPUS_PER_NODE)
        scaled = {tuple(role["scaled_from"]) for role in row["roles"] if role["scaled_from"]}
        print(f"| {name} | {gpus} | `{text}` | {planned.memory.total / 2**30:.1f} | {row['device_peak'] / 2**30:.1f} | "
              f"{planned.memory.total / row['device_peak'] - 1:+.1%} | {'fits' if row['fits'] else 'OOM'} | "
              f"{_roles_column(row)} | {', '.join(f'{a} and {b}' for a, b in scaled) or '-'} | "
              f"{row['wall_seconds']:.0f} s |")


def _roles_column(row: dict[str, Any]) -> str:
    traced, every = len(row["roles"]), row.get("roles_of", len(row["roles"]))
    return str(traced) if traced == every else f"{traced} of {every}"


def _write_row(name: str, row: dict[str, Any]) -> None:
    """Add `row` to the file as it is now (another process may have added rows), atomically."""
    stored = json.loads(TRACED.read_text()) if TRACED.exists() else {}
    stored[name] = row
    partial = TRACED.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    os.replace(partial, TRACED)


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--again", action="store_true", help="trace every row again")
    parser.add_argument("--list", action="store_true", help="list the rows and stop")
    parser.add_argument("--table", action="store_true", help="the recorded rows against the planner, markdown")
    parser.add_argument("--part", default="1/1", help="i/n: trace every n-th row from the i-th (several processes)")
    args = parser.parse_args()
    stored = json.loads(TRACED.read_text()) if TRACED.exists() else {}
    if args.table:
        print_table(stored)
        return
    todo = sorted(rows(), key=lambda row: cost(row[0], Layout.parse(row[2])))
    for name, gpus, layout, batch in todo:
        mark = "recorded" if key(name, gpus, layout) in stored else "to trace"
        print(f"{name:>5} {gpus:>5}  {layout:<52} {mark}", flush=True)
    if args.list:
        return
    part, parts = (int(number) for number in args.part.split("/"))
    for name, gpus, text, batch in todo[part - 1::parts]:
        layout = Layout.parse(text)
        if key(name, gpus, text) in stored and not args.again:
            continue
        started = time.perf_counter()
        try:
            checked = verify(GPTConfig(**MODELS[name], seq_len=SEQ), layout, gpus, device=DEVICE, batch=(batch, SEQ),
                             microbatches=scaled_microbatches(layout), timeout=7200,
                             roles=traced_roles(name, layout, gpus))
        except (RuntimeError, ValueError) as error:  # the dry run failed or refused: say so in the row, go on
            reason = str(error).strip().splitlines()[-1]
            _write_row(key(name, gpus, text), {"model": name, "sizes": MODELS[name], "gpus": gpus, "layout": text,
                                               "failed": reason, "date": date.today().isoformat()})
            print(f"failed {name} {gpus} {text}: {reason}", flush=True)
            continue
        _write_row(key(name, gpus, text), record(name, gpus, batch, checked, time.perf_counter() - started))
        planned = estimate(MODELS[name], layout, device=DEVICE, global_batch=batch, seq_len=SEQ,
                           gpus_per_node=GPUS_PER_NODE).memory.total
        print(f"traced {name} {gpus} {text}: {checked.peak / 2**30:.1f} GiB (planner {planned / 2**30:.1f}), "
              f"{'fits' if checked.fits else 'OOM'}, {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
