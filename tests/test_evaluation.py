"""`ParallelModel.evaluate` and the Trainer's evaluation rows on real engines against one process.

The reference scores the same trained weights (`trained_models.py`) on the same global batches in
one process with no kit code: per-token cross-entropy summed over the targets that are not -100
(after the causal shift for labelled Hugging Face batches), or per-sample losses, divided by how
many there are. The batches differ in size and in how many targets they score, so a mean of
per-batch means would be off by far more than the 1e-6 allowed (asserted). Evaluating in the
middle of training changes nothing: the training losses equal a run without it, bit for bit.
"""
from __future__ import annotations

import csv
import io
import math
import sys
from functools import lru_cache

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

import any_models
from trained_models import SEQ, VOCAB, build, noisy_pattern, trained, trained_state

cloudpickle.register_pickle_by_value(sys.modules[__name__])

RTOL = 1e-6  # float32 means of each rank's piece, summed in float64: ~1e-7 apart from one process


@lru_cache(maxsize=None)
def data(kind: str) -> list:
    """Three global batches of 4, 4 and 2 rows. Token pairs: the last targets of some rows are -100.
    Labelled dicts: transformers' causal-LM batches, padding labelled -100. Samples: images."""
    generator = torch.Generator().manual_seed(3)
    if kind == "tokens":
        batches = []
        for rows in (4, 4, 2):
            seq = noisy_pattern(rows, SEQ + 1, generator)
            targets = seq[:, 1:].clone()
            targets[::2, -torch.randint(1, 8, (1,), generator=generator).item():] = -100
            batches.append((seq[:, :-1].contiguous(), targets))
        return batches
    batches = any_models.make_batches("llama-lm" if kind == "labels" else "cnn", 3)
    return batches[:2] + [{k: v[:2] for k, v in batches[2].items()} if kind == "labels"
                          else tuple(t[:2] for t in batches[2])]


def reference(model_kind: str, kind: str) -> dict:
    """One process: (sum of per-unit losses / units, units, mean of per-batch means)."""
    model = (trained(model_kind) if model_kind != "cnn" else any_models.build("cnn", 5)).eval()
    total, units, means = 0.0, 0, []
    with torch.no_grad():
        for batch in data(kind):
            if kind == "samples":
                losses, count = F.cross_entropy(model(batch[0]), batch[1], reduction="none"), len(batch[1])
            else:
                inputs, targets = ((batch["input_ids"], batch["labels"][:, 1:]) if kind == "labels" else batch)
                logits = model(input_ids=inputs).logits if kind == "labels" else model(inputs)
                logits = logits[:, :-1] if kind == "labels" else logits
                losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                         reduction="none", ignore_index=-100)
                count = int((targets != -100).sum())
            total += losses.double().sum().item()
            units += count
            means.append(losses.double().sum().item() / count)
    return {"loss": total / units, "units": units, "mean_of_means": sum(means) / len(means)}


def engine_evaluate(model_kind: str, layout: str, kind: str, batches: list, state: dict | None) -> dict:
    import torch.distributed as dist

    from colab_par import parallelize

    torch.manual_seed(dist.get_rank())
    if model_kind == "cnn":
        model = any_models.build("cnn", 5)
    else:
        model = build(model_kind)
        model.load_state_dict(state)
    return parallelize(model, layout).evaluate(batches)


def evaluated(cluster, model_kind: str, layout: str, kind: str) -> list[dict]:
    state = trained_state(model_kind) if model_kind != "cnn" else None
    return cluster.run(engine_evaluate, model_kind, layout, kind, data(kind), state)


def check(results: list[dict], model_kind: str, kind: str) -> None:
    expected = reference(model_kind, kind)
    unit = {"tokens": "tokens", "labels": "labels", "samples": "samples"}[kind]
    assert all(r == results[0] for r in results), "ranks disagree"
    got = results[0]
    assert got[unit] == expected["units"] and got["batches"] == 3
    assert math.isclose(got["loss"], expected["loss"], rel_tol=RTOL), (got["loss"], expected["loss"])
    assert abs(expected["mean_of_means"] - expected["loss"]) > 1e3 * RTOL * expected["loss"]  # weighting shows
    if kind == "samples":
        assert "perplexity" not in got
    else:
        assert math.isclose(got["perplexity"], math.exp(expected["loss"]), rel_tol=2 * RTOL)


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero3", "tp2", "pp2 1f1b mb2", "pp2 interleaved v2 mb2",
                                    "pp2 zbv v2 mb2", "cp2", "cp2 ulysses"])
