"""Hugging Face MoE families under expert parallel train like transformers alone (real engines).

Tiny 2-layer, 4-expert (2 per token) configs, no download. Against one process running the family
with transformers alone (its own experts forward, its own ``aux_loss`` where switched on), on
learnable data: every step's loss and gradient norm within 1e-5 relative, every parameter within
Adam's tolerance (`parity.assert_parity`). Qwen3-MoE, Mixtral and OLMoE under `dp2 ep2` and
`dp2 ep2 zero3`, with and without the balance loss (which must then be the global-batch one: a
per-rank loss differs by far more than 1e-5 with this coefficient); Qwen2-MoE (shared expert),
DeepSeek-V3 (shared expert, no balance loss) and GPT-OSS (expert biases) a two-step smoke.
"""
from __future__ import annotations

import sys
from typing import Any

import cloudpickle
import pytest
import torch

from colab_par import compat
from colab_par.layout import Layout, LayoutError
from colab_par.training.telemetry import expert_row_key
from parity import (LR, SEED, assert_close_to_fp32, assert_parity, bf16_engine_run, build_model, engine_model,
                    engine_run, engine_run_moved, reference_run, training_batches)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import test modules

STEPS, SMOKE_STEPS = 6, 2
FAMILIES, AUX = ("qwen3-moe", "mixtral", "olmoe"), ("", "-aux")  # the families, with and without the loss


@pytest.mark.parametrize("aux", AUX)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["dp2 ep2", "dp2 ep2 zero3"])
def test_hf_moe_trains_like_transformers(cluster2, layout: str, family: str, aux: str) -> None:
    kind = family + aux
    assert_parity(cluster2.run(engine_run, layout, kind, STEPS), reference_run(kind, STEPS))


def test_hf_balance_loss_is_global_under_plain_dp(cluster2) -> None:
    """Without ep too: transformers' per-forward loss would be per rank; the kit's is global."""
    assert_parity(cluster2.run(engine_run, "dp2", "qwen3-moe-aux", STEPS), reference_run("qwen3-moe-aux", STEPS))


@pytest.mark.parametrize("layout, kind", [*[("dp4 ep2", family + aux) for family in FAMILIES for aux in AUX],
                                          ("dp4 ep2 zero3", "mixtral-aux")])
def test_two_ep_groups_train_like_transformers(cluster4, layout: str, kind: str) -> None:
    """Each expert on two ranks (edp): its gradient summed over them and divided by dp."""
    assert_parity(cluster4.run(engine_run, layout, kind, STEPS), reference_run(kind, STEPS))


@pytest.mark.parametrize("aux", AUX)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_moe_under_tensor_parallel_trains_like_transformers(cluster2, family: str, aux: str) -> None:
    """tp2 as the family's own plan says: attention by its colwise/rowwise entries, the experts
    split inside ('moe_tp_experts': gate|up packed_colwise, down rowwise), the router whole."""
    kind = family + aux
    assert_parity(cluster2.run(engine_run, "tp2", kind, STEPS), reference_run(kind, STEPS))


@pytest.mark.parametrize("layout, kind", [*[("dp2 ep2 tp2", family + aux) for family in FAMILIES for aux in AUX],
                                          ("dp2 ep2 tp2 zero3", "qwen3-moe-aux")])
def test_hf_moe_under_ep_and_tp_trains_like_transformers(cluster4, layout: str, kind: str) -> None:
    assert_parity(cluster4.run(engine_run, layout, kind, STEPS), reference_run(kind, STEPS))


MATMULS = {"mm", "bmm", "addmm", "baddbmm", "_grouped_mm"}


