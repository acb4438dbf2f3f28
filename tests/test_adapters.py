"""PEFT models (peft's LoRA, DoRA, IA3) under every layout, against peft and transformers alone.

A model from ``peft.get_peft_model`` trains under dp, ZeRO-1/3 (+ offload, recompute, bf16), tensor
parallel (its adapters split with their base layers; Megatron sequence parallel on the kit's GPT,
whose row-split adapters need their gradients summed), pipeline stages and dp × tp, with every
step's loss within 1e-5 relative of peft in one process (same base, LoraConfig, seed, batches,
AdamW), for Llama and GPT-2 (transformers' Conv1D, a fused q|k|v). Only adapters change and only
they hold optimizer state, as the planner counts it. ``from_pretrained(dir, layout, lora=...)``
equals ``get_peft_model`` on transformers' own load; the saved adapter and the merged model give
the trained logits through peft / transformers alone, and load back onto a sharded base;
checkpoints resume bit for bit and move to another layout. What cannot work is refused before any
work, naming the way out. Data: one repeated batch of a learnable pattern, so losses fall.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import cloudpickle
import pytest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from any_models import GPT2  # noqa: E402
from parity import (HF_TOKENS, LLAMA_SIZES, PEFT_LAYERS, SEED, assert_close_to_fp32, assert_parity,  # noqa: E402
                    batches, bf16_engine_run, build_model, engine_run, engine_run_moved, peft_config,
                    reference_run, training_batches)
from test_hf_io import TOKENS, engine_logits  # noqa: E402


cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS, LR = 8, 3e-3  # Adam at 3e-3 moves the adapters visibly in 8 steps, well inside float32 parity
VOCAB, SEQ = LLAMA_SIZES["vocab_size"], LLAMA_SIZES["max_position_embeddings"]
LLAMA_LORA = "llama+lora"


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def _learns(reference: dict) -> None:
    losses = reference["losses"]
    assert losses[-1] < losses[0] - 0.05, f"the adapters do not learn the pattern: {losses}"


# ---- parity with peft in one process -------------------------------------------------------------
@pytest.mark.parametrize("layout", ["dp2", "dp2 zero3", "tp2", "pp2"])
@pytest.mark.parametrize("kind", [LLAMA_LORA, "gpt2+lora"])
def test_lora_trains_as_peft_does_in_one_process(cluster2, kind: str, layout: str) -> None:
    reference = reference_run(kind, STEPS, lr=LR)
    _learns(reference)
    assert_parity(cluster2.run(engine_run, layout, kind, STEPS, lr=LR), reference)


@pytest.mark.parametrize("kind,layout,source", [
    ("gpt+lora", "tp2 sp", "module"),  # the kit's GPT: row-split bases leave their output split by sequence
    (LLAMA_LORA, "dp2 zero1", "module"),
    ("gpt2+lora", "dp2 zero2", "module"),
    (LLAMA_LORA, "dp2 zero3 offload ac-full", "module"),
    (LLAMA_LORA, "tp2", "factory"),  # built on meta: peft's adapter init recorded and replayed
    ("llama+lora_head", "tp2", "module"),  # modules_to_save: the head's trained copy split as the head
    ("llama+dora", "dp2 zero3", "module"),
    ("llama+ia3", "pp2", "module")])
def test_adapters_compose_with_the_other_layout_steps(cluster2, kind: str, layout: str, source: str) -> None:
    reference = reference_run(kind, STEPS, lr=LR)
    assert reference["losses"][-1] < reference["losses"][0]
    assert_parity(cluster2.run(engine_run, layout, kind, STEPS, source, lr=LR), reference)


def test_lora_trains_in_bf16_with_fp32_master_weights(cluster2) -> None:
    """Every linear (adapters too) runs in bf16 and the losses show bf16 rounding yet stay within 2e-2
    (`parity.assert_close_to_fp32`'s bounds); the frozen fp32 base is untouched. Adapter weights
    start at zero, where bf16 noise flips the sign of some of Adam's first steps, so they are not
    held element by element: their update (final minus initial weights) must follow the fp32
    reference's, within a quarter of its norm (measured 0.05). Adapters that never trained miss by
    the whole norm (ratio 1); an element-wise bound wide enough for the sign flips
    (2·3.2·lr·steps = 0.05) would pass them."""
    results = cluster2.run(bf16_engine_run, "dp2 zero3 bf16", kind=LLAMA_LORA, steps=STEPS)
    reference = reference_run(LLAMA_LORA, STEPS)
    adapters = _peft_trainable()
    frozen_only = {k: v for k, v in reference["state"].items() if k not in adapters}
    assert_close_to_fp32(results, {**reference, "state": frozen_only})
    for name, expected in frozen_only.items():
        assert torch.equal(results[0]["state"][name], expected), name
    initial = build_model(LLAMA_LORA, SEED).get_base_model().state_dict()
    got = torch.cat([(results[0]["state"][n] - initial[n]).flatten() for n in sorted(adapters)])
    wanted = torch.cat([(reference["state"][n] - initial[n]).flatten() for n in sorted(adapters)])
    miss = ((got - wanted).norm() / wanted.norm()).item()
    assert miss < 0.25, f"the adapters' bf16 update is {miss:.2f} of the fp32 update's norm away from it"


@pytest.mark.parametrize("kind", [LLAMA_LORA, "gpt2+lora"])
def test_lora_trains_under_data_and_tensor_parallel_together(cluster4, kind: str) -> None:
    assert_parity(cluster4.run(engine_run, "dp2 tp2", kind, STEPS, lr=LR), reference_run(kind, STEPS, lr=LR))


@pytest.mark.parametrize("source", ["module", "factory"])
def test_lora_trains_on_a_tensor_grid(cluster4, source: str) -> None:
    """The kit's GPT on the 2d grid (q=2: batch and weights split two ways each): the adapters add
    their update to each rank's weight piece, their gradients summed over the pieces; built whole
    or shard-first from a factory."""
    reference = reference_run("gpt+lora", STEPS, lr=LR)
    _learns(reference)
    assert_parity(cluster4.run(engine_run, "tp4 2d", "gpt+lora", STEPS, source, lr=LR), reference)


# ---- what trains ------------------------------------------------------------------------------------
def _shapes_and_training(layout: str) -> dict:
    """Engine side: local/global shapes of layer 0's adapters, the state before and after 3 steps,
    and the parameters holding a gradient after the first backward and optimizer state (this rank's)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from colab_par import parallelize

    pm = parallelize(build_model(LLAMA_LORA, SEED + dist.get_rank()), layout, optimizer_fn=_adamw)
    shapes = {name: (tuple(p.to_local().shape) if isinstance(p, DTensor) else None, tuple(p.shape))
              for name, p in pm.model.named_parameters() if ".layers.0." in name and "lora_" in name}
    before = pm.full_state_dict()
    (x, y), *rest = training_batches(LLAMA_LORA, 3)
    pm.forward_backward(x, y)
    inner_model = getattr(pm.model, "module", pm.model)  # DDP (ZeRO-1) wraps it
    with_grad = {name for name, p in inner_model.named_parameters() if p.grad is not None}
    pm.optimizer_step()
    for x, y in rest:
        pm.train_step(x, y)
    inner = getattr(pm.optimizer, "optim", pm.optimizer)  # ZeRO-1 keeps this rank's share inside
    state = get_optimizer_state_dict(pm.model, inner, options=StateDictOptions(flatten_optimizer_state_dict=True))
    with_state = {key[len("state."):].rpartition(".")[0] for key in state if key.startswith("state.")}
    return {"shapes": shapes, "before": before, "after": pm.full_state_dict(), "with_state": with_state,
            "with_grad": with_grad}


def _peft_trainable() -> set[str]:
    model = build_model(LLAMA_LORA, SEED)
    return {name for name, p in model.get_base_model().named_parameters() if p.requires_grad}


@pytest.mark.parametrize("layout", ["dp2 zero1", "dp2 zero3", "tp2"])
def test_only_adapters_change_and_only_they_hold_gradients_and_optimizer_state(cluster2, layout: str) -> None:
    results = cluster2.run(_shapes_and_training, layout)
    before, after = results[0]["before"], results[0]["after"]
    trainable = _peft_trainable()
    assert trainable and all("lora_" in name for name in trainable)
    for name, value in before.items():
        if name in trainable:
            assert not torch.equal(value, after[name]), f"{name} did not train"
        else:
            assert torch.equal(value, after[name]), f"frozen {name} changed"
    assert set().union(*(r["with_state"] for r in results)) == trainable
    for result in results:
        assert result["with_grad"] == trainable, sorted(result["with_grad"] ^ trainable)[:4]
    if layout == "tp2":  # a column-split base (q_proj): B split by output; a row-split one (o_proj): A by input
        shapes = results[0]["shapes"]
        assert shapes["model.layers.0.self_attn.q_proj.lora_B.default.weight"] == ((16, 4), (32, 4))
        assert shapes["model.layers.0.self_attn.q_proj.lora_A.default.weight"] == (None, (4, 32))
        assert shapes["model.layers.0.self_attn.o_proj.lora_A.default.weight"] == ((4, 16), (4, 32))
        assert shapes["model.layers.0.self_attn.o_proj.lora_B.default.weight"] == (None, (32, 4))


def _lora_with_dropout() -> dict:
    """Engine side: tp2 with lora_dropout 0.1; rank's A of column-split bases (whole on each rank)."""
    import torch.distributed as dist

    from colab_par import parallelize

    torch.manual_seed(SEED + dist.get_rank())  # each rank its own generator: masks drawn per rank
    model = peft.get_peft_model(build_model("llama", None), peft_config("lora", "llama", lora_dropout=0.1))
    pm = parallelize(model, "tp2", optimizer_fn=_adamw)
    losses = [pm.train_step(x, y) for x, y in training_batches(LLAMA_LORA, STEPS)]
    whole = {name: p.detach().clone() for name, p in pm.model.named_parameters()
             if "q_proj.lora_A" in name or "gate_proj.lora_A" in name}
    return {"losses": losses, "whole": whole}


def test_dropout_on_a_whole_input_draws_one_mask_for_the_tensor_parallel_group(cluster2) -> None:
    """The replicas of A after a column-split base must see the same dropped input, or their
    gradients (and then the replicas) would differ."""
    first, second = cluster2.run(_lora_with_dropout)
    assert first["losses"][-1] < first["losses"][0] - 0.05
    assert first["whole"] and all(torch.equal(first["whole"][k], second["whole"][k]) for k in first["whole"])


# ---- the planner counts state for what trains ---------------------------------------------------------
def _measured(layout: str, kind: str = LLAMA_LORA) -> dict:
    import torch.distributed as dist

    from colab_par import memory_report, parallelize

    pm = parallelize(build_model(kind, SEED + dist.get_rank()), layout, optimizer_fn=_adamw)
    (x, y), = training_batches(kind, 1)
    pm.forward_backward(x, y)
    backward = memory_report(pm)
    pm.optimizer_step()
    return {"backward": backward, "step": memory_report(pm)}


@pytest.mark.parametrize("layout", ["dp2", "dp2 zero3"])
def test_planner_counts_gradients_and_optimizer_state_for_trainable_parameters_only(cluster2, layout) -> None:
    from colab_par.planning.module_spec import ModuleSpec
    from colab_par.planning.planner import ModelSpec, estimate

    model = build_model(LLAMA_LORA, SEED)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trainable < total / 4
    spec = ModuleSpec.probe(model, training_batches(LLAMA_LORA, 1)[0])
    assert spec.trainable_params == trainable and spec.n_params == total
    assert ModelSpec.of(model).trainable == pytest.approx(trainable / total)
    option = estimate(spec, layout, device="cpu", global_batch=4, seq_len=SEQ)
    for report in cluster2.run(_measured, layout):
        assert report["backward"]["params"] == pytest.approx(option.resting.params, rel=1e-12)
        assert report["backward"]["grads"] == pytest.approx(option.resting.grads, rel=1e-12)
        assert report["step"]["optimizer"] == pytest.approx(option.resting.optimizer, rel=1e-12)


def test_planner_counts_whole_adapters_on_every_rank_of_a_tensor_grid(cluster4) -> None:
    """The grid splits the base four ways and keeps the adapters whole: the planner's gradients and
    optimizer state are the adapters' own, as each rank holds them."""
    from colab_par.planning.planner import ModelSpec, estimate

    model = build_model("gpt+lora", SEED)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    option = estimate(ModelSpec.of(model), "tp4 2d", device="cpu", global_batch=4, seq_len=16)
    assert option.resting.grads == pytest.approx(4 * adapters, rel=1e-12)
    for report in cluster4.run(_measured, "tp4 2d", "gpt+lora"):
        assert report["backward"]["grads"] == pytest.approx(option.resting.grads, rel=1e-12)
        assert report["backward"]["params"] == pytest.approx(option.resting.params, rel=1e-12)
        assert report["step"]["optimizer"] == pytest.approx(option.resting.optimizer, rel=1e-12)


# ---- from_pretrained with adapters -------------------------------------------------------------------
def _hf_dir(folder: Path, family: str = "llama", **changes) -> Path:
    """A random 2-layer model saved by transformers: Llama, or GPT-2 as released (head tied to wte)."""
    torch.manual_seed(SEED)
    if family == "gpt2":
        config = transformers.GPT2Config(**{**GPT2, "n_layer": PEFT_LAYERS, **changes}, **HF_TOKENS)
    else:
        config = transformers.LlamaConfig(**{**LLAMA_SIZES, "num_hidden_layers": PEFT_LAYERS, **changes},
                                          **HF_TOKENS, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    return {family: _hf_dir(tmp_path_factory.mktemp(family), family) for family in ("llama", "gpt2")}


@pytest.fixture(scope="module")
def llama_dir(hf_dirs) -> Path:
    return hf_dirs["llama"]


DATA = batches(VOCAB, SEQ, 1) * 3


def _lora_from_pretrained(path: str, layout: str) -> dict:
    """Engine side: the adapters as from_pretrained made them, the first logits, three steps' losses."""
    from colab_par import from_pretrained

    torch.manual_seed(SEED)
    pm = from_pretrained(path, layout, lora=peft_config("lora", "llama"), optimizer_fn=_adamw)
    state, logits = pm.full_state_dict(), engine_logits(pm, TOKENS)
    return {"state": state, "logits": logits, "losses": [pm.train_step(x, y) for x, y in DATA]}


def _peft_alone(path: Path) -> dict:
    """transformers' own load, get_peft_model with the same seed, the same three steps."""
    torch.manual_seed(SEED)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path),
                                peft_config("lora", "llama"))
    state = {k: v.clone() for k, v in model.get_base_model().state_dict().items()}
    with torch.no_grad():
        logits = model(input_ids=TOKENS, use_cache=False).logits
    optimizer = _adamw([p for p in model.parameters() if p.requires_grad])
    losses = []
    for x, y in DATA:
        out = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"state": state, "logits": logits, "losses": losses}


