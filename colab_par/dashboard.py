"""Live training dashboard in the notebook (or one text line per log step in a terminal).

Renders; never measures (telemetry.py measures on the engines). The client's wait loop feeds it
the latest `datapub` dict of every engine; it keeps the union of the rows it has seen, and redraws
ONE display handle in place with a matplotlib (Agg) PNG plus a progress line. Pictures are limited
to 2 per second and to 0.5 % of the machine's CPU time, because the client shares the CPUs with
the engines it is watching: a picture costs 0.1-0.2 CPU-seconds, so a 2-core machine whose engines
fill both cores gets one every 15-30 s, a GPU node with many idle cores twice a second. The progress
line under the last picture refreshes every second at no drawing cost, so the dashboard never looks
frozen.
"""
from __future__ import annotations

import base64
import io
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from colab_par.telemetry import METRICS_KEY, ROWS_KEY

__all__ = ["LiveDashboard", "Panel", "progress_line"]

# (row key, legend label, colour): fixed colours, so a part keeps its colour from frame to frame
MEMORY_PARTS = (("mem_params", "params", "tab:blue"), ("mem_grads", "grads", "tab:orange"),
                ("mem_optimizer", "optimizer", "tab:green"),
                ("mem_activations", "activations", "tab:red"))
TIME_PARTS = (("time_data", "data", "tab:cyan"), ("time_forward_backward", "fwd+bwd", "tab:blue"),
              ("time_clip", "clip", "tab:orange"), ("time_optimizer", "optimizer", "tab:green"),
              ("time_telemetry", "telemetry", "tab:purple"))
LINE_COLOURS = {"loss": "tab:blue", "tokens_per_s": "tab:blue", "mfu": "tab:orange"}


@dataclass(frozen=True)
class Panel:
    """Where a frame draws one plot and in which colours, so whoever reads the PNG (a test, a
    report) can tell a frame with data from an empty one."""

    title: str
    box: tuple[int, int, int, int]  # left, top, right, bottom: the plot area in PNG pixels
    colours: tuple[str, ...]  # matplotlib colours the data is drawn in
    bars: bool  # stacked bars standing on the bottom edge (else lines)


