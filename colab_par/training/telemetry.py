"""Per-step, per-rank training metrics measured on the engines, and their publication.

Measures; never renders (dashboard.py draws). Rows are plain dicts of floats so they travel through
ipyparallel's `datapub` cheaply and land in `Trainer.history` / CSV unchanged. Rows are
published in chunks that the client's data dict accumulates, so a client that polls at its own
pace (about every 0.25 s) still draws complete curves.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn

from colab_par.planning import devices
from colab_par.planning.flops import ModelSpec, flops_per_token
from colab_par.memory_tiers.measure import PeakWindow
from colab_par.parallel.activations import ActivationMeter
from colab_par.views.rows import CHUNK, METRICS_KEY, ROWS_KEY, expert_counts, expert_row_key

__all__ = ["METRICS_KEY", "StepClock", "ActivationMeter", "Publisher", "metrics_data",
           "device_peak_flops", "model_flops_per_token", "memory_sample", "grad_bytes",
           "pipeline_bubble", "peak_window", "mark_peak", "ExpertLoad", "expert_row_key", "expert_counts"]

def device_peak_flops(device: torch.device | str, precision: str = "fp32") -> float:
    """Peak FLOP/s of one rank's device: a known GPU's datasheet number, found by its exact product
    name (`devices.PRODUCTS`), or a measured matmul rate on CPU (the machine's cores shared by the
    engines on it). 0.0 for a GPU the catalogue does not name exactly: MFU is left out, not guessed."""
    device = torch.device(device)
    if device.type == "cuda":
        known = devices.device_for_product(torch.cuda.get_device_name(device))
        if known is None:
            return 0.0
        peaks = known.peak_flops
    else:
        engines = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or (
            torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
        peaks = devices.measure_cpu_device(engines).peak_flops
    return peaks.get(precision) or peaks["fp32"]


def model_flops_per_token(model: nn.Module, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token without recomputation (what MFU counts): the decoder formula
    (`flops.flops_per_token`: 6·matmul-params + 12·layers·d_model·seq) when the model has known
    sizes, else 6·params. A MoE model counts what a token runs: top_k experts and the router
    (`ModelSpec.matmul_params`)."""
    try:
        spec = ModelSpec.of(model)
    except (ValueError, TypeError, AttributeError):
        return 6.0 * num_params
    return float(flops_per_token(spec, seq_len, "none"))


class StepClock:
    """Seconds of one step and of its named phases, without stalling the device to take them.

    On CUDA each boundary is an event recorded on the current stream (where the step's work is
    queued), so the spans are the GPU's own timeline, read once in `read` after the step's
    single read point has waited for the device anyway; on CPU, where work is done when the call
    returns, they are perf_counter times. The step's span starts when the clock is made and ends
    at `stop`. With `mark`, each phase is also named in the running torch.profiler trace
    (``colab_par.<phase>``), so a timeline shows the phases this clock times without timing them
    again (`colab_par.profiling`)."""

    def __init__(self, device: torch.device, *, mark: bool = False):
        self.mark, self.cuda = mark, torch.device(device).type == "cuda"
        self._spans: list[tuple[str, Any, Any]] = []  # (phase, start, end)
        self._start, self._end = self._now(), None

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        marked = torch.profiler.record_function(f"colab_par.{name}") if self.mark else contextlib.nullcontext()
        with marked:
            start = self._now()
            try:
                yield
            finally:
                self._spans.append((name, start, self._now()))

    def stop(self) -> None:
        """The step's work is all queued: its span ends here."""
        self._end = self._now()

    def read(self) -> tuple[float, dict[str, float]]:
        """(the step's seconds, seconds per phase), after `stop`; on CUDA it waits for the last
        event, which the step's read point has already done."""
        if self.cuda:
            self._end.synchronize()

        def seconds(start: Any, end: Any) -> float:
            return start.elapsed_time(end) / 1000.0 if self.cuda else end - start

        phases: dict[str, float] = {}
        for name, start, end in self._spans:
            phases[name] = phases.get(name, 0.0) + seconds(start, end)
        return seconds(self._start, self._end), phases


def memory_sample(pm: Any, activations: int, grads: int) -> dict[str, float]:
    """Bytes on this rank: model state from the real local shards, activations, and the device's
    own view (CUDA allocator counters, the peak since `mark_peak`, or the process RSS on CPU).
    `grads` is measured by the caller before the optimizer step frees the gradients."""
    from colab_par.parallel import memory_report

    report = memory_report(pm)
    report["total"] += grads - report["grads"]
    report["grads"] = grads
    sample = {f"mem_{key}": float(value) for key, value in report.items()}
    device = torch.device(getattr(pm, "device", "cpu"))
    if device.type == "cuda":
        sample["mem_cuda_allocated"] = float(torch.cuda.memory_allocated(device))
        sample["mem_cuda_reserved"] = float(torch.cuda.memory_reserved(device))
        sample["mem_cuda_peak"] = float(peak_window(device).bytes())  # since the step's mark
    else:
        sample["mem_rss"] = float(_process_rss())
    sample["mem_activations"] = float(activations)
    return sample


def grad_bytes(pm: Any) -> int:
    """Bytes of gradients this rank holds now (call before the optimizer step frees them)."""
    from colab_par.parallel import memory_report
    return memory_report(pm)["grads"]


