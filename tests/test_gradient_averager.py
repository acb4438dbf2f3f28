"""`GradientAverager` (zero 0 beside tp or pp) in buckets: on a real two-rank gloo world, gradients
spread over several buckets (one over the cap reduced in place, a transposed one copied through a
flat bucket) end as the mean of the two ranks' gradients, each exactly as one flat all-reduce
would leave it, and the buckets are those the planner's collective estimate counts."""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from colab_par.parallel.data_parallel import GRADIENT_BUCKET_BYTES, GradientAverager, gradient_buckets

MIB_FLOATS = 2 ** 20 // 4
SHAPES = [(20, MIB_FLOATS), (10, MIB_FLOATS), (30, MIB_FLOATS), (1, MIB_FLOATS), (MIB_FLOATS, 2)]


def _grads(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
    grads[-1] = grads[-1].t().contiguous().t()  # a transposed (non-contiguous) gradient
    return grads


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    for param, grad in zip(params, _grads(rank)):
        param.grad = grad
    GradientAverager(params, dist.group.WORLD)()
    if rank == 0:
        torch.save([param.grad for param in params], out)
    dist.destroy_process_group()


def test_buckets_average_every_gradient_as_one_flat_all_reduce(tmp_path) -> None:
    sizes = [rows * cols * 4 for rows, cols in SHAPES]
    assert GRADIENT_BUCKET_BYTES == 25 * 2 ** 20
    assert [list(bucket) for bucket in gradient_buckets(sizes)] == [[0], [1], [2], [3, 4]]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "averaged.pt"
    torch.multiprocessing.start_processes(_rank, args=(port, str(out)), nprocs=2, start_method="spawn")
    averaged = torch.load(out)
    for got, mine, theirs in zip(averaged, _grads(0), _grads(1)):
        assert torch.equal(got, (mine + theirs) / 2)  # a two-term sum, halved: exact in float32
