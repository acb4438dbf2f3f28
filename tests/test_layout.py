"""Layout: the compact string form round-trips, and every validation rule fails with a message that
names the broken rule and a valid alternative."""
from __future__ import annotations

import itertools

import pytest

from colab_par.layout import (CHECKPOINTING, CP_MODES, FIELDS, PP_SCHEDULES, PRECISIONS, TP_MODES,
                              ZERO_LEVELS, Layout, LayoutError, field_options, grid_batch_chunks,
                              tensor_grid, valid_layouts)
from colab_par.models.gpt import GPTConfig
from colab_par.layout.tier_options import MemoryTiers

CONFIG = GPTConfig(vocab_size=128, seq_len=64, n_layer=4, n_head=8, n_kv_head=4, d_model=64,
                   ffn_hidden=192)


# ---- string form -------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "dp2 tp2 zero3", "pp2 interleaved mb4 v2 bf16", "cp2 ulysses", "dp4 zero2 offload",
    "tp2 sp ac-selective", "pp4 gpipe mb8", "dp2 cp2 ac-full", "pp2 zbv v2", "pp2 1f1b",
    "pp4 1f1b mb8", "dp2 pp2 gpipe mb1", "tp4 2d", "tp8 2.5d d2", "tp8 3d", "dp2 tp4 2d zero3",
    "dp2 zero3 ac-selective compile", "tp2 sp bf16 compile",
])
def test_parse_and_str_round_trip(text: str) -> None:
    layout = Layout.parse(text)
    assert str(layout) == text
    assert Layout.parse(str(layout)) == layout


def test_parse_reads_each_field() -> None:
    layout = Layout.parse("dp2 tp4 pp2 cp2 zero3 offload sp ulysses interleaved mb8 v2 bf16 ac-full "
                          "compile")
    assert layout == Layout(dp=2, tp=4, pp=2, cp=2, zero=3, offload=True, sequence_parallel=True,
                            cp_mode="ulysses", pp_schedule="interleaved", microbatches=8,
                            virtual_stages=2, precision="bf16", checkpointing="full", compile=True)
    assert layout.world_size == 32


def test_every_field_combination_round_trips() -> None:
    """str() must be faithful even for non-default options whose degree is 1 (no silent drops)."""
    for schedule, mode, precision, ac, zero in itertools.product(
            ("gpipe", "1f1b", "interleaved", "zbv"), ("ring", "ulysses"), ("fp32", "bf16"),
            ("none", "selective", "full"), (0, 3)):
        layout = Layout(dp=2, zero=zero, pp_schedule=schedule, cp_mode=mode, precision=precision,
                        checkpointing=ac)
        assert Layout.parse(str(layout)) == layout


# ---- default microbatches: every layout string trains as written ------------------------------
@pytest.mark.parametrize("text,count", [("pp2", 2), ("pp4 gpipe", 4), ("pp2 zbv v2", 2),
                                        ("pp2 interleaved v2", 2), ("dp2", 1), ("dp2 pp2", 2)])
def test_default_microbatches_fill_the_pipeline(text: str, count: int) -> None:
    layout = Layout.parse(text)
    assert layout.microbatches == count
    assert layout.validate(layout.world_size, CONFIG, global_batch=8) is layout
    assert layout == Layout.parse(f"{text} mb{count}")  # the default is the explicit count


def test_pp2_alone_is_valid() -> None:
    assert Layout(pp=2).validate(2, CONFIG) == Layout.parse("pp2 1f1b mb2")


def test_replace_lets_a_default_count_follow_the_pipeline() -> None:
    assert Layout(dp=2).replace(dp=1, pp=2).microbatches == 2
    assert Layout(pp=2).replace(pp=4).microbatches == 4
    assert Layout(pp=2, microbatches=4).replace(pp=4).microbatches == 4  # an explicit count stays
    assert Layout(pp=2).replace(pp=4, microbatches=2).microbatches == 2


def test_parse_accepts_a_layout_and_commas() -> None:
    layout = Layout(dp=2, tp=2, zero=3)
    assert Layout.parse(layout) is layout
    assert Layout.parse("dp2, tp2, zero3") == layout


