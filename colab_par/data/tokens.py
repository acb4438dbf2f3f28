"""Data for training from a notebook: real text that needs no download, synthetic tokens, and
global batches of any form (`BatchList`).

Every dataset is a pure function of (batch index, dp rank): the global batch number `index` is the
whole data position, so it fits in a checkpoint as one integer, is identical under every layout
(re-layout keeps the same sample order), and each rank materialises only its own dp rows. The
context-parallel sequence split is done by `parallelize`'s model, not here.
"""
from __future__ import annotations

import os
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

__all__ = ["TokenDataset", "TextDataset", "SyntheticDataset", "BatchList", "pack_text", "stdlib_source_dir"]


def stdlib_source_dir() -> Path:
    """The Python standard library's own sources: real text present on every machine."""
    return Path(sysconfig.get_paths()["stdlib"])


class TokenDataset:
    """Batches of (inputs, targets) next-token pairs; subclasses define `window(i)`.

    `batch_size` is the GLOBAL batch (rows summed over data-parallel ranks).
    """

    vocab_size: int
    seq_len: int
    batch_size: int
    seed: int

    def window(self, sample: int) -> torch.Tensor:
        """Sample number `sample` (0, 1, 2, ... over all epochs) as seq_len+1 token ids."""
        raise NotImplementedError

    def batch(self, index: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of global batch `index` that belong to `dp_rank`: (inputs, targets), each (rows, seq)."""
        if self.batch_size % dp_size:
            raise ValueError(f"global batch_size={self.batch_size} does not split over dp={dp_size} "
                             f"ranks; use a batch_size that is a multiple of {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_size - 1}")
        rows = self.batch_size // dp_size
        first = index * self.batch_size + dp_rank * rows
        windows = torch.stack([self.window(first + r) for r in range(rows)])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def describe(self) -> dict:
        """A JSON-able fingerprint stored in checkpoints, so a resume with other data is caught."""
        return {"class": type(self).__name__, "seq_len": self.seq_len, "batch_size": self.batch_size,
                "vocab_size": self.vocab_size, "seed": self.seed}

    def _check_sizes(self) -> None:
        for name in ("seq_len", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")


class TextDataset(TokenDataset):
    """Byte-level tokens (vocab 256) from every matching text file under `root`.

    Files are read in sorted path order until `max_bytes`, cut into non-overlapping windows of
    seq_len+1 bytes, and visited in a fresh seeded permutation each epoch.
    """

    vocab_size = 256

    def __init__(self, root: str | os.PathLike | None = None, *, seq_len: int = 64, batch_size: int = 8,
                 pattern: str = "*.py", max_bytes: int = 4 << 20, seed: int = 0):
        self.root = Path(root) if root is not None else stdlib_source_dir()
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.pattern, self.max_bytes = pattern, max_bytes
        self._check_sizes()
        if not self.root.is_dir():
            raise ValueError(f"text root {str(self.root)!r} is not a directory; pass root=<folder of "
                             "text files> or leave it out for the Python standard library's sources")
        self.tokens = torch.frombuffer(bytearray(_read_corpus(sorted(self.root.rglob(pattern)), max_bytes)),
                                       dtype=torch.uint8)
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < batch_size:
            raise ValueError(f"{len(self.tokens)} bytes of {pattern!r} files under {str(self.root)!r} give "
                             f"{self.num_windows} windows of {seq_len + 1} tokens, fewer than one batch "
                             f"of {batch_size}; add text, lower seq_len/batch_size or change pattern")
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def window(self, sample: int) -> torch.Tensor:
        epoch, slot = divmod(sample, self.num_windows)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_windows, generator=generator)
        start = int(self._order[slot]) * self.seq_len
        return self.tokens[start:start + self.seq_len + 1].long()

    def describe(self) -> dict:
        return {**super().describe(), "root": str(self.root), "pattern": self.pattern,
                "max_bytes": self.max_bytes, "num_bytes": len(self.tokens)}


def _read_corpus(paths: Iterable[Path], max_bytes: int) -> bytes:
    chunks, total = [], 0
    for path in paths:
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable files (permissions, broken links) are simply not part of the corpus
        chunks.append(data[:max_bytes - total])
        total += len(chunks[-1])
    return b"".join(chunks)


class SyntheticDataset(TokenDataset):
    """Learnable synthetic sequences: each row counts from a random start with a random stride
    (mod vocab), so the loss falls quickly and a broken step shows up as a flat curve."""

    def __init__(self, vocab_size: int = 256, seq_len: int = 64, batch_size: int = 8, *,
                 max_stride: int = 7, seed: int = 0):
        self.vocab_size, self.seq_len, self.batch_size, self.seed = vocab_size, seq_len, batch_size, seed
        self.max_stride = max_stride
        self._check_sizes()
        if vocab_size < 2 or max_stride < 1:
            raise ValueError(f"vocab_size={vocab_size} and max_stride={max_stride} must be >= 2 and >= 1")

    def window(self, sample: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + sample)
        start = int(torch.randint(self.vocab_size, (1,), generator=generator))
        stride = int(torch.randint(1, self.max_stride + 1, (1,), generator=generator))
        return (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size


class BatchList:
    """Global batches of any form (`(images, labels)`, dicts with attention masks: see
    `colab_par/data/batch.py`), for models that do not train on token windows.

    `source` is a list (or anything indexable with a length) of global batches, cycled by index,
    or a function `index -> global batch` (a pure function of the index, like the token datasets,
    so a checkpoint's data position stays one integer). `name` identifies the data in checkpoints.
    """

    def __init__(self, source: Any, *, name: str | None = None):
        if callable(source) and not hasattr(source, "__getitem__"):
            self._get, self.count = source, None
        elif hasattr(source, "__getitem__") and hasattr(source, "__len__"):
            if len(source) == 0:
                raise ValueError("BatchList got no batches; give at least one global batch")
            self._get, self.count = (lambda index: source[index % len(source)]), len(source)
        else:
            raise TypeError(f"BatchList takes a list of global batches or a function index -> batch, "
                            f"not {type(source).__name__}")
        self.name = name or getattr(source, "__name__", type(source).__name__)

    def global_batch(self, index: int) -> Any:
        return self._get(index)

    def describe(self) -> dict:
        return {"kind": "BatchList", "name": self.name, "count": self.count}


def pack_text(dataset: Any, tokenizer: Callable[..., Any], seq_len: int, *, text_column: str = "text",
              add_eos: bool = True, map_batch: int = 1000) -> Any:
    """Tokenize a text column and pack it into rows of exactly `seq_len` tokens: a Hugging Face
    `datasets.Dataset` with `input_ids` and `labels` (= input_ids; the model shifts them), ready
    for `Trainer(pm, packed, batch_size=...)` with any causal LM.

    `dataset` is a `datasets.Dataset` (or a list of strings); `tokenizer` is a Hugging Face
    tokenizer or any callable `text -> token ids`. Documents are joined with the tokenizer's
    `eos_token_id` after each (when it has one and `add_eos`), so rows cross document borders as
    in GPT-style pre-training. Packing runs through `datasets.map` in chunks of `map_batch`
    documents; each chunk's last tokens that do not fill a row are dropped.
    """
    import datasets

    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
    if not isinstance(dataset, datasets.Dataset):
        texts = list(dataset)
        if not all(isinstance(text, str) for text in texts):
            raise TypeError("pack_text takes a datasets.Dataset or a list of strings")
        dataset = datasets.Dataset.from_dict({text_column: texts})
    if text_column not in dataset.column_names:
        raise ValueError(f"the dataset has no column {text_column!r} (its columns: {dataset.column_names}); "
                         "pass text_column= the column that holds the text")
    eos = getattr(tokenizer, "eos_token_id", None) if add_eos else None
    encode = _token_encoder(tokenizer)

    def pack(columns: dict) -> dict:
        stream: list[int] = []
        for ids in encode(columns[text_column]):
            stream.extend(ids)
            if eos is not None:
                stream.append(int(eos))
        rows = [stream[start:start + seq_len] for start in range(0, len(stream) - seq_len + 1, seq_len)]
        return {"input_ids": rows, "labels": [list(row) for row in rows]}

    packed = dataset.map(pack, batched=True, batch_size=map_batch, remove_columns=dataset.column_names)
    if len(packed) == 0:
        raise ValueError(f"the text gives fewer than seq_len={seq_len} tokens per chunk of {map_batch} "
                         "documents, so no row; add text, lower seq_len or raise map_batch")
    return packed


def _token_encoder(tokenizer: Callable[..., Any]) -> Callable[[list[str]], list[list[int]]]:
    """texts -> token id lists: one batched call for a Hugging Face tokenizer, else one call per text
    (a result may be ids, a tensor, or a mapping with `input_ids`)."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:
        PreTrainedTokenizerBase = ()  # noqa: N806 (no transformers: every tokenizer is a callable)
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return lambda texts: tokenizer(texts)["input_ids"]

    def each(texts: list[str]) -> list[list[int]]:
        encoded = []
        for text in texts:
            ids = tokenizer(text)
            ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise TypeError(f"the tokenizer gave {ids[:5]!r} for a text; it must return token ids "
                                "(ints), a tensor of them, or a mapping with 'input_ids'")
            encoded.append(ids)
        return encoded
    return each
