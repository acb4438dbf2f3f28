"""Shard-first initialisation: a model built on the meta device, or a factory the kit builds on
meta, trains exactly like one-process training of the normally built model (the parity suite's
reference and tolerances), under every kind of layout. PARITY_SOURCE=meta|factory runs the whole
parity suite this way; here a cross-section runs in CI."""
from __future__ import annotations

import pytest

from any_models import make_batches
from parity import assert_parity, engine_run, reference_run

CROSS_SECTION = [("dp2", "gpt"), ("dp2 zero1", "gpt"), ("dp2 zero3", "gpt"), ("dp2 zero3 ac-full", "gpt"),
                 ("dp2 zero3 offload", "gpt"), ("tp2 sp", "gpt"), ("pp2 1f1b", "gpt"), ("cp2", "gpt"),
                 ("dp2 zero3", "llama"), ("tp2", "qwen2"), ("pp2 1f1b", "llama"),
                 ("dp2 zero2", "bert"), ("dp2 zero3", "cnn"), ("dp2 zero3", "tinylm")]


@pytest.mark.parametrize("source", ["meta", "factory"])
@pytest.mark.parametrize("layout, kind", CROSS_SECTION)
def test_meta_built_model_trains_like_one_process(cluster2, layout: str, kind: str, source: str) -> None:
    assert_parity(cluster2.run(engine_run, layout, kind, source=source), reference_run(kind))


@pytest.mark.parametrize("kind", ["bert", "cnn"])
def test_a_traced_pipeline_split_of_a_factory_trains_like_one_process(cluster2, kind: str) -> None:
    """torch's pipeline() traces the model while it is still on meta; the graph's own tensors
    (BERT's attention mask) are then made on the rank's device."""
    example = make_batches(kind, 1)[0]
    assert_parity(cluster2.run(engine_run, "pp2 1f1b", kind, source="factory", example_batch=example),
                  reference_run(kind))
