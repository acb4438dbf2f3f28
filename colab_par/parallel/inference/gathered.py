"""The weights brought in once for a whole generate call, not once per token and layer.

Training under zero3 frees each FSDP unit's gathered parameters after its forward
(``reshard_after_forward=True``), which is right when backward follows but makes a decode loop
all-gather every unit at every token (the ZeRO-3 generation users of DeepSpeed and TRL wait hours
on). Here each unit's setting is switched to keep its parameters after forward
(`FSDPModule.set_reshard_after_forward`, public FSDP2 API), so the first forward of the call
gathers each unit once, later forwards find it gathered; on the way out the training setting comes
back and every unit is resharded, so the gathered memory is freed. colab_par passes
``reshard_after_forward`` to every `fully_shard` explicitly (`data_parallel.fsdp_options`), so
setting the same value back restores FSDP's state exactly.

Memory tiers keep the working parameters on the device (their chunks hold optimizer state,
masters and gradients), so a forward reads them in place and nothing is brought in per token,
except under ``params@disk``: its forward hooks drop each chunk's pages once the chunk's
parameters have passed, so a decode loop would page the whole model in from its files at every
token. `TieredAdamW.parameters_held` keeps them resident for the call and drops them after.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch.distributed.fsdp import FSDPModule

from colab_par.memory_tiers.optimizer import TieredAdamW
from colab_par.parallel.data_parallel import fsdp_options

__all__ = ["weights_gathered"]


@contextlib.contextmanager
def weights_gathered(pm: Any) -> Iterator[None]:
    """Inside: every FSDP unit gathered by its first forward and kept so; paged-in parameters
    kept resident. After: the training settings back, the units resharded, the pages dropped."""
    units = [module for part in pm.model_parts for module in part.modules() if isinstance(module, FSDPModule)]
    training_setting = fsdp_options(pm.layout, pm.device.type)["reshard_after_forward"]
    held = (pm.optimizer.parameters_held() if isinstance(pm.optimizer, TieredAdamW)
            else contextlib.nullcontext())
    with held:
        try:
            if training_setting:
                for unit in units:
                    unit.set_reshard_after_forward(False, recurse=False)
            yield
        finally:
            for unit in units:
                if training_setting:
                    unit.set_reshard_after_forward(True, recurse=False)
                unit.reshard()
