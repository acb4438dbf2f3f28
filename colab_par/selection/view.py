"""Live notebook view of a model-selection sweep: loss per trial, who ran where (Gantt), leaderboard.

Renders a `SweepResult`; never measures. Like the training dashboard (and through its helpers), it
redraws ONE display handle in place with a matplotlib (Agg) PNG, at most `max_fps` times a second
and within `max_duty` of the machine's CPU time, because the client shares the CPUs with the engines
running the trials. `finish` always draws, so the executed notebook keeps the final frame. Outside
a notebook it prints a line when a trial changes status, and the leaderboard at the end.
"""
from __future__ import annotations

import base64
import io
import math
import os
import sys
import time
from typing import Any, TextIO

from colab_par.views.dashboard import Panel, _detect_mode, _escape
from colab_par.selection.results import SweepResult

__all__ = ["SelectionView", "leaderboard_text", "trial_colour"]

# tab10, then Dark2: 18 colours far enough apart (per RGB channel) to be told apart, by eye and by
# the picture tests; trial i keeps colour i in every frame and panel.
TRIAL_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                 "tab:pink", "tab:gray", "tab:olive", "tab:cyan", "#1b9e77", "#d95f02", "#7570b3",
                 "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666")
TITLES = ("loss per trial", "timeline", "leaderboard")
STATUS_ORDER = ("done", "running", "waiting", "pruned", "stopped", "failed")
ROW_PX = 12  # leaderboard line height in pixels (8 pt text at 72 dpi)


def trial_colour(index: int) -> str:
    """The colour of the trial at `index` in `SweepResult.trials` (repeats after 18 trials)."""
    return TRIAL_COLOURS[index % len(TRIAL_COLOURS)]


def leaderboard_text(result: SweepResult) -> str:
    """`SweepResult.leaderboard()` as aligned plain text; only trials with a loss and no failure
    get a rank, and a failed trial shows the first line of its error."""
    header = ("#", "trial", "status", "final", "best", "steps", "engines", "shards", "error")
    rows, rank = [header], 0
    for trial in result.leaderboard():
        scored = trial.status != "failed" and not math.isnan(trial.final_loss)
        rank += scored
        rows.append((str(rank) if scored else "-", trial.name, trial.status,
                     _loss(trial.final_loss), _loss(trial.best_loss),
                     f"{len(trial.losses)}/{trial.steps}",
                     ",".join(str(e) for e in sorted(trial.engines)) or "-", str(trial.shards),
                     _brief(trial.error)))
    if not any(row[-1] for row in rows[1:]):
        rows = [row[:-1] for row in rows]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in rows)


