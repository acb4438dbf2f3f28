"""Pipeline parallel: cut a model into stages and run them with torch.distributed.pipelining.

`split_model` gives one pp rank its stage modules, every parameter under its original fully
qualified name. colab_par's GPT and Hugging Face decoders are cut by their layers (`layers.py`);
any other model, or any model given `split_points`, is traced by torch's `pipeline()` on an example
microbatch (`traced.py`). `PipelineRunner` (`runner.py`) runs the stages with the layout's
schedule (forward-only for evaluation); `decode.py` runs them one call at a time outside torch's
schedules (generation, whose shapes change and whose stages keep caches); `stages.py` says which
stages live on which rank.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from colab_par.layout import Layout
from colab_par.data.batch import Batch
from colab_par.parallel.pipeline.layers import layer_count, layer_stage, layer_units, split_by_layers
from colab_par.parallel.pipeline.runner import PipelineRunner
from colab_par.parallel.pipeline.stages import TiedTensor, stage_ids, stage_owner
from colab_par.parallel.pipeline.traced import TracedInterface, auto_split_points, balanced_cuts, split_traced

__all__ = ["stage_ids", "stage_owner", "split_model", "auto_split_points", "balanced_cuts", "layer_count",
           "layer_stage", "layer_units", "TracedInterface", "TiedTensor", "PipelineRunner"]


def split_model(model: nn.Module, layout: Layout | str, pp_rank: int, *,
                split_points: Sequence[str] | None = None, block_types: Sequence[type | str] = (),
                example_batch: Batch | None = None) -> list[nn.Module]:
    """This rank's stage modules, one per stage id; parameters keep the model's own FQNs.

    colab_par's `GPT` and Hugging Face decoders (causal LMs that take ``inputs_embeds``, whatever
    their modules are called) are cut by their layers. Any other model, and any model given
    `split_points`, is traced by torch's `pipeline()` on `example_batch` (one microbatch of this
    rank's share) and cut before each module named in `split_points`, or before repeated blocks
    (`find_blocks(model, block_types)`) chosen to balance parameter counts. The source model is
    left untouched.
    """
    layout = Layout.parse(layout).validate()
    stage_ids(layout, pp_rank)  # refuses a rank outside the pipeline before any work
    if split_points is None and layer_count(model) is not None:
        return split_by_layers(model, layout, pp_rank)
    if example_batch is None:
        raise TypeError(f"split_model cuts colab_par's GPT and Hugging Face decoders by their layers; "
                        f"{type(model).__name__} is neither; use pp=1 for it, or pass example_batch= "
                        "(one microbatch of this rank's share, e.g. (images, labels)) so torch's "
                        "pipeline() can trace it and cut it into stages")
    return split_traced(model, layout, pp_rank, split_points, block_types, example_batch)
