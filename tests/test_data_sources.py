"""The user's own data (torch Dataset, IterableDataset, DataLoader, Hugging Face datasets) as global
batches: every row of every epoch trained on exactly once across dp ranks, a seeded order that does
not depend on the dp size, a checkpointed position that resumes with exactly the next rows (also
under another layout), a packed Hugging Face dataset that trains a tiny Llama under dp2 like one
process, and bad data refused before any work."""
from __future__ import annotations

import re
import sys

import cloudpickle
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from colab_par.data.sources import DataPlace, IterableSource, MapSource, data_source, stack_rows
from colab_par.training.options import Checkpoints, Logs

datasets = pytest.importorskip("datasets")

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# ---- learnable rows that carry their own id --------------------------------------------------------
FEATURES, CLASSES, ROWS, BATCH = 4, 3, 10, 4  # 10 rows in batches of 4: epochs end mid-batch (wrap)


def row(i: int) -> dict:
    """Row i: features seeded by i, the label a fixed linear rule of them (learnable), its id."""
    x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(1000 + i))
    rule = torch.arange(FEATURES * CLASSES, dtype=torch.float32).reshape(CLASSES, FEATURES).sin()
    return {"x": x, "labels": int((rule @ x).argmax()), "sample_id": i}


class Rows(Dataset):
    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict:
        return row(i)


class TupleRows(Dataset):
    """Rows as tuples, for a DataLoader whose collate_fn builds the dict batch."""

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> tuple:
        r = row(i)
        return r["x"], r["labels"], r["sample_id"]


def tuples_to_dict(rows: list[tuple]) -> dict:
    xs, labels, ids = zip(*rows)
    return {"x": torch.stack(xs), "labels": torch.tensor(labels), "sample_id": torch.tensor(ids)}


class Stream(IterableDataset):
    """The rows in a fixed scrambled order, pass after pass; remembers the passes it was told of."""

    ORDER = [3, 7, 0, 9, 4, 1, 8, 2, 6, 5]

    def __init__(self):
        self.epochs: list[int] = []
        self.read = 0  # rows yielded on this rank

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        for i in self.ORDER:
            self.read += 1
            yield row(i)


def hf_rows():
    rows = [row(i) for i in range(ROWS)]
    return datasets.Dataset.from_dict({key: [r[key].tolist() if torch.is_tensor(r[key]) else r[key]
                                             for r in rows] for key in rows[0]})


SOURCES = {
    "dataset": lambda: (Rows(), dict(batch_size=BATCH)),
    "loader": lambda: (DataLoader(TupleRows(), batch_size=BATCH, shuffle=True, collate_fn=tuples_to_dict), {}),
    "hf": lambda: (hf_rows(), dict(batch_size=BATCH)),
    "stream": lambda: (Stream(), dict(batch_size=BATCH)),
}


