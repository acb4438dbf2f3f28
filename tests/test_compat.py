"""Each private API in colab_par.compat, exercised against the installed torch, ipyparallel and
transformers (no mocks): if a release drops or changes one, its test here fails first."""
from __future__ import annotations

import importlib
import pickle
import re
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from colab_par import compat

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import test modules

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_supported_ranges_are_the_ones_pyproject_declares():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["hf"]
    for package, requirement in compat.SUPPORTED.items():
        assert requirement in declared, f"pyproject.toml does not declare {requirement}"
    assert compat.SUPPORTED["transformers"] in project["optional-dependencies"]["test"]


def test_a_missing_api_names_the_supported_range():
    import transformers

    error = compat._missing("transformers", "create_causal_mask")
    assert isinstance(error, compat.CompatError)
    assert f"transformers {transformers.__version__}" in str(error)
    assert "transformers>=5.9" in str(error)


# ---- torch.distributed.checkpoint ------------------------------------------------------------------
class _Recording(pickle.Unpickler):
    """Resolves everything (our own freshly written file) and records which globals it names."""

    def __init__(self, handle):
        super().__init__(handle)
        self.names: set[tuple[str, str]] = set()

    def find_class(self, module, name):
        self.names.add((module, name))
        return super().find_class(module, name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_file_and_its_private_globals(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.randn(3, 4), "step": 7}, checkpoint_id=str(tmp_path))
    path = Path(compat.dcp_metadata_path(dcp.FileSystemReader(str(tmp_path))))
    assert path == tmp_path / ".metadata"
    with open(path, "rb") as handle:
        recorder = _Recording(handle)
        metadata = recorder.load()
    assert list(metadata.state_dict_metadata["w"].size) == [3, 4]
    private = {(module, name) for module, name in recorder.names if name.startswith("_")}
    assert private <= compat.DCP_METADATA_GLOBALS
    for module, name in compat.DCP_METADATA_GLOBALS:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone"


# ---- DeviceMesh ------------------------------------------------------------------------------------
def _flattened_mesh() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "cp"))
    flat = compat.flatten_mesh(mesh["dp", "cp"], "dp_cp")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total, group=flat.get_group())
    return {"names": flat.mesh_dim_names, "ranks": dist.get_process_group_ranks(flat.get_group()),
            "sum": total.item()}


def test_flatten_mesh_gives_one_group_over_both_dims(cluster2):
    for result in cluster2.run(_flattened_mesh):
        assert result == {"names": ("dp_cp",), "ranks": [0, 1], "sum": 3.0}


def _unflattened_mesh() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    grid = compat.unflatten_mesh(mesh, "tp", (2, 1), ("row", "col"))
    return {"names": grid.mesh_dim_names, "rows": dist.get_process_group_ranks(grid["row"].get_group()),
            "coords": (grid["row"].get_local_rank(), grid["col"].get_local_rank())}


def test_unflatten_mesh_splits_a_dim_into_a_grid(cluster2):
    results = cluster2.run(_unflattened_mesh)
    assert [r["coords"] for r in results] == [(0, 0), (1, 0)]
    for result in results:
        assert result["names"] == ("dp", "row", "col") and result["rows"] == [0, 1]


