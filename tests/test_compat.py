"""Each private API in colab_par.compat, exercised against the installed torch, ipyparallel and
transformers (no mocks): if a release drops or changes one, its test here fails first."""
from __future__ import annotations

import functools
import importlib
import json
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
    declared = [requirement.split(";")[0].strip()  # without environment markers
                for requirement in project["dependencies"] + project["optional-dependencies"]["hf"]]
    for package, requirement in compat.SUPPORTED.items():
        assert requirement in declared, f"pyproject.toml does not declare {requirement}"
    assert compat.SUPPORTED["transformers"] in project["optional-dependencies"]["test"]


def test_a_missing_api_names_the_supported_range():
    import transformers

    error = compat._missing("transformers", "loss.loss_utils")
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


def _heart_registrations(monitor_class: type, pongs: list[list[bytes]]) -> tuple[list[str], set[bytes]]:
    """The hearts a real heart monitor of `monitor_class` (its own zmq sockets, no beat running)
    announces to the hub within 0.5 s of receiving `pongs`, and the hearts it then knows."""
    import asyncio

    import zmq
    from jupyter_client.session import Session
    from zmq.eventloop.zmqstream import ZMQStream

    async def run() -> tuple[list[str], set[bytes]]:
        context = zmq.Context()
        hub = context.socket(zmq.PULL)  # what the hub reads the monitor's announcements from
        hub.bind("inproc://monitor")
        sockets = {kind: context.socket(kind) for kind in (zmq.PUB, zmq.ROUTER, zmq.PUSH)}
        sockets[zmq.PUSH].connect("inproc://monitor")
        session = Session(key=b"test")
        monitor = monitor_class(ping_stream=ZMQStream(sockets[zmq.PUB]), pong_stream=ZMQStream(sockets[zmq.ROUTER]),
                                monitor_stream=ZMQStream(sockets[zmq.PUSH]), session=session)
        monitor.lifetime = 1.5  # the ping being answered
        for pong in pongs:
            monitor.handle_pong(pong)
        announced = []
        deadline = asyncio.get_running_loop().time() + 0.5
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
            while hub.poll(0):
                _, message = session.feed_identities(hub.recv_multipart())
                announced += session.deserialize(message)["content"]["hearts"]
        known = set(monitor.hearts)
        for stream_socket in (hub, *sockets.values()):
            stream_socket.close(linger=0)
        context.term()
        return announced, known

    return asyncio.run(run())


def test_prompt_heart_monitor_registers_a_heart_at_its_first_answer():
    from ipyparallel.controller.heartmonitor import HeartMonitor

    pongs = [[b"engine-a", b"1.5"], [b"engine-b", b"0.5"]]  # b answers a ping it never got
    assert _heart_registrations(compat.prompt_heart_monitor(), pongs) == (["engine-a"], {b"engine-a"})
    # ipyparallel's own waits for the next beat: nothing announced before it
    assert _heart_registrations(HeartMonitor, pongs) == ([], set())