class Recorder(torch.nn.Module):
    """A linear classifier that remembers the ids of the rows it trained on, in order."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(FEATURES, CLASSES)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, sample_id: torch.Tensor) -> torch.Tensor:
        self.seen.extend(sample_id.tolist())
        return self.linear(x)


def stream_of(records: list[dict], batch: int) -> list:
    """The global row stream from what each rank's model saw: one recording rank per dp rank,
    cut into shares of batch/dp rows, dp shares of each global batch in dp order."""
    by_dp = {}
    for record in records:
        if record["seen"]:
            by_dp.setdefault(record["dp_rank"], record["seen"])
    share = batch // len(by_dp)
    chunks = [[seen[i:i + share] for i in range(0, len(seen), share)] for _, seen in sorted(by_dp.items())]
    return [x for batch_chunks in zip(*chunks) for chunk in batch_chunks for x in chunk]


def train_recorder(kind: str, layout: str, steps: int, grad_accum: int) -> dict:
    from colab_par import Trainer, parallelize

    torch.manual_seed(0)
    pm = parallelize(Recorder(), layout, optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.5))
    data, options = SOURCES[kind]()
    trainer = Trainer(pm, data, steps=steps, grad_accum=grad_accum, seed=11, telemetry=False, **options)
    trainer.fit()
    model = getattr(pm.model, "module", pm.model)
    return {"seen": model.seen, "dp_rank": pm.dp_rank, "losses": [r["loss"] for r in trainer.history],
            "epochs_told": getattr(data, "epochs", None), "read": getattr(data, "read", None)}


@pytest.mark.parametrize("kind,grad_accum", [("dataset", 2), ("dataset", 1), ("loader", 2), ("hf", 2),
                                             ("stream", 2)])
def test_every_row_of_every_epoch_is_trained_on_once_across_ranks(cluster2, kind, grad_accum):
    epochs = 4
    steps = epochs * ROWS // (BATCH * grad_accum)
    records = cluster2.run(train_recorder, kind, "dp2", steps, grad_accum)
    stream = stream_of(records, BATCH)
    assert len(stream) == steps * grad_accum * BATCH == epochs * ROWS
    orders = [stream[e * ROWS:(e + 1) * ROWS] for e in range(epochs)]
    assert all(sorted(order) == list(range(ROWS)) for order in orders), orders
    if kind == "stream":  # in its own order, each pass told its number; rank 0 alone reads it
        assert orders == [Stream.ORDER] * epochs
        assert records[0]["epochs_told"][-epochs:] == list(range(epochs)) and set(records[1]["epochs_told"]) == {0}
        # (before work every rank reads the first batch to check it, and its first row to fingerprint)
        assert records[0]["read"] == epochs * ROWS + BATCH + 1 and records[1]["read"] == BATCH + 1
    else:  # reshuffled each epoch with the documented seeded permutation
        assert orders == [seeded_order(11, e) for e in range(epochs)]
    losses = records[0]["losses"]
    assert losses == records[1]["losses"] and losses[-1] < 0.8 * losses[0]


def seeded_order(seed: int, epoch: int) -> list[int]:
    return torch.randperm(ROWS, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()


# ---- resume: a checkpoint continues with exactly the next rows, under any layout --------------------
GPT_SIZES = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, kernels="torch")
STEPS, SAVE_AT = 6, 3  # 24 rows of 10: the save falls in the second epoch, mid-batch of it


def window(i: int) -> torch.Tensor:
    """Row i's 17 tokens: counting from a start unique to i with a stride of 1..5 (learnable)."""
    return ((i * 37) % 64 + (1 + i % 5) * torch.arange(GPT_SIZES["seq_len"] + 1)) % 64


class Windows(Dataset):
    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> tuple:
        w = window(i)
        return w[:-1], w[1:]


class WindowStream(IterableDataset):
    def __iter__(self):
        for i in Stream.ORDER:
            w = window(i)
            yield w[:-1], w[1:]


def resume_run(kind: str, layout: str, *, ckpt: str | None = None, stop_at: int | None = None,
               resume_from: str | None = None, relayout_to: str | None = None) -> dict:
    """Train the test GPT on `kind` rows ("map" or "stream"): fully, or up to `stop_at` saving a
    checkpoint, or from `resume_from`, or moving to `relayout_to` live at SAVE_AT. Returns the
    losses and, per layout trained under, the row ids of the batches the trainer fed the model."""
    from colab_par import Trainer, load, parallelize
    from colab_par.training.checkpoint import relayout
    from colab_par.models.gpt import GPT, GPTConfig

    ids = {tuple(window(i)[1:].tolist()): i for i in range(ROWS)}
    parts: list[dict] = []

    def watch(pm) -> None:
        """Note the rows of every batch pm trains on (its own method, observed, not changed)."""
        part, train = {"seen": [], "dp_rank": pm.dp_rank}, pm.forward_backward_tensor
        parts.append(part)

        def forward_backward(batch, *args, **kwargs):
            part["seen"].extend(ids[tuple(t)] for t in batch[-1].tolist())
            return train(batch, *args, **kwargs)
        pm.forward_backward_tensor = forward_backward  # what the Trainer calls

    torch.manual_seed(5)
    pm = parallelize(GPT(GPTConfig(**GPT_SIZES)), layout,
                     optimizer_fn=lambda p: torch.optim.AdamW(p, lr=3e-3))
    data = {"map": Windows, "stream": WindowStream, "workers": workers_loader}[kind]()
    trainer = Trainer(pm, data, steps=STEPS, batch_size=BATCH, seed=3, logs=Logs(telemetry=False), checkpoints=Checkpoints(ckpt, every=SAVE_AT) if ckpt else None)
    if resume_from:
        load(pm, resume_from, trainer=trainer)
    watch(pm)
    if relayout_to:
        trainer.fit(stop_at=SAVE_AT)
        watch(relayout(pm, relayout_to, trainer=trainer))
    trainer.fit(stop_at=stop_at)
    return {"parts": parts, "losses": [row["loss"] for row in trainer.history],
            "position": trainer.data_position}


