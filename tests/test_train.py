"""Trainer on real engines against a plain single-process loop: same losses, grad norms and LRs with
gradient accumulation, clipping across shards and warm-up + cosine; telemetry that adds up."""
from __future__ import annotations

import csv
import importlib.util
import math
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import any_models
import cloudpickle
import pytest
import torch

from colab_par.data import SyntheticDataset
from colab_par.models.gpt import GPT, GPTConfig
from colab_par.training.trainer import Trainer, WarmupCosine
from colab_par.training.options import Logs

CONFIG = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, kernels="torch")
DATA = dict(vocab_size=64, seq_len=16, batch_size=4, seed=5)
LR, WEIGHT_DECAY, MODEL_SEED = 3e-3, 0.1, 7

# Engines cannot import test modules: ship this one (and its helpers used elsewhere) by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def build_trainer(layout: str, steps: int, *, warmup: int = 1, **options) -> Trainer:
    """On an engine: the test GPT parallelized as `layout` and its Trainer (model seed fixed, so
    the single-process reference starts from the same weights)."""
    from colab_par import parallelize

    torch.manual_seed(MODEL_SEED)
    pm = parallelize(GPT(GPTConfig(**CONFIG)), layout, optimizer_fn=adamw)
    return Trainer(pm, SyntheticDataset(**DATA), steps=steps, lr_schedule=WarmupCosine(warmup, steps),
                   **options)


def train_on_engine(layout: str, steps: int, grad_accum: int, grad_clip: float | None,
                    warmup: int, log_every: int = 1) -> list[dict]:
    trainer = build_trainer(layout, steps, warmup=warmup, grad_accum=grad_accum, grad_clip=grad_clip,
                            log_every=log_every)
    trainer.fit()
    return trainer.history


def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warm-up then half a cosine to `floor` (Loshchilov & Hutter, SGDR, with warm-up)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2


def reference(steps: int, grad_accum: int, grad_clip: float | None, warmup: int) -> list[dict]:
    """The same training with no parallel wrapper, no Trainer: one process, the whole batch."""
    torch.manual_seed(MODEL_SEED)
    model = GPT(GPTConfig(**CONFIG))
    optimizer = adamw(model.parameters())
    data = SyntheticDataset(**DATA)
    rows = []
    for step in range(steps):
        losses = []
        for micro in range(grad_accum):
            inputs, targets = data.batch(step * grad_accum + micro)
            loss = model.loss_fn(model(inputs), targets)
            (loss / grad_accum).backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf).item()
        for group in optimizer.param_groups:
            group["lr"] = LR * warmup_cosine(step, warmup, steps)
        optimizer.step()
        optimizer.zero_grad()
        rows.append({"loss": sum(losses) / grad_accum, "grad_norm": norm, "lr": optimizer.param_groups[0]["lr"]})
    return rows


@pytest.mark.parametrize("layout,grad_accum,grad_clip", [
    ("dp2 zero3", 2, 0.05),  # clipping active: the norm is well above 0.05
    ("tp2", 1, None),
    ("pp2 gpipe mb2", 2, 0.05),
])
def test_trainer_matches_single_process_training(cluster2, layout, grad_accum, grad_clip):
    steps, warmup = 6, 2
    ranks = cluster2.run(train_on_engine, layout, steps, grad_accum, grad_clip, warmup)
    expected = reference(steps, grad_accum, grad_clip, warmup)
    assert grad_clip is None or min(r["grad_norm"] for r in expected) > 2 * grad_clip
    for history in ranks:
        assert [r["step"] for r in history] == list(range(1, steps + 1))
        for got, want in zip(history, expected):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
            assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)


