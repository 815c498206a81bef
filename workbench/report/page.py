"""The comparison page: one self-contained HTML file (inline CSS and JS, figures embedded as
base64) written beside the figures' PNG files."""
from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from workbench.files import write_text_atomically
from workbench.report import plots
from workbench.report.runs import FIELDS, Run, mean_std, repeats

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
td.error { white-space: normal; color: #a00; } .wandb { color: #777; font-size: 11px; }
figure { margin: 1em 0; } img { max-width: 100%; } .note { color: #777; font-style: italic; }
"""

# Click a header to sort by it, again to reverse; numbers sort by their data-value, blanks last.
# The table starts sorted by the chosen metric, best first; data-ready="1" says the script ran.
SCRIPT = """
(function () {
  const table = document.getElementById("runs");
  if (!table) return;  // no run finished: nothing to sort
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
            "Final {metric} (mean ± std over seeds) against the bytes each client uploaded (log "
            "scale); the dashed line joins the Pareto front: no other run is both cheaper and "
            "more accurate.",
            "No run logged comm/bytes_up_per_client.", plots.accuracy_vs_bytes),
    Section("accuracy_vs_time.png", "Accuracy against time",
            "Final {metric} against wall time end to end (the process's seconds: imports, feature "
            "extraction, an engine's start; time/wall_s, or the sweep runner's measure) and "
            "against the fit's own time (time/fit_s).",
            "No run logged time/wall_s or time/fit_s.", plots.accuracy_vs_time),
    Section("accuracy_vs_alpha.png", "Invariance to the partition",
            "Final {metric} (mean ± std over seeds) against the Dirichlet α, one line per setting "
            "but α. An analytic method that is exactly invariant to the partition draws flat lines.",
            "No Dirichlet-partitioned run logged {metric}.", plots.accuracy_vs_alpha),
    Section("round_accuracy_vs_bytes.png", "Accuracy by round against cumulative upload",
            "Per-round accuracy (round/test_acc, or val/acc with a validation hold-out) against "
            "the bytes each client had uploaded by that round, one line per multi-round run.",
            "No multi-round run logged a per-round accuracy (round/test_acc, or val/acc with "
            "data.val_fraction > 0).",
            lambda runs, metric, group_by, png: plots.round_accuracy_vs_bytes(runs, group_by, png)),
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


def _alpha(value: float) -> str:
    return "—" if not math.isfinite(value) else f"{value:g}"


def table_columns(runs: list[Run], metric: str, group_by: str) -> list[Column]:
    """(header, value of a run, formatter of a numeric value or None for text) of each column:
    the personalized score and each GH-OFL head's accuracy get columns of their own when any
    run logged them."""
    logged = {key for run in runs for row in run.rows for key in row}
    candidates = ["test/acc", "test/acc_local_mean", "test/acc_local_min",
                  *sorted(k for k in logged if k.startswith("test/acc/"))]
    extra = [key for key in candidates if key in logged and key != metric]
    columns = [
        ("method", lambda r: r.method, None),
        ("engine", lambda r: r.engine, None),
        ("protocol", lambda r: r.protocol, None),
        ("dataset", lambda r: r.dataset, None),
        ("backbone", lambda r: r.backbone, None),
        ("partition", lambda r: r.partition, None),
        ("α", lambda r: r.alpha, _alpha),
        ("K", lambda r: r.num_clients, _number(0)),
        (metric, lambda r, m=metric: r.final(m), _number(4)),
        *[(key, lambda r, k=key: r.final(k), _number(4)) for key in extra],
        ("rounds", lambda r: r.final("comm/rounds"), _number(0)),
        ("bytes up / client", lambda r: r.final("comm/bytes_up_per_client"), human_bytes),
        ("bytes up, all clients", lambda r: r.final("comm/bytes_up"), human_bytes),
        ("fit time (s)", lambda r: r.final("time/fit_s"), _number(2)),
        ("wall time (s)", lambda r: r.wall_seconds, _number(1)),
    ]
    if group_by not in FIELDS:
        columns.insert(1, (group_by, lambda r: plots.label(r.value_of(group_by)), None))
    return columns


def _cell(values: list[Any], fmt: Callable[[float], str] | None, mark: str = "") -> str:
    """One cell for a set of repeats: text if they agree; numbers as mean ± std (n) when
    several runs logged them, the mean as the value sorting uses; `mark` after the number."""
    if fmt is None:
        texts = sorted({str(value) for value in values})
        return f"<td>{html.escape(' / '.join(texts))}</td>"
    mean, std, n = mean_std([float(value) for value in values])
    data = repr(mean) if n else ""
    text = fmt(mean)
    if n > 1:
        text = f"{text} ± {fmt(std)} (n={n})"
    return f'<td class="num" data-value="{data}">{html.escape(text + mark)}</td>'


def _run_link(run: Run) -> str:
    breakable = re.sub(r"([,/])", r"\1<wbr>", html.escape(run.name))  # wrap at , and /
    wandb = f' <span class="wandb">W&amp;B {html.escape(run.wandb_id)}</span>' if run.wandb_id else ""
    return f'<span title="{html.escape(str(run.path))}">{breakable}</span>{wandb}'


def render_table(runs: list[Run], metric: str, group_by: str) -> str:
    """One row per set of repeats (runs equal but for their seeds), every run named in it."""
    columns = table_columns(runs, metric, group_by)
    sort_column = 2 + [header for header, _, _ in columns].index(metric)
    head = ('<th class="text">runs</th><th class="num">n</th>' + "".join(
        f'<th class="{"num" if fmt else "text"}">{html.escape(header)}</th>'
        for header, _, fmt in columns))
    rows = []
    for same in repeats(runs):
        names = " ".join(run.name for run in same)
        cells = [f'<td>{"<br>".join(map(_run_link, same))}</td>',
                 f'<td class="num" data-value="{len(same)}">{len(same)}</td>']
        # a personalized run's test/acc is its global model's (AnaPFL's global branch): marked
        mark = " †" if same[0].protocol == "personalized" else ""
        cells += [_cell([value_of(run) for run in same], fmt, mark if header == "test/acc" else "")
                  for header, value_of, fmt in columns]
        rows.append(f'<tr data-run="{html.escape(names)}">{"".join(cells)}</tr>')
    return (f'<table id="runs" data-sort-column="{sort_column}">\n<thead><tr>{head}</tr></thead>\n'
            f'<tbody>\n{chr(10).join(rows)}\n</tbody>\n</table>')


def render_unfinished(runs: list[Run]) -> str:
    """The runs with no result: failed, running, stopped or superseded, each with its error."""
    if not runs:
        return '<p class="note">Every run finished.</p>'
    rows = "\n".join(
        f'<tr data-unfinished="{html.escape(run.name)}"><td>{_run_link(run)}</td>'
        f"<td>{html.escape(run.status)}</td><td>{html.escape(run.method if run.config else '—')}</td>"
        f'<td class="error">{html.escape(run.error)}</td></tr>' for run in runs)
    return ('<table id="unfinished">\n<thead><tr><th>run</th><th>status</th><th>method</th>'
            f"<th>error (last line)</th></tr></thead>\n<tbody>\n{rows}\n</tbody>\n</table>")


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
    done = [run for run in runs if run.status == "done"]
    unfinished = [run for run in runs if run.status != "done"]
    sections = []
    for section in SECTIONS:
        png = section.draw(done, metric, group_by, out / section.file) if done else None
        if png is None:
            (out / section.file).unlink(missing_ok=True)  # one from an earlier report would mislead
        sections.append(render_section(section, png, metric))
    methods = sorted({run.method for run in done})
    settings = len(repeats(done))
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>workbench: {len(runs)} runs compared</title>
<style>{STYLE}</style>
</head>
<body>
<h1>{len(done)} finished runs of {html.escape(", ".join(methods) or "no method")}, {len(unfinished)} unfinished</h1>
<p>Metric <code>{html.escape(metric)}</code>, grouped by <code>{html.escape(group_by)}</code>.
{len(done)} finished runs in {settings} settings: runs that differ only in their seeds are one row,
numbers as mean ± sample std over them (n runs). Written {datetime.now():%Y-%m-%d %H:%M} from
the runs' <code>metrics.csv</code>, <code>config.yaml</code> and the sweep runner's
<code>status.json</code>. Click a column header to sort. † Under the personalized protocol,
<code>test/acc</code> scores the global model (AnaPFL's global branch), not what the method
hands each client: compare personalized runs by <code>test/acc_local_mean</code>, each client's
own model on its own test split.</p>
{render_table(done, metric, group_by) if done else '<p class="note">No run finished.</p>'}
<h2>Unfinished runs</h2>
{render_unfinished(unfinished)}
{chr(10).join(sections)}
<script>{SCRIPT}</script>
</body>
</html>
"""
    page_path = out / "index.html"
    write_text_atomically(page_path, page)
    return page_path
