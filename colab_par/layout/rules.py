"""Every rule a layout must keep, beyond each field's own domain (checked when a Layout is built).

A rule reads some fields of a layout, the world size, the model's sizes and the device, and raises
`LayoutError` naming what is wrong and a valid alternative. Rules run in the order written here:
`check_rules` (behind `Layout.validate`) stops at the first one broken, and `valid_layouts` runs
each as soon as the fields it reads are chosen.
"""
from __future__ import annotations

from typing import Any, Callable

from colab_par.layout.device_catalogue import DEVICES, catalogue_device
from colab_par.layout.model_facts import has_expert_plan, is_hugging_face, model_sizes
from colab_par.layout.terms import DEGREES, LayoutError, divisors, grid_batch_chunks, tensor_grid

_MULTI_STAGE = ("interleaved", "zbv")  # the schedules that place several stages on a rank

# Each rule names the Layout fields it reads, so `valid_layouts` can check it as soon as those
# fields are chosen (a rule that reads an undeclared field fails loudly there: the enumeration
# hands rules only the fields chosen so far).
Rule = Callable[[Any, "int | None", dict, "str | None"], None]
RULES: list[tuple[tuple[str, ...], Rule]] = []


def _rule(*fields: str) -> Callable[[Rule], Rule]:
    def register(check: Rule) -> Rule:
        RULES.append((fields, check))
        return check
    return register


def rule_sizes(world: int | None, model_config: Any, global_batch: int | None) -> dict[str, int]:
    """Check the arguments of `validate` / `valid_layouts` and gather the sizes the rules read."""
    if world is not None and (not isinstance(world, int) or isinstance(world, bool) or world < 1):
        raise LayoutError(f"world_size={world!r} must be a positive integer (the number of ranks), "
                          "e.g. world_size=2")
    sizes = model_sizes(model_config)
    if is_hugging_face(model_config):
        sizes["hugging_face"] = 1
    if has_expert_plan(model_config):
        sizes["expert_plan"] = 1
    if global_batch is not None:
        sizes["global_batch"] = global_batch
    return sizes


def check_rules(layout: Any, world: int | None, model_config: Any, device: Any,
                global_batch: int | None) -> None:
    """Raise `LayoutError` for the first rule `layout` breaks (what `Layout.validate` runs)."""
    sizes = rule_sizes(world, model_config, global_batch)
    for _, rule in RULES:
        rule(layout, world, sizes, device)


def _suggest(n: int, what: str) -> str:
    options = [str(d) for d in divisors(n) if d > 1] or ["1"]
    return f"try {what}=" + " or ".join(options[:4])


