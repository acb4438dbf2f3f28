"""Triton kernels vs torch eager vs torch.compile, measured side by side in one run.

On CUDA, first every compiled kernel (forward and backward, float32 and bfloat16, small shapes
that take every code path) against a float64 torch reference (`check_kernels`); any mismatch is
reported, nothing is timed and the exit status is 1. Then, for every kernel: median time
(triton.testing.do_bench), achieved GB/s from the minimum bytes the operation must move (each
input read once, each output written once: `norm_and_elementwise_cases`), and that as a fraction
of a device-to-device copy measured in the same run; peak memory of cross-entropy and fused linear cross-entropy at vocab 32k and 128k.
Goals from the issue (H100): norms fwd+bwd >= 90 % of copy bandwidth, fused linear CE peak memory
<= 0.2 x eager, each kernel faster than torch.compile. Writes a CSV and a markdown table.

Without a GPU it says so and runs the same check with the Triton code in the interpreter
(TRITON_INTERPRET=1, CPU) instead; exit status 1 on any mismatch there too.

    python benchmarks/kernels.py [--out-dir out/benchmarks] [--quick]
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from colab_par.kernels import (FusedAdamW, InterpreterProcess, apply_rope, cross_entropy,
                               fused_linear_cross_entropy, layer_norm, rms_norm, swiglu)
from colab_par.kernels.cross_entropy import cross_entropy_reference
from colab_par.kernels.layer_norm import layer_norm_reference
from colab_par.kernels.rms_norm import rms_norm_reference
from colab_par.kernels.rope import apply_rope_reference
from colab_par.kernels.swiglu import swiglu_reference

Case = tuple[str, Callable[[], object], Callable[[], object], Callable[[], object], float, list]


# ---------------------------------------------------------------- CUDA benchmark

def copy_bandwidth_gbs(do_bench: Callable) -> float:
    src = torch.empty(256 * 2 ** 20, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def fwd_bwd(fn: Callable, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable[[], None]:
    """One forward + backward; inputs are leaves, each call sees a fresh non-leaf view of them."""
    def run() -> None:
        out = fn(*[t.view_as(t) for t in inputs])
        outs = list(out) if isinstance(out, tuple) else [out]
        torch.autograd.backward(outs, grads[:len(outs)])
    return run


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def norm_and_elementwise_cases(tokens: int, d_model: int, ffn: int, dtype: torch.dtype) -> list[Case]:
    """Timed cases with the bytes each must move at least: every input read once, every output
    written once (saved statistics left out, a kernel may recompute them). With |t| the bytes of t:
    rms_norm fwd 2|x| + |w|, bwd (reads dy, x, w; writes dx, dw) 3|x| + 2|w|; layer_norm fwd
    2|x| + |w| + |b|, bwd 3|x| + 2|w| + |b|; swiglu fwd (gate, up -> out) 3|gate|, bwd (dy, gate,
    up -> dgate, dup) 5|gate|; rope fwd and bwd each 2(|q| + |k|) + |cos| + |sin|."""
    dev = "cuda"
    x = torch.randn(tokens, d_model, device=dev, dtype=dtype, requires_grad=True)
    w = torch.rand(d_model, device=dev, dtype=dtype, requires_grad=True)
    b = torch.randn(d_model, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    gate = torch.randn(tokens, ffn, device=dev, dtype=dtype, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)
    dgate = torch.randn_like(gate)
    heads, kv_heads, head_dim = d_model // 128, max(1, d_model // 512), 128
    seq = 4096 if tokens >= 4096 else tokens
    q = torch.randn(tokens // seq, seq, heads, head_dim, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(tokens // seq, seq, kv_heads, head_dim, device=dev, dtype=dtype, requires_grad=True)
    angles = torch.rand(seq, head_dim, device=dev)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    rope_bytes = 2 * nbytes(q, k) + nbytes(cos, sin)
    compiled = {f: torch.compile(f) for f in (rms_norm_reference, layer_norm_reference, swiglu_reference,
                                               apply_rope_reference)}
    cases: list[Case] = []
    for name, ours, ref, inputs, grads, fwd_bytes, bwd_bytes in [
        ("rms_norm", lambda x, w: rms_norm(x, w), rms_norm_reference, [x, w], [dy], 2 * nbytes(x) + nbytes(w),
         3 * nbytes(x) + 2 * nbytes(w)),
        ("layer_norm", lambda x, w, b: layer_norm(x, w, b), layer_norm_reference, [x, w, b], [dy],
         2 * nbytes(x) + nbytes(w, b), 3 * nbytes(x) + 2 * nbytes(w) + nbytes(b)),
        ("swiglu", swiglu, swiglu_reference, [gate, up], [dgate], 3 * nbytes(gate), 5 * nbytes(gate)),
        ("rope", apply_rope, apply_rope_reference, [q, k, cos, sin], [dq, dk], rope_bytes, rope_bytes),
    ]:
        shape = f"{tuple(inputs[0].shape)} {str(dtype).removeprefix('torch.')}"
        no_grad = [t.detach() for t in inputs]
        cases.append((f"{name} fwd", lambda o=ours, a=no_grad: o(*a), lambda r=ref, a=no_grad: r(*a),
                      lambda c=compiled[ref], a=no_grad: c(*a), fwd_bytes, [shape]))
        cases.append((f"{name} fwd+bwd", fwd_bwd(ours, inputs, grads), fwd_bwd(ref, inputs, grads),
                      fwd_bwd(compiled[ref], inputs, grads), fwd_bytes + bwd_bytes, [shape, *inputs]))
    return cases


def cross_entropy_cases(tokens: int, vocabs: list[int], dtype: torch.dtype) -> list[Case]:
    cases: list[Case] = []
    compiled = torch.compile(cross_entropy_reference)
    for vocab in vocabs:
        logits = torch.randn(tokens, vocab, device="cuda", dtype=dtype, requires_grad=True)
        target = torch.randint(0, vocab, (tokens,), device="cuda")
        one = torch.ones((), device="cuda")
        shape = f"({tokens}, {vocab}) {str(dtype).removeprefix('torch.')}"
        # at least: the logits read twice (log-sum-exp, then the gradient: a row of 128k does not stay in
        # registers), the gradient written over them once, the targets read once
        cases.append((f"cross_entropy fwd+bwd V={vocab}",
                      fwd_bwd(lambda x: cross_entropy(x, target), [logits], [one]),
                      fwd_bwd(lambda x: cross_entropy_reference(x, target), [logits], [one]),
                      fwd_bwd(lambda x: compiled(x, target), [logits], [one]),
                      3 * nbytes(logits) + nbytes(target), [shape, logits]))
    return cases


def adamw_case(n_params: int) -> Case:
    """A Llama-ish list of tensors (few big matrices, many small vectors) totalling ~n_params."""
    sizes = [4096 * 4096] * max(1, n_params // (4096 * 4096)) + [4096] * 64
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    ours, eager = FusedAdamW(params, lr=1e-4), torch.optim.AdamW(params, lr=1e-4, foreach=True)
    fused_torch = torch.optim.AdamW(params, lr=1e-4, fused=True)
    total = sum(sizes)
    # at least: param, grad, exp_avg, exp_avg_sq read and param, exp_avg, exp_avg_sq written (fp32)
    # "eager" = torch foreach AdamW, "compile" slot = torch's own fused CUDA AdamW
    return ("adamw step (compile col = torch fused AdamW)", ours.step, eager.step, fused_torch.step, 7 * total * 4,
            [f"{total / 1e6:.0f}M fp32 params in {len(sizes)} tensors"])


def peak_memory_rows(tokens: int, d_model: int, vocabs: list[int], dtype: torch.dtype) -> list[dict]:
    rows = []
    for vocab in vocabs:
        hidden = torch.randn(tokens, d_model, device="cuda", dtype=dtype, requires_grad=True)
        weight = (torch.randn(vocab, d_model, device="cuda", dtype=dtype) * 0.02).requires_grad_()
        target = torch.randint(0, vocab, (tokens,), device="cuda")

        def eager_linear_ce():
            F.cross_entropy((hidden @ weight.t()).float(), target).backward()

        def eager_ce():
            logits = (hidden @ weight.t()).detach().requires_grad_()
            F.cross_entropy(logits.float(), target).backward()

        def fused_ce():
            logits = (hidden @ weight.t()).detach().requires_grad_()
            cross_entropy(logits.view_as(logits), target).backward()

        compiled_linear_ce = torch.compile(eager_linear_ce)
        measured = {}
        for label, fn in [("linear+CE eager", eager_linear_ce), ("linear+CE torch.compile", compiled_linear_ce),
                          ("fused_linear_cross_entropy", lambda: fused_linear_cross_entropy(hidden, weight,
                                                                                            target).backward()),
                          ("logits+CE eager", eager_ce), ("logits+CE triton cross_entropy", fused_ce)]:
            fn()  # warm up (compile, allocator)
            hidden.grad = weight.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            measured[label] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            hidden.grad = weight.grad = None
        for label, gib in measured.items():
            reference = measured["linear+CE eager" if label.startswith("linear") or label.startswith("fused")
                                  else "logits+CE eager"]
            rows.append({"vocab": vocab, "tokens": tokens, "d_model": d_model, "variant": label,
                         "peak_gib": round(gib, 3), "vs_eager": round(gib / reference, 3)})
    return rows


def run_cuda(out_dir: Path, quick: bool) -> list[str]:
    """Check every compiled kernel against float64, then (only if all pass) time them; the failures."""
    from triton.testing import do_bench

    def median_ms(fn: Callable, grad_leaves: list) -> float:
        try:
            return do_bench(fn, grad_to_none=grad_leaves or None, return_mode="median")
        except Exception as error:  # e.g. a torch.compile failure: report it, keep measuring the rest
            print(f"    failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            return float("nan")

    device = torch.cuda.get_device_name()
    results, failures = check_kernels("cuda")
    checks = check_rows(results)
    print(markdown_table(checks))
    if failures:
        for failure in failures:
            print(f"FAILED: {failure}")
        write_tables(out_dir, {"kernel_checks": checks}, header=f"{device}: compiled kernels against float64 "
                                                                f"FAILED, nothing timed")
        return failures
    tokens = 4096 if quick else 16384
    dtype = torch.bfloat16
    copy_gbs = copy_bandwidth_gbs(do_bench)
    print(f"{device}: device-to-device copy {copy_gbs:,.0f} GB/s")
    cases = norm_and_elementwise_cases(tokens, 4096, 14336 if not quick else 4096, dtype)
    cases += cross_entropy_cases(tokens // 2, [32_000, 128_256], dtype)
    cases.append(adamw_case(200_000_000 if not quick else 20_000_000))
    rows = []
    for name, ours, eager, compiled, nbytes, extra in cases:
        shape, leaves = extra[0], [t for t in extra[1:] if isinstance(t, torch.Tensor)]
        times = {label: median_ms(fn, leaves) for label, fn in (("triton", ours), ("eager", eager),
                                                                 ("compile", compiled))}
        gbs = nbytes / (times["triton"] * 1e-3) / 1e9
        rows.append({"kernel": name, "shape": shape, "triton_ms": round(times["triton"], 4),
                     "eager_ms": round(times["eager"], 4), "compile_ms": round(times["compile"], 4),
                     "speedup_vs_eager": round(times["eager"] / times["triton"], 2),
                     "speedup_vs_compile": round(times["compile"] / times["triton"], 2),
                     "triton_gbs": round(gbs, 1), "fraction_of_copy_bw": round(gbs / copy_gbs, 3)})
        print(f"{name:32s} {shape:28s} triton {times['triton']:8.3f} ms  eager x{rows[-1]['speedup_vs_eager']:5.2f}"
              f"  compile x{rows[-1]['speedup_vs_compile']:5.2f}  {gbs:7.0f} GB/s ({gbs / copy_gbs:.0%} of copy)")
    memory = peak_memory_rows(tokens // 2, 4096, [32_000, 128_256], dtype)
    for row in memory:
        print(f"peak memory V={row['vocab']:>6} {row['variant']:32s} {row['peak_gib']:7.2f} GiB  "
              f"x{row['vs_eager']:.2f} of eager")
    norms_ok = all(r["fraction_of_copy_bw"] >= 0.9 for r in rows if "norm fwd+bwd" in r["kernel"])
    memory_ok = all(r["vs_eager"] <= 0.2 for r in memory if r["variant"] == "fused_linear_cross_entropy")
    faster_ok = all(r["speedup_vs_compile"] > 1.0 for r in rows if not r["kernel"].startswith("adamw"))
    print(f"goals: norms fwd+bwd >= 90% of copy bandwidth: {norms_ok}; fused linear CE peak <= 0.2 x eager: "
          f"{memory_ok}; every kernel faster than torch.compile: {faster_ok}")
    write_tables(out_dir, {"kernel_checks": checks, "kernels": rows, "kernels_memory": memory},
                 header=f"{device}, copy bandwidth {copy_gbs:,.0f} GB/s; every kernel matched float64 first")
    return []


def markdown_table(table: list[dict]) -> str:
    lines = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    return "\n".join(lines + ["| " + " | ".join(str(v) for v in row.values()) + " |" for row in table])


def write_tables(out_dir: Path, tables: dict[str, list[dict]], header: str) -> None:
    """Each table as out_dir/<name>.csv, and all of them under ``header`` in out_dir/kernels.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"_{header}_", ""]
    for name, table in tables.items():
        with open(out_dir / f"{name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
        lines += [markdown_table(table), ""]
    (out_dir / "kernels.md").write_text("\n".join(lines))
    print(f"wrote {', '.join(f'{out_dir}/{name}.csv' for name in tables)}, {out_dir}/kernels.md")


# ---------------------------------------------------------------- correctness: before timing, and on CPU

DTYPES = (torch.float32, torch.bfloat16)


def tolerance(dtype: torch.dtype, interpreted: bool) -> float:
    """Largest max |ours - float64| / max |float64| a kernel may show on ``dtype`` inputs.

    float32: each operation rounds by 2^-24 and the reductions here sum up to 32000 terms, ~sqrt(n)
    * 2^-24 = 3e-6 typical (n * 2^-24 = 2e-3 only if every rounding pointed one way): 1e-4 is 30x
    the typical. bfloat16: eight roundings' worth: the output's own, plus what feeds it (AdamW's
    stored moments and parameter over 3 steps; the linear head's logits, which move each
    probability by a rounding times |logit|, so that case keeps |logits| < 4 as trained heads
    do). A rounding is 2^-9 compiled (round to nearest) and 2^-8 in the interpreter, whose
    float32 -> bfloat16 conversion truncates. Off by 1 %, a kernel fails in float32 either way.
    """
    if dtype == torch.float32:
        return 1e-4
    return 8 * (2 ** -8 if interpreted else 2 ** -9)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.detach().double() - expected.detach()).abs().max() / expected.detach().abs().max())