def test_controller_main_code_starts_the_controller_app():
    assert "run_controller()" in compat.CONTROLLER_MAIN_CODE  # through run_controller: the prompt monitor
    done = subprocess.run([sys.executable, "-c", compat.CONTROLLER_MAIN_CODE, "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.search(r"--HeartMonitor\.period", done.stdout)


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


class _RecordOps(compat.torch_dispatch_mode()):
    """Every aten overload dispatched under it, in order."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_sdpa_aten_ops_include_the_kernel_sdpa_runs_here():
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with _RecordOps() as record:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert set(record.seen) & set(compat.sdpa_aten_ops())


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


# ---- dispatch modes, pytrees and aten op metadata ---------------------------------------------------
def test_torch_dispatch_mode_sees_every_aten_call_in_order():
    x = torch.ones(3)
    with _RecordOps() as record:
        (x * 2).sum()
    assert record.seen == [torch.ops.aten.mul.Tensor, torch.ops.aten.sum.default]


def test_tree_map_and_leaves_walk_nested_containers_in_order():
    tree = {"a": (1, [2, 3]), "b": {"c": 4}}
    assert compat.tree_leaves(tree) == [1, 2, 3, 4]
    assert compat.tree_map(lambda leaf: leaf * 10, tree) == {"a": (10, [20, 30]), "b": {"c": 40}}


def test_device_constructors_are_what_a_device_context_redirects():
    constructors = compat.device_constructors()
    assert {torch.empty, torch.zeros, torch.ones, torch.randn, torch.arange, torch.full} <= constructors
    assert torch.add not in constructors
    with torch.device("meta"):
        assert all(make(2).is_meta for make in (torch.empty, torch.zeros, torch.randn))


def test_op_schema_says_what_an_op_writes_and_whether_it_returns_a_view():
    uniform = compat.op_schema(torch.ops.aten.uniform_.default)
    assert uniform.arguments[0].alias_info.is_write
    assert all(arg.alias_info is None for arg in uniform.arguments[1:])
    view = compat.op_schema(torch.ops.aten.view.default)
    assert view.returns[0].alias_info is not None and not view.returns[0].alias_info.is_write
    assert compat.op_schema(torch.ops.aten.add.Tensor).returns[0].alias_info is None


def test_storage_key_tells_meta_storages_apart_and_joins_views():
    a, b = torch.empty(4, device="meta"), torch.empty(4, device="meta")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == 0  # why a key is needed
    assert compat.storage_key(a) != compat.storage_key(b)
    assert compat.storage_key(a[1:]) == compat.storage_key(a.view(2, 2)) == compat.storage_key(a)


def test_module_reset_finds_public_and_torchs_private_resets():
    linear = torch.nn.Linear(4, 4)
    assert compat.module_reset(linear) == linear.reset_parameters
    attention = torch.nn.MultiheadAttention(4, 2)
    before = attention.in_proj_weight.detach().clone()
    reset = compat.module_reset(attention)
    assert reset is not None and not hasattr(attention, "reset_parameters")
    reset()
    assert not torch.equal(attention.in_proj_weight, before)  # drawn again
    assert compat.module_reset(torch.nn.ReLU()) is None


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_triton_interpreted_follows_the_environment_at_import(interpret: str):
    import os

    code = ("import triton.language as tl\nfrom colab_par import compat\n"
            "print(compat.triton_interpreted(tl.sum))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRITON_INTERPRET": interpret})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(interpret == "1")


# ---- the claim: nothing else uses a private API ----------------------------------------------------
PACKAGE_ROOTS = [Path(__file__).resolve().parents[1] / name for name in ("colab_par", "kernels")]
FOREIGN = ("torch", "transformers", "triton", "ipyparallel", "ipykernel")
COMPAT_FOLDER = Path(compat.__file__).resolve().parent  # the one place allowed to use private APIs
# Private names still used outside colab_par/compat/: (file, name) -> why. Keep this short; each entry is a
# release of torch away from an AttributeError inside training.
ALLOWED = {
    ("colab_par/parallel/tensor_parallel.py", "_apply"):
        "a ParallelStyle subclass implements torch's _apply (no public hook); tensor-parallel room",
    ("colab_par/parallel/hf_plans.py", "_apply"):
        "GPT-2's Conv1D styles implement torch's ParallelStyle._apply (no public hook)",
    ("colab_par/parallel/adapters/tensor_split.py", "_apply"):
        "the adapters' ParallelStyles implement torch's ParallelStyle._apply (no public hook)",
    ("colab_par/parallel/tensor_parallel.py", "_parameters"):
        "replaces parameters in place while distributing them; tensor-parallel room",
    ("colab_par/parallel/tensor_parallel.py", "_modules"):
        "swaps submodules while distributing them; tensor-parallel room",
}


@functools.cache
def _foreign_private_attributes() -> frozenset[str]:
    """Private attribute names of the torch, transformers, ipyparallel and ipykernel objects the kit
    handles (classes and live instances: `_parameters` exists only on an instance), and every private name
    colab_par/compat/ itself reaches for (`AsyncResult._children` is set only on a live result)."""
    import ast
    import inspect

    import ipyparallel
    import transformers
    from ipykernel.kernelbase import Kernel
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ParallelStyle

    param = torch.nn.Parameter(torch.zeros(1))
    objects = [torch.zeros(1), param, param.untyped_storage(), torch.ops.aten.add, torch.ops.aten.add.Tensor,
               torch.nn.Linear(1, 1), torch.optim.SGD([param]), torch.Generator(), DeviceMesh, DTensor,
               FSDPModule, PipelineStage, ParallelStyle, torch.autograd.Function,
               transformers.PreTrainedModel, transformers.PretrainedConfig(), ipyparallel.AsyncResult,
               ipyparallel.Client, ipyparallel.DirectView, Kernel]
    objects += [cls for _, cls in inspect.getmembers(torch.nn, inspect.isclass)
                if issubclass(cls, torch.nn.Module)]
    names = {name for obj in objects for name in dir(obj)}
    nodes = (node for path in sorted(COMPAT_FOLDER.glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))))
    for node in nodes:
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)
    return frozenset(name for name in names if name.startswith("_") and not name.startswith("__"))


def _private_uses(path: Path, private_names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each private name of a foreign package `path` uses: imports of a private
    module or name, attribute chains from a foreign package through a private name, private
    attributes of foreign objects (on anything but self/cls), and getattr & co. of them by string."""
    import ast

    def private(part: str) -> bool:
        return part.startswith("_") and not part.startswith("__")

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] in FOREIGN:
            names = [node.module] if any(map(private, node.module.split("."))) else []
            found += [(node.lineno, name) for name in names + [a.name for a in node.names if private(a.name)]]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] in FOREIGN and any(map(private, a.name.split(".")))]
        elif isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            root_name = root.id if isinstance(root, ast.Name) else None
            if root_name in FOREIGN or (node.attr in private_names and root_name not in ("self", "cls")):
                found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in private_names):
            found.append((node.lineno, node.args[1].value))
    return found


