"""Dry runs at scale (issue 41): one rank of Llama-3 8B / 70B (LlamaConfig shapes, no weights) and
the kit's GPT, on fake tensors, for several layouts and world sizes; the traced peak beside the
planner's, written to tests/data/dry_run_traces.json (what tests/test_planner_against_traces.py
holds the planner to).

    python benchmarks/dry_run_scale.py            # every row (about 20-40 minutes on 2 cores)
    python benchmarks/dry_run_scale.py --only 8b  # rows whose name contains "8b"
    python benchmarks/dry_run_scale.py --table    # the recorded rows against the planner, no tracing

Rows already in the file are kept unless traced again (`--only` picks which).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from colab_par.layout import Layout  # noqa: E402
from colab_par.planning.dry_run import DryRunReport, dry_run  # noqa: E402

TRACES = Path(__file__).resolve().parent.parent / "tests" / "data" / "dry_run_traces.json"
GiB = 2 ** 30

LLAMA3 = {  # Meta's published shapes (config.json of Llama-3 8B and 70B)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}
LLAMA3_COMMON = dict(model_type="llama", vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=False)
GPT2_SMALL = dict(model_type="gpt", vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768)
SMALL_GPT = dict(model_type="gpt", vocab_size=2048, seq_len=256, n_layer=4, n_head=8, n_kv_head=4, d_model=256)
SMALL_MOE = {**SMALL_GPT, "n_experts": 4, "top_k": 2}
# notebook 05's 1.3B, 13B and 70B shapes with fewer layers (what a layer adds is the same at any depth)
GPT_1_3B_L16 = dict(model_type="gpt", vocab_size=50257, seq_len=4096, n_layer=16, n_head=16, d_model=2048)
GPT_13B_L8 = dict(model_type="gpt", vocab_size=32000, seq_len=4096, n_layer=8, n_head=40, d_model=5120, ffn_hidden=13824)
GPT_70B_L4 = dict(model_type="gpt", vocab_size=32000, seq_len=4096, n_layer=4, n_head=64, n_kv_head=8, d_model=8192,
                  ffn_hidden=28672)

# (name, model, layout, global batch, seq len)
ROWS = [
    ("llama3-8b w8 dp8 zero3", LLAMA3["8b"], "dp8 zero3", 8, 2048),
    ("llama3-8b w8 dp4 tp2 zero3 bf16", LLAMA3["8b"], "dp4 tp2 zero3 bf16", 8, 2048),
    ("llama3-8b w8 tp8", LLAMA3["8b"], "tp8", 8, 2048),
    ("llama3-8b w64 dp64 zero3", LLAMA3["8b"], "dp64 zero3", 64, 2048),
    ("llama3-8b w64 dp8 tp8 zero3", LLAMA3["8b"], "dp8 tp8 zero3", 64, 2048),
    ("llama3-8b w64 dp32 tp2 zero2 bf16", LLAMA3["8b"], "dp32 tp2 zero2 bf16", 64, 2048),
    ("llama3-70b w64 dp8 tp8 zero3", LLAMA3["70b"], "dp8 tp8 zero3", 64, 2048),
    ("llama3-70b w64 dp64 zero3 bf16", LLAMA3["70b"], "dp64 zero3 bf16", 64, 2048),
    ("llama3-70b w64 dp16 tp4 zero2 bf16", LLAMA3["70b"], "dp16 tp4 zero2 bf16", 16, 2048),
    ("llama3-70b w512 dp64 tp8 zero3 bf16", LLAMA3["70b"], "dp64 tp8 zero3 bf16", 64, 2048),
    ("llama3-70b w512 dp512 zero3", LLAMA3["70b"], "dp512 zero3", 512, 2048),
    ("llama3-70b w512 dp128 tp4 zero3", LLAMA3["70b"], "dp128 tp4 zero3", 128, 2048),
    ("llama3-8b w8 tp8 bf16", LLAMA3["8b"], "tp8 bf16", 8, 2048),  # autocast (tp without FSDP)
    ("gpt2-small w64 dp64 zero3", GPT2_SMALL, "dp64 zero3", 64, 1024),
    ("gpt2-small w64 dp16 tp4 zero3 bf16", GPT2_SMALL, "dp16 tp4 zero3 bf16", 64, 1024),
    ("gpt2-small w4 tp4", GPT2_SMALL, "tp4", 4, 1024),
    ("gpt2-small w8 dp4 cp2 zero3 ring", GPT2_SMALL, "dp4 cp2 zero3", 8, 1024),  # cp: the kit's GPT only
    ("small-gpt w4 dp2 tp2 zero3", SMALL_GPT, "dp2 tp2 zero3", 4, 256),  # the test's live row (~7 s)
]
# The other layout families on the kit's small GPT with real tensors (a few seconds each):
# (name, model, layout, global batch, seq len, rank). A pipeline has a row per rank role
# (`rank_roles`); the planner predicts the fullest one.
FAMILY_ROWS = [
    ("small-gpt w4 tp4 bf16", SMALL_GPT, "tp4 bf16", 4, 256, 0),
    ("small-gpt w2 pp2 1f1b stage 0", SMALL_GPT, "pp2", 4, 256, 0),
    ("small-gpt w2 pp2 1f1b stage 1", SMALL_GPT, "pp2", 4, 256, 1),
    ("small-gpt w4 dp2 cp2 ring", SMALL_GPT, "dp2 cp2", 4, 256, 0),
    ("small-gpt w2 cp2 ulysses", SMALL_GPT, "cp2 ulysses", 4, 256, 0),
    ("small-gpt w2 dp2 zero3 offload", SMALL_GPT, "dp2 zero3 offload", 4, 256, 0),
    ("small-gpt w2 dp2 zero3 optimizer@disk", SMALL_GPT, "dp2 zero3 optimizer@disk", 4, 256, 0),
    ("small-moe w4 dp4 ep2", SMALL_MOE, "dp4 ep2", 4, 256, 0),
    ("small-gpt w4 tp4 2d", SMALL_GPT, "tp4 2d", 4, 256, 0),
    ("small-gpt w8 tp8 2.5d d2", SMALL_GPT, "tp8 2.5d d2", 4, 256, 0),
    ("small-gpt w8 tp8 3d", SMALL_GPT, "tp8 3d", 4, 256, 0),
    # a grid under selective recompute: its matmuls rebuilt in backward, not cached
    ("small-gpt w4 tp4 2d ac-selective", SMALL_GPT, "tp4 2d ac-selective", 4, 256, 0),
    ("small-gpt w8 tp8 3d ac-selective", SMALL_GPT, "tp8 3d ac-selective", 4, 256, 0),
    ("small-gpt w4 dp4 zero3 ac-full", SMALL_GPT, "dp4 zero3 ac-full", 4, 256, 0),
    ("small-gpt w4 dp4 zero3 ac-selective", SMALL_GPT, "dp4 zero3 ac-selective", 4, 256, 0),
]
# Pipeline stages and experts at GPT-2 small's shape, fake tensors: (name, model, layout, batch, seq, rank)
SCALE_ROLE_ROWS = [
    ("gpt2-small w2 pp2 1f1b stage 0", GPT2_SMALL, "pp2", 8, 1024, 0),
    ("gpt2-small w2 pp2 1f1b stage 1", GPT2_SMALL, "pp2", 8, 1024, 1),
    ("gpt2-small-moe w8 dp8 ep4", {**GPT2_SMALL, "n_experts": 8, "top_k": 2}, "dp8 ep4", 8, 1024, 0),
    # the last stage at 8 microbatches of the same size: 1F1B holds one microbatch's logits, GPipe all
    *[(f"gpt2-small w2 pp2 {schedule} mb8 stage {rank}", GPT2_SMALL, f"pp2 {schedule} mb8", 32, 1024, rank)
      for schedule in ("1f1b", "gpipe") for rank in (0, 1)],
    # tensor parallel (1d, a 2d grid) inside pipeline stages: the held logits in the compute dtype
    *[(f"gpt-1.3b-l16 w16 {layout} rank {rank}", GPT_1_3B_L16, f"{layout} bf16", 32, 4096, rank)
      for layout in ("dp2 pp2 tp4 zero2", "dp2 pp2 tp4 2d zero2", "dp2 pp2 tp4 2d zero2 zbv v2") for rank in (0, 8)],
    # 1F1B on eight stages, 32 one-sequence microbatches: a middle stage holds input gradients too
    *[(f"gpt-1.3b-l16 w{16 * tp} dp2 {'tp2 ' * (tp > 1)}pp8 zero3 mb32 ac-selective stage {stage}", GPT_1_3B_L16,
       f"dp2 {'tp2 ' * (tp > 1)}pp8 zero3 mb32 bf16 ac-selective", 64, 4096, stage * 2 * tp)
      for tp in (1, 2) for stage in range(8)],
    # pipelines under FSDP (gathered stages, unsharded gradients to the step's end), each schedule
    *[(f"gpt-13b-l8 w256 dp128 pp2 {layout} rank {rank}", GPT_13B_L8, f"dp128 pp2 {layout} bf16", 1024, 4096, rank)
      for layout in ("zero2 mb8", "zero3 mb8", "zero2 interleaved mb8 v2", "zero3 zbv mb8 v2") for rank in (0, 128)],
    # zbv on four stages (the V's per-chunk in-flight counts are not modelled: EXPLAINED)
    *[(f"gpt-1.3b-l16 w16 {layout} rank {rank}", GPT_1_3B_L16, f"{layout} bf16", 16, 4096, rank)
      for layout in ("dp4 pp4 zero2 zbv v2", "dp2 tp2 pp4 zero2 zbv mb8 v2") for rank in (0, 4, 8, 12)],
    # full recompute: the rebuilt layer's MLP backward, 2 to 128 sequences per rank
    ("gpt-70b-l4 w512 dp512 zero3 ac-full", GPT_70B_L4, "dp512 zero3 bf16 ac-full", 1024, 4096, 0),
    ("gpt-70b-l4 w16 dp16 zero3 ac-full", GPT_70B_L4, "dp16 zero3 bf16 ac-full", 1024, 4096, 0),
    ("gpt-70b-l4 w8 dp8 zero1 ac-full", GPT_70B_L4, "dp8 zero1 bf16 ac-full", 1024, 4096, 0),
    ("gpt-70b-l4 w512 dp128 tp2 cp2 zero3 ac-full", GPT_70B_L4, "dp128 tp2 cp2 zero3 sp bf16 ac-full", 1024, 4096, 0),
    # ring attention's backward: its score blocks at each recompute, 4 and 8 thousand tokens a rank
    ("gpt-70b-l4 w512 dp128 tp2 cp2 zero3", GPT_70B_L4, "dp128 tp2 cp2 zero3 sp bf16", 512, 4096, 0),
    ("gpt-70b-l4 w512 dp128 tp2 cp2 zero3 ac-selective", GPT_70B_L4, "dp128 tp2 cp2 zero3 sp bf16 ac-selective",
     1024, 4096, 0),
    ("gpt-70b-l4 w512 dp64 tp2 cp4 zero3 ac-full", GPT_70B_L4, "dp64 tp2 cp4 zero3 sp bf16 ac-full", 512, 4096, 0),
    ("gpt-70b-l4-s8k w512 dp128 tp4 cp2 zero3", {**GPT_70B_L4, "seq_len": 8192}, "dp128 tp4 cp2 zero3 sp bf16",
     256, 8192, 0),
    # zero 0 beside tensor parallel: `GradientAverager`'s flat copy of every gradient
    ("gpt-70b-l4 w512 dp128 tp2 cp2 zero0 ac-selective", GPT_70B_L4, "dp128 tp2 cp2 sp bf16 ac-selective", 512, 4096, 0),
    # selective recompute on a tensor grid: each layer rebuilt in backward (its matmuls are not cached)
    ("gpt-1.3b-l16 w8 dp2 tp4 2d zero2 ac-selective", GPT_1_3B_L16, "dp2 tp4 2d zero2 bf16 ac-selective", 16, 4096, 0),
    ("gpt-1.3b-l16 w8 tp8 3d ac-selective", GPT_1_3B_L16, "tp8 3d ac-selective", 8, 4096, 0),
    # selective recompute under sequence parallel: the layer's input is kept split
    ("gpt-70b-l4 w512 dp64 tp8 zero3 sp ac-selective", GPT_70B_L4, "dp64 tp8 zero3 sp bf16 ac-selective", 1024, 4096, 0),
]
LIVE_ROW = "small-gpt w4 dp2 tp2 zero3"
# Rows the planner misses by more than 5 %, with the error docs/planner.md ("What remains
# different") explains; the test holds each to it within a point, so a change either way shows.
EXPLAINED = {
    "small-gpt w2 dp2 zero3 optimizer@disk": +0.166,
    "gpt-70b-l4 w8 dp8 zero1 ac-full": +0.095,
    **{f"gpt-1.3b-l16 w16 dp4 pp4 zero2 zbv v2 rank {rank}": +0.094 for rank in (0, 4, 8, 12)},
    **{f"gpt-1.3b-l16 w16 dp2 tp2 pp4 zero2 zbv mb8 v2 rank {rank}": -0.061 for rank in (0, 4, 8, 12)},
}


def build_config(model: dict[str, Any]) -> Any:
    """The model a row names: a transformers LlamaConfig (shapes only) or the kit's GPTConfig."""
    sizes = {key: value for key, value in model.items() if key != "model_type"}
    if model["model_type"] == "gpt":
        from colab_par.models import GPTConfig

        return GPTConfig(**sizes)
    from transformers import LlamaConfig

    return LlamaConfig(**sizes)


