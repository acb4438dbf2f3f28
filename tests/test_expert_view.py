"""The dashboard's expert heat map: a MoE run's frames draw the newest step's layer × expert token
counts (SVG cells carry the counts, the PNG picture colours each cell by its count), a dense run's
frames are unchanged, and on two real engines under dp2 ep2 the map's counts equal a one-process
count of the routers' choices for the same batch."""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

import cloudpickle
import numpy as np
import torch
from parity import LR, MOE_SIZES, SEED, build_model, engine_model
from picture import SVG, assert_png_heat_map, heat_cells
from test_dashboard import PNG_MAGIC, display_ids, published, row

from colab_par.views.dashboard import PANELS, LiveDashboard
from colab_par.training.telemetry import expert_counts, expert_row_key, metrics_data

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import test modules

def expert_columns(counts: list[list[float]]) -> dict[str, float]:
    return {expert_row_key(layer, expert): value
            for layer, per_expert in enumerate(counts) for expert, value in enumerate(per_expert)}


# ---- frames from rows ------------------------------------------------------------------------------
STEP_COUNTS = {1: [[5, 0, 3, 8], [1, 1, 14, 0]], 2: [[2, 6, 4, 4], [9, 3, 0, 4]]}


def test_heat_map_shows_the_newest_steps_counts_in_svg_and_png():
    dash = LiveDashboard(mode="text")
    rows = [row(step, 0, **expert_columns(counts)) for step, counts in STEP_COUNTS.items()]
    dash.update([metrics_data({"rank": 0, "run": 1, "total_steps": 2}, rows)])
    maps = heat_cells(dash.svg())
    assert list(maps) == ["tokens per expert, step 2 · busiest expert 2.25× the mean"]  # 9 / mean 4
    assert list(maps.values()) == [STEP_COUNTS[2]]
    png = dash.png()
    assert png.startswith(PNG_MAGIC)
    assert_png_heat_map(dash, png, STEP_COUNTS[2])


def test_a_dense_run_draws_no_heat_map_and_keeps_its_frame():
    dense, moe = LiveDashboard(mode="text"), LiveDashboard(mode="text")
    dense.update([published(0, range(1, 4))])
    moe.update([metrics_data({"rank": 0, "run": 1}, [row(s, 0, **expert_columns(c))
                                                    for s, c in STEP_COUNTS.items()])])
    svg = ET.fromstring(dense.svg())
    assert (svg.get("width"), svg.get("height")) == ("792", "396")
    assert heat_cells(dense.svg()) == {} and len(svg.findall(f"{SVG}g[@class='plot']")) == len(PANELS)
    assert not any(panel.heat for panel in dense.panels())
    assert ET.fromstring(moe.svg()).get("height") == "594"  # one row more for the map
    # the dense plots keep their place and size in the MoE picture
    for a, b in zip(dense.panels(), moe.panels()):
        assert a.title == b.title and np.abs(np.subtract(a.box, b.box)).max() <= 2


def test_expert_counts_reads_back_what_the_row_keys_name():
    counts = [[1.0, 0.0, 7.0], [2.0, 3.0, 0.0]]
    assert expert_counts({"loss": 1.0, **expert_columns(counts)}) == counts
    assert expert_counts({"loss": 1.0}) == []


# ---- a real dp2 ep2 run against a one-process count of the routers' choices ------------------------
STEPS = 2
DATA = dict(vocab_size=MOE_SIZES["vocab_size"], seq_len=MOE_SIZES["seq_len"], batch_size=4, seed=7)


def _train_rows(layout: str) -> list[dict]:
    from colab_par import parallelize
    from colab_par.data import SyntheticDataset
    from colab_par.training.trainer import Trainer

    pm = parallelize(engine_model("gpt-moe-aux", "module"), layout,
                     optimizer_fn=lambda p: torch.optim.AdamW(p, lr=LR))
    trainer = Trainer(pm, SyntheticDataset(**DATA), steps=STEPS)
    trainer.fit()
    return trainer.history


def _routers_choices_last_step() -> list[list[float]]:
    """One process: train the same model on the same global batches; on the last step's batch,
    count per MoE layer which experts its router's top-k picks for every token (from the router's
    own logits, captured at each layer's input, not from the layer's dispatch)."""
    from colab_par.data import SyntheticDataset
    from colab_par.parallel.experts import moe_layers

    model, data = build_model("gpt-moe-aux", SEED), SyntheticDataset(**DATA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    inputs_of: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(moe_layers(model)):
        layer.register_forward_pre_hook(lambda _, args, index=index: inputs_of.__setitem__(index, args[0]))
    for step in range(STEPS):
        inputs, targets = data.batch(step)
        model.loss_fn(model(inputs), targets).backward()
        if step < STEPS - 1:
            optimizer.step()
            optimizer.zero_grad()
    counts = []
    with torch.no_grad():
        for index, layer in enumerate(moe_layers(model)):
            tokens = inputs_of[index].reshape(-1, MOE_SIZES["d_model"])
            chosen = layer.router(tokens).float().softmax(-1).topk(MOE_SIZES["top_k"], dim=-1).indices
            counts.append(torch.bincount(chosen.reshape(-1), minlength=MOE_SIZES["n_experts"]).tolist())
    return [[float(n) for n in layer] for layer in counts]


def test_heat_map_of_a_dp2_ep2_run_counts_the_routers_choices(cluster2, captured):
    """Two engines train the MoE GPT under dp2 ep2 through the real display path (datapub, the
    client's dashboard): the final PNG's map has the colours of the one-process counts, and a
    dashboard fed the ranks' rows draws exactly those counts in its SVG cells."""
    expected = _routers_choices_last_step()
    assert sum(expected[0]) == DATA["batch_size"] * DATA["seq_len"] * MOE_SIZES["top_k"]
    assert len({n for layer in expected for n in layer}) > 1  # uneven: colours tell counts apart
    cluster2.dashboard = True  # the fixture runs without it; the magics turn it on
    try:
        histories = cluster2.run(_train_rows, "dp2 ep2")
    finally:
        cluster2.dashboard = False
    ids = display_ids(captured)
    assert len(set(ids)) == 1 and ids[0]
    final = captured[-1]["data"]["image/png"]
    assert final.startswith(PNG_MAGIC)
    assert captured[-1]["data"]["text/plain"].startswith(f"step {STEPS}/{STEPS}")

    dash = LiveDashboard(mode="text")
    dash.update([metrics_data({"rank": rank, "run": 1, "total_steps": STEPS}, history)
                 for rank, history in enumerate(histories)])
    maps = heat_cells(dash.svg())
    assert len(maps) == 1 and next(iter(maps)).startswith(f"tokens per expert, step {STEPS}")
    assert next(iter(maps.values())) == expected
    assert_png_heat_map(dash, final, expected)
