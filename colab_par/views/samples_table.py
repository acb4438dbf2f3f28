"""What the policy wrote, as the dashboard shows it: the rows' `SAMPLES_COLUMN` (a few prompts, a
completion of each and its reward) as an HTML table under the live plots, or as text lines in a
terminal. Reading completions is how a post-training user sees reward hacking or a collapsed
policy long before a mean reward says so."""
from __future__ import annotations

from html import escape
from typing import Any

__all__ = ["samples_html", "samples_lines", "samples_markdown", "valid_samples"]

CELL_CHARS = 300  # a longer prompt or completion is cut, with an ellipsis, to keep frames small


def valid_samples(value: Any) -> list[dict] | None:
    """`value` as a list of sample dicts, or None when it is not one (a row without samples)."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(item, dict) and "completion" in item for item in value):
        return None
    return value


def samples_html(samples: list[dict], step: int) -> str:
    """An HTML table: prompt, completion, reward (one row a sample)."""
    cells = "".join(f"<tr><td>{_cell(s.get('prompt'))}</td><td>{_cell(s.get('completion'))}</td>"
                    f"<td style='text-align:right'>{_number(s.get('reward'))}</td></tr>" for s in samples)
    return ("<table style='font-family:monospace;font-size:12px;border-collapse:collapse'>"
            f"<caption style='text-align:left'>completions at step {step}</caption>"
            "<tr><th style='text-align:left'>prompt</th><th style='text-align:left'>completion</th>"
            f"<th>reward</th></tr>{cells}</table>")


def samples_lines(samples: list[dict], step: int) -> list[str]:
    """The same as text: a header line, then `reward | prompt -> completion` per sample."""
    return [f"completions at step {step}:"] + [
        f"  {_number(s.get('reward')):>8} | {_short(s.get('prompt'))!r} -> {_short(s.get('completion'))!r}"
        for s in samples]


def samples_markdown(samples: list[dict]) -> str:
    """The same as a Markdown table (TensorBoard's text tab renders Markdown)."""
    def cell(value: Any) -> str:
        return _short(value).replace("|", "\\|").replace("\n", " ")
    rows = [f"| {cell(s.get('prompt'))} | {cell(s.get('completion'))} | {_number(s.get('reward'))} |"
            for s in samples]
    return "\n".join(["| prompt | completion | reward |", "|---|---|---:|", *rows])


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= CELL_CHARS else text[:CELL_CHARS - 1] + "…"


def _cell(value: Any) -> str:
    return escape(_short(value)).replace("\n", "<br/>")


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "n/a"
