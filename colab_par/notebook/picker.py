"""`LayoutPicker`: choose a parallel layout in the notebook with live validation and estimates.

Core ipywidgets only (Dropdown, Checkbox, HTML, Button, boxes), so it renders in JupyterLab,
VS Code and Colab without extensions. The widget holds no rules and no numbers of its own: every
message comes from `Layout.validate`, every estimate from `colab_par.planning.planner`.
"""
from __future__ import annotations

import html
import threading
from typing import Any

import ipywidgets as w
import traitlets

from colab_par.layout import FIELDS, Layout, LayoutError, default_microbatches, field_options
from colab_par.planning.dry_run.verify import Verification, check_verifiable, verify
from colab_par.planning.module_spec import ModuleSpec
from colab_par.planning.planner import GiB, DeviceSpec, ModelSpec, Plan, estimate, get_device, plan
from colab_par.layout.tier_options import DEFAULT_DISK, MemoryTiers, format_bytes
from colab_par.notebook.plan_render import memory_bar_html, plans_table_html, size_text, tier_text

__all__ = ["LayoutPicker", "TierSelector"]

_CHECKBOXES = {"offload": "CPU offload", "sequence_parallel": "sequence parallel",
               "compile": "compile blocks"}
_BUILDS = {"meta": "built on the meta device", "full": "built whole on every rank",
           "pretrained": "loaded from a checkpoint"}
BUDGET_SHARES = (0.25, 0.5, 0.75, 1.0, 1.5)  # budgets offered, as shares of the predicted training memory


class TierSelector(w.HBox):
    """The `tiers` field as a budget dropdown and a disk-tier checkbox; `value` is the MemoryTiers.

    A layout applied with its own disk folder or kinds pinned to tiers keeps them: the checkbox
    turns that folder on and off, the dropdown sets the budget."""

    value = traitlets.Instance(MemoryTiers)

    def __init__(self, budgets: list[tuple[str, "int | None"]]):
        self.budget = w.Dropdown(options=budgets, value=None, description="budget/rank")
        self.disk = w.Checkbox(description="disk tier", indent=False)
        self._folder, self._pins, self._syncing = DEFAULT_DISK, {}, False
        super().__init__([self.budget, self.disk], value=MemoryTiers())
        self.budget.observe(self._from_children, names="value")
        self.disk.observe(self._from_children, names="value")
        self.observe(self._to_children, names="value")

    def _from_children(self, _: dict) -> None:
        if not self._syncing:
            self.value = MemoryTiers(budget=self.budget.value, disk=self._folder if self.disk.value else None,
                                     **self._pins)

    def _to_children(self, change: dict) -> None:
        tiers: MemoryTiers = change["new"]
        self._pins = {kind: tier for kind, tier in tiers.placements().items() if tier != "auto"}
        self._folder = tiers.disk or self._folder
        self._syncing = True
        try:
            if tiers.budget not in [value for _, value in self.budget.options]:
                self.budget.options = sorted([*self.budget.options, (format_bytes(tiers.budget), tiers.budget)],
                                             key=lambda option: -1 if option[1] is None else option[1])
            self.budget.value = tiers.budget
            self.disk.value = tiers.disk is not None
        finally:
            self._syncing = False