def test_telemetry_rows_add_up(cluster2, tmp_path):
    ranks = cluster2.run(train_on_engine, "dp2 zero3", 4, 1, None, 1, log_every=2)
    n_params = GPTConfig(**CONFIG).num_params()
    tokens = DATA["batch_size"] * DATA["seq_len"]
    assert [r["step"] for r in ranks[0]] == [2, 4]
    for rank, history in enumerate(ranks):
        for row in history:
            assert row["rank"] == rank
            assert row["tokens_per_s"] == pytest.approx(tokens / row["step_time"])
            phases = sum(row[k] for k in row if k.startswith("time_") and k != "time_telemetry")
            assert 0 < phases <= row["step_time"]
            assert 0 < row["mfu"] < 1 and row["flops_per_s"] > 0
            assert row["mem_total"] == row["mem_params"] + row["mem_grads"] + row["mem_optimizer"]
            assert row["mem_activations"] > 0 and row["mem_rss"] > row["mem_total"]
            assert row["bubble"] is None
    # ZeRO-3 shards params, grads and the two AdamW moments evenly over the 2 ranks.
    last = [history[-1] for history in ranks]
    assert sum(r["mem_params"] for r in last) == 4 * n_params
    assert sum(r["mem_grads"] for r in last) == 4 * n_params
    assert sum(r["mem_optimizer"] for r in last) == 2 * 4 * n_params


def test_pipeline_rows_report_a_measured_bubble(cluster2):
    ranks = cluster2.run(train_on_engine, "pp2 gpipe mb2", 3, 1, None, 1)
    for history in ranks:
        assert all(0.0 < row["bubble"] < 1.0 for row in history)


OWN_WORK_GOAL = 0.03  # issue 23: the Trainer's own work at most 3 % of a step's CPU


