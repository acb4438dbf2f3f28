"""Triton fused kernels for the training path (installed as colab_par.kernels).

Every public function dispatches on its input: CUDA tensors run compiled Triton, CPU tensors run
the Triton interpreter when triton was imported with TRITON_INTERPRET=1, and the torch reference
otherwise. ``backend(tensor)`` says which path a call on ``tensor`` takes.
"""
from ._dispatch import backend, interpreter_active
from .adamw import FusedAdamW
from .cross_entropy import cross_entropy
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .interpreter_process import InterpreterProcess
from .layer_norm import layer_norm
from .rms_norm import rms_norm
from .rope import apply_rope
from .swiglu import swiglu

__all__ = ["backend", "interpreter_active", "FusedAdamW", "cross_entropy", "fused_linear_cross_entropy",
           "InterpreterProcess", "layer_norm", "rms_norm", "apply_rope", "swiglu"]
