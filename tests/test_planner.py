"""The planner against its sources: ZeRO Table 1, the activation terms of Korthikanti et al., a
pipeline timeline simulation, real parameter counts; and the invariants plan() must keep."""
from __future__ import annotations

import datetime
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from colab_par.planning.devices import (CPU_COSTS_FILE, CPU_PROCESS_BYTES, CPU_WRAPPER_COST, DeviceSpec, GiB, cpu_device,
                               device_for_product, load_cpu_costs)
from colab_par.layout import (CHECKPOINTING, CP_MODES, FIELDS, PP_SCHEDULES, PRECISIONS, TP_MODES,
                              ZERO_LEVELS, Layout, LayoutError, default_microbatches)
from colab_par.models.gpt import GPT, GPTConfig
from colab_par.layout.tier_options import MemoryTiers
from colab_par.planning.planner import (DEVICES, ModelSpec, Plan, activation_bytes_per_layer, candidate_layouts,
                               estimate, get_device, measure_cpu_device, model_state_bytes,
                               pipeline_bubble, plan, preferred, search_space)

LLAMA_8B = {"n_layer": 32, "d_model": 4096, "n_head": 32, "n_kv_head": 8, "ffn_hidden": 14336,
            "vocab_size": 128256}
LLAMA_70B = {"n_layer": 80, "d_model": 8192, "n_head": 64, "n_kv_head": 8, "ffn_hidden": 28672,
             "vocab_size": 128256}
SMALL = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=64)

# ZeRO paper (Rajbhandari et al. 2020) Table 1, 7.5B parameters, GB per device as printed, by Nd:
# (ZeRO-1 "P_os", ZeRO-2 "P_os+g", ZeRO-3 "P_os+g+p"); baseline DP is 120 GB for every Nd.
ZERO_TABLE_1 = {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
                64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"),
                1024: ("30.1", "15.1", "0.12")}


def _matches_printed(value: float, printed: str) -> bool:
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(value - float(printed)) <= 0.5 * 10 ** -decimals + 1e-12


@pytest.mark.parametrize("nd", sorted(ZERO_TABLE_1))
def test_zero_paper_table_1(nd: int) -> None:
    assert model_state_bytes(7.5e9, zero=0, dp=nd).total / 1e9 == 120
    for zero, printed in zip((1, 2, 3), ZERO_TABLE_1[nd]):
        predicted = model_state_bytes(7.5e9, zero=zero, dp=nd).total / 1e9
        assert _matches_printed(predicted, printed), (zero, nd, predicted, printed)


def test_fp32_state_is_4_4_8_bytes_and_sgd_has_one_state() -> None:
    state = model_state_bytes(1000, zero=0, dp=1, precision="fp32")
    assert (state.params, state.grads, state.optimizer) == (4000, 4000, 8000)
    assert model_state_bytes(1000, zero=0, dp=1, precision="fp32", optimizer="sgd").optimizer == 4000
    with pytest.raises(ValueError, match="precision 'mixed' or 'fp32'"):
        model_state_bytes(1000, zero=0, dp=1, precision="fp8")


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_offload_moves_sharded_state_to_host(zero: int) -> None:
    kept = model_state_bytes(7.5e9, zero=zero, dp=8)
    moved = model_state_bytes(7.5e9, zero=zero, dp=8, offload=True)
    assert moved.total < kept.total
    assert moved.total + moved.host_total == pytest.approx(kept.total)
    assert moved.optimizer == 0 and moved.host_optimizer == kept.optimizer


def test_offload_on_a_cpu_keeps_the_state_in_the_peak() -> None:
    """A CPU's host memory is its device memory: offload moves nothing out of the peak (it once
    made `plan` call 'dp2 zero3 offload' fitting at a quarter of its real memory)."""
    options = dict(device="cpu", global_batch=2, seq_len=128)
    config = {"n_layer": 24, "d_model": 2048, "n_head": 16, "vocab_size": 8192}
    kept, moved = (estimate(config, text, **options).memory for text in ("dp2 zero3", "dp2 zero3 offload"))
    assert moved.peak == pytest.approx(kept.peak) and moved.host_total == 0
    assert estimate(config, "dp2 zero3 offload", device="A100-80GB", global_batch=2,
                    seq_len=128).memory.host_total > 0


