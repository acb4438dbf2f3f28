"""Models the kit did not write (a notebook CNN, a transformer classifier with a dict batch and an
attention mask, an MLP without repeated blocks) train under data parallel and ZeRO exactly like
the same model in one process: same losses, gradient norms and final parameters (see parity.py)."""
from __future__ import annotations

import pytest
from any_models import build, make_batches
from parity import assert_parity, engine_run, reference_run

ZERO_LAYOUTS = ["dp2", "dp2 zero1", "dp2 zero3", "dp2 zero3 offload"]


@pytest.mark.parametrize("layout", ZERO_LAYOUTS)
@pytest.mark.parametrize("kind", ["cnn", "classifier"])
def test_notebook_models_train_like_single_process(cluster2, kind: str, layout: str) -> None:
    assert_parity(cluster2.run(engine_run, layout, kind), reference_run(kind))


def test_model_without_repeated_blocks_shards_as_one_unit(cluster2) -> None:
    assert_parity(cluster2.run(engine_run, "dp2 zero3", "mlp"), reference_run("mlp"))


def test_user_loss_fn_sees_outputs_and_batch(cluster2) -> None:
    import torch.nn.functional as F

    def loss_fn(outputs, batch):
        return F.cross_entropy(outputs, batch["labels"])

    assert_parity(cluster2.run(engine_run, "dp2 zero2", "classifier", loss_fn=loss_fn),
                  reference_run("classifier"))


def test_parity_rejects_a_wrong_run_of_a_notebook_model(cluster2) -> None:
    """Negative control: the same check fails against a reference whose learning rate is 1 % off."""
    from parity import LR

    results = cluster2.run(engine_run, "dp2 zero3", "cnn")
    assert_parity(results, reference_run("cnn"))
    with pytest.raises(AssertionError):
        assert_parity(results, reference_run("cnn", lr=LR * 1.01))


def test_checkpointing_without_blocks_is_refused_before_work(cluster2) -> None:
    from colab_par.cluster.output import EngineError

    with pytest.raises(EngineError, match="has none.*blocks=\\[...\\]"):
        cluster2.run(engine_run, "dp2 zero3 ac-full", "mlp")


def _train_images_with_trainer() -> dict:
    """Engine side: the Trainer on an image classifier's (images, labels) batches under dp2 zero3."""
    import torch

    from colab_par import Trainer, parallelize

    pm = parallelize(build("cnn", 0), "dp2 zero3", optimizer_fn=lambda p: torch.optim.AdamW(p, lr=1e-2))
    trainer = Trainer(pm, make_batches("cnn", 6, batch=8), steps=12, grad_accum=2)
    rows = trainer.fit()
    return {"loss": [r["loss"] for r in rows], "samples_per_s": rows[-1]["samples_per_s"],
            "tokens_per_s": rows[-1].get("tokens_per_s"), "flops_per_s": rows[-1]["flops_per_s"],
            "step_time": rows[-1]["step_time"], "position": trainer.data_position}


def test_trainer_and_telemetry_on_image_batches(cluster2) -> None:
    """The loop needs no tokens: samples/s replaces tokens/s, FLOPs come from torch's counter.

    The counted FLOPs are checked against the convolution/linear formula for this rank's share:
    forward 2·MACs, backward twice that (input and weight gradients; the first conv has no input
    gradient)."""
    first, second = cluster2.run(_train_images_with_trainer)
    assert first["loss"] == second["loss"] and first["loss"][-1] < first["loss"][0]
    assert first["tokens_per_s"] is None
    assert first["samples_per_s"] == pytest.approx(16 / first["step_time"])  # 8 per micro-step, 2 micro-steps
    assert first["position"] == 24
    per_sample_macs = 64 * (1 * 4 * 9 + 4 * 4 * 9 + 4 * 4 * 9) + 256 * 5
    first_conv_input_grad = 64 * 1 * 4 * 9
    flops = 2 * 4 * 2 * (3 * per_sample_macs - first_conv_input_grad)  # 4 samples per rank, 2 micro-steps
    assert first["flops_per_s"] * first["step_time"] == pytest.approx(flops, rel=0.02)


@pytest.mark.parametrize("layout", ["dp2 zero3", "tp2"])
def test_bert_masked_lm_trains_like_single_process(cluster2, layout: str) -> None:
    """Ranks hold different numbers of masked tokens: the loss is still the mean over all of them."""
    pytest.importorskip("transformers")
    assert_parity(cluster2.run(engine_run, layout, "bert"), reference_run("bert"))


@pytest.mark.parametrize("kind,layout", [("cnn", "pp2 1f1b"), ("classifier", "pp2 gpipe mb2"),
                                         ("bert-untied", "pp2 1f1b"), ("bert", "pp2 1f1b")])
def test_models_the_kit_did_not_write_train_under_pipeline_parallel(cluster2, kind: str, layout: str) -> None:
    """parallelize traces them with torch's pipeline() on an example batch and cuts between blocks."""
    if kind.startswith("bert"):
        pytest.importorskip("transformers")
    example = make_batches(kind, 1)[0]
    assert_parity(cluster2.run(engine_run, layout, kind, example_batch=example), reference_run(kind))


def test_user_named_split_points(cluster2) -> None:
    example = make_batches("classifier", 1)[0]
    assert_parity(cluster2.run(engine_run, "pp2 1f1b", "classifier", example_batch=example,
                               split_points=["layers.1"]), reference_run("classifier"))


@pytest.mark.parametrize("layout", ["dp2 zero3", "pp2 1f1b", "tp2"])
def test_notebook_tinylm_under_zero3_pipeline_and_its_tensor_parallel_plan(cluster2, layout: str) -> None:
    """Notebook 01's TinyLM (torch's encoder layers) with the plan the notebook shows for tp."""
    from any_models import TINYLM_TP_PLAN
    from parity import batches

    options = {"pp2 1f1b": {"example_batch": batches(64, 16, 1)[0]},
               "tp2": {"tp_plan": TINYLM_TP_PLAN}}.get(layout, {})
    assert_parity(cluster2.run(engine_run, layout, "tinylm", **options), reference_run("tinylm"))
