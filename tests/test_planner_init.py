"""The planner counts the peak of building the model, not only of training it: parameter counts and
the largest tensor come from real models built on the meta device (independent of the planner's
size arithmetic), and neither `plan()` nor the picker offers a layout that cannot be built."""
from __future__ import annotations

import pytest
import torch

from colab_par.models.gpt import GPT, GPTConfig
from colab_par.planning.planner import (CPU_PROCESS_BYTES, DEVICES, GiB, DeviceSpec, cpu_device, estimate,
                               init_peak_bytes, plan)
from colab_par.notebook.picker import LayoutPicker

LLAMA_70B = dict(n_layer=80, d_model=8192, n_head=64, n_kv_head=8, ffn_hidden=28672, vocab_size=128256)
# a vocabulary so large that its embedding dwarfs the layers: its largest tensor sets the init peak
WIDE_VOCAB = GPTConfig(vocab_size=1 << 20, seq_len=16, n_layer=2, n_head=8, d_model=256)
CPU = cpu_device(2, cores=2, peak_flops=1e10, efficiency=0.5, layer_overhead=1e-4, bandwidth=1e9,
                 latency=1e-5, state_bandwidth=1e10)


def _counts(config: GPTConfig) -> tuple[int, int]:
    """(parameters, elements of the largest parameter) of the real model, built on meta."""
    with torch.device("meta"):
        model = GPT(config)
    return sum(p.numel() for p in model.parameters()), max(p.numel() for p in model.parameters())


def _llama_counts() -> tuple[int, int]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=LLAMA_70B["vocab_size"], hidden_size=LLAMA_70B["d_model"],
        intermediate_size=LLAMA_70B["ffn_hidden"], num_hidden_layers=LLAMA_70B["n_layer"],
        num_attention_heads=LLAMA_70B["n_head"], num_key_value_heads=LLAMA_70B["n_kv_head"])
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return sum(p.numel() for p in model.parameters()), max(p.numel() for p in model.parameters())


def test_init_modes_follow_their_formulas() -> None:
    sizes = dict(model_params=1000, local_params=100, largest_tensor=30, block_params=20)
    assert init_peak_bytes("meta", **sizes) == (100 + 2 * 30) * 4
    assert init_peak_bytes("full", **sizes) == (1000 + 30) * 4
    assert init_peak_bytes("pretrained", **sizes) == (100 + 20) * 4
    with pytest.raises(ValueError, match="init='lazy'.*'meta'.*'full'.*'pretrained'"):
        init_peak_bytes("lazy", **sizes)


def test_meta_init_of_a_model_whose_largest_tensor_dominates() -> None:
    """tp8 splits every matrix, but materialising still computes each full tensor on the CPU: the
    1 Mi × 256 embedding (twice: record + materialise) sets the peak, above training's."""
    params, largest = _counts(WIDE_VOCAB)
    assert largest == WIDE_VOCAB.vocab_size * WIDE_VOCAB.d_model
    option = estimate(WIDE_VOCAB, "tp8 sp", device="A100-80GB", global_batch=8, seq_len=8)
    norms = (2 * WIDE_VOCAB.n_layer + 1) * WIDE_VOCAB.d_model  # replicated on every tp rank
    local = (params - norms) / 8 + norms
    assert option.memory.init == pytest.approx((local + 2 * largest) * 4)
    assert option.limit == "init" and option.memory.init > option.memory.total
    # a device holding the training peak but not the build: the plan must not fit
    between = DeviceSpec("between", (option.memory.total + option.memory.init) / 2 / 0.9,
                         {"fp32": 1e13}, 1e12, 1e11, 1e10, 1e10)
    assert not estimate(WIDE_VOCAB, "tp8 sp", device=between, global_batch=8, seq_len=8).fits


def test_full_build_is_refused_where_meta_fits() -> None:
    """Llama 3 70B on 8 H100: every rank building the whole model needs 280 GB before sharding;
    built on meta, some layouts fit."""
    params, largest = _llama_counts()
    options = dict(device="H100", global_batch=16, seq_len=4096, top=None)
    full = plan(LLAMA_70B, 8, init="full", **options)
    capacity = 0.9 * DEVICES["H100-80GB"].memory
    for option in full:
        assert option.memory.init == pytest.approx((params + largest) * 4, rel=1e-9)
        assert not option.fits and option.memory.peak > capacity
    meta = plan(LLAMA_70B, 8, init="meta", **options)
    fitting = [option for option in meta if option.fits]
    assert fitting and all(option.memory.peak <= capacity for option in fitting)
    assert all(option.memory.init < (params + largest) * 4 / 4 for option in fitting)  # shards only


# capacity 2.6 GiB: the wide-vocabulary model trains in it under heavy tensor parallelism, built on
# meta (peak 2.25 GiB), but not when every rank first builds all of it (3 GiB); 8-token sequences keep the
# loss's token x vocabulary tensors (3 x 64 x 1 Mi x 4 bytes) under the build's peak
SMALL_DEVICE = DeviceSpec("small", 2.6 * GiB / 0.9, {"fp32": 1e13}, 1e12, 1e11, 1e10, 1e10)