def test_parse_rejects_unknown_token_and_lists_valid_ones() -> None:
    with pytest.raises(LayoutError, match=r"unknown layout token 'dq2'.*'dp2 tp2 pp2 cp2'"):
        Layout.parse("dq2 tp2")


def test_parse_rejects_conflicting_tokens() -> None:
    with pytest.raises(LayoutError, match=r"sets dp twice \(2 and 4\); keep one"):
        Layout.parse("dp2 dp4")


def test_parse_rejects_non_string() -> None:
    with pytest.raises(LayoutError, match="string like 'dp2 tp2 zero3'"):
        Layout.parse(4)


# ---- every rule its own test -------------------------------------------------------------------
def _error(layout: Layout, world: int | None = None, config=None, **kwargs) -> str:
    with pytest.raises(LayoutError) as info:
        layout.validate(world, config, **kwargs)
    return str(info.value)


def _accepted(text: str, config=None, **context) -> Layout:
    """Validate the layout `text` names for its own world size: it must come back as the same
    object, whose string form parses back to it; callers check the fields it holds."""
    layout = Layout.parse(text)
    assert layout.validate(layout.world_size, config, **context) is layout
    assert Layout.parse(str(layout)) == layout
    return layout


def _fields(layout: Layout) -> dict:
    """The fields that differ from the default layout's."""
    return {name: value for name, value in layout.to_dict().items() if value != getattr(Layout(), name)}


def test_valid_layouts_pass_and_return_self() -> None:
    for text, fields in [
            ("dp2", dict(dp=2)), ("dp2 tp2 zero3 sp", dict(dp=2, tp=2, zero=3, sequence_parallel=True)),
            ("pp2 1f1b mb2", dict(pp=2, microbatches=2)),
            ("pp2 interleaved mb4 v2", dict(pp=2, pp_schedule="interleaved", microbatches=4, virtual_stages=2)),
            ("cp2", dict(cp=2)), ("cp2 ulysses", dict(cp=2, cp_mode="ulysses")),
            ("dp4 zero2 offload", dict(dp=4, zero=2, offload=True)), ("dp2 zero1", dict(dp=2, zero=1))]:
        layout = _accepted(text, CONFIG, device="A100-80GB", global_batch=8)
        assert _fields(layout) == fields, text


def _refused(**fields) -> str:
    with pytest.raises(LayoutError) as info:
        Layout(**fields)
    return str(info.value)


@pytest.mark.parametrize("field,bad,valid", [
    ("zero", 9, "0, 1, 2, 3"), ("zero", True, "0, 1, 2, 3"), ("zero", "3", "0, 1, 2, 3"),
    ("cp_mode", "spiral", "ring, ulysses"), ("precision", "fp8", "fp32, bf16"),
    ("pp_schedule", "zb", "gpipe, 1f1b, interleaved, zbv"),
    ("checkpointing", "some", "none, selective, full"),
])
def test_unknown_names_are_refused_when_built(field: str, bad, valid: str) -> None:
    message = _refused(**{field: bad})
    assert f"{field}={bad!r} is unknown; choose one of {valid}" == message


def test_domains_are_the_exported_ones() -> None:
    """The error lists exactly the exported domain: the picker and planner offer the same values."""
    for field, domain in (("zero", ZERO_LEVELS), ("cp_mode", CP_MODES), ("pp_schedule", PP_SCHEDULES),
                          ("precision", PRECISIONS), ("checkpointing", CHECKPOINTING)):
        for value in domain:
            assert getattr(Layout(**{field: value}), field) == value


def test_parse_refuses_out_of_domain_values() -> None:
    with pytest.raises(LayoutError, match=r"zero=9 is unknown; choose one of 0, 1, 2, 3"):
        Layout.parse("zero9 dp2")


def test_booleans_are_refused_when_built() -> None:
    assert _refused(offload="yes") == "offload='yes' must be True or False"
    assert _refused(sequence_parallel=1) == "sequence_parallel=1 must be True or False"
    assert _refused(compile="yes") == "compile='yes' must be True or False"


