"""The largest reference GPT that trains on this machine: planner-predicted vs measured peak memory.

Grows the reference GPT (`colab_par.models.GPT`, torch kernels) in width and depth, and for every
candidate starts a fresh cluster (2 gloo CPU engines, or every GPU on nccl on a CUDA machine, where
the peaks are the CUDA allocator's and the planner uses the GPU's catalogue entry), parallelizes it
under each layout (by default `dpN zero3`, with and without full activation checkpointing), trains
`--steps` steps and reads each engine's peak memory (on CPU the resident peak VmHWM from
/proc/self/status, reset through /proc/self/clear_refs before parallelize and again before
training). It prints, per candidate and
layout, the parameters, the planner's predicted peak per rank next to the measured one (the larger
of the build and the training peak, the process baseline included), their ratio and tokens/s.

The planner proposes the sizes: the ladder is ordered by parameters, a candidate runs only when the
planner predicts that both engines fit in the memory available now (with the worst
measured/predicted ratio seen so far as a margin), and the search climbs the ladder from small to
large, so an engine is never asked for memory the machine does not have. A candidate that fails
(an error or a killed engine) is reported and ends the climb; the largest that trained is printed
last.

    python benchmarks/scale.py --quick                 # tiny smoke run, a minute
    python benchmarks/scale.py                         # the search, models built on meta
    python benchmarks/scale.py --build full            # models built whole on every rank
    python benchmarks/scale.py --only 2048x24          # one candidate (d_model x n_layer)
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_probe import probe  # noqa: E402  (the driver asks a child about the GPUs)

GiB = 2 ** 30
LAYOUTS = ("dp2 zero3", "dp2 zero3 ac-full")
# (d_model, n_layer): widths are multiples of 128 (heads of 128), depth grows with width
LADDER = [(512, 4), (768, 8), (1024, 8), (1024, 12), (1280, 16), (1536, 16), (1536, 20),
          (1792, 20), (2048, 16), (2048, 20), (2048, 24), (2304, 24), (2560, 24), (2560, 28),
          (2816, 28), (3072, 28), (3072, 32)]
QUICK_LADDER = [(128, 2), (256, 4)]
# glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, after which
# tensors of a few MiB live in the heap, whose freed holes stay resident: 25 % more peak RSS on a
# 168 M model (measured 2026-11-23). A fixed threshold makes every tensor above it its own mapping,
# returned when freed, so the resident peak is what the tensors need.
MMAP_THRESHOLD = 1 << 20
VOCAB, SEQ, GLOBAL_BATCH = 8192, 128, 2  # a small vocabulary leaves the memory to the layers


def gpt_config(d_model: int, n_layer: int, vocab: int, seq: int) -> dict[str, Any]:
    return dict(vocab_size=vocab, seq_len=seq, n_layer=n_layer, d_model=d_model,
                n_head=max(1, d_model // 128), kernels="torch")


# ---- on the engines ------------------------------------------------------------------------------
def _status(key: str) -> int:
    """A /proc/self/status memory line (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


_windows: dict[str, Any] = {}


def _window() -> Any:
    """This engine's span of its device's peak (the CUDA allocator's, or VmHWM on a CPU engine):
    a `PeakWindow`, whose marks keep the spans of the other readers in the process (the tiers'
    placement measures its own step meanwhile)."""
    import torch

    from colab_par.memory_tiers.measure import PeakWindow

    cuda = torch.cuda.is_available()  # the engine's own GPU: it holds a context there anyway
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if str(device) not in _windows:
        _windows[str(device)] = PeakWindow(device)
    return _windows[str(device)]


def _reset_peak(window: Any = None) -> int:
    """Restart `window`'s span (default: this engine's `_window`) from what is held now, and
    return that: on a GPU the CUDA allocator's bytes; on a CPU engine the RSS (after dropping
    freed heap)."""
    import ctypes
    import gc

    from colab_par.memory_tiers.measure import resident_bytes

    window = window or _window()
    gc.collect()
    if window.device.type == "cpu":
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    window.mark()
    return resident_bytes(window.device)


def _peak(window: Any = None) -> int:
    """The peak since `window`'s last mark (default: this engine's `_window`)."""
    return (window or _window()).bytes()


def train_candidate(sizes: dict[str, Any], layout: str, build: str, steps: int,
                    global_batch: int) -> dict[str, Any]:
    """On every engine: build + parallelize (`build` "meta": from a factory on the meta device,
    "full": a model built whole here), train `steps` steps; the resident-memory peaks per phase."""
    import gc

    import torch

    from colab_par import parallelize
    from colab_par.models.gpt import GPT, GPTConfig

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # two engines share the two cores
    config = GPTConfig(**sizes)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, config.vocab_size, (global_batch, config.seq_len), generator=generator)
    batch = (inputs, torch.roll(inputs, -1, dims=1))
    window = _window()  # passed on: this function may travel by value, without the module's state
    result: dict[str, Any] = {"baseline": _reset_peak(window)}
    torch.manual_seed(0)
    start = time.perf_counter()
    pm = parallelize((lambda: GPT(config)) if build == "meta" else GPT(config), layout)
    result["init_s"] = time.perf_counter() - start
    result["init_peak"] = _peak(window)
    result["after_init"] = _reset_peak(window)
    step_times, step_peaks = [], []
    for _ in range(steps):
        start = time.perf_counter()
        pm.train_step(*batch)
        step_times.append(time.perf_counter() - start)
        step_peaks.append(_peak(window))
    result.update(step_s=step_times, step_peaks=step_peaks, train_peak=max(step_peaks))
    del pm
    gc.collect()
    return result


