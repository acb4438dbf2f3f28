"""Live training dashboard in the notebook (or one text line per log step in a terminal).

Renders; never measures (telemetry.py measures on the engines). The client's wait loop feeds it
the latest `datapub` dict of every engine; it keeps the union of the rows it has seen and updates
ONE display handle in place. While training, a frame is SVG text (svg_plot.py: about a millisecond
of CPU, the frontend draws it) under a progress line, shown when new rows arrived, at most twice a
second and within 0.5 % of the machine's CPU time: the notebook shares its cores with the engines
it watches, and a matplotlib picture would cost a hundred times more. The frame at the end of the
cell is the full matplotlib (Agg) picture as a PNG (png_picture.py), which the saved notebook
keeps; `png()` draws the same for files (the CLI demo). Rows that carry samples of what the model
wrote (a GRPO rollout's `SAMPLES_COLUMN`) add a table of them under the frame (samples_table.py).
"""
from __future__ import annotations

import base64
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from colab_par.views.png_picture import PngPicture
from colab_par.views.rows import CHUNK, METRICS_KEY, ROWS_KEY, SAMPLES_COLUMN, expert_counts
from colab_par.views.samples_table import samples_html, samples_lines, valid_samples
from colab_par.views.svg_plot import HEAT_COLOURS, Line, Plot, Stack, grid_places, svg_grid

__all__ = ["LiveDashboard", "Panel", "PANELS", "progress_line"]

BLUE, ORANGE, GREEN, RED, PURPLE, CYAN = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                          "#17becf")  # matplotlib's tab10, for SVG and PNG alike
# (row key, legend label, colour): fixed colours, so a part keeps its colour from frame to frame
MEMORY_PARTS = (("mem_params", "params", BLUE), ("mem_grads", "grads", ORANGE),
                ("mem_optimizer", "optimizer", GREEN), ("mem_activations", "activations", RED))
TIME_PARTS = (("time_data", "data", CYAN), ("time_forward_backward", "fwd+bwd", BLUE),
              ("time_clip", "clip", ORANGE), ("time_optimizer", "optimizer", GREEN),
              ("time_telemetry", "telemetry", PURPLE))
# memory tiers (the runtime's memory_report, published as mem_tier_*): model state resident per
# tier, and the working memory beside it on the device
TIER_PARTS = (("mem_tier_working", "working", RED), ("mem_tier_device", "device", BLUE),
              ("mem_tier_host", "host", ORANGE), ("mem_tier_disk", "disk", GREEN))


@dataclass(frozen=True)
class Curve:
    """A metric drawn over steps: the first of `keys` ((row key, name) pairs) that has data."""

    keys: tuple[tuple[str, str], ...]
    colour: str
    scale: float = 1.0
    right: bool = False  # on a second y axis


@dataclass(frozen=True)
class PanelSpec:
    """One plot: `curves` over steps, or stacked bars per rank of the latest row's `parts` (times
    `scale`), with `note` above each bar: (row key, format template, factor) of the row's value,
    and `limit` across them: (row key, label) of a bound the bars must stay under (the largest
    rank's, times `scale`). `{}` in `title` is the first curve's name."""

    title: str
    curves: tuple[Curve, ...] = ()
    parts: tuple[tuple[str, str, str], ...] = ()
    scale: float = 1.0
    note: tuple[str, str, float] | None = None
    limit: tuple[str, str] | None = None

    @property
    def colours(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([c.colour for c in self.curves] + [c for *_, c in self.parts]))