@pytest.mark.parametrize("field", ["dp", "tp", "pp", "cp", "microbatches", "virtual_stages"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_counts_must_be_positive_integers_when_built(field: str, bad) -> None:
    message = _refused(**{field: bad})
    hint = "leave it out for the default" if field == "microbatches" else "use 1 to turn it off"
    assert message == f"{field}={bad!r} must be a positive integer; {hint}"


def test_rule_product_equals_world() -> None:
    message = _error(Layout(tp=2), 8)
    assert "dp·tp·pp·cp = 1·2·1·1 = 2 but the world has 8 ranks" in message
    assert "try dp=4" in message
    assert "e.g. dp=6" in _error(Layout(tp=4), 6)


def test_rule_world_size_positive() -> None:
    assert "world_size=0 must be a positive integer" in _error(Layout(), 0)


def test_rule_zero_needs_data_parallel() -> None:
    message = _error(Layout(tp=2, zero=3), 2)
    assert "zero=3 shards over data parallel ranks but dp=1" in message and "zero=0" in message


def test_rule_offload_needs_fsdp() -> None:
    message = _error(Layout(dp=2, zero=1, offload=True), 2)
    assert "offload" in message and "needs zero=2 or zero=3" in message and "set zero=3" in message


def test_rule_zero1_is_plain_data_parallel() -> None:
    message = _error(Layout(dp=2, tp=2, zero=1), 4)
    assert "zero=1 (ZeroRedundancyOptimizer) works with plain data parallel only" in message
    assert "use zero=0, zero=2 or zero=3" in message


def test_data_parallel_over_tensor_parallel_without_zero_is_valid() -> None:
    """Megatron's DP x TP: tensor-parallel gradients are averaged over the dp group."""
    for text in ("dp2 tp2", "dp2 tp2 sp", "dp2 tp2 pp2 mb2", "dp2 tp2 cp2"):
        layout = _accepted(text, CONFIG, global_batch=8)
        assert (layout.dp, layout.tp, layout.zero) == (2, 2, 0), text


def test_rule_sequence_parallel_needs_tp() -> None:
    message = _error(Layout(dp=2, sequence_parallel=True), 2)
    assert "sequence_parallel (Megatron SP)" in message and "needs tp>1" in message


def test_rule_zbv_two_stages_per_rank() -> None:
    message = _error(Layout(pp=2, pp_schedule="zbv", microbatches=2, virtual_stages=3), 2)
    assert "'zbv' places exactly 2 stages per rank" in message and "set virtual_stages=2" in message


def test_rule_zbv_refuses_recompute() -> None:
    # selective: the real step fails (torch.utils.checkpoint: "Trying to backward an extra time"):
    # zbv's input and weight passes are two backwards over a region selective recompute lets back
    # once; full: the fullest rank holds more than without recompute (traced, docs/planner.md)
    for checkpointing in ("selective", "full"):
        message = _error(Layout(pp=2, pp_schedule="zbv", microbatches=2, virtual_stages=2,
                                checkpointing=checkpointing), 2)
        assert f"checkpointing={checkpointing!r} cannot save memory" in message, message
        assert "use checkpointing='none' with zbv" in message and "'1f1b' or 'interleaved' with recompute" in message
    Layout(pp=2, pp_schedule="zbv", microbatches=2, virtual_stages=2).validate(2)
    Layout(pp=2, pp_schedule="1f1b", microbatches=2, checkpointing="selective").validate(2)
    Layout(pp=2, pp_schedule="interleaved", microbatches=4, virtual_stages=2, checkpointing="full").validate(2)


def test_rule_interleaved_needs_virtual_stages() -> None:
    message = _error(Layout(pp=2, pp_schedule="interleaved", microbatches=2), 2)
    assert "'interleaved' needs virtual_stages>=2" in message and "'1f1b'" in message


def test_rule_single_stage_schedules() -> None:
    message = _error(Layout(pp=2, pp_schedule="1f1b", microbatches=2, virtual_stages=2), 2)
    assert "runs one stage per rank" in message and "pp_schedule='interleaved'" in message


def test_rule_virtual_stages_need_pipeline() -> None:
    message = _error(Layout(dp=2, virtual_stages=2), 2)
    assert "virtual_stages=2 splits pipeline stages but pp=1" in message and "pp=2" in message


def test_rule_microbatches_fill_the_pipeline() -> None:
    message = _error(Layout(pp=4, pp_schedule="1f1b", microbatches=2), 4)
    assert "needs microbatches >= pp (4)" in message and "set microbatches=4" in message
    assert "leave it out" in message
    assert _accepted("pp4 gpipe mb2").microbatches == 2  # GPipe runs with any count


def test_rule_interleaved_microbatches_multiple_of_pp() -> None:
    message = _error(Layout(pp=2, pp_schedule="interleaved", microbatches=3, virtual_stages=2), 2)
    assert "microbatches divisible by pp=2" in message and "try microbatches=4" in message


def test_rule_pipeline_with_context_parallel_unsupported() -> None:
    message = _error(Layout(pp=2, cp=2, microbatches=2), 4)
    assert "pipeline parallel with context parallel is not supported" in message
    assert "cp without pp" in message


def test_rule_sequence_parallel_inside_pipeline_unsupported() -> None:
    message = _error(Layout(pp=2, tp=2, sequence_parallel=True, microbatches=2), 4)
    assert "sequence_parallel inside pipeline stages is not supported" in message
    assert "drop 'sp' or set pp=1" in message


def test_rule_tp_divides_heads() -> None:
    config = {"n_head": 8, "n_kv_head": 8}
    assert _error(Layout(tp=3), 3, config) == "tp=3 does not divide 8 heads; try tp=2 or 4 or 8"


def test_rule_tp_divides_kv_heads() -> None:
    message = _error(Layout(tp=4), 4, {"n_head": 8, "n_kv_head": 2})
    assert "tp=4 does not divide 2 kv-heads" in message and "try tp=2" in message


def test_rule_ulysses_divides_local_heads() -> None:
    message = _error(Layout(tp=2, cp=8, cp_mode="ulysses", dp=1, zero=0), 16, CONFIG)
    assert "ulysses context parallel splits heads: cp=8" in message and "cp_mode='ring'" in message


def test_ulysses_accepts_kv_heads_that_cp_does_not_divide() -> None:
    """1 kv head per tp rank and cp=2: the rule lets it through (context.py repeats the head;
    tests/test_parallel_parity.py trains "tp2 cp2" on such a GQA model)."""
    gqa = {"n_head": 4, "n_kv_head": 2, "n_layer": 2, "seq_len": 16}
    layout = _accepted("tp2 cp2 ulysses", gqa)
    assert gqa["n_kv_head"] // layout.tp % layout.cp != 0  # cp does not divide the local kv heads


def test_rule_layers_split_into_stages() -> None:
    message = _error(Layout(pp=3, microbatches=3), 3, CONFIG)
    assert "4 layers do not split into pp·virtual_stages = 3" in message
    assert "try pp·virtual_stages=2 or 4" in message


def test_rule_sequence_divides_ring_chunks() -> None:
    message = _error(Layout(cp=2), 2, {"seq_len": 66})
    assert "seq_len=66 is not divisible by 4 (2·cp for load-balanced ring)" in message
    assert "multiple of 4" in message
    assert _accepted("cp2 ulysses", {"seq_len": 66, "n_head": 4}).cp_mode == "ulysses"  # no chunks


def test_rule_sequence_parallel_divides_local_sequence() -> None:
    message = _error(Layout(tp=4, sequence_parallel=True), 4, {"seq_len": 66})
    assert "sequence parallel splits the local sequence" in message and "multiple of 4" in message


def test_rule_tp_divides_ffn_width() -> None:
    message = _error(Layout(tp=4), 4, {"n_head": 8, "ffn_hidden": 90})
    assert "tp=4 does not divide the feed-forward width 90" in message and "try tp=2" in message


def test_rule_global_batch_splits_over_dp() -> None:
    message = _error(Layout(dp=4), 4, global_batch=6)
    assert "global_batch=6 does not split over dp=4" in message and "multiple of 4" in message


def test_rule_local_batch_splits_into_microbatches() -> None:
    message = _error(Layout(dp=2, pp=2, microbatches=4), 4, global_batch=4)
    assert "per-rank batch 2" in message and "microbatches=4" in message and "try microbatches=2" in message


def test_rule_bf16_needs_a_capable_device() -> None:
    assert "T4 has none (its DeviceSpec lists peaks for fp32 only); use precision='fp32'" in _error(
        Layout(precision="bf16"), 1, device="T4")
    assert "'V100' is not in the device catalogue; choose one of H100-80GB" in _error(
        Layout(precision="bf16"), 1, device="V100")  # no guess from the name: the catalogue or a DeviceSpec
    assert _accepted("bf16", device="H100-80GB").precision == "bf16"
    assert _accepted("bf16", device="cpu").precision == "bf16"  # torch has bf16 on CPUs (slow, but it runs)


# ---- multi-dimensional tensor parallel -----------------------------------------------------------
@pytest.mark.parametrize("tp,mode,depth,grid,chunks", [
    (4, "2d", 1, (2, 1), 2), (9, "2d", 1, (3, 1), 3), (4, "2.5d", 1, (2, 1), 2),
    (8, "2.5d", 2, (2, 2), 4), (18, "2.5d", 2, (3, 2), 6), (8, "3d", 1, (2, 2), 4),
    (27, "3d", 1, (3, 3), 9), (8, "2d", 1, None, 1), (4, "3d", 1, None, 1), (2, "2d", 1, None, 1),
    (4, "1d", 1, None, 1)])
def test_tensor_grid_shapes_and_batch_pieces(tp: int, mode: str, depth: int, grid, chunks: int) -> None:
    assert tensor_grid(tp, mode, depth) == grid
    assert grid_batch_chunks(Layout(tp=tp, tp_mode=mode, tp_depth=depth)) == chunks


def test_rule_grid_shape_names_the_valid_tp_values() -> None:
    assert _error(Layout.parse("tp8 2d"), 8) == ("tp=8 does not form a 2d grid (q×q, q >= 2); use "
                                                 "tp = 4, 9, 16, 25, ... or tp_mode='1d'")
    assert "use tp = 8, 27, 64" in _error(Layout.parse("tp4 3d"), 4)
    assert "(q×q×2, q >= 2); use tp = 8, 18, 32" in _error(Layout.parse("tp4 2.5d d2"), 4)


def test_rule_depth_belongs_to_2_5d() -> None:
    assert "tp_depth=2 is the depth of a 2.5d grid" in _error(Layout.parse("tp8 3d d2"), 8)
    assert "set tp_mode='2.5d' or tp_depth=1" in _error(Layout(tp=4, tp_depth=2), 4)


@pytest.mark.parametrize("text,expected", [
    ("tp4 2d sp", "sequence parallel is the 1d form of that: drop 'sp'"),
    ("tp4 2d cp2", "context parallel with 2d tensor parallel is not supported; use cp=1"),
    ("dp2 tp8 3d zero3", "places them on three; use zero=0, or tp_mode='2d'"),
    ("dp2 tp8 2.5d d2 zero2", "places them on three; use zero=0, or tp_mode='2d'"),
])
def test_rule_grid_modes_refuse_what_does_not_compose(text: str, expected: str) -> None:
    layout = Layout.parse(text)
    assert expected in _error(layout, layout.world_size, CONFIG)


def test_compile_composes_with_1d_layouts_and_refuses_what_it_cannot_compile() -> None:
    for text in ("dp2 compile", "dp2 zero1 compile", "dp2 zero3 offload bf16 ac-full compile",
                 "tp2 sp compile", "cp2 ulysses compile", "pp2 zbv v2 compile", "dp2 tp2 cp2 zero3 compile"):
        layout = Layout.parse(text)
        assert layout.validate(layout.world_size, CONFIG, global_batch=8) is layout
    assert ("compile is proven with 1d tensor parallel only" in _error(Layout.parse("tp4 2d compile"), 4)
            and "use tp_mode='1d' with compile, or drop 'compile'" in _error(Layout.parse("tp8 3d compile"), 8))
    no_blocks = {"generic_model": 1, "n_blocks": 0}
    assert "compile compiles each repeated block and this model has none" in _error(
        Layout.parse("dp2 compile"), 2, no_blocks)
    assert Layout.parse("dp2 compile").validate(2, {"generic_model": 1, "n_blocks": 3})


def test_grid_modes_compose_with_dp_zero_bf16_and_recompute() -> None:
    for text, fields in [
            ("dp2 tp4 2d zero3 bf16 ac-full",
             dict(dp=2, tp=4, tp_mode="2d", zero=3, precision="bf16", checkpointing="full")),
            ("dp2 tp4 2d zero2", dict(dp=2, tp=4, tp_mode="2d", zero=2)),
            ("dp2 tp8 3d", dict(dp=2, tp=8, tp_mode="3d")),
            ("tp8 2.5d d2 ac-selective", dict(tp=8, tp_mode="2.5d", tp_depth=2, checkpointing="selective")),
            ("pp2 tp4 2d mb2", dict(pp=2, tp=4, tp_mode="2d", microbatches=2)),
            ("pp2 tp8 3d zbv v2 mb2", dict(pp=2, tp=8, tp_mode="3d", pp_schedule="zbv", virtual_stages=2,
                                           microbatches=2))]:
        assert _fields(_accepted(text, CONFIG, global_batch=16)) == fields, text


def test_rule_grid_sizes_divide() -> None:
    heads = GPTConfig(vocab_size=128, n_head=6, n_kv_head=3, d_model=72, ffn_hidden=192)
    assert "the 2d grid side q=2 does not divide 3 kv-heads" in _error(Layout.parse("tp4 2d"), 4, heads)
    narrow = GPTConfig(vocab_size=129, n_head=3, d_model=6, ffn_hidden=192)
    assert ("a 3d grid of side q=3 splits d_model=6 into 9 pieces; use a d_model that is a multiple "
            "of 9") in _error(Layout.parse("tp27 3d"), 27, narrow)
    odd_vocab = GPTConfig(vocab_size=129, n_head=4, d_model=64, ffn_hidden=192)  # split unevenly
    assert Layout.parse("tp4 2d").validate(4, odd_vocab).tp_mode == "2d"


def test_rule_grid_splits_each_batch() -> None:
    message = _error(Layout.parse("dp2 tp8 3d"), 16, CONFIG, global_batch=4)
    assert message == ("3d tensor parallel splits each rank's (micro)batch of 2 sequences into 4 "
                       "pieces; use a global batch that is a multiple of 8")


def test_rule_grid_modes_are_for_the_kits_gpt() -> None:
    llama = {"hugging_face": True, "num_attention_heads": 4, "hidden_size": 64}
    assert "use tp_mode='1d' for this model" in _error(Layout.parse("tp4 2d"), 4, {"generic_model": 1, "tp_plan": 1})
    assert "use tp_mode='1d' for this model" in _error(Layout.parse("tp4 2d"), 4, llama)


def test_hugging_face_config_sizes_are_read() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=6, num_attention_heads=12,
                                      num_key_value_heads=4, hidden_size=768,
                                      intermediate_size=2048)
    assert "tp=8 does not divide 12 heads" in _error(Layout(tp=8), 8, config)
    assert "tp=3 does not divide 4 kv-heads" in _error(Layout(tp=3), 3, config)
    assert "6 layers do not split" in _error(Layout(pp=4, microbatches=4), 4, config)
    assert _fields(_accepted("tp2 pp3 mb3", config)) == dict(tp=2, pp=3, microbatches=3)


def test_rule_hugging_face_models_have_no_cp_or_sp() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
                                      intermediate_size=128, max_position_embeddings=64)
    message = _error(Layout(cp=2), 2, config)
    assert "context parallel needs colab_par's GPT" in message and "cp=1" in message
    assert "drop 'sp'" in _error(Layout(tp=2, sequence_parallel=True), 2, config)
    assert _accepted("cp2", {"n_head": 4, "seq_len": 64}).cp == 2  # plain sizes: the reference GPT