class MatmulDtypes(compat.torch_dispatch_mode()):
    """The dtypes of every matrix multiply that runs (forward and backward), grouped ones too."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.overloadpacket.__name__ in MATMULS:
            self.dtypes.update(str(a.dtype).removeprefix("torch.") for a in args[:3]
                               if isinstance(a, torch.Tensor) and a.is_floating_point())
        return func(*args, **(kwargs or {}))


def bf16_moe_run(layout: str, kind: str) -> dict[str, Any]:
    """`parity.bf16_engine_run`, also recording the dtype of every matrix multiply of the steps."""
    with MatmulDtypes() as seen:
        result = bf16_engine_run(layout, kind=kind, steps=STEPS)
    return {**result, "matmul_dtypes": sorted(seen.dtypes)}


@pytest.mark.parametrize("kind, layout", [("qwen3-moe-aux", "dp2 bf16"), ("qwen3-moe-aux", "dp2 ep2 bf16"),
                                          ("qwen3-moe-aux", "dp2 ep2 zero3 bf16"), ("qwen3-moe", "tp2 bf16"),
                                          ("gpt-moe-aux", "dp2 ep2 bf16"), ("gpt-moe-aux", "dp2 ep2 zero3 bf16")])
def test_bf16_runs_the_experts_in_bf16(cluster2, kind: str, layout: str) -> None:
    """torch's grouped matmul is not on autocast's list, and transformers' computes in its weights'
    dtype: without a cast the experts, most of a MoE's compute, ran in float32 under bf16 while
    every linear ran in bf16. Now every matrix multiply of the step is bf16, forward and backward,
    and the run stays as close to float32 training as bf16 allows (`parity.assert_close_to_fp32`)."""
    results = cluster2.run(bf16_moe_run, layout, kind)
    for rank, result in enumerate(results):
        assert result["matmul_dtypes"] == ["bfloat16"], f"rank {rank}: {result['matmul_dtypes']}"
    assert_close_to_fp32(results, reference_run(kind, STEPS), stray=1e-3)  # measured: 1-2 of 8192-10240


@pytest.mark.parametrize("kind", ["qwen2-moe-aux", "deepseek-v3", "gpt-oss-aux"])
def test_more_hf_moe_families_smoke(cluster2, kind: str) -> None:
    assert_parity(cluster2.run(engine_run, "dp2 ep2", kind, SMOKE_STEPS), reference_run(kind, SMOKE_STEPS))


@pytest.mark.parametrize("kind", ["qwen3-moe-aux", "gpt-moe-aux"])
@pytest.mark.parametrize("layout", ["dp2 ep2 ac-full", "dp2 ep2 zero3 ac-selective"])
def test_ep_with_activation_checkpointing(cluster2, layout: str, kind: str) -> None:
    """Backward recomputes each block's forward, all-to-all and balance statistics included, in the
    same order on every rank: the same training."""
    assert_parity(cluster2.run(engine_run, layout, kind, STEPS), reference_run(kind, STEPS))


def _experts_calls_per_step(layout: str, batch: tuple) -> int:
    """How often the experts modules ran in one training step (forward, and any recomputation)."""
    from colab_par import parallelize
    from colab_par.parallel.experts import moe_layers

    pm = parallelize(engine_model("qwen3-moe-aux", "module"), layout)
    calls = []
    for layer in moe_layers(pm.model):
        layer.module.register_forward_pre_hook(lambda *args: calls.append(1))  # recomputation may stop early
    pm.train_step(*batch)
    return len(calls)


def test_checkpointing_under_ep_recomputes_the_experts(cluster2) -> None:
    """The parity above is not checkpointing silently off: backward runs each experts module again."""
    batch = training_batches("qwen3-moe-aux", 1)[0]
    assert cluster2.run(_experts_calls_per_step, "dp2 ep2", batch) == [2, 2]
    assert cluster2.run(_experts_calls_per_step, "dp2 ep2 ac-full", batch) == [4, 4]


# ---- each rank holds its slice of the family's packed expert weights ------------------------------
def _expert_pieces(kind: str, layout: str) -> tuple[int, dict[str, torch.Tensor]]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from colab_par import parallelize

    pm = parallelize(engine_model(kind, "module"), layout)
    return dist.get_rank(), {name: param.to_local().detach().clone()
                             for name, param in pm.model.named_parameters() if isinstance(param, DTensor)}


def test_tensor_parallel_splits_each_expert_inside(cluster2) -> None:
    """tp2 of Qwen3-MoE: every rank holds every expert, gate_up_proj as a plain half of its packed
    rows (rank 0 the gate, rank 1 the up projection: what checkpoints see), down_proj half its
    input features; nothing else of the MLP is a DTensor but the attention's planned projections."""
    whole = build_model("qwen3-moe", SEED).state_dict()
    for rank, pieces in cluster2.run(_expert_pieces, "qwen3-moe", "tp2"):
        experts = {name: piece for name, piece in pieces.items() if ".mlp." in name}
        assert set(experts) == {name for name in whole if name.rsplit(".", 1)[0].endswith("mlp.experts")}
        for name, piece in experts.items():
            expected = whole[name].chunk(2, 1 if name.endswith("gate_up_proj") else 2)[rank]
            torch.testing.assert_close(piece, expected, rtol=0, atol=0)


def test_gpt_oss_experts_refuse_tensor_parallel(cluster2) -> None:
    """GPT-OSS ships no tensor-parallel plan for its experts (interleaved gate/up, biases)."""
    for error in cluster2.run(_refusal, "gpt-oss", "tp2"):
        assert "no 'moe_tp_experts' entry" in error and "split its experts with ep" in error, error


