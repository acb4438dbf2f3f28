"""Datasets: real bytes of real files, rank slices that tile the global batch, deterministic order."""
from __future__ import annotations

import pytest
import torch

from colab_par.data import SyntheticDataset, TextDataset, stdlib_source_dir


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "b.txt").write_text("second file: " + "xyz" * 50)
    (root / "a.txt").write_text("first file, read first because paths are sorted. " * 4)
    (root / "skip.bin").write_bytes(b"\x00" * 100)
    return root


def test_text_tokens_are_the_bytes_of_the_sorted_files(corpus_dir):
    data = TextDataset(corpus_dir, pattern="*.txt", seq_len=8, batch_size=2)
    expected = (corpus_dir / "a.txt").read_bytes() + (corpus_dir / "b.txt").read_bytes()
    assert bytes(data.tokens.tolist()) == expected
    assert data.num_windows == (len(expected) - 1) // 8
    # Every window is a contiguous run of the corpus starting at a multiple of seq_len.
    for sample in range(data.num_windows):
        window = bytes(data.window(sample).tolist())
        start = expected.index(window)
        assert len(window) == 9 and expected[start:start + 9] == window


def test_default_text_is_the_standard_library(tmp_path):
    data = TextDataset(seq_len=32, batch_size=4, max_bytes=64 << 10)
    first_file = sorted(stdlib_source_dir().rglob("*.py"))[0].read_bytes()
    assert len(data.tokens) == 64 << 10
    assert bytes(data.tokens[:min(len(first_file), 1000)].tolist()) == first_file[:1000]


def test_each_epoch_visits_every_window_once(corpus_dir):
    data = TextDataset(corpus_dir, pattern="*.txt", seq_len=8, batch_size=2, seed=3)
    n = data.num_windows
    corpus = data.tokens.long()
    every_window = sorted(corpus[8 * i:8 * i + 9].tolist() for i in range(n))
    for epoch in (0, 1):
        assert sorted(data.window(epoch * n + i).tolist() for i in range(n)) == every_window
    order0 = [data.window(i).tolist() for i in range(n)]
    order1 = [data.window(n + i).tolist() for i in range(n)]
    assert order0 != order1, "a new epoch must reshuffle"


@pytest.mark.parametrize("make", [
    lambda: SyntheticDataset(vocab_size=50, seq_len=12, batch_size=8, seed=1),
    lambda: TextDataset(seq_len=16, batch_size=8, max_bytes=32 << 10, seed=1),
])
def test_dp_slices_tile_the_global_batch_in_order(make):
    data = make()
    for index in (0, 5):
        full_inputs, full_targets = data.batch(index)
        for dp in (2, 4):
            pieces = [data.batch(index, rank, dp) for rank in range(dp)]
            assert torch.equal(torch.cat([p[0] for p in pieces]), full_inputs)
            assert torch.equal(torch.cat([p[1] for p in pieces]), full_targets)
        assert torch.equal(full_inputs[:, 1:], full_targets[:, :-1])
    again = make()
    assert torch.equal(again.batch(3, 1, 2)[0], data.batch(3, 1, 2)[0]), "same seed, same batches"


def test_synthetic_rows_are_arithmetic_sequences():
    data = SyntheticDataset(vocab_size=31, seq_len=20, batch_size=4, max_stride=5)
    inputs, targets = data.batch(7)
    strides = (targets - inputs) % 31
    assert (strides == strides[:, :1]).all()
    assert ((strides >= 1) & (strides <= 5)).all()
    assert not torch.equal(data.batch(0)[0], data.batch(1)[0])


def test_bad_inputs_are_refused_with_a_way_out(tmp_path, corpus_dir):
    with pytest.raises(ValueError, match="multiple of 3"):
        SyntheticDataset(batch_size=4).batch(0, 0, 3)
    with pytest.raises(ValueError, match="not a directory"):
        TextDataset(tmp_path / "missing")
    with pytest.raises(ValueError, match="fewer than one batch"):
        TextDataset(corpus_dir, pattern="*.txt", seq_len=64, batch_size=64)
    with pytest.raises(ValueError, match="seq_len"):
        SyntheticDataset(seq_len=0)
