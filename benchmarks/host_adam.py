"""The host optimizer step of memory tiers against torch's AdamW on the same parameters.

Run: ``python benchmarks/host_adam.py [--rounds 7] [--steps 3] [--threads 1]``. The parameters are
a reference GPT's (`--d-model`, `--layers`, `--vocab`), random values and gradients; every arm
holds its own copy of the same values:
- "chunks": `adamw_chunk_step` over flat float32 chunks of `--chunk-mib` (the tiers runtime's
  layout of the state: parameters, gradients, exp_avg and exp_avg_sq as one run each per chunk);
- torch's `AdamW` over the per-parameter tensors: its default implementation, foreach=False,
  foreach=True and fused=True.
Each round runs `steps` steps of every arm, the arms' order rotating from round to round (the
machine is shared: its load hits all arms alike). Reported per arm: ms per step, median of the
rounds with the range, the ratio to "chunks" from the medians, and optimizer-state bytes
(exp_avg + exp_avg_sq, 8 per parameter) updated per second. `--threads 1` is what a CPU engine
has when two engines share two cores.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from colab_par.memory_tiers.host_adam import AdamWHyper, adamw_chunk_step

HYPER = AdamWHyper(lr=1e-4, weight_decay=0.1)
TORCH_ARMS = {"torch default": {}, "torch foreach=False": {"foreach": False},
              "torch foreach=True": {"foreach": True}, "torch fused": {"fused": True}}


def gpt_shapes(d_model: int, layers: int, vocab: int) -> list[torch.Size]:
    """The reference GPT's parameter shapes, read off a model built on the meta device."""
    from colab_par.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=vocab, seq_len=16, n_layer=layers, n_head=max(1, d_model // 64),
                              d_model=d_model, kernels="torch"))
    return [p.shape for p in model.parameters()]


class ChunkArm:
    """The state as flat float32 chunks, stepped chunk by chunk with `adamw_chunk_step`."""

    def __init__(self, values: torch.Tensor, grads: torch.Tensor, chunk_elements: int):
        self.chunks = [(p.clone(), g.clone(), torch.zeros_like(p), torch.zeros_like(p), torch.zeros(()))
                       for p, g in zip(values.split(chunk_elements), grads.split(chunk_elements))]

    def step(self) -> None:
        for param, grad, exp_avg, exp_avg_sq, count in self.chunks:
            adamw_chunk_step(param, grad, exp_avg, exp_avg_sq, count, HYPER)


class TorchArm:
    """torch.optim.AdamW over the per-parameter tensors, with `options` (foreach / fused)."""

    def __init__(self, values: torch.Tensor, grads: torch.Tensor, shapes: list[torch.Size], options: dict):
        self.params = []
        for value, grad, shape in zip(values.split([s.numel() for s in shapes]),
                                      grads.split([s.numel() for s in shapes]), shapes):
            param = torch.nn.Parameter(value.clone().view(shape))
            param.grad = grad.clone().view(shape)
            self.params.append(param)
        self.optimizer = torch.optim.AdamW(self.params, lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2),
                                           eps=HYPER.eps, weight_decay=HYPER.weight_decay, **options)

    def step(self) -> None:
        self.optimizer.step()


def state_rate(parameters: int, seconds_per_step: float) -> float:
    """Optimizer-state bytes (exp_avg + exp_avg_sq) updated per second."""
    return 8 * parameters / seconds_per_step


def time_arms(arms: dict[str, Callable[[], None]], rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each arm, one sample per round, the arms' order rotating."""
    names = list(arms)
    for step in arms.values():  # warm-up: lazy state allocation, first-touch page faults
        step()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            for _ in range(steps):
                arms[name]()
            samples[name].append((time.perf_counter() - start) / steps)
    return samples


def build_arms(shapes: list[torch.Size], chunk_elements: int) -> tuple[dict[str, Callable[[], None]], int]:
    """The arms over the same random values and gradients, and the parameter count."""
    total = sum(s.numel() for s in shapes)
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(total, generator=generator) * 0.02
    grads = torch.randn(total, generator=generator) * 1e-3
    arms = {"chunks": ChunkArm(values, grads, chunk_elements).step}
    arms.update({name: TorchArm(values, grads, shapes, options).step for name, options in TORCH_ARMS.items()})
    return arms, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--chunk-mib", type=int, default=32, help="float32 MiB per chunk")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = gpt_shapes(args.d_model, args.layers, args.vocab)
    arms, total = build_arms(shapes, args.chunk_mib * 2 ** 20 // 4)
    samples = time_arms(arms, args.rounds, args.steps)
    reference = statistics.median(samples["chunks"])
    print(f"# {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{total / 1e6:.1f} M parameters in {len(shapes)} tensors, chunks of {args.chunk_mib} MiB, "
          f"{args.rounds} rounds × {args.steps} steps")
    print("| arm | ms per step | / chunks | state GB/s |\n|---|---|---|---|")
    for name, seconds in samples.items():
        median = statistics.median(seconds)
        print(f"| {name} | {median * 1e3:.1f} ({min(seconds) * 1e3:.1f}-{max(seconds) * 1e3:.1f}) | "
              f"{median / reference:.2f} | {state_rate(total, median) / 1e9:.2f} |")


if __name__ == "__main__":
    main()