def _refusal(kind: str, layout: str) -> str:
    from colab_par import parallelize

    try:
        parallelize(engine_model(kind, "module"), layout)
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("kind", ["gpt-oss", "qwen2-moe"])
def test_each_rank_holds_its_experts_and_shared_experts_stay_whole(cluster2, kind: str) -> None:
    """Exactly the ep plan's packed weights are split (GPT-OSS: its biases too), by expert; the
    shared expert of Qwen2-MoE and everything else stays a whole tensor."""
    whole = build_model(kind, SEED).state_dict()
    planned = {name for name in whole if name.rsplit(".", 1)[0].endswith("mlp.experts")}
    for rank, pieces in cluster2.run(_expert_pieces, kind, "dp2 ep2"):
        assert set(pieces) == planned
        for name, piece in pieces.items():
            torch.testing.assert_close(piece, whole[name][rank * 2:rank * 2 + 2], rtol=0, atol=0)


# ---- the Trainer's per-expert token counts ------------------------------------------------------
COUNT_STEPS = 2


def _trainer_rows(kind: str, layout: str) -> list[dict]:
    from colab_par import parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.training.trainer import Trainer

    pm = parallelize(engine_model(kind, "module"), layout, optimizer_fn=lambda p: torch.optim.AdamW(p, lr=LR))
    trainer = Trainer(pm, SyntheticDataset(vocab_size=64, seq_len=16, batch_size=4, seed=5), steps=COUNT_STEPS)
    trainer.fit()
    return trainer.history


def _one_process_counts(kind: str) -> list[list[list[int]]]:
    """Per step, (layer, expert) counts of the top-k of transformers' own router logits."""
    from colab_par.data import SyntheticDataset

    model, data = build_model(kind, SEED), SyntheticDataset(vocab_size=64, seq_len=16, batch_size=4, seed=5)
    optimizer, top_k = torch.optim.AdamW(model.parameters(), lr=LR), model.config.num_experts_per_tok
    per_step = []
    for step in range(COUNT_STEPS):
        inputs, targets = data.batch(step)
        out = model(input_ids=inputs, use_cache=False, output_router_logits=True)
        per_step.append([torch.bincount(logits.topk(top_k, dim=-1).indices.reshape(-1), minlength=4).tolist()
                         for logits in out.router_logits])
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 64), targets.reshape(-1))
        (loss + model.config.router_aux_loss_coef * out.aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad()
    return per_step


def test_trainer_rows_count_the_tokens_each_hf_expert_got(cluster2) -> None:
    expected = _one_process_counts("olmoe-aux")
    for history in cluster2.run(_trainer_rows, "olmoe-aux", "dp2 ep2"):
        for row, counts in zip(history, expected):
            got = [[row[expert_row_key(layer, e)] for e in range(4)] for layer in range(2)]
            assert got == counts, f"step {row['step']}"


# ---- refused before any work --------------------------------------------------------------------
def test_ep_needs_an_expert_plan() -> None:
    dense = build_model("qwen3", None).config
    with pytest.raises(LayoutError, match="this model has none"):
        Layout.parse("dp2 ep2").validate(2, dense)
    Layout.parse("dp2 ep2").validate(2, build_model("mixtral", None).config)


# ---- shard-first builds, checkpoints and Hugging Face files across ep layouts ------------------------
@pytest.mark.parametrize("kind, layout", [("qwen3-moe-aux", "dp2 ep2"), ("gpt-moe", "dp2 ep2 zero3")])
def test_ep_builds_shard_first_from_a_factory(cluster2, kind: str, layout: str) -> None:
    """Each rank allocates only its experts, filled with rank 0's one-process init."""
    assert_parity(cluster2.run(engine_run, layout, kind, STEPS, "factory"), reference_run(kind, STEPS))


@pytest.mark.parametrize("kind, first, second", [("qwen3-moe-aux", "dp2 ep2", "dp2"),
                                                 ("gpt-moe-aux", "dp2", "dp2 ep2 zero3"),
                                                 ("qwen3-moe-aux", "dp2 ep2", "tp2"),
                                                 ("gpt-moe-aux", "tp2", "dp2 ep2")])
def test_moe_checkpoint_moves_between_ep_dp_and_tp(cluster2, tmp_path, kind: str, first: str, second: str) -> None:
    """Half the steps under one layout, saved (DCP, model and optimizer), loaded under the other,
    the rest there: equal to all steps in one process."""
    assert_parity(cluster2.run(engine_run_moved, first, second, str(tmp_path), kind, STEPS),
                  reference_run(kind, STEPS))


def _load_step_save(source: str, out: str, kind: str, layout: str) -> dict:
    """On every engine: the directory transformers wrote, loaded shard-first under `layout` (under
    ep each rank reads only its experts' tensors), its full state, the loss of one forward-backward
    on a learnable batch, then written back with save_pretrained (before any optimizer step)."""
    from colab_par.hf_io import from_pretrained, save_pretrained

    pm = from_pretrained(source, layout)
    state = pm.full_state_dict()
    loss = pm.forward_backward(*training_batches(kind, 1)[0])
    save_pretrained(pm, out)
    return {"state": state, "loss": loss}


def _file_keys(folder) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            keys |= set(handle.keys())
    return keys


@pytest.mark.parametrize("kind, layout, shard", [
    ("mixtral", "dp2 ep2", None), ("qwen3-moe", "dp2 ep2", None), ("olmoe", "dp2", None),
    ("qwen3-moe", "dp2 ep2 zero3", None), ("gpt-oss", "dp2 ep2", None),
    ("qwen2-moe", "dp2 ep2", None), ("deepseek-v3", "dp2 ep2", "40KB")])
def test_hf_files_in_the_familys_own_layout_load_and_save(cluster2, tmp_path, kind: str, layout: str,
                                                          shard: str | None) -> None:
    """transformers' own files (experts one tensor per expert; Mixtral's block_sparse_moe names;
    GPT-OSS packed; `shard`: split over several files with an index) load under `layout` to
    transformers' exact weights and one-process loss; the kit writes the very keys transformers
    writes, and transformers reads them back bit-exactly."""
    import torch.nn.functional as F
    import transformers

    model = build_model(kind, SEED)
    model.save_pretrained(tmp_path / "transformers", **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert len(list((tmp_path / "transformers").glob("model-*.safetensors"))) > 2
    runs = cluster2.run(_load_step_save, str(tmp_path / "transformers"), str(tmp_path / "kit"), kind, layout)
    expected = model.state_dict()
    inputs, targets = training_batches(kind, 1)[0]
    logits = model(input_ids=inputs, use_cache=False).logits
    reference = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "kit").state_dict()
    for state in (runs[0]["state"], again):  # the full state comes back on rank 0
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)
    for run in runs:  # float32 sums in another order (dp halves of the batch): a few ulps
        assert run["loss"] == pytest.approx(reference, rel=1e-5)
    assert _file_keys(tmp_path / "kit") == _file_keys(tmp_path / "transformers")


