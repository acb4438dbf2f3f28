"""Pipeline parallel for models the kit did not write: torch's `pipeline()` traces them, splits them
before user-named modules or before blocks balanced by parameter count, and the runner trains
tuple and dict batches with a user `loss_fn(outputs, batch)`.

Splitting is checked in-process (names and values equal the model's state_dict, chained stages
compute the model's outputs, the automatic cut is the best one by brute force, refusals come before
any work). Training runs on a real 2-engine gloo cluster, driving `split_model` + `PipelineRunner`
directly, and must match single-process training of the same model on the same batches
(`parity.reference_run`): losses and gradient norms within 1e-5 relative, every final parameter
within the tolerance Adam's arithmetic gives it (see `parity.assert_parity`).
"""
from __future__ import annotations

import itertools
import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F
from any_models import build
from parity import LR, SEED, STEPS, assert_parity, build_model, reference_run, training_batches
from torch import nn

from colab_par.layout import Layout
from colab_par.data.batch import slice_batch
from colab_par.parallel.pipeline import auto_split_points, split_model, stage_ids

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def token_loss(logits, targets):
    raise AssertionError("step_batch scored a microbatch with the token loss, not batch_loss_fn")


def classifier_loss(outputs, batch):
    """A user's loss on a dict batch: the model returns logits, the labels are in the batch."""
    return F.cross_entropy(outputs, batch["labels"])


def example_of(kind: str, layout: str):
    """One microbatch of the first global batch (pp only: every rank's share is the whole batch)."""
    return slice_batch(training_batches(kind, 1)[0], Layout.parse(layout).microbatches, 0)


# ---- engine side (shipped by value) ---------------------------------------------------------------
def train_pipelined(kind: str, layout: str, split_points=None, loss_fn=None, steps: int = STEPS):
    """`split_model` + `PipelineRunner.step_batch` + AdamW on every engine, as parallelize will."""
    import torch
    import torch.distributed as dist

    from colab_par.data.batch import default_batch_loss
    from colab_par.parallel.pipeline import PipelineRunner, split_model

    model = build_model(kind, SEED)
    batches = training_batches(kind, steps)
    parts = split_model(model, layout, dist.get_rank(), split_points=split_points,
                        example_batch=example_of(kind, layout))
    runner = PipelineRunner(parts, layout, dist.group.WORLD, token_loss, "cpu",
                            batch_loss_fn=loss_fn or default_batch_loss)
    optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=LR)
    losses, grad_norms, bubbles = [], [], []
    for batch in batches:
        losses.append(runner.step_batch(batch))
        bubbles.append(runner.last_bubble)
        squares = sum(p.grad.double().square().sum() for part in parts for p in part.parameters())
        dist.all_reduce(squares)
        grad_norms.append(squares.sqrt().item())
        optimizer.step()
        optimizer.zero_grad()
    mine = {name: t.detach().clone() for part in parts for name, t in part.state_dict().items()}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    state = {k: v for piece in gathered for k, v in piece.items()} if gathered else {}
    return {"losses": losses, "grad_norms": grad_norms, "state": state, "bubbles": bubbles,
            "stage_ids": runner.stage_ids}


def assert_trains_like_single_process(results, kind: str, layout: str) -> None:
    assert_parity(results, reference_run(kind))
    assert [r["stage_ids"] for r in results] == [stage_ids(Layout.parse(layout), r) for r in range(2)]
    assert all(0.0 <= b < 1.0 for r in results for b in r["bubbles"])


# ---- training on the cluster -----------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["pp2 gpipe mb2", "pp2 1f1b mb2"])
def test_cnn_auto_split_trains_like_single_process(cluster2, layout):
    """(images, labels) batches, split automatically before a conv block, default loss."""
    results = cluster2.run(train_pipelined, "cnn", layout)
    assert_trains_like_single_process(results, "cnn", layout)
    with pytest.raises(AssertionError):  # negative control: a 1 % different learning rate fails
        assert_parity(results, reference_run("cnn", lr=LR * 1.01))


def test_dict_batch_with_user_loss_and_split_points_trains_like_single_process(cluster2):
    """input_ids + attention_mask + labels; the user names the split point and the loss."""
    layout = "pp2 1f1b mb2"
    results = cluster2.run(train_pipelined, "classifier", layout, ["layers.1"], classifier_loss)
    assert_trains_like_single_process(results, "classifier", layout)