def test_more_sharding_never_more_memory() -> None:
    for precision in ("mixed", "fp32"):
        for dp in (1, 2, 8, 64):
            totals = [model_state_bytes(1e9, zero=z, dp=dp, precision=precision).total for z in range(4)]
            assert totals == sorted(totals, reverse=True)
        for zero in range(4):
            totals = [model_state_bytes(1e9, zero=zero, dp=dp).total for dp in (1, 2, 4, 8, 64)]
            assert totals == sorted(totals, reverse=True)


def test_layout_estimates_shrink_with_sharding_recompute_and_offload() -> None:
    options = dict(device="A100-80GB", global_batch=8, seq_len=4096)

    def total(text: str) -> float:
        return estimate(LLAMA_8B, text, **options).memory.total

    assert total("dp8 bf16") >= total("dp8 zero1 bf16") >= total("dp8 zero2 bf16") >= total("dp8 zero3 bf16")
    # in fp32, zero2 keeps a gathered fp32 copy of every parameter beside its shard from forward to
    # backward (FSDP, reshard_after_forward=False), zero1 whole parameters and DDP's buckets, a
    # float32 copy of every gradient, on top: zero1 holds more (the dry run sees both)
    assert total("dp8 zero1") > total("dp8 zero2") > total("dp8 zero3")
    assert total("dp8 zero3") > total("dp8 zero3 offload")
    # selective keeps the matmul and SDPA outputs (not the norms' and SwiGLU's); full the layer inputs
    assert total("dp8 zero3") > total("dp8 zero3 ac-selective") > total("dp8 zero3 ac-full")
    assert total("dp4 tp2 zero3") > total("dp4 tp2 zero3 sp") > total("dp4 tp4 zero3 sp")
    assert total("dp8 zero3") > total("dp4 cp2 zero3")


# ---- activations: the per-tensor inventory of Korthikanti et al. 2022, section 4 ----------------
def _activation_inventory(s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: str) -> float:
    """Sum the stored tensors one by one: (bytes, inside the tensor-parallel region, attention core)."""
    sbh, as2b = s * b * h, a * s * s * b
    tensors = [
        (2 * sbh, False, False),   # QKV projection input
        (4 * sbh, True, False),    # Q and K for QK^T
        (2 * as2b, True, True),    # softmax output
        (as2b, True, True),        # softmax dropout mask
        (2 * as2b, True, True),    # dropout output (attention over V)
        (2 * sbh, True, False),    # V
        (2 * sbh, True, False),    # output projection input
        (sbh, False, False),       # attention dropout mask
        (2 * sbh, False, False),   # MLP input
        (8 * sbh, True, False),    # GeLU input
        (8 * sbh, True, False),    # GeLU output (second linear's input)
        (sbh, False, False),       # MLP dropout mask
        (4 * sbh, False, False),   # two layer-norm inputs
    ]
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    total = 0.0
    for size, in_tp_region, attention_core in tensors:
        if recompute == "selective" and attention_core:
            continue
        total += size / t if (in_tp_region or sp) else size
    return total


