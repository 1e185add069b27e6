// The rft run page: subscribes to /api/runs/{name}/events (server-sent events) for each selected run and draws
// every chart as SVG itself (no third-party script). Stable data-* attributes name what is drawn, for tests:
// figure[data-chart] > path[data-run][data-series][data-points], circle[data-run][data-series][data-step][data-y],
// tr[data-run][data-explorer][data-state][data-version], .notice[data-run][data-state][data-broker].
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const DASHES = ["", "6 3", "2 2", "8 3 2 3"];  // one per overlaid run
const MAX_CIRCLES = 400;  // per series; beyond it only the line is drawn

const runs = {};  // name -> {snap, records, epoch, source, error}
let selected = [];
let available = [];

// -- charts: what each one draws, as series picked from metrics records
const ratio = (a, b) => r => (typeof r[a] === "number" && r[b] > 0 ? r[a] / r[b] : undefined);
const keyed = re => recs => [...new Set(recs.flatMap(r => Object.keys(r).filter(k => re.test(k))))].sort();
const CHARTS = [
  {id: "reward", title: "reward and held-out accuracy", series: recs => ["reward_mean", ...keyed(/^eval\/.+\/accuracy$/)(recs)]},
  {id: "eval", title: "eval pass@k / mean@k", series: keyed(/^eval\/.+\/(pass|mean)@\d+$/)},
  {id: "loss", title: "loss", series: () => ["loss"]},
  {id: "kl", title: "KL", series: () => ["kl"]},
  {id: "mismatch", title: "training-inference mismatch: mean |trainer - rollout log-prob|, all and by staleness",
   series: keyed(/^logprob_mismatch(_stale\d+(plus)?)?_mean$/)},
  {id: "mismatch_kl", title: "training-inference KL (k3) and share of tokens past trainer.mismatch_ratio",
   series: () => ["logprob_mismatch_kl", "logprob_mismatch_frac"]},
  {id: "entropy", title: "entropy", series: () => ["entropy"]},
  {id: "staleness", title: "staleness (mean, max)", series: () => ["staleness_mean", "staleness_max"]},
  {id: "dropped", title: "dropped samples per step", series: () => ["dropped_stale", "dropped_future"]},
  {id: "tokens", title: "trainer tokens/s", series: () => ["tokens_per_s"]},
  {id: "samples", title: "trainer samples/s", series: () => ["samples_per_s"],
   derived: {samples_per_s: ratio("samples", "step_time_s")}},
  {id: "idle", title: "trainer idle fraction (waiting for data)", series: () => ["idle_fraction"],
   derived: {idle_fraction: ratio("data_wait_s", "step_time_s")}},
  {id: "lag", title: "consumer lag (experiences not yet consumed)", series: () => ["consumer_lag"]},
];

function el(tag, attrs = {}, ...children) {
  const node = tag === "svg" || SVG_TAGS.has(tag) ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
const SVG_TAGS = new Set(["g", "path", "circle", "line", "rect", "text", "title", "polyline"]);

function fmt(v, digits = 3) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  return Math.abs(v) >= 1000 || Number.isInteger(v) ? String(Math.round(v)) : v.toPrecision(digits);
}

function t0(run) {
  const times = run.records.map(r => r.time).concat((run.snap?.fleet_events || []).map(e => e.time));
  return times.length ? Math.min(...times) : 0;
}

function xOf(run, record, axis) {
  return axis === "step" ? record.step : (record.time - t0(run)) / 60;
}

// the step in force at wall-clock `time` (events drawn on the step axis)
function stepAt(run, time) {
  let step = 0;
  for (const r of run.records) if (typeof r.step === "number" && r.time <= time) step = Math.max(step, r.step);
  return step;
}

function seriesPoints(run, key, derived, axis) {
  const byX = new Map();  // later records of a step win (a resumed run repeats steps)
  for (const r of run.records) {
    if (axis === "step" && typeof r.step !== "number") continue;
    const y = derived && derived[key] ? derived[key](r) : r[key];
    if (typeof y !== "number") continue;
    byX.set(xOf(run, r, axis), {x: xOf(run, r, axis), y, step: r.step});
  }
  return [...byX.values()].sort((a, b) => a.x - b.x);
}

function scale(lo, hi, a, b) {
  if (hi === lo) { hi = lo + 1; lo = lo - (lo === 0 ? 0 : 1); }
  return v => a + (v - lo) / (hi - lo) * (b - a);
}