class LiveDashboard:
    """Draws the metrics engines publish under `METRICS_KEY`; silent until the first such dict.

    `mode`: "auto" (rich display inside a notebook frontend, text in a terminal), "display" or
    "text". `max_fps` caps redraws; `max_duty` caps the share of the machine's CPU time (all cores)
    spent drawing; `progress_interval` paces the progress line shown under the last picture.
    """

    def __init__(self, *, mode: str = "auto", max_fps: float = 2.0, max_duty: float = 0.005,
                 progress_interval: float = 1.0,
                 stream: TextIO | None = None):
        if mode not in ("auto", "display", "text"):
            raise ValueError(f"mode={mode!r}; choose 'auto', 'display' or 'text'")
        self.mode = _detect_mode() if mode == "auto" else mode
        self.min_interval = 1.0 / max_fps
        self.progress_interval = progress_interval  # s between progress lines while no picture is due
        self.cpu_budget = max_duty * (os.cpu_count() or 1)  # CPU seconds per wall second
        self.stream = stream
        self.rows: dict[int, dict[int, dict]] = {}  # rank -> step -> row
        self.header: dict[int, dict] = {}
        self.handle: Any = None
        self.frames = 0
        self._run: Any = None
        self._last_render = 0.0
        self._last_shown = 0.0
        self._png = b""
        self._render_cost = 0.0
        self._printed_step = -1
        self._merged: dict[tuple[int, str], int] = {}
        self._figure: Any = None

    # ---- feeding ----------------------------------------------------------------------------
    def update(self, per_rank: list[dict | None]) -> None:
        """Merge the latest published dicts (rank order); redraw if enough time has passed."""
        if not self._merge(per_rank):
            return
        if self.mode == "text":
            self._print_new_lines()
            return
        now = time.monotonic()
        interval = max(self.min_interval, self._render_cost / self.cpu_budget)
        if self.handle is None or now - self._last_render >= interval:
            self._render()
        elif now - self._last_shown >= self.progress_interval:
            self._show(self._png)  # the last picture under a fresh progress line: nothing drawn

    def finish(self, per_rank: list[dict | None] | None = None) -> None:
        """Show the final frame (the executed notebook keeps it)."""
        self._merge(per_rank or [])
        if not self.rows:
            return
        if self.mode == "text":
            self._print_new_lines()
        else:
            self._render()

    def _merge(self, per_rank: list[dict | None]) -> bool:
        for rank, data in enumerate(per_rank):
            header = data.get(METRICS_KEY) if isinstance(data, dict) else None
            if not header:
                continue
            rank = int(header.get("rank", rank))
            if header.get("run") != self._run and rank == 0:
                self._run = header.get("run")
                self.rows, self.header, self._printed_step, self._merged = {}, {}, -1, {}
            self.header[rank] = header
            steps = self.rows.setdefault(rank, {})
            for key, rows in data.items():
                if not key.startswith(ROWS_KEY) or self._merged.get((rank, key)) == len(rows):
                    continue  # chunks are only ever extended: an unchanged length is nothing new
                self._merged[(rank, key)] = len(rows)
                for row in rows:
                    if row.get("kind") != "eval":  # evaluation rows share a step with a training row
                        steps[int(row["step"])] = row
        return bool(self.rows)

    # ---- summaries ----------------------------------------------------------------------------
    def latest(self) -> dict[int, dict]:
        """The newest row of each rank."""
        return {rank: steps[max(steps)] for rank, steps in sorted(self.rows.items()) if steps}

    def series(self, key: str, rank: int | None = None) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, from `rank` or the lowest rank that has it."""
        ranks = [rank] if rank is not None else sorted(self.rows)
        for r in ranks:
            steps = self.rows.get(r, {})
            points = [(s, row[key]) for s, row in sorted(steps.items()) if row.get(key) is not None]
            if points:
                return [s for s, _ in points], [float(v) for _, v in points]
        return [], []

    def png(self) -> bytes:
        """The current frame as PNG bytes (for files and reports), drawn now regardless of rate limits."""
        self._ensure_figure()
        return self._draw_png()

    def panels(self) -> list[Panel]:
        """The frame's four plots: their pixel boxes in `png()` / display frames, and data colours."""
        self._ensure_figure()
        height = int(round(self._figure.bbox.height))
        (loss_ax, speed_ax), (memory_ax, time_ax) = self._axes
        specs = ((loss_ax, ("loss",), ()), (speed_ax, ("tokens_per_s", "mfu"), ()),
                 (memory_ax, (), MEMORY_PARTS), (time_ax, (), TIME_PARTS))
        panels = []
        for ax, lines, parts in specs:
            box = ax.bbox
            colours = tuple(dict.fromkeys([LINE_COLOURS[key] for key in lines] +
                                          [colour for _, _, colour in parts]))
            panels.append(Panel(ax.get_title(), (int(round(box.x0)), int(round(height - box.y1)),
                                                 int(round(box.x1)), int(round(height - box.y0))),
                                colours, bool(parts)))
        return panels

    def progress(self) -> str:
        header = self.header.get(min(self.header)) if self.header else {}
        return progress_line(self.latest(), int(header.get("total_steps", 0)))

    # ---- text mode ----------------------------------------------------------------------------
    def _print_new_lines(self) -> None:
        stream = self.stream or sys.stdout
        reference = min(self.rows)
        for step in sorted(s for s in self.rows[reference] if s > self._printed_step):
            ranks = {r: steps[step] for r, steps in self.rows.items() if step in steps}
            header = self.header.get(reference, {})
            print(progress_line(ranks, int(header.get("total_steps", 0))), file=stream, flush=True)
            self._printed_step = step

    # ---- display mode -------------------------------------------------------------------------
    def _render(self) -> None:
        self._ensure_figure()  # first call imports matplotlib: not part of the per-frame cost
        start = time.process_time()
        self._png = self._draw_png()
        self._show(self._png)
        # Every frame, the first included, sets the pace: on a machine whose cores the engines fill,
        # each CPU second spent here is taken from training (figure construction is not counted).
        self._render_cost = time.process_time() - start
        self.frames += 1
        self._last_render = time.monotonic()

    def _show(self, png: bytes) -> None:
        """Put `png` and the current progress line in the one display handle."""
        from IPython.display import display

        line = self.progress()
        html = (f"<div style='font-family:monospace'>{_escape(line)}</div>"
                f"<img src='data:image/png;base64,{base64.b64encode(png).decode()}'/>")
        bundle = {"text/plain": line, "image/png": png, "text/html": html}
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)
        self._last_shown = time.monotonic()

    def _ensure_figure(self) -> None:
        """Build the figure and its line artists once; frames only update data (re-creating axes
        and ticks every frame costs several times more than drawing)."""
        if self._figure is not None:
            return
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self._figure = Figure(figsize=(9, 5), dpi=72)  # fixed margins: layout engines cost a lot
        FigureCanvasAgg(self._figure)
        (loss_ax, speed_ax), (memory_ax, time_ax) = self._axes = self._figure.subplots(2, 2)
        self._figure.subplots_adjust(left=0.07, right=0.93, top=0.94, bottom=0.09, hspace=0.45,
                                     wspace=0.25)
        mfu_ax = speed_ax.twinx()
        self._lines = {key: ax.plot([], [], color=LINE_COLOURS[key], linewidth=2)[0]
                       for key, ax in (("loss", loss_ax), ("tokens_per_s", speed_ax), ("mfu", mfu_ax))}
        self._line_scale = {"loss": 1.0, "tokens_per_s": 1.0, "mfu": 100.0}
        for ax, title in ((loss_ax, "loss by step"), (speed_ax, "tokens/s (blue), MFU % (orange)"),
                          (memory_ax, "memory by rank (MiB)"), (time_ax, "step time by rank (ms)")):
            ax.set_title(title, fontsize=10)
        for ax in (loss_ax, speed_ax, mfu_ax, memory_ax, time_ax):
            ax.tick_params(labelsize=8)
            ax.locator_params(axis="y", nbins=4)  # every tick label is drawn text: keep few
        for ax in (loss_ax, speed_ax):
            ax.locator_params(axis="x", nbins=5)
        self._bars: list[Any] = []

    def _draw_png(self) -> bytes:
        for key, line in self._lines.items():
            steps, values = self.series(key)
            if key == "tokens_per_s" and not steps:  # models without tokens: samples/s instead
                steps, values = self.series("samples_per_s")
                line.axes.set_title("samples/s (blue), MFU % (orange)", fontsize=10)
            line.set_data(steps, [self._line_scale[key] * v for v in values])
            line.axes.relim()
            line.axes.autoscale_view()
        for artist in self._bars:
            artist.remove()
        self._bars = []
        latest = self.latest()
        _, (memory_ax, time_ax) = self._axes
        self._draw_stacked(memory_ax, latest, MEMORY_PARTS, scale=2 ** -20)
        self._draw_stacked(time_ax, latest, TIME_PARTS, scale=1e3, note="bubble")
        buffer = io.BytesIO()
        self._figure.savefig(buffer, format="png", pil_kwargs={"compress_level": 1})
        return buffer.getvalue()

    def _draw_stacked(self, ax: Any, latest: dict[int, dict], parts: tuple, *, scale: float,
                      note: str | None = None) -> None:
        ranks = list(latest)
        positions = list(range(len(ranks)))
        bottoms = [0.0] * len(ranks)
        for key, label, colour in parts:
            heights = [float(latest[r].get(key) or 0.0) * scale for r in ranks]
            if any(heights):
                self._bars.append(ax.bar(positions, heights, bottom=bottoms, label=label, color=colour))
                bottoms = [b + h for b, h in zip(bottoms, heights)]
        for i, r in enumerate(ranks):
            value = latest[r].get(note) if note else None
            if value is not None:
                self._bars.append(ax.annotate(f"{note} {100 * value:.0f}%", (i, bottoms[i]),
                                              ha="center", va="bottom", fontsize=7))
        ax.set_xticks(positions, [str(r) for r in ranks])
        ax.set_xlim(-0.6, len(ranks) - 0.4)
        ax.set_ylim(0, 1.6 * max(bottoms, default=0.0) or 1.0)  # headroom for legend and notes
        if ranks:
            self._bars.append(ax.legend(fontsize=7, loc="upper center", ncol=len(parts)))


def progress_line(latest: dict[int, dict], total_steps: int) -> str:
    """`step 12/100 · loss 3.2100 · 1.2k tok/s · MFU 3.1% · mem 45.0 MiB · ETA 0:00:42`."""
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
    memory = [r.get("mem_total") for r in latest.values() if r.get("mem_total") is not None]
    if memory:
        parts.append(f"mem {max(memory) / 2 ** 20:.1f} MiB/rank")
    if row.get("bubble") is not None:
        parts.append(f"bubble {100 * row['bubble']:.0f}%")
    if total_steps and row.get("step_time") and step < total_steps:
        seconds = int(round(row["step_time"] * (total_steps - step)))
        parts.append(f"ETA {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}")
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