def test_nothing_outside_compat_uses_a_private_api():
    private_names = _foreign_private_attributes()
    root = PACKAGE_ROOTS[0].parent
    uses = {}
    for package in PACKAGE_ROOTS:
        for path in sorted(package.rglob("*.py")):
            if COMPAT_FOLDER in path.parents:
                continue
            where = str(path.relative_to(root))
            for line, name in _private_uses(path, private_names):
                if (where, name) not in ALLOWED:
                    uses.setdefault(where, []).append(f"line {line}: {name}")
    assert not uses, f"private APIs outside colab_par/compat/ (put them behind compat): {uses}"


def test_the_private_api_scan_finds_each_kind_of_use(tmp_path):
    """The scan itself can fail: each kind of private use it must catch, in a file of its own."""
    private_names = _foreign_private_attributes()
    cases = {"from torch.utils._pytree import tree_map": "torch.utils._pytree",
             "from torch.utils._device import _device_constructors": "_device_constructors",
             "import torch._dynamo": "torch._dynamo",
             "x = torch._C._get_tracing_state()": "_C",
             "key = t.untyped_storage()._cdata": "_cdata",
             "schema = func._schema": "_schema",
             "module._parameters[name] = p": "_parameters",
             "futures = getattr(result, '_children')": "_children",
             "reset = getattr(module, '_reset_parameters', None)": "_reset_parameters",
             "kernel._publish_status('idle', 'shell')": "_publish_status"}
    for i, (code, name) in enumerate(cases.items()):
        path = tmp_path / f"case{i}.py"
        path.write_text("import torch\n" + code + "\n")
        assert name in [found for _, found in _private_uses(path, private_names)], code
    clean = tmp_path / "clean.py"
    clean.write_text("class A:\n    def f(self):\n        self._parameters = {}\n"
                     "        return self._schema\nfrom torch.utils.flop_counter import FlopCounterMode\n"
                     "x = torch.ops.aten.add.default\n")
    assert _private_uses(clean, private_names) == []


