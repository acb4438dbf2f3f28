"""The memory-tier model against hand-computed cases of the runtime's contract (placement under a
budget, bytes moved per step, exposed seconds), the bytes of a concrete GPT under a layout with
tiers, the measured rates file, and the largest model a budget trains."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from colab_par.planning.largest_model import gpt_ladder, largest_model, largest_under_budget
from colab_par.models.gpt import GPT, GPTConfig
from colab_par.planning.planner import estimate
from colab_par.planning.tier_costs import (HEAP_COSTS, HOST_HEAP_FILE, TIER_COSTS_FILE, HeapCosts, TierRates,
                                  HostShare, disk_free_bytes, load_heap_costs, load_tier_rates, place_state,
                                  tier_plan)
from colab_par.layout.tier_options import SLACK, MemoryTiers

STATE = {"params": 100.0, "grads": 100.0, "optimizer": 400.0}
RATES = TierRates(disk_read=100.0, disk_write=50.0, host_device=20.0, host_adam=8.0, chunk_bytes=10,
                  threads=1, measured="test", machine="test")


def test_auto_kinds_fill_the_budget_in_order_and_reserve_two_chunks_per_streamed_kind() -> None:
    # budget 480, filled to 15/16 of it (450, as the runtime fills it), working 100: params and grads
    # stay (200), the optimizer streams, so its two chunks (20) are reserved: 450 - 100 - 200 - 20 =
    # 130 of it stays, 270 go to disk
    plan = place_state(STATE, MemoryTiers(budget=480, disk="tmp"), 100.0, one_memory=True, chunk_bytes=10)
    assert plan.fits, plan.reason
    assert dict(plan.device) == {"params": 100.0, "grads": 100.0, "optimizer": 130.0}
    assert dict(plan.disk) == {"params": 0.0, "grads": 0.0, "optimizer": 270.0}
    assert plan.streaming == 20.0
    assert plan.device_total == 450.0  # the budget covers state, working memory and buffers, less SLACK


def test_a_streamed_optimizer_chunk_reserves_each_of_its_arrays() -> None:
    """The runtime streams a chunk's moments (and a bf16 layout's float32 master) together: two
    chunks of three arrays each, as its own check before training counts them."""
    plan = place_state(STATE, MemoryTiers(optimizer="disk"), 100.0, one_memory=True, chunk_bytes=10,
                       optimizer_arrays=3)
    assert plan.streaming == 2 * 3 * 10


def test_everything_fitting_stays_on_the_device_without_buffers() -> None:
    plan = place_state(STATE, MemoryTiers(budget=10_000, disk="tmp"), 100.0, one_memory=True, chunk_bytes=10)
    assert dict(plan.device) == STATE and plan.streaming == 0 and not any(plan.disk.values())


def test_pinned_kinds_go_where_pinned_and_stream() -> None:
    tiers = MemoryTiers(grads="disk", optimizer="disk")
    plan = place_state(STATE, tiers, 100.0, one_memory=True, chunk_bytes=10)
    assert dict(plan.device) == {"params": 100.0, "grads": 0.0, "optimizer": 0.0}
    assert dict(plan.disk) == {"params": 0.0, "grads": 100.0, "optimizer": 400.0}
    assert plan.streaming == 40.0


def test_host_is_the_device_on_one_memory_and_its_own_tier_on_cuda() -> None:
    tiers = MemoryTiers(budget=480, disk="tmp")
    cuda = place_state(STATE, tiers, 100.0, one_memory=False, chunk_bytes=10, host_capacity=200.0)
    assert dict(cuda.host) == {"params": 0.0, "grads": 0.0, "optimizer": 200.0}  # host first, then disk
    assert cuda.disk["optimizer"] == 70.0
    pinned = place_state(STATE, MemoryTiers(optimizer="host"), 100.0, one_memory=True, chunk_bytes=10)
    assert pinned.device["optimizer"] == 400.0 and pinned.streaming == 0


def test_no_room_says_why_and_what_to_do() -> None:
    without_disk = place_state(STATE, MemoryTiers(budget=450), 100.0, one_memory=True, chunk_bytes=10)
    assert not without_disk.fits and "add a disk tier" in without_disk.reason
    full_disk = place_state(STATE, MemoryTiers(budget=450, disk="tmp"), 100.0, one_memory=True, chunk_bytes=10,
                            disk_capacity=100.0)
    assert not full_disk.fits and "free space" in full_disk.reason
    working = place_state(STATE, MemoryTiers(budget=90, disk="tmp"), 100.0, one_memory=True, chunk_bytes=10)
    assert not working.fits and "working memory" in working.reason
    pinned = place_state(STATE, MemoryTiers(budget=300, optimizer="device"), 100.0, one_memory=True,
                         chunk_bytes=10)
    assert not pinned.fits and "kinds pinned there" in pinned.reason


def test_disk_traffic_per_step_follows_the_contract() -> None:
    # everything on disk: optimizer read + written, grads written + read, params read twice + written
    tiers = MemoryTiers(params="disk", grads="disk", optimizer="disk")
    plan = tier_plan(STATE, tiers, 0.0, host=HostShare(one_memory=True), compute=0.0, optimizer_time=0.0,
                     optimizer_bytes_per_param=8, rates=RATES)
    assert plan.disk_read == 400 + 100 + 2 * 100
    assert plan.disk_write == 400 + 100 + 100
    assert plan.host_device == 0.0 and plan.moved == 1300


def test_exposed_seconds_overlap_io_with_compute_and_the_step() -> None:
    # params on disk, 2 ranks sharing the disk: read 50 B/s, write 25 B/s per rank.
    # forward+backward: 200 read = 4 s against 3 s compute -> 1 s shows;
    # step: 100 written = 4 s against a 1 s optimizer step -> 3 s; first chunks 2 * 10 / 50 = 0.4 s
    plan = tier_plan(STATE, MemoryTiers(params="disk"), 0.0, host=HostShare(one_memory=True, ranks=2), compute=3.0,
                     optimizer_time=1.0, optimizer_bytes_per_param=8, rates=RATES)
    assert plan.times["io_fb"] == pytest.approx(4.0) and plan.times["io_step"] == pytest.approx(4.0)
    assert plan.seconds == pytest.approx(1.0 + 3.0 + 0.4)
    hidden = tier_plan(STATE, MemoryTiers(params="disk"), 0.0, host=HostShare(one_memory=True, ranks=2),
                       compute=10.0, optimizer_time=10.0, optimizer_bytes_per_param=8, rates=RATES)
    assert hidden.seconds == pytest.approx(0.4)  # all hidden but the first chunks


def test_a_cpu_rank_tightens_its_heap_where_the_budget_binds_with_the_default_heaps_working_memory() -> None:
    # budget 480 (450 filled), working 50: with the default heap's working memory (x2 here) the
    # placement at the measured step is params 100 + grads 100 + 100 working + 20 buffers: 130 of the
    # optimizer's 400 stay, so auto state leaves the device and the runtime tightens the heap
    heap = HeapCosts(tight_step_ratio=1.25, default_working_ratio=2.0, measured="test")
    args = dict(host=HostShare(one_memory=True), compute=1.0, optimizer_time=1.0, optimizer_bytes_per_param=8,
                rates=RATES, heap=heap)
    assert tier_plan(STATE, MemoryTiers(budget=480, disk="tmp"), 50.0, **args).tight_heap
    # everything fits even with twice the working memory: the heap stays as glibc has it
    assert not tier_plan(STATE, MemoryTiers(budget=10_000, disk="tmp"), 50.0, **args).tight_heap
    # no budget, only pins: nothing binds
    assert not tier_plan(STATE, MemoryTiers(optimizer="disk"), 50.0, **args).tight_heap
    # budget 725 (680 filled): the state fits beside the live working memory (600 + 50) but not
    # beside the default heap's (600 + 100): it binds at the measured step all the same
    assert not tier_plan(STATE, MemoryTiers(budget=725, disk="tmp"), 50.0, **args).disk["optimizer"]
    assert tier_plan(STATE, MemoryTiers(budget=725, disk="tmp"), 50.0, **args).tight_heap
    # on CUDA the host heap is not the budget's memory
    assert not tier_plan(STATE, MemoryTiers(budget=480, disk="tmp"), 50.0,
                         **dict(args, host=HostShare(one_memory=False))).tight_heap


def test_the_planner_prices_a_tightened_heap_on_every_part_of_the_step() -> None:
    config = dict(vocab_size=8192, n_layer=24, d_model=2048, n_head=16)
    budget = 5 * 2 ** 30
    option = estimate(config, f"dp2 zero3 mem{budget} disk", device="cpu", global_batch=2, seq_len=128)
    assert option.tiers.tight_heap
    others = sum(v for k, v in option.times.items() if k not in ("heap", "tiers"))
    assert option.times["heap"] == pytest.approx((HEAP_COSTS.tight_step_ratio - 1) * others)
    roomy = estimate(config, "dp2 zero3 mem64GiB disk", device="cpu", global_batch=2, seq_len=128)
    assert not roomy.tiers.tight_heap and "heap" not in roomy.times


def test_the_heap_costs_file_is_measured_and_says_where() -> None:
    data = json.loads(HOST_HEAP_FILE.read_text())
    assert data["script"] == "python benchmarks/host_heap.py" and data["measured"] and data["machine"]
    costs = load_heap_costs()
    assert min(data["tight_step_ratio_per_round"]) <= costs.tight_step_ratio <= max(data["tight_step_ratio_per_round"])
    assert (min(data["default_working_ratio_per_round"]) <= costs.default_working_ratio
            <= max(data["default_working_ratio_per_round"]))


def test_cuda_host_optimizer_moves_grads_down_and_params_up_and_steps_on_the_host() -> None:
    # optimizer on the host (mixed precision: 12 bytes per parameter, 8 of them exp_avg +
    # exp_avg_sq): grads 100 go down, params 100 go up; the host AdamW updates 400 * 8/12 bytes
    # of moments at 8 B/s
    plan = tier_plan(STATE, MemoryTiers(optimizer="host"), 0.0, host=HostShare(one_memory=False), compute=0.0,
                     optimizer_time=0.0, optimizer_bytes_per_param=12, rates=RATES)
    assert plan.host_device == 200.0 and plan.disk_read == 0.0
    assert plan.times["host_adam"] == pytest.approx(400 * 8 / 12 / 8)
    assert plan.seconds == pytest.approx(max(200 / 20, 400 * 8 / 12 / 8))
    # float32 training has no master on the host: the params come down as well as up
    fp32 = tier_plan(STATE, MemoryTiers(optimizer="host"), 0.0, host=HostShare(one_memory=False), compute=0.0,
                     optimizer_time=0.0, optimizer_bytes_per_param=8, rates=RATES)
    assert fp32.host_device == 300.0


SMALL = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=64, kernels="torch")


def test_bytes_of_a_small_gpt_with_its_optimizer_on_disk() -> None:
    n = sum(p.numel() for p in GPT(SMALL).parameters())
    option = estimate(SMALL, "dp2 zero3 optimizer@disk", device="cpu", global_batch=4, seq_len=64)
    plain = estimate(SMALL, "dp2 zero3", device="cpu", global_batch=4, seq_len=64)
    tiers = option.tiers
    assert tiers is not None and option.fits
    # fp32 on a CPU: 4 + 4 + 8 bytes per parameter, sharded over dp2
    assert tiers.disk["optimizer"] == pytest.approx(n * 8 / 2)
    assert tiers.device["params"] == pytest.approx(n * 4 / 2) and tiers.device["grads"] == pytest.approx(n * 4 / 2)
    assert tiers.disk_read == tiers.disk_write == pytest.approx(n * 8 / 2)
    # the device keeps everything but the optimizer, plus its two streaming chunks
    assert option.memory.total == pytest.approx(plain.memory.total - n * 8 / 2 + tiers.streaming)
    assert option.times["tiers"] > 0 and option.step_time > plain.step_time
    assert "disk" in str(option) and plain.tiers is None


def test_clipping_reads_the_gradients_on_disk_once_more_and_nothing_hides_it() -> None:
    n = sum(p.numel() for p in GPT(SMALL).parameters())
    options = dict(device="cpu", global_batch=4, seq_len=64)
    on_disk = estimate(SMALL, "dp2 zero3 grads@disk optimizer@disk", **options)
    clipped = estimate(SMALL, "dp2 zero3 grads@disk optimizer@disk", grad_clip=True, **options)
    # the norm reads this rank's fp32 gradient shard (what test_memory_tiers measures the runtime move)
    assert clipped.tiers.disk_read - on_disk.tiers.disk_read == pytest.approx(n * 4 / 2)
    assert clipped.tiers.disk_write == on_disk.tiers.disk_write
    read_rate = load_tier_rates().disk_read / 2  # the two ranks share the disk
    assert clipped.step_time - on_disk.step_time == pytest.approx(n * 4 / 2 / read_rate)
    in_memory = dict(layout="dp2 zero3 optimizer@disk", model=SMALL)
    assert estimate(**in_memory, grad_clip=True, **options).step_time == estimate(**in_memory, **options).step_time


def test_zero1_counts_a_ranks_share_of_the_optimizer_state() -> None:
    """dp2 zero1, optimizer on disk: a rank holds the whole parameters and gradients (4 + 4 bytes
    per parameter) but only its half of the AdamW state (8 / 2), on disk, read and written once per
    step: half of what dp2 zero0 puts and moves there."""
    from colab_par.planning.tier_costs import TIER_RATES

    n = sum(p.numel() for p in GPT(SMALL).parameters())
    options = dict(device="cpu", global_batch=4, seq_len=64)
    zero1, zero0 = (estimate(SMALL, f"dp2 {zero}optimizer@disk", **options) for zero in ("zero1 ", ""))
    tiers = zero1.tiers
    assert zero1.fits and dict(tiers.device) == {"params": n * 4, "grads": n * 4, "optimizer": 0.0}
    assert tiers.disk["optimizer"] == n * 8 / 2 == zero0.tiers.disk["optimizer"] / 2
    assert tiers.disk_read == tiers.disk_write == n * 8 / 2
    assert tiers.streaming == 2 * min(TIER_RATES.chunk_bytes, n * 8 / 2)
    plain = estimate(SMALL, "dp2 zero1", **options)
    assert zero1.memory.total == pytest.approx(plain.memory.total - n * 8 / 2 + tiers.streaming)


def test_the_predicted_peak_stays_within_the_budget() -> None:
    config = dict(vocab_size=8192, n_layer=24, d_model=2048, n_head=16)
    budget = 5 * 2 ** 30  # float32 shards 2.3 GiB stay resident; gradients and AdamW state (6.9 GiB) spill
    option = estimate(config, f"dp2 zero3 mem{budget} disk", device="cpu", global_batch=2, seq_len=128)
    assert option.fits and sum(option.tiers.disk.values()) > 0
    filled = budget * (1 - SLACK)  # the runtime keeps SLACK of the budget free; so does the plan
    # sized for the largest working memory of any moment of the step (memory_estimate.step_instants),
    # reported at the fullest moment: within the budget, and using most of it (86 % here)
    assert 0.8 * filled <= option.memory.total <= filled * (1 + 1e-12)
    assert option.memory.peak <= option.memory.baseline + filled * (1 + 1e-12)
    over = estimate(config, f"dp2 zero3 mem{budget}", device="cpu", global_batch=2, seq_len=128)
    assert not over.fits and "disk tier" in over.tiers.reason


def test_disk_free_space_of_a_folder_not_made_yet() -> None:
    base = Path(tempfile.gettempdir())  # the free space moves as other jobs write: a loose match
    assert disk_free_bytes(str(base / "not" / "made" / "yet")) == pytest.approx(shutil.disk_usage(base).free,
                                                                                 rel=0.1)
    assert disk_free_bytes(None) == 0.0


def test_rates_file_is_measured_and_says_where() -> None:
    data = json.loads(TIER_COSTS_FILE.read_text())
    assert data["script"] == "python benchmarks/tier_costs.py" and data["measured"] and data["machine"]
    rates = load_tier_rates()
    for name in ("disk_read", "disk_write", "host_adam"):
        low, high = data["ranges"][name]
        assert low <= getattr(rates, name) <= high
    assert rates.chunk_bytes >= 2 ** 20


def test_a_disk_tier_trains_a_larger_model_under_the_same_budget() -> None:
    family = gpt_ladder(widths=range(512, 4097, 512))
    # 3 GiB: the parameters stay resident, so the disk tier helps once the state beside them is most
    found = largest_under_budget("dp2 zero3", "3GiB", device="cpu", global_batch=2, seq_len=128, family=family)
    memory, disk = found["memory"], found["disk"]
    assert memory is not None and disk is not None and disk.n_params > memory.n_params
    assert memory.plan.fits and disk.plan.fits and memory.plan.tiers.resident()["disk"] == 0
    # the next larger member does not fit in memory alone
    larger = next(sizes for sizes in family if sizes["d_model"] > memory.sizes["d_model"])
    assert not estimate(larger, "dp2 zero3 mem3GiB", device="cpu", global_batch=2, seq_len=128).fits
    assert largest_model("dp2 zero3 mem1MiB", device="cpu", global_batch=2, seq_len=128, family=family) is None


def test_plan_under_a_budget_puts_every_candidate_in_tiers_and_within_it() -> None:
    from colab_par.planning.planner import plan

    config = dict(vocab_size=8192, n_layer=24, d_model=2048, n_head=16)
    budget = 3 * 2 ** 30
    plans = plan(config, 2, device="cpu", global_batch=2, seq_len=128, top=None,
                 tiers=MemoryTiers(budget=budget, disk="tmp"))
    fitting = [p for p in plans if p.fits]
    assert fitting and all(p.layout.tiers == MemoryTiers(budget=budget, disk="tmp") for p in plans)
    assert not any(p.layout.offload for p in plans)
    assert all(p.memory.total <= budget * (1 + 1e-12) for p in fitting)
    assert not plan(config, 2, device="cpu", global_batch=2, seq_len=128, top=None,
                    tiers=MemoryTiers(budget=budget))[0].fits  # 9 GiB of state per rank, no disk: no fit


def test_without_a_measured_copy_rate_the_catalogues_link_is_used() -> None:
    from dataclasses import replace

    options = dict(compute=0.0, optimizer_time=0.0, optimizer_bytes_per_param=12)
    measured = tier_plan(STATE, MemoryTiers(params="host"), 0.0, host=HostShare(one_memory=False), rates=RATES,
                         **options)
    catalogue = tier_plan(STATE, MemoryTiers(params="host"), 0.0, rates=replace(RATES, host_device=None),
                          host=HostShare(one_memory=False, link_bandwidth=20.0), **options)
    assert measured.times["io_fb"] == catalogue.times["io_fb"] == pytest.approx(200 / 20)
    gpu = estimate(dict(vocab_size=32000, n_layer=32, d_model=4096, n_head=32), "dp8 zero3 bf16 optimizer@host",
                   device="H100", global_batch=8, seq_len=4096)
    assert gpu.tiers.host["optimizer"] > 0 and gpu.tiers.host_device > 0 and gpu.times["tiers"] > 0
    assert gpu.memory.host_optimizer == gpu.tiers.host["optimizer"] and gpu.memory.optimizer == 0


def test_auto_parameters_stay_on_the_device_as_the_runtime_keeps_them() -> None:
    # the runtime never moves parameters it was not told to: a budget that leaves them no room
    # is refused, not met by putting them on disk (which the runtime would not do)
    squeezed = place_state(STATE, MemoryTiers(budget=260, disk="tmp"), 100.0, one_memory=True, chunk_bytes=10)
    assert squeezed.fits and squeezed.device["params"] == 100.0 and squeezed.disk["params"] == 0.0
    assert squeezed.disk["grads"] + squeezed.disk["optimizer"] > 0
    over = place_state(STATE, MemoryTiers(budget=150, disk="tmp"), 30.0, one_memory=True, chunk_bytes=10)
    assert not over.fits and over.disk["params"] == 0.0 and "the parameters" in over.reason
