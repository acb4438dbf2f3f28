"""What a script written by `colab-par export` calls at run time, under torchrun.

The script keeps the notebook's split: its ordinary cells run once, on rank 0, with their own
random stream (the notebook's kernel is one process, apart from the engines); its `%%colossal`
cells run on every rank, in a namespace set up as on an engine (`rank`, `world_size`,
`local_rank`, `device`); before each of those, the notebook values the cell uses go from rank 0
to every rank, pickled as `%%colossal` ships them. So the script computes what the notebook did.
"""
from __future__ import annotations

import contextlib
import io
import os
import random
from typing import Any, Iterator

import cloudpickle
import torch
import torch.distributed as dist

from colab_par.cluster.engine import bind_device, seed_generators
from colab_par.cluster.ranks import parse_ranks
from colab_par.cluster.ship import ship_by_value

__all__ = ["join_world", "notebook_cell", "engine_cell", "share", "restart", "leave_world"]

_FIRST_SEED = torch.initial_seed()  # this process's own draw, made before anything seeds it
_notebook_rng: tuple[torch.Tensor, Any] | None = None  # the notebook's own random states between its cells


def join_world(seed: int | None = 0) -> tuple[int, int, int, str]:
    """Bind this process to its device and seed it as an engine is (`Cluster(seed=...)`), and join
    torchrun's world; returns (rank, world_size, local_rank, device)."""
    if "LOCAL_RANK" not in os.environ:
        raise RuntimeError("this script was written by `colab-par export` for torchrun: run it as "
                           "`torchrun --nproc-per-node N SCRIPT`")
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = bind_device(local_rank, local_world, backend)
    if seed is not None:
        seed_generators(seed)
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), local_rank, device


@contextlib.contextmanager
def notebook_cell() -> Iterator[None]:
    """An ordinary cell's code runs with the notebook's random streams (torch's and Python's), not
    the engine's: rank 0's model initialisation must not see the draws the notebook made. Nothing
    seeds a notebook's kernel, so its streams start from this process's own first draw."""
    global _notebook_rng
    engine_rng = (torch.get_rng_state(), random.getstate())
    if _notebook_rng is not None:
        torch.set_rng_state(_notebook_rng[0])
        random.setstate(_notebook_rng[1])
    else:
        torch.manual_seed(_FIRST_SEED)
        random.seed(_FIRST_SEED)
    try:
        yield
    finally:
        _notebook_rng = (torch.get_rng_state(), random.getstate())
        torch.set_rng_state(engine_rng[0])
        random.setstate(engine_rng[1])


@contextlib.contextmanager
def engine_cell(targets: str = "all", all_output: bool = False) -> Iterator[bool]:
    """A `%%colossal` cell: yields whether this rank is one of `targets` (the magic's
    `--targets`); output shows on the first of them only, as the magic shows one rank's, unless
    `all_output`."""
    rank = dist.get_rank()
    ranks = parse_ranks(targets, dist.get_world_size())
    runs = rank in ranks
    shown = all_output or rank == min(ranks)
    with contextlib.redirect_stdout(io.StringIO()) if runs and not shown else contextlib.nullcontext():
        yield runs


def share(namespace: dict[str, Any], names: list[str]) -> None:
    """Rank 0's values of `names` (computed by the notebook's cells) to every other rank."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        values = {name: namespace[name] for name in names if name in namespace}
        ship_by_value(*values.values())
        payload = [cloudpickle.dumps(values)]
    dist.broadcast_object_list(payload, src=0)
    if dist.get_rank() != 0:
        namespace.update(cloudpickle.loads(payload[0]))


def restart(seed: int | None = 0) -> None:
    """`%colossal restart`: the notebook's engines start again, seeded anew; here the same
    processes go on from the same seed, once all of them got there."""
    dist.barrier()
    if seed is not None:
        seed_generators(seed)


def leave_world() -> None:
    """`%colossal stop`."""
    if dist.is_initialized():
        dist.destroy_process_group()