# ---- in this process -----------------------------------------------------------------------------
def _available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def engines_and_device(kind: str, gpus: Any = None) -> tuple[int, Any, str]:
    """How many engines, the planner's DeviceSpec and the backend: every GPU (nccl) on a CUDA
    machine (`gpus`: `cuda_probe.probe()`'s answer), else 2 CPU engines (gloo)."""
    from colab_par.planning.devices import PRODUCTS, device_for_product, measure_cpu_device

    if kind == "cpu":
        return 2, measure_cpu_device(2), "gloo"
    if gpus is None or not gpus.count:
        raise SystemExit("--device cuda: no CUDA device here")
    device = device_for_product(gpus.names[0])
    if device is None:
        raise SystemExit(f"{gpus.names[0]} is not in the planner's catalogue ({', '.join(PRODUCTS)})")
    return gpus.count, device, "nccl"


def _free_per_engine(kind: str, engines: int, headroom: float) -> float:
    """Memory one more engine's peak may take: the least free memory of the GPUs the engines
    take (asked in a child process, between candidates: this process holds no context on any
    GPU), or the host's available memory shared by the CPU engines."""
    if kind == "cpu":
        return (_available() - headroom * GiB) / engines
    return min(probe(tuple(range(engines))).free.values()) - headroom * GiB


def run_candidate(sizes: dict[str, Any], layout: str, build: str, steps: int,
                  global_batch: int, engines: int = 2, backend: str = "gloo") -> list[dict[str, Any]] | str:
    """One candidate in a fresh cluster: the engines' results, or the error's first line."""
    from colab_par import Cluster

    try:
        with Cluster(n=engines, backend=backend, timeout=600.0, dashboard=False) as cluster:
            return cluster.run(train_candidate, sizes, layout, build, steps, global_batch)
    except Exception as error:  # an engine killed by the kernel's OOM killer lands here too
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def predict(sizes: dict[str, Any], layout: str, build: str, global_batch: int, device: Any) -> Any:
    """The planner's Plan for one candidate (its memory: init, training and peak per rank)."""
    from colab_par.planning.planner import estimate

    return estimate(sizes, layout, device=device, global_batch=global_batch, seq_len=sizes["seq_len"],
                    init=build)


