"""What activation checkpointing recomputes, seen op by op in backward (one process, the kit's GPT).

Without checkpointing backward runs only gradient ops. "selective" saves the matmuls and the
attention (`checkpointing._SAVED_OPS`) and recomputes the cheap ops between them (SiLU, the norms'
reciprocal square root); "full" recomputes everything, matmuls and attention included. A policy
that saved everything (or recomputed nothing) fails the first assertion, one that saved nothing
the second.
"""
from __future__ import annotations

from collections import Counter

import torch

from colab_par.compat import sdpa_aten_ops, torch_dispatch_mode
from colab_par.models.gpt import GPT, GPTConfig
from colab_par.parallel.blocks import find_blocks
from colab_par.parallel.checkpointing import apply_activation_checkpointing
from colab_par.planning.dry_run import dry_run

CONFIG = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32, kernels="torch")


class _Ops(torch_dispatch_mode()):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(mode: str) -> Counter:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    apply_activation_checkpointing(model, mode, find_blocks(model))
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, CONFIG["seq_len"] + 1))
    loss = model.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    with _Ops() as ops:
        loss.backward()
    return ops.counts


def test_selective_recomputes_the_cheap_ops_and_full_recomputes_the_matmuls_too() -> None:
    none, selective, full = (backward_ops(mode) for mode in ("none", "selective", "full"))
    layers = CONFIG["n_layer"]
    attention = {op.overloadpacket.__name__ for op in sdpa_aten_ops()}
    forward_attention = lambda counts: sum(counts[name] for name in attention)  # noqa: E731
    # the cheap ops run again in backward under both policies, never without one
    assert none["silu"] == 0 and selective["silu"] == full["silu"] == layers
    assert none["rsqrt"] == 0 and selective["rsqrt"] >= 2 * layers and full["rsqrt"] == selective["rsqrt"]
    # selective keeps the matmuls' and attention's outputs: backward does no more of them than without
    assert selective["mm"] == none["mm"] and forward_attention(selective) == forward_attention(none) == 0
    # full recomputes them as well
    assert full["mm"] > none["mm"] and forward_attention(full) == layers


def test_selective_caches_no_score_block_of_ring_attention() -> None:
    """Ring attention (cp ring) is a custom autograd Function: the matmuls inside its forward (each
    s/2 x s/2 block of scores) are no outputs autograd records, and selective checkpointing must not
    cache them; when it did, every layer's blocks stayed until backward and selective held more
    than no recompute at all (70B at 4,096 tokens, cp2: 35.9 GiB against 17.4)."""
    config = GPTConfig(vocab_size=256, seq_len=2048, n_layer=2, n_head=4, d_model=64)
    kept = {mode: dry_run(config, f"cp2 ac-{mode}", 2, batch=(2, 2048), tensors="fake").phases["forward"].activations
            for mode in ("none", "selective")}
    assert kept["selective"] < kept["none"], kept