def workers_loader() -> DataLoader:
    """The map rows through a DataLoader read by 2 worker processes per rank, pinned, persistent."""
    return DataLoader(Windows(), batch_size=BATCH, shuffle=True, collate_fn=stack_rows, num_workers=2,
                      pin_memory=True, persistent_workers=True)


def rows_trained(ranks: list[dict]) -> list[int]:
    """The global row stream of a run, layout after layout."""
    return [i for part in range(len(ranks[0]["parts"]))
            for i in stream_of([rank["parts"][part] for rank in ranks], BATCH)]


@pytest.fixture(scope="module")
def uninterrupted(cluster2, tmp_path_factory):
    """Per kind: the uninterrupted dp2 run, and a checkpoint saved at SAVE_AT of the same run."""
    runs = {}
    for kind in ("map", "stream"):
        ckpt = str(tmp_path_factory.mktemp(f"ckpt-{kind}"))
        full = cluster2.run(resume_run, kind, "dp2")
        first = cluster2.run(resume_run, kind, "dp2", ckpt=ckpt, stop_at=SAVE_AT)
        assert first[0]["losses"] == full[0]["losses"][:SAVE_AT]
        runs[kind] = (rows_trained(full), full[0]["losses"], ckpt)
    return runs


@pytest.mark.parametrize("kind,layout", [("map", "dp2"), ("map", "tp2"), ("map", "pp2 gpipe mb2"),
                                         ("stream", "tp2")])
def test_a_resumed_run_trains_on_exactly_the_rows_of_an_uninterrupted_one(cluster2, uninterrupted, kind,
                                                                          layout):
    stream, losses, ckpt = uninterrupted[kind]
    assert sorted(stream[:ROWS]) == list(range(ROWS))
    assert (stream[:ROWS] != stream[ROWS:2 * ROWS]) == (kind == "map")  # (a stream keeps its order)
    resumed = cluster2.run(resume_run, kind, layout, resume_from=ckpt)
    assert rows_trained(resumed) == stream[SAVE_AT * BATCH:]
    assert resumed[0]["position"] == STEPS
    assert resumed[0]["losses"] == pytest.approx(losses[SAVE_AT:], rel=1e-5)


def resume_with_other_data(ckpt: str) -> str:
    from colab_par import Trainer, load, parallelize
    from colab_par.training.checkpoint import CheckpointError
    from colab_par.models.gpt import GPT, GPTConfig

    pm = parallelize(GPT(GPTConfig(**GPT_SIZES)), "dp2")
    trainer = Trainer(pm, Windows(), steps=STEPS, batch_size=BATCH, seed=4, logs=Logs(telemetry=False))  # saved: 3
    try:
        load(pm, ckpt, trainer=trainer)
    except CheckpointError as error:
        return f"{error} step={trainer.step}"
    return "loaded"


def test_a_checkpoint_of_other_data_order_is_refused(cluster2, uninterrupted):
    for message in cluster2.run(resume_with_other_data, uninterrupted["map"][2]):
        assert "'seed': 3" in message and "'seed': 4" in message and message.endswith(
            "build the same dataset to resume step=0")


def test_a_live_relayout_keeps_the_row_stream(cluster2, uninterrupted):
    stream, losses, _ = uninterrupted["map"]
    moved = cluster2.run(resume_run, "map", "dp2", relayout_to="pp2 gpipe mb2")
    assert rows_trained(moved) == stream  # dp2's shares, then whole batches
    assert moved[0]["losses"] == pytest.approx(losses, rel=1e-5)