PANELS = (
    PanelSpec("loss by step", (Curve((("loss", "loss"),), BLUE),
                               Curve((("eval_loss", "validation"),), ORANGE))),
    PanelSpec("grad norm by step", (Curve((("grad_norm", "grad norm"),), RED),)),
    PanelSpec("learning rate by step", (Curve((("lr", "lr"),), GREEN),)),
    PanelSpec("{} (blue), MFU % (orange)",
              (Curve((("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s")), BLUE),
               Curve((("mfu", "MFU %"),), ORANGE, scale=100.0, right=True))),
    PanelSpec("memory by rank (MiB)", parts=MEMORY_PARTS, scale=2 ** -20),
    PanelSpec("step time by rank (ms)", parts=TIME_PARTS, scale=1e3, note=("bubble", "bubble {:.0f}%", 100.0)),
)
# a run with memory tiers adds this plot after PANELS (a dense run's frame has none)
TIER_PANEL = PanelSpec("state per tier by rank (MiB)", parts=TIER_PARTS, scale=2 ** -20,
                       note=("mem_tier_moved", "moved {:,.0f} MiB/step", 2 ** -20),
                       limit=("mem_tier_budget", "budget per rank"))
# a GRPO run (rows with a mean `reward`) adds this plot after those (training/grpo)
REWARD_PANEL = PanelSpec("reward by step", (Curve((("reward", "reward"),), GREEN),))
# a run saving asynchronously (rows with `ckpt_pause_s`, training/checkpoint_async) adds what each
# save held the step, beside the step time itself
SAVE_PANEL = PanelSpec("checkpoint pause of the step (ms)",
                       (Curve((("ckpt_pause_s", "save pause"),), ORANGE, scale=1e3),
                        Curve((("step_time", "step time"),), BLUE, scale=1e3)))
# MoE models add a row per heat map of the latest step's per-expert counts (layer × expert):
# the heat map of a MoE model's routed tokens (`telemetry.expert_counts`); a dense model's frame has none
EXPERT_MAP_TITLE = "tokens per expert"
COLUMNS = 3
FRAME_INCHES, DPI = (11.0, 5.5), 72  # the SVG frames and the PNG picture have the same pixel size
ROW_INCHES = FRAME_INCHES[1] / 2  # the frame grows by this for each heat-map row
MAX_LABELLED_CELLS = 64  # the PNG picture writes each count in its cell up to this many cells


@dataclass(frozen=True)
class Panel:
    """Where a PNG picture draws one plot and in which colours, so whoever reads the PNG (a test, a
    report) can tell a picture with data from an empty one."""

    title: str
    box: tuple[int, int, int, int]  # left, top, right, bottom: the plot area in PNG pixels
    colours: tuple[str, ...]  # matplotlib colours the data is drawn in
    bars: bool  # stacked bars standing on the bottom edge (else lines)
    heat: bool = False  # a heat map filling the plot area (cells coloured along HEAT_COLOURS)


