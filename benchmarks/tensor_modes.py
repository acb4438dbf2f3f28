"""Tensor-parallel modes side by side: per-rank weights, activations and communication per step for
1d, 1d+sp, 2d, 2.5d and 3d, measured on p = 4 and p = 8 engines, and predicted for a large model.

Run: ``python benchmarks/tensor_modes.py``. Measured in one run on real engines (gloo on CPU,
nccl on GPUs), each layout on the same GPT and batches:
- weights: the parameter elements the rank holds, ×4 bytes (fp32);
- activations: the floating-point tensors autograd keeps over one forward and loss, parameters
  aside, each storage once (`ActivationMeter`);
- comm: the bytes of every collective one training step issues (`CollectiveBytes`: an
  all-reduce's buffer, an all-gather's output, a reduce-scatter's input);
all three by `colab_par.parallel.step_costs.measure_step_costs`.
Rank 0's figures, and in brackets measured / predicted by `colab_par.planning.tensor_costs` (what the
planner uses for the grid modes; 1d counted the same way). Memory and bytes are deterministic, so
one sample each. The second table predicts one Llama-70B-sized layer (hidden 8192, 64 heads, FFN
28672, seq 4096, microbatch 8, bf16) on the same basis: where each mode wins. Its weights and the
exposed communication time are the planner's (H100, 8 per node: tp16 and tp64 cross nodes).
"""
from __future__ import annotations

import argparse

from colab_par import Cluster, Layout
from colab_par.planning.planner import ModelSpec, estimate
from colab_par.planning.tensor_costs import grid_local_params, kept_activation_bytes, tensor_comm_bytes

SIZES = dict(vocab_size=256, seq_len=64, n_layer=2, n_head=8, d_model=128, kernels="torch")
BATCH = 16
MODES = {4: ["tp4", "tp4 sp", "tp4 2d", "tp4 2.5d"], 8: ["tp8", "tp8 sp", "tp8 2.5d d2", "tp8 3d"]}
LARGE = dict(n_layer=1, d_model=8192, n_head=64, n_kv_head=64, ffn_hidden=28672, vocab_size=32000)
LARGE_MODES = {4: ["tp4", "tp4 sp", "tp4 2d"], 8: ["tp8", "tp8 sp", "tp8 2.5d d2", "tp8 3d"],
               16: ["tp16", "tp16 sp", "tp16 2d", "tp16 2.5d d4"],
               64: ["tp64", "tp64 sp", "tp64 2d", "tp64 2.5d d4", "tp64 3d"]}


def measure(layout: str) -> dict:
    """Engine side: `measure_step_costs` of the GPT under `layout`."""
    import torch

    from colab_par import parallelize
    from colab_par.models import GPT, GPTConfig
    from colab_par.parallel.step_costs import measure_step_costs

    torch.manual_seed(0)
    pm = parallelize(GPT(GPTConfig(**SIZES)), layout)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, SIZES["vocab_size"], (BATCH, SIZES["seq_len"] + 1), generator=gen)
            for _ in range(2)]
    costs = measure_step_costs(pm, *[(seq[:, :-1], seq[:, 1:]) for seq in seqs])
    return {"weights": 4 * costs["params"], "activations": costs["activations"], "comm": costs["comm"]}


def predicted(layout: str) -> dict:
    text = Layout.parse(layout)
    spec = ModelSpec.of({k: v for k, v in SIZES.items() if k != "kernels"})
    per_layer, outside = kept_activation_bytes(spec, text, BATCH, SIZES["seq_len"])
    weights = (grid_local_params(spec, text)[0] if text.tp_mode != "1d" else
               (spec.n_layer * spec.layer_matrix_params + 2 * spec.vocab_size * spec.d_model) / text.tp
               + (2 * spec.n_layer + 1) * spec.d_model)  # 1d: matrices split, norms whole
    return {"weights": 4 * weights,
            "activations": spec.n_layer * per_layer + outside,
            "comm": tensor_comm_bytes(spec, text, BATCH, SIZES["seq_len"]) + 8}  # + the loss all-reduce


def _cell(measured: float, expected: float) -> str:
    return f"{measured / 1024:,.1f} ({measured / expected:.3f})"


def measured_table() -> None:
    print(f"GPT {SIZES}, batch {BATCH}; KiB per rank (rank 0), measured / predicted in brackets\n")
    print("| p | layout | weights | activations kept | comm per step |")
    print("|---|---|---|---|---|")
    for world, layouts in MODES.items():
        with Cluster(n=world, dashboard=False) as cluster:
            for layout in layouts:
                got, want = cluster.run(measure, layout)[0], predicted(layout)
                cells = [_cell(got[k], want[k]) for k in ("weights", "activations", "comm")]
                print(f"| {world} | {layout} | " + " | ".join(cells) + " |")


def large_table() -> None:
    spec = ModelSpec.of(LARGE)
    print(f"\nPredicted per layer, {LARGE}, seq 4096, microbatch 8, bf16 (MiB per rank):\n")
    print("| p | layout | weights (layer + embedding + head) | activations | tp payload per step | "
          "exposed tp time ms |")
    print("|---|---|---|---|---|---|")
    for world, layouts in LARGE_MODES.items():
        for text in layouts:
            plan = estimate(spec, f"{text} bf16", device="H100", global_batch=8, seq_len=4096,
                            validate=False)
            layout = plan.layout
            comm = _layer_comm(spec, layout)
            print(f"| {world} | {text} | {plan.memory.params / 2**20:,.0f} | "
                  f"{_layer_activations(spec, layout) / 2**20:,.0f} | {comm / 2**20:,.0f} | "
                  f"{plan.times.get('tp', 0.0) * 1e3:,.1f} |")


def _layer_activations(spec: ModelSpec, layout: Layout) -> float:
    return kept_activation_bytes(spec, layout, 8, 4096, 2)[0]


def _layer_comm(spec: ModelSpec, layout: Layout) -> float:
    """One layer's collective payload per microbatch (two layers' less one layer's)."""
    two = tensor_comm_bytes(ModelSpec.of({**LARGE, "n_layer": 2}), layout, 8, 4096, 2)
    return two - tensor_comm_bytes(spec, layout, 8, 4096, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predicted-only", action="store_true", help="only the large-model table")
    args = parser.parse_args()
    if not args.predicted_only:
        measured_table()
    large_table()


if __name__ == "__main__":
    main()