@pytest.mark.parametrize("layout", ["pp2 interleaved v2 mb2", "pp2 zbv v2 mb2"])
def test_values_relayed_past_a_stage_train_like_single_process(cluster2, layout):
    """Four stages on two ranks: the padding mask stage 0 computes reaches stages 2 and 3 through
    the stages between, and the last stage reads the attention mask from the batch itself."""
    results = cluster2.run(train_pipelined, "classifier", layout, ["layers.0", "layers.1", "head"],
                           classifier_loss)
    assert_trains_like_single_process(results, "classifier", layout)


def test_token_model_trains_through_the_batch_path(cluster2):
    """colab_par's GPT keeps its layer split; step_batch((tokens, targets)) trains it like `step`."""
    layout = "pp2 1f1b mb2"
    assert_trains_like_single_process(cluster2.run(train_pipelined, "gpt", layout), "gpt", layout)


# ---- splitting (in-process) ------------------------------------------------------------------------
def all_stages(model, layout: str, **options) -> dict[int, nn.Module]:
    layout = Layout.parse(layout)
    stages = {}
    for rank in range(layout.pp):
        stages.update(zip(stage_ids(layout, rank), split_model(model, layout, rank, **options)))
    return stages


def run_chained(stages: dict[int, nn.Module], batch, n_microbatches: int = 1):
    """The stages called one after another on `batch`, fed the way PipelineRunner feeds them."""
    io = stages[0].pipeline_io
    inputs, sent = io.inputs(batch, n_microbatches), ()
    for stage in sorted(stages):
        out = stages[stage](*sent, **inputs)
        sent = out if isinstance(out, tuple) else (out,)
    return io.outputs(sent)


@pytest.mark.parametrize("kind,layout,points", [
    ("cnn", "pp2 1f1b mb2", None),
    ("classifier", "pp2 1f1b mb2", ["layers.1"]),
    ("classifier", "pp2 zbv v2 mb2", ["layers.0", "layers.1", "head"]),
])
def test_split_keeps_names_values_and_function(kind, layout, points):
    model = build(kind, SEED)
    original = {name: t.clone() for name, t in model.state_dict().items()}
    example = example_of(kind, layout)
    stages = all_stages(model, layout, split_points=points, example_batch=example)
    assert sorted(stages) == list(range(len(stages)))

    names = [name for part in stages.values() for name in part.state_dict()]
    assert len(names) == len(set(names)), "a tensor lives on two stages"
    assert sorted(names) == sorted(original), "stage names differ from the model's state_dict"
    for part in stages.values():
        for name, tensor in part.state_dict().items():
            assert torch.equal(tensor, original[name]), name
    assert all(torch.equal(t, original[n]) for n, t in model.state_dict().items()), "source changed"

    expected = model(*example[:-1]) if isinstance(example, tuple) else model(
        example["input_ids"], example["attention_mask"])
    torch.testing.assert_close(run_chained(stages, example), expected, rtol=1e-6, atol=1e-6)


class Stack(nn.Module):
    """Blocks of very different sizes, so an even split by block count is a bad split."""

    def __init__(self, widths: list[int]):
        super().__init__()
        self.stem = nn.Linear(4, widths[0])
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(w, w), nn.Tanh()) for w in widths)
        self.head = nn.Linear(widths[-1], 3)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x[..., :1].expand(*x.shape[:-1], block[0].in_features))
        return self.head(x)


def stage_params(stages: dict[int, nn.Module]) -> list[int]:
    return [sum(p.numel() for p in stages[s].parameters()) for s in sorted(stages)]


@pytest.mark.parametrize("layout", ["pp2 1f1b mb2", "pp2 interleaved v2 mb2"])
def test_auto_split_gives_the_best_parameter_balance(layout):
    model = Stack([16, 2, 2, 2, 2, 12, 2, 2])
    n_stages = Layout.parse(layout).pp * Layout.parse(layout).virtual_stages
    x = torch.randn(2, 4)
    stages = all_stages(model, layout, example_batch=(x, torch.zeros(2)))
    got = stage_params(stages)
    assert sum(got) == sum(p.numel() for p in model.parameters())

    # Independent reference: every way to cut the blocks into n_stages non-empty runs, stem on the
    # first stage and head on the last; the split must reach the smallest possible largest stage.
    sizes = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    stem, head = (sum(p.numel() for p in m.parameters()) for m in (model.stem, model.head))
    best = min(max(sum(sizes[a:b]) + (stem if a == 0 else 0) + (head if b == len(sizes) else 0)
                   for a, b in zip((0, *cuts), (*cuts, len(sizes))))
               for cuts in itertools.combinations(range(1, len(sizes)), n_stages - 1))
    assert max(got) == best
    assert max(got) < max(stage_params(all_stages(  # an even split by block count is worse
        model, layout, example_batch=(x, torch.zeros(2)),
        split_points=[f"blocks.{i * len(sizes) // n_stages}" for i in range(1, n_stages)])))
    torch.testing.assert_close(run_chained(stages, (x, None)), model(x), rtol=1e-6, atol=1e-6)


