"""`Timeline`: the ranks' compact records of one recording, lined up on one clock, with the figures
a person asks first (where did the step go, how much communication hid behind compute).

Built in the notebook from what the engines sent (`events.reduce_trace`); draws itself
(`picture.py`) and prints as a table. Pure Python.
"""
from __future__ import annotations

import json
from typing import Any

from colab_par.views import remote_view
from colab_par.profiling.events import MAIN_CATEGORIES
from colab_par.profiling.picture import draw

__all__ = ["Timeline"]

_COLUMNS = {"communication": "comm", "optimizer": "optim", "waiting": "wait"}


class Timeline(remote_view.View):
    """Per-rank lanes of one torch.profiler recording (see `colab_par.profiling`).

    Times are microseconds on one clock for every rank: the ranks' own clock when they share a
    host, else each rank's shifted so that all leave the recording's opening barrier together.
    `folder` holds the raw traces, one ``rank<N>.pt.trace.json`` per rank (Perfetto, TensorBoard).
    """

    kind = "timeline"

    def __init__(self, records: list[dict[str, Any]], folder: str | None = None):
        if not records:
            raise ValueError("a Timeline needs the record of at least one rank")
        self.records = sorted(records, key=lambda r: r["rank"])
        self.folder = folder
        self._offsets = _offsets(self.records)

    # ---- what was recorded -----------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return [record["rank"] for record in self.records]

    def record(self, rank: int) -> dict[str, Any]:
        """The compact record rank `rank` sent, on its own clock (`events.reduce_trace`)."""
        return next(r for r in self.records if r["rank"] == rank)

    def offset(self, rank: int) -> float:
        """What to add to rank `rank`'s times to put them on the shared clock."""
        return self._offsets[rank]

    def lanes(self, rank: int) -> list[dict[str, Any]]:
        """Rank `rank`'s lanes, segments ``[start, end, label]`` on the shared clock."""
        shift = self.offset(rank)
        return [{**lane, "segments": [[s + shift, e + shift, label] for s, e, label in lane["segments"]]}
                for lane in self.record(rank)["lanes"]]

    def steps(self, rank: int) -> list[tuple[int, float, float]]:
        """The Trainer steps rank `rank` ran while recording: (step, start, end) on the shared clock."""
        shift = self.offset(rank)
        return [(n, s + shift, e + shift) for n, s, e in self.record(rank)["steps"]]

    @property
    def span_us(self) -> float:
        return max(self.offset(r["rank"]) + r["span_us"] for r in self.records)

    def summary(self) -> list[dict[str, Any]]:
        """Per rank: the recording's length, each host-lane category's share of it, the time some
        collective ran (`comm_us`) and how much of it overlapped other work (`hidden_us`)."""
        rows = []
        for record in self.records:
            span = record["span_us"] or 1.0
            rows.append({"rank": record["rank"], "span_us": record["span_us"],
                         **{c: record["totals"].get(c, 0.0) / span for c in MAIN_CATEGORIES},
                         "comm_us": record["comm_busy_us"], "hidden_us": record["comm_hidden_us"],
                         "collectives": record["collectives"]})
        return rows

    # ---- showing it ------------------------------------------------------------------------------
    def __str__(self) -> str:
        steps = sorted({n for r in self.records for n, _, _ in r["steps"]})
        shown = f", steps {steps[0]}–{steps[-1]}" if len(steps) > 1 else (f", step {steps[0]}" if steps else "")
        lines = [f"colab_par profile: {len(self.records)} rank(s){shown}"
                 + (f"; traces (Perfetto, TensorBoard) in {self.folder}" if self.folder else "")]
        lines.append(f"{'rank':>4} {'ms':>8} " + " ".join(f"{_COLUMNS.get(c, c):>7}" for c in MAIN_CATEGORIES)
                     + "  collectives ms (overlapped)")
        for row in self.summary():
            shares = " ".join(f"{row[c]:>7.0%}" for c in MAIN_CATEGORIES)
            hidden = row["hidden_us"] / row["comm_us"] if row["comm_us"] else 0.0
            lines.append(f"{row['rank']:>4} {row['span_us'] / 1e3:>8.1f} {shares}  "
                         f"{row['comm_us'] / 1e3:.1f} ({hidden:.0%})")
            kinds = ", ".join(f"{kind} ×{v['count']} {v['us'] / 1e3:.2f} ms"
                              for kind, v in sorted(row["collectives"].items()))
            if kinds:
                lines.append(f"{'':>14}{kinds}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Timeline of {len(self.records)} rank(s), {self.span_us / 1e3:.1f} ms, traces in {self.folder}>"

    def png(self, **options: Any) -> bytes:
        """The picture (`picture.draw` options: width in inches, dpi)."""
        return draw(self, **options)

    # ---- travelling ------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"records": self.records, "folder": self.folder}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Timeline":
        return cls(data["records"], data.get("folder"))

    def dumps(self) -> str:
        return json.dumps(self.to_json())


def _offsets(records: list[dict[str, Any]]) -> dict[int, float]:
    """Per rank, the shift onto the shared clock (see `Timeline`); the earliest rank starts at 0."""
    synced = all(r["sync_us"] is not None for r in records)
    if len({r["host"] for r in records}) > 1 and synced:
        meet = max(r["sync_us"] for r in records)
        return {r["rank"]: meet - r["sync_us"] for r in records}
    first = min(r["start_us"] for r in records)
    return {r["rank"]: r["start_us"] - first for r in records}
