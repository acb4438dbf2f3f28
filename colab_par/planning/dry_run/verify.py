"""`verify`: a layout checked by dry runs of each of its rank roles, beside the planner.

A layout's ranks do not all hold the same memory (a pipeline's first and last stages, an expert's
owner): `roles.rank_roles` names one representative rank per distinct role, and each is dry-run
(`dry_run`, a spawned fake world, fake tensors by default: nothing is allocated, so whether an
80 GB device holds the step is known before any real allocation). Each role's trace stands beside
the planner's prediction (`compare`) and its step time estimated from the traced operators
(`step_time.traced_step_seconds`) beside the planner's.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from colab_par.layout import Layout
from colab_par.models import GPTConfig
from colab_par.planning.devices import GiB, DeviceSpec, get_device
from colab_par.planning.dry_run.compare import Comparison, compare
from colab_par.planning.dry_run.launch import dry_run
from colab_par.planning.dry_run.microbatch_scaling import scaled_report, short_layouts
from colab_par.planning.dry_run.report import MiB, DryRunReport, MemoryKinds
from colab_par.planning.dry_run.roles import rank_roles
from colab_par.planning.dry_run.step_time import traced_step_seconds
from colab_par.planning.layout_estimate import estimate

__all__ = ["RoleCheck", "Verification", "verify", "check_verifiable"]

_KINDS = tuple(MemoryKinds.__dataclass_fields__)  # params ... other, the trace's columns


@dataclass(frozen=True)
class RoleCheck:
    """One rank role: its dry run, the planner against it, and the step seconds its traced
    operators take on the device."""

    role: str
    rank: int
    report: DryRunReport
    comparison: Comparison
    traced_seconds: float


@dataclass(frozen=True)
class Verification:
    """Every role of `layout` at `world_size` traced; `fits` only if every role's step fits the
    device (the planner's rule: 90 % of its memory, less the process baseline)."""

    model: str
    layout: str
    world_size: int
    device: str
    batch: tuple[int, int]
    tensors: str
    predicted_seconds: float
    predicted_fits: bool
    roles: tuple[RoleCheck, ...]

    @property
    def fits(self) -> bool:
        return all(check.comparison.fits for check in self.roles)

    @property
    def overflow(self) -> str:
        """"" when every role fits; else the first role that does not, its phase and kind."""
        return next((f"{check.role} (rank {check.rank}): {check.comparison.overflow}"
                     for check in self.roles if not check.comparison.fits), "")

    @property
    def fullest(self) -> RoleCheck:
        """The role with the largest traced step peak: the one that must fit."""
        return max(self.roles, key=lambda check: check.report.peak.total)

    @property
    def peak(self) -> int:
        """The fullest role's traced step peak, bytes."""
        return self.fullest.report.peak.total

    @property
    def traced_seconds(self) -> float:
        """The slowest role's step: the others wait for it."""
        return max(check.traced_seconds for check in self.roles)

    def verdict(self) -> str:
        traced = "fits" if self.fits else f"does NOT fit: {self.overflow}"
        agree = "" if self.fits == self.predicted_fits else \
            f" (the planner said it {'fits' if self.predicted_fits else 'does not fit'})"
        return f"traced on {self.device}: {traced}{agree}"

    def _header(self) -> str:
        return (f"verify {self.model}: {self.layout!r} at world {self.world_size}, batch {self.batch[0]} x "
                f"{self.batch[1]}, {self.tensors} tensors; step {_ms(self.predicted_seconds)} predicted, "
                f"{_ms(self.traced_seconds)} from the traced operators")

    def __str__(self) -> str:
        lines = [self._header()]
        for check in self.roles:
            unit, name = _unit(check)
            lines.append(f"{check.role} (rank {check.rank}), traced in {check.report.seconds:.0f} s, "
                         f"{_ms(check.traced_seconds)} per step, {name}:")
            lines.append(f"  {'':<10}" + "".join(f"{kind:>12}" for kind in (*_KINDS, "total")))
            lines += [f"  {label:<10}" + "".join(f"{cell:>12}" for cell in cells)
                      for label, cells in _rows(check, unit)]
            lines.append(f"  {'fits' if check.comparison.fits else 'does NOT fit: ' + check.comparison.overflow}")
        lines.append(self.verdict())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        parts = [f"<b>{html.escape(self._header())}</b>"]
        for check in self.roles:
            unit, name = _unit(check)
            head = "".join(f"<th>{kind}</th>" for kind in (*_KINDS, "total"))
            body = "".join(f"<tr><th style='text-align:left'>{label}</th>"
                           + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>"
                           for label, cells in _rows(check, unit))
            fits = "fits" if check.comparison.fits else f"does NOT fit: {check.comparison.overflow}"
            parts.append(f"<div>{html.escape(check.role)} (rank {check.rank}), {name}, "
                         f"{_ms(check.traced_seconds)} per step traced: {html.escape(fits)}</div>"
                         f"<table><tr><th></th>{head}</tr>{body}</table>")
        colour = "#2e7d32" if self.fits else "#c62828"
        parts.append(f"<span style='color:{colour}'>{html.escape(self.verdict())}</span>")
        return "".join(parts)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3g} ms" if seconds < 1 else f"{seconds:,.2f} s"


