"""The devices the planner and telemetry know: GPUs from the catalogue (`device_catalogue`: exact
product names, the vendors' datasheet peaks), and the CPU as measured.

Below the planner (estimates) and telemetry (MFU on the engines). A GPU is recognised only by the
exact name `torch.cuda.get_device_name()` reports for it (`PRODUCTS`): product lines share
fragments ("L4" is in "L40S", an H100 PCIe is not an H100 SXM, a MIG slice is not the whole GPU),
so anything else is unknown, and MFU is left out rather than guessed. The CPU's matmul peak, layer
cost and loopback bandwidth are measured when first asked for; the costs that need a process group
to measure (`CPU_COSTS`) come from `benchmarks/cpu_costs.py`, which writes `cpu_costs.json`.
"""
from __future__ import annotations

import functools
import json
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from colab_par.layout.device_catalogue import DEVICES, PRODUCTS, GiB, DeviceSpec, catalogue_device, device_for_product
from colab_par.planning.flops import ModelSpec, flops_per_token

__all__ = ["GiB", "DeviceSpec", "DEVICES", "PRODUCTS", "device_for_product", "get_device",
           "catalogue_device", "CpuCosts",
           "CPU_COSTS", "CPU_COSTS_FILE", "CPU_WRAPPER_COST", "CPU_PROCESS_BYTES", "load_cpu_costs",
           "measure_cpu_device", "cpu_device", "cpu_compute_costs"]

def get_device(device: "str | DeviceSpec", engines: int = 1) -> DeviceSpec:
    """A catalogue entry by name (case-insensitive, "cpu" = measured), or the DeviceSpec given.
    Any other name is refused: a GPU's figures are never guessed (a "cuda" device names no product)."""
    if isinstance(device, DeviceSpec):
        return device
    key = str(device).lower()
    if key.startswith("cpu"):
        return measure_cpu_device(engines)
    spec = catalogue_device(str(device))
    if spec is None:
        what = ("a torch device type, not a GPU product" if key.split(":")[0] == "cuda"
                else "not in the device catalogue")
        raise ValueError(f"device {device!r} is {what}; choose one of {', '.join(DEVICES)} or 'cpu' "
                         "(measured), or describe the GPU with a DeviceSpec(name, memory, peak_flops="
                         "{'bf16': ..., 'fp32': ...}, hbm_bandwidth, intra_bandwidth, inter_bandwidth, "
                         "host_bandwidth) from its datasheet")
    return spec


# ---- CPU: costs measured with a process group (benchmarks/cpu_costs.py) --------------------------
CPU_COSTS_FILE = Path(__file__).with_name("cpu_costs.json")


@dataclass(frozen=True)
class CpuCosts:
    """CPU engine costs that need a running process group to measure, so the notebook cannot
    measure them when it plans: the extra host time per layer pass of each wrapper, in plain
    layer passes (`wrapper_cost`), and what an engine's process holds before any model
    (`process_bytes`: interpreter, torch, ipyparallel, the gloo group), each collective's bus
    bandwidth with one engine per core (`collective_bandwidth`) and the share of compute an
    asynchronous collective hides (`overlap`). `measured`, `machine`, `torch` and `engines` say
    where they come from."""

    wrapper_cost: Mapping[str, float]
    process_bytes: int
    collective_bandwidth: Mapping[str, float]
    overlap: float
    measured: str
    machine: str
    torch: str
    engines: int


def load_cpu_costs(path: "str | os.PathLike" = CPU_COSTS_FILE) -> CpuCosts:
    """The costs `benchmarks/cpu_costs.py` wrote to `path` (JSON)."""
    data = json.loads(Path(path).read_text())
    return CpuCosts(wrapper_cost={k: float(v) for k, v in data["wrapper_cost"].items()},
                    process_bytes=int(data["process_bytes"]),
                    collective_bandwidth={k: float(v) for k, v in data["collective_bandwidth"].items()},
                    overlap=float(data["overlap"]), measured=data["measured"],
                    machine=data["machine"], torch=data["torch"], engines=int(data["engines"]))


CPU_COSTS = load_cpu_costs()
CPU_WRAPPER_COST = dict(CPU_COSTS.wrapper_cost)
CPU_PROCESS_BYTES = CPU_COSTS.process_bytes


# ---- CPU: measured when asked for ----------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def measure_cpu_device(engines: int = 1) -> DeviceSpec:
    """The CPU as `engines` single-threaded engines see it: measured matmul peak, layer cost and
    loopback TCP bandwidth / latency (what gloo uses), the cores shared between the engines;
    memory is the machine's RAM divided by them. Cached: measuring takes about a second."""
    return cpu_device(engines, cores=os.cpu_count() or 1, **_cpu_measurements())


@functools.lru_cache(maxsize=None)
def _cpu_measurements() -> dict[str, float]:
    bandwidth, latency = _loopback_bandwidth()
    return dict(cpu_compute_costs(), bandwidth=bandwidth, latency=latency)


