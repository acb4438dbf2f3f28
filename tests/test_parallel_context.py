"""Context parallel (ring and Ulysses attention) on real gloo engines against single-process math.

References are computed here, in the test process, from the full sequence: an explicit masked
softmax attention for the op tests, and the unparallelized GPT for the model test.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from colab_par.models.gpt import GPT, GPTConfig
from colab_par.parallel.context import (_block_pairs, apply_context_parallel, ring_attention,
                                        ring_chunks, sequence_positions, shard_sequence,
                                        ulysses_attention, unshard_sequence)

MODES = ("ring", "ulysses")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
# (heads, kv_heads, head_dim): plain multi-head, GQA with an odd head_dim, multi-query
HEAD_SHAPES = ((4, 4, 8), (4, 2, 5), (4, 1, 6))


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention written out: repeat kv heads, mask the future, softmax, mix."""
    repeat = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    seq = q.shape[1]
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def attention_cases(seq: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    cases = []
    for heads, kv_heads, head_dim in HEAD_SHAPES:
        shapes = [(2, seq, heads, head_dim), (2, seq, kv_heads, head_dim), (2, seq, kv_heads, head_dim),
                  (2, seq, heads, head_dim)]
        cases.append(tuple(torch.randn(shape, generator=gen, dtype=dtype) for shape in shapes))
    return cases


# ---- engine side -------------------------------------------------------------------------------
def cp_attention_on_engine(mode: str, cases: list[tuple[torch.Tensor, ...]]) -> list[list[torch.Tensor]]:
    """Shard each case, run cp attention forward + backward, return (out, dq, dk, dv) local parts."""
    rank, size = dist.get_rank(), dist.get_world_size()
    attention = ring_attention if mode == "ring" else ulysses_attention
    results = []
    for q, k, v, grad_out in cases:
        local = [shard_sequence(t, rank, size, mode).clone().requires_grad_() for t in (q, k, v)]
        out = attention(*local, group=dist.group.WORLD)
        out.backward(shard_sequence(grad_out, rank, size, mode))
        results.append([out.detach()] + [t.grad for t in local])
    return results


def cp_gpt_on_engine(config: GPTConfig, state: dict, tokens: torch.Tensor, targets: torch.Tensor,
                     mode: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and cp-averaged gradients of the GPT on this rank's sequence shard."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model = GPT(config)
    model.load_state_dict(state)
    apply_context_parallel(model, dist.group.WORLD, mode)
    positions = sequence_positions(tokens.shape[1], rank, size, mode)
    logits = model(shard_sequence(tokens, rank, size, mode), positions)
    loss = model.loss_fn(logits, shard_sequence(targets, rank, size, mode))
    loss.backward()
    # Every rank holds the same number of tokens, so the mean of local means is the global mean.
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)
        grads[name] = param.grad / size
    return total.item() / size, grads


def cp_errors_on_engine() -> list[str]:
    messages = []
    odd_sequence = torch.zeros(1, 3, 4, 8)
    three_heads = torch.zeros(1, 4, 3, 8)
    for call in (functools.partial(ring_attention, odd_sequence, odd_sequence, odd_sequence),
                 functools.partial(ulysses_attention, three_heads, three_heads, three_heads)):
        try:
            call()
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


# ---- checks in the test process ----------------------------------------------------------------
def check_attention(cluster, mode: str, dtype: torch.dtype) -> None:
    size = cluster.n
    cases = attention_cases(seq=8 * size, dtype=dtype)
    per_rank = cluster.run(cp_attention_on_engine, mode, cases)
    for index, (q, k, v, grad_out) in enumerate(cases):
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected_out = reference_attention(*full)
        expected_out.backward(grad_out)
        expected = [expected_out.detach()] + [t.grad for t in full]
        for name, position, want in zip(("out", "dq", "dk", "dv"), range(4), expected):
            got = unshard_sequence([rank_result[index][position] for rank_result in per_rank], size, mode)
            torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype],
                                       msg=lambda m: f"{mode} cp={size} {HEAD_SHAPES[index]} {name}: {m}")