def test_family_files_read_a_block_from_the_experts_it_covers_only(tmp_path) -> None:
    """A block of a packed tensor (experts 2-3, rows across the gate/up seam, some columns) read
    from transformers' per-expert Mixtral files equals that block of the model's tensor, and only
    those two experts' tensors are read."""
    from colab_par.hf_io.family_files import FamilyWeights
    from colab_par.models.hf_weights import SafetensorsWeights

    class Recorded(SafetensorsWeights):
        read_names: list[str] = []

        def read(self, name, index=None):
            self.read_names.append(name)
            return super().read(name, index)

    class RecordedFamilyWeights(FamilyWeights, Recorded):
        pass

    model = build_model("mixtral", SEED)
    model.save_pretrained(tmp_path)
    with torch.device("meta"):
        shapes = build_model("mixtral", None)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    packed = model.state_dict()[name]
    seam = packed.shape[1] // 2
    index = (slice(2, 4), slice(seam - 3, seam + 5), slice(1, 7))
    with RecordedFamilyWeights(tmp_path, shapes) as weights:
        assert weights.header(name) == (tuple(packed.shape), "F32")
        assert torch.equal(weights.read(name, index), packed[index])
    assert sorted(Recorded.read_names) == [f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"
                                           for e in (2, 3) for w in ("w1", "w3")]


def test_per_expert_files_without_a_mapping_are_refused_before_any_read(tmp_path) -> None:
    """GPT-OSS has no conversion mapping in transformers: its experts stored one tensor per expert
    (not its own layout) are refused, naming the tensor, before parallelize starts."""
    import safetensors.torch

    from colab_par.hf_io import WeightsError, from_pretrained

    build_model("gpt-oss", SEED).save_pretrained(tmp_path)
    state = safetensors.torch.load_file(tmp_path / "model.safetensors")
    packed = state.pop("model.layers.0.mlp.experts.gate_up_proj")
    state.update({f"model.layers.0.mlp.experts.{e}.gate_up_proj": packed[e].clone() for e in range(len(packed))})
    safetensors.torch.save_file(state, tmp_path / "model.safetensors", {"format": "pt"})
    with pytest.raises(WeightsError, match=r"lacks the experts model.layers.0.mlp.experts.gate_up_proj .*"
                                           r"model_type 'gpt_oss'.* no per-expert layout"):
        from_pretrained(tmp_path, "dp2 ep2")
