"""torch.compile internals: time spent compiling, dynamo's recompile limit, inductor's CPU vector width."""
from __future__ import annotations

from typing import Any

from colab_par.compat.support import _missing, _torch_private


_COMPILE_PHASES = ("_compile.compile_inner", "backward._backward_impl")  # a frame; a lazy backward


def compile_seconds() -> float:
    """Seconds `torch.compile` has spent compiling in this process so far: each frame (dynamo and
    the forward graph) and each backward graph, compiled lazily at the first backward
    (`torch._dynamo.utils.compilation_time_metrics`)."""
    metrics = getattr(_torch_private("torch._dynamo.utils"), "compilation_time_metrics", None)
    if not isinstance(metrics, dict):
        raise _missing("torch", "torch._dynamo.utils.compilation_time_metrics")
    return float(sum(sum(metrics.get(phase, ())) for phase in _COMPILE_PHASES))


def _dynamo_config() -> Any:
    config = getattr(_torch_private("torch._dynamo"), "config", None)
    if config is None or not hasattr(config, "recompile_limit") or not hasattr(config, "fail_on_recompile_limit_hit"):
        raise _missing("torch", "torch._dynamo.config.recompile_limit / fail_on_recompile_limit_hit")
    return config


def recompile_limit() -> int:
    """How many input shapes (or guard failures) dynamo compiles one code object for."""
    return int(_dynamo_config().recompile_limit)


def failing_at_recompile_limit() -> Any:
    """A context in which reaching the recompile limit raises `recompile_limit_error()` instead of
    dynamo's silent fallback to eager."""
    return _dynamo_config().patch(fail_on_recompile_limit_hit=True)


def recompile_limit_error() -> type:
    """What dynamo raises at the recompile limit under `failing_at_recompile_limit`."""
    error = getattr(_torch_private("torch._dynamo.exc"), "FailOnRecompileLimitHit", None)
    if error is None:
        raise _missing("torch", "torch._dynamo.exc.FailOnRecompileLimitHit")
    return error


def pin_inductor_vector_width() -> int:
    """Fix inductor's CPU vector width (``cpp.simdlen``) to the one it would pick now, and return it.

    Left unset, inductor picks it per compile from ATEN_CPU_CAPABILITY, but its graph cache keys
    on its config, not on that choice: code generated for avx512 was served under avx2 and built
    with avx2's headers (NaN losses), and under "default" failed to build at all. Pinned, the
    width is part of the key (`torch._inductor.cpu_vec_isa.pick_vec_isa`)."""
    config = getattr(_torch_private("torch._inductor"), "config", None)
    pick = getattr(_torch_private("torch._inductor.cpu_vec_isa"), "pick_vec_isa", None)
    if config is None or pick is None or not hasattr(config, "cpp"):
        raise _missing("torch", "torch._inductor.config.cpp.simdlen / cpu_vec_isa.pick_vec_isa")
    if config.cpp.simdlen is None:
        config.cpp.simdlen = pick().bit_width()
    return config.cpp.simdlen
