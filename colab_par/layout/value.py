"""The `Layout` value: its fields, its compact string form and the domain of each field.

A Layout refuses a value outside a field's own domain when it is built; the rules that need the
world size or the model run in `Layout.validate` (see `colab_par.layout.rules`).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Union

from colab_par.layout.rules import check_rules
from colab_par.layout.terms import DEGREES, FIELDS, NAMED_VALUES, LayoutError, default_microbatches
from colab_par.layout.tier_options import MemoryTiers, tier_token


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
            check_domain("pp", self.pp)
            object.__setattr__(self, "microbatches", default_microbatches(self.pp))
        for name in FIELDS:
            check_domain(name, getattr(self, name))

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
        check_rules(self, world_size, model_config, device, global_batch)
        return self


def check_domain(name: str, value: Any) -> None:
    """One field's own domain (no other field, no world): types, names, positive counts."""
    if name in NAMED_VALUES:
        allowed = NAMED_VALUES[name]
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


# ---- the compact form's tokens ----------------------------------------------------------------
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