# ---- pytrees and transformers' losses ----------------------------------------------------------------
def test_pytree_flattens_model_outputs_and_rebuilds_them():
    transformers = pytest.importorskip("transformers")

    output = transformers.modeling_outputs.CausalLMOutput(logits=torch.ones(2, 3))
    leaves, spec = compat.tree_flatten(((torch.zeros(1), 2), {"out": output}))
    assert [type(leaf) for leaf in leaves] == [torch.Tensor, int, torch.Tensor]
    rebuilt = compat.tree_unflatten(leaves, spec)
    assert torch.equal(rebuilt[1]["out"].logits, output.logits) and rebuilt[0][1] == 2
    doubled = compat.tree_map(lambda leaf: leaf * 2, {"a": torch.ones(2), "b": [3]})
    assert torch.equal(doubled["a"], torch.full((2,), 2.0)) and doubled["b"] == [6]


def test_hf_token_losses_are_what_language_models_score_with():
    """The causal loss shifts labels (summed over the items, divided by num_items_in_batch), the
    masked one does not; GPT-2 (not named *ForCausalLM) and BERT's masked LM use them."""
    transformers = pytest.importorskip("transformers")

    losses = compat.hf_token_losses()
    logits, labels = torch.randn(1, 4, 5), torch.tensor([[1, 2, -100, 4]])
    flat = F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="none")
    shifted = F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="none")
    torch.testing.assert_close(losses["masked"](logits, labels, 5, num_items_in_batch=2.0), flat.sum() / 2)
    torch.testing.assert_close(losses["causal"](logits, labels, 5, num_items_in_batch=2.0), shifted.sum() / 2)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=8))
    bert = transformers.BertForMaskedLM(transformers.BertConfig(hidden_size=8, num_hidden_layers=1,
                                                                num_attention_heads=2, intermediate_size=8))
    assert gpt2.loss_function is losses["causal"] and bert.loss_function is losses["masked"]


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