def test_gpt_evaluates_like_one_process(cluster2, layout: str) -> None:
    check(evaluated(cluster2, "gpt", layout, "tokens"), "gpt", "tokens")


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero3", "tp2", "pp2 1f1b mb2"])
def test_hugging_face_labelled_batches_evaluate_like_one_process(cluster2, layout: str) -> None:
    check(evaluated(cluster2, "llama", layout, "labels"), "llama", "labels")


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero3"])
def test_image_batches_evaluate_per_sample(cluster2, layout: str) -> None:
    check(evaluated(cluster2, "cnn", layout, "samples"), "cnn", "samples")


@pytest.mark.parametrize("model_kind,kind,layout", [("gpt", "tokens", "dp2 tp2"), ("gpt", "tokens", "tp4 2d"),
                                                    ("llama", "labels", "dp2 tp2")])
def test_evaluates_under_four_ranks(cluster4, model_kind: str, kind: str, layout: str) -> None:
    check(evaluated(cluster4, model_kind, layout, kind), model_kind, kind)


# ---- the user's own rows: read whole once, split over dp, none counted twice -----------------------------
def engine_evaluate_rows(model_kind: str, layout: str, kind: str, batches: list, state: dict | None) -> dict:
    """The rows of `batches` (10) as a DataLoader of token pairs (read by its 2 workers), a Hugging Face dataset of
    labelled rows, or images in batches of 2 and of 4 (4 does not divide 10: refused)."""
    import multiprocessing

    import datasets
    from torch.utils.data import DataLoader, TensorDataset, get_worker_info

    from colab_par import parallelize

    model = any_models.build("cnn", 5) if model_kind == "cnn" else build(model_kind)
    if state is not None:
        model.load_state_dict(state)
    pm = parallelize(model, layout)
    if kind == "labels":
        columns = {key: torch.cat([b[key] for b in batches]).tolist() for key in batches[0]}
        return pm.evaluate(datasets.Dataset.from_dict(columns), batch_size=4)
    rows = TensorDataset(*(torch.cat(parts) for parts in zip(*batches)))
    if kind == "tokens":  # read by the DataLoader's own workers, as a user's loader would be
        in_workers = multiprocessing.Value("i", 0)  # shared with the (forked) workers

        class Counted(TensorDataset):
            def __getitem__(self, index):
                if get_worker_info() is not None:
                    with in_workers.get_lock():
                        in_workers.value += 1
                return super().__getitem__(index)

        result = pm.evaluate(DataLoader(Counted(*rows.tensors), batch_size=4, num_workers=2))
        if in_workers.value < len(rows) // 2:  # this rank's share of the 10 rows (and copies)
            raise RuntimeError(f"the DataLoader's workers read {in_workers.value} rows")
        return result
    try:
        pm.evaluate(rows, batch_size=4)
    except ValueError as error:
        refusal = str(error)
    return {**pm.evaluate(rows, batch_size=2), "refusal": refusal}


@pytest.mark.parametrize("model_kind,kind,layout", [("gpt", "tokens", "dp2"), ("gpt", "tokens", "pp2 1f1b mb2"),
                                                    ("llama", "labels", "dp2 zero3")])
def test_user_datasets_evaluate_every_row_once(cluster2, model_kind: str, kind: str, layout: str) -> None:
    """10 rows in global batches of 4: the last batch's 2 missing rows are copies with masked
    labels, so the units counted are exactly the 10 rows' (a copy counted, or a row left out,
    changes the count and the loss)."""
    state = trained_state(model_kind)
    check(cluster2.run(engine_evaluate_rows, model_kind, layout, kind, data(kind), state), model_kind, kind)


def test_per_sample_rows_must_fill_whole_batches(cluster2) -> None:
    expected = reference("cnn", "samples")
    for got in cluster2.run(engine_evaluate_rows, "cnn", "dp2", "samples", data("samples"), None):
        assert "do not fill whole global batches of 4" in got["refusal"] and "e.g. 2" in got["refusal"]
        assert got["samples"] == 10 and got["batches"] == 5
        assert math.isclose(got["loss"], expected["loss"], rel_tol=RTOL)