def cpu_device(engines: int, *, cores: int, peak_flops: float, efficiency: float, layer_overhead: float,
               bandwidth: float, latency: float, state_bandwidth: float,
               process_memory: float = CPU_PROCESS_BYTES) -> DeviceSpec:
    """A DeviceSpec for `engines` engines sharing `cores` cores, from single-core measurements
    (`state_bandwidth`: the rate AdamW's step streams the training state, see
    `cpu_compute_costs`; it stands for the memory bandwidth the planner prices the step with)."""
    share = min(1.0, cores / max(engines, 1))  # a core's share per engine when they take turns
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(engines, 1)
    return DeviceSpec("CPU", memory, {"fp32": peak_flops * share}, state_bandwidth * share, bandwidth * share,
                      bandwidth * share, math.inf, latency=latency / share, efficiency=efficiency,
                      half_tokens=0, overlap=CPU_COSTS.overlap, layer_overhead=layer_overhead / share,
                      wrapper_overhead={k: v * layer_overhead / share for k, v in CPU_WRAPPER_COST.items()},
                      async_launch=False, core_share=share, process_memory=process_memory,
                      collective_bandwidth={k: v * share for k, v in CPU_COSTS.collective_bandwidth.items()},
                      kind="cpu")


def cpu_compute_costs() -> dict[str, float]:
    """Single-thread matmul peak (FLOP/s), the fixed cost of one layer's forward + backward
    (seconds, from a tiny layer), the efficiency a mid-sized layer reaches on top of it, and the
    state bandwidth: the bytes of parameters, gradients and AdamW's two moments that torch's AdamW
    (the kit's default optimizer, as it runs on a CPU) reads and writes per second in its step,
    over 64 MiB of state, more than a core's caches hold."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(256, 256)
        peak = 2 * 256 ** 3 / _seconds_per_call(lambda: a @ a)
        overhead = _seconds_per_call(_layer_step(16, 8, 1)[0])
        step, flops = _layer_step(128, 128, 2)
        rate = flops / max(_seconds_per_call(step) - overhead, 1e-9)
        state_bandwidth = _adamw_state_bandwidth()
    finally:
        torch.set_num_threads(threads)
    return {"peak_flops": peak, "layer_overhead": overhead, "efficiency": min(1.0, rate / peak),
            "state_bandwidth": state_bandwidth}


def _adamw_state_bandwidth(numel: int = 2 ** 20, tensors: int = 4) -> float:
    """2 × the state bytes (fp32 parameters, gradients and two moments: 16 per parameter) over
    the seconds of one AdamW step: the planner's `2 · state / bandwidth` then gives that step."""
    import torch

    params = [torch.zeros(numel, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full((numel,), 1e-3)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    return 2 * 16 * numel * tensors / _seconds_per_call(optimizer.step)


def _seconds_per_call(fn: Any, budget: float = 0.15, windows: int = 5) -> float:
    """Seconds per call of `fn`: the best of `windows` short windows' means, so that another job
    taking the core for a moment does not make this machine look slower than it is."""
    fn()
    best = math.inf
    for _ in range(windows):
        start, count = time.perf_counter(), 0
        while count == 0 or time.perf_counter() - start < budget / windows:
            fn()
            count += 1
        best = min(best, (time.perf_counter() - start) / count)
    return best


def _layer_step(d: int, seq: int, batch: int) -> tuple[Any, float]:
    """Forward + backward of one Llama-style layer (2 heads) and its FLOPs as the planner counts."""
    import torch
    import torch.nn.functional as F

    layer = ModelSpec(n_layer=1, d_model=d, n_head=2, vocab_size=0)
    ffn = layer.ffn_hidden
    x = torch.randn(batch, seq, d, requires_grad=True)
    attention = [torch.randn(d, d, requires_grad=True) for _ in range(4)]
    gate_up = [torch.randn(ffn, d, requires_grad=True) for _ in range(2)]
    down = torch.randn(d, ffn, requires_grad=True)
    norm = torch.ones(d, requires_grad=True)

    def step() -> None:
        h = F.rms_norm(x, (d,), norm)
        q, k, v = (F.linear(h, w).view(batch, seq, 2, d // 2).transpose(1, 2) for w in attention[:3])
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        h = x + F.linear(mixed.reshape(batch, seq, d), attention[3])
        g = F.rms_norm(h, (d,), norm)
        out = h + F.linear(F.silu(F.linear(g, gate_up[0])) * F.linear(g, gate_up[1]), down)
        out.sum().backward()

    return step, batch * seq * flops_per_token(layer, seq, "none")


_ECHO_PEER = """
import socket, sys
peer = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
total, received = int(sys.argv[2]), 0
while received < total:
    received += len(peer.recv(1 << 20))
peer.sendall(b"k")
while True:
    byte = peer.recv(1)
    if not byte:
        break
    peer.sendall(byte)
"""


def _loopback_bandwidth(total: int = 32 * 2 ** 20, chunk: int = 2 ** 20) -> tuple[float, float]:
    """Bytes/s and one-way latency over local TCP to another process (what gloo goes through)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(30)
    peer = subprocess.Popen([sys.executable, "-c", _ECHO_PEER, str(server.getsockname()[1]), str(total)])
    try:
        connection, _ = server.accept()
        connection.settimeout(30)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = b"\0" * chunk
        start = time.perf_counter()
        for _ in range(total // chunk):
            connection.sendall(payload)
        connection.recv(1)
        bandwidth = total / (time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(50):
            connection.sendall(b"x")
            connection.recv(1)
        latency = (time.perf_counter() - start) / 100
        connection.close()
    finally:
        server.close()
        try:
            peer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
    return bandwidth, latency