class LiveDashboard:
    """Draws the metrics engines publish under `METRICS_KEY`; silent until the first such dict.

    `mode`: "auto" (rich display inside a notebook frontend, text in a terminal), "display" or
    "text". `max_fps` caps live frames; `max_duty` caps the share of the machine's CPU time (all
    cores) they take. `cpu_seconds` is the CPU time `update` has spent (this thread only).
    """

    def __init__(self, *, mode: str = "auto", max_fps: float = 2.0, max_duty: float = 0.005,
                 stream: TextIO | None = None):
        if mode not in ("auto", "display", "text"):
            raise ValueError(f"mode={mode!r}; choose 'auto', 'display' or 'text'")
        self.mode = _detect_mode() if mode == "auto" else mode
        self.min_interval = 1.0 / max_fps
        self.cpu_budget = max_duty * (os.cpu_count() or 1)  # CPU seconds per wall second
        self.stream = stream
        self.handle: Any = None
        self.frames = 0  # live (SVG) frames shown
        self.cpu_seconds = 0.0
        self._changed = False  # rows arrived since the last frame
        self._last_frame = 0.0
        self._frame_cost = 0.0
        self._picture = PngPicture(columns=COLUMNS, dpi=DPI, dense_height=FRAME_INCHES[1],
                                   dense_plots=len(PANELS), max_labelled_cells=MAX_LABELLED_CELLS)
        self._start_run(None)

    def _start_run(self, run: Any) -> None:
        """Forget the rows merged so far: a new fit draws fresh curves."""
        self._run = run
        self.rows: dict[int, dict[int, dict]] = {}  # rank -> step -> row
        self.header: dict[int, dict] = {}
        self._columns: dict[int, dict[str, _Column]] = {}  # rank -> metric -> its column
        self._newest: dict[int, int] = {}  # rank -> newest step merged
        self.evals: dict[int, list[dict]] = {}  # rank -> its evaluation rows (Trainer eval_every)
        self._newest_eval: dict[int, int] = {}  # rank -> step of its newest evaluation row
        self._merged: dict[tuple[int, int], int] = {}  # (rank, chunk) -> rows merged
        self._complete: dict[int, int] = {}  # rank -> leading chunks full and merged
        self._printed_step = -1
        self._printed_evals = 0
        self.samples: tuple[int, list[dict]] | None = None  # (step, the newest rollout's samples)
        self._printed_samples = -1  # step of the samples the text mode printed last

    # ---- feeding ----------------------------------------------------------------------------
    def update(self, per_rank: list[dict | None]) -> None:
        """Merge the latest published dicts (rank order); show a new frame if one is due."""
        started = time.thread_time()
        try:
            if not self._merge(per_rank):
                return
            if self.mode == "text":
                self._print_new_lines()
            elif self._frame_due():
                self._show_live_frame()
        finally:
            self.cpu_seconds += time.thread_time() - started

    def finish(self, per_rank: list[dict | None] | None = None) -> None:
        """Show the final frame, the full matplotlib picture (the executed notebook keeps it)."""
        self._merge(per_rank or [])
        if not self.rows:
            return
        if self.mode == "text":
            self._print_new_lines()
            return
        png, line = self.png(), self.progress()
        self._show({"text/plain": line, "image/png": png,
                    "text/html": _frame_html(line, "image/png", png) + self.samples_html()})

    def _merge(self, per_rank: list[dict | None]) -> bool:
        for rank, data in enumerate(per_rank):
            header = data.get(METRICS_KEY) if isinstance(data, dict) else None
            if not header:
                continue
            rank = int(header.get("rank", rank))
            if header.get("run") != self._run and rank == 0:
                self._start_run(header.get("run"))
            self.header[rank] = header
            index = self._complete.get(rank, 0)  # chunks before it are full and merged: final
            while (rows := data.get(f"{ROWS_KEY}{index}")) is not None:
                if self._merged.get((rank, index)) != len(rows):  # chunks only ever grow
                    self._merged[(rank, index)] = len(rows)
                    self._add_rows(rank, rows)
                if len(rows) >= CHUNK and index == self._complete.get(rank, 0):
                    self._complete[rank] = index + 1
                index += 1
        return bool(self.rows)

    def _add_rows(self, rank: int, rows: list[dict]) -> None:
        """Keep the rows, and each metric as a column: frames read the columns, so a frame costs
        no pass over every row. Rows come in step order (chunks hold them so); a row of a step
        already seen is a chunk sent again."""
        steps = self.rows.setdefault(rank, {})
        columns = self._columns.setdefault(rank, {})
        for row in rows:
            step, evaluation = int(row["step"]), row.get("kind") == "eval"
            if evaluation:  # shares its step with a training row: kept apart, drawn as its own curve
                if step <= self._newest_eval.get(rank, -1):
                    continue
                self.evals.setdefault(rank, []).append(row)
                self._newest_eval[rank] = step
            else:
                steps[step] = row
                if step <= self._newest.get(rank, -1):
                    continue
                self._newest[rank] = step
                self._keep_samples(step, valid_samples(row.get(SAMPLES_COLUMN)))
            self._changed = True
            for key, value in row.items():
                if isinstance(value, (int, float)) and key not in ("step", "rank"):
                    columns.setdefault(key, _Column()).append(step, value)

    def _keep_samples(self, step: int, samples: list[dict] | None) -> None:
        """The newest step's samples (every rank's rollout is the same: the first to come is kept)."""
        if samples is not None and (self.samples is None or step > self.samples[0]):
            self.samples = (step, samples)

    def samples_html(self) -> str:
        """The table of the newest samples under the frame ('' when the rows carry none)."""
        return samples_html(self.samples[1], self.samples[0]) if self.samples is not None else ""

    # ---- summaries ----------------------------------------------------------------------------
    def latest(self) -> dict[int, dict]:
        """The newest row of each rank."""
        return {rank: self.rows[rank][step] for rank, step in sorted(self._newest.items())}

    def series(self, key: str, rank: int | None = None) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, from `rank` or the lowest rank that has it."""
        steps, values = self._column(key, rank)
        return [int(s) for s in steps], values.tolist()

    def _column(self, key: str, rank: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        for r in ([rank] if rank is not None else sorted(self._columns)):
            column = self._columns.get(r, {}).get(key)
            if column is not None:
                return column.view()
        return np.empty(0), np.empty(0)

    def plots(self) -> list[Plot]:
        """What a frame shows, plot by plot: the SVG frames and the PNG picture draw these. A MoE
        run adds its heat maps below the curves and bars."""
        latest = self.latest()
        return ([self._plot(spec, latest) for spec in _panel_specs(latest, self._saves())]
                + [plot for _, plot in self._expert_maps(latest)])

    def _saves(self) -> bool:
        """Whether any rank has reported an asynchronous save (its pause) so far."""
        return any("ckpt_pause_s" in columns for columns in self._columns.values())

    def _expert_maps(self, latest: dict[int, dict]) -> list[tuple[str, Plot]]:
        """(title, plot) of the layer × expert heat map of the newest step's routed tokens, from the
        lowest rank whose row has them (the counts are already summed over the ranks sharing the
        batch); none for a dense model. The experts are dropless: no token is dropped to map."""
        for row in latest.values():
            counts = expert_counts(row)
            if counts:
                return [(EXPERT_MAP_TITLE, _heat_plot(EXPERT_MAP_TITLE, counts, int(row["step"])))]
        return []

    def _plot(self, spec: PanelSpec, latest: dict[int, dict]) -> Plot:
        if spec.parts:
            ranks = list(latest)
            stacks = tuple(Stack(label, colour, [float(latest[r].get(key) or 0.0) * spec.scale
                                                 for r in ranks])
                           for key, label, colour in spec.parts)
            key, template, factor = spec.note or ("", "", 1.0)
            notes = tuple(template.format(latest[r][key] * factor) if spec.note and latest[r].get(key) is not None
                          else "" for r in ranks)
            key, label = spec.limit or ("", "")
            bound = max((float(latest[r].get(key) or 0.0) for r in ranks), default=0.0) * spec.scale
            return Plot(spec.title, bars=True, categories=tuple(str(r) for r in ranks),
                        stacks=stacks, notes=notes, limit=bound or None, limit_label=label)
        lines = []
        for curve in spec.curves:
            name, steps, values = curve.keys[0][1], np.empty(0), np.empty(0)
            for key, label in curve.keys:
                steps, values = self._column(key)
                if len(steps):
                    name = label
                    break
            lines.append(Line(name, curve.colour, steps, values * curve.scale, curve.right))
        return Plot(spec.title.format(lines[0].label), lines=tuple(lines))

    def svg(self) -> str:
        """The current live frame as SVG text."""
        plots = self.plots()
        width, height = (int(round(inches * DPI)) for inches in _frame_inches(plots))
        return svg_grid(plots, columns=COLUMNS, width=width, height=height)

    def png(self) -> bytes:
        """The current frame as the full matplotlib picture (PNG bytes), drawn now."""
        plots = self.plots()
        return self._picture.png(plots, _frame_inches(plots))

    def panels(self) -> list[Panel]:
        """The PNG picture's plots: their pixel boxes in `png()` and final frames, and data colours."""
        plots = self.plots()
        boxes = self._picture.boxes(plots, _frame_inches(plots))
        latest = self.latest()
        specs = [(_default_title(spec), spec.colours, bool(spec.parts), False)
                 for spec in _panel_specs(latest, self._saves())]
        specs += [(title, HEAT_COLOURS, False, True) for title, _ in self._expert_maps(latest)]
        return [Panel(title, box, colours, bars, heat) for (title, colours, bars, heat), box in zip(specs, boxes)]

    def progress(self) -> str:
        header = self.header.get(min(self.header)) if self.header else {}
        line = progress_line(self.latest(), int(header.get("total_steps", 0)))
        evals = self.evals.get(min(self.evals)) if self.evals else None
        return f"{line} · validation loss {evals[-1]['eval_loss']:.4f}" if evals else line

    # ---- text mode ----------------------------------------------------------------------------
    def _print_new_lines(self) -> None:
        stream = self.stream or sys.stdout
        reference = min(self.rows)
        for step in sorted(s for s in self.rows[reference] if s > self._printed_step):
            ranks = {r: steps[step] for r, steps in self.rows.items() if step in steps}
            header = self.header.get(reference, {})
            print(progress_line(ranks, int(header.get("total_steps", 0))), file=stream, flush=True)
            self._printed_step = step
        evals = self.evals.get(reference, [])
        for row in evals[self._printed_evals:]:
            print(eval_line(row), file=stream, flush=True)
        self._printed_evals = len(evals)
        if self.samples is not None and self.samples[0] > self._printed_samples:
            print("\n".join(samples_lines(self.samples[1], self.samples[0])), file=stream, flush=True)
            self._printed_samples = self.samples[0]

    # ---- display mode -------------------------------------------------------------------------
    def _frame_due(self) -> bool:
        """New rows, and the last frame is older than the rate cap and than its own CPU cost
        allows (each CPU second spent here is taken from engines that share the cores)."""
        if not self._changed:
            return False
        interval = max(self.min_interval, self._frame_cost / self.cpu_budget)
        return self.handle is None or time.monotonic() - self._last_frame >= interval

    def _show_live_frame(self) -> None:
        started = time.thread_time()
        svg, line = self.svg(), self.progress()
        self._show({"text/plain": line,
                    "text/html": _frame_html(line, "image/svg+xml", svg.encode()) + self.samples_html()})
        self._frame_cost = time.thread_time() - started
        self._last_frame = time.monotonic()
        self._changed = False
        self.frames += 1

    def _show(self, bundle: dict[str, Any]) -> None:
        """Put `bundle` in the one display handle."""
        from IPython.display import display

        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)