def pipeline_bubble(pm: Any) -> Callable[[], float] | None:
    """The idle share of the last pipeline step as the pipeline runner measured it, read when
    called (on CUDA that waits for the step's events: call it once the step is read); None
    without PP."""
    if pm.layout.pp == 1:
        return None
    return pm.bubble_reading()


def mark_peak(device: torch.device) -> None:
    """Start the span whose peak the next `memory_sample` reports as ``mem_cuda_peak`` (CUDA:
    the Trainer marks it when a measured step starts; CPU rows carry the RSS instead)."""
    if torch.device(device).type == "cuda":
        peak_window(device).mark()


_windows: dict[str, PeakWindow] = {}


def peak_window(device: torch.device) -> PeakWindow:
    """Telemetry's own span of the device's peak counter (`memory_tiers.measure.PeakWindow`):
    the Trainer marks it when a measured step starts and `memory_sample` reads it, whatever
    other readers (the tiers' placement) mark meanwhile."""
    key = str(torch.device(device))
    if key not in _windows:
        _windows[key] = PeakWindow(torch.device(device))
    return _windows[key]


def _process_rss() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak, the best available


class Publisher:
    """Sends rows to the notebook: ipyparallel `datapub` on an engine, otherwise a local sink.

    datapub merges each message into the task's data dict on the client, so rows travel in chunks
    under keys `colab_par.metrics.rows.<n>` (CHUNK rows each): a publish re-sends only the chunks
    that gained rows since the last one, and the client, which polls at its own pace, still holds
    every row. `METRICS_KEY` carries the header (rank, run, total steps, layout). Publishing is
    rate-limited to one message per `min_interval` seconds: the dashboard shows at most two
    frames a second, and each message costs the rank's training thread about 0.3 ms.
    """

    def __init__(self, header: dict[str, Any], *, min_interval: float = 0.5,
                 local_sink: Callable[[list[dict | None]], None] | None = None):
        self.header = header
        self.min_interval = min_interval
        self._send = engine_publisher()
        self._local_sink = local_sink
        self._last = 0.0
        self._sent = 0  # rows already published

    @property
    def on_engine(self) -> bool:
        return self._send is not None

    def publish(self, rows: list[dict], *, force: bool = False, done: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.min_interval:
            return
        self._last = now
        message = metrics_data({**self.header, "done": done, "time": time.time()}, rows,
                               since=self._sent)
        self._sent = len(rows)
        if self._send is not None:
            self._send(message)
        elif self._local_sink is not None:
            self._local_sink([message])


def metrics_data(header: dict[str, Any], rows: list[dict], *, since: int = 0) -> dict[str, Any]:
    """The one format the dashboard reads: `header` under `METRICS_KEY`, rows in CHUNK-sized lists
    under `ROWS_KEY<n>`. With `since=0` it is the whole data dict a client holds after every
    publish (what `colab-par demo` draws from returned rows); with `since=n` only the chunks that
    hold rows from the n-th on (one publish)."""
    data: dict[str, Any] = {METRICS_KEY: header}
    for chunk in range(since // CHUNK, (len(rows) + CHUNK - 1) // CHUNK):
        data[f"{ROWS_KEY}{chunk}"] = rows[chunk * CHUNK:(chunk + 1) * CHUNK]
    return data


def engine_publisher() -> Callable[[dict], None] | None:
    """`publish_data` when this process is an ipyparallel engine running a task, else None."""
    from colab_par.views.remote_view import engine_kernel

    kernel = engine_kernel()
    data_pub = getattr(kernel.shell, "data_pub", None) if kernel is not None else None
    return data_pub.publish_data if data_pub is not None else None


class ExpertLoad:
    """Tokens each expert of each MoE layer got in one step (all micro-steps), summed over the ranks
    sharing the global batch: the load imbalance a MoE user needs to see first. Counted from the
    routers' own choices (`MoE.last_counts`), read after each micro-step's forward and backward (a
    recomputed forward repeats the same counts, so activation checkpointing counts once)."""

    def __init__(self, layers: list[Any], *, stages: list[int] | None = None, pp_group: Any = None):
        """`stages`: under pipeline parallel, the stage id holding each layer, and `pp_group` the
        ranks holding the other stages: rows then number the layers of the whole model."""
        self.layers, self.stages, self.pp_group = layers, stages, pp_group
        self.counts: torch.Tensor | None = None

    def start_step(self) -> None:
        self.counts = None

    def add_micro_step(self) -> None:
        counts = torch.stack([layer.last_counts for layer in self.layers])
        self.counts = counts if self.counts is None else self.counts + counts

    def row(self) -> dict[str, float]:
        """The step's counts as row columns (a collective over the data-parallel ranks)."""
        counts, group = self.counts, self.layers[0].stats_group
        if group is not None:
            torch.distributed.all_reduce(counts, group=group)
        per_layer = counts.tolist()
        if self.pp_group is not None:  # every stage's layers, in model order (stage, then position)
            mine = [(stage, i, row) for i, (stage, row) in enumerate(zip(self.stages, per_layer))]
            gathered: list[Any] = [None] * torch.distributed.get_world_size(self.pp_group)
            torch.distributed.all_gather_object(gathered, mine, group=self.pp_group)
            per_layer = [row for _, _, row in sorted(entry for piece in gathered for entry in piece)]
        return {expert_row_key(layer, expert): float(n)
                for layer, per_expert in enumerate(per_layer)
                for expert, n in enumerate(per_expert)}