# ---- the Trainer ------------------------------------------------------------------------------------
def fit_trainer(layout: str, held_out_as: str | None, folder: str, state: dict) -> tuple:
    """A Trainer of the trained GPT, evaluating (unless `held_out_as` is None) on 2 global batches
    of 4 held-out sequences as the kit's TokenDataset or as a DataLoader of the same rows."""
    from torch.utils.data import DataLoader, TensorDataset

    from colab_par import parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.training.trainer import Trainer

    model = build("gpt")
    model.load_state_dict(state)
    pm = parallelize(model, layout, optimizer_fn=lambda p: torch.optim.AdamW(p, lr=3e-3))
    held_out = SyntheticDataset(vocab_size=VOCAB, seq_len=SEQ, batch_size=4, seed=77)
    rows = DataLoader(TensorDataset(*(torch.cat(parts) for parts in zip(*(held_out.batch(i, 0, 1)
                                                                          for i in range(2))))), batch_size=4)
    options = ({} if held_out_as is None else dict(eval_data=held_out, eval_every=2, eval_batches=2)
               if held_out_as == "tokens" else dict(eval_data=rows, eval_every=2))
    trainer = Trainer(pm, SyntheticDataset(vocab_size=VOCAB, seq_len=SEQ, batch_size=4, seed=5), steps=5,
                      telemetry=False, ckpt_dir=folder, **options)
    return trainer, pm, held_out


def engine_fit(layout: str, held_out_as: str | None, folder: str, state: dict) -> dict:
    from colab_par.training.checkpoint import saved_history

    trainer, pm, held_out = fit_trainer(layout, held_out_as, folder, state)
    trainer.fit()
    trainer.to_csv(f"{folder}-history-{trainer.rank}.csv")
    return {"history": trainer.history, "saved": saved_history(folder),
            "final": pm.evaluate(held_out, 2)}


@pytest.mark.parametrize("layout,held_out_as", [("dp2 zero3", "tokens"), ("pp2 1f1b mb2", "tokens"),
                                                ("dp2 zero3", "loader")])