def test_plan_never_calls_fitting_what_cannot_be_built() -> None:
    params, largest = _counts(WIDE_VOCAB)
    options = dict(device=SMALL_DEVICE, global_batch=8, seq_len=8, top=None)
    full = plan(WIDE_VOCAB, 8, init="full", **options)
    assert not any(p.fits for p in full)
    assert all(p.memory.init == pytest.approx((params + largest) * 4) for p in full)
    trainable = [p for p in full if p.memory.total <= p.capacity]
    assert trainable and all(p.limit == "init" for p in trainable)
    def degrees(layout):  # plan() adds recompute / offload until a layout fits, else keeps the last
        return layout.replace(checkpointing="none", offload=False)

    meta = {degrees(p.layout): p for p in plan(WIDE_VOCAB, 8, init="meta", **options)}
    assert all(meta[degrees(p.layout)].fits for p in trainable)
    for option in [*full, *meta.values()]:
        assert option.fits == (option.memory.baseline + max(option.memory.init, option.memory.total)
                               <= option.capacity)


def test_picker_hides_plans_that_cannot_be_built() -> None:
    full = LayoutPicker(8, model=LLAMA_70B, device="H100", global_batch=16, seq_len=4096, init="full")
    assert full.plans == []
    assert "no layout fits" in full._table_html.value and "meta device" in full._table_html.value
    before = full._current()
    full.auto()
    assert full._current() == before and full.message.startswith("✗ no layout fits")
    full.apply("dp8 zero3 bf16 ac-full")
    assert "before training" in full.message and "meta device" in full.message

    meta = LayoutPicker(8, model=LLAMA_70B, device="H100", global_batch=16, seq_len=4096)
    assert meta.plans and all(p.fits for p in meta.plans)
    meta.auto()
    assert meta.estimate.fits and meta.estimate.memory.peak <= meta.estimate.capacity

    built_whole = LayoutPicker(8, model=WIDE_VOCAB, device=SMALL_DEVICE, global_batch=8, seq_len=8,
                               init="full", top=50)
    on_meta = LayoutPicker(8, model=WIDE_VOCAB, device=SMALL_DEVICE, global_batch=8, seq_len=8, top=50)
    assert built_whole.plans == [] and "<code>tp8 sp</code>" in on_meta._table_html.value
    with pytest.raises(ValueError, match="init='eager'"):
        LayoutPicker(8, model=WIDE_VOCAB, device=SMALL_DEVICE, global_batch=8, seq_len=8, init="eager")


def test_cpu_engines_count_their_process_and_the_fsdp_root() -> None:
    """On CPU engines the peak includes the process baseline. With few activations the fullest
    instant of a zero3 step is the root unit's reduce-scatter at the end of backward: every
    gradient shard, the root (embedding, head, final norm) gathered, its gradients in two copies."""
    config = GPTConfig(vocab_size=32000, seq_len=128, n_layer=8, n_head=8, d_model=1024)
    params, largest = _counts(config)
    option = estimate(config, "dp2 zero3", device=CPU, global_batch=2, seq_len=128)
    assert option.memory.baseline == CPU_PROCESS_BYTES
    root = 2 * config.vocab_size * config.d_model + config.d_model
    layer = (params - root) / config.n_layer
    assert option.memory.phase == "backward end" and option.memory.activations == 0
    assert option.memory.params == pytest.approx(params / 2 * 4 + root * 4)
    assert option.memory.grads == pytest.approx(params / 2 * 4) and root > layer
    assert option.memory.buffers == pytest.approx(2 * root * 4)
    assert option.memory.init == pytest.approx((params / 2 + 2 * largest) * 4)
    assert option.memory.peak == pytest.approx(CPU_PROCESS_BYTES + option.memory.total)


def test_tiers_bf16_working_shards_build_narrow_and_a_budget_holds_the_build() -> None:
    """bf16 with the optimizer pinned off the device materialises bf16 shards (2 bytes kept per
    parameter, fp32 temporaries as before); a budget below the build peak does not fit."""
    sizes = dict(model_params=1000, local_params=100, largest_tensor=30, block_params=20)
    assert init_peak_bytes("meta", **sizes, shard_bytes=2) == 100 * 2 + 2 * 30 * 4
    assert init_peak_bytes("pretrained", **sizes, shard_bytes=2) == 100 * 2 + 20 * 4
    config = dict(n_layer=8, d_model=1024, n_head=8, vocab_size=8192)
    options = dict(device=CPU, global_batch=2, seq_len=128)
    plain, narrow = (estimate(config, text, **options) for text in ("dp2 zero3 bf16", "dp2 zero3 bf16 optimizer@disk"))
    local = plain.memory.init - narrow.memory.init
    assert local == pytest.approx(estimate(config, "dp2 zero3", **options).resting.params / 2)
    roomy = estimate(config, "dp2 zero3 bf16 optimizer@disk mem64GiB", **options)
    tight = estimate(config, f"dp2 zero3 bf16 optimizer@disk mem{int(narrow.memory.init * 0.9)}", **options)
    assert roomy.fits and not tight.fits
