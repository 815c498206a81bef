"""The comparison page: one self-contained HTML file, the dashboard's data as JSON, Plotly (the
`plotly.min.js` the `plotly` package ships) and the page's own script inlined: it opens offline,
from any folder, and can be mailed as it is."""
from __future__ import annotations

import html
import json
import re
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any

from workbench.files import write_text_atomically
from workbench.report import dashboard
from workbench.report.runs import Run

HERE = resources.files("workbench.report")


def plotly_js() -> tuple[str, str]:
    """(the Plotly bundle the installed `plotly` package ships, plotly.js's version)."""
    try:
        bundle = (resources.files("plotly") / "package_data" / "plotly.min.js").read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError) as error:
        raise ImportError("the comparison page draws with plotly.js from the plotly package: pip install "
                          "'plotly>=5.24' (a dependency of workbench: pip install -e .)") from error
    version = re.search(r"plotly\.js v([\w.]+)", bundle[:1000])
    return bundle, version.group(1) if version else "?"


def _json(data: dict[str, Any]) -> str:
    """JSON that cannot end its <script> element early."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")


def _table(element_id: str, headers: list[str], rows: list[list[str]], attribute: str) -> str:
    head = "".join(f"<th>{html.escape(header)}</th>" for header in headers)
    body = "\n".join(f'<tr {attribute}="{html.escape(row[0])}">' + "".join(
        f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table id="{element_id}"><thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody></table>'


def render_unfinished(data: dict[str, Any]) -> str:
    """Failed, refused, running, stopped and superseded runs, each with its error's last line."""
    if not data["unfinished"]:
        return '<p class="note">Every run finished.</p>'
    return _table("unfinished", ["run", "status", "method", "error (last line)"],
                  [[run["name"], run["status"], run["method"], run["error"]] for run in data["unfinished"]],
                  "data-unfinished")


def render_reevaluations(data: dict[str, Any]) -> str:
    """`test --ckpt_path` runs: listed beside the fit they re-scored, never counted as runs."""
    if not data["reevaluations"]:
        return '<p class="note">No re-evaluation (<code>test --ckpt_path</code>) among these runs.</p>'

    def score(value: float | None) -> str:
        return "—" if value is None else f"{value:.4f}"

    return _table("reevaluations", ["re-evaluation", "of the fit", "metric", "its score", "the fit's"],
                  [[item["name"], item["of"] + ("" if item["found"] else " (not among these runs)"), item["metric"],
                    score(item["value"]), score(item["fit_value"])] for item in data["reevaluations"]],
                  "data-reevaluation")


def render_constant(data: dict[str, Any]) -> str:
    """What every finished run shares: the identity fields in the text, the rest folded away."""
    fields = [f"{key} <b>{html.escape(dashboard.label_value(value))}</b>" for key, value in data["constant"].items()
              if key in dashboard.IDENTITY]
    settings = [f"<code>{html.escape(key)}={html.escape(dashboard.label_value(value))}</code>"
                for key, value in data["constant"].items() if key not in dashboard.IDENTITY]
    shared = f"Every run has {', '.join(fields)}. " if fields else ""
    return (f'<div id="constant">{shared}<details><summary>{len(settings)} settings every run shares</summary>'
            f'{" ".join(settings)}</details></div>')


def render(data: dict[str, Any]) -> str:
    counts = data["counts"]
    methods = ", ".join(data["filters"]["method"]) or "no method"
    bundle, version = plotly_js()
    style = (HERE / "dashboard.css").read_text(encoding="utf-8")
    script = (HERE / "dashboard.js").read_text(encoding="utf-8")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>workbench: {counts['runs']} runs compared</title>
<style>{style}</style>
</head>
<body>
<h1>{counts['runs']} runs in {counts['settings']} settings of {html.escape(methods)};
{counts['unfinished']} unfinished</h1>
<p class="lead">Read from the runs' <code>metrics.csv</code>, <code>config.yaml</code> and <code>status.json</code>
on {datetime.now():%Y-%m-%d %H:%M}. Runs that differ only in their seeds are one row: numbers are their mean ±
sample std (n runs). Figures show one group of comparable runs at a time (same dataset, inputs, protocol, partition
and K), so a front never crosses groups; a personalized run is ranked by <code>test/acc_local_mean</code>, each
client's own model on its own test split († marks <code>test/acc</code> under that protocol: the global branch only).
Hover a point for its run and values, drag to zoom, double-click to reset; the camera icon saves a PNG.</p>
<section id="controls">
<div id="filters"></div>
<div class="pickers">
<label>group by <select id="group-by"></select></label>
<label>metric <select id="metric"></select></label>
<details id="columns"><summary>columns</summary><div id="column-toggles"></div></details>
</div>
{render_constant(data)}
<p id="shown"></p>
</section>
<div class="scroll"><table id="runs"><thead></thead><tbody></tbody></table></div>
<h2>Figures of one group of comparable runs</h2>
<p><label>group <select id="group"></select></label> <span id="group-fields" class="note"></span></p>
<div class="figures">
<div id="fig-rounds" class="figure"></div>
<div id="fig-upload" class="figure"></div>
<div id="fig-latency" class="figure"></div>
<div class="figure"><label>x axis <select id="cost"></select></label><div id="fig-final"></div></div>
<div id="fig-parallel" class="figure"></div>
<div id="fig-alpha" class="figure"></div>
<div id="fig-depth" class="figure"></div>
<div id="fig-clients" class="figure"></div>
</div>
<h2>Unfinished runs</h2>
{render_unfinished(data)}
<h2>Re-evaluations</h2>
{render_reevaluations(data)}
<p class="note">Drawn with plotly.js {html.escape(version)}, inlined: the page needs no network.</p>
<script type="application/json" id="dashboard-data">{_json(data)}</script>
<script>{bundle}</script>
<script>{script}</script>
</body>
</html>
"""


def write_report(runs: list[Run], out: Path, metric: str = "test/acc", group_by: str = "method") -> Path:
    """`out/index.html`; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    page_path = out / "index.html"
    write_text_atomically(page_path, render(dashboard.build(runs, metric, group_by)))
    return page_path