def row_model(model: dict[str, Any]) -> dict[str, Any]:
    return model if model.get("model_type") == "gpt" else {**LLAMA3_COMMON, **model}


def trace_row(model: dict[str, Any], layout: str, batch: int, seq: int, *, rank: int = 0,
              tensors: str = "fake") -> DryRunReport:
    world = Layout.parse(layout).world_size
    return dry_run(build_config(model), layout, world, rank=rank, batch=(batch, seq), tensors=tensors, timeout=1800)


def all_rows() -> list[tuple[str, dict[str, Any], str, int, int, int, str]]:
    """Every row as (name, model, layout, batch, seq, rank, tensors): the scale rows on fake
    tensors, the small family rows on real ones."""
    return ([(*row, 0, "fake") for row in ROWS] + [(*row, "real") for row in FAMILY_ROWS]
            + [(*row, "fake") for row in SCALE_ROLE_ROWS])


def report_row(name: str, model: dict[str, Any], report: DryRunReport) -> dict[str, Any]:
    """One JSON row: the model, the layout, the traced peak and phases, collectives, seconds."""
    return {"name": name, "model": model, "layout": report.layout, "world": report.world_size,
            "rank": report.rank, "batch": list(report.batch), "peak": asdict(report.peak),
            "phases": {phase: asdict(kinds) for phase, kinds in report.phases.items()},
            "collectives": [asdict(row) for row in report.collectives], "seconds": round(report.seconds, 1),
            "rss_gib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20, 2)}


def load_rows() -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in json.loads(TRACES.read_text())} if TRACES.exists() else {}