def test_a_dataloader_with_workers_resumes_on_the_exact_next_row(cluster2, uninterrupted, tmp_path):
    """Read by workers (2 per rank, pinned, persistent): the rows and losses of the in-process
    uninterrupted run, saved mid-epoch and resumed under tp2 (dp 2 -> 1) on exactly the next row,
    and moved live to pp2 keeping the stream."""
    stream, losses, _ = uninterrupted["map"]
    first = cluster2.run(resume_run, "workers", "dp2", ckpt=str(tmp_path), stop_at=SAVE_AT)
    assert rows_trained(first) == stream[:SAVE_AT * BATCH] and first[0]["losses"] == losses[:SAVE_AT]
    resumed = cluster2.run(resume_run, "workers", "tp2", resume_from=str(tmp_path))
    assert rows_trained(resumed) == stream[SAVE_AT * BATCH:] and resumed[0]["position"] == STEPS
    assert resumed[0]["losses"] == pytest.approx(losses[SAVE_AT:], rel=1e-5)
    moved = cluster2.run(resume_run, "workers", "dp2", relayout_to="pp2 gpipe mb2")
    assert rows_trained(moved) == stream


class Corrupt(Rows):
    """Rows 0..BATCH-1 read anywhere; later rows fail when a DataLoader worker reads them."""

    def __getitem__(self, i: int) -> dict:
        if get_worker_info() is not None and i >= BATCH:
            raise ValueError(f"row {i} is corrupt")
        return row(i)


def fail_in_a_worker() -> str:
    import traceback

    from colab_par import Trainer, parallelize

    loader = DataLoader(Corrupt(), batch_size=BATCH, num_workers=2)
    trainer = Trainer(parallelize(Recorder(), "dp2"), loader, steps=3, logs=Logs(telemetry=False))
    try:
        trainer.fit()
    except ValueError:
        return f"at step {trainer.step}: {traceback.format_exc()}"
    return "trained"


def test_a_worker_that_raises_fails_the_step_with_its_traceback(cluster2):
    for dp_rank, report in enumerate(cluster2.run(fail_in_a_worker)):
        assert report.startswith("at step 1: ")  # batch 0 trained; batch 1 (rows 4..7) failed
        assert re.search(r"ValueError: Caught ValueError in DataLoader worker process \d\.\nOriginal Traceback "
                         r"\(most recent call last\):\n.*in _worker_loop\n.*in __getitem__\n(.*\n)?"
                         rf"ValueError: row {4 + 2 * dp_rank} is corrupt\n", report, re.S), report


# ---- a packed Hugging Face dataset trains a tiny Llama under dp2 like one process ------------------
WORDS = ("the a one my red big small old cat dog bird fox sees likes chases finds on under near "
         "mat box tree . and").split()