@pytest.mark.parametrize("s,b,h,a", [(2048, 1, 12288, 96), (4096, 2, 4096, 32), (64, 3, 64, 4)])
@pytest.mark.parametrize("t,sp", [(1, False), (8, False), (8, True), (4, True)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_formula_matches_tensor_inventory(s, b, h, a, t, sp, recompute) -> None:
    predicted = activation_bytes_per_layer(s, b, h, a, tp=t, sp=sp, recompute=recompute)
    assert predicted == pytest.approx(_activation_inventory(s, b, h, a, t, sp, recompute), rel=1e-12)
    assert activation_bytes_per_layer(s, b, h, a, tp=t, sp=sp, recompute=recompute,
                                      dtype_bytes=4) == pytest.approx(2 * predicted, rel=1e-12)


def test_activation_formula_paper_example() -> None:
    """GPT-3 175B layer (s=2048, h=12288, a=96, t=8): the paper's 5as/h = 80 versus 34."""
    s, b, h, a = 2048, 1, 12288, 96
    assert activation_bytes_per_layer(s, b, h, a) == s * b * h * (34 + 80)
    assert activation_bytes_per_layer(s, b, h, a, tp=8, sp=True, recompute="selective") == s * b * h * 34 / 8
    with pytest.raises(ValueError, match="'none', 'selective' or 'full'"):
        activation_bytes_per_layer(s, b, h, a, recompute="some")


# ---- pipeline bubble against a timeline simulation ------------------------------------------------
def _simulated_bubble(p: int, m: int, schedule: str) -> float:
    """List-schedule unit-time forward/backward ops on p stages; bubble = idle share of the makespan."""
    orders = []
    for stage in range(p):
        if schedule == "gpipe":
            order = [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
        else:  # 1F1B: warm-up forwards, then alternate, then drain backwards
            warm = min(p - stage - 1, m)
            order = [("F", j) for j in range(warm)]
            for j in range(m - warm):
                order += [("F", warm + j), ("B", j)]
            order += [("B", j) for j in range(m - warm, m)]
        orders.append(order)
    done: dict[tuple[str, int, int], float] = {}
    clock, position = [0.0] * p, [0] * p
    while any(position[i] < len(orders[i]) for i in range(p)):
        for stage in range(p):
            while position[stage] < len(orders[stage]):
                kind, j = orders[stage][position[stage]]
                dependency = (("F", stage - 1, j) if kind == "F" and stage > 0 else
                              ("B", stage + 1, j) if kind == "B" and stage < p - 1 else
                              ("F", stage, j) if kind == "B" else None)
                if dependency is not None and dependency not in done:
                    break
                start = max(clock[stage], done.get(dependency, 0.0))
                clock[stage] = done[(kind, stage, j)] = start + 1.0
                position[stage] += 1
    makespan = max(clock)
    return 1 - 2 * m / makespan


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (8, 32)])
def test_pipeline_bubble_matches_simulation(schedule: str, p: int, m: int) -> None:
    assert pipeline_bubble(p, m, schedule) == pytest.approx(_simulated_bubble(p, m, schedule), rel=1e-12)


def test_interleaved_bubble_is_v_times_smaller_in_microbatch_units() -> None:
    assert pipeline_bubble(4, 8, "interleaved", 2) == pytest.approx(3 / (16 + 3))
    assert pipeline_bubble(4, 8, "zbv", 2) < pipeline_bubble(4, 8, "interleaved", 2)
    assert pipeline_bubble(1, 8) == 0.0


# ---- model sizes -----------------------------------------------------------------------------------
def test_parameter_count_matches_the_reference_gpt() -> None:
    for config in (SMALL, GPTConfig(vocab_size=100, n_layer=3, n_head=4, n_kv_head=2, d_model=32,
                                    ffn_hidden=48)):
        real = sum(p.numel() for p in GPT(config).parameters())
        assert ModelSpec.of(config).n_params == real
        assert ModelSpec.of(GPT(config)).n_params == real


def test_parameter_count_matches_a_hugging_face_llama() -> None:
    transformers = pytest.importorskip("transformers")
    for tied in (False, True):
        config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, tie_word_embeddings=tied)
        real = transformers.LlamaForCausalLM(config).num_parameters()
        assert ModelSpec.of(config).n_params == real


def test_model_sizes_missing_are_named() -> None:
    with pytest.raises(ValueError, match="model sizes d_model, vocab_size are missing"):
        ModelSpec.of({"n_layer": 2, "n_head": 2})


def test_published_8b_and_70b_sizes() -> None:
    assert ModelSpec.of(LLAMA_8B).n_params / 1e9 == pytest.approx(8.03, abs=0.01)
    assert ModelSpec.of(LLAMA_70B).n_params / 1e9 == pytest.approx(70.55, abs=0.01)


# ---- devices -----------------------------------------------------------------------------------------
def test_device_catalogue_and_errors() -> None:
    assert get_device("h100") is DEVICES["H100-80GB"]
    assert not DEVICES["T4"].bf16 and DEVICES["A100-40GB"].bf16
    with pytest.raises(ValueError, match="device 'tpu' is not in the device catalogue; choose one of H100-80GB"):
        get_device("tpu")


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "NVIDIA H800"])
def test_a_gpu_the_catalogue_lacks_is_refused_not_planned_as_another(name: str) -> None:
    """"cuda" (a device type, no product) and an unlisted product are never priced as an H100."""
    for ask in (lambda: get_device(name), lambda: plan(SMALL, 2, device=name, global_batch=4, seq_len=64)):
        with pytest.raises(ValueError, match=rf"device '{name}' is .*; choose one of H100-80GB, .*T4 or 'cpu'.*"
                                             r"describe the GPU with a DeviceSpec\(name, memory"):
            ask()


