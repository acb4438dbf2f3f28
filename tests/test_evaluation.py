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


# ---- the Trainer ------------------------------------------------------------------------------------
def engine_fit(layout: str, evaluate: bool, folder: str, state: dict) -> dict:
    from colab_par import parallelize
    from colab_par.checkpoint import saved_history
    from colab_par.data import SyntheticDataset
    from colab_par.train import Trainer

    model = build("gpt")
    model.load_state_dict(state)
    pm = parallelize(model, layout, optimizer_fn=lambda p: torch.optim.AdamW(p, lr=3e-3))
    held_out = SyntheticDataset(vocab_size=VOCAB, seq_len=SEQ, batch_size=4, seed=77)
    options = dict(eval_data=held_out, eval_every=2, eval_batches=2) if evaluate else {}
    trainer = Trainer(pm, SyntheticDataset(vocab_size=VOCAB, seq_len=SEQ, batch_size=4, seed=5), steps=5,
                      telemetry=False, ckpt_dir=folder, **options)
    trainer.fit()
    trainer.to_csv(f"{folder}-history-{trainer.rank}.csv")
    return {"history": trainer.history, "saved": saved_history(folder),
            "final": pm.evaluate(held_out, 2)}


@pytest.mark.parametrize("layout", ["dp2 zero3", "pp2 1f1b mb2"])
def test_trainer_evaluates_every_k_steps_without_changing_training(cluster2, tmp_path, layout: str) -> None:
    plain = cluster2.run(engine_fit, layout, False, str(tmp_path / "plain"), trained_state("gpt"))
    evaluated = cluster2.run(engine_fit, layout, True, str(tmp_path / "evaluated"), trained_state("gpt"))
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


def test_dashboard_takes_histories_with_eval_rows() -> None:
    """The dashboard keeps drawing the training rows; an eval row at the same step replaces none."""
    from colab_par.dashboard import LiveDashboard
    from colab_par.telemetry import metrics_data

    rows = [{"step": 1, "rank": 0, "loss": 3.0, "lr": 1e-3}, {"step": 2, "rank": 0, "loss": 2.5, "lr": 1e-3},
            {"step": 2, "rank": 0, "kind": "eval", "eval_loss": 2.7, "eval_perplexity": 14.9,
             "eval_tokens": 64}]
    stream = io.StringIO()
    dashboard = LiveDashboard(mode="text", stream=stream)
    dashboard.update([metrics_data({"rank": 0, "total_steps": 2, "run": 1}, rows)])
    assert dashboard.latest()[0]["loss"] == 2.5
    assert "loss 2.5000" in stream.getvalue()


def test_bad_eval_arguments_fail_before_any_work() -> None:
    from colab_par.data import SyntheticDataset
    from colab_par.train import _check_eval

    held_out = SyntheticDataset(vocab_size=VOCAB, seq_len=SEQ)
    for args, message in [((held_out, 2, None), "num_batches"), ((None, 2, None), "eval_data"),
                          ((held_out, None, 3), "eval_every"), ((held_out, 0, 3), "eval_every"),
                          (("text", 2, None), "TokenDataset"), (([], 2, None), "no batches")]:
        with pytest.raises((ValueError, TypeError), match=message):
            _check_eval(*args)