def save_rows(rows: dict[str, dict[str, Any]]) -> None:
    TRACES.parent.mkdir(parents=True, exist_ok=True)
    order = [name for name, *_ in all_rows()]  # rows no longer listed are dropped
    ordered = sorted((row for row in rows.values() if row["name"] in order), key=lambda row: order.index(row["name"]))
    TRACES.write_text(json.dumps(ordered, indent=1) + "\n")


def planner_total(row: dict[str, Any]) -> float:
    """The planner's training peak for a recorded row (the same comparison `compare` makes)."""
    from colab_par.planning.layout_estimate import estimate

    plan = estimate(build_config(row["model"]), row["layout"], device="cpu", global_batch=row["batch"][0],
                    seq_len=row["batch"][1], validate=False)
    return plan.memory.total


def fullest_traced(row: dict[str, Any], rows: "list[dict[str, Any]]") -> float:
    """What the planner's peak (the fullest rank's) is compared with: the row's traced peak, or
    under a pipeline the fullest of its layout's recorded rank roles."""
    if Layout.parse(row["layout"]).pp == 1:
        return sum(row["peak"].values())
    same = [other for other in rows if (other["layout"], other["model"], other["batch"]) ==
            (row["layout"], row["model"], row["batch"])]
    return max(sum(other["peak"].values()) for other in same)


