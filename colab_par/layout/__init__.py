"""The parallel layout: one small frozen value that names every parallelism degree and option.

Pure Python on purpose (no torch.distributed import): the widget, the planner and the magics
validate layouts in a notebook kernel that has no cluster. Every rule lives here: a field's domain
is checked when a Layout is built, the rules that need the world size or the model in `validate`,
and `valid_layouts` / `field_options` enumerate what those rules accept, so the planner and the
picker offer layouts without knowing any rule themselves.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from types import SimpleNamespace
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Union

from colab_par.layout.device_catalogue import DEVICES, catalogue_device
from colab_par.layout.tier_options import MemoryTiers, tier_token

__all__ = ["Layout", "LayoutError", "model_sizes", "valid_layouts", "field_options",
           "default_microbatches", "tensor_grid", "grid_batch_chunks", "DEGREES", "ZERO_LEVELS",
           "PACKED_ATTENTION", "CP_MODES", "TP_MODES", "PP_SCHEDULES", "PRECISIONS", "CHECKPOINTING", "FIELDS"]

DEGREES = ("dp", "tp", "pp", "cp")
ZERO_LEVELS = (0, 1, 2, 3)
CP_MODES = ("ring", "ulysses")
TP_MODES = ("1d", "2d", "2.5d", "3d")  # Megatron, Optimus (q×q), Tesseract (q×q×d), 3D (q×q×q)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")
PRECISIONS = ("fp32", "bf16")
CHECKPOINTING = ("none", "selective", "full")
_MULTI_STAGE = ("interleaved", "zbv")
# Field order of the enumeration: a field comes after those its choices or its default depend on.
FIELDS = ("tp", "tp_mode", "tp_depth", "cp", "pp", "dp", "ep", "pp_schedule", "virtual_stages",
          "microbatches", "zero", "sequence_parallel", "cp_mode", "offload", "precision", "checkpointing",
          "compile", "tiers")
_NAMED = {"zero": ZERO_LEVELS, "tp_mode": TP_MODES, "cp_mode": CP_MODES, "pp_schedule": PP_SCHEDULES,
          "precision": PRECISIONS, "checkpointing": CHECKPOINTING}


class LayoutError(ValueError):
    """An impossible layout; the message names the broken rule and a valid alternative."""


def default_microbatches(pp: int) -> int:
    """The count a Layout gets when none is given: the smallest that fills the pipeline (pp: every
    stage busy in steady state) for every schedule, and 1 (the whole batch) without pipeline."""
    return pp


def tensor_grid(tp: int, tp_mode: str, tp_depth: int = 1) -> "tuple[int, int] | None":
    """(q, depth) of a multi-dimensional tensor-parallel grid: q×q for "2d", q×q×depth for "2.5d",
    q×q×q for "3d" (depth q); None when `tp` does not form that grid (or for "1d")."""
    if tp_mode == "1d":
        return None
    depth = tp_depth if tp_mode == "2.5d" else 1
    power = 3 if tp_mode == "3d" else 2
    if tp % depth:
        return None
    q = round((tp // depth) ** (1 / power))
    if q < 2 or q ** power * depth != tp:
        return None
    return q, (q if tp_mode == "3d" else depth)


@dataclass(frozen=True)
class Layout:
    """How one model is spread over `world_size` ranks.

    Mesh order (outermost first) is pp, dp, cp, tp: tensor parallel ranks are neighbours, so on a
    multi-GPU node they share the fastest links. `tp_mode` arranges the tp ranks: "1d" (Megatron)
    in a line, "2d" / "2.5d" / "3d" in a q×q / q×q×tp_depth / q×q×q grid (Colossal-AI's
    multi-dimensional tensor parallelism, which partitions activations as well as weights).
    `ep` (expert parallel) splits each mixture-of-experts layer's experts over groups of `ep`
    data-parallel ranks (drawn from dp, as torchtitan does: it adds no ranks to the world); a
    rank's expert weights are shared with the dp/ep ranks holding the same experts.
    ``microbatches=None`` (the default) becomes `default_microbatches`, so every layout string
    trains as written. `compile` runs each repeated block through ``torch.compile`` (torchtitan's
    per-block placement: after activation checkpointing, before FSDP) and steps torch's Adam, AdamW,
    SGD or Adagrad as its fused kernel unless the optimizer names its implementation.
    `tiers` (a `MemoryTiers`; tokens "mem8GiB", "disk", "disk:/path", "optimizer@disk", ...) keeps
    each rank's model state under a memory budget across device, host and disk.
    """

    dp: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1
    tp_mode: str = "1d"
    tp_depth: int = 1
    cp: int = 1
    zero: int = 0
    offload: bool = False
    sequence_parallel: bool = False
    cp_mode: str = "ring"
    pp_schedule: str = "1f1b"
    microbatches: Union[int, None] = None
    virtual_stages: int = 1
    precision: str = "fp32"
    checkpointing: str = "none"
    compile: bool = False
    tiers: MemoryTiers = MemoryTiers()

    def __post_init__(self) -> None:
        """Refuse values outside a field's domain here, so no impossible Layout ever exists."""
        if self.microbatches is None:
            _check_domain("pp", self.pp)
            object.__setattr__(self, "microbatches", default_microbatches(self.pp))
        for name in FIELDS:
            _check_domain(name, getattr(self, name))

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    # ---- compact string form -------------------------------------------------------------------
    def __str__(self) -> str:
        parts = [f"{name}{getattr(self, name)}" for name in DEGREES if getattr(self, name) != 1]
        if not parts:
            parts = ["dp1"]
        if self.ep != 1:
            parts.append(f"ep{self.ep}")
        if self.tp_mode != "1d":
            parts.append(self.tp_mode)
        if self.tp_depth != 1:
            parts.append(f"d{self.tp_depth}")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.offload:
            parts.append("offload")
        if self.sequence_parallel:
            parts.append("sp")
        if self.cp_mode != "ring":
            parts.append(self.cp_mode)
        if self.pp > 1 or self.pp_schedule != "1f1b":
            parts.append(self.pp_schedule)
        if self.microbatches != default_microbatches(self.pp):
            parts.append(f"mb{self.microbatches}")
        if self.virtual_stages != 1:
            parts.append(f"v{self.virtual_stages}")
        if self.precision != "fp32":
            parts.append(self.precision)
        if self.checkpointing != "none":
            parts.append(f"ac-{self.checkpointing}")
        if self.compile:
            parts.append("compile")
        return " ".join(parts + self.tiers.tokens())

    @classmethod
    def parse(cls, text: "str | Layout") -> "Layout":
        """Parse the compact form, e.g. ``"dp2 tp2 zero3"`` or ``"pp2 interleaved mb4 v2 bf16"``."""
        if isinstance(text, Layout):
            return text
        if not isinstance(text, str):
            raise LayoutError("a layout is a string like 'dp2 tp2 zero3' or a Layout, "
                              f"not {type(text).__name__}")
        fields: dict[str, Any] = {}
        tiers: dict[str, Any] = {}
        for token in text.replace(",", " ").split():
            try:
                tier_fields = tier_token(token)
            except ValueError as error:
                raise LayoutError(str(error)) from None
            into = tiers if tier_fields is not None else fields
            for name, value in (tier_fields or _parse_token(token.lower())).items():
                if name in into and into[name] != value:
                    raise LayoutError(f"layout {text!r} sets {name} twice ({into[name]!r} and "
                                      f"{value!r}); keep one of them")
                into[name] = value
        if tiers:
            fields["tiers"] = MemoryTiers(**tiers)
        return cls(**fields)

    def replace(self, **changes: Any) -> "Layout":
        """A copy with `changes`; a default microbatch count follows a new pp."""
        if "microbatches" not in changes and \
                self.microbatches == default_microbatches(self.pp):
            changes["microbatches"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Field -> value (`tiers` stays a MemoryTiers, so ``Layout(**layout.to_dict())`` holds)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    # ---- validation ----------------------------------------------------------------------------
    def validate(self, world_size: int | None = None, model_config: Any = None, *,
                 device: Any = None, global_batch: int | None = None) -> "Layout":
        """Raise `LayoutError` for the first broken rule; return self when the layout is possible.

        `model_config` may be a GPTConfig, a Hugging Face config or a mapping with n_layer/n_head/
        n_kv_head/seq_len/ffn_hidden (any of the usual spellings). `device` ("cpu", "cuda", a
        planner catalogue name such as "T4", or a DeviceSpec) lets the bf16 rule apply (by the
        DeviceSpec's `bf16`); `global_batch` lets the
        batch-splitting rules apply.
        """
        sizes = _rule_sizes(world_size, model_config, global_batch)
        for _, rule in _RULES:
            rule(self, world_size, sizes, device)
        return self


def _check_domain(name: str, value: Any) -> None:
    """One field's own domain (no other field, no world): types, names, positive counts."""
    if name in _NAMED:
        allowed = _NAMED[name]
        if value not in allowed or type(value) is not type(allowed[0]):
            raise LayoutError(f"{name}={value!r} is unknown; choose one of "
                              f"{', '.join(map(str, allowed))}")
    elif name == "tiers":
        if not isinstance(value, MemoryTiers):
            raise LayoutError(f"tiers={value!r} must be a MemoryTiers, e.g. MemoryTiers(budget='8GiB', "
                              "disk='/scratch')")
    elif name in ("offload", "sequence_parallel", "compile"):
        if not isinstance(value, bool):
            raise LayoutError(f"{name}={value!r} must be True or False")
    elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
        hint = "leave it out for the default" if name == "microbatches" else "use 1 to turn it off"
        raise LayoutError(f"{name}={value!r} must be a positive integer; {hint}")


def has_expert_plan(model_config: Any) -> bool:
    """A Hugging Face MoE family whose experts ep can split: its config's own expert plan
    dispatches tokens to them (or a sizes mapping that says so)."""
    if isinstance(model_config, Mapping):
        return bool(model_config.get("expert_plan"))
    return "ep_dispatch_experts" in (getattr(model_config, "base_model_ep_plan", None) or {}).values()


def _rule_sizes(world: int | None, model_config: Any, global_batch: int | None) -> dict[str, int]:
    """Check the arguments of `validate` / `valid_layouts` and gather the sizes the rules read."""
    if world is not None and (not isinstance(world, int) or isinstance(world, bool) or world < 1):
        raise LayoutError(f"world_size={world!r} must be a positive integer (the number of ranks), "
                          "e.g. world_size=2")
    sizes = model_sizes(model_config)
    if getattr(model_config, "model_type", None) or (isinstance(model_config, Mapping)
                                                     and model_config.get("hugging_face")):
        sizes["hugging_face"] = 1  # a Hugging Face config
    if has_expert_plan(model_config):
        sizes["expert_plan"] = 1
    if global_batch is not None:
        sizes["global_batch"] = global_batch
    return sizes


# ---- enumeration: the layouts the rules accept --------------------------------------------------
Choices = Union[Iterable[Any], Callable[[Any], Iterable[Any]]]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _default_choices(world: int, sizes: dict[str, int]) -> dict[str, Choices]:
    """Every value of every field, bounded by the world and the model / batch where a field has no
    bound of its own: virtual stages divide the layers (1 or 2 without a model), microbatch counts
    divide the global batch (only the default count without a batch)."""
    layers, batch = sizes.get("n_layer"), sizes.get("global_batch")
    # ep only where asked for (ep=(1, 2)): the planner asks in its search space
    return {**{name: _divisors(world) for name in DEGREES}, **_NAMED, "ep": (1,),
            "offload": (False, True), "sequence_parallel": (False, True), "compile": (False, True),
            "tiers": (MemoryTiers(),),
            "tp_depth": [d for d in _divisors(world) if d < world],
            "virtual_stages": _divisors(layers) if layers else (1, 2),
            "microbatches": (None, *_divisors(batch)) if batch else (None,)}


def valid_layouts(world_size: int, model_config: Any = None, *, device: Any = None,
                  global_batch: int | None = None, **choices: Choices) -> Iterator[Layout]:
    """Every Layout over `world_size` ranks that `validate` accepts, each once.

    `choices` narrow a field to some values, e.g. ``zero=(2, 3)``, or to a function of the fields
    chosen before it in `FIELDS` (``microbatches=lambda l: (l.pp, 2 * l.pp)``); None stands for
    the default microbatch count. Each rule runs as soon as the fields it reads are chosen, so the
    search stays fast on thousands of ranks.
    """
    if world_size is None:
        raise LayoutError("valid_layouts needs world_size, e.g. valid_layouts(8)")
    sizes = _rule_sizes(world_size, model_config, global_batch)
    unknown = set(choices) - set(FIELDS)
    if unknown:
        raise LayoutError(f"unknown layout field(s) {', '.join(sorted(unknown))}; choose from "
                          f"{', '.join(FIELDS)}")
    grid = {**_default_choices(world_size, sizes), **choices}
    position = {name: i for i, name in enumerate(FIELDS)}
    due: dict[str, list[Rule]] = {name: [] for name in FIELDS}
    for fields, rule in _RULES:
        due[max(fields, key=position.__getitem__)].append(rule)

    def search(depth: int, chosen: dict[str, Any]) -> Iterator[Layout]:
        if depth == len(FIELDS):
            yield Layout(**chosen)
            return
        name = FIELDS[depth]
        partial = SimpleNamespace(**chosen)
        options = grid[name](partial) if callable(grid[name]) else grid[name]
        if name == "microbatches":  # resolve the default count once, then drop repeats
            options = dict.fromkeys(default_microbatches(chosen["pp"])
                                    if m is None else m for m in options)
        for value in options:
            _check_domain(name, value)
            step = SimpleNamespace(**chosen, **{name: value})
            try:
                for rule in due[name]:
                    rule(step, world_size, sizes, device)
            except LayoutError:
                continue
            yield from search(depth + 1, {**chosen, name: value})

    return search(0, {})


def field_options(world_size: int, model_config: Any = None, *, device: Any = None,
                  global_batch: int | None = None, **choices: Iterable[Any]) -> dict[str, list[Any]]:
    """For each field, the values that appear in at least one valid layout (a picker's options);
    `choices` set a field's candidate values as in `valid_layouts` (e.g. ``ep=(1, 2, 4)``)."""
    grid = {**_default_choices(world_size, _rule_sizes(world_size, model_config, global_batch)), **choices}
    options: dict[str, list[Any]] = {}
    for name in FIELDS:
        options[name] = [value for value in grid[name] if value is not None and next(valid_layouts(
            world_size, model_config, device=device, global_batch=global_batch,
            **{**choices, name: (value,)}), None) is not None]
    return options


# ---- parsing helpers ---------------------------------------------------------------------------
_TOKEN_PATTERNS: list[tuple[str, Any]] = [
    (r"(dp|ep|tp|pp|cp)(\d+)", lambda m: {m[1]: int(m[2])}),
    (r"zero(\d+)", lambda m: {"zero": int(m[1])}),
    (r"(1d|2d|2\.5d|3d)", lambda m: {"tp_mode": m[1]}),
    (r"d(\d+)", lambda m: {"tp_depth": int(m[1])}),
    (r"mb(\d+)", lambda m: {"microbatches": int(m[1])}),
    (r"v(\d+)", lambda m: {"virtual_stages": int(m[1])}),
    (r"offload", lambda m: {"offload": True}),
    (r"sp", lambda m: {"sequence_parallel": True}),
    (r"(ring|ulysses)", lambda m: {"cp_mode": m[1]}),
    (r"(gpipe|1f1b|interleaved|zbv)", lambda m: {"pp_schedule": m[1]}),
    (r"(fp32|bf16)", lambda m: {"precision": m[1]}),
    (r"ac-(none|selective|full)", lambda m: {"checkpointing": m[1]}),
    (r"compile", lambda m: {"compile": True}),
]


def _parse_token(token: str) -> dict[str, Any]:
    for pattern, build in _TOKEN_PATTERNS:
        match = re.fullmatch(pattern, token)
        if match:
            return build(match)
    raise LayoutError(
        f"unknown layout token {token!r}; use degrees like 'dp2 tp2 pp2 cp2', 'ep2', 'zero0'..'zero3', "
        "'1d'/'2d'/'2.5d'/'3d' with 'd2' (2.5d depth), "
        "'offload', 'sp', 'ring'/'ulysses', 'gpipe'/'1f1b'/'interleaved'/'zbv', 'mb4', 'v2', "
        "'fp32'/'bf16', 'ac-selective'/'ac-full', 'compile', memory tiers 'mem8GiB', 'disk', "
        "'disk:/path', 'optimizer@disk' (params/grads/optimizer @ device/host/disk)")


# ---- model sizes from any config ---------------------------------------------------------------
# blocks of d_model in a packed q|k|v projection, by model_type (GPT-2's Conv1D c_attn)
PACKED_ATTENTION = {"gpt2": 3}

_SIZE_NAMES = {
    "d_model": ("d_model", "hidden_size", "n_embd", "dim"),
    "vocab_size": ("vocab_size",),
    "n_layer": ("n_layer", "num_hidden_layers", "n_layers", "num_layers"),
    "n_head": ("n_head", "num_attention_heads", "n_heads"),
    "n_kv_head": ("n_kv_head", "num_key_value_heads", "n_kv_heads"),
    "seq_len": ("seq_len", "max_position_embeddings", "block_size"),
    "ffn_hidden": ("ffn_hidden", "intermediate_size", "n_inner"),
    # a model the kit did not write (module_spec.ModuleSpec.config): its repeated blocks, and
    # whether a tensor-parallel plan exists for it
    "n_blocks": ("n_blocks",),
    "generic_model": ("generic_model",),
    "tp_plan": ("tp_plan",),
    "tied_params": ("tied_params",),  # one parameter under two names (module_spec.ModuleSpec)
    # experts per mixture-of-experts layer (the kit's GPT, Qwen-MoE, Mixtral, DeepSeek spellings)
    "n_experts": ("n_experts", "num_experts", "num_local_experts", "n_routed_experts"),
    # experts a token runs, and an expert's width where it differs from a dense layer's
    "top_k": ("top_k", "num_experts_per_tok"),
    "expert_hidden": ("moe_intermediate_size",),
}


def model_sizes(config: Any) -> dict[str, int]:
    """The sizes the rules (and the planner) need, from a GPTConfig, a Hugging Face config or a
    mapping, whatever the spelling; missing sizes are simply absent."""
    if config is None:
        return {}
    get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
    sizes: dict[str, int] = {}
    for key, spellings in _SIZE_NAMES.items():
        for name in spellings:
            value = get(name, None)
            if value is not None:
                sizes[key] = int(value)
                break
    if "n_kv_head" not in sizes and "n_head" in sizes:
        sizes["n_kv_head"] = sizes["n_head"]
    return sizes


def _suggest(n: int, what: str) -> str:
    options = [str(d) for d in _divisors(n) if d > 1] or ["1"]
    return f"try {what}=" + " or ".join(options[:4])


# ---- the rules, checked in order ---------------------------------------------------------------
# Each rule names the Layout fields it reads, so `valid_layouts` can check it as soon as those
# fields are chosen (a rule that reads an undeclared field fails loudly there: the enumeration
# hands rules only the fields chosen so far).
Rule = Callable[[Any, "int | None", dict, "str | None"], None]
_RULES: list[tuple[tuple[str, ...], Rule]] = []


def _rule(*fields: str) -> Callable[[Rule], Rule]:
    def register(check: Rule) -> Rule:
        _RULES.append((fields, check))
        return check
    return register


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


def grid_batch_chunks(layout: Any) -> int:
    """Into how many pieces a multi-dimensional tensor-parallel grid splits each (micro)batch: q in
    2d, q·depth in 2.5d, q² in 3d; 1 otherwise."""
    grid = tensor_grid(layout.tp, layout.tp_mode, layout.tp_depth)
    if grid is None:
        return 1
    q, depth = grid
    return q * depth if layout.tp_mode != "2d" else q


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