def test_bf16_follows_the_device_spec_not_its_name() -> None:
    """A DeviceSpec decides bf16 by its peaks: a "T4"-named card with bf16 plans bf16 layouts, an
    "H100"-named one without it is refused bf16 and planned in fp32."""
    h100 = DEVICES["H100-80GB"]
    with_bf16 = DeviceSpec("Tesla T4 (rebadged)", h100.memory, dict(h100.peak_flops), h100.hbm_bandwidth,
                           h100.intra_bandwidth, h100.inter_bandwidth, h100.host_bandwidth)
    without = DeviceSpec("H100-like", h100.memory, {"fp32": 67e12}, h100.hbm_bandwidth, h100.intra_bandwidth,
                         h100.inter_bandwidth, h100.host_bandwidth)
    assert Layout(precision="bf16").validate(1, device=with_bf16).precision == "bf16"
    assert {p.layout.precision for p in plan(SMALL, 2, device=with_bf16, global_batch=4, seq_len=64)} == {"bf16"}
    with pytest.raises(LayoutError, match=r"H100-like has none \(its DeviceSpec lists peaks for fp32 only\)"):
        Layout(precision="bf16").validate(1, device=without)
    with pytest.raises(LayoutError, match="H100-like has none"):
        estimate(SMALL, "dp2 bf16", device=without, global_batch=4, seq_len=64)
    assert {p.layout.precision for p in plan(SMALL, 2, device=without, global_batch=4, seq_len=64)} == {"fp32"}
    # a CPU runs bf16 whatever its ISA (torch emulates it), priced at its fp32 peak
    cpu = DeviceSpec("CPU", h100.memory, {"fp32": 1e11}, 1e10, 1e10, 1e10, 1e10, kind="cpu")
    assert Layout(precision="bf16").validate(1, device=cpu).precision == "bf16"
    assert estimate(SMALL, "dp2 bf16", device=cpu, global_batch=4, seq_len=64).layout.precision == "bf16"


# torch.cuda.get_device_name() of real cards (as they appear in nvidia-smi output and bug reports),
# the catalogue entry each must find, and its dense BF16 peak: the datasheet's "with sparsity"
# figure halved, or its dense figure where it lists one (A100, L40S). None: bf16 not supported.
REAL_PRODUCTS = {
    "NVIDIA H100 80GB HBM3": ("H100-80GB", 1979e12 / 2), "NVIDIA H100 PCIe": ("H100-PCIe", 1513e12 / 2),
    "NVIDIA H100 NVL": ("H100-NVL", 1671e12 / 2), "NVIDIA H200": ("H200", 1979e12 / 2),
    "NVIDIA H200 NVL": ("H200-NVL", 1671e12 / 2),
    "NVIDIA A100-SXM4-40GB": ("A100-40GB", 312e12), "NVIDIA A100-SXM4-80GB": ("A100-80GB", 312e12),
    "NVIDIA A100-PCIE-40GB": ("A100-PCIe-40GB", 312e12),
    "NVIDIA A100 80GB PCIe": ("A100-PCIe-80GB", 312e12),
    "NVIDIA L4": ("L4", 242e12 / 2), "NVIDIA L40S": ("L40S", 362.05e12), "Tesla T4": ("T4", None),
}
# Names that share a fragment with a catalogue entry but are other products (or a slice of one):
# each must be unknown, so MFU is left out instead of computed against the wrong peak.
CONFUSABLE = ["NVIDIA L40", "NVIDIA A10", "NVIDIA A10G", "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
              "NVIDIA H100", "NVIDIA H800", "NVIDIA A800-SXM4-80GB", "NVIDIA GH200 480GB", "NVIDIA H20",
              "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090", "NVIDIA RTX A6000", "NVIDIA L4 (virtual)"]


@pytest.mark.parametrize("product", REAL_PRODUCTS)
def test_a_gpu_is_found_by_its_exact_product_name(product: str) -> None:
    entry, bf16 = REAL_PRODUCTS[product]
    device = device_for_product(product)
    assert device is DEVICES[entry] and get_device(product) is device
    assert device.peak_flops.get("bf16") == (pytest.approx(bf16) if bf16 else None)
    assert device_for_product(f" {product}\n") is device  # surrounding whitespace only


@pytest.mark.parametrize("product", CONFUSABLE)
def test_a_confusable_or_unknown_gpu_is_unknown(product: str) -> None:
    assert device_for_product(product) is None


