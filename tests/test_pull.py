"""`%colossal pull` / `Cluster.pull` on a real 2-engine gloo world: a DTensor comes back whole, a
tp2 model as its full state dict, each equal to the values one process computes; what would not
fit in the notebook's memory is refused with the sizes, before anything moves."""
from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from parity import SEED, build_model, engine_model

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SHARDED = ("import torch\n"
           "from torch.distributed.device_mesh import init_device_mesh\n"
           "from torch.distributed.tensor import Shard, distribute_tensor\n"
           "mesh = init_device_mesh('cpu', (2,))\n"
           "rows = distribute_tensor(torch.arange(24.0).reshape(6, 4) * 1.5, mesh, [Shard(0)])\n"
           "columns = distribute_tensor(torch.arange(24.0).reshape(6, 4) - 7, mesh, [Shard(1)])\n")


def local_shape(name):
    from IPython import get_ipython

    return list(get_ipython().user_ns[name].to_local().shape)


def parallelize_tp2():
    """The test's GPT under tp2 as engine variable `pm` (each rank seeded differently: only rank
    0's initialisation survives parallelize)."""
    from IPython import get_ipython

    from colab_par import parallelize

    get_ipython().user_ns["pm"] = parallelize(engine_model("gpt", "module"), "tp2")


def test_a_dtensor_is_pulled_whole(on_cluster, cluster2, capsys):
    on_cluster.run_cell_magic("colossal", "", SHARDED)
    assert cluster2.run(local_shape, "rows") == [[3, 4], [3, 4]]  # each rank holds half
    on_cluster.run_line_magic("colossal", "pull rows")
    on_cluster.run_line_magic("colossal", "pull columns --rank 1 --as cols")
    assert "colab_par: cols = columns of rank 1 (tensor float32 [6, 4])" in capsys.readouterr().out
    assert type(on_cluster.user_ns["rows"]) is torch.Tensor
    assert torch.equal(on_cluster.user_ns["rows"], torch.arange(24.0).reshape(6, 4) * 1.5)
    assert torch.equal(on_cluster.user_ns["cols"], torch.arange(24.0).reshape(6, 4) - 7)


def test_a_tp2_models_state_dict_is_pulled_whole(on_cluster, cluster2):
    cluster2.run(parallelize_tp2)
    expected = build_model("gpt", SEED).state_dict()
    pulled = cluster2.pull("pm")
    assert sorted(pulled) == sorted(expected)
    for name, tensor in expected.items():
        assert type(pulled[name]) is torch.Tensor and torch.equal(pulled[name], tensor), name
    head = cluster2.pull("pm.model.output.weight", rank=1)  # one tensor of it (a column shard each)
    assert torch.equal(head, expected["output.weight"])


def test_a_pull_too_large_or_missing_is_refused_before_anything_moves(on_cluster, cluster2):
    on_cluster.run_cell_magic("colossal", "", "import torch\nbig = torch.zeros(1).expand(2**38)\n"
                                              "history = [{'step': rank, 'loss': 2.5}]\n"
                                              "if rank == 0:\n    only_here = torch.zeros(2)")
    refused = (r"big \(tensor float32 \[274877906944\]\) is 1\.00 TiB whole; the limit is [\d.,]+ [KMG]iB "
               r"\(a third of this host's [\d.,]+ [KMG]iB available")
    with pytest.raises(MemoryError, match=refused):
        on_cluster.run_line_magic("colossal", "pull big")
    with pytest.raises(MemoryError, match=r"history \(list\) is \d+ B whole; the limit is 10 B \(max_bytes"):
        cluster2.pull("history", max_bytes=10)
    with pytest.raises(NameError, match="rank 1: no engine variable 'only_here'; nothing pulled"):
        cluster2.pull("only_here", rank=1)
    with pytest.raises(NameError, match="rank 0: history has no attribute 'loss'"):
        cluster2.pull("history.loss")
    assert cluster2.pull("history", rank=1) == [{"step": 1, "loss": 2.5}]