def max_errors(ours: Callable, reference: Callable, tensors: list[torch.Tensor], dtype: torch.dtype) -> tuple:
    """(forward, backward) max abs error / max |reference| of ``ours`` on ``dtype`` inputs vs float64."""
    low = [t.detach().to(dtype).clone().requires_grad_() for t in tensors]
    high = [t.detach().to(dtype).double().requires_grad_() for t in tensors]
    out, ref = ours(*[t.view_as(t) for t in low]), reference(*high)
    out, ref = (out if isinstance(out, tuple) else (out,)), (ref if isinstance(ref, tuple) else (ref,))
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)).to(o.device) for o in out]
    torch.autograd.backward(list(out), [g.to(o.dtype) for g, o in zip(grads, out)])
    torch.autograd.backward(list(ref), [g.double() for g in grads])
    forward = max(relative_error(o, r) for o, r in zip(out, ref))
    backward = max(relative_error(a.grad, b.grad) for a, b in zip(low, high))
    return forward, backward


def adamw_error(device: str, dtype: torch.dtype, steps: int = 3) -> float:
    """FusedAdamW against torch.optim.AdamW on float64 copies, same start and gradients (no backward)."""
    generator = torch.Generator().manual_seed(1)
    start = [torch.randn(n, generator=generator) for n in (5000, 33, 1)]  # several program chunks, a tail, one
    ours = [torch.nn.Parameter(t.to(device, dtype)) for t in start]
    high = [torch.nn.Parameter(p.detach().double()) for p in ours]
    optimizers = (FusedAdamW(ours, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(high, lr=1e-2, weight_decay=0.1))
    for _ in range(steps):
        for p, q in zip(ours, high):
            g = torch.randn(p.shape, generator=generator).to(device, dtype)
            p.grad, q.grad = g, g.double()
        for optimizer in optimizers:
            optimizer.step()
    return relative_error(torch.cat([p.flatten() for p in ours]), torch.cat([q.flatten() for q in high]))


def correctness_cases(device: str) -> list[tuple[str, Callable, Callable, list[torch.Tensor]]]:
    """(name, ours, float64 reference, inputs): small shapes that still take every code path (rows
    wider than a block, several row tiles, grouped-query heads, ignored targets, chunked linear CE)."""
    from colab_par.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy_reference
    from colab_par.models.gpt import rope_cos_sin
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device)

    cos, sin = (t.to(device) for t in rope_cos_sin(torch.arange(9), 12, 10000.0, torch.float32))
    target = torch.tensor([3, -100, 31_999, 5], device=device)
    return [
        ("rms_norm (6, 9000)", lambda x, w: rms_norm(x, w), rms_norm_reference, [randn(6, 9000), randn(9000) + 0.5]),
        ("rms_norm (150, 40)", lambda x, w: rms_norm(x, w), rms_norm_reference, [randn(150, 40), randn(40) + 0.5]),
        ("layer_norm (6, 100)", lambda x, w, b: layer_norm(x, w, b), layer_norm_reference,
         [randn(6, 100), randn(100), randn(100)]),
        ("rope (2, 9, 4+2 heads, 12)", lambda q, k: apply_rope(q, k, cos, sin),
         lambda q, k: apply_rope_reference(q, k, cos.double(), sin.double()), [randn(2, 9, 4, 12), randn(2, 9, 2, 12)]),
        ("swiglu (3, 1000)", swiglu, swiglu_reference, [randn(3, 1000), randn(3, 1000)]),
        ("cross_entropy (4, 32000)", lambda x: cross_entropy(x, target), lambda x: cross_entropy_reference(x, target),
         [randn(4, 32000) * 3]),
        ("fused_linear_cross_entropy (4, 32) x 32000", lambda h, w: fused_linear_cross_entropy(h, w, target),
         lambda h, w: fused_linear_cross_entropy_reference(h, w, target), [randn(4, 32), randn(32000, 32) * 0.1]),
    ]