def test_confusable_pairs_get_their_own_peaks() -> None:
    """The substring matches the old lookup made: L4 inside L40S, an SXM H100 for a PCIe one."""
    l4, l40s = device_for_product("NVIDIA L4"), device_for_product("NVIDIA L40S")
    assert l40s.peak_flops["bf16"] > 2.5 * l4.peak_flops["bf16"] and l40s.memory == 2 * l4.memory
    pcie, sxm = device_for_product("NVIDIA H100 PCIe"), device_for_product("NVIDIA H100 80GB HBM3")
    assert pcie.peak_flops["bf16"] < 0.8 * sxm.peak_flops["bf16"] and pcie.hbm_bandwidth < sxm.hbm_bandwidth


def test_measured_cpu_device_is_cached_and_shared_between_engines() -> None:
    one, four = measure_cpu_device(1), measure_cpu_device(4)
    assert measure_cpu_device(1) is one
    assert one.peak_flops["fp32"] > 1e8 and not one.bf16
    assert four.peak_flops["fp32"] < one.peak_flops["fp32"] and four.memory < one.memory
    # AdamW's state rate, measured (no constant): four engines on two cores get half each
    assert one.hbm_bandwidth > 1e8 and four.hbm_bandwidth == pytest.approx(one.hbm_bandwidth / 2)


# ---- CPU costs measured with a process group (benchmarks/cpu_costs.py) -------------------------------
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_planners_cpu_costs_are_the_measured_files() -> None:
    shipped = json.loads(CPU_COSTS_FILE.read_text())
    assert shipped["script"] == "python benchmarks/cpu_costs.py"
    assert shipped["machine"] and shipped["measured"]
    assert CPU_WRAPPER_COST == shipped["wrapper_cost"] and CPU_PROCESS_BYTES == shipped["process_bytes"]
    cpu = cpu_device(4, cores=2, peak_flops=1e10, efficiency=0.5, layer_overhead=1e-3, bandwidth=1e9,
                     latency=1e-5, state_bandwidth=1e10)
    per_pass = 1e-3 / 0.5  # two engines per core: each pass takes twice as long
    expected = {k: v * per_pass for k, v in shipped["wrapper_cost"].items()}
    assert cpu.wrapper_overhead == pytest.approx(expected)
    assert cpu.process_memory == shipped["process_bytes"]
    # collectives measured with one engine per core; four engines on two cores get half each
    assert cpu.collective_bandwidth == pytest.approx({k: v / 2 for k, v in shipped["collective_bandwidth"].items()})
    assert cpu.overlap == shipped["overlap"]
    tp = estimate(SMALL, "tp2", device=cpu, global_batch=4, seq_len=64)
    dp = estimate(SMALL, "dp2", device=cpu, global_batch=4, seq_len=64)
    assert tp.memory.baseline == dp.memory.baseline == shipped["process_bytes"]


def test_data_parallel_traffic_runs_at_each_collectives_measured_rate() -> None:
    """gloo moves an all-gather's, a reduce-scatter's and an all-reduce's bus bytes at different
    rates; the data-parallel time takes each at its own. Per parameter P in float32 over dp2: zero3
    gathers twice (2 · 4 · 1/2 bytes) and reduce-scatters once (4 · 1/2), DDP all-reduces 2 · 4 · 1/2."""
    from dataclasses import replace

    link = DeviceSpec("test", 1e15, {"fp32": 1e15}, 1e15, 1e9, 1e9, 1e9, latency=0.0, efficiency=1.0,
                      half_tokens=0, overlap=0.0, layer_overhead=0.0)
    rated = replace(link, collective_bandwidth={"all_gather": 0.5e9, "reduce_scatter": 0.25e9, "all_reduce": 2e9})
    config = dict(vocab_size=8192, n_layer=4, d_model=1024, n_head=8)
    zero3 = [estimate(config, "dp2 zero3", device=d, global_batch=2, seq_len=128).times["dp"] for d in (link, rated)]
    assert zero3[1] / zero3[0] == pytest.approx((4 / 0.5 + 2 / 0.25) / (4 + 2))
    ddp = [estimate(config, "dp2", device=d, global_batch=2, seq_len=128).times["dp"] for d in (link, rated)]
    assert ddp[1] / ddp[0] == pytest.approx(1 / 2)