def _size(size: float) -> str:
    return f"{size / GiB:.2f} GiB" if size >= GiB else f"{size / 2 ** 20:.1f} MiB"


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| row | wall | traced peak / rank | planner | error |", "|---|---|---|---|---|"]
    for row in rows.values():
        traced = sum(row["peak"].values())
        planned = planner_total(row)
        error = (planned - fullest_traced(row, list(rows.values()))) / fullest_traced(row, list(rows.values()))
        lines.append(f"| {row['name']} | {row['seconds']:.0f} s | {_size(traced)} | {_size(planned)} | "
                     f"{error:+.1%}{' (explained)' if row['name'] in EXPLAINED else ''} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="trace only rows whose name contains this")
    parser.add_argument("--table", action="store_true", help="print the recorded rows against the planner")
    args = parser.parse_args()
    rows = load_rows()
    if not args.table:
        for name, model, layout, batch, seq, rank, tensors in all_rows():
            if args.only not in name:
                continue
            report = trace_row(row_model(model), layout, batch, seq, rank=rank, tensors=tensors)
            rows[name] = report_row(name, row_model(model), report)
            save_rows(rows)
            traced = report.peak.total
            print(f"{name}: {report.seconds:.0f} s, traced {traced / GiB:.2f} GiB", flush=True)
    print(table(rows))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
