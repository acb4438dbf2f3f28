"""Triton fused kernels for the training path (installed as colab_par.kernels)."""