def _last_stage(values: list):
    """What the ranks holding the logits returned (the last pipeline stage's; all agree)."""
    return [value for value in values if value is not None][-1]


@pytest.mark.parametrize("layout", ["dp2 zero3", "tp2", "pp2"])
def test_from_pretrained_with_lora_equals_get_peft_model_in_one_process(cluster2, llama_dir, layout) -> None:
    results = cluster2.run(_lora_from_pretrained, str(llama_dir), layout)
    alone = _peft_alone(llama_dir)
    state = results[0]["state"]
    assert set(state) == set(alone["state"])
    for name, expected in alone["state"].items():  # base weights from the files, adapters as peft drew them
        assert torch.equal(state[name], expected), name
    assert state["model.layers.1.mlp.up_proj.lora_A.default.weight"].abs().sum() > 0
    torch.testing.assert_close(_last_stage([r["logits"] for r in results]), alone["logits"], rtol=0.0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(alone["losses"]),
                               rtol=1e-5, atol=0.0)


# ---- adapter files out and in ----------------------------------------------------------------------
def _train_and_save(path: str, family: str, adapter: str, layout: str, adapter_out: str,
                    merged_out: str) -> torch.Tensor | None:
    from colab_par import from_pretrained, save_pretrained

    torch.manual_seed(SEED)
    pm = from_pretrained(path, layout, lora=peft_config(adapter, family), optimizer_fn=_adamw)
    for x, y in DATA:
        pm.train_step(x, y)
    save_pretrained(pm, adapter_out)
    save_pretrained(pm, merged_out, merged=True)
    return engine_logits(pm, TOKENS)