def tiny_tokenizer():
    """A word-level PreTrainedTokenizerFast over WORDS, built in memory (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["<unk>", "<eos>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")


def sentences(count: int = 60) -> list[str]:
    """Learnable text: every sentence follows one grammar (seeded)."""
    g = torch.Generator().manual_seed(0)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=g))]
    return [" ".join([pick("the", "a", "my"), pick("red", "big", "small", "old"), pick("cat", "dog", "bird", "fox"),
                      pick("sees", "likes", "chases", "finds"), pick("the", "one"), pick("mat", "box", "tree"), "."])
            for _ in range(count)]


LLAMA_SEQ, LLAMA_STEPS, LLAMA_LR = 16, 8, 1e-2  # 32 rows of 30: the run wraps into epoch 2


def packed_text():
    from colab_par.data import pack_text

    return pack_text(datasets.Dataset.from_dict({"text": sentences()}), tiny_tokenizer(), LLAMA_SEQ)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(21)
    config = LlamaConfig(vocab_size=len(WORDS) + 2, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LLAMA_SEQ,
                         head_dim=8, pad_token_id=None, bos_token_id=None, eos_token_id=1,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def llama_on_engine(layout: str) -> list[dict]:
    from colab_par import Trainer, parallelize

    pm = parallelize(tiny_llama(), layout, optimizer_fn=lambda p: torch.optim.AdamW(p, lr=LLAMA_LR))
    trainer = Trainer(pm, packed_text(), batch_size=BATCH, steps=LLAMA_STEPS, seed=4)
    trainer.fit()
    return trainer.history


def test_a_packed_hf_dataset_trains_a_tiny_llama_under_dp2_like_one_process(cluster2):
    packed, tokenizer = packed_text(), tiny_tokenizer()
    assert packed.column_names == ["input_ids", "labels"] and len(packed) >= LLAMA_STEPS * BATCH // 2
    stream = [i for text in sentences() for i in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    rows = len(stream) // LLAMA_SEQ
    assert packed["input_ids"] == packed["labels"] == [stream[r * LLAMA_SEQ:(r + 1) * LLAMA_SEQ]
                                                       for r in range(rows)]
    # One process, transformers alone: the documented seeded order, the model's own loss.
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LLAMA_LR)
    order = [i for epoch in range(2) for i in
             torch.randperm(rows, generator=torch.Generator().manual_seed(4 * 1_000_003 + epoch)).tolist()]
    expected = []
    for step in range(LLAMA_STEPS):
        batch = packed[order[step * BATCH:(step + 1) * BATCH]]
        loss = model(input_ids=torch.tensor(batch["input_ids"]), labels=torch.tensor(batch["labels"])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    assert expected[-1] < 0.8 * expected[0]  # the text is learnable: a broken update would show
    for history in cluster2.run(llama_on_engine, "dp2"):
        assert [row["loss"] for row in history] == pytest.approx(expected, rel=1e-5)
        for row in history:  # each rank read half the rows; the throughput counts all of them
            assert row["tokens_per_s"] == pytest.approx(BATCH * LLAMA_SEQ / row["step_time"])


# ---- order, epochs and position without a cluster ---------------------------------------------------
def shares(source, index: int, dp: int) -> list[int]:
    """Global batch `index` as the dp ranks read it, concatenated in dp order (row ids)."""
    return [i for k in range(dp) for i in source.local_batch(index, DataPlace(k, dp))["sample_id"].tolist()]


def test_the_order_is_seeded_wrapped_and_the_same_for_every_dp_size():
    source = MapSource(Rows(), BATCH, seed=7)
    stream = [i for index in range(5) for i in shares(source, index, 1)]  # 20 rows: two epochs
    assert stream == seeded_order(7, 0) + seeded_order(7, 1)
    for dp in (2, 4):
        assert [i for index in range(5) for i in shares(MapSource(Rows(), BATCH, seed=7), index, dp)] == stream
    assert [i for index in range(5) for i in shares(MapSource(Rows(), BATCH, shuffle=False), index, 2)] == \
        list(range(ROWS)) * 2


def test_drop_last_skips_the_rows_that_do_not_fill_a_batch():
    source = MapSource(Rows(), BATCH, seed=7, drop_last=True)
    epochs = [[i for index in (2 * e, 2 * e + 1) for i in shares(source, index, 2)] for e in range(3)]
    assert epochs == [seeded_order(7, e)[:8] for e in range(3)]


def test_a_dataloader_brings_its_batch_collate_order_and_drop_last():
    loader = DataLoader(TupleRows(), batch_size=BATCH, shuffle=True, collate_fn=tuples_to_dict, drop_last=True)
    source = data_source(loader, seed=7)
    assert (source.batch_size, source.collate, source.shuffle, source.drop_last) == (BATCH, tuples_to_dict, True, True)
    in_order = data_source(DataLoader(TupleRows(), batch_size=2, collate_fn=tuples_to_dict))
    assert shares(in_order, 1, 2) == [2, 3] and in_order.describe()["shuffle"] is False
    seeded = data_source(DataLoader(TupleRows(), batch_size=BATCH, shuffle=True, collate_fn=tuples_to_dict,
                                    generator=torch.Generator().manual_seed(9)), seed=7)
    assert [i for index in (0, 1) for i in shares(seeded, index, 2)] == seeded_order(9, 0)[:8]  # its generator
    streamed = data_source(DataLoader(Stream(), batch_size=BATCH))
    assert isinstance(streamed, IterableSource)
    assert streamed.local_batch(0, DataPlace())["sample_id"].tolist() == Stream.ORDER[:BATCH]


def test_a_stream_wraps_its_passes_and_resumes_from_its_saved_place():
    def read(source, first, count):
        return [i for index in range(first, first + count)
                for i in source.local_batch(index, DataPlace())["sample_id"].tolist()]
    data = Stream()
    whole = read(IterableSource(data, BATCH), 0, 5)
    assert whole == Stream.ORDER * 2 and data.epochs == [0, 1]
    first = IterableSource(Stream(), BATCH)
    read(first, 0, 3)
    state = first.state_dict()
    assert state == {"pass": 1, "rows_read": 2, "batches": 3}
    resumed = IterableSource(Stream(), BATCH)
    resumed.load_state_dict(state)
    assert read(resumed, 3, 2) == whole[12:]
    with pytest.raises(RuntimeError, match="a stream is read in order: batch 0 was asked for after 5"):
        resumed.local_batch(0, DataPlace())


def test_the_fingerprint_tells_datasets_apart_without_reading_them():
    class Counting(Rows):
        reads = 0

        def __getitem__(self, i):
            Counting.reads += 1
            return row(i)
    class Shifted(Rows):
        def __getitem__(self, i):
            return row(i + 1)
    described = MapSource(Counting(), BATCH, seed=1).describe()
    assert Counting.reads == 2 and described["rows"] == ROWS  # the first and last rows only
    assert described["fingerprint"] == MapSource(Rows(), BATCH).describe()["fingerprint"]
    assert described["fingerprint"] != MapSource(Shifted(), BATCH).describe()["fingerprint"]
    hf = hf_rows()
    assert MapSource(hf, BATCH).describe() == MapSource(hf_rows(), BATCH).describe()
    shifted = hf.map(lambda r: {"x": [v + 1 for v in r["x"]]})
    assert MapSource(shifted, BATCH).describe() != MapSource(hf, BATCH).describe()


def test_pack_text_takes_any_callable_tokenizer():
    from colab_par.data import pack_text

    packed = pack_text(["ab", "cde", "fghij"], lambda text: list(text.encode()), 4)
    assert packed["input_ids"] == [list(b"abcd"), list(b"efgh")]  # no eos without one; "ij" is left over
    with pytest.raises(ValueError, match=r"no column 'body' \(its columns: \['text'\]\)"):
        pack_text(datasets.Dataset.from_dict({"text": ["x"]}), tiny_tokenizer(), 4, text_column="body")
    with pytest.raises(ValueError, match="fewer than seq_len=64 tokens"):
        pack_text(["short"], tiny_tokenizer(), 64)


# ---- bad data is refused before any work, with the way out -------------------------------------------
class Empty(Dataset):
    def __len__(self) -> int:
        return 0

    def __getitem__(self, i: int) -> dict:
        raise IndexError(i)


class EmptyStream(IterableDataset):
    def __iter__(self):
        return iter(())


class Scorer(torch.nn.Module):
    """Hugging Face style: the forward takes the labels it would score."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 8)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed(input_ids)


