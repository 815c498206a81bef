// The comparison page's script: draws what workbench.report.dashboard computed (the JSON in
// #dashboard-data) with Plotly, inlined above it; nothing is fetched. Filters, column toggles,
// the group-by key, the metric and the group of comparable runs only choose what is drawn: the
// numbers, the groups and the Pareto fronts come from Python, where they are tested.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("dashboard-data").textContent);
  const runsById = new Map(data.runs.map((run) => [run.id, run]));
  const groupsById = new Map(data.groups.map((group) => [group.id, group]));
  const columnsByKey = new Map(data.columns.map((column) => [column.key, column]));
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf"];
  const SYMBOLS = ["circle", "square", "diamond", "triangle-up", "x", "cross", "star", "triangle-down",
    "pentagon", "hexagon"];
  const COSTS = {
    "comm/bytes_up_per_client": "bytes uploaded per client",
    "comm/bytes_down_per_client": "bytes downloaded per client",
    "comm/rounds": "rounds",
    "time/fit_s": "fit time (s)",
    "time/wall_s": "wall time, end to end (s)",
    "latency/total_s": "simulated time on the clients' links (s)",
  };
  const PLOT_CONFIG = { displaylogo: false, responsive: true };

  const state = {
    filters: Object.fromEntries(Object.entries(data.filters).map(([name, values]) => [name, new Set(values)])),
    shown: new Set(data.columns.filter((column) => column.shown).map((column) => column.key)),
    groupBy: data.group_by,
    metric: data.metric,
    group: data.groups.length ? data.groups[0].id : null,
    cost: "comm/bytes_up_per_client",
    // best first; a click on a header sorts by it, ties by the last order (rows of one group of
    // comparable runs always stay together: `order()`)
    sort: [{ key: data.metric, descending: true }],
  };

  // ---- text ---------------------------------------------------------------------------------
  function el(tag, attributes, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (name === "text") node.textContent = value;
      else node.setAttribute(name, value === true ? "" : value);
    }
    for (const child of children) node.append(child);
    return node;
  }
  function label(value) {
    if (value === null || value === undefined) return "—";
    if (typeof value === "number") return Number.isInteger(value) ? String(value) : String(+value.toPrecision(6));
    return String(value);
  }
  function humanBytes(value) {
    for (const [unit, size] of [["GB", 1e9], ["MB", 1e6], ["kB", 1e3]]) {
      if (value >= size) return (value / size).toFixed(2) + " " + unit;
    }
    return value.toFixed(0) + " B";
  }
  function format(kind, value) {
    if (value === null || value === undefined) return "—";
    if (kind === "accuracy") return value.toFixed(4);
    if (kind === "bytes") return humanBytes(value);
    if (kind === "seconds") return value < 10 ? value.toFixed(2) : value.toFixed(1);
    return label(value);
  }
  function cellText(column, cell, row) {
    if (typeof cell === "string") return cell;
    const [mean, std, n] = cell;
    if (!n) return "—";
    let text = format(column.kind, mean);
    if (n > 1 && std > 0) text += " ± " + format(column.kind === "count" ? "seconds" : column.kind, std);
    if (column.key === "test/acc" && row.protocol === "personalized") text += " †";
    return text;
  }
  // A config key's header is its last part (model.local.lr -> lr), or more of it where two
  // keys share a last part; the full key is its title.
  const leafCounts = new Map();
  for (const column of data.columns) {
    if (column.kind === "config") leafCounts.set(column.key.split(".").pop(), (leafCounts.get(column.key.split(".").pop()) || 0) + 1);
  }
  function shortHeader(key) {
    const column = columnsByKey.get(key);
    if (column.kind !== "config") return column.header;
    const parts = key.split(".");
    return leafCounts.get(parts[parts.length - 1]) > 1 ? parts.slice(1).join(".") : parts[parts.length - 1];
  }

  // ---- which runs ---------------------------------------------------------------------------
  function passes(run) {
    return Object.entries(state.filters).every(([name, allowed]) => allowed.has(label(run.values[name])));
  }
  function visibleRows() {
    return data.rows.filter((row) => row.runs.some((id) => passes(runsById.get(id))));
  }
  function groupValue(run) { return label(run.values[state.groupBy]); }
  function styleOf(value) {
    const values = [...new Set(data.runs.map(groupValue))].sort();
    const i = Math.max(values.indexOf(value), 0);
    return { color: PALETTE[i % PALETTE.length], symbol: SYMBOLS[i % SYMBOLS.length] };
  }

  // ---- controls -----------------------------------------------------------------------------
  function renderControls() {
    const filters = document.getElementById("filters");
    filters.replaceChildren();
    for (const [name, values] of Object.entries(data.filters)) {
      const box = el("fieldset", { "data-filter": name }, el("legend", { text: name }));
      for (const value of values) {
        const input = el("input", { type: "checkbox", value, checked: state.filters[name].has(value) });
        input.addEventListener("change", () => {
          if (input.checked) state.filters[name].add(value); else state.filters[name].delete(value);
          render();
        });
        box.append(el("label", {}, input, " " + value));
      }
      filters.append(box);
    }
    const groupBy = document.getElementById("group-by");
    const keys = data.columns.filter((c) => c.kind === "text" || c.kind === "config" || c.key === "K").map((c) => c.key);
    groupBy.replaceChildren(...keys.map((key) => el("option", { value: key, text: key, selected: key === state.groupBy })));
    groupBy.onchange = () => { state.groupBy = groupBy.value; render(); };
    const metric = document.getElementById("metric");
    const metrics = data.columns.filter((c) => c.kind === "accuracy").map((c) => c.key);
    metric.replaceChildren(...metrics.map((key) => el("option", { value: key, text: key, selected: key === state.metric })));
    metric.onchange = () => { state.metric = metric.value; renderParallel(); };
    const toggles = document.getElementById("column-toggles");
    toggles.replaceChildren(...data.columns.map((column) => {
      const input = el("input", { type: "checkbox", "data-column": column.key, checked: state.shown.has(column.key) });
      input.addEventListener("change", () => {
        if (input.checked) state.shown.add(column.key); else state.shown.delete(column.key);
        renderTable();
      });
      const alone = !column.varies && column.runs === 1;
      return el("label", { title: column.varies ? "varies among the runs" : alone ? "only one run has it"
        : "the same in every run that has it" }, input,
        " " + column.key + (column.varies ? "" : alone ? " (one run)" : " (same)"));
    }));
    const group = document.getElementById("group");
    group.replaceChildren(...data.groups.map((g) => el("option", { value: g.id, selected: g.id === state.group,
      text: `${g.id}: ${g.label} (${g.runs} run${g.runs === 1 ? "" : "s"})` })));
    group.onchange = () => { state.group = group.value; renderFigures(); };
    const cost = document.getElementById("cost");
    cost.replaceChildren(...Object.entries(COSTS).map(([key, text]) => el("option", { value: key, text, selected: key === state.cost })));
    cost.onchange = () => { state.cost = cost.value; renderFinal(); };
  }

  // ---- the table ----------------------------------------------------------------------------
  function sortKey(row, key) {
    const cell = row.cells[key];
    if (typeof cell === "string") return cell.toLowerCase();
    return cell && cell[2] ? cell[0] : null;
  }
  function order() {  // the groups first (a sort never mixes incomparable runs), then the reader's
    const byGroup = data.groups.length > 1 && state.sort[0].key !== "group";
    return byGroup ? [{ key: "group", descending: false }, ...state.sort] : state.sort;
  }
  function renderTable() {
    const columns = data.columns.filter((column) => state.shown.has(column.key));
    const rows = visibleRows();
    rows.sort((a, b) => {
      for (const { key, descending } of order()) {
        const x = sortKey(a, key), y = sortKey(b, key);
        if (x === null || y === null) {
          if (x !== y) return (x === null) - (y === null);  // blanks last
          continue;
        }
        if (x !== y) return (x < y ? -1 : 1) * (descending ? -1 : 1);
      }
      return 0;
    });
    const { key, descending } = state.sort[0];
    const head = el("tr", {}, el("th", { text: "runs" }), el("th", { class: "num", text: "n" }));
    for (const column of columns) {
      const numeric = column.kind !== "text" && column.kind !== "config";
      const th = el("th", { class: numeric ? "num" : "text", title: column.key, "data-key": column.key,
        "aria-sort": column.key === key ? (descending ? "descending" : "ascending") : null,
        text: shortHeader(column.key).replace(/([_/])/g, "$1\u200b") });  // a long header may wrap after _ or /
      th.addEventListener("click", () => {  // best first (the largest accuracy, the fewest bytes, seconds,
        // rounds), text A-first; a second click reverses
        const first = { key: column.key, descending: column.key === key ? !descending : column.kind === "accuracy" };
        state.sort = [first, ...state.sort.filter((order) => order.key !== column.key)].slice(0, 3);
        renderTable();
      });
      head.append(th);
    }
    const body = rows.map((row) => {
      const runs = row.runs.map((id) => runsById.get(id));
      const names = el("td", { class: "names" });
      for (const run of runs) {
        const style = styleOf(groupValue(run));
        names.append(el("div", { title: run.path + (run.wandb ? " · W&B " + run.wandb : "") },
          el("span", { class: "swatch", style: `background:${style.color}` }), run.name));
      }
      const tr = el("tr", { "data-setting": row.id, "data-runs": runs.map((run) => run.name).join(" "),
        "data-group": row.group }, names, el("td", { class: "num", text: String(runs.length) }));
      for (const column of columns) {
        const cell = row.cells[column.key];
        const numeric = typeof cell !== "string";
        tr.append(el("td", { class: numeric ? "num" : "text", "data-value": numeric && cell[2] ? String(cell[0]) : null,
          title: column.key === "group" ? groupsById.get(cell).label : null, text: cellText(column, cell, row) }));
      }
      return tr;
    });
    const table = document.getElementById("runs");
    table.tHead.replaceChildren(head);
    table.tBodies[0].replaceChildren(...body);
    const shownRuns = rows.reduce((total, row) => total + row.runs.length, 0);
    document.getElementById("shown").textContent =
      `Showing ${rows.length} of ${data.rows.length} settings (${shownRuns} of ${data.runs.length} runs); ` +
      `${columns.length} of ${data.columns.length} columns.`;
  }

  // ---- figures: one group of comparable runs ----------------------------------------------
  function groupRuns() {
    return data.runs.filter((run) => run.group === state.group && passes(run));
  }
  function note(id, text) {
    const target = document.getElementById(id);
    if (target.dataset.plotted) Plotly.purge(target);
    delete target.dataset.plotted;
    target.replaceChildren(el("p", { class: "note", text }));
  }
  function plot(id, traces, layout) {
    const target = document.getElementById(id);
    if (!target.dataset.plotted) target.replaceChildren();
    target.dataset.plotted = "1";
    // the title starts at the plot's left edge, clear of the toolbar at the top right
    const title = Object.assign({ x: 0, xref: "paper", xanchor: "left", font: { size: 14 } }, layout.title);
    Plotly.react(target, traces, Object.assign({
      margin: { t: 40, r: 10, b: 50, l: 60 }, height: 380, hovermode: "closest",
      legend: { title: { text: state.groupBy }, font: { size: 11 } },
    }, layout, { title }), PLOT_CONFIG);
  }
  function integerAxis(title, values) {
    const top = Math.max(1, ...values.filter((v) => v !== null));
    return { title: { text: title }, tickformat: "d", dtick: Math.max(1, Math.ceil(top / 10)), tick0: 0 };
  }
  function bytesAxis(title, values) {  // a label per decade, or at 1, 2 and 5 where few decades are spanned
    const finite = values.filter((v) => v > 0);
    const decades = finite.length ? Math.log10(Math.max(...finite) / Math.min(...finite)) : 0;
    return { title: { text: title + " (log scale)" }, type: "log", exponentformat: "SI", ticksuffix: "B",
      dtick: decades > 2 ? 1 : "D2" };
  }
  function band(mean, std) { return [mean - (std || 0), mean + (std || 0)]; }  // a point with its error bar
  function scoreAxis(group, values) {  // around the points drawn (a flat line is not padded out to 0..2)
    const axis = { title: { text: group ? group.score : state.metric } };
    const finite = (values || []).filter((v) => Number.isFinite(v));
    if (finite.length) {
      const low = Math.min(...finite), high = Math.max(...finite), pad = Math.max((high - low) * 0.15, 0.01);
      axis.range = [Math.max(0, low - pad), high + pad];
    }
    return axis;
  }

  function curveTraces(runs, x) {  // one trace per run, one legend entry per group value
    const seen = new Set();
    return runs.filter((run) => run.curve).map((run) => {
      const value = groupValue(run), style = styleOf(value), curve = run.curve, line = curve.round.length > 1;
      // a one-round method is one point, often where another one-round method's is: open markers
      // show both (AFL's circle no longer hides under GH-OFL's cross)
      const marker = line ? { color: style.color, symbol: style.symbol, size: 6 }
        : { color: style.color, symbol: style.symbol + "-open", size: 12, line: { width: 2, color: style.color } };
      const trace = {
        type: "scatter", mode: line ? "lines+markers" : "markers",
        x: curve[x], y: curve.acc, name: value, legendgroup: value, showlegend: !seen.has(value), marker,
        line: { color: style.color, width: 1.5 },
        customdata: curve.round.map((round, i) => [round, humanBytes(curve.up[i] || 0), humanBytes(curve.down[i] || 0)]),
        hovertemplate: `<b>${run.name}</b><br>${state.groupBy}: ${value}<br>round %{customdata[0]}<br>` +
          `${run.score_metric.replace("test/", "round/")} %{y:.4f}<br>up/client %{customdata[1]}<br>` +
          "down/client %{customdata[2]}<extra></extra>",
      };
      seen.add(value);
      return trace;
    });
  }
  function renderCurves() {
    const group = groupsById.get(state.group), runs = groupRuns();
    const traces = curveTraces(runs, "round");
    if (!traces.length) {
      note("fig-rounds", "No run of this group logged a learning curve (round/test_acc): runs written before " +
        "workbench 0.3 or with --eval_every 0.");
      note("fig-upload", "No learning curve to draw against upload.");
      note("fig-latency", "No learning curve to draw against simulated time.");
      return;
    }
    const rounds = runs.flatMap((run) => (run.curve ? run.curve.round : []));
    plot("fig-rounds", traces, { title: { text: "accuracy by round" }, xaxis: integerAxis("round", rounds),
      yaxis: scoreAxis(group) });
    plot("fig-upload", curveTraces(runs, "up"), { title: { text: "accuracy against cumulative upload" },
      xaxis: bytesAxis("bytes uploaded per client so far", runs.flatMap((run) => (run.curve ? run.curve.up : []))),
      yaxis: scoreAxis(group) });
    const clocked = runs.filter((run) => run.curve && run.curve.latency && run.curve.latency.some((s) => s > 0));
    if (!clocked.length) {
      note("fig-latency", "No run of this group has a simulated clock: fit with systems.preset (cellular, wifi, " +
        "datacenter) to draw accuracy against the time the rounds take on the clients' links.");
      return;
    }
    plot("fig-latency", curveTraces(clocked, "latency"), { title: { text: "accuracy against simulated time" },
      xaxis: { title: { text: "simulated seconds on the clients' links (log scale)" }, type: "log" },
      yaxis: scoreAxis(group) });
  }
  function renderFinal() {
    const group = groupsById.get(state.group);
    const visible = new Set(groupRuns().map((run) => run.setting));
    const rows = data.rows.filter((row) => row.group === state.group && visible.has(row.id));
    const score = group.score, cost = state.cost;
    const points = rows.filter((row) => row.cells[cost] && row.cells[cost][2] && row.cells[score] && row.cells[score][2]);
    if (!points.length) { note("fig-final", `No run of this group logged ${score} and ${cost}.`); return; }
    const byValue = new Map();
    for (const row of points) {
      const value = groupValue(runsById.get(row.runs[0]));
      if (!byValue.has(value)) byValue.set(value, []);
      byValue.get(value).push(row);
    }
    const traces = [...byValue.entries()].sort().map(([value, rows]) => {
      const style = styleOf(value);
      return {
        type: "scatter", mode: "markers", name: value, x: rows.map((r) => r.cells[cost][0]),
        y: rows.map((r) => r.cells[score][0]),
        error_y: { type: "data", array: rows.map((r) => r.cells[score][1] || 0), visible: true },
        marker: { color: style.color, symbol: style.symbol, size: 10 },
        customdata: rows.map((r) => [r.runs.map((id) => runsById.get(id).name).join("<br>"), r.runs.length,
          format(columnsByKey.get(cost).kind, r.cells[cost][0])]),
        hovertemplate: `<b>%{customdata[0]}</b><br>${state.groupBy}: ${value} (n=%{customdata[1]})<br>` +
          `${score} %{y:.4f}<br>${cost} %{customdata[2]}<extra></extra>`,
      };
    });
    const rowsById = new Map(data.rows.map((row) => [row.id, row]));
    const front = group.fronts[cost].map((id) => rowsById.get(id));
    traces.push({
      type: "scatter", mode: "lines", name: "Pareto front", legendgroup: "front",
      x: front.map((r) => r.cells[cost][0]), y: front.map((r) => r.cells[score][0]),
      line: { color: "black", dash: "dash", width: 1, shape: "hv" }, hoverinfo: "skip",
    });
    const log = cost.startsWith("comm/bytes") || cost.startsWith("time/");
    plot("fig-final", traces, {
      title: { text: `final ${score} against ${COSTS[cost]}` },
      xaxis: cost.startsWith("comm/bytes") ? bytesAxis(COSTS[cost], points.map((r) => r.cells[cost][0]))
        : log ? { title: { text: COSTS[cost] + " (log scale)" }, type: "log" } : integerAxis(COSTS[cost], front.map((r) => r.cells[cost][0])),
      yaxis: scoreAxis(group, points.flatMap((r) => band(r.cells[score][0], r.cells[score][1]))),
    });
  }
  function shownMetric() {  // the metric picked, or the group's score where the page's metric means it
    const group = groupsById.get(state.group);
    return state.metric === data.metric && group ? group.score : state.metric;
  }
  function renderParallel() {
    const metric = shownMetric();
    const runs = groupRuns().filter((run) => run.values[metric] !== null && run.values[metric] !== undefined);
    const keys = data.columns.filter((c) => (c.kind === "text" || c.kind === "config" || c.key === "K")
      && new Set(runs.map((run) => label(run.values[c.key]))).size > 1).map((c) => c.key);
    if (runs.length < 2 || !keys.length) {
      note("fig-parallel", runs.length < 2 ? `Fewer than two runs of this group logged ${metric}.`
        : "No setting varies among these runs.");
      return;
    }
    const dimensions = keys.map((key) => {
      const values = runs.map((run) => run.values[key]);
      if (values.every((v) => typeof v === "number")) return { label: shortHeader(key), values };
      const texts = [...new Set(values.map(label))].sort();
      return { label: shortHeader(key), values: values.map((v) => texts.indexOf(label(v))),
        tickvals: texts.map((_, i) => i), ticktext: texts };
    });
    // what each run cost, where it differs: rounds, upload (MB, a linear axis), fit time
    for (const [key, name, scale] of [["comm/rounds", "rounds", 1], ["comm/bytes_up_per_client", "MB up / client", 1e-6],
      ["time/fit_s", "fit s", 1]]) {
      const values = runs.map((run) => run.values[key]);
      if (values.every((v) => typeof v === "number") && new Set(values).size > 1) {
        dimensions.push({ label: name, values: values.map((v) => v * scale) });
      }
    }
    const scores = runs.map((run) => run.values[metric]);
    dimensions.push({ label: metric, values: scores });
    plot("fig-parallel", [{ type: "parcoords", dimensions,
      line: { color: scores, colorscale: "Viridis", showscale: true, colorbar: { title: { text: metric } } } }],
    { title: { text: `settings against ${metric} (drag along an axis to select)` }, margin: { t: 80, r: 40, b: 30, l: 60 } });
  }
  function renderAlpha() {
    const group = groupsById.get(state.group);
    const lines = data.alpha_lines.filter((line) => line.family === group.family);
    if (!lines.length) {
      note("fig-alpha", "No setting of these runs but its Dirichlet α was run at two or more α.");
      return;
    }
    // its lines join this group to the groups that differ from it in α alone (α is part of a group)
    const alphas = [...new Set(lines.flatMap((line) => line.points.map((p) => p.alpha)))].sort((a, b) => a - b);
    plot("fig-alpha", lines.map((line) => {
      const style = styleOf(line.group_value);
      return { type: "scatter", mode: "lines+markers", name: line.label, x: line.points.map((p) => p.alpha),
        y: line.points.map((p) => p.mean), error_y: { type: "data", array: line.points.map((p) => p.std || 0) },
        marker: { color: style.color, symbol: style.symbol }, line: { color: style.color },
        customdata: line.points.map((p) => p.n),
        hovertemplate: `<b>${line.label}</b><br>α %{x}<br>${group.score} %{y:.4f} (n=%{customdata})<extra></extra>` };
    }), { title: { text: "accuracy against the Dirichlet α (flat: invariant)" },
      // a label at each α run, not the log axis's bare minor digits
      xaxis: { title: { text: "Dirichlet α (log scale; small = strong label skew)" }, type: "log",
        tickvals: alphas, ticktext: alphas.map(label) },
      yaxis: scoreAxis(group, lines.flatMap((line) => line.points.flatMap((p) => band(p.mean, p.std)))),
      legend: { font: { size: 11 } } });
  }
  function renderDepth() {
    const runs = groupRuns().filter((run) => run.depth);
    if (!runs.length) { note("fig-depth", "No run of this group logged an accuracy by depth (DeepAFL)."); return; }
    const seen = new Set();
    plot("fig-depth", runs.map((run) => {
      const value = groupValue(run), style = styleOf(value);
      const trace = { type: "scatter", mode: "lines+markers", x: run.depth.depth, y: run.depth.acc, name: value,
        legendgroup: value, showlegend: !seen.has(value), marker: { color: style.color, symbol: style.symbol },
        line: { color: style.color },
        hovertemplate: `<b>${run.name}</b><br>depth %{x}<br>depth/test_acc %{y:.4f}<extra></extra>` };
      seen.add(value);
      return trace;
    }), { title: { text: "test accuracy by depth" }, xaxis: integerAxis("depth (layers)", runs.flatMap((r) => r.depth.depth)),
      yaxis: { title: { text: "depth/test_acc" } } });
  }
  function renderClients() {
    const runs = groupRuns().filter((run) => run.per_client);
    if (!runs.length) { note("fig-clients", "No run of this group logged per-client accuracies (personalized runs)."); return; }
    plot("fig-clients", runs.map((run) => {
      const style = styleOf(groupValue(run));
      return { type: "box", y: run.per_client, name: run.name, marker: { color: style.color }, boxpoints: "all",
        jitter: 0.4, hovertemplate: `<b>${run.name}</b><br>a client: %{y:.4f}<extra></extra>` };
    }), { title: { text: "each client's accuracy on its own test split" }, showlegend: false,
      yaxis: { title: { text: "accuracy" } }, xaxis: { automargin: true } });
  }
  function renderFigures() {
    if (!state.group) return;
    const group = groupsById.get(state.group);
    document.getElementById("group-fields").textContent =
      Object.entries(group.fields).map(([name, value]) => `${name} ${label(value)}`).join(" · ") +
      ` — ranked by ${group.score}` + (group.fields.protocol === "personalized"
        ? " (each client's own model on its own test split; the global branch's test/acc is never on a front)" : "");
    renderCurves(); renderFinal(); renderParallel(); renderAlpha(); renderDepth(); renderClients();
  }

  function render() { renderTable(); renderFigures(); }
  renderControls();
  render();
  document.body.dataset.ready = "1";
})();