def test_trainer_evaluates_every_k_steps_without_changing_training(cluster2, tmp_path, layout: str,
                                                                   held_out_as: str) -> None:
    plain = cluster2.run(engine_fit, layout, None, str(tmp_path / "plain"), trained_state("gpt"))
    evaluated = cluster2.run(engine_fit, layout, held_out_as, str(tmp_path / "evaluated"), trained_state("gpt"))
    for a, b in zip(plain, evaluated):
        train = [row for row in b["history"] if row.get("kind") != "eval"]
        assert [row["loss"] for row in a["history"]] == [row["loss"] for row in train]  # bit for bit
        evals = [row for row in b["history"] if row.get("kind") == "eval"]
        assert [row["step"] for row in evals] == [2, 4, 5]  # every 2 steps and after the last
        assert evals[-1]["eval_loss"] == a["final"]["loss"] == b["final"]["loss"]
        assert evals[-1]["eval_perplexity"] == a["final"]["perplexity"]
        assert evals[-1]["eval_tokens"] == 2 * 4 * SEQ
        assert b["saved"] == b["history"]  # checkpoints keep the eval rows with the history
    with open(tmp_path / "evaluated-history-0.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["kind"] for row in rows].count("eval") == 3 and float(rows[-1]["eval_loss"]) > 0


def engine_fit_resumed(layout: str, folder: str, state: dict) -> dict:
    """Train 5 steps evaluating every 2; then train to step 3 (a checkpoint), and resume that in a
    fresh model and Trainer to step 5."""
    whole, _, _ = fit_trainer(layout, "loader", f"{folder}-whole", state)
    whole.fit()
    first, _, _ = fit_trainer(layout, "loader", f"{folder}-cut", state)
    first.fit(stop_at=3)
    resumed, _, _ = fit_trainer(layout, "loader", f"{folder}-cut", state)
    resumed.resume()
    restored = list(resumed.history)
    resumed.fit()
    return {"whole": whole.history, "restored": restored, "resumed": resumed.history}


def test_eval_rows_survive_a_checkpoint_and_resume(cluster2, tmp_path) -> None:
    def outcome(rows: list[dict]) -> list[tuple]:
        return [(row["step"], row.get("kind"), row.get("loss"), row.get("eval_loss")) for row in rows]

    for got in cluster2.run(engine_fit_resumed, "dp2 zero3", str(tmp_path / "run"), trained_state("gpt")):
        assert [(step, kind) for step, kind, *_ in outcome(got["restored"])] == [
            (1, None), (2, None), (2, "eval"), (3, None)]
        assert outcome(got["resumed"]) == outcome(got["whole"])  # bit for bit, eval rows of both halves


def test_dashboard_takes_histories_with_eval_rows() -> None:
    """The dashboard keeps drawing the training rows; an eval row at the same step replaces none."""
    from colab_par.views.dashboard import LiveDashboard
    from colab_par.training.telemetry import metrics_data

    rows = [{"step": 1, "rank": 0, "loss": 3.0, "lr": 1e-3}, {"step": 2, "rank": 0, "loss": 2.5, "lr": 1e-3},
            {"step": 2, "rank": 0, "kind": "eval", "eval_loss": 2.7, "eval_perplexity": 14.9,
             "eval_tokens": 64}]
    stream = io.StringIO()
    dashboard = LiveDashboard(mode="text", stream=stream)
    dashboard.update([metrics_data({"rank": 0, "total_steps": 2, "run": 1}, rows)])
    assert dashboard.latest()[0]["loss"] == 2.5
    assert "loss 2.5000" in stream.getvalue()


def dashboard_of(rows: list[dict]):
    from colab_par.views.dashboard import LiveDashboard
    from colab_par.training.telemetry import metrics_data

    dashboard = LiveDashboard(mode="text", stream=io.StringIO())
    for _ in range(2):  # the same chunks published twice: nothing may be drawn twice
        dashboard.update([metrics_data({"rank": 0, "total_steps": 10, "run": 1}, rows)])
    return dashboard


def test_dashboard_draws_validation_loss_beside_training_loss() -> None:
    """A validation curve (orange) in the loss plot of the live SVG frame and of the final PNG,
    an eval line in text mode, validation loss in the progress line; none without eval rows."""
    import xml.etree.ElementTree as ET

    import numpy as np
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread

    from colab_par.views.dashboard import ORANGE

    train = [{"step": s, "rank": 0, "loss": 3.0 / s, "lr": 1e-3} for s in range(1, 11)]
    evals = [{"step": s, "rank": 0, "kind": "eval", "eval_loss": 4.0 / s, "eval_perplexity": math.exp(4.0 / s),
              "eval_tokens": 64} for s in (2, 4, 6, 8, 10)]
    with_eval = dashboard_of(sorted(train + evals, key=lambda row: (row["step"], "kind" in row)))
    without = dashboard_of(train)

    assert with_eval.series("eval_loss") == ([2, 4, 6, 8, 10], [4.0 / s for s in (2, 4, 6, 8, 10)])
    assert with_eval.series("loss") == without.series("loss") and with_eval.latest()[0]["loss"] == 0.3

    def validation_points(dashboard) -> list[int]:
        svg = ET.fromstring(dashboard.svg())
        plot = next(g for g in svg.iter("{http://www.w3.org/2000/svg}g") if g.get("data-title") == "loss by step")
        return [len(line.get("points").split()) for line in plot.iter("{http://www.w3.org/2000/svg}polyline")
                if line.get("data-label") == "validation" and line.get("stroke") == ORANGE]

    assert validation_points(with_eval) == [5] and validation_points(without) == []

    def orange_pixels(dashboard) -> int:
        panel = next(p for p in dashboard.panels() if p.title == "loss by step")
        left, top, right, bottom = panel.box
        image = imread(io.BytesIO(dashboard.png()), format="png")[top + 3:bottom - 3, left + 3:right - 3, :3]
        return int((np.abs(image - np.array(to_rgb(ORANGE))) < 0.08).all(axis=-1).sum())

    assert orange_pixels(with_eval) > 40 and orange_pixels(without) == 0
    text = with_eval.stream.getvalue()
    assert text.count("eval at step") == 5 and "eval at step 10 · loss 0.4000 · perplexity 1.492 · 64 tokens" in text
    assert with_eval.progress().endswith("validation loss 0.4000") and "validation" not in without.progress()


def test_bad_eval_arguments_fail_before_any_work() -> None:
    from colab_par.data import SyntheticDataset
    from colab_par.training.options import Evaluation
    from colab_par.training.trainer import held_out_data

    held_out = SyntheticDataset(vocab_size=VOCAB, seq_len=SEQ)
    for args, message in [((held_out, 2, None), "num_batches"), ((None, 2, None), "data=None"),
                          ((held_out, None, 3), "every=None"), ((held_out, 0, 3), "every=0"),
                          (("text", 2, None), "needs a length.*not a str"), (([], 2, None), "no batches")]:
        with pytest.raises((ValueError, TypeError), match=message):
            held_out_data(Evaluation(*args), None)


def test_held_out_rows_that_cannot_be_read_whole_are_refused() -> None:
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    from colab_par.parallel.inference.evaluation import eval_data

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    rows = TensorDataset(torch.zeros(6, 4, dtype=torch.long), torch.zeros(6, 4, dtype=torch.long))
    refused = [(Stream(), 4, "needs a length"), (DataLoader(Stream(), batch_size=2), None, "needs a length"),
               ("text", 2, "not a str"), ({"input_ids": rows.tensors[0]}, 2, "not a dict"),
               (rows, None, "pass batch_size="), (DataLoader(rows, batch_size=2), 4, "the DataLoader's is 2")]
    for data, batch_size, message in refused:
        with pytest.raises((ValueError, TypeError), match=message):
            eval_data(data, batch_size)
    assert eval_data(DataLoader(rows, batch_size=2), None).count == 3
