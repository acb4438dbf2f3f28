"""Batches and the data they come from, below the parallel model: token datasets, data sources with
their saved position and dp split, DataLoader workers, evaluation rows. Knows a rank's place in data
parallelism, never how a model is sharded."""
from colab_par.data.tokens import BatchList, SyntheticDataset, TextDataset, TokenDataset, pack_text, stdlib_source_dir

__all__ = ["TokenDataset", "TextDataset", "SyntheticDataset", "BatchList", "pack_text", "stdlib_source_dir"]
