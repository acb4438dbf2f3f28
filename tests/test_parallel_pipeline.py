"""Pipeline parallel against single-process training of the same model and data.

Splitting is checked in-process (names, values, stage chaining, placement against torch's own
stage-to-rank mapping); every schedule is trained on a real 2-engine gloo cluster and compared
step by step with one process training the same initial model on the same batches.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

from colab_par.layout import Layout
from colab_par.models.gpt import GPT, GPTConfig
from colab_par.parallel.pipeline import split_model, stage_ids

SCHEDULES = ["pp2 gpipe mb2", "pp2 1f1b mb2", "pp2 interleaved v2 mb2", "pp2 zbv v2 mb2"]
RTOL = 1e-5
# Parameters after AdamW: Adam divides by sqrt(v), so an element whose gradient is nearly zero turns
# summation-order noise into a visible update; 1e-5 absolute on ~2e-2 weights (one lr=1e-3 step
# moves a weight by up to 1e-3) still catches a wrong gradient or a missed step.
PARAM_ATOL = 1e-5


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=4, d_model=32, kernels="torch"))


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(config)


def tiny_gpt2(seed: int = 0, tied: bool = False) -> torch.nn.Module:
    """GPT-2, whose layers are transformer.h (Conv1D projections, learned positions)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(config)


def flat_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def batches(steps: int, batch: int = 8, seq: int = 16, vocab: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (batch, seq), generator=gen),
             torch.randint(0, vocab, (batch, seq), generator=gen)) for _ in range(steps)]