class _Column:
    """One metric's (step, value) pairs in step order, in arrays that double when full: a frame
    takes views of them, never a copy of the whole history."""

    __slots__ = ("x", "y", "size")

    def __init__(self) -> None:
        self.x, self.y, self.size = np.empty(CHUNK), np.empty(CHUNK), 0

    def append(self, step: int, value: float) -> None:
        if self.size == len(self.x):
            self.x, self.y = (np.concatenate([a, np.empty_like(a)]) for a in (self.x, self.y))
        self.x[self.size], self.y[self.size] = step, value
        self.size += 1

    def view(self) -> tuple[np.ndarray, np.ndarray]:
        return self.x[:self.size], self.y[:self.size]


def _heat_plot(title: str, counts: list[list[float]], step: int) -> Plot:
    """A full-width heat map of one step's layer × expert counts; the title says the step and how
    far the busiest expert is above the mean (1.00× is perfect balance)."""
    title = f"{title}, step {step}"
    ratios = [max(layer) / (sum(layer) / len(layer)) for layer in counts if sum(layer)]
    if ratios:
        title += f" · busiest expert {max(ratios):.2f}× the mean"
    return Plot(title, heat=tuple(tuple(layer) for layer in counts),
                row_labels=tuple(f"layer {i}" for i in range(len(counts))),
                categories=tuple(str(e) for e in range(len(counts[0]))), span=COLUMNS)


