"""`colab_par.show(pm)`: the map of which rank holds which slice of each parameter, on real engines.

Each layout is built on real gloo engines; the map is checked against what the engines measure
themselves, independently of it: the bytes of the storages behind the parameters each rank holds,
and, for each parameter, which of its elements each rank holds (from the local tensor's values:
the engines fill every parameter with its global element index first, so a rank's local tensor
says exactly which elements it has). Every element must be held by as many ranks as any other.
"""
from __future__ import annotations

import io
import sys

import cloudpickle
import numpy as np
import pytest
from matplotlib.image import imread

from colab_par.shard_map.picture import SLICE, WHOLE
from colab_par.shard_map.view import ShardMap

cloudpickle.register_pickle_by_value(sys.modules[__name__])

GPT_SIZES = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, kernels="torch")


def build(layout: str, vocab_size: int = 64, n_layer: int = 2, n_experts: int = 0) -> None:
    """On every engine: the test GPT (a mixture of experts with `n_experts`) as `layout` in the
    engine variable `pm`."""
    import torch
    from IPython import get_ipython

    from colab_par import parallelize
    from colab_par.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(**{**GPT_SIZES, "vocab_size": vocab_size, "n_layer": n_layer, "n_experts": n_experts})
    pm = parallelize(GPT(config), layout)
    get_ipython().user_ns["pm"] = pm


def map_and_measure() -> tuple[dict, int, dict[str, list[int]]]:
    """On every engine: the shard map's data, then what this rank measures on its own: the bytes of
    the distinct storages behind its parameters, and per parameter name the global indices of the
    elements it holds (each parameter is filled with its elements' global indices, through the
    DTensor API, after the map was taken)."""
    import torch
    from IPython import get_ipython
    from torch.distributed.tensor import DTensor, distribute_tensor

    import colab_par
    from colab_par import compat

    pm = get_ipython().user_ns["pm"]
    shard_map = colab_par.show(pm).to_json()
    storages, held = {}, {}
    for part in pm.model_parts:
        module = getattr(part, "module", part)
        for name, param in module.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param.data
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
            index = torch.arange(param.numel(), dtype=torch.float64).reshape(param.shape)
            if isinstance(param, DTensor):
                index = distribute_tensor(index, param.device_mesh, param.placements, src_data_rank=None).to_local()
            held[compat.unwrapped_name(name)] = sorted(int(i) for i in index.reshape(-1).tolist())
    return shard_map, sum(storages.values()), held


def check_map(results: list[tuple[dict, int, dict]]) -> ShardMap:
    """The map every rank returned is one and the same; its storage bytes per rank equal the
    storages each rank measured, its bytes held the elements each rank holds; its slices are exactly
    those elements, and cover every element of every parameter the same number of times."""
    maps = [data for data, _, _ in results]
    assert all(m == maps[0] for m in maps), "every rank must return the same map"
    shard_map = ShardMap.from_json(maps[0])
    assert shard_map.storage_per_rank() == {rank: measured for rank, (_, measured, _) in enumerate(results)}
    itemsize = 4  # float32 parameters
    assert shard_map.bytes_per_rank() == {rank: itemsize * sum(map(len, held.values()))
                                          for rank, (_, _, held) in enumerate(results)}
    for row in shard_map.parameters():
        counts = np.zeros(row.numel, dtype=int)
        for rank, (_, _, held) in enumerate(results):
            elements = np.arange(row.numel).reshape(row.shape)
            if rank in row.slices:
                elements = elements[tuple(slice(a, b) for a, b in row.slices[rank])]
                assert sorted(elements.reshape(-1).tolist()) == held[row.name], (row.name, rank)
                counts[elements.reshape(-1)] += 1
            else:
                assert row.name not in held, f"{row.name} is on rank {rank} but the map says not"
        assert counts.min() >= 1 and counts.min() == counts.max(), (row.name, np.bincount(counts))
    return shard_map


def colour_pixels(png: bytes, colour: str) -> int:
    rgb = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    image = imread(io.BytesIO(png))[..., :3]
    return int((np.abs(image - rgb).max(axis=-1) < 0.03).sum())


