"""What the GPU paths decide on the CPU: the NCCL error handling the engines ask torch for, the
Slurm engine job's tasks per node, which GPU each engine binds, and what a rank waits for when
its collective returned at once (as NCCL's do) and it blocks later, in user code."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from traitlets.config import Config

from colab_par import Slurm
from colab_par.cluster import engine
from colab_par.cluster.backend import choose_backend, expected_devices


def test_nccl_errors_abort_the_communicators_and_leave_the_engine_alive() -> None:
    """The mode the engines set, read in torch's own header: it cleans up (aborts the
    communicators, so pending collectives fail) and does not tear the process down."""
    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    modes = dict((int(v), k) for k, v in re.findall(r"(\w+) = (\d)", re.search(
        r"enum ErrorHandlingMode \{(.*?)\}", header.read_text(), re.S).group(1)))
    mode = modes[int(engine.NCCL_ENVIRONMENT["TORCH_NCCL_ASYNC_ERROR_HANDLING"])]
    clean_up = re.search(r"#define SHOULD_CLEAN_UP\(a\) \((.*)\)", header.read_text()).group(1)
    tear_down = re.search(r"#define SHOULD_TEAR_DOWN\(a\) \((.*)\)", header.read_text()).group(1)
    assert mode not in re.findall(r"a != (\w+)", clean_up) and mode in re.findall(r"a != (\w+)", tear_down)
    assert engine.bound_device("gloo") is None  # gloo binds no device; NCCL's: gpu_check's engine row


def test_a_slurm_engine_job_runs_its_gpus_count_of_engines_on_each_node(tmp_path: Path) -> None:
    """The script ipyparallel writes for `-n 8 --gpus-per-node 4` pins 4 tasks per node."""
    from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

    config = Config()
    Slurm(gpus_per_node=4).configure(config)
    launcher = SlurmEngineSetLauncher(work_dir=str(tmp_path), config=config, profile_dir=str(tmp_path),
                                      cluster_id="t")
    launcher.write_batch_script(8)
    script = Path(launcher.batch_file).read_text()
    assert "#SBATCH --ntasks=8\n" in script and "#SBATCH --gpus-per-node=4\n" in script
    assert "#SBATCH --ntasks-per-node=4\n" in script, script
    assert Slurm(gpus_per_node=4).sbatch_options(tasks_per_node=1).count("--ntasks-per-node=1") == 1


def reports(*engines: tuple[str, list[str]]) -> list[dict]:
    return [{"host": host, "gpus": len(ids), "gpu_ids": ids} for host, ids in engines]


def test_engines_given_a_gpu_each_are_not_a_short_host() -> None:
    """srun --gpus-per-task=1 (or a CUDA_VISIBLE_DEVICES per engine): each engine sees one GPU of
    its own and binds its cuda:0; engines seeing the same GPUs share them by local order; two
    engines seeing one same GPU are short."""
    own = reports(("n1", ["GPU-a"]), ("n1", ["GPU-b"]), ("n2", ["GPU-c"]), ("n2", ["GPU-d"]))
    assert choose_backend(None, own) == ("nccl", None)
    assert expected_devices("nccl", own) == ["cuda:0"] * 4
    shared = reports(("n1", ["GPU-a", "GPU-b"]), ("n1", ["GPU-a", "GPU-b"]))
    assert choose_backend(None, shared) == ("nccl", None)
    assert expected_devices("nccl", shared) == ["cuda:0", "cuda:1"]
    backend, note = choose_backend(None, reports(("n1", ["GPU-a"]), ("n1", ["GPU-a"])))
    assert backend == "gloo" and "n1 has 1 GPU for 2 engines" in note


def test_the_gpus_an_engine_reports_follow_cuda_visible_devices() -> None:
    """Without NVML here the names are CUDA_VISIBLE_DEVICES' entries: two engines pinned to
    different GPUs report different ones."""
    code = "from colab_par import engine; print(engine.visible_gpu_ids(1))"
    seen = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "CUDA_VISIBLE_DEVICES": d}).stdout.strip() for d in ("2", "3")]
    assert seen == ["['2']", "['3']"]


RANK = textwrap.dedent('''
    import os, sys, time, torch, torch.distributed as dist
    from colab_par import compat
    from colab_par.cluster import probe
    rank = int(sys.argv[1])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], TORCH_FR_BUFFER_SIZE="100")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1))
    def settled(done):  # gloo retires finished entries from its own thread, a moment later
        deadline = time.monotonic() + 10
        while not done(pending := probe.pending_collective(compat.flight_record())) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        return pending
    if rank == 0:
        work = dist.all_reduce(torch.ones(1), group=group, async_op=True)  # returns at once
        print(settled(lambda p: p is not None and p["group"] == group.group_name), flush=True)
        dist.barrier()  # rank 1 joins the all_reduce after this
        work.wait()
        print(settled(lambda p: p is None), flush=True)
    else:
        dist.barrier()
        dist.all_reduce(torch.ones(1), group=group)
    dist.destroy_process_group()
''')


def test_a_collective_that_returned_at_once_is_named_until_it_completes(tmp_path: Path) -> None:
    """Rank 0 enqueues an all_reduce rank 1 has not entered and goes on (as every NCCL call
    does): the flight recorder names it, with its group and members, until it completes."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    (tmp_path / "rank.py").write_text(RANK)
    ranks = [subprocess.Popen([sys.executable, str(tmp_path / "rank.py"), str(r), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (1, 0)]
    out = [p.communicate(timeout=120) for p in ranks][1][0].splitlines()
    assert len(out) == 2, out
    pending = eval(out[0])  # noqa: S307 - the dict the rank printed
    assert (pending["op"], pending["ranks"], pending["root"]) == ("all_reduce", [0, 1], None)
    assert pending["group"] != "0" and out[1] == "None"  # the world's all_reduce before it finished


def test_selective_recompute_keeps_the_output_of_every_fused_attention_backend() -> None:
    """Each fused kernel torch's SDPA may pick on a GPU (flash, memory-efficient, cuDNN: Hopper's
    default) is among the ops selective checkpointing saves; the math backend is matmuls."""
    from torch.nn.attention import SDPBackend

    from colab_par import compat

    fused = [name.lower().removesuffix("_attention") for name in SDPBackend.__members__
             if name not in ("ERROR", "MATH", "OVERRIDEABLE")]
    saved = {str(op) for op in compat.sdpa_aten_ops()}
    assert fused and all(f"aten._scaled_dot_product_{kind}_attention.default" in saved for kind in fused), saved


def test_after_an_out_of_memory_error_the_failed_frames_hold_no_tensor() -> None:
    """A cell failing with torch's OutOfMemoryError leaves its stack for `%debug` but not its
    variables (a retry needs their memory); any other error keeps them for inspection."""
    from IPython.core.interactiveshell import InteractiveShell

    from colab_par.cluster import postmortem

    shell = InteractiveShell.instance()
    postmortem.install()
    cell = textwrap.dedent('''
        import torch, weakref
        def step(error):
            activations = torch.ones(1000)
            refs.append(weakref.ref(activations))
            raise error("CUDA out of memory. Tried to allocate 2.00 GiB")
        refs = []
        step({})
    ''')
    try:
        shell.run_cell(cell.format("ValueError"))
        assert shell.user_ns["refs"][0]() is not None  # kept for debugging
        shell.run_cell(cell.format("torch.OutOfMemoryError"))
        assert shell.user_ns["refs"][0]() is None
        assert "step" in postmortem.begin()["text"]  # the stack is still there
    finally:
        postmortem.clear()