def trainer_step_benchmark():
    """benchmarks/trainer_step.py, whose engine-side measurement of the Trainer's own work this
    test runs (one measurement, not a copy of it)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "trainer_step.py"
    spec = importlib.util.spec_from_file_location("trainer_step_benchmark", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_trainer_own_work_stays_within_its_share(cluster2):
    """The Trainer's own CPU work per step (data, LR, grad norm, telemetry rows, activation hooks,
    publishing), outside the model's forward/backward/optimizer, on real engines with telemetry
    on: `trainer_step.py --own-work` measured a median of 2.47 % of the step (2.35-2.58 % over 12
    rank-rounds) on the 2-core VM. The goal is the median's: a single 12-step round once read
    3.12 % in a full CI run, its "other" (the engine's heartbeat and messaging threads, which the
    process clock counts) twice the other rank's, so each rank's median of three rounds is held to
    the 3 % goal."""
    bench = trainer_step_benchmark()
    ranks = cluster2.run(bench.own_work_on_engine, bench.MODEL, bench.BATCH, 6, 2, "dp2", 3)
    measured = ("data", "grad norm", "hooks", "row", "publish")  # telemetry and publishing ran
    assert all(round_[part] > 0 for rounds in ranks for round_ in rounds for part in measured), ranks
    shares = [statistics.median(round_["own"] / round_["step"] for round_ in rounds) for rounds in ranks]
    assert all(0 < share <= OWN_WORK_GOAL for share in shares), \
        f"the Trainer's own work is {[f'{100 * s:.2f} %' for s in shares]} of the step: {ranks}"


def test_history_to_csv(tmp_path):
    trainer = Trainer.__new__(Trainer)
    trainer.history = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25, "mfu": 0.1}]
    trainer.to_csv(tmp_path / "h.csv")
    with open(tmp_path / "h.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert rows == [{"step": "1", "loss": "2.5", "mfu": ""}, {"step": "2", "loss": "2.25", "mfu": "0.1"}]


def test_warmup_cosine_shape():
    schedule = WarmupCosine(warmup_steps=4, total_steps=20, min_ratio=0.1)
    factors = [schedule(s) for s in range(25)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[3:], factors[4:]))
    assert factors[12] == pytest.approx(0.55) and factors[20] == pytest.approx(0.1) == factors[24]
    with pytest.raises(ValueError, match="min_ratio"):
        WarmupCosine(2, 10, min_ratio=1.5)


@pytest.mark.parametrize("kwargs,message", [
    (dict(steps=0), "steps=0 must be a positive integer"),
    (dict(steps=5, grad_accum=0), "grad_accum=0"),
    (dict(steps=5, grad_clip=-1.0), "grad_clip=-1.0"),
    (dict(steps=5, ckpt_every=2), "ckpt_every is set but ckpt_dir is None"),
])
def test_bad_arguments_fail_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Trainer(None, SyntheticDataset(), **kwargs)
    with pytest.raises(TypeError, match="int is not data to train on"):
        Trainer(None, 42, steps=1)
    with pytest.raises(TypeError, match=r"a batch is a tuple \(\*inputs, target\) or a dict"):
        Trainer(None, [torch.zeros(3)], steps=1)  # a list of tensors, not of batches


def test_plain_python_prints_one_line_per_log_step(tmp_path):
    script = textwrap.dedent("""
        import os, torch, torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://%s", rank=0, world_size=1)
        from colab_par import Trainer, parallelize
        from colab_par.data import TextDataset
        from colab_par.models.gpt import GPT, GPTConfig
        pm = parallelize(GPT(GPTConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=2, d_model=16,
                                       kernels="torch")), "dp1")
        Trainer(pm, TextDataset(seq_len=16, batch_size=2, max_bytes=1 << 16), steps=4, log_every=2).fit()
        dist.destroy_process_group()
    """) % (tmp_path / "store")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(" · ")[0] for line in lines] == ["step 2/4", "step 4/4"], done.stdout
    assert all("loss" in line and "tok/s" in line for line in lines)


# ---- reading the device: once per logged step ----------------------------------------------------
READS = frozenset({"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"})


class DeviceReads(torch.overrides.TorchFunctionMode):
    """Counts the values the kit's own code takes from tensors (each a wait for the device on a
    GPU rank), by the function that asked: torch's internals (AdamW reading its host step
    counts) and the data modules (rows that are host tensors before they are sent) are left out."""

    def __init__(self) -> None:
        super().__init__()
        import colab_par
        self.package = os.path.dirname(colab_par.__file__)
        self.host_side = {os.path.join(self.package, "data", name) for name in ("tokens.py", "sources.py")}
        self.counts: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            frame = sys._getframe(1)
            while frame.f_code.co_filename.endswith(("torch/overrides.py", "torch/_tensor.py")):
                frame = frame.f_back  # Tensor methods written in Python hand over to torch_function
            path = frame.f_code.co_filename
            if path.startswith(self.package) and path not in self.host_side:
                where = f"{os.path.relpath(path, self.package)}:{frame.f_code.co_name}"
                self.counts[where] = self.counts.get(where, 0) + 1
        return func(*args, **(kwargs or {}))


def reads_per_step(layout: str, data: str, grad_accum: int, steps: int = 5, log_every: int = 2) -> list:
    """Engine side: (whether the step logged a row, the kit's device reads in it) for every step
    after the first (which builds schedules and places state), telemetry on."""
    from colab_par import parallelize

    if data == "tokens":
        torch.manual_seed(MODEL_SEED)
        pm = parallelize(GPT(GPTConfig(**CONFIG)), layout, optimizer_fn=adamw)
        source = SyntheticDataset(**DATA)
    else:  # labelled dict batches: the loss averages over the labels counted on every dp rank
        pm = parallelize(any_models.build(data, 0), layout, optimizer_fn=adamw)
        source = any_models.make_batches(data, steps * grad_accum)
    trainer = Trainer(pm, source, steps=steps, grad_accum=grad_accum, logs=Logs(every=log_every))
    trainer.train_step()
    out = []
    for _ in range(steps - 1):
        with DeviceReads() as reads:
            row = trainer.train_step()
        out.append((row is not None, reads.counts))
    return out


@pytest.mark.parametrize("layout,data", [("dp2 zero3", "tokens"), ("pp2 gpipe mb2", "tokens"),
                                         ("dp2", "llama-lm")])
def test_a_step_reads_the_device_once_whatever_its_micro_steps(cluster2, layout, data):
    """Three micro-steps, telemetry on: a logged step takes its losses and gradient norm from the
    device in one read (`train.read_step`), a step without a row reads nothing; no micro-step,
    phase timer, pipeline bubble or label count waits for the device."""
    for rank in cluster2.run(reads_per_step, layout, data, 3):
        assert [logged for logged, _ in rank] == [True, False, True, True]  # steps 2..5, log_every=2, last
        for logged, counts in rank:
            assert counts == ({"training/trainer.py:read_step": 1} if logged else {}), rank