# ---- the rules, checked in order ---------------------------------------------------------------
@_rule(*DEGREES)
def _check_world(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if world is None:
        return
    product = layout.dp * layout.tp * layout.pp * layout.cp
    if product == world:
        return
    if world % (layout.tp * layout.pp * layout.cp) == 0:
        hint = f"try dp={world // (layout.tp * layout.pp * layout.cp)}"
    else:
        hint = f"choose degrees whose product is {world}, e.g. dp={world}"
    raise LayoutError(
        f"dp·tp·pp·cp = {layout.dp}·{layout.tp}·{layout.pp}·{layout.cp} = {product} "
        f"but the world has {world} ranks; {hint}")


@_rule("zero", "dp")
def _check_zero_needs_dp(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.zero > 0 and layout.dp == 1:
        raise LayoutError(f"zero={layout.zero} shards over data parallel ranks but dp=1; "
                          "set dp>1 or zero=0")


@_rule("ep", "dp")
def _check_experts_split(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.ep == 1:
        return
    if layout.dp % layout.ep:
        raise LayoutError(f"ep={layout.ep} groups data-parallel ranks (expert parallel adds no ranks) "
                          f"and must divide dp={layout.dp}; {_suggest(layout.dp, 'ep')}")
    experts = sizes.get("n_experts")
    if not experts and any(key in sizes for key in ("n_layer", "d_model", "n_blocks")):
        raise LayoutError("ep splits the experts of mixture-of-experts layers and this model has none "
                          "(no n_experts in its config); use ep=1")
    if experts and experts % layout.ep:
        raise LayoutError(f"ep={layout.ep} does not divide the {experts} experts of each layer; "
                          f"{_suggest(experts, 'ep')}")
    if sizes.get("generic_model") or (sizes.get("hugging_face") and not sizes.get("expert_plan")):
        raise LayoutError("expert parallel splits the kit's MoE GPT (GPTConfig(n_experts=...)) and Hugging "
                          "Face MoE families whose config has a base_model_ep_plan; this model has "
                          "neither, train it with ep=1 (plain dp / zero)")


@_rule("ep", "cp", "zero")
def _check_experts_compose(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.ep == 1:
        return
    if layout.cp > 1:
        raise LayoutError(f"ep composes with dp, zero, tp, pp, activation checkpointing and compile so far, "
                          f"not with cp={layout.cp} (the experts' all-to-all is not built into context parallel yet); "
                          f"use e.g. 'dp{layout.dp} ep{layout.ep}' or drop ep")
    if layout.zero == 1:
        raise LayoutError("zero=1 with ep is not built: torch's ZeroRedundancyOptimizer shards whole parameters "
                          "over ONE group and hands each rank's updated share to all of it, but the ranks of "
                          "an ep group hold different experts (a ZeRO over dp would overwrite one rank's "
                          "experts with another's); the experts would need a second ZeRO over the dp/ep ranks "
                          "holding the same experts, which the kit's checkpoints and memory report (one "
                          "ZeroRedundancyOptimizer) do not carry. With ep use zero=2 (optimizer state and "
                          "gradients sharded, the experts over their own replicas), zero=3 or zero=0")


@_rule("tp", "tp_mode", "sequence_parallel")
def _check_experts_split_inside(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if not sizes.get("n_experts") or layout.tp == 1:
        return
    if layout.tp_mode != "1d":
        raise LayoutError(f"tp_mode={layout.tp_mode!r} has no split of the experts inside (tp splits "
                          "them along one dim of ranks); use the 1d tensor parallel of e.g. 'tp2' or ep")
    if layout.sequence_parallel:
        raise LayoutError("the experts take whole sequences under tp (sequence parallel is not built into "
                          "their split); drop 'sp'")


@_rule("cp")
def _check_moe_gpt(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if not sizes.get("n_experts") or sizes.get("hugging_face") or sizes.get("generic_model"):
        return
    if layout.cp > 1:
        raise LayoutError(f"the MoE GPT trains under dp, zero, tp, pp and ep so far, not cp={layout.cp}; "
                          "use e.g. 'dp2 ep2', 'tp2' or 'pp2 dp2 ep2'")


@_rule("offload", "zero")
def _check_offload(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.offload and layout.zero < 2:
        raise LayoutError("offload moves FSDP-sharded state to the CPU and needs zero=2 or zero=3 "
                          f"(got zero={layout.zero}); set zero=3")


@_rule("offload", "tiers")
def _check_tiers_or_offload(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.offload and layout.tiers.enabled:
        raise LayoutError("offload (FSDP's all-or-nothing CPU offload) and memory tiers both place the "
                          "state; keep one: drop 'offload' and let the tiers place chunks under the budget")


@_rule("tiers", "zero")
def _check_tiers(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    """What memory tiers cannot do, decided from the layout alone."""
    tiers = layout.tiers
    if not tiers.enabled:
        return
    apart = ("disk",) if device != "cuda" else ("host", "disk")
    if tiers.params in apart and device == "cuda":
        raise LayoutError(f"params@{tiers.params} on CUDA would stream every layer's weights to the GPU per "
                          "use, which is not built; keep them on the device and shard them (zero3, more dp "
                          "ranks), with bf16 and optimizer@host|disk (the float32 master leaves the device)")
    if tiers.params in apart and layout.zero > 0:
        raise LayoutError(f"params@{tiers.params} needs zero0 (DDP, tp or pp keep plain local tensors whose "
                          f"storage can be a file): under zero{layout.zero} "
                          + ("FSDP holds the shards in its own storage and gathers them itself; with bf16 "
                             "and optimizer@disk the float32 master is on disk and the working shards bf16"
                             if layout.zero >= 2 else "each rank tiers only its share of the state")
                          + f"; use zero0 with params@{tiers.params}, or drop the params@ token")
    if tiers.grads in apart and layout.zero < 2:
        raise LayoutError(f"grads@{tiers.grads} needs zero2 or zero3: under zero{layout.zero} DDP (or the "
                          "gradient averager) holds every gradient until backward ends, so moving them frees "
                          "nothing; with FSDP each shard is written out as its reduce-scatter completes")


@_rule("zero", "tp", "pp", "cp")
def _check_zero1(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.zero == 1 and (layout.tp > 1 or layout.pp > 1 or layout.cp > 1):
        raise LayoutError("zero=1 (ZeroRedundancyOptimizer) works with plain data parallel only; "
                          "with tp/pp/cp use zero=0, zero=2 or zero=3")


@_rule("sequence_parallel", "tp")
def _check_sequence_parallel(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.sequence_parallel and layout.tp == 1:
        raise LayoutError("sequence_parallel (Megatron SP) splits activations over tensor-parallel "
                          "ranks and needs tp>1; set tp=2 or sequence_parallel=False")


@_rule("pp", "cp")
def _check_pipeline_cp(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.pp > 1 and layout.cp > 1:
        raise LayoutError("pipeline parallel with context parallel is not supported yet; use pp "
                          "with dp/tp, or cp without pp")


@_rule("pp", "sequence_parallel")
def _check_pipeline_sp(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.pp > 1 and layout.sequence_parallel:
        raise LayoutError("sequence_parallel inside pipeline stages is not supported yet; drop "
                          "'sp' or set pp=1")


@_rule("pp", "precision", "zero")
def _check_pipeline_bf16(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.pp > 1 and layout.precision == "bf16" and layout.zero < 2:
        raise LayoutError("bf16 inside pipeline stages comes from FSDP's mixed precision; with pp "
                          "use zero=2 or zero=3 (dp>1), or precision='fp32'")


@_rule("pp", "pp_schedule", "virtual_stages")
def _check_virtual_stages(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    schedule, v = layout.pp_schedule, layout.virtual_stages
    if layout.pp == 1:
        if v != 1:
            raise LayoutError(f"virtual_stages={v} splits pipeline stages but pp=1; set pp=2 or "
                              "more, or virtual_stages=1")
        return
    if schedule == "zbv" and v != 2:
        raise LayoutError(f"pp_schedule='zbv' places exactly 2 stages per rank (V shape) but "
                          f"virtual_stages={v}; set virtual_stages=2")
    if schedule == "interleaved" and v < 2:
        raise LayoutError("pp_schedule='interleaved' needs virtual_stages>=2 stages per rank; "
                          "set virtual_stages=2 or use pp_schedule='1f1b'")
    if schedule not in _MULTI_STAGE and v != 1:
        raise LayoutError(f"pp_schedule={schedule!r} runs one stage per rank; set virtual_stages=1 "
                          "or use pp_schedule='interleaved'")


def splits_backward(layout: Any) -> bool:
    """Whether the schedule runs each microbatch's backward as two passes over one graph (input
    gradients, then weight gradients): recompute cannot save memory there (`_check_split_backward_recompute`)."""
    return layout.pp > 1 and layout.pp_schedule == "zbv"


@_rule("pp", "pp_schedule", "checkpointing")
def _check_split_backward_recompute(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    """zbv's weight pass needs what its input-gradient pass used: selective recompute keeps its saved
    results for one backward (torch.utils.checkpoint raises "Trying to backward an extra time" in
    the second), and full recompute keeps each rebuilt layer until its microbatch's weight pass, more
    than no recompute at all (traced, 7B at pp2: 17.6 GiB on the fullest rank against 14.1)."""
    if splits_backward(layout) and layout.checkpointing != "none":
        raise LayoutError(f"pp_schedule='zbv' runs two backward passes per microbatch, and checkpointing="
                          f"{layout.checkpointing!r} cannot save memory across them (selective recompute "
                          "allows one backward; full recompute holds each rebuilt layer until the second, "
                          "more than no recompute); use checkpointing='none' with zbv, or pp_schedule='1f1b' "
                          "or 'interleaved' with recompute")


@_rule("pp", "pp_schedule", "microbatches")
def _check_microbatches(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    schedule, m, p = layout.pp_schedule, layout.microbatches, layout.pp
    if p == 1:
        return
    if schedule != "gpipe" and m < p:
        raise LayoutError(f"pp_schedule={schedule!r} needs microbatches >= pp ({p}) to fill the "
                          f"pipeline, got microbatches={m}; set microbatches={p} or more, or leave "
                          "it out (the default fills the pipeline)")
    if schedule == "interleaved" and m % p:
        raise LayoutError(f"pp_schedule='interleaved' needs microbatches divisible by pp={p}, "
                          f"got {m}; try microbatches={2 * p}")


def _head_split(layout: Any) -> int:
    """How many ways tensor parallel splits heads and feed-forward columns: tp in 1d, q in a grid
    (1 for a tp that forms no grid: `_check_tensor_grid` names that problem)."""
    if layout.tp_mode == "1d":
        return layout.tp
    grid = tensor_grid(layout.tp, layout.tp_mode, layout.tp_depth)
    return grid[0] if grid else 1


@_rule("tp", "tp_mode", "tp_depth")
def _check_heads(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    split, grid = _head_split(layout), layout.tp_mode != "1d"
    by = f"the {layout.tp_mode} grid side q" if grid else "tp"
    for what in ("heads", "kv-heads"):
        count = sizes.get("n_head" if what == "heads" else "n_kv_head")
        if count and count % split:
            hint = (f"use a grid whose side divides the {what}, or tp_mode='1d'" if grid
                    else _suggest(count, "tp"))
            raise LayoutError(f"{by}={split} does not divide {count} {what}; {hint}")


@_rule("tp", "cp", "cp_mode")
def _check_ulysses_heads(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    heads = sizes.get("n_head")
    if heads and layout.cp > 1 and layout.cp_mode == "ulysses":
        # Query heads are split over cp; kv heads that cp does not divide are repeated instead.
        local_heads = heads // layout.tp
        if local_heads % layout.cp:
            raise LayoutError(f"ulysses context parallel splits heads: cp={layout.cp} does not divide "
                              f"{local_heads} heads per tp rank; use cp_mode='ring' or a cp that "
                              "divides the heads")


@_rule("pp", "virtual_stages")
def _check_layers(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    layers = sizes.get("n_layer")
    stages = layout.pp * layout.virtual_stages
    if layers and layers % stages:
        raise LayoutError(f"{layers} layers do not split into pp·virtual_stages = {stages} equal "
                          f"stages; {_suggest(layers, 'pp·virtual_stages')}")


@_rule("tp", "cp", "sequence_parallel")
def _check_generic_model(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if not sizes.get("generic_model"):
        return
    if layout.cp > 1:
        raise LayoutError("context parallel splits token sequences by position, which only the kit's "
                          "GPT and Hugging Face decoders take; use cp=1 for this model")
    if layout.sequence_parallel:
        raise LayoutError("sequence_parallel follows the kit's GPT plan; for this model drop 'sp'")
    if layout.tp > 1 and not sizes.get("tp_plan"):
        raise LayoutError("this model has no tensor-parallel plan; pass parallelize(..., tp_plan="
                          "{'pattern': 'colwise', ...}) (and to the picker), or use tp=1")


@_rule("checkpointing")
def _check_blocks_to_recompute(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if sizes.get("generic_model") and not sizes.get("n_blocks") and layout.checkpointing != "none":
        raise LayoutError("activation checkpointing wraps repeated blocks and this model has none; "
                          "use checkpointing='none', or name blocks with blocks=[...]")


@_rule("compile")
def _check_blocks_to_compile(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if sizes.get("generic_model") and not sizes.get("n_blocks") and layout.compile:
        raise LayoutError("compile compiles each repeated block and this model has none; drop "
                          "'compile', or name blocks with blocks=[...]")


@_rule("compile", "tp_mode")
def _check_compiled_grid(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.compile and layout.tp_mode != "1d":
        raise LayoutError(f"compile is proven with 1d tensor parallel only; the {layout.tp_mode} "
                          "grid's own autograd functions and collectives inside each block are not "
                          "compiled yet; use tp_mode='1d' with compile, or drop 'compile'")


@_rule("pp", "virtual_stages")
def _check_blocks(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    stages = layout.pp * layout.virtual_stages
    if sizes.get("generic_model") and stages > 1 and sizes.get("n_blocks", 0) < stages:
        raise LayoutError(f"pipeline parallel cuts between repeated blocks, and this model has "
                          f"{sizes.get('n_blocks', 0)} for pp·virtual_stages = {stages} stages; "
                          "use fewer stages, or name the blocks with blocks=[...]")


@_rule("pp", "pp_schedule")
def _check_traced_ties(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    """ZB-V's V puts the first and the last stage on rank 0. The kit's GPT and Hugging Face decoders
    split by layers and share a tied head with the embeddings; a traced model's stages hold each a
    copy of the tie under one name, which one optimizer state (a checkpoint) cannot name twice."""
    if sizes.get("generic_model") and sizes.get("tied_params") and layout.pp > 1 and layout.pp_schedule == "zbv":
        raise LayoutError("pp_schedule='zbv' puts this model's first and last pipeline stages on one rank, "
                          "where its tied parameters become two tensors under one name that checkpoints "
                          "cannot save; use 'interleaved' or '1f1b', or untie the parameters")


@_rule("cp", "cp_mode")
def _check_sequence_chunks(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    seq = sizes.get("seq_len")
    if seq and layout.cp > 1:
        chunks = 2 * layout.cp if layout.cp_mode == "ring" else layout.cp
        if seq % chunks:
            raise LayoutError(f"seq_len={seq} is not divisible by {chunks} "
                              f"({'2·cp for load-balanced ring' if layout.cp_mode == 'ring' else 'cp'}); "
                              f"use a sequence length that is a multiple of {chunks}")


@_rule("sequence_parallel", "cp", "tp")
def _check_sequence_parallel_split(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    seq = sizes.get("seq_len")
    if seq and layout.sequence_parallel and seq % (layout.cp * layout.tp):
        raise LayoutError(f"sequence parallel splits the local sequence (seq_len={seq} / cp={layout.cp}) "
                          f"over tp={layout.tp}; use a sequence length that is a multiple of "
                          f"{layout.cp * layout.tp}")


@_rule("cp", "sequence_parallel")
def _check_hugging_face(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if sizes.get("hugging_face") and layout.cp > 1:
        raise LayoutError("context parallel needs colab_par's GPT (its swappable attention); use "
                          "cp=1 for Hugging Face models")
    if sizes.get("hugging_face") and layout.sequence_parallel:
        raise LayoutError("sequence_parallel has no plan for Hugging Face models; drop 'sp'")


@_rule("tp", "tp_mode", "tp_depth")
def _check_ffn(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    ffn, split = sizes.get("ffn_hidden"), _head_split(layout)
    if ffn and ffn % split:
        raise LayoutError(f"{'tp' if layout.tp_mode == '1d' else 'the grid side q'}={split} does not "
                          f"divide the feed-forward width {ffn}; {_suggest(ffn, 'tp')}")


@_rule("tp", "tp_mode", "tp_depth")
def _check_tensor_grid(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    mode, depth = layout.tp_mode, layout.tp_depth
    if mode != "2.5d" and depth != 1:
        raise LayoutError(f"tp_depth={depth} is the depth of a 2.5d grid (3d's depth is its side q); "
                          "set tp_mode='2.5d' or tp_depth=1")
    if mode == "1d" or tensor_grid(layout.tp, mode, depth):
        return
    power, times = (3, 1) if mode == "3d" else (2, depth)
    shape = {"2d": "q×q", "2.5d": f"q×q×{depth}", "3d": "q×q×q"}[mode]
    valid = ", ".join(str(q ** power * times) for q in range(2, 6))
    raise LayoutError(f"tp={layout.tp} does not form a {mode} grid ({shape}, q >= 2); use tp = "
                      f"{valid}, ... or tp_mode='1d'")


@_rule("tp", "tp_mode", "tp_depth")
def _check_grid_sizes(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    grid = tensor_grid(layout.tp, layout.tp_mode, layout.tp_depth)
    if grid is None:
        return
    q = grid[0]
    # 3d splits the hidden width over two grid sides (q² pieces), 2d and 2.5d over one; every
    # layer sees those pieces, so they must be equal (an odd vocabulary is split unevenly: only the
    # embedding and the head, which gather it, see its pieces)
    split = q * q if layout.tp_mode == "3d" else q
    d_model = sizes.get("d_model")
    if d_model and d_model % split:
        raise LayoutError(f"a {layout.tp_mode} grid of side q={q} splits d_model={d_model} into "
                          f"{split} pieces; use a d_model that is a multiple of {split}, or "
                          "tp_mode='1d'")


@_rule("tp_mode", "sequence_parallel", "cp")
def _check_grid_composition(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.tp_mode == "1d":
        return
    mode = layout.tp_mode
    if layout.sequence_parallel:
        raise LayoutError(f"{mode} tensor parallel already partitions activations (by batch and "
                          "hidden); sequence parallel is the 1d form of that: drop 'sp'")
    if layout.cp > 1:
        raise LayoutError(f"context parallel with {mode} tensor parallel is not supported; use cp=1, "
                          "or tp_mode='1d' with cp")
    if sizes.get("generic_model") or sizes.get("hugging_face"):
        raise LayoutError(f"{mode} tensor parallel partitions the kit's GPT (its linears, norms, "
                          "embedding and head); use tp_mode='1d' for this model")


@_rule("tp_mode", "zero")
def _check_grid_fsdp(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.tp_mode in ("2.5d", "3d") and layout.zero >= 2:
        raise LayoutError(f"zero={layout.zero} (FSDP2) shards tensor-parallel parameters placed on at "
                          f"most two mesh dims, and {layout.tp_mode} places them on three; use zero=0, "
                          "or tp_mode='2d'")


@_rule("dp", "microbatches", "tp", "tp_mode", "tp_depth")
def _check_grid_batch(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    batch, chunks = sizes.get("global_batch"), grid_batch_chunks(layout)
    if batch is None or chunks == 1 or batch % (layout.dp * layout.microbatches):
        return
    piece = batch // layout.dp // layout.microbatches
    if piece % chunks:
        raise LayoutError(f"{layout.tp_mode} tensor parallel splits each rank's (micro)batch of {piece} "
                          f"sequences into {chunks} pieces; use a global batch that is a multiple of "
                          f"{layout.dp * layout.microbatches * chunks}")


@_rule("dp", "microbatches")
def _check_batch(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    batch = sizes.get("global_batch")
    if batch is None:
        return
    if batch % layout.dp:
        raise LayoutError(f"global_batch={batch} does not split over dp={layout.dp} data-parallel "
                          f"ranks; use a global batch that is a multiple of {layout.dp}, or "
                          f"{_suggest(batch, 'dp')}")
    local = batch // layout.dp
    if local % layout.microbatches:
        raise LayoutError(f"the per-rank batch {local} (global_batch={batch} / dp={layout.dp}) does "
                          f"not split into microbatches={layout.microbatches}; "
                          f"{_suggest(local, 'microbatches')}")


@_rule("precision")
def _check_precision(layout: Any, world: int | None, sizes: dict, device: str | None) -> None:
    if layout.precision != "bf16" or device is None:
        return
    spec = _device_spec(device)
    if spec is not None and not spec.runs_bf16:
        raise LayoutError(f"precision='bf16' needs a device with bfloat16 (Ampere or newer GPUs); "
                          f"{spec.name} has none (its DeviceSpec lists peaks for {', '.join(spec.peak_flops)} "
                          "only); use precision='fp32'")


def _device_spec(device: Any) -> Any:
    """The DeviceSpec a rule's `device` means: the one given, the catalogue's entry for a name, or
    None for a bare "cpu" / "cuda" (no product named: the device decides at run time)."""
    if not isinstance(device, str):
        return device
    if device.lower().split(":")[0] in ("cpu", "cuda"):
        return None
    spec = catalogue_device(device)
    if spec is None:
        raise LayoutError(f"device {device!r} is not in the device catalogue; choose one of "
                          f"{', '.join(DEVICES)}, 'cpu' or 'cuda', or pass a DeviceSpec")
    return spec