@pytest.mark.parametrize("layout", ["dp2 zero3", "tp2", "pp2", "dp2 ep2"])
def test_map_of_two_ranks_matches_what_they_hold(cluster2, layout):
    cluster2.run(build, layout, n_experts=4 if "ep" in layout else 0)
    shard_map = check_map(cluster2.run(map_and_measure))
    rows = {row.name: row for row in shard_map.parameters()}
    wq, wo, norm = (rows[f"layers.0.{name}.weight"] for name in ("attention.wq", "attention.wo", "attention_norm"))
    if layout == "dp2 zero3":  # FSDP2: every parameter cut in two along dim 0
        assert all(row.slices[r][0] == (r * row.shape[0] // 2, (r + 1) * row.shape[0] // 2)
                   for row in rows.values() for r in (0, 1))
    elif layout == "tp2":  # colwise: output halves; rowwise: input halves; norms whole
        assert [wq.slices[r] for r in (0, 1)] == [((0, 16), (0, 32)), ((16, 32), (0, 32))]
        assert [wo.slices[r] for r in (0, 1)] == [((0, 32), (0, 16)), ((0, 32), (16, 32))]
        assert norm.cell(0) == norm.cell(1) == "all"
    elif layout == "dp2 ep2":  # each rank two whole experts of four; everything else whole
        experts = rows["layers.0.feed_forward.experts.w1"]
        assert [experts.slices[r][0] for r in (0, 1)] == [(0, 2), (2, 4)]
        assert wq.cell(0) == wq.cell(1) == "all"
    else:  # pipeline stages: each layer on one rank only
        assert set(rows["layers.0.attention.wq.weight"].held) == {0}
        assert set(rows["layers.1.attention.wq.weight"].held) == {1}
        assert set(rows["tok_embeddings.weight"].held) == {0} and set(rows["output.weight"].held) == {1}
    assert shard_map.storage_per_rank() == shard_map.bytes_per_rank()  # even pieces: no padding
    text = str(shard_map)
    assert f"colab_par shard map: {layout}" in text and "bytes held" in text
    png = shard_map.png()
    assert colour_pixels(png, WHOLE if layout == "pp2" else SLICE) > 100, "the cells show no held block"


def test_map_of_a_tensor_grid_with_uneven_pieces(cluster4):
    """tp4 2d: weights cut over the two grid dims; a vocabulary of 65 splits 33 + 32 (check_map
    holds the storage and the slices to what the engines measure, padding included)."""
    cluster4.run(build, "tp4 2d", vocab_size=65)
    shard_map = check_map(cluster4.run(map_and_measure))
    embedding = next(row for row in shard_map.parameters() if row.name == "tok_embeddings.weight")
    assert sorted({b - a for r in shard_map.ranks for a, b in embedding.slices[r][:1]}) == [32, 33]
    # some short pieces live in storage padded to the long ones' size: the map says so
    padded = [r for r in shard_map.ranks if shard_map.storage_per_rank()[r] > shard_map.bytes_per_rank()[r]]
    assert padded and "padded shards" in str(shard_map)
    grid_cut = [row for row in shard_map.parameters()
                if len({row.slices[r] for r in shard_map.ranks}) == 4]
    assert grid_cut, "2d cuts weights into four different blocks"


@pytest.mark.parametrize("layout", ["pp2 dp2 zero3 interleaved v2", "dp2 tp2 zero3 sp"])
def test_map_of_composite_layouts(cluster4, layout):
    """Stages x FSDP shards (two stages per rank, each layer on one dp pair, halved between them)
    and tensor splits x FSDP shards (each weight in four different blocks)."""
    cluster4.run(build, layout, n_layer=4)
    shard_map = check_map(cluster4.run(map_and_measure))
    for row in shard_map.parameters():
        if layout.startswith("pp"):
            assert len(row.held) == 2 and all(row.fraction(r) == 0.5 for r in row.held), row
        elif row.name.endswith("attention.wq.weight"):
            assert len({row.slices[r] for r in shard_map.ranks}) == 4, row
    if layout.startswith("pp"):
        holders = {tuple(sorted(row.held)) for row in shard_map.parameters() if row.name.startswith("layers.")}
        assert len(holders) == 2, f"the layers live on two dp pairs, not {holders}"


def test_show_as_the_value_of_a_cell_draws_in_the_notebook(cluster2, shell_on, captured, capsys):
    """The value of a %%colossal cell: rank 0 sends the map's data, the notebook draws the PNG; and
    `print(show(pm, text=True))` prints the table from rank 0."""
    cluster2.run(build, "tp2")
    shell_on.run_cell_magic("colossal", "", "import colab_par\ncolab_par.show(pm)")
    pictures = [o["data"] for o in captured if "image/png" in o["data"]]
    assert len(pictures) == 1 and "colab_par shard map: tp2" in pictures[0]["text/plain"]
    shell_on.run_cell_magic("colossal", "", "print(colab_par.show(pm, text=True))")
    assert "[0:16, :]" in capsys.readouterr().out


def test_many_parameters_are_shown_by_block():
    """Above MAX_PARAMETER_ROWS parameters a row is a block (``layers.7``): each cell the share of
    the block's elements the rank holds."""
    def param(name, offsets, sizes):
        return {"name": name, "shape": [8, 4], "dtype": "float32", "itemsize": 4, "offsets": offsets,
                "sizes": sizes, "placement": "dp:S(0)", "stage": None, "trainable": True, "device": "cpu"}

    names = [f"layers.{i}.w{j}" for i in range(10) for j in range(3)]
    ranks = [{"rank": r, "layout": "dp2 zero3", "storage_bytes": 480, "grad_bytes": 0, "optimizer_bytes": 0,
              "params": [param(n, [4 * r, 0], [4, 4]) for n in names] + [param("head", [0, 0], [8, 4])]}
             for r in (0, 1)]
    shard_map = ShardMap(ranks)
    rows = shard_map.rows()
    assert [row.name for row in rows] == [f"layers.{i}" for i in range(10)] + ["head"]
    assert [rows[0].cell(r) for r in (0, 1)] == ["50%", "50%"] and rows[-1].cell(1) == "all"
    assert shard_map.bytes_per_rank() == {0: 30 * 64 + 128, 1: 30 * 64 + 128}
    assert colour_pixels(shard_map.png(), SLICE) > 100