# ---- enumeration: exactly what validate accepts ------------------------------------------------
def _brute_force(world: int, config, grid: dict, **context) -> set[Layout]:
    """Every combination of the grid, kept when validate accepts it: the independent reference.

    Degrees whose product is not the world are skipped unasked: no layout of theirs is valid
    (`test_rule_product_equals_world`), and one that `valid_layouts` offered would still be missing
    here. That leaves a ninth of world 4's ten million combinations to validate.
    """
    others = {name: grid[name] for name in grid if name not in ("dp", "tp", "pp", "cp")}
    kept = set()
    for dp, tp, pp, cp in itertools.product(grid["dp"], grid["tp"], grid["pp"], grid["cp"]):
        if dp * tp * pp * cp != world:
            continue
        for values in itertools.product(*others.values()):
            layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, **dict(zip(others, values)))
            try:
                layout.validate(world, config, **context)
            except LayoutError:
                continue
            kept.add(layout)
    return kept


@pytest.mark.parametrize("world,context,every_option", [
    (4, dict(global_batch=8, device="T4"), True), (6, dict(global_batch=12), False), (8, {}, False)])
def test_valid_layouts_are_exactly_those_validate_accepts(world: int, context: dict,
                                                          every_option: bool) -> None:
    config = {"n_layer": 4, "n_head": 4, "n_kv_head": 2, "seq_len": 12, "ffn_hidden": 48}
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    grid = dict(tp=divisors, tp_mode=TP_MODES, tp_depth=(1, 2), cp=divisors, pp=divisors, dp=divisors, ep=(1,),
                pp_schedule=PP_SCHEDULES,
                virtual_stages=(1, 2), microbatches=(None, 1, 2, 4), zero=ZERO_LEVELS,
                sequence_parallel=(False, True), cp_mode=CP_MODES,
                offload=(False, True) if every_option else (False,),
                precision=PRECISIONS if every_option else ("fp32",),
                checkpointing=("none", "full") if every_option else ("none",),
                compile=(False, True) if every_option else (False,),
                tiers=(MemoryTiers(), MemoryTiers(budget="1GiB")) if every_option else (MemoryTiers(),))
    assert set(grid) == set(FIELDS)
    found = list(valid_layouts(world, config, **context, **grid))
    assert len(found) == len(set(found))
    expected = _brute_force(world, config, grid, **context)
    assert len(expected) > 50 and set(found) == expected