function lineChart(spec, axis) {
  const W = 380, H = 180, L = 44, R = 8, T = 8, B = 24;
  const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img"});
  const lines = [];
  selected.forEach((name, ri) => {
    const run = runs[name];
    if (!run) return;
    spec.series(run.records).forEach((key, ki) => {
      const pts = seriesPoints(run, key, spec.derived, axis);
      if (pts.length) lines.push({name, ri, key, ki, pts, run});
    });
  });
  const legend = el("span", {class: "legend"});
  const fig = el("figure", {class: "chart", "data-chart": spec.id}, el("figcaption", {}, spec.title, legend), svg);
  if (!lines.length) {
    svg.append(el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"}, "no data yet"));
    return fig;
  }
  const xs = lines.flatMap(l => l.pts.map(p => p.x)), ys = lines.flatMap(l => l.pts.map(p => p.y));
  const [x0, x1, y0, y1] = [Math.min(0, ...xs), Math.max(...xs), Math.min(0, ...ys), Math.max(...ys)];  // from step 0 / the start
  const sx = scale(x0, x1, L, W - R), sy = scale(y0, y1, H - B, T);
  for (const v of [y0, (y0 + y1) / 2, y1]) {
    svg.append(el("line", {class: "grid", x1: L, x2: W - R, y1: sy(v), y2: sy(v)}),
               el("text", {x: L - 4, y: sy(v) + 3, "text-anchor": "end"}, fmt(v, 2)));
  }
  svg.append(el("line", {class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B}),
             el("text", {x: L, y: H - 8}, fmt(x0, 2)), el("text", {x: W - R, y: H - 8, "text-anchor": "end"}, fmt(x1, 2)),
             el("text", {x: (L + W) / 2, y: H - 8, "text-anchor": "middle"}, axis === "step" ? "step" : "minutes"));
  for (const name of selected) {  // fleet and trainer events on the time axis
    const run = runs[name];
    for (const e of allEvents(run)) {
      const x = axis === "step" ? stepAt(run, e.time) : (e.time - t0(run)) / 60;
      if (x < x0 || x > x1) continue;
      svg.append(el("line", {class: `event-${e.kind}`, "data-event": e.kind, "data-who": e.who, "data-run": name,
                             x1: sx(x), x2: sx(x), y1: T, y2: H - B}, el("title", {}, `${e.who}: ${e.kind}`)));
    }
  }
  for (const l of lines) {
    const color = COLORS[l.ki % COLORS.length];
    const d = l.pts.map((p, i) => `${i ? "L" : "M"}${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`).join("");
    svg.append(el("path", {d, fill: "none", stroke: color, "stroke-width": 1.5, "stroke-dasharray": DASHES[l.ri % 4],
                           "data-run": l.name, "data-series": l.key, "data-points": l.pts.length}));
    if (l.pts.length <= MAX_CIRCLES) {
      for (const p of l.pts) {
        svg.append(el("circle", {cx: sx(p.x), cy: sy(p.y), r: 2, fill: color, "data-run": l.name,
                                 "data-series": l.key, "data-step": p.step, "data-y": p.y},
                      el("title", {}, `${l.name} ${l.key} step ${p.step}: ${fmt(p.y)}`)));
      }
    }
    legend.append(el("span", {class: "swatch", style: `background:${color}`}),
                  `${selected.length > 1 ? l.name + ": " : ""}${l.key}  `);
  }
  return fig;
}

function allEvents(run) {
  const events = [...(run.snap?.fleet_events || [])];
  for (const e of run.snap?.explorers || []) {
    if (e.state === "silent") events.push({time: e.last_seen, kind: "silent", who: e.explorer_id});
  }
  return events;
}

function stalenessHistogram() {
  const W = 380, H = 180, L = 44, B = 24, T = 8;
  const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img"});
  const fig = el("figure", {class: "chart", "data-chart": "staleness_hist"},
                 el("figcaption", {}, "staleness histogram (samples, whole run)"), svg);
  const bars = [];
  selected.forEach((name, ri) => {
    const total = {};
    for (const r of runs[name]?.records || []) {
      for (const [k, n] of Object.entries(r.staleness_hist || {})) if (typeof n === "number") total[k] = (total[k] || 0) + n;
    }
    for (const [k, n] of Object.entries(total)) bars.push({name, ri, k: Number(k), n});
  });
  if (!bars.length) {
    svg.append(el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"}, "no data yet"));
    return fig;
  }
  const ks = [...new Set(bars.map(b => b.k))].sort((a, b) => a - b), top = Math.max(...bars.map(b => b.n));
  const slot = (W - L - 8) / ks.length, width = slot * 0.8 / selected.length;
  for (const b of bars) {
    const h = (H - B - T) * b.n / top, x = L + ks.indexOf(b.k) * slot + slot * 0.1 + b.ri * width;
    svg.append(el("rect", {x, y: H - B - h, width, height: h, fill: COLORS[b.ri % COLORS.length], "data-run": b.name,
                           "data-staleness": b.k, "data-count": b.n}, el("title", {}, `${b.name} staleness ${b.k}: ${b.n}`)));
  }
  ks.forEach((k, i) => svg.append(el("text", {x: L + (i + 0.5) * slot, y: H - 8, "text-anchor": "middle"}, k)));
  svg.append(el("text", {x: L - 4, y: T + 8, "text-anchor": "end"}, fmt(top)));
  return fig;
}

function fleetTimeline(name) {
  const run = runs[name], snap = run.snap, W = 780, lane = 18, L = 110;
  const explorers = snap.explorers || [];
  const H = 24 + lane * Math.max(1, explorers.length);
  const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img", "data-timeline": name});
  const last = Math.max(...run.records.map(r => r.time), ...(snap.fleet_events || []).map(v => v.time),
                        ...explorers.map(e => e.last_seen));
  const start = t0(run), end = Math.max(snap.state === "running" ? snap.time : last, start + 1), sx = scale(0, (end - start) / 60, L, W - 8);
  explorers.forEach((e, i) => {
    const joins = (snap.fleet_events || []).filter(v => v.who === e.explorer_id && v.kind === "join").map(v => v.time);
    const from = joins.length ? Math.max(...joins) : start;
    const until = e.state === "live" ? snap.time : e.last_seen;
    const y = 8 + i * lane, color = {live: "#2ca02c", silent: "#c0392b", left: "#bbb"}[e.state] || "#888";
    svg.append(el("text", {x: 4, y: y + 11}, e.explorer_id),
               el("rect", {x: sx((from - start) / 60), y, height: lane - 6, rx: 2, fill: color,
                           width: Math.max(2, sx((until - start) / 60) - sx((from - start) / 60)),
                           "data-explorer": e.explorer_id, "data-state": e.state},
                  el("title", {}, `${e.explorer_id}: ${e.state}`)));
  });
  svg.append(el("text", {x: L, y: H - 4}, "0"), el("text", {x: W - 8, y: H - 4, "text-anchor": "end"},
                                                 `${fmt((end - start) / 60, 2)} min`));
  return svg;
}

function fleetTable(name) {
  const snap = runs[name].snap;
  const head = ["explorer", "state", "host", "pid", "weights", "groups", "batches", "admission waits", "busy", "seen"];
  const table = el("table", {"data-fleet": name}, el("tr", {}, ...head.map(h => el("th", {}, h))));
  for (const e of snap.explorers || []) {
    const state = e.state + (e.left_reason ? ` (${e.left_reason})` : "");
    table.append(el("tr", {"data-run": name, "data-explorer": e.explorer_id, "data-state": e.state,
                           "data-version": e.weights_version},
      el("td", {}, e.explorer_id), el("td", {}, state), el("td", {}, e.host || "-"), el("td", {class: "num"}, e.pid ?? "-"),
      el("td", {class: "num"}, `v${e.weights_version}`), el("td", {class: "num"}, e.groups),
      el("td", {class: "num"}, e.batches), el("td", {class: "num"}, e.admission_waits),
      el("td", {class: "num"}, e.busy === null ? "-" : `${Math.round(e.busy * 100)}%`),
      el("td", {class: "num"}, `${Math.round(e.seconds_since_seen)} s ago`)));
  }
  return table;
}

function kv(pairs, attrs = {}) {
  return el("div", {class: "kv", ...attrs}, ...pairs.map(([k, v]) => el("span", {}, el("b", {}, k + ": "), fmt(v))));
}

function render() {
  const axis = document.getElementById("xaxis").value;
  const notices = document.getElementById("notices"), summary = document.getElementById("summary");
  const charts = document.getElementById("charts"), fleet = document.getElementById("fleet");
  const config = document.getElementById("config");
  notices.replaceChildren(); summary.replaceChildren(); fleet.replaceChildren(); config.replaceChildren();
  for (const name of selected) {
    const run = runs[name];
    if (!run) continue;
    if (run.error) {
      notices.append(el("div", {class: "notice", "data-run": name, "data-state": "not-found"}, run.error));
      continue;
    }
    const s = run.snap;
    if (!s) continue;
    for (const text of s.notices.length ? s.notices : [`run ${name}: ${s.state}`]) {
      notices.append(el("div", {class: "notice", "data-run": name, "data-state": s.state, "data-broker": s.broker.state},
                        text));
    }
    const t = s.trainer || {}, c = s.config || {};
    const bound = c.mode === "off_policy" ? ` (max staleness ${c.max_staleness})`
      : c.mode === "async" ? (c.async_max_staleness == null ? " (explorers never wait)"
                                                             : ` (explorers wait at staleness ${c.async_max_staleness})`)
      : "";
    summary.append(el("h2", {}, `${name}: ${s.state}`), kv([
      ["mode", (c.mode || "?") + bound], ["trainer", t.state], ["step", `${t.step ?? "-"} / ${c.max_steps ?? "?"}`],
      ["weights version", t.version], ["broker", `${s.broker.state} ${s.broker.bootstrap}`],
      ["groups/s (explorers)", s.throughput.groups_per_s], ["steps/s", s.throughput.steps_per_s],
      ["experiences lag", s.lags.experiences?.lag], ["tasks lag", s.lags.tasks?.lag],
      ["skipped metrics lines", s.skipped.metrics_lines],
      ["skipped control records", s.skipped.control_undecodable + s.skipped.control_malformed],
    ], {"data-summary": name, "data-run-state": s.state}));
    fleet.append(el("h2", {}, `fleet of ${name}`), fleetTable(name));
    if (s.explorers.length) fleet.append(fleetTimeline(name));
    else fleet.append(el("p", {"data-fleet-empty": name}, s.broker.state === "connected" ? "no explorer has joined yet"
                                                                                      : "no fleet known: no broker to ask"));
    if (c.yaml) {
      config.append(el("h2", {}, `config of ${name}`), kv([["mode", c.mode], ["max staleness", c.max_staleness],
                                                            ["max steps", c.max_steps]]),
                    el("details", {}, el("summary", {}, "resolved config"), el("pre", {"data-config": name}, c.yaml)));
    }
  }
  charts.replaceChildren(...CHARTS.map(spec => lineChart(spec, axis)), stalenessHistogram());
}

function onSnapshot(name, snap) {
  const run = runs[name];
  if (snap.records_offset === 0 || snap.records_epoch !== run.epoch) run.records = [];
  run.records.push(...snap.records);
  run.epoch = snap.records_epoch;
  run.snap = snap;
  run.error = null;
}

async function subscribe(name) {
  const run = runs[name] = {snap: null, records: [], epoch: null, source: null, error: null};
  const response = await fetch(`/api/runs/${encodeURIComponent(name)}/snapshot`).catch(() => null);
  if (response && response.status === 404) {
    run.error = (await response.json()).detail;
    render();
    return;
  }
  run.source = new EventSource(`/api/runs/${encodeURIComponent(name)}/events`);
  run.source.addEventListener("snapshot", ev => {
    onSnapshot(name, JSON.parse(ev.data));
    setConnection(true);
    render();
  });
  run.source.onerror = () => setConnection(false);  // EventSource reconnects by itself; the server resends all
}

function setConnection(ok) {
  const node = document.getElementById("connection");
  node.dataset.connection = ok ? "live" : "lost";
  node.textContent = ok ? "live" : "dashboard server unreachable: retrying";
}

function select(names) {
  for (const name of Object.keys(runs)) {
    if (!names.includes(name)) { runs[name].source?.close(); delete runs[name]; }
  }
  selected = names;
  for (const name of names) if (!runs[name]) subscribe(name);
  const url = new URL(location.href);
  url.searchParams.delete("run");
  names.forEach(n => url.searchParams.append("run", n));
  history.replaceState(null, "", url);
  drawRunPicker();
  render();
}

function drawRunPicker() {
  const box = document.getElementById("runs");
  const names = [...new Set([...available.map(r => r.name), ...selected])];
  box.replaceChildren(...names.map(name => {
    const input = el("input", {type: "checkbox", "data-run": name});
    input.checked = selected.includes(name);
    input.addEventListener("change", () => select(names.filter(n => n === name ? input.checked : selected.includes(n))));
    const i = selected.indexOf(name);  // the first selected run is drawn solid, the others dashed
    return el("label", {title: i > 0 ? `drawn dashed (${DASHES[i % 4]})` : ""}, input, name);
  }));
}

async function loadRuns(first) {
  const response = await fetch("/api/runs").catch(() => null);
  if (!response || !response.ok) { setConnection(false); return; }
  const body = await response.json();
  available = body.runs;
  if (first) {
    const asked = new URL(location.href).searchParams.getAll("run");
    select(asked.length ? asked : [body.default]);
  } else {
    drawRunPicker();
  }
}

document.getElementById("xaxis").addEventListener("change", render);
loadRuns(true);
setInterval(() => loadRuns(false), 10000);