def check_gpt(cluster, mode: str) -> None:
    config = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                       kernels="torch")
    torch.manual_seed(0)
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len))
    targets = torch.randint(0, config.vocab_size, (2, config.seq_len))
    loss = model.loss_fn(model(tokens), targets)
    loss.backward()
    per_rank = cluster.run(cp_gpt_on_engine, config, model.state_dict(), tokens, targets, mode)
    for cp_loss, grads in per_rank:
        assert cp_loss == pytest.approx(loss.item(), abs=1e-5)
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"{mode} grad of {name}: {m}")


# ---- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", MODES)
def test_shard_unshard_round_trip_and_positions(mode: str, cp_size: int) -> None:
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    parts = [shard_sequence(x, rank, cp_size, mode) for rank in range(cp_size)]
    assert torch.equal(unshard_sequence(parts, cp_size, mode), x)
    for rank, part in enumerate(parts):
        positions = sequence_positions(24, rank, cp_size, mode)
        assert torch.equal(part, x[:, positions])  # positions name exactly the tokens held


def test_ring_sharding_is_head_tail() -> None:
    # 2·cp = 4 chunks of 2 tokens: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert sequence_positions(8, 0, 2, "ring").tolist() == [0, 1, 6, 7]
    assert sequence_positions(8, 1, 2, "ring").tolist() == [2, 3, 4, 5]
    assert sequence_positions(8, 1, 2, "ulysses").tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 8])
def test_ring_schedule_covers_the_causal_triangle_once_with_equal_work(cp_size: int) -> None:
    seen, work = [], []
    for rank in range(cp_size):
        pairs = []
        for step in range(cp_size):
            source = (rank - step) % cp_size
            for q_part, kv_part, causal in _block_pairs(rank, source, cp_size, chunk=1):
                q_chunk = ring_chunks(rank, cp_size)[q_part.start]
                k_chunk = ring_chunks(source, cp_size)[kv_part.start]
                assert causal == (q_chunk == k_chunk)
                pairs.append((q_chunk, k_chunk))
        seen += pairs
        work.append(sum(0.5 if q == k else 1.0 for q, k in pairs))
    chunks = 2 * cp_size
    assert sorted(seen) == [(q, k) for q in range(chunks) for k in range(q + 1)]
    assert len(set(work)) == 1, f"unequal work per rank: {work}"


def test_bad_sharding_input_is_rejected() -> None:
    x = torch.zeros(1, 6, 2)
    with pytest.raises(ValueError, match="not divisible by 4 chunks"):
        shard_sequence(x, 0, 2, "ring")
    with pytest.raises(ValueError, match="choose one of"):
        shard_sequence(x, 0, 2, "stripes")
    with pytest.raises(ValueError, match="outside 0..1"):
        shard_sequence(x, 2, 2, "ulysses")
    with pytest.raises(ValueError, match="one part per cp rank"):
        unshard_sequence([x], 2, "ulysses")


def test_apply_context_parallel_swaps_attention_once() -> None:
    model = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=8, kernels="torch"))
    apply_context_parallel(model, None, "ring")
    swapped = [layer.attention.attention for layer in model.layers.values()]
    assert all(fn.func is ring_attention for fn in swapped)
    with pytest.raises(ValueError, match="already applied"):
        apply_context_parallel(model, None, "ulysses")
    with pytest.raises(ValueError, match="reference GPT only"):
        apply_context_parallel(torch.nn.Linear(2, 2), None, "ring")


def test_bad_attention_input_is_rejected_on_engines(cluster2) -> None:
    ring_message, ulysses_message = cluster2.run(cp_errors_on_engine)[0]
    assert "even local sequence" in ring_message
    assert "cp=2" in ulysses_message and "ring" in ulysses_message


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("mode", MODES)
def test_cp2_attention_matches_single_process(cluster2, mode: str, dtype: torch.dtype) -> None:
    check_attention(cluster2, mode, dtype)


@pytest.mark.parametrize("mode", MODES)
def test_cp2_gpt_loss_and_grads_match_single_process(cluster2, mode: str) -> None:
    check_gpt(cluster2, mode)


@pytest.mark.slow
def test_cp4_attention_and_gpt_match_single_process(cluster4) -> None:
    for mode in MODES:
        check_attention(cluster4, mode, torch.float64)
        check_gpt(cluster4, mode)
