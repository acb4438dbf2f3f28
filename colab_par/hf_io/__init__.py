"""Hugging Face weights in and out: local model directories to a `ParallelModel` and back.

`from_pretrained` reads each rank's slices straight from the safetensors files (`weights.py`),
`save_pretrained` streams the trained weights back into the same format (`save.py`); neither
holds the whole model on any rank.
"""
from colab_par.hf_io.load import from_pretrained
from colab_par.hf_io.save import DEFAULT_MAX_SHARD_BYTES, save_pretrained
from colab_par.models.hf_weights import SafetensorsWeights, WeightsError

__all__ = ["from_pretrained", "save_pretrained", "SafetensorsWeights", "WeightsError",
           "DEFAULT_MAX_SHARD_BYTES"]