def _load_adapter(path: str, layout: str, adapter: str, trainable: bool) -> dict:
    from colab_par import from_pretrained

    pm = from_pretrained(path, layout, adapter=adapter, is_trainable=trainable)
    return {"logits": engine_logits(pm, TOKENS),
            "trainable": {name for name, p in pm.model.named_parameters() if p.requires_grad}}


# Logits are sums over a few hundred float32 products per layer; the same weights applied in
# another order (sharded matmuls, W + s·B·A merged before multiplying) differ by a few units of
# float32 rounding (6e-8) of the largest partial sums (|logit| < 4 here): well under 1e-5.
LOGITS_ATOL = 1e-5


@pytest.mark.parametrize("family,adapter,layout", [
    ("llama", "lora", "dp2 zero3"), ("llama", "lora_head", "tp2"), ("llama", "lora", "pp2"),
    ("gpt2", "lora", "tp2")])  # GPT-2: Conv1D bases, q|k|v regrouped, the head tied to the embedding
def test_saved_adapter_and_merged_model_give_the_trained_logits_through_peft_and_transformers(
        cluster2, hf_dirs, tmp_path, family, adapter, layout) -> None:
    base_dir, adapter_out, merged_out = hf_dirs[family], tmp_path / "adapter", tmp_path / "merged"
    trained = _last_stage(cluster2.run(_train_and_save, str(base_dir), family, adapter, layout,
                                       str(adapter_out), str(merged_out)))
    assert sorted(p.name for p in adapter_out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((adapter_out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)
    with torch.no_grad():
        untrained = _base(base_dir)(input_ids=TOKENS, use_cache=False).logits
        reloaded = peft.PeftModel.from_pretrained(_base(base_dir), adapter_out)
        through_peft = reloaded(input_ids=TOKENS, use_cache=False).logits
        merged = _base(merged_out)(input_ids=TOKENS, use_cache=False).logits
    assert (through_peft - untrained).abs().max() > 1e-3  # the adapter is not a no-op
    torch.testing.assert_close(trained, through_peft, rtol=0.0, atol=LOGITS_ATOL)
    torch.testing.assert_close(trained, merged, rtol=0.0, atol=LOGITS_ATOL)
    from safetensors import safe_open
    with safe_open(str(adapter_out / "adapter_model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(peft.get_peft_model_state_dict(reloaded))  # peft's names, nothing else
    trainable = peft.PeftModel.from_pretrained(_base(base_dir), adapter_out, is_trainable=True).get_base_model()
    adapters = {name for name, p in trainable.named_parameters() if p.requires_grad}
    for trainable in (False, True):  # the adapter onto a sharded base, frozen or trainable
        loaded = cluster2.run(_load_adapter, str(base_dir), layout, str(adapter_out), trainable)
        torch.testing.assert_close(_last_stage([r["logits"] for r in loaded]), trained, rtol=0.0, atol=LOGITS_ATOL)
        assert set().union(*(r["trainable"] for r in loaded)) == (adapters if trainable else set())


def _base(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder)


# ---- checkpoints ---------------------------------------------------------------------------------------
def test_checkpoint_of_a_lora_model_loads_under_another_layout(cluster2, tmp_path) -> None:
    """Trained under dp2 zero3, saved (base and adapters, DCP), loaded under tp2 and trained on."""
    results = cluster2.run(engine_run_moved, "dp2 zero3", "tp2", str(tmp_path), LLAMA_LORA, STEPS)
    assert_parity(results, reference_run(LLAMA_LORA, STEPS))


@pytest.mark.parametrize("first,second", [("tp4 2d", "dp2 tp2"), ("dp4 zero3", "tp4 2d")])
def test_checkpoint_of_a_lora_model_moves_to_and_from_a_tensor_grid(cluster4, tmp_path, first, second) -> None:
    """The grid's replicated adapters and split bases load under 1d tp and ZeRO-3, and back."""
    results = cluster4.run(engine_run_moved, first, second, str(tmp_path), "gpt+lora", STEPS)
    assert_parity(results, reference_run("gpt+lora", STEPS))


def _resume_and_relayout(folder: str) -> dict:
    """Engine side: 2 steps, save, 2 steps (the uninterrupted run); a fresh model loads the save and
    takes the same 2 steps; then the live model moves from dp2 zero3 to tp2 and trains on."""
    import torch.distributed as dist

    from colab_par import load, parallelize, save
    from colab_par.training.checkpoint import relayout

    data = training_batches(LLAMA_LORA, 6)
    pm = parallelize(build_model(LLAMA_LORA, SEED + dist.get_rank()), "dp2 zero3", optimizer_fn=_adamw)
    first = [pm.train_step(x, y) for x, y in data[:2]]
    save(pm, folder)
    straight = [pm.train_step(x, y) for x, y in data[2:4]]
    fresh = parallelize(build_model(LLAMA_LORA, SEED + 7), "dp2 zero3", optimizer_fn=_adamw)
    load(fresh, folder)
    resumed = [fresh.train_step(x, y) for x, y in data[2:4]]
    moved = relayout(pm, "tp2")
    later = [moved.train_step(x, y) for x, y in data[4:]]
    trainable = {name for name, p in moved.model.named_parameters() if p.requires_grad}
    return {"losses": first + straight + later, "resumed": resumed, "straight": straight,
            "trainable": trainable, "state": moved.full_state_dict(), "layout": str(moved.layout)}


def test_resume_is_bit_for_bit_and_a_live_relayout_continues_exactly(cluster2, tmp_path) -> None:
    results = cluster2.run(_resume_and_relayout, str(tmp_path / "ckpt"))
    for result in results:
        assert result["resumed"] == result["straight"]  # bit for bit
        assert result["trainable"] == _peft_trainable() and result["layout"] == "tp2"
    assert_parity(results, reference_run(LLAMA_LORA, 6, lr=LR))


# ---- refused before any work ----------------------------------------------------------------------------
def test_a_lora_target_that_matches_nothing_is_refused_naming_what_exists(llama_dir) -> None:
    from colab_par import from_pretrained

    with pytest.raises(ValueError, match=r"qq_proj.*matches no module.*q_proj.*down_proj"):
        from_pretrained(llama_dir, "dp2", lora=peft.LoraConfig(target_modules=["qq_proj"]))


def test_prompt_learning_is_refused_with_the_tuners_that_work(llama_dir) -> None:
    from colab_par import from_pretrained

    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    with pytest.raises(ValueError, match=r"PROMPT_TUNING.*virtual tokens.*LoRA"):
        from_pretrained(llama_dir, "dp2", lora=config)


def test_an_adapter_for_another_base_is_refused_naming_the_tensor(hf_dirs, llama_dir, tmp_path) -> None:
    from colab_par import from_pretrained

    def adapter_of(base: Path, family: str = "llama") -> Path:
        """A LoRA adapter directory peft writes for `base`."""
        saved = base.with_name(f"{base.name}-adapter")
        peft.get_peft_model(_base(base), peft_config("lora", family)).save_pretrained(saved)
        return saved

    saved = adapter_of(_hf_dir(tmp_path / "wider", hidden_size=64))
    with pytest.raises(ValueError, match=r"lora_A.weight is \[4, 64\] there but this base needs \[4, 32\]"):
        from_pretrained(llama_dir, "dp2", adapter=saved)
    saved = adapter_of(_hf_dir(tmp_path / "deeper", num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"layers\.2\..*which this base has no place for"):
        from_pretrained(llama_dir, "dp2", adapter=saved)
    saved = adapter_of(hf_dirs["gpt2"], "gpt2")
    gpt2_base = re.escape(str(hf_dirs["gpt2"]))
    with pytest.raises(ValueError, match=rf"trained for {gpt2_base}, .*transformer\.h\.0\.attn\.c_attn.* "
                                         r"match none of this model's layers; load it onto the base"):
        from_pretrained(llama_dir, "dp2", adapter=saved)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        from_pretrained(llama_dir, "dp2", adapter=llama_dir)


def _parallelize_refused(kind: str, layout: str, targets, **changes) -> str:
    import torch.distributed as dist

    from colab_par import parallelize

    torch.manual_seed(SEED + dist.get_rank())
    base_kind, adapter = kind.split("+")
    model = peft.get_peft_model(build_model(base_kind, None),
                                peft_config(adapter, base_kind, target_modules=targets, **changes))
    try:
        parallelize(model, layout)
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize("kind,targets,named", [
    ("llama+ia3", ["v_proj", "down_proj"], r"splits model\.layers\.0\.self_attn\.v_proj \(IA3"),
    ("llama+dora", ["q_proj"], r"q_proj \(LoRA with DoraLinearVariant\)"),
    ("llama+lora", ["embed_tokens", "q_proj"], r"embed_tokens \(LoRA on an embedding\)")])
def test_an_adapter_tensor_parallel_cannot_split_is_refused_naming_what_works(cluster2, kind, targets, named) -> None:
    for message in cluster2.run(_parallelize_refused, kind, "tp2", targets):
        assert message != "accepted"
        assert re.search(named, message), message
        assert "every adapter type trains under dp, zero1-3, offload and pp" in message


GRID_REFUSALS = [  # what the 2d grid cannot add to its weight pieces: (kind, targets, config changes, error)
    ("gpt+lora", ["tok_embeddings", "wq"], {}, r"tok_embeddings is LoRA on an embedding"),
    ("gpt+dora", ["wq"], {}, r"layers\.0\.attention\.wq is LoRA with DoraLinearVariant"),
    ("gpt+lora", ["wq"], {"lora_dropout": 0.1}, r"lora_dropout=0\.1.*use lora_dropout=0\.0"),
    ("gpt+lora", ["wq"], {"modules_to_save": ["output"]}, r"output, which peft trains whole"),
]


def _grid_refusals() -> list[str]:
    return [_parallelize_refused(kind, "tp4 2d", targets, **changes) for kind, targets, changes, _ in GRID_REFUSALS]


def test_an_adapter_the_tensor_grid_cannot_add_is_refused_naming_what_works(cluster4) -> None:
    for messages in cluster4.run(_grid_refusals):
        for (*_, named), message in zip(GRID_REFUSALS, messages):
            assert re.search(named, message), message
            assert "tp_mode='1d'" in message, message
