"""Checkpoints of the layouts the planner recommends on 2 CPU engines, several pipeline stages per
rank (ZB-V, interleaved) included: a run saved midway and resumed under another layout, or moved
there live by relayout, gives the losses of the same run never saved, for the README's GPT and a
Hugging Face decoder whose tied head lives on the same rank as its embeddings under ZB-V."""
from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from colab_par.planning.planner import plan

# Engines cannot import test modules: ship this one by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS, SAVE_AT, SEQ, BATCH = 4, 2, 64, 8
GPT_SIZES = dict(vocab_size=256, seq_len=SEQ, n_layer=4, n_head=4, d_model=128, kernels="torch")  # the README's
LLAMA_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=True,
                   pad_token_id=None, bos_token_id=1, eos_token_id=2)
SEVERAL_STAGES = ("pp2 zbv v2", "pp2 interleaved mb2 v2")


def config(kind: str):
    if kind == "gpt":
        from colab_par.models import GPTConfig
        return GPTConfig(**GPT_SIZES)
    import transformers
    return transformers.LlamaConfig(**LLAMA_SIZES, attn_implementation="sdpa")


def best_layout(kind: str, engines: int = 2) -> str:
    """What plan() (and so the picker's Auto) recommends for `kind` on `engines` CPU engines."""
    return str(plan(config(kind), engines, device="cpu", global_batch=BATCH, seq_len=SEQ)[0].layout)


def build_trainer(kind: str, layout: str):
    """On an engine: `kind` parallelized as `layout` (same seed, so the same weights everywhere) and
    its Trainer on byte-level text, which a few steps already learn."""
    import colab_par
    from colab_par.data import TextDataset
    from colab_par.training.trainer import Trainer

    def model():
        torch.manual_seed(3)
        if kind == "gpt":
            from colab_par.models import GPT
            return GPT(config(kind))
        import transformers
        return transformers.LlamaForCausalLM(config(kind))

    import json
    from pathlib import Path

    pm = colab_par.parallelize(model, layout, optimizer_fn=lambda p: torch.optim.AdamW(p, lr=3e-3))
    text = Path(json.__file__).parent  # the json package's sources: 48 KB, read at once
    return Trainer(pm, TextDataset(text, seq_len=SEQ, batch_size=BATCH), steps=STEPS)


def unsaved(kind: str, layout: str) -> list[float]:
    trainer = build_trainer(kind, layout)
    trainer.fit()
    return [row["loss"] for row in trainer.history]


def save_midway(kind: str, layout: str, root: str) -> None:
    import colab_par

    trainer = build_trainer(kind, layout)
    trainer.fit(stop_at=SAVE_AT)
    colab_par.save(trainer.pm, root, trainer=trainer)


def resume(kind: str, layout: str, root: str) -> list[float]:
    import colab_par

    trainer = build_trainer(kind, layout)
    colab_par.load(trainer.pm, root, trainer=trainer)
    trainer.fit()
    return [row["loss"] for row in trainer.history]


def relayout_midway(kind: str, first: str, second: str) -> list[float]:
    from colab_par.training.checkpoint import relayout

    trainer = build_trainer(kind, first)
    trainer.fit(stop_at=SAVE_AT)
    relayout(trainer.pm, second, trainer=trainer)
    trainer.fit()
    return [row["loss"] for row in trainer.history]


@pytest.fixture(scope="module")
def reference(cluster2):
    """The losses of a run never saved, per (model, layout), each trained once."""
    runs: dict[tuple[str, str], list[float]] = {}

    def losses(kind: str, layout: str) -> list[float]:
        if (kind, layout) not in runs:
            runs[kind, layout] = cluster2.run(unsaved, kind, layout)[0]
        return runs[kind, layout]
    return losses


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_recommended_layouts_resume_in_another_layout(cluster2, reference, tmp_path, kind):
    """Saved midway under each layout plan() may recommend (its best, and the several-stages-per-
    rank schedules it ranks next), resumed under tp2 (the README's relayout): the unsaved losses."""
    for i, layout in enumerate(dict.fromkeys([best_layout(kind), *SEVERAL_STAGES])):
        unsaved_losses = reference(kind, layout)
        assert unsaved_losses[-1] < unsaved_losses[0] - 0.05, unsaved_losses  # learnt: optimizer state matters
        root = str(tmp_path / f"ckpt{i}")
        cluster2.run(save_midway, kind, layout, root)
        resumed = cluster2.run(resume, kind, "tp2", root)[0]
        assert resumed == pytest.approx(unsaved_losses[SAVE_AT:], rel=1e-5), layout


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_relayout_into_several_stages_per_rank_and_back(cluster2, reference, kind):
    """tp2 -> pp2 zbv v2 and pp2 zbv v2 -> dp2, live, mid-run: the losses of the run never moved."""
    for first, second in (("tp2", "pp2 zbv v2"), ("pp2 zbv v2", "dp2")):
        moved = cluster2.run(relayout_midway, kind, first, second)[0]
        assert moved == pytest.approx(reference(kind, first), rel=1e-5), (first, second)


@pytest.mark.parametrize("engines, other", [(4, "dp2 tp2"), (8, "dp4 tp2")])
def test_the_best_layout_for_more_engines_resumes_in_another(request, tmp_path, engines, other):
    """plan()'s best layout on 4 and 8 CPU engines (pipelines here: pp4 1f1b, dp2 pp4 1f1b), saved
    midway and resumed under dp·tp: the unsaved losses, for the GPT and the tied Llama."""
    cluster = request.getfixturevalue(f"cluster{engines}")
    for kind in ("gpt", "llama"):
        layout = best_layout(kind, engines)
        unsaved_losses = cluster.run(unsaved, kind, layout)[0]
        root = str(tmp_path / kind)
        cluster.run(save_midway, kind, layout, root)
        resumed = cluster.run(resume, kind, other, root)[0]
        assert resumed == pytest.approx(unsaved_losses[SAVE_AT:], rel=1e-5), (kind, layout)