# ---- torch.distributed.pipelining ------------------------------------------------------------------
def _stage_hook_calls(n_microbatches: int) -> dict[str, int]:
    """A real zero-bubble V schedule over 2 ranks × 2 stages, counting the compute hooks it calls."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    compat.check_stage_compute_hooks()
    calls = dict.fromkeys(compat.STAGE_COMPUTE_HOOKS, 0)

    def counted(name):
        def method(self, *args, **kwargs):
            calls[name] += 1
            return getattr(PipelineStage, name)(self, *args, **kwargs)
        return method

    counting = type("CountingStage", (PipelineStage,),
                    {name: counted(name) for name in compat.STAGE_COMPUTE_HOOKS})
    rank = dist.get_rank()
    torch.manual_seed(0)
    stages = [counting(torch.nn.Linear(4, 4), stage, 4, torch.device("cpu")) for stage in (rank, 3 - rank)]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=n_microbatches,
                                     loss_fn=lambda out, target: F.mse_loss(out, target))
    inputs, targets = torch.randn(2 * n_microbatches, 4), torch.randn(2 * n_microbatches, 4)
    if rank == 0:  # V placement: rank 0 holds the first and the last stage
        schedule.step(inputs, target=targets)
    else:
        schedule.step()
    return calls


def test_schedules_call_the_stage_compute_hooks(cluster2):
    n_mb = 2
    for calls in cluster2.run(_stage_hook_calls, n_mb):
        # two stages per rank, each runs every microbatch forward, backward (input) and weight
        assert calls == dict.fromkeys(compat.STAGE_COMPUTE_HOOKS, 2 * n_mb)


# ---- transformers ----------------------------------------------------------------------------------
def _tiny_llama(attn: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, attn_implementation=attn)
    return transformers.LlamaForCausalLM(config)


def test_create_causal_mask_masks_the_future():
    model = _tiny_llama("eager")  # eager attention takes the mask as an additive float tensor
    seq = 6
    h = torch.randn(2, seq, 32)
    mask = compat.create_causal_mask(model.config, h, torch.arange(seq).unsqueeze(0))
    allowed = mask[0, 0] == 0
    assert torch.equal(allowed, torch.ones(seq, seq, dtype=torch.bool).tril())
    assert (mask[0, 0][~allowed] <= torch.finfo(h.dtype).min / 2).all()


def test_hf_tp_plan_is_the_models_own_and_names_its_modules():
    model = _tiny_llama("sdpa")
    plan = compat.hf_tp_plan(model)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    names = [name for name, _ in model.named_modules()]
    for pattern in plan:
        assert any(fnmatch(name, pattern) for name in names), f"{pattern} names no module"
    assert compat.hf_tp_plan(torch.nn.Linear(2, 2)) == {}


# ---- ipyparallel -----------------------------------------------------------------------------------
def _on_engine_kernel() -> bool:
    from ipykernel.kernelbase import Kernel

    return type(Kernel.instance()) is compat.ipp_engine_kernel_class()


def test_engine_kernel_class_is_what_engines_run(cluster2):
    assert cluster2.run(_on_engine_kernel) == [True, True]


def test_engine_main_code_starts_the_engine_app():
    done = subprocess.run([sys.executable, "-c", compat.ENGINE_MAIN_CODE, "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.search(r"--IPEngine\.", done.stdout)


# ---- activation checkpointing ----------------------------------------------------------------------
class _CountingTanh(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(2 * x)


def test_checkpoint_wrapper_recomputes_in_backward():
    x = torch.randn(3, 4, requires_grad=True)
    inner = _CountingTanh()
    expected = torch.autograd.grad(inner(x).square().sum(), x)[0]
    inner.calls = 0
    wrapped = compat.checkpoint_wrapper(inner, preserve_rng_state=False)
    got = torch.autograd.grad(wrapped(x).square().sum(), x)[0]
    assert inner.calls == 2  # the forward, and its recomputation during backward
    assert torch.equal(got, expected)


def test_sdpa_aten_ops_include_the_kernel_sdpa_runs_here():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with Record():
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert set(seen) & set(compat.sdpa_aten_ops())


def test_task_futures_show_a_finished_rank_while_another_still_runs(cluster2):
    view = cluster2._client[cluster2._client.ids[:2]]
    result = view.execute("import time\nif rank == 1: time.sleep(2.0)", block=False)
    futures = compat.task_futures(result)
    assert len(futures) == 2
    futures[0].result(timeout=30)
    assert futures[0].done() and not futures[1].done() and not result.ready()
    result.get(timeout=30)


def test_engine_main_file_is_where_an_engine_main_thread_starts(cluster2):
    import faulthandler
    import tempfile

    def dump() -> str:
        with tempfile.TemporaryFile("w+") as handle:
            faulthandler.dump_traceback(handle, all_threads=False)
            handle.seek(0)
            return handle.read()

    assert all(compat.ENGINE_MAIN_FILE in text for text in cluster2.run(dump))


def answer_echo_requests() -> None:
    import threading

    compat.answer_control_requests({"colab_par_echo_request": lambda content: {
        "echo": content["text"], "thread": threading.current_thread().name}})


def test_control_requests_are_answered_from_the_control_thread_while_a_task_runs(cluster2):
    import concurrent.futures

    cluster2.run(answer_echo_requests)
    busy = cluster2._client[cluster2._client.ids[:2]].execute("import time\ntime.sleep(2.0)", block=False)
    futures = compat.send_control_requests(cluster2._client, cluster2._client.ids[:2], "colab_par_echo_request",
                                           {"text": "hello"})
    concurrent.futures.wait(futures, timeout=10)
    replies = [future.result()["content"] for future in futures]
    assert not busy.ready()  # answered while the main thread still sleeps in the task
    assert [(r["status"], r["echo"]) for r in replies] == [("ok", "hello")] * 2
    assert all(r["thread"] != "MainThread" for r in replies)
    busy.get(timeout=30)


def sequence_and_groups() -> tuple[int, int, bool]:
    import torch
    import torch.distributed as dist

    before = compat.group_sequence(dist.group.WORLD)
    dist.all_reduce(torch.ones(1))
    return before, compat.group_sequence(dist.group.WORLD), dist.group.WORLD in compat.process_groups()


def test_group_sequence_counts_each_collective_and_process_groups_lists_the_world(cluster2):
    (before, after, listed), second = cluster2.run(sequence_and_groups)
    assert after == before + 1 and listed and second == (before, after, True)