def refusals_on_engine() -> dict[str, str]:
    """Each bad input given to a Trainer on a real dp2 (or pp2) model: the error it raised."""
    from colab_par import Trainer, parallelize
    from colab_par.models.gpt import GPT, GPTConfig

    recorder = parallelize(Recorder(), "dp2")
    scorer = parallelize(Scorer(), "dp2")
    stages = parallelize(GPT(GPTConfig(**GPT_SIZES)), "pp2 gpipe mb2")
    text = datasets.Dataset.from_dict({"text": ["the cat", "a dog"] * 4})
    ragged = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4, 5]] * 4, "labels": [[1, 2], [3, 4, 5]] * 4})
    ids = datasets.Dataset.from_dict({"input_ids": [[1, 2]] * 8})
    cases = {
        "dp split": (recorder, Rows(), dict(batch_size=3)),
        "microbatches": (stages, Windows(), dict(batch_size=3)),
        "text": (scorer, text, dict(batch_size=4)),
        "ragged": (scorer, ragged, dict(batch_size=4)),
        "unknown keys": (recorder, text.rename_column("text", "words").map(lambda r: {"words": 1}), dict(batch_size=4)),
        "missing key": (recorder, hf_rows().remove_columns("sample_id"), dict(batch_size=4)),
        "no labels": (scorer, ids, dict(batch_size=4)),
        "tuple arity": (scorer, torch.utils.data.TensorDataset(*[torch.zeros(8, 2, dtype=torch.long)] * 4),
                        dict(batch_size=4)),
        "empty stream": (recorder, EmptyStream(), dict(batch_size=4)),
    }
    found = {}
    for name, (pm, data, options) in cases.items():
        try:
            Trainer(pm, data, steps=1, telemetry=False, **options)
            found[name] = "accepted"
        except (ValueError, TypeError) as error:
            found[name] = str(error)
    return found