@pytest.mark.slow
def test_the_cpu_costs_benchmark_regenerates_the_file(tmp_path) -> None:
    import torch

    out = tmp_path / "cpu_costs.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "cpu_costs.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(out.read_text()).keys() == json.loads(CPU_COSTS_FILE.read_text()).keys()
    fresh = load_cpu_costs(out)
    assert fresh.wrapper_cost.keys() == CPU_WRAPPER_COST.keys() == {"tp", "fsdp", "cp"}
    assert all(cost > 0 for cost in fresh.wrapper_cost.values()), fresh.wrapper_cost
    assert 64 * 2 ** 20 < fresh.process_bytes < 4 * GiB
    assert fresh.measured == datetime.date.today().isoformat() and fresh.torch == torch.__version__
    assert fresh.engines == 2


# ---- estimate and plan -------------------------------------------------------------------------------
def test_estimate_rejects_impossible_layouts_with_the_rule() -> None:
    with pytest.raises(LayoutError, match="tp=3 does not divide 32 heads"):
        estimate(LLAMA_8B, "tp3", device="H100", global_batch=3, seq_len=1024)


def test_estimate_times_and_mfu_are_consistent() -> None:
    option = estimate(LLAMA_8B, "dp8 zero3 bf16 ac-selective", device="H100", global_batch=8,
                      seq_len=8192)
    assert option.step_time == pytest.approx(sum(option.times.values()))
    assert option.tokens_per_s == pytest.approx(8 * 8192 / option.step_time)
    assert 0 < option.mfu < DEVICES["H100-80GB"].efficiency
    one_node = estimate(LLAMA_8B, "dp16 zero3 bf16 ac-selective", device="H100", global_batch=16,
                        seq_len=8192, gpus_per_node=16)
    assert one_node.step_time == pytest.approx(option.step_time, rel=0.05)  # weak scaling
    two_nodes = estimate(LLAMA_8B, "dp16 zero3 bf16 ac-selective", device="H100", global_batch=16,
                         seq_len=8192, gpus_per_node=8)
    assert two_nodes.times["dp"] > one_node.times["dp"]  # the gathers cross the slower network


def test_plan_lists_only_valid_layouts_best_first() -> None:
    plans = plan(LLAMA_8B, 16, device="H100", global_batch=32, seq_len=4096, top=None)
    assert len(plans) > 10 and all(isinstance(p, Plan) for p in plans)
    for option in plans:
        option.layout.validate(16, {**LLAMA_8B, "seq_len": 4096}, device="H100-80GB", global_batch=32)
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True) and fits[0]
    fitting = [p.step_time for p in plans if p.fits]
    assert fitting == sorted(fitting)
    assert plans[0].memory.total <= plans[0].capacity


def test_plan_on_a_t4_never_uses_bf16_and_may_not_fit() -> None:
    plans = plan(LLAMA_8B, 1, device="T4", global_batch=1, seq_len=2048)
    assert all(p.layout.precision == "fp32" for p in plans)
    assert not plans[0].fits
    assert plan(SMALL, 1, device="T4", global_batch=4, seq_len=64)[0].fits


def test_plan_accepts_configs_and_explains_impossible_batches() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=22, num_attention_heads=32,
                                      num_key_value_heads=4)
    plans = plan(config, 8, device="A100-40GB", global_batch=16, seq_len=2048, top=None)
    assert plans[0].fits
    assert all(p.layout.cp == 1 and not p.layout.sequence_parallel for p in plans)  # no HF plan
    assert plan(SMALL, 2, device="cpu", global_batch=4, seq_len=64)[0].layout.world_size == 2
    with pytest.raises(LayoutError, match="no valid layout .* global_batch=3"):
        plan({"n_layer": 3, "d_model": 64, "n_head": 1, "vocab_size": 10}, 4, device="cpu",
             global_batch=3, seq_len=63)