def check_kernels(device: str) -> tuple[list[tuple], list[str]]:
    """Every kernel on ``device`` (compiled on CUDA, interpreted on CPU) against float64, forward and
    backward, in float32 and bfloat16: (rows of name, dtype, forward and backward error, tolerance;
    failures)."""
    from colab_par.kernels import backend
    interpreted = backend(torch.zeros(1, device=device)) == "triton-interpreter"
    rows = []
    for name, ours, reference, tensors in correctness_cases(device):
        for dtype in DTYPES:
            rows.append((name, dtype, *max_errors(ours, reference, tensors, dtype), tolerance(dtype, interpreted)))
    for dtype in DTYPES:
        rows.append(("FusedAdamW 3 steps (5000, 33, 1)", dtype, adamw_error(device, dtype), None,
                     tolerance(dtype, interpreted)))
    failures = [f"{name} {str(dtype).removeprefix('torch.')}: {part} error {error:.1e} > {limit:.1e}"
                for name, dtype, *errors, limit in rows for part, error in zip(("forward", "backward"), errors)
                if error is not None and not error <= limit]  # NaN fails too
    return rows, failures


def check_rows(rows: list[tuple[str, torch.dtype, float, float | None, float]]) -> list[dict]:
    return [{"kernel": name, "dtype": str(dtype).removeprefix("torch."), "forward_rel_err": f"{forward:.1e}",
             "backward_rel_err": "-" if backward is None else f"{backward:.1e}", "tolerance": f"{limit:.1e}"}
            for name, dtype, forward, backward, limit in rows]


def interpreter_check() -> tuple[list[tuple], list[str]]:
    """check_kernels on CPU in a process whose Triton is interpreted (InterpreterProcess)."""
    from colab_par.kernels import backend
    assert backend(torch.zeros(1)) == "triton-interpreter", "the worker did not import triton in interpreter mode"
    return check_kernels("cpu")


def run_cpu() -> list[str]:
    print("No GPU present: timings, bandwidth and peak memory need CUDA. Running the Triton kernels in the "
          "interpreter (TRITON_INTERPRET=1) on small shapes: max |error| / max |float64 torch reference|.")
    with InterpreterProcess(timeout=600) as worker:
        results, failures = worker.run(interpreter_check)
    print(markdown_table(check_rows(results)))
    for failure in failures:
        print(f"FAILED: {failure}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("out/benchmarks"))
    parser.add_argument("--quick", action="store_true", help="smaller shapes (CUDA)")
    args = parser.parse_args()
    failures = run_cuda(args.out_dir, args.quick) if torch.cuda.is_available() else run_cpu()
    if failures:
        sys.exit(f"{len(failures)} kernel check(s) failed")


if __name__ == "__main__":
    main()