def test_auto_split_uses_named_block_classes():
    model = Stack([16, 2, 2, 2, 2, 12, 2, 2])
    # Found automatically the blocks are blocks.<i>; named as nn.Linear they are the stem, every
    # blocks.<i>.0 and the head: stem + blocks.0.0 (352 parameters) against the other 201.
    assert auto_split_points(model, 2) == ["blocks.1"]
    assert auto_split_points(model, 2, [nn.Linear]) == ["blocks.1.0"]
    assert auto_split_points(model, 2, ["Linear"]) == ["blocks.1.0"]


# ---- refusals, all before any work ---------------------------------------------------------------
class Branchy(nn.Module):
    """Python control flow on a tensor's value: one graph cannot hold it."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) if x.sum() > 0 else -layer(x)
        return x


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.out = nn.Linear(4, 8, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.spare = nn.Linear(4, 4)

    def forward(self, x):
        return self.layers[1](self.layers[0](x))


class Reused(nn.Module):
    """Calls one block twice, so splitting before it cuts twice."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        return self.layers[1](self.layers[1](self.layers[0](x)))


CNN_BATCH = (torch.randn(2, 1, 8, 8), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("make,options,error,match", [
    (lambda: build("cnn", 0), {}, TypeError, "NotebookCNN is neither; use pp=1.*example_batch="),
    (lambda: build("cnn", 0), {"layout": "pp4 1f1b mb4", "example_batch": CNN_BATCH}, ValueError,
     "has 3 repeated blocks .*pp·virtual_stages = 4 stages.*split_points="),
    (lambda: build("cnn", 0), {"split_points": ["features.9"], "example_batch": CNN_BATCH},
     ValueError, r"split point 'features.9' names no module of NotebookCNN; .* e.g. \['features'"),
    (lambda: build("cnn", 0), {"split_points": ["features.2", "head"], "example_batch": CNN_BATCH},
     ValueError, "2 split points make 3 stages, but the layout has pp·virtual_stages = 2"),
    (lambda: build("cnn", 0), {"split_points": "head", "example_batch": CNN_BATCH}, TypeError,
     "give a list of module names"),
    (lambda: build("cnn", 0), {"block_types": ["Conv3d"], "example_batch": CNN_BATCH}, ValueError,
     r"blocks=\['Conv3d'\] match no module"),
    (lambda: build("cnn", 0), {"layout": "pp2 tp2 1f1b mb2", "example_batch": CNN_BATCH},
     ValueError, "use tp=1 and cp=1 with pp"),
    (Reused, {"split_points": ["layers.1"], "example_batch": (torch.randn(2, 4), None)},
     ValueError, "split Reused into 3 stages, not pp·virtual_stages = 2: .* called more than once"),
    (Unused, {"split_points": ["layers.0"], "example_batch": (torch.randn(2, 4), None)},
     ValueError, "split Unused into 1 stages, .*its stage would be empty"),
    (Branchy, {"example_batch": (torch.randn(2, 4), None)}, ValueError,
     "could not trace Branchy .* remove data-dependent Python control flow .* or use pp=1"),
    (Tied, {"layout": "dp2 pp2 zero3 1f1b mb2",
            "example_batch": (torch.zeros(2, 3, dtype=torch.long), None)}, ValueError, r"\['embed.weight', 'out.weight'\] are one tied tensor used by stages \[0, 1\].*zero=0 or 1.*untie"),
    (Unused, {"example_batch": (torch.randn(2, 4), None)}, ValueError,
     "spare.weight is not used by forward, so no pipeline stage would hold it.* delete the unused module"),
])
def test_split_refuses_what_cannot_work(make, options, error, match):
    layout = options.pop("layout", "pp2 1f1b mb2")
    with pytest.raises(error, match=match):
        split_model(make(), layout, 0, **options)


def test_batch_the_trace_does_not_fit_is_refused():
    stages = all_stages(build("cnn", 0), "pp2 1f1b mb2", example_batch=CNN_BATCH)
    io = stages[0].pipeline_io
    assert set(io.inputs((torch.randn(4, 1, 8, 8), None), 2)) == {"input_0"}
    with pytest.raises(ValueError, match=r"traced for microbatches of \(2, 1, 8, 8\).* must be "
                                         r"\(4, 1, 8, 8\).*drop_last=True"):
        io.inputs((torch.randn(6, 1, 8, 8), None), 2)
    with pytest.raises(ValueError, match="structure differs from the example batch"):
        io.inputs((torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8), None), 2)
