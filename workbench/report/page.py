"""The comparison page: one self-contained HTML file (inline CSS and JS, figures embedded as
base64) written beside the figures' PNG files."""
from __future__ import annotations

import base64
import html
import math
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from workbench.files import write_text_atomically
from workbench.report import plots
from workbench.report.runs import Run

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em;
       color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { padding: 4px 8px; border-bottom: 1px solid #eee; text-align: left; white-space: nowrap; }
td:first-child { white-space: normal; min-width: 12em; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
th { cursor: pointer; user-select: none; background: #f6f6f6; position: sticky; top: 0; }
th[aria-sort="ascending"]::after { content: " \\25B2"; }
th[aria-sort="descending"]::after { content: " \\25BC"; }
tbody tr:hover { background: #f3f7ff; }
figure { margin: 1em 0; } img { max-width: 100%; } .note { color: #777; font-style: italic; }
"""

# Click a header to sort by it, again to reverse; numbers sort by their data-value, blanks last.
# The table starts sorted by the chosen metric, best first; data-ready="1" says the script ran.
SCRIPT = """
(function () {
  const table = document.getElementById("runs");
  const headers = Array.from(table.tHead.rows[0].cells);
  function key(row, column) {
    const cell = row.cells[column];
    if (cell.dataset.value === undefined) return cell.textContent.trim().toLowerCase();
    const value = parseFloat(cell.dataset.value);
    return Number.isNaN(value) ? null : value;
  }
  function sortBy(column, descending) {
    const body = table.tBodies[0];
    const rows = Array.from(body.rows);
    rows.sort(function (a, b) {
      const x = key(a, column), y = key(b, column);
      if (x === null || y === null) return (x === null) - (y === null);
      const order = x < y ? -1 : x > y ? 1 : 0;
      return descending ? -order : order;
    });
    rows.forEach(function (row) { body.appendChild(row); });
    headers.forEach(function (th, i) {
      if (i === column) th.setAttribute("aria-sort", descending ? "descending" : "ascending");
      else th.removeAttribute("aria-sort");
    });
  }
  headers.forEach(function (th, i) {
    th.addEventListener("click", function () {  // numbers start high-first, text A-first
      const current = th.getAttribute("aria-sort");
      sortBy(i, current ? current === "ascending" : th.classList.contains("num"));
    });
  });
  sortBy(parseInt(table.dataset.sortColumn, 10), true);
  table.dataset.ready = "1";
})();
"""


@dataclass(frozen=True)
class Section:
    """A figure of the page: its PNG file, how to draw it, and what the page says about it."""

    file: str
    heading: str
    caption: str
    missing: str  # shown instead when no run has what the figure needs
    draw: Callable[[list[Run], str, str, Path], Path | None]  # (runs, metric, group_by, png)


SECTIONS = (
    Section("accuracy_vs_bytes.png", "Accuracy against communication",
            "Final {metric} against the bytes each client uploaded (log scale).",
            "No run logged comm/bytes_up_per_client.", plots.accuracy_vs_bytes),
    Section("accuracy_vs_alpha.png", "Invariance to the partition",
            "Final {metric} against the Dirichlet α, one line per group and client count K. "
            "An analytic method that is exactly invariant to the partition draws flat lines.",
            "No Dirichlet-partitioned run logged {metric}.", plots.accuracy_vs_alpha),
    Section("accuracy_curves.png", "Accuracy by depth or round",
            "Per-depth (depth/test_acc) or per-round (round/test_acc, val/acc) accuracy, "
            "one line per run.",
            "No run logged an accuracy at two or more depths or rounds.",
            lambda runs, metric, group_by, png: plots.accuracy_curves(runs, group_by, png)),
    Section("per_client_accuracy.png", "Per-client accuracy (personalized runs)",
            "Accuracy of each client on its own test split, from each run's per_client_acc.csv.",
            "No run logged per-client accuracies (a per_client_acc.csv with columns client, acc).",
            lambda runs, metric, group_by, png: plots.per_client_accuracy(runs, png)),
)


def human_bytes(value: float) -> str:
    if not math.isfinite(value):
        return "—"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value:,.0f} B"


def _number(digits: int) -> Callable[[float], str]:
    return lambda value: "—" if not math.isfinite(value) else f"{value:,.{digits}f}"


Column = tuple[str, Callable[[Run], Any], Callable[[float], str] | None]


def table_columns(metric: str, group_by: str) -> list[Column]:
    """(header, value of a run, formatter of a numeric value or None for text) of each column."""
    columns = [
        ("method", lambda r: r.method, None),
        ("dataset", lambda r: r.dataset, None),
        ("backbone", lambda r: r.backbone, None),
        ("partition", lambda r: r.partition, None),
        ("α", lambda r: r.alpha, lambda v: "—" if not math.isfinite(v) else f"{v:g}"),
        ("K", lambda r: r.num_clients, _number(0)),
        (metric, lambda r: r.final(metric), _number(4)),
        ("rounds", lambda r: r.final("comm/rounds"), _number(0)),
        ("bytes up / client", lambda r: r.final("comm/bytes_up_per_client"), human_bytes),
        ("bytes up, all clients", lambda r: r.final("comm/bytes_up"), human_bytes),
        ("fit time (s)", lambda r: r.final("time/fit_s"), _number(2)),
    ]
    if group_by not in ("method", "dataset", "backbone", "partition", "alpha", "K", "num_clients"):
        columns.insert(1, (group_by, lambda r: plots.label(r.value_of(group_by)), None))
    return columns


def render_table(runs: list[Run], metric: str, group_by: str) -> str:
    columns = table_columns(metric, group_by)
    sort_column = 1 + [header for header, _, _ in columns].index(metric)
    head = '<th class="text">run</th>' + "".join(
        f'<th class="{"num" if fmt else "text"}">{html.escape(header)}</th>'
        for header, _, fmt in columns)
    rows = []
    for run in runs:
        breakable = re.sub(r"([,/])", r"\1<wbr>", html.escape(run.name))  # wrap at , and /
        cells = [f'<td title="{html.escape(str(run.path))}">{breakable}</td>']
        for _, value_of, fmt in columns:
            value = value_of(run)
            if fmt is None:
                cells.append(f"<td>{html.escape(str(value))}</td>")
            else:
                value = float(value)
                data = repr(value) if math.isfinite(value) else ""
                cells.append(f'<td class="num" data-value="{data}">{html.escape(fmt(value))}</td>')
        rows.append(f'<tr data-run="{html.escape(run.name)}">{"".join(cells)}</tr>')
    return (f'<table id="runs" data-sort-column="{sort_column}">\n<thead><tr>{head}</tr></thead>\n'
            f'<tbody>\n{chr(10).join(rows)}\n</tbody>\n</table>')


def render_section(section: Section, png: Path | None, metric: str) -> str:
    heading = f'<h2>{html.escape(section.heading)}</h2>'
    if png is None:
        missing = html.escape(section.missing.format(metric=metric))
        return f'{heading}\n<p class="note">{missing}</p>'
    encoded = base64.b64encode(png.read_bytes()).decode("ascii")
    return (f'{heading}\n<figure><img alt="{html.escape(section.heading)}" '
            f'src="data:image/png;base64,{encoded}">\n<figcaption>'
            f'{html.escape(section.caption.format(metric=metric))} '
            f'(<a href="{section.file}">{section.file}</a>)</figcaption></figure>')


def write_report(runs: list[Run], out: Path, metric: str = "test/acc",
                 group_by: str = "method") -> Path:
    """`out/index.html` plus one PNG per figure that has data; returns the page's path."""
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    for section in SECTIONS:
        png = section.draw(runs, metric, group_by, out / section.file)
        if png is None:
            (out / section.file).unlink(missing_ok=True)  # one from an earlier report would mislead
        sections.append(render_section(section, png, metric))
    methods = sorted({run.method for run in runs})
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>workbench: {len(runs)} runs compared</title>
<style>{STYLE}</style>
</head>
<body>
<h1>{len(runs)} runs of {html.escape(", ".join(methods))}</h1>
<p>Metric <code>{html.escape(metric)}</code>, grouped by <code>{html.escape(group_by)}</code>.
Written {datetime.now():%Y-%m-%d %H:%M} from the runs' <code>metrics.csv</code> and
<code>config.yaml</code>. Click a column header to sort.</p>
{render_table(runs, metric, group_by)}
{chr(10).join(sections)}
<script>{SCRIPT}</script>
</body>
</html>
"""
    page_path = out / "index.html"
    write_text_atomically(page_path, page)
    return page_path