class LayoutPicker:
    """Selectors for every `Layout` field over `world_size` devices, a validation message, a
    per-device memory bar, predicted step time / tokens/s / MFU, an Auto button, a Verify button
    (the chosen layout's dry run beside the prediction, `verify`) and the top plans.

    ``picker.layout`` is the chosen Layout (raises `LayoutError` saying why when it is not valid);
    ``%%colossal --layout picker`` hands it to the cell. Only plans that fit, building the model
    included (`init`, see `planner.init_peak_bytes`), are listed and applied by Auto.
    """

    def __init__(self, world_size: int, *, model: Any, device: "str | DeviceSpec", global_batch: int,
                 seq_len: int = 0, example_batch: Any = None, gpus_per_node: int = 8, top: int = 5,
                 init: str = "meta", **probe_options: Any):
        """`model`: a GPTConfig / Hugging Face config / sizes dict (with `seq_len`), or any
        nn.Module with an `example_batch` it takes (probed once: `module_spec.ModuleSpec`;
        `probe_options` are parallelize's blocks / tp_plan / loss_fn). `init`: how the model
        reaches the ranks, "meta" (parallelize a factory), "full" (a model built normally) or
        "pretrained" (from_pretrained)."""
        self.world_size, self.global_batch, self.seq_len = world_size, global_batch, seq_len
        self.init = init
        self.gpus_per_node = gpus_per_node
        self.model = model
        self.spec = (ModuleSpec.probe(model, example_batch, **probe_options) if example_batch is not None
                     else ModelSpec.of(model))
        self.device = get_device(device, world_size)
        ranked = plan(self.spec, world_size, device=self.device, global_batch=global_batch,
                      seq_len=seq_len, gpus_per_node=gpus_per_node, top=None, init=init)
        self.plans: list[Plan] = [p for p in ranked if p.fits][:top]  # only what the kit can start
        self._start = (self.plans or ranked)[0].layout
        self.message = ""
        self.estimate: Plan | None = None
        self.controls = self._build_controls()
        self._message_html = w.HTML()
        self._memory_html = w.HTML()
        self._estimate_html = w.HTML()
        self.auto_button = w.Button(description="Auto", button_style="primary",
                                    tooltip="apply the planner's best fitting layout")
        self.auto_button.on_click(lambda _: self.auto())
        self.verification: Verification | None = None
        self._verifying: threading.Thread | None = None
        self._verify_html = w.HTML()
        self.verify_button = self._build_verify_button()
        self._table_html = w.HTML(plans_table_html(self.plans, self._no_plan_text()))
        for name, control in self.controls.items():
            control.observe(self._on_change(name), names="value")
        self.widget = self._assemble()
        self._refresh()

    # ---- state ----------------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        """The current choice, validated for this world, model, device and batch."""
        return self._current().validate(self.world_size, self.spec.config(self.seq_len),
                                        device=self.device, global_batch=self.global_batch)

    def apply(self, layout: "Layout | str") -> None:
        """Set every selector from `layout` (refreshing once at the end)."""
        layout = Layout.parse(layout)
        self._applying = True
        try:
            for name, control in self.controls.items():
                value = getattr(layout, name)
                if isinstance(control, w.Dropdown) and value not in control.options:
                    control.options = tuple(sorted(set(control.options) | {value}))
                control.value = value
        finally:
            self._applying = False
        self._refresh()

    def auto(self) -> None:
        """Apply the planner's best fitting plan; with none, say so and leave the choice as is."""
        if not self.plans:
            self._refresh()
            self.message = f"✗ {self._no_plan_text()}"
            self._message_html.value = f"<span style='color:#c62828'>{html.escape(self.message)}</span>"
            return
        self.apply(self.plans[0].layout)

    def verify(self, *, timeout: float = 600.0) -> Verification:
        """Dry-run the chosen layout's rank roles (`dry_run.verify`: spawned processes, fake
        tensors) and show their traced memory per phase beside the
        prediction; what the Verify button runs, in a thread (`verify_in_background`)."""
        layout = self.layout
        self._verify_html.value = f"verifying <code>{html.escape(str(layout))}</code>…"

        def progress(role: str, index: int, count: int) -> None:
            self._verify_html.value = (f"verifying <code>{html.escape(str(layout))}</code>: dry run of "
                                       f"{html.escape(role)} ({index + 1} of {count})…")

        self.verification = verify(self.model, layout, self.world_size, device=self.device,
                                   batch=(self.global_batch, self.seq_len), timeout=timeout, progress=progress)
        self._verify_html.value = self.verification._repr_html_()
        return self.verification

    def verify_in_background(self, *, timeout: float = 600.0) -> threading.Thread:
        """Start `verify` in a thread, so the kernel stays free while the dry runs take their
        seconds to minutes; the button is disabled until it ends (each dry run stops by `timeout`
        seconds) and a failure is shown in the widget, not raised."""
        def run() -> None:
            try:
                self.verify(timeout=timeout)
            except Exception as error:  # shown where the user clicked
                self._verify_html.value = (f"<span style='color:#c62828'>✗ verify failed: "
                                           f"{html.escape(str(error))}</span>")
            finally:
                self.verify_button.disabled = False
                self._verifying = None

        self.verify_button.disabled = True
        self._verifying = thread = threading.Thread(target=run, name="LayoutPicker.verify", daemon=True)
        thread.start()
        return thread

    # ---- widgets --------------------------------------------------------------------------------
    def _build_verify_button(self) -> w.Button:
        """Enabled for a model the dry run can build (a GPTConfig or Hugging Face config)."""
        button = w.Button(description="Verify", tooltip="dry-run the chosen layout's rank roles and show "
                          "their traced memory per phase beside the prediction")
        try:
            check_verifiable(self.model)
        except TypeError as why:
            button.disabled, button.tooltip = True, str(why)
        button.on_click(lambda _: self.verify_in_background())
        return button

    def _build_controls(self) -> dict[str, w.ValueWidget]:
        """A dropdown per field offering the values that some valid layout for this world, model,
        device and batch takes (`field_options`: the picker knows no rule itself)."""
        start = self._start
        options = field_options(self.world_size, self.spec.config(self.seq_len), device=self.device,
                                global_batch=self.global_batch, ep=self._expert_degrees())
        labels = {"tp_mode": "tp mode", "tp_depth": "tp depth", "cp_mode": "cp mode",
                  "pp_schedule": "schedule", "virtual_stages": "virtual st.",
                  "checkpointing": "recompute"}
        controls: dict[str, w.ValueWidget] = {
            name: w.Dropdown(options=options[name], description=labels.get(name, name))
            for name in FIELDS if name not in _CHECKBOXES and name != "tiers"}
        controls.update({name: w.Checkbox(description=label, indent=False)
                         for name, label in _CHECKBOXES.items()})
        controls["tiers"] = TierSelector(self._budget_options())
        for name, control in controls.items():
            value = getattr(start, name)
            if isinstance(control, w.Dropdown) and value not in control.options:
                control.options = tuple(sorted(set(control.options) | {value}))
            control.value = value
        return controls

    def _budget_options(self) -> list[tuple[str, "int | None"]]:
        """No budget, and `BUDGET_SHARES` of the starting plan's predicted training memory, host
        offload included (the process baseline left out, as a budget leaves it out), rounded to
        whole MiB (GiB from 4 GiB)."""
        start = estimate(self.spec, self._start.replace(tiers=MemoryTiers()), device=self.device,
                         global_batch=self.global_batch, seq_len=self.seq_len, gpus_per_node=self.gpus_per_node,
                         validate=False, init=self.init)
        total = start.memory.total + start.memory.host_total
        options: list[tuple[str, "int | None"]] = [("none", None)]
        for share in BUDGET_SHARES:
            unit = GiB if share * total >= 4 * GiB else 2 ** 20
            size = max(1, round(share * total / unit)) * unit
            if size not in [value for _, value in options]:
                options.append((f"{format_bytes(size)} ({share:.0%} of {size_text(total)})", size))
        return options

    def _expert_degrees(self) -> tuple[int, ...]:
        """The ep values to offer: the world's divisors for a MoE model, else 1 (no selector)."""
        if not getattr(self.spec, "n_experts", 0):
            return (1,)
        return tuple(d for d in range(1, self.world_size + 1) if self.world_size % d == 0)

    def _assemble(self) -> w.VBox:
        c = self.controls
        title = w.HTML(f"<b>Layout for {self.world_size} × {html.escape(self.device.name)}</b> "
                       f"({self.spec.n_params / 1e6:,.1f} M parameters, {self._batch_text()})")
        degrees = [c["dp"], *([c["ep"]] if len(self._expert_degrees()) > 1 else []), c["tp"], c["pp"], c["cp"]]
        rows = [w.HBox(degrees),
                w.HBox([c["zero"], c["offload"], c["sequence_parallel"], c["precision"]]),
                w.HBox([c["cp_mode"], c["pp_schedule"], c["microbatches"], c["virtual_stages"]]),
                w.HBox([c["checkpointing"], c["compile"], self.auto_button, self.verify_button]),
                c["tiers"]]
        return w.VBox([title, *rows, self._message_html, self._memory_html, self._estimate_html,
                       self._verify_html, self._table_html])

    def _on_change(self, name: str):
        def handler(change: dict) -> None:
            if getattr(self, "_applying", False):
                return
            if name in ("tp", "pp", "cp"):
                self._rebalance_dp()
            if name == "pp":
                self._follow_default_microbatches(change["old"])
            self._refresh()
        return handler

    def _follow_default_microbatches(self, old_pp: int) -> None:
        """A default microbatch count follows pp, as in `Layout.replace`."""
        c = self.controls
        new = default_microbatches(c["pp"].value)
        if c["microbatches"].value == default_microbatches(old_pp) and new in c["microbatches"].options:
            self._set_quietly("microbatches", new)

    def _rebalance_dp(self) -> None:
        """Keep dp·tp·pp·cp equal to the world when another degree changes, where dp can follow."""
        c = self.controls
        other = c["tp"].value * c["pp"].value * c["cp"].value
        if self.world_size % other == 0 and self.world_size // other in c["dp"].options:
            self._set_quietly("dp", self.world_size // other)

    def _set_quietly(self, name: str, value: Any) -> None:
        """Set one selector without triggering its own change handler."""
        self._applying = True
        try:
            self.controls[name].value = value
        finally:
            self._applying = False

    def _current(self) -> Layout:
        return Layout(**{name: control.value for name, control in self.controls.items()})

    def _refresh(self) -> None:
        try:
            layout = self.layout
        except LayoutError as error:
            self.message, self.estimate = f"✗ {error}", None
        else:
            self.estimate = estimate(self.spec, layout, device=self.device,
                                     global_batch=self.global_batch, seq_len=self.seq_len,
                                     gpus_per_node=self.gpus_per_node, validate=False, init=self.init)
            self.message = f"✓ {layout} is valid and {self._verdict(self.estimate)}"
        colour = "#2e7d32" if self.estimate is not None and self.estimate.fits else "#c62828"
        self._message_html.value = f"<span style='color:{colour}'>{html.escape(self.message)}</span>"
        self._memory_html.value = memory_bar_html(self.estimate, self.init)
        self._estimate_html.value = html.escape(self._estimate_line())
        if self._verifying is None:  # a result shown belongs to the layout it names; a new choice clears it
            self._verify_html.value = ""

    def _verdict(self, option: Plan) -> str:
        if option.fits:
            return "fits"
        if option.tiers is not None and not option.tiers.fits:
            return f"does NOT fit its memory budget: {option.tiers.reason}"
        if option.limit == "training":
            return "does NOT fit in device memory"
        hint = ("; build it on the meta device instead (parallelize(lambda: Model(config), layout), "
                "init='meta')" if self.init == "full" else "")
        return (f"does NOT fit in device memory: the model {_BUILDS[self.init]} peaks at "
                f"{size_text(option.memory.baseline + option.memory.init)} per device before training{hint}")

    def _no_plan_text(self) -> str:
        hint = (" Building the model on the meta device (init='meta') may fit." if self.init == "full" else "")
        return (f"no layout fits {self.world_size} × {self.device.name} with the model "
                f"{_BUILDS[self.init]}: use more devices, a smaller global batch or a smaller model.{hint}")

    # ---- rendering ------------------------------------------------------------------------------
    def _estimate_line(self) -> str:
        e = self.estimate
        if e is None:
            return "no estimate for an invalid layout"
        return (f"step {e.step_time * 1e3:,.1f} ms · {e.throughput} · MFU {e.mfu:.1%} · "
                f"{size_text(e.memory.peak)} of {size_text(e.capacity)} per device (building "
                f"{size_text(e.memory.baseline + e.memory.init)}, training "
                f"{size_text(e.memory.baseline + e.memory.total)})"
                + (f" (+{size_text(e.memory.host_total)} on the host)" if e.memory.host_total else "")
                + tier_text(e))

    def _batch_text(self) -> str:
        if isinstance(self.spec, ModuleSpec):
            return f"{self.spec.name}, global batch {self.global_batch} samples"
        return f"global batch {self.global_batch} × {self.seq_len} tokens"

    def __repr__(self) -> str:
        lines = [f"LayoutPicker({self.world_size} × {self.device.name}, {self._batch_text()})",
                 f"  {self.message}",
                 f"  {self._estimate_line()}", "  top plans:"]
        lines += [f"    {p}" for p in self.plans] or [f"    {self._no_plan_text()}"]
        return "\n".join(lines)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = repr(self)
        return bundle