def calls_after_a_rebind(store_file: str) -> tuple[list[float], list[int], list[int]]:
    """A DTensor all-gather and a send through a captured group object after that group was rebound
    to a fresh gloo backend over `store_file`: (the gathered tensor, the calls the old backend ran
    before and after them, the calls the fresh one ran)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    group = dist.new_group([0, 1])  # not the world's group
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))
    sharded = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    old = group._get_backend(torch.device("cpu"))
    before = old._get_sequence_number_for_group()
    compat.rebind_group(group, dist.FileStore(store_file, 2), timedelta(seconds=30))
    gathered = sharded.redistribute(mesh, [Replicate()]).to_local().tolist()
    message = torch.tensor([float(dist.get_rank())])
    (dist.isend(message, 1, group=group) if dist.get_rank() == 0 else dist.irecv(message, 0, group=group)).wait()
    fresh = group._get_backend(torch.device("cpu"))._get_sequence_number_for_group()
    return gathered + message.tolist(), [before, old._get_sequence_number_for_group()], [fresh]


def test_rebind_group_sends_what_holds_the_group_object_to_the_fresh_backend(cluster2, tmp_path):
    """DTensor resolves the group by name, a pipeline stage calls with the object: both reach the
    fresh backend, the old one runs nothing more."""
    for gathered, (before, after), (fresh,) in cluster2.run(calls_after_a_rebind, str(tmp_path / "store")):
        assert gathered == [0.0, 1.0, 2.0, 3.0, 0.0] and after == before and fresh == 2


def objects_over_a_registered_group(store_file: str) -> tuple[int, int, list]:
    """A group formed over `store_file` alone, then torch's own calls on it: its rank and size, an
    object all-gather (what DCP and the checkpoint's agreement run on)."""
    from datetime import timedelta

    import torch.distributed as dist

    group = compat.registered_gloo_group(dist.FileStore(store_file, 2), [1, 0], "colab_par-test-registered",
                                         timedelta(seconds=30))
    gathered = [None, None]
    dist.all_gather_object(gathered, f"rank {dist.get_rank()}", group=group)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    dist.destroy_process_group(group)
    return rank, size, gathered


def test_registered_gloo_group_takes_torchs_own_calls(cluster2, tmp_path):
    """Ranks listed [1, 0]: the world's rank 1 is the group's rank 0."""
    assert cluster2.run(objects_over_a_registered_group, str(tmp_path / "store")) == [
        (1, 2, ["rank 1", "rank 0"]), (0, 2, ["rank 1", "rank 0"])]


def _reformed_world_rank(rank: int, folder: str, out: str) -> None:
    """A dp2 tp2 DTensor op in a world of 4, then the same op after the world is re-formed with
    other group names (one more group first): it must run on the new world's mesh."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from colab_par.layout import Layout
    from colab_par.parallel.mesh import build_mesh

    results = []
    for world in range(2):
        store = dist.FileStore(f"{folder}/store{world}", 4)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
        if world:
            dist.new_group([0, 1])  # the mesh's groups now get other names than in the first world
        mesh, _ = build_mesh(Layout.parse("dp2 tp2"), torch.device("cpu"))
        doubled = distribute_tensor(torch.arange(4.0), mesh["tp"], [Shard(0)]) * 2
        results.append(doubled.full_tensor().tolist())
        dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps(results))


def test_forget_dtensor_plans_lets_a_reformed_world_run_dtensor_ops(tmp_path):
    """Without it (`build_mesh` calls it in a new world) the second world's op reuses the first
    world's cached plan and mesh: "Could not resolve the process group registered under the name"."""
    torch.multiprocessing.start_processes(_reformed_world_rank, args=(str(tmp_path), str(tmp_path)), nprocs=4,
                                          start_method="spawn")
    assert [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(4)] == [[[0.0, 2.0, 4.0, 6.0]] * 2] * 4


def test_compile_seconds_count_each_compiled_frame_and_lazy_backward_but_not_reuse():
    import torch._dynamo

    torch._dynamo.reset()
    function = torch.compile(lambda x: (x.sin() * 2).sum(), backend="aot_eager")
    x = torch.randn(8, requires_grad=True)
    start = compat.compile_seconds()
    loss = function(x)
    forward = compat.compile_seconds()
    loss.backward()  # the backward graph compiles at the first backward
    backward = compat.compile_seconds()
    function(x).backward()
    assert start < forward < backward == compat.compile_seconds()


# ---- torch grouped matmul --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_mm_equals_a_matmul_per_group(dtype):
    """float32 takes torch._grouped_mm (when torch has it), float64 the loop; both equal one matmul
    per expert, an empty group included, in value and gradient (a summed loss: expanded gradient)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(10, 8, dtype=dtype, generator=generator, requires_grad=True)
    weights = torch.randn(3, 8, 12, dtype=dtype, generator=generator, requires_grad=True)
    ends = torch.tensor([3, 3, 10], dtype=torch.int32)
    out = compat.grouped_mm(tokens, weights, ends)
    expected = torch.cat([tokens[:3] @ weights[0], tokens[3:3] @ weights[1], tokens[3:] @ weights[2]])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), (tokens, weights)),
                               torch.autograd.grad(expected.sum(), (tokens, weights)))
    if dtype == torch.float32:
        assert "GroupedMm" in type(out.grad_fn).__name__, "float32 should run torch's grouped matmul"


def test_storage_holder_rehomes_a_dtensor_parameters_values(cluster2):
    def rehome() -> bool:
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2,))
        param = nn.Parameter(distribute_tensor(torch.arange(8.0).view(4, 2), mesh, [Shard(0)]))
        elsewhere = torch.full((2, 2), 7.0)
        with torch.no_grad():
            compat.storage_holder(param).data = elsewhere
        plain = nn.Parameter(torch.zeros(3))
        return (param.to_local().data_ptr() == elsewhere.data_ptr() and bool((param.full_tensor() == 7).all())
                and compat.storage_holder(plain) is plain)

    assert cluster2.run(rehome) == [True, True]


def test_fsdp_offload_policy_is_the_one_fully_shard_applied(cluster2):
    def policies() -> list[str]:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        from colab_par.compat import fsdp_offload_policy

        mesh = init_device_mesh("cpu", (2,))
        offloaded = fully_shard(torch.nn.Linear(4, 4), mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        plain = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
        holds_none = fully_shard(torch.nn.Sequential(fully_shard(torch.nn.Linear(4, 4), mesh=mesh)), mesh=mesh)
        return [type(fsdp_offload_policy(m)).__name__ for m in (offloaded, plain, holds_none)]

    assert cluster2.run(policies) == [["CPUOffloadPolicy", "OffloadPolicy", "NoneType"]] * 2


# ---- the rest of the entries: one test each ------------------------------------------------------
def test_grouped_mm_is_one_op_only_for_the_operands_torchs_kernel_takes():
    weights = torch.randn(2, 8, 4)
    assert compat.grouped_mm_is_one_op(torch.randn(6, 8), weights)  # float32, 32-byte rows
    assert not compat.grouped_mm_is_one_op(torch.randn(6, 8, dtype=torch.float64), weights.double())
    assert not compat.grouped_mm_is_one_op(torch.randn(6, 3), torch.randn(2, 3, 4))  # 12-byte rows
    assert not compat.grouped_mm_is_one_op(torch.randn(6, 8), weights.half())  # mixed dtypes


def test_unwrapped_name_takes_the_checkpoint_wrappers_module_out():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    plain = [name for name, _ in model.named_parameters()]
    model[0] = compat.checkpoint_wrapper(model[0])
    wrapped = [name for name, _ in model.named_parameters()]
    assert wrapped != plain and [compat.unwrapped_name(name) for name in wrapped] == plain


def test_swapped_parameters_run_the_module_with_the_given_tensors_then_restore():
    linear = torch.nn.Linear(3, 2, bias=False)
    own, x = linear.weight, torch.randn(4, 3)
    other = torch.randn(2, 3, requires_grad=True)
    with compat.swapped_parameters(linear, {"weight": other}):
        out = linear(x)
    torch.testing.assert_close(out, x @ other.T, rtol=0, atol=0)
    assert linear.weight is own
    out.sum().backward()  # the gradient reaches the swapped-in tensor's history
    torch.testing.assert_close(other.grad, x.sum(0).expand(2, 3), rtol=0, atol=0)


def test_fused_optimizer_devices_include_cpu_where_fused_adam_runs_on_it():
    devices = compat.fused_optimizer_devices()
    assert "cuda" in devices
    if "cpu" in devices:  # then torch's fused AdamW must really take CPU tensors
        param = torch.nn.Parameter(torch.ones(3))
        param.grad = torch.ones(3)
        torch.optim.AdamW([param], lr=0.1, fused=True).step()
        assert torch.all(param < 1)


def test_recompile_limit_error_is_raised_at_the_limit_under_failing_at_recompile_limit():
    import torch._dynamo

    assert compat.recompile_limit() >= 1
    torch._dynamo.reset()
    function = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        assert compat.recompile_limit() == 1
        function(torch.ones(2))
        with compat.failing_at_recompile_limit(), pytest.raises(compat.recompile_limit_error()):
            function(torch.ones(3))  # a second shape: dynamo would fall back to eager silently
    torch._dynamo.reset()


def test_pin_inductor_vector_width_pins_what_inductor_would_pick():
    import torch._inductor.config as config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    before = config.cpp.simdlen
    try:
        config.cpp.simdlen = None
        width = compat.pin_inductor_vector_width()
        assert width == config.cpp.simdlen == pick_vec_isa().bit_width()
    finally:
        config.cpp.simdlen = before


def _drop_attribute(monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module, name: str) -> None:
    """`model` as a transformers release without `name` would build it: gone from the instance and
    from every class that defines it (what a rename upstream does)."""
    if name in vars(model):
        monkeypatch.delattr(model, name)
    for cls in type(model).__mro__:
        if name in vars(cls):
            monkeypatch.delattr(cls, name)
    assert not hasattr(model, name)


def test_hf_output_recorder_finds_a_moe_models_router_and_refuses_a_drifted_transformers(monkeypatch):
    transformers = pytest.importorskip("transformers")

    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=2)
    model = transformers.MixtralForCausalLM(config)
    recorder = compat.hf_output_recorder(model, "router_logits")
    assert any(isinstance(module, recorder.target_class) for module in model.modules())
    assert compat.hf_output_recorder(model, "no_such_output") is None
    assert compat.hf_output_recorder(torch.nn.Linear(2, 2), "router_logits") is None  # not transformers'
    # a transformers without the attributes: refused, not read as "no plan" / "records nothing"
    _drop_attribute(monkeypatch, model, "_tp_plan")
    with pytest.raises(compat.CompatError, match=r"_tp_plan.*transformers>=5\.9"):
        compat.hf_tp_plan(model)
    _drop_attribute(monkeypatch, model, "_can_record_outputs")
    with pytest.raises(compat.CompatError, match=r"_can_record_outputs.*transformers>=5\.9"):
        compat.hf_output_recorder.__wrapped__(model, "router_logits")


def _local_offsets() -> tuple[int, ...]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2,))
    return (compat.local_shard_offsets((5, 3), mesh, [Shard(0)]), compat.local_shard_offsets((5, 3), mesh, [Shard(1)]),
            compat.local_shard_offsets((5, 3), mesh, [Replicate()]))


def test_local_shard_offsets_are_where_each_ranks_block_starts(cluster2):
    # torch's chunking: 5 rows -> 3 + 2, 3 columns -> 2 + 1
    assert cluster2.run(_local_offsets) == [((0, 0), (0, 0), (0, 0)), ((3, 0), (0, 2), (0, 0))]


def _engine_side() -> dict:
    """On an engine: the kernel, its shell entry for direct requests, and after_output's fast path."""
    import sys
    import threading

    kernel = compat.engine_kernel()
    ran = threading.Event()
    seen = {}

    def then() -> None:
        seen.update(thread=threading.current_thread().name,
                    pending=any(buffer.tell() for buffer in sys.stdout._buffers.values()))
        ran.set()

    print("some output", end="")
    compat.after_output([sys.stdout, sys.stderr], then)
    ran.wait(10)
    mark = compat.output_mark(kernel.session, [sys.stdout])
    quiet = compat.output_since(mark, kernel.session, [sys.stdout])
    print("more")
    return {"kernel": type(kernel) is compat.ipp_engine_kernel_class(),
            "shell": compat.engine_shell(kernel) is not None, "after_output": seen, "quiet": quiet,
            "printed": compat.output_since(mark, kernel.session, [sys.stdout])}


def test_engine_kernel_shell_and_output_order_take_the_fast_paths(cluster2):
    """The fallbacks (no direct channel, a flush that waits, "assume output") are not what the
    installed ipykernel gets: `then` runs on the output thread after the pending text went out."""
    for result in cluster2.run(_engine_side):
        assert result["kernel"] and result["shell"]
        assert result["after_output"] == {"thread": result["after_output"]["thread"], "pending": False}
        assert result["after_output"]["thread"] != "MainThread"
        assert result["quiet"] is False and result["printed"] is True


def _publish_idle(msg_id: str, session: str) -> None:
    parent = {"header": {"msg_id": msg_id, "session": session, "username": "test", "msg_type": "apply_request",
                         "date": "2026-01-01T00:00:00Z", "version": "5.3"}}
    compat.publish_status(compat.engine_kernel(), "idle", parent)


def test_publish_status_idle_resolves_the_clients_output_future(cluster2):
    """What direct.py sends after a request's output: the client's own books (`client_metadata`,
    `output_futures`) resolve the request's output when the engine's idle status arrives."""
    import concurrent.futures
    import uuid

    client = cluster2._client
    msg_id = f"colab-par-test-{uuid.uuid4()}"
    done = concurrent.futures.Future()
    compat.client_metadata(client)[msg_id]  # a request of this client's (its books are a defaultdict)
    compat.output_futures(client)[msg_id] = done
    try:
        client[client.ids[0]].apply_sync(_publish_idle, msg_id, client.session.session)
        assert done.result(timeout=10) is None
    finally:
        compat.output_futures(client).pop(msg_id, None)
        compat.client_metadata(client).pop(msg_id, None)
    assert "ipykernel>=6.9.1,<8" in str(compat._missing("ipykernel", "Kernel._publish_status"))


def test_client_internals_are_the_live_clients_sockets_and_books(cluster2):
    import zmq
    from zmq.eventloop.zmqstream import ZMQStream

    client = cluster2._client
    ids = client.ids[:2]
    idents, targets = compat.engine_idents(client, ids)
    assert targets == ids and len(set(idents)) == 2 and all(isinstance(ident, bytes) for ident in idents)
    assert isinstance(compat.mux_stream(client), ZMQStream)
    assert isinstance(compat.client_context(client), zmq.Context)
    assert compat.client_io_loop(client) is not None and callable(compat.client_reply_handler(client))
    busy = client[ids].execute("import time\ntime.sleep(1.0)", block=False)
    assert compat.unanswered(client) == {ids[0]: 1, ids[1]: 1} | {i: 0 for i in client.ids[2:]}
    books = compat.client_metadata(client)[busy.msg_ids[0]]  # the request's own, filled as replies come
    busy.get(timeout=30)
    assert set(compat.unanswered(client).values()) == {0}
    assert books is busy.metadata[0] and books["msg_id"] == busy.msg_ids[0] and books["completed"] is not None


def _fail() -> None:
    raise ValueError("on purpose")


def test_failed_at_reads_when_each_engines_part_failed(cluster2):
    import datetime

    client = cluster2._client
    result = client[client.ids[:2]].apply_async(_fail)
    with pytest.raises(Exception):
        result.get(timeout=30)
    for future in compat.task_futures(result):
        assert isinstance(compat.failed_at(future, future.result()), datetime.datetime)


def test_non_persistent_buffers_are_the_ones_left_out_of_the_state_dict():
    module = torch.nn.Module()
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("table", torch.zeros(1), persistent=False)
    from colab_par.compat import non_persistent_buffers

    assert non_persistent_buffers(module) == {"table"} and set(module.state_dict()) == {"kept"}


def test_dtensor_over_wraps_the_local_tensor_itself_with_the_likes_layout(cluster2):
    def wrapped() -> tuple:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from colab_par.compat import dtensor_over

        like = distribute_tensor(torch.zeros(4, 3), init_device_mesh("cpu", (2,)), [Shard(0)])
        local = torch.full((2, 3), float(dist.get_rank()))
        over = dtensor_over(local, like)
        return (over.to_local().data_ptr() == local.data_ptr(), over.placements == like.placements,
                tuple(over.shape), over.full_tensor()[:, 0].tolist())

    assert cluster2.run(wrapped) == [(True, True, (4, 3), [0.0, 0.0, 1.0, 1.0])] * 2


def test_gpu_uuids_never_initialise_cuda():
    from colab_par.compat import gpu_uuids

    uuids = gpu_uuids()  # None here (no NVML); one string per GPU where there is one
    assert uuids is None or all(isinstance(uuid, str) for uuid in uuids)
    assert not torch.cuda.is_initialized()


FLIGHT = '''
import os, torch, torch.distributed as dist
from colab_par.compat import flight_record
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
record = flight_record()
print(sorted({"entries", "pg_config"} & set(record)), len(record["pg_config"]) > 0)
dist.destroy_process_group()
'''


def test_flight_record_is_torchs_record_of_this_process_collectives():
    """The full behaviour (an unfinished collective named) is tests/test_gpu_paths.py's; here the
    shape of what the private dump gives back."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**__import__("os").environ, "TORCH_FR_BUFFER_SIZE": "100", "PORT": str(port)}
    out = subprocess.run([sys.executable, "-c", FLIGHT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "['entries', 'pg_config'] True"


def test_assert_async_passes_a_true_condition_and_raises_its_message_on_cpu():
    compat.assert_async(torch.tensor(True), "never shown")
    with pytest.raises(RuntimeError, match="targets must be class indices"):
        compat.assert_async(torch.tensor(False), "targets must be class indices")