def logits_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def train_single_process(model, data, loss_fn, lr=1e-3):
    """The reference: plain AdamW on the whole batch in this process."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for inputs, targets in data:
        loss = loss_fn(logits_of(model, inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


# ---- engine-side functions (shipped by value to the cluster) ------------------------------------
def train_pipelined(layout, model, data, loss_fn, lr=1e-3):
    import torch
    import torch.distributed as dist
    from colab_par.parallel.pipeline import PipelineRunner, split_model

    parts = split_model(model, layout, dist.get_rank())
    runner = PipelineRunner(parts, layout, dist.group.WORLD, loss_fn, "cpu")
    optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=lr)
    losses, bubbles = [], []
    for inputs, targets in data:
        losses.append(runner.step(inputs, targets))
        bubbles.append(runner.last_bubble)
        optimizer.step()
        optimizer.zero_grad()
    state = {name: t for part in parts for name, t in part.state_dict().items()}
    return {"losses": losses, "state": state, "stage_ids": runner.stage_ids, "bubbles": bubbles}


def train_fsdp_pipelined(layout, model, data, lr=1e-3):
    """dp·pp on a (pp, dp) mesh: each stage fully_shard-ed over its dp ranks, as torchtitan does."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from colab_par.layout import Layout
    from colab_par.parallel.pipeline import PipelineRunner, split_model

    layout = Layout.parse(layout)
    mesh = init_device_mesh("cpu", (layout.pp, layout.dp), mesh_dim_names=("pp", "dp"))
    dp_rank = mesh["dp"].get_local_rank()
    parts = split_model(model, layout, mesh["pp"].get_local_rank())
    for part in parts:
        for block in part.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
    runner = PipelineRunner(parts, layout, mesh["pp"].get_group(), model.loss_fn, "cpu")
    optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=lr)
    losses = []
    for inputs, targets in data:
        rows = slice(dp_rank * len(inputs) // layout.dp, (dp_rank + 1) * len(inputs) // layout.dp)
        loss = torch.tensor([runner.step(inputs[rows], targets[rows]) / layout.dp])
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    state = {name: t.full_tensor() if isinstance(t, DTensor) else t
             for part in parts for name, t in part.state_dict().items()}
    return {"losses": losses, "state": state}


def accumulate_two_halves(layout, model, inputs, targets):
    import torch.distributed as dist
    from colab_par.parallel.pipeline import PipelineRunner, split_model

    parts = split_model(model, layout, dist.get_rank())
    runner = PipelineRunner(parts, layout, dist.group.WORLD, model.loss_fn, "cpu")
    half = inputs.shape[0] // 2
    losses = [runner.step(inputs[:half], targets[:half], loss_scale=0.5),
              runner.step(inputs[half:], targets[half:], loss_scale=0.5)]
    grads = {name: p.grad for part in parts for name, p in part.named_parameters()}
    return losses, grads


def step_with_batch(layout, model, batch):
    import torch
    import torch.distributed as dist
    from colab_par.parallel.pipeline import PipelineRunner, split_model

    parts = split_model(model, layout, dist.get_rank())
    runner = PipelineRunner(parts, layout, dist.group.WORLD, model.loss_fn, "cpu")
    tokens = torch.zeros(batch, 16, dtype=torch.long)
    return runner.step(tokens, tokens)


def runner_with_parts(layout, model, n_parts):
    import torch.distributed as dist
    from colab_par.parallel.pipeline import PipelineRunner

    PipelineRunner([model] * n_parts, layout, dist.group.WORLD, model.loss_fn, "cpu")


# ---- splitting ----------------------------------------------------------------------------------
@pytest.mark.parametrize("pp,v", [(2, 2), (4, 2), (2, 3)])
def test_interleaved_placement_matches_torch_loop_mapping(pp, v):
    layout = Layout(pp=pp, virtual_stages=v, pp_schedule="interleaved", microbatches=pp)
    mapping = generate_stage_to_rank_mapping(pp, pp * v, style="loop")
    for rank in range(pp):
        assert stage_ids(layout, rank) == sorted(s for s, r in mapping.items() if r == rank)


@pytest.mark.parametrize("pp", [2, 4])
def test_zbv_placement_matches_torch_v_mapping(pp):
    layout = Layout(pp=pp, virtual_stages=2, pp_schedule="zbv", microbatches=pp)
    mapping = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
    for rank in range(pp):
        assert sorted(stage_ids(layout, rank)) == sorted(s for s, r in mapping.items() if r == rank)


@pytest.mark.parametrize("make_model", [tiny_gpt, tiny_llama, tiny_gpt2], ids=["gpt", "llama", "gpt2"])
@pytest.mark.parametrize("layout", SCHEDULES + ["pp4 1f1b mb4"])
def test_split_keeps_names_values_and_function(make_model, layout):
    model = make_model()
    layout = Layout.parse(layout)
    original = {name: t.clone() for name, t in model.state_dict().items()}
    stages = {}
    for rank in range(layout.pp):
        stages.update(zip(stage_ids(layout, rank), split_model(model, layout, rank)))
    assert sorted(stages) == list(range(layout.pp * layout.virtual_stages))

    names = [name for part in stages.values() for name in part.state_dict()]
    assert len(names) == len(set(names)), "a parameter lives on two stages"
    assert sorted(names) == sorted(original), "stage names differ from the unsplit model's"
    for part in stages.values():
        for name, tensor in part.state_dict().items():
            assert torch.equal(tensor, original[name])
    assert all(torch.equal(t, original[n]) for n, t in model.state_dict().items()), "source changed"

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    hidden = tokens
    for stage in sorted(stages):
        hidden = stages[stage](hidden)
    torch.testing.assert_close(hidden, logits_of(model, tokens), rtol=0, atol=0)


def test_split_rejects_layers_that_do_not_divide():
    with pytest.raises(ValueError, match="4 layers do not split into pp·virtual_stages = 6"):
        split_model(tiny_gpt(), "pp2 interleaved v3 mb2", 0)


def test_split_keeps_a_head_tied_to_the_embeddings_as_synchronised_copies():
    """The first stage holds the embedding, the last the head: one tensor, trained as two copies
    whose gradients the runner sums; refused where the sum cannot happen yet (FSDP, tp pieces)."""
    first, last = (split_model(tiny_gpt2(tied=True), "pp2 1f1b mb2", rank)[0] for rank in (0, 1))
    assert "transformer.wte.weight" in first.state_dict() and "lm_head.weight" in last.state_dict()
    assert [set(tie.names) for tie in first.pipeline_ties] == [{"transformer.wte.weight", "lm_head.weight"}]
    assert first.pipeline_ties == last.pipeline_ties
    with pytest.raises(ValueError, match=r"zero 2/3.*tie_word_embeddings=False"):
        split_model(tiny_gpt2(tied=True), "dp2 pp2 zero3 1f1b mb2", 0)
    with pytest.raises(ValueError, match=r"tensor-parallel pieces.*tie_word_embeddings=False"):
        split_model(tiny_gpt2(tied=True), "tp2 pp2 1f1b mb2", 0)


def test_split_refuses_a_decoder_that_runs_a_module_out_of_its_registration_order():
    """Llama with its final norm registered before its layers: the last stage would not hold the
    norm it runs, so the first step says so instead of scoring zeros."""
    model = tiny_llama()
    inner = model.model
    layers, rotary = inner.layers, inner.rotary_emb
    del inner.layers, inner.rotary_emb
    inner.layers, inner.rotary_emb = layers, rotary  # registered again, now after the norm
    first, last = (split_model(model, "pp2 1f1b mb2", rank)[0] for rank in (0, 1))
    hidden = first(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"model.norm is registered before the decoder's layers, so the first "
                                         r"pipeline stage holds it, but the model's forward runs it after"):
        last(hidden)


def test_split_rejects_rank_outside_pipeline():
    with pytest.raises(ValueError, match="pp_rank=2 is outside 0..1"):
        split_model(tiny_gpt(), "pp2 1f1b mb2", 2)


# ---- training on the cluster --------------------------------------------------------------------
@pytest.mark.parametrize("layout", SCHEDULES)
def test_schedule_trains_like_single_process(cluster2, layout):
    data = batches(20)
    model = tiny_gpt()
    results = cluster2.run(train_pipelined, layout, model, data, model.loss_fn)
    ref_losses, ref_state = train_single_process(tiny_gpt(), data, tiny_gpt().loss_fn)

    for result in results:
        assert result["losses"] == pytest.approx(ref_losses, rel=RTOL)
        assert all(0.0 <= b < 1.0 for b in result["bubbles"])
    assert results[0]["losses"] == results[1]["losses"], "pp ranks disagree on the loss"
    assert [r["stage_ids"] for r in results] == [stage_ids(Layout.parse(layout), r) for r in range(2)]
    gathered = {name: t for r in results for name, t in r["state"].items()}
    assert sorted(gathered) == sorted(ref_state)
    for name, tensor in gathered.items():
        torch.testing.assert_close(tensor, ref_state[name], rtol=RTOL, atol=PARAM_ATOL)


@pytest.mark.slow
def test_fsdp_sharded_stages_train_like_single_process(cluster4):
    data = batches(10)
    results = cluster4.run(train_fsdp_pipelined, "dp2 pp2 zero3 1f1b mb2", tiny_gpt(), data)
    ref_losses, ref_state = train_single_process(tiny_gpt(), data, tiny_gpt().loss_fn)
    for result in results:
        assert result["losses"] == pytest.approx(ref_losses, rel=RTOL)
    for result in results:  # every dp rank of a stage gathers the same full parameters
        for name, tensor in result["state"].items():
            torch.testing.assert_close(tensor, ref_state[name], rtol=RTOL, atol=PARAM_ATOL)
    assert sorted({n for r in results for n in r["state"]}) == sorted(ref_state)


def test_llama_pipeline_trains_like_single_process(cluster2):
    data = batches(5)
    results = cluster2.run(train_pipelined, "pp2 zbv v2 mb2", tiny_llama(), data, flat_cross_entropy)
    ref_losses, ref_state = train_single_process(tiny_llama(), data, flat_cross_entropy)
    for result in results:
        assert result["losses"] == pytest.approx(ref_losses, rel=RTOL)
    gathered = {name: t for r in results for name, t in r["state"].items()}
    assert sorted(gathered) == sorted(ref_state)
    for name, tensor in gathered.items():
        torch.testing.assert_close(tensor, ref_state[name], rtol=RTOL, atol=PARAM_ATOL)


def test_loss_scale_accumulates_like_one_big_batch(cluster2):
    (inputs, targets), = batches(1)
    results = cluster2.run(accumulate_two_halves, "pp2 1f1b mb2", tiny_gpt(), inputs, targets)

    reference = tiny_gpt()
    half = inputs.shape[0] // 2
    half_losses = [reference.loss_fn(reference(inputs[s]), targets[s]).item()
                   for s in (slice(None, half), slice(half, None))]
    reference.loss_fn(reference(inputs), targets).backward()
    for losses, grads in results:
        assert losses == pytest.approx(half_losses, rel=RTOL)
        for name, grad in grads.items():
            expected = dict(reference.named_parameters())[name].grad
            torch.testing.assert_close(grad, expected, rtol=RTOL, atol=RTOL * expected.abs().max().item())


def test_new_batch_shape_rebuilds_the_schedule(cluster2):
    data = batches(1, batch=8) + batches(1, batch=4, seq=8) + batches(1, batch=8)
    model = tiny_gpt()
    results = cluster2.run(train_pipelined, "pp2 interleaved v2 mb2", model, data, model.loss_fn, lr=0.0)
    with torch.no_grad():
        expected = [model.loss_fn(model(x), y).item() for x, y in data]
    for result in results:
        assert result["losses"] == pytest.approx(expected, rel=RTOL)


def test_batch_that_does_not_split_into_microbatches_is_refused(cluster2):
    with pytest.raises(Exception, match="batch of 7 does not split into microbatches=2"):
        cluster2.run(step_with_batch, "pp2 1f1b mb2", tiny_gpt(), 7)
    # the refusal happened before any communication: the same engines still train
    assert cluster2.run(step_with_batch, "pp2 1f1b mb2", tiny_gpt(), 8)[0] > 0


def test_wrong_number_of_parts_is_refused(cluster2):
    with pytest.raises(Exception, match=r"holds stages \[0, 3\] but got 1 parts"):
        cluster2.run(runner_with_parts, "pp2 zbv v2 mb2", tiny_gpt(), 1)


def test_split_refuses_a_model_it_cannot_cut():
    with pytest.raises(TypeError, match="Sequential is neither; use pp=1"):
        split_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), "pp2 1f1b mb2", 0)


def test_split_refuses_an_impossible_schedule():
    with pytest.raises(ValueError, match="set virtual_stages=2"):
        split_model(tiny_gpt(), "pp2 zbv v1 mb2", 0)
