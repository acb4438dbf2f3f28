"""What saving the RNG state for recompute costs: a checkpointed training step with and without it.

Run: ``python benchmarks/rng_state.py [--rounds 9] [--steps 5] [--threads 1]``. One process, the
kit's GPT with dropout (`--d-model`, `--layers`, `--seq`, `--batch`), every block wrapped by
torch's checkpoint wrapper as `parallel/checkpointing.py` wraps it ("full" recompute), in two arms
that differ only in `preserve_rng_state` (True: the kit's setting, which replays the forward's
dropout masks; False: what it used before, which draws new ones). Each round times `--steps`
forward+backward+AdamW steps of both arms, their order alternating from round to round (the
machine is shared: its load hits both alike). Reported: ms per step per arm, median of the rounds
with the range, the ratio of the per-round ratios (median and range), and the CPU state's
get/set cost per block and step on its own.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from colab_par.compat import checkpoint_wrapper
from colab_par.models.gpt import GPT, GPTConfig
from colab_par.parallel.blocks import find_blocks, replace_block


def model(args: argparse.Namespace, preserve: bool) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.d_model // 32,
                        d_model=args.d_model, kernels="torch", dropout=0.1))
    for container, key, block in find_blocks(gpt, None):
        replace_block(container, key, checkpoint_wrapper(block, preserve_rng_state=preserve))
    return gpt, torch.optim.AdamW(gpt.parameters(), lr=1e-4)


def seconds_per_step(arm: tuple[GPT, torch.optim.Optimizer], tokens: torch.Tensor, steps: int) -> float:
    gpt, optimizer = arm
    start = time.perf_counter()
    for _ in range(steps):
        gpt.loss_fn(gpt(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / steps


def block_overhead_us(repeats: int = 20000) -> float:
    """What one checkpointed block adds per step on CPU: torch's checkpoint gets the state in
    forward; its recompute forks (gets the state, later sets it back) and sets the saved one."""
    state = torch.get_rng_state()
    start = time.perf_counter()
    for _ in range(repeats):
        torch.get_rng_state()
        torch.get_rng_state()
        torch.set_rng_state(state)
        torch.set_rng_state(state)
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("rounds", 9), ("steps", 5), ("threads", 1), ("d_model", 256), ("layers", 4),
                          ("seq", 128), ("batch", 8), ("vocab", 1024)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    arms = {"preserve_rng_state=True": model(args, True), "preserve_rng_state=False": model(args, False)}
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1))
    for arm in arms.values():
        seconds_per_step(arm, tokens, 1)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in arms}
    for round_ in range(args.rounds):
        for name in (list(arms) if round_ % 2 == 0 else list(arms)[::-1]):
            times[name].append(seconds_per_step(arms[name], tokens, args.steps))
    print(f"GPT d_model={args.d_model} layers={args.layers} batch={args.batch}x{args.seq}, dropout 0.1, "
          f"full recompute, {args.threads} thread(s), {args.rounds} rounds x {args.steps} steps")
    for name, values in times.items():
        print(f"{name:>26}: {1e3 * statistics.median(values):7.2f} ms/step "
              f"({1e3 * min(values):.2f}-{1e3 * max(values):.2f})")
    ratios = [a / b for a, b in zip(*times.values())]
    print(f"{'state saved+replayed/block':>26}: {block_overhead_us():.2f} us per step")
    print(f"{'ratio True/False':>26}: {statistics.median(ratios):.4f} ({min(ratios):.4f}-{max(ratios):.4f})")


if __name__ == "__main__":
    main()