def _unit(check: RoleCheck) -> tuple[float, str]:
    return (GiB, "GiB") if check.report.peak.total >= GiB else (MiB, "MiB")


def _rows(check: RoleCheck, unit: float) -> list[tuple[str, list[str]]]:
    """The traced phases and peak per kind, then the planner's kinds (its buffers under
    temporaries; it has no "other") and its error against the traced peak."""
    report, rows = check.report, []
    for label, kinds in (*report.phases.items(), ("step peak", report.peak)):
        rows.append((label, [f"{getattr(kinds, kind) / unit:.2f}" for kind in _KINDS] + [f"{kinds.total / unit:.2f}"]))
    predicted = {row.kind: row for row in check.comparison.rows}
    rows.append(("planner", [f"{predicted[kind].predicted / unit:.2f}" if kind in predicted else "-"
                             for kind in (*_KINDS, "total")]))
    rows.append(("error", [f"{predicted[kind].relative_error:+.0%}" if kind in predicted else "-"
                           for kind in (*_KINDS, "total")]))
    return rows


def verify(model: Any, layout: "Layout | str", world_size: int, *, device: "str | DeviceSpec",
           batch: tuple[int, int], tensors: str = "fake", roles: Iterable[str] | None = None,
           optimizer: str = "adam", microbatches: int | None = None, timeout: float = 600.0,
           progress: Callable[[str, int, int], None] | None = None) -> Verification:
    """Dry-run every rank role of `layout` for `model` (a GPTConfig or Hugging Face config: what
    both the dry run and the planner read) on `world_size` ranks of `device`, global `batch` =
    (batch, seq len), and set each beside the planner. `roles`: only these role names (of
    `rank_roles`). `tensors`="fake" allocates nothing (any size); "real" allocates the rank's tensors
    (small models: what a real world measures). `microbatches`=k: a pipeline's step is
    traced at k and 2k microbatches and scaled to the layout's count (`microbatch_scaling`: for
    hundreds of microbatches; each report says so); None traces every one. `progress(role, index, count)` is
    called before each role's run. Bad input raises ValueError / TypeError before any process
    starts; a failing or overlong dry run raises as `dry_run` does."""
    layout = Layout.parse(layout)
    chosen = _chosen_roles(rank_roles(layout, world_size), roles)  # refuses a layout of another world size
    dev = get_device(device, world_size)
    check_verifiable(model)
    if len(batch) != 2 or min(batch) < 1 or tensors not in ("real", "fake"):
        raise ValueError(f"batch={batch!r}, tensors={tensors!r}: give batch=(global batch, seq len) and "
                         "tensors='fake' (no storage: any size) or 'real' (allocated: small models)")
    plan = estimate(model, layout, device=dev, global_batch=batch[0], seq_len=batch[1], optimizer=optimizer)
    traced = [(layout, tuple(batch))] if microbatches is None else short_layouts(layout, tuple(batch), microbatches)
    checks = []
    for index, (role, rank) in enumerate(chosen.items()):
        if progress is not None:
            progress(role, index, len(chosen))
        reports = [dry_run(model, variant, world_size, rank=rank, batch=variant_batch, tensors=tensors,
                           timeout=timeout) for variant, variant_batch in traced]
        report = reports[0] if microbatches is None else scaled_report(*reports, layout, tuple(batch))
        checks.append(RoleCheck(role, rank, report, compare(report, model, device=dev, optimizer=optimizer),
                                traced_step_seconds(report, dev)))
    return Verification(_model_name(model), str(layout), world_size, dev.name, tuple(batch), tensors,
                        plan.step_time, plan.fits, tuple(checks))


def check_verifiable(model: Any) -> None:
    """Raise TypeError unless `model` is what both the dry run and the planner read."""
    if not isinstance(model, GPTConfig) and not hasattr(model, "to_dict"):
        raise TypeError(f"verify takes a GPTConfig or a Hugging Face config (the planner reads its sizes, "
                        f"the dry run builds it), not a {type(model).__name__}")


def _chosen_roles(every: dict[str, int], roles: Iterable[str] | None) -> dict[str, int]:
    if roles is None:
        return every
    wanted = list(roles)
    unknown = [role for role in wanted if role not in every]
    if unknown or not wanted:
        raise ValueError(f"roles={wanted!r}: this layout's roles are {', '.join(map(repr, every))}")
    return {role: every[role] for role in wanted}


def _model_name(model: Any) -> str:
    name = getattr(model, "name_or_path", "") or getattr(model, "model_type", "")
    return name or type(model).__name__