# ---- candidates: exactly what layout.py accepts ----------------------------------------------------
def _accepted_in_search_space(spec: ModelSpec, world: int, global_batch: int, seq_len: int,
                              bf16: bool, device: str) -> set[Layout]:
    """Brute force: every combination of field values, kept when the planner's search space offers
    each value and `validate` accepts the layout."""
    space = search_space(global_batch, bf16=bf16, n_experts=spec.n_experts)
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    domains = {**{name: divisors for name in ("dp", "tp", "pp", "cp")},
               "ep": divisors if spec.n_experts else (1,),  # a dense model: validate refuses any other
               "zero": ZERO_LEVELS, "sequence_parallel": (False, True), "cp_mode": CP_MODES,
               "tp_mode": TP_MODES, "tp_depth": (1, 2), "pp_schedule": PP_SCHEDULES, "virtual_stages": (1, 2, 3),
               "microbatches": range(1, global_batch + 1), "offload": (False, True),
               "precision": PRECISIONS, "checkpointing": CHECKPOINTING, "compile": (False, True),
               "tiers": (MemoryTiers(),)}
    assert set(domains) == set(FIELDS)
    # a fixed choice narrows the product at once; a choice that depends on other fields is checked
    grid = {name: [v for v in domain if callable(space.get(name)) or name not in space
                   or v in space[name]] for name, domain in domains.items()}
    kept = set()
    for values in itertools.product(*grid.values()):
        fields = SimpleNamespace(**dict(zip(grid, values)))
        if not all(getattr(fields, name) in [default_microbatches(fields.pp)
                                             if v is None else v for v in choice(fields)]
                   for name, choice in space.items() if callable(choice)):
            continue
        layout = Layout(**vars(fields))
        try:
            layout.validate(world, spec.config(seq_len), device=device, global_batch=global_batch)
        except LayoutError:
            continue
        kept.add(layout)
    return kept


@pytest.mark.parametrize("world,global_batch,device,experts", [(4, 8, "A100-80GB", 0), (6, 6, "T4", 0),
                                                               (4, 8, "A100-80GB", 4)])
def test_candidates_are_exactly_the_layouts_layout_py_accepts(world: int, global_batch: int,
                                                              device: str, experts: int) -> None:
    """`experts`: the kit's MoE GPT, whose candidates add ep (dp and zero only, so no dp x tp)."""
    spec = ModelSpec.of({"n_layer": 6, "d_model": 64, "n_head": 6, "n_kv_head": 2, "ffn_hidden": 96,
                         "vocab_size": 100, "n_experts": experts, "top_k": 2})
    bf16 = DEVICES[get_device(device, world).name].bf16
    accepted = _accepted_in_search_space(spec, world, global_batch, 12, bf16, device)
    candidates = candidate_layouts(spec, world, global_batch=global_batch, seq_len=12, bf16=bf16,
                                   device=device)
    assert len(candidates) == len(set(candidates))
    assert set(candidates) == set(preferred(accepted))
    if experts:
        assert {c.ep for c in candidates} == {1, 2, 4}
    else:
        assert any(c.dp > 1 and c.tp > 1 and c.zero == 0 for c in candidates)  # DP x TP is offered


def test_preferred_drops_only_dominated_twins() -> None:
    sp, no_sp = Layout.parse("tp2 sp"), Layout.parse("tp2")
    assert preferred([sp, no_sp]) == [sp]
    assert preferred([no_sp]) == [no_sp]  # where SP is not valid, tp without it stays
    zbv, one, gpipe = (Layout.parse(t) for t in ("pp2 zbv v2", "pp2 1f1b", "pp2 gpipe mb2"))
    assert preferred([gpipe, one, zbv]) == [zbv]
    assert preferred([gpipe, one]) == [one]
    assert preferred([Layout.parse("pp2 gpipe mb1")]) == [Layout.parse("pp2 gpipe mb1")]


def test_plan_4096_gpus_in_under_a_second() -> None:
    best = min(_timed(lambda: plan(LLAMA_70B, 4096, device="H100", global_batch=2048, seq_len=8192))
               for _ in range(2))
    assert best < 1.0


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@pytest.mark.parametrize("text", ["pp2 1f1b mb2", "pp4 1f1b mb4", "pp2 interleaved mb2 v2",
                                  "pp2 zbv mb2 v2", "pp4 gpipe mb4"])
def test_fullest_pipeline_rank_matches_the_real_stage_split(text: str) -> None:
    """Parameters of the fullest rank against the stage modules `parallelize` really builds."""
    from colab_par.parallel.pipeline import split_model

    config = GPTConfig(vocab_size=256, seq_len=64, n_layer=8, n_head=4, d_model=64)
    layout = Layout.parse(text)
    real = max(sum(p.numel() for part in split_model(GPT(config), layout, rank) for p in part.parameters())
               for rank in range(layout.pp))
    option = estimate(config, layout, device="A100-80GB", global_batch=8, seq_len=64)
    assert option.resting.params == 4 * real  # fp32 bytes