def test_valid_layouts_refuses_out_of_domain_choices_and_unknown_fields() -> None:
    with pytest.raises(LayoutError, match="zero=5 is unknown"):
        list(valid_layouts(2, zero=(0, 5)))
    with pytest.raises(LayoutError, match="unknown layout field.*zer0"):
        list(valid_layouts(2, zer0=(1,)))


def test_field_options_are_the_values_some_valid_layout_takes() -> None:
    config = {"n_layer": 6, "n_head": 4, "n_kv_head": 4, "seq_len": 12}
    options = field_options(6, config, global_batch=6, device="T4")
    every = list(valid_layouts(6, config, global_batch=6, device="T4"))
    for field in FIELDS:
        assert options[field] == sorted({getattr(layout, field) for layout in every},
                                        key=list(options[field]).index), field
    assert options["precision"] == ["fp32"] and options["tp"] == [1, 2] and options["pp"] == [1, 2, 3, 6]


def test_memory_tiers_tokens_round_trip_and_refusals() -> None:
    layout = Layout.parse("dp2 zero3 mem8GiB disk:/Scratch/Run optimizer@disk grads@host")
    assert layout.tiers == MemoryTiers(budget=8 * 2 ** 30, disk="/Scratch/Run", optimizer="disk", grads="host")
    assert Layout.parse(str(layout)) == layout and Layout(**layout.to_dict()) == layout
    assert Layout.parse("dp2 mem1.5GiB").tiers.budget == 3 * 2 ** 29
    assert Layout.parse("dp2 params@disk").tiers.disk_folder == "tmp"  # pinned to disk: default folder
    assert not Layout.parse("dp2").tiers.enabled and Layout.parse("dp2").tiers.disk_folder is None
    with pytest.raises(LayoutError, match="not understood"):
        Layout.parse("dp2 mem8Gx")
    with pytest.raises(LayoutError, match="sets budget twice"):
        Layout.parse("dp2 mem1GiB mem2GiB")
    with pytest.raises(LayoutError, match="drop 'offload'"):
        Layout.parse("dp2 zero3 offload mem1GiB").validate(2)
    with pytest.raises(ValueError, match="not a tier"):
        MemoryTiers(optimizer="nvme")
