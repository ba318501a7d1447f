// miles dashboard page: polls the JSON endpoints of app.py and draws the curves with uPlot.
// Every text that comes from a run (samples, log lines) is set as textContent, never as HTML.
"use strict";

const POLL_MS = 2000;
const COLORS = ["#3b6fd8", "#d8663b", "#1a9f5b", "#9b3bd8", "#c9a400", "#d83b7a", "#2ab3c4", "#6b6b6b"];
const DASHES = [[], [6, 4], [2, 3], [10, 3, 2, 3]];

const state = { runs: [], panels: {}, versions: {}, records: {}, charts: {}, polls: 0 };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c ?? "")));
  return node;
}

function fmt(v, digits = 4) {
  if (v === null || v === undefined) return "–";
  return typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(digits)) : String(v);
}

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

// ---- curves -----------------------------------------------------------------------------------

function panelData(keys) {
  // one x axis (the union of steps of every run that has a key of this panel), one series per run x key
  const series = [];
  const steps = new Set();
  state.runs.forEach((run, ri) => {
    const recs = state.records[run.id] || [];
    keys.forEach((key, ki) => {
      const pts = new Map();
      for (const r of recs) if (typeof r[key] === "number" && r.step !== undefined) pts.set(r.step, r[key]);
      if (pts.size === 0) return;
      pts.forEach((_, s) => steps.add(s));
      const label = state.runs.length > 1 ? `${run.name}: ${key}` : key;
      // one run: a colour per key; several (a sweep): a colour per run, a dash pattern per key
      const multi = state.runs.length > 1;
      const color = COLORS[(multi ? ri : ki) % COLORS.length];
      series.push({ label, pts, color, dash: multi ? DASHES[ki % DASHES.length] : [] });
    });
  });
  const xs = [...steps].sort((a, b) => a - b);
  const data = [xs, ...series.map((s) => xs.map((x) => (s.pts.has(x) ? s.pts.get(x) : null)))];
  return { series, data, points: xs.length };
}

function drawPanel(title, keys) {
  const { series, data, points } = panelData(keys);
  const holder = document.getElementById("charts");
  let chart = state.charts[title];
  if (series.length === 0) {
    if (chart) { chart.plot.destroy(); chart.box.remove(); delete state.charts[title]; }
    return;
  }
  const signature = series.map((s) => s.label).join("|");
  if (!chart || chart.signature !== signature) {
    if (chart) { chart.plot.destroy(); chart.box.remove(); }
    const box = el("div", { class: "chart", "data-panel": title }, el("h4", {}, title));
    const order = Object.keys(state.panels);
    const after = [...holder.children].find((c) => order.indexOf(c.dataset.panel) > order.indexOf(title));
    holder.insertBefore(box, after || null);
    const opts = {
      width: 400, height: 200,
      scales: { x: { time: false } },
      axes: [{ label: "step" }, {}],
      series: [{ label: "step" }, ...series.map((s) => ({
        label: s.label, stroke: s.color, dash: s.dash, width: 1.5, spanGaps: true,
        points: { show: points < 40 },
      }))],
    };
    chart = { plot: new uPlot(opts, data, box), box, signature };
    state.charts[title] = chart;
  } else {
    chart.plot.setData(data);
  }
  chart.box.dataset.points = String(points);
  chart.box.dataset.lastStep = String(data[0][data[0].length - 1]);
  chart.box.dataset.drawn = "1";
}

// ---- run cards ----------------------------------------------------------------------------------

function bar(frac) {
  const b = el("div", { class: "bar" }, el("div"));
  b.firstChild.style.width = `${Math.max(0, Math.min(1, frac || 0)) * 100}%`;
  return b;
}

function table(header, rows) {
  return el("table", {}, el("tr", {}, ...header.map((h) => el("th", {}, h))),
    ...rows.map((r) => el("tr", {}, ...r.map((c) => (c instanceof Node ? el("td", {}, c) : el("td", {}, fmt(c)))))));
}

function stateSpan(text, good) {
  return el("span", { class: good ? "ok" : "bad" }, text);
}

