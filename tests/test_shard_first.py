"""Shard-first initialisation on a real 2-engine cluster: the memory a rank needs to parallelize a
model built on meta is its shards, not the model; refusals come before any work."""
from __future__ import annotations

import pytest

from colab_par.models import GPTConfig

# ~61 M parameters, 243 MB in fp32; its largest tensor (the embedding) is 8 MB.
BIG = dict(vocab_size=4096, seq_len=64, n_layer=18, n_head=8, n_kv_head=4, d_model=512, kernels="torch")
TINY = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, kernels="torch")


def _peak_growth(sizes: dict, layout: str, source: str) -> int:
    """Bytes this engine's peak resident memory grew by while parallelizing (VmHWM, reset first,
    after handing freed heap back to the system so earlier tests' caches do not hide growth)."""
    import ctypes
    import gc

    import torch

    from colab_par import parallelize
    from colab_par.models import GPT, GPTConfig

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status("VmRSS:")
    config = GPTConfig(**sizes)
    model = (lambda: GPT(config)) if source == "factory" else GPT(config)
    torch.manual_seed(0)
    pm = parallelize(model, layout)
    growth = status("VmHWM:") - before
    del pm, model
    gc.collect()
    return growth


@pytest.mark.parametrize("layout", ["dp2 zero3", "tp2"])
def test_a_meta_built_model_costs_each_rank_its_shards_not_the_model(cluster2, layout: str) -> None:
    size = 4 * GPTConfig(**BIG).num_params()
    overhead = max(cluster2.run(_peak_growth, TINY, layout, "factory"))
    meta_peaks = cluster2.run(_peak_growth, BIG, layout, "factory")
    bound = 0.6 * size + overhead
    assert max(meta_peaks) <= bound, f"peak growth {meta_peaks} > {bound:.0f} for a {size}-byte model"
    # The bound is tight enough to catch a whole model on a rank: building it normally breaks it.
    assert min(cluster2.run(_peak_growth, BIG, layout, "module")) > bound


def _parallelize_refusal(case: str) -> str:
    import torch
    import torch.distributed as dist

    from colab_par import parallelize
    from colab_par.models import GPT, GPTConfig

    config = GPTConfig(**TINY)
    try:
        if case == "rank-seeded factory":
            parallelize(lambda: (torch.manual_seed(dist.get_rank()), GPT(config))[1], "dp2")
        elif case == "weights for a built model":
            parallelize(GPT(config), "dp2", weights={})
    except (ValueError, TypeError) as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize("case, message", [
    ("rank-seeded factory", r"initialised differently on different ranks.*seed"),
    ("weights for a built model", r"weights= fills a model built on the meta device.*factory"),
])
def test_shard_first_refusals_name_the_way_out(cluster2, case: str, message: str) -> None:
    import re

    for error in cluster2.run(_parallelize_refusal, case):
        assert re.search(message, error), error