def _frame_inches(plots: list[Plot]) -> tuple[float, float]:
    """The dense frame's size, taller by a row for each row of plots beyond its two."""
    rows = grid_places(plots, COLUMNS)[-1][0] + 1
    return FRAME_INCHES[0], FRAME_INCHES[1] + ROW_INCHES * (rows - len(PANELS) // COLUMNS)


def _panel_specs(latest: dict[int, dict], saves: bool) -> tuple[PanelSpec, ...]:
    """PANELS, the tiers plot when a rank's newest row reports memory tiers, the reward plot when
    it reports a reward, and the save plot once a row has reported an asynchronous save."""
    tiers = any(row.get("mem_tier_device") is not None for row in latest.values())
    rewards = any(row.get("reward") is not None for row in latest.values())
    return PANELS + (TIER_PANEL,) * tiers + (REWARD_PANEL,) * rewards + (SAVE_PANEL,) * saves


def _default_title(spec: PanelSpec) -> str:
    return spec.title.format(spec.curves[0].keys[0][1] if spec.curves else "")


def _frame_html(line: str, mime: str, image: bytes) -> str:
    """The progress line over the picture, for frontends that show HTML first (all of them)."""
    return (f"<div style='font-family:monospace'>{_escape(line)}</div>"
            f"<img src='data:{mime};base64,{base64.b64encode(image).decode()}'/>")


def progress_line(latest: dict[int, dict], total_steps: int) -> str:
    """`step 12/100 · loss 3.2100 · 1.2k tok/s · MFU 3.1% · lr 3.00e-03 · grad norm 0.52 ·
    mem 45.0 MiB/rank · compiled in 16.9 s · ETA 0:00:42` (compiled: a step that ran torch.compile,
    whose seconds the ETA leaves out)."""
    if not latest:
        return "waiting for the first step"
    row = latest[min(latest)]
    step = int(row["step"])
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}", f"loss {row['loss']:.4f}"]
    if row.get("tokens_per_s") is not None:
        parts.append(f"{_si(row['tokens_per_s'])} tok/s")
    elif row.get("samples_per_s") is not None:
        parts.append(f"{_si(row['samples_per_s'])} samples/s")
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    if row.get("lr") is not None:
        parts.append(f"lr {row['lr']:.2e}")
    if row.get("grad_norm") is not None:
        parts.append(f"grad norm {row['grad_norm']:.3g}")
    memory = [r.get("mem_total") for r in latest.values() if r.get("mem_total") is not None]
    if memory:
        parts.append(f"mem {max(memory) / 2 ** 20:.1f} MiB/rank")
    moved = [r["mem_tier_moved"] for r in latest.values() if r.get("mem_tier_moved") is not None]
    if moved:
        parts.append(f"tiers moved {max(moved) / 2 ** 20:,.1f} MiB/step")
    if row.get("bubble") is not None:
        parts.append(f"bubble {100 * row['bubble']:.0f}%")
    if row.get("compile_s"):
        parts.append(f"compiled in {row['compile_s']:.1f} s")
    if row.get("ckpt_pause_s") is not None:
        parts.append(f"saved, the step paused {1e3 * row['ckpt_pause_s']:.0f} ms")
    if row.get("ckpt_writing"):
        parts.append("checkpoint writing in the background")
    if total_steps and row.get("step_time") and step < total_steps:
        seconds = int(round((row["step_time"] - row.get("compile_s", 0.0)) * (total_steps - step)))
        parts.append(f"ETA {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}")
    return " · ".join(parts)


def eval_line(row: dict) -> str:
    """`eval at step 50 · loss 2.3100 · perplexity 10.07 · 8192 tokens`."""
    parts = [f"eval at step {int(row['step'])}", f"loss {row['eval_loss']:.4f}"]
    if row.get("eval_perplexity") is not None:
        parts.append(f"perplexity {row['eval_perplexity']:.4g}")
    parts += [f"{row[f'eval_{unit}']} {unit}" for unit in ("tokens", "labels", "samples")
              if row.get(f"eval_{unit}") is not None]
    return " · ".join(parts)


def _si(value: float) -> str:
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f}{suffix}"
    return f"{value:.0f}"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _detect_mode() -> str:
    """Rich display inside a notebook frontend (Jupyter, VS Code, Colab, nbclient); text otherwise."""
    try:
        from IPython import get_ipython
    except ImportError:
        return "text"
    shell = get_ipython()
    if shell is None or type(shell).__name__ == "TerminalInteractiveShell":
        return "text"
    return "display"