def summarise(results: list[dict[str, Any]], tokens: int) -> dict[str, float]:
    """Per-rank peaks (the fuller rank) and tokens/s from the steps after the first (slowest rank)."""
    later = [max(r["step_s"][i] for r in results) for i in range(1, len(results[0]["step_s"]))]
    step = sorted(later)[len(later) // 2] if later else max(r["step_s"][0] for r in results)
    return {"baseline": max(r["baseline"] for r in results), "init": max(r["init_peak"] for r in results),
            "train": max(r["train_peak"] for r in results),
            "peak": max(max(r["init_peak"], r["train_peak"]) for r in results),
            "tokens_per_s": tokens / step, "init_s": max(r["init_s"] for r in results)}


HEADER = (f"{'candidate':<12} {'params':>8} {'layout':<18} {'build':<5} {'pred GiB':>8} {'meas GiB':>8} "
          f"{'ratio':>6}  {'init pred/meas':>14}  {'train pred/meas':>15}  {'tokens/s':>8}  {'init s':>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two tiny candidates (smoke run)")
    parser.add_argument("--build", choices=("meta", "full"), default="meta",
                        help="meta: parallelize(factory), shard-first; full: a model built whole on "
                             "every rank (what the kit did before shard-first initialisation)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="cuda: every GPU, peaks from the CUDA allocator; default: cuda when present")
    parser.add_argument("--layouts", nargs="+", default=None,
                        help="default: dpN zero3, with and without ac-full, N the engines")
    parser.add_argument("--only", nargs="+", default=None, metavar="DxL",
                        help="run just these candidates, e.g. 2048x24 (the memory guard still applies)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's dynamic mmap threshold on in the engines (see MMAP_THRESHOLD)")
    parser.add_argument("--headroom", type=float, default=1.5,
                        help="GiB of available memory left untouched (this process, the rest)")
    args = parser.parse_args()

    gpus = probe() if args.device != "cpu" else None  # names only: no context on any GPU
    kind = args.device or ("cuda" if gpus.count else "cpu")
    engines, device, backend = engines_and_device(kind, gpus)
    layouts = args.layouts or [layout.replace("dp2", f"dp{engines}") for layout in LAYOUTS]
    # a SIGTERM (e.g. `timeout`) unwinds through `with Cluster(...)`, which stops the engines
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if kind == "cpu" and not args.default_malloc:  # the engines inherit it
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    if args.only:
        ladder = [tuple(int(v) for v in text.lower().split("x")) for text in args.only]
    else:
        ladder = QUICK_LADDER if args.quick else LADDER
    vocab, seq = (512, 64) if args.quick else (args.vocab, args.seq)
    tokens = args.global_batch * seq
    measured = ("VmHWM per engine" if kind == "cpu" else "torch.cuda.max_memory_allocated per GPU")
    print(f"{engines} {device.name} engines, {backend}, fp32 AdamW, vocab {vocab}, seq {seq}, global batch "
          f"{args.global_batch}, {args.steps} steps, build={args.build}, MALLOC_MMAP_THRESHOLD_="
          f"{os.environ.get('MALLOC_MMAP_THRESHOLD_', 'dynamic')}; peaks are {measured} (the fuller one)")
    print(HEADER, flush=True)
    largest: dict[str, tuple[int, str]] = {}
    margin = 1.0  # the worst measured/predicted ratio so far guards the next candidate
    for layout in layouts:
        for d_model, n_layer in sorted(ladder, key=lambda c: gpt_config(c[0], c[1], vocab, seq)["n_layer"]
                                       * c[0] ** 2):
            sizes = gpt_config(d_model, n_layer, vocab, seq)
            name, option = f"{d_model}x{n_layer}", predict(sizes, layout, args.build, args.global_batch, device)
            params = _n_params(sizes)
            need, free = option.memory.peak * margin, _free_per_engine(kind, engines, args.headroom)
            if need > free:
                print(f"{name:<12} {params / 1e6:7.0f}M {layout:<18} planner: {option.memory.peak / GiB:.2f} "
                      f"GiB per engine (x{margin:.2f} margin) > {free / GiB:.2f} GiB free each; stop", flush=True)
                break
            results = run_candidate(sizes, layout, args.build, args.steps, args.global_batch, engines, backend)
            if isinstance(results, str):
                print(f"{name:<12} {params / 1e6:7.0f}M {layout:<18} FAILED: {results}", flush=True)
                break
            m = summarise(results, tokens)
            memory = option.memory
            margin = max(margin, m["peak"] / memory.peak)
            print(f"{name:<12} {params / 1e6:7.0f}M {layout:<18} {args.build:<5} {memory.peak / GiB:8.2f} "
                  f"{m['peak'] / GiB:8.2f} {memory.peak / m['peak']:6.2f}  "
                  f"{(memory.baseline + memory.init) / GiB:6.2f}/{m['init'] / GiB:<6.2f}  "
                  f"{(memory.baseline + memory.total) / GiB:7.2f}/{m['train'] / GiB:<6.2f}  "
                  f"{m['tokens_per_s']:8.1f}  {m['init_s']:6.1f}", flush=True)
            if params > largest.get(layout, (0, ""))[0]:
                largest[layout] = (params, name)
    for layout, (params, name) in largest.items():
        print(f"largest that trained under {layout!r} (build={args.build}): {name}, "
              f"{params / 1e9:.3f} B parameters")


def _n_params(sizes: dict[str, Any]) -> int:
    from colab_par.models.gpt import GPTConfig

    return GPTConfig(**sizes).num_params()


if __name__ == "__main__":
    main()