class BrokenStream(Stream):
    """Gives its first pass, then fails (a file gone, a network read that broke)."""

    def __iter__(self):
        if len(self.epochs) > 3:  # two opens for the checks before work, the first pass, then this
            raise OSError("shard-00001 is gone")
        return super().__iter__()


def fail_mid_stream() -> str:
    from colab_par import Trainer, parallelize

    trainer = Trainer(parallelize(Recorder(), "dp2"), BrokenStream(), batch_size=BATCH, steps=10, logs=Logs(telemetry=False))
    try:
        trainer.fit()
    except (OSError, RuntimeError) as error:
        return f"{type(error).__name__}: {error} (at step {trainer.step})"
    return "trained"


def test_a_stream_that_fails_mid_run_fails_every_rank_at_once(cluster2):
    rank0, rank1 = cluster2.run(fail_mid_stream)
    assert rank0 == "OSError: shard-00001 is gone (at step 2)"
    assert rank1 == ("RuntimeError: rank 0, which reads the stream for every rank, failed: OSError: "
                     "shard-00001 is gone (at step 2)")


REFUSALS = {
    "dp split": r"global batch_size=3 does not split over dp=2 ranks; use a multiple of 2 \(e.g. 4\)",
    "microbatches": r"3 rows .* do not split into microbatches=2; use a batch_size that is a multiple of 2",
    "text": r"column 'text' holds text \('the cat'\).*colab_par.data.pack_text.*remove_columns",
    "ragged": r"column 'input_ids' has rows of different shapes \[\(2,\), \(3,\)\].*collate_fn that pads",
    "unknown keys": r"the rows have keys \['words'\] but the model's forward takes \['sample_id', 'x'\]",
    "missing key": r"the model's forward needs \['sample_id'\], which the rows \(keys \['labels', 'x'\]\) lack",
    "no labels": r"the model scores `labels` but the rows \(keys \['input_ids'\]\) have none.*loss_fn",
    "tuple arity": r"a tuple row is \(\*inputs, target\): 3 input\(s\) for a forward taking \['input_ids', 'labels'\]",
    "empty stream": r"the stream \(EmptyStream\) gave no rows",
}


def test_bad_data_is_refused_before_any_work_with_the_way_out(cluster2):
    for found in cluster2.run(refusals_on_engine):
        for name, pattern in REFUSALS.items():
            assert re.search(pattern, found[name]), (name, found[name])


@pytest.mark.parametrize("make,error,message", [
    (lambda: data_source(Empty(), 4), ValueError, r"the dataset \(Empty\) has no rows"),
    (lambda: data_source(Rows()), ValueError, r"a Rows has rows, not batches: pass batch_size= \(the GLOBAL"),
    (lambda: data_source({"x": torch.zeros(4)}, 4), TypeError, r"dict is not data to train on.*from_dict"),
    (lambda: data_source(Rows(), 0), ValueError, r"batch_size=0 must be a positive integer: the GLOBAL batch"),
    (lambda: data_source(Rows(), 16, drop_last=True), ValueError, r"drop_last=True with 10 rows .* no batch"),
    (lambda: data_source(DataLoader(Rows(), batch_size=4), 8), ValueError, r"the DataLoader's is 4; leave"),
    (lambda: data_source(DataLoader(Rows(), batch_sampler=[[0, 1]])), ValueError, r"has a batch_sampler"),
    (lambda: data_source(DataLoader(Rows(), batch_size=4, sampler=torch.utils.data.distributed.DistributedSampler(
        Rows(), num_replicas=2, rank=0))), ValueError, r"DistributedSampler.*no DistributedSampler either"),
    (lambda: stack_rows([{"ids": [1]}, {"ids": [1, 2]}]), ValueError, r"column 'ids' has rows of different"),
    (lambda: data_source(DataLoader(Stream(), batch_size=4, num_workers=2)), ValueError,
     r"reads a stream with num_workers=2, pin_memory=False: colab_par reads a stream on rank 0.*num_workers=0"),
    (lambda: data_source(DataLoader(Rows(), batch_size=4, num_workers=1, in_order=False)), ValueError,
     r"in_order=False lets workers hand batches back in any order.*in_order=True"),
])
def test_data_refused_before_a_model_is_involved(make, error, message):
    with pytest.raises(error, match=message):
        make()