function card(s) {
  const running = s.owner.running;
  const c = el("div", { class: "card", "data-run": s.id, "data-step": fmt(s.step) },
    el("h3", {}, s.name, " ", stateSpan(running ? "running" : running === false ? "stopped" : "?", running)),
    el("div", { class: "muted mono" }, s.path),
    el("div", { class: "muted" }, s.owner.detail || ""));
  const planned = s.steps_planned;
  c.append(el("div", { class: "step" }, `step ${fmt(s.step)}${planned ? " / " + planned : ""} · weight version ${fmt(s.weight_version)}`));
  if (planned) c.append(bar((s.step || 0) / planned));
  const cap = s.buffer.capacity;
  c.append(el("div", {}, `buffer ${fmt(s.buffer.size)}${cap ? " / " + cap + " groups" : ""}`));
  if (cap && s.buffer.size !== null) c.append(bar(s.buffer.size / cap));
  c.append(el("h4", {}, `engines (${s.engines.length})`), table(["url", "node", "state", "running", "waiting"],
    s.engines.map((e) => [e.url, e.node, stateSpan(e.state, e.state === "serving"), e.running_reqs, e.waiting_reqs])));
  c.append(el("h4", {}, `trainer ranks (${s.trainers.length})`), table(["rank", "state", "log age (s)", "last line"],
    s.trainers.map((t) => [t.rank, t.state, t.age_s, el("span", { class: "mono" }, t.last_line || "")])));
  if (s.slurm) {
    const j = s.slurm;
    c.append(el("h4", {}, "Slurm job"));
    if (j.error) c.append(el("div", { class: "bad" }, j.error));
    else {
      c.append(table(["job", "state"], [[j.job_id, stateSpan(j.state, !/FAIL|CANCEL|TIMEOUT|OUT_OF/.test(j.state))],
        ...(j.components || []).map((p) => [p.id, `${p.state} ${p.nodes || ""}`])]));
      if (j.failure) c.append(el("div", { class: "bad mono" }, j.failure.error));
    }
  }
  return c;
}

function samplesBlock(run, res) {
  const out = el("div", { class: "card", "data-samples": run.id }, el("h3", {}, run.name));
  if (res.evaluations.length === 0) out.append(el("div", { class: "muted" }, "no evaluation records yet (RUN_DIR/eval/<dataset>/step_<N>.jsonl)"));
  for (const ev of res.evaluations) {
    out.append(el("h4", {}, `${ev.dataset} at step ${ev.step}`),
      table(["prompt", "response", "score", "versions"], ev.rows.map((r) => [
        el("span", { class: "mono" }, r.prompt), el("span", { class: "mono" }, r.output),
        r.score, (r.weight_versions || []).join(",")])));
  }
  return out;
}

// ---- polling ------------------------------------------------------------------------------------

async function poll() {
  try {
    const cards = [], samples = [];
    for (const run of state.runs) {
      const m = await getJSON(`/api/runs/${encodeURIComponent(run.id)}/metrics?version=${encodeURIComponent(state.versions[run.id] || "")}`);
      if (!m.unchanged) { state.records[run.id] = m.records; state.versions[run.id] = m.version; }
      cards.push(card(await getJSON(`/api/runs/${encodeURIComponent(run.id)}/state`)));
      samples.push(samplesBlock(run, await getJSON(`/api/runs/${encodeURIComponent(run.id)}/samples`)));
    }
    document.getElementById("cards").replaceChildren(...cards);
    document.getElementById("samples").replaceChildren(...samples);
    for (const [title, keys] of Object.entries(state.panels)) drawPanel(title, keys);
    state.polls += 1;
    document.body.dataset.polls = String(state.polls);
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.getElementById("error").textContent = "";
  } catch (e) {
    document.getElementById("error").textContent = String(e);
  }
  setTimeout(poll, POLL_MS);
}

async function start() {
  const info = await getJSON("/api/runs");
  state.runs = info.runs;
  state.panels = info.panels;
  document.getElementById("runs-shown").textContent = state.runs.map((r) => r.name).join(" · ");
  poll();
}

start();