class SelectionView:
    """Draws the `SweepResult` the sweep driver passes to `update` (often) and `finish` (once).

    `mode`: "auto" (PNG display in a notebook frontend, text in a terminal), "png" (alias
    "display", as `LiveDashboard` names it) or "text". `max_fps` caps redraws; `max_duty` caps the
    share of the machine's CPU time (all cores) spent drawing.
    """

    def __init__(self, *, mode: str = "auto", max_fps: float = 2.0, max_duty: float = 0.005,
                 stream: TextIO | None = None):
        if mode not in ("auto", "png", "display", "text"):
            raise ValueError(f"mode={mode!r}; choose 'auto', 'png' or 'text'")
        self.mode = _detect_mode() if mode == "auto" else "text" if mode == "text" else "display"
        self.min_interval = 1.0 / max_fps
        self.cpu_budget = max_duty * (os.cpu_count() or 1)  # CPU seconds per wall second
        self.stream = stream
        self.handle: Any = None
        self.frames = 0  # pictures drawn for the display (not counting direct `png()` calls)
        self._last_render = 0.0
        self._render_cost = 0.0
        self._statuses: tuple[str, ...] | None = None
        self._figure: Any = None
        self._artists: list[Any] = []

    def update(self, result: SweepResult) -> None:
        """Redraw if the rate and CPU caps allow (text mode: a line when a status changed)."""
        if self.mode == "text":
            statuses = tuple(t.status for t in result.trials)
            if statuses != self._statuses:
                self._statuses = statuses
                print(_summary(result), file=self.stream or sys.stdout, flush=True)
            return
        interval = max(self.min_interval, self._render_cost / self.cpu_budget)
        if self.handle is None or time.monotonic() - self._last_render >= interval:
            self._render(result)

    def finish(self, result: SweepResult) -> None:
        """Draw the final frame regardless of the caps (text mode: print the leaderboard)."""
        if self.mode == "text":
            print(f"{_summary(result)}\n{leaderboard_text(result)}", file=self.stream or sys.stdout,
                  flush=True)
        else:
            self._render(result)

    def png(self, result: SweepResult) -> bytes:
        """One frame as PNG bytes, drawn now regardless of the caps."""
        self._ensure_figure()
        return self._draw_png(result)

    def panels(self, result: SweepResult | None = None) -> list[Panel]:
        """The three plots' pixel boxes in `png()` frames (fixed: no layout engine) and the colours
        `result`'s trials are drawn in (none for the leaderboard, whose markers are no data)."""
        self._ensure_figure()
        height = int(round(self._figure.bbox.height))
        colours = tuple(trial_colour(i) for i in range(len(result.trials) if result else 0))
        return [Panel(title, (int(round(ax.bbox.x0)), int(round(height - ax.bbox.y1)),
                              int(round(ax.bbox.x1)), int(round(height - ax.bbox.y0))),
                      colours if title != "leaderboard" else (), False)
                for title, ax in zip(TITLES, self._axes)]

    def row_band(self, engine: int) -> tuple[int, int]:
        """(top, bottom) pixel rows of `engine`'s lane in the timeline of the last frame drawn."""
        height = self._figure.bbox.height
        ys = [height - self._axes[1].transData.transform((0.0, engine + d))[1] for d in (-0.5, 0.5)]
        return int(round(min(ys))), int(round(max(ys)))

    # ---- drawing ------------------------------------------------------------------------------
    def _render(self, result: SweepResult) -> None:
        self._ensure_figure()  # first call imports matplotlib: not part of the per-frame cost
        start = time.process_time()
        png = self._draw_png(result)
        self._show(png, result)
        self._render_cost = time.process_time() - start  # paces the next frame (duty cap)
        self.frames += 1
        self._last_render = time.monotonic()

    def _show(self, png: bytes, result: SweepResult) -> None:
        """Put `png` in the one display handle; the plain-text part carries the leaderboard."""
        from IPython.display import display

        line = _summary(result)
        html = (f"<div style='font-family:monospace'>{_escape(line)}</div>"
                f"<img src='data:image/png;base64,{base64.b64encode(png).decode()}'/>")
        bundle = {"text/plain": f"{line}\n{leaderboard_text(result)}", "image/png": png,
                  "text/html": html}
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)

    def _ensure_figure(self) -> None:
        """Axes, titles and labels once (fixed boxes, no layout engine); frames swap data artists."""
        if self._figure is not None:
            return
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self._figure = Figure(figsize=(10, 6.5), dpi=72)
        FigureCanvasAgg(self._figure)
        self._axes = (self._figure.add_axes((0.06, 0.56, 0.40, 0.38)),
                      self._figure.add_axes((0.56, 0.56, 0.41, 0.38)),
                      self._figure.add_axes((0.01, 0.01, 0.98, 0.43)))
        loss_ax, timeline_ax, board_ax = self._axes
        for ax, title in zip(self._axes, TITLES):
            ax.set_title(title, fontsize=10)
            ax.tick_params(labelsize=8)
        loss_ax.set_xlabel("step", fontsize=8)
        timeline_ax.set_xlabel("seconds", fontsize=8)
        timeline_ax.set_ylabel("engine", fontsize=8)
        loss_ax.locator_params(axis="y", nbins=4)  # every tick label is drawn text: keep few
        board_ax.axis("off")

    def _draw_png(self, result: SweepResult) -> bytes:
        for artist in self._artists:
            artist.remove()
        self._artists = []
        self._draw_losses(result)
        self._draw_timeline(result)
        self._draw_board(result)
        buffer = io.BytesIO()
        self._figure.savefig(buffer, format="png", pil_kwargs={"compress_level": 1})
        return buffer.getvalue()

    def _draw_losses(self, result: SweepResult) -> None:
        ax = self._axes[0]
        finite = []
        for index, trial in enumerate(result.trials):
            values = [v if math.isfinite(v) else math.nan for v in trial.losses]
            finite += [v for v in values if not math.isnan(v)]
            if values:  # a lone first point needs a marker to be seen
                self._artists += ax.plot(range(1, len(values) + 1), values, linewidth=2,
                                         color=trial_colour(index),
                                         marker="o" if len(values) == 1 else None, markersize=4)
        ax.set_xlim(0, max([t.steps for t in result.trials], default=1))
        if finite:
            low, high = min(finite), max(finite)
            pad = 0.08 * (high - low) or 0.1 * abs(high) or 1.0
            ax.set_ylim(low - pad, high + pad)
        else:
            ax.set_ylim(0, 1)

    def _draw_timeline(self, result: SweepResult) -> None:
        """One bar per span in its trial's colour, init spans lighter; engine 0 on top."""
        from matplotlib.collections import PolyCollection
        from matplotlib.colors import to_rgb

        ax = self._axes[1]
        colour_of = {t.name: to_rgb(trial_colour(i)) for i, t in enumerate(result.trials)}
        boxes, faces = [], []
        for span in result.timeline:
            colour = colour_of.get(span.trial, (0.3, 0.3, 0.3))
            if span.kind == "init":
                colour = tuple(0.5 + 0.5 * c for c in colour)
            low, high = span.engine - 0.4, span.engine + 0.4
            boxes.append([(span.start, low), (span.end, low), (span.end, high), (span.start, high)])
            faces.append(colour)
        if boxes:  # edges in the face colour: a span shorter than a pixel still shows
            bars = PolyCollection(boxes, facecolors=faces, edgecolors=faces, linewidths=0.3)
            self._artists.append(ax.add_collection(bars))
        ranks = sorted({s.engine for s in result.timeline} | set(result.peak_resident)
                       | {e for t in result.trials for e in t.engines})
        ax.set_yticks(ranks, [str(r) for r in ranks])
        ax.set_ylim(max(ranks, default=0) + 0.5, -0.5)
        end = max([result.makespan] + [s.end for s in result.timeline])
        ax.set_xlim(0, end if end > 0 else 1.0)

    def _draw_board(self, result: SweepResult) -> None:
        """Summary, header and as many leaderboard rows as fit, each row led by its colour."""
        ax = self._axes[2]
        step = ROW_PX / ax.bbox.height
        lines = [_summary(result)] + leaderboard_text(result).splitlines()
        fits = int(1 / step) - 1
        order = {id(t): i for i, t in enumerate(result.trials)}
        board = result.leaderboard()
        if len(lines) > fits:
            lines = lines[:fits - 1] + [f"… and {len(lines) - fits + 1} more"]
        for row, line in enumerate(lines):
            y = 1.0 - row * step
            self._artists.append(ax.text(0.025, y, line, family="monospace", fontsize=8, va="top",
                                         transform=ax.transAxes, clip_on=True))
            trial = board[row - 2] if 2 <= row < len(board) + 2 and not line.startswith("…") else None
            if trial is not None:
                self._artists.append(ax.text(0.005, y, "■", fontsize=8, va="top",
                                             color=trial_colour(order[id(trial)]),
                                             transform=ax.transAxes))


def _summary(result: SweepResult) -> str:
    """`3 trials: 1 done, 1 running, 1 failed · best b 0.5200 · 12.3 s · scheduler fifo`."""
    counts = {s: sum(t.status == s for t in result.trials) for s in STATUS_ORDER}
    others = len(result.trials) - sum(counts.values())
    parts = [f"{n} {s}" for s, n in counts.items() if n] + ([f"{others} other"] if others else [])
    line = f"{len(result.trials)} trials: {', '.join(parts) or 'none'}"
    board = result.leaderboard()
    if board and board[0].status != "failed" and not math.isnan(board[0].final_loss):
        line += f" · best {board[0].name} {_loss(board[0].final_loss)}"
    return f"{line} · {result.makespan:.1f} s · scheduler {result.scheduler}"


def _loss(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.4f}" if 1e-3 <= abs(value) < 1e4 else f"{value:.3e}"


def _brief(error: str | None, limit: int = 60) -> str:
    """The first line of an error, cut to `limit` characters: the table stays one line a trial."""
    lines = (error or "").strip().splitlines()
    first = lines[0] if lines else ""
    return first if len(first) <= limit else first[:limit - 1] + "…"
