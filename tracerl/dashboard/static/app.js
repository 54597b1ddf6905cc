// The tracerl dashboard page: polls the JSON API every second and redraws what changed.
// Metrics are fetched incrementally (a byte offset into metrics.jsonl), so a live update
// costs one small request; the rollouts table is paged on the server.
"use strict";

const CHARTS = [
  ["train/reward", "train reward"],
  ["eval/success", "held-out success"],
  ["pipeline/staleness_mean", "staleness (versions)"],
  ["pipeline/rollouts_per_s", "throughput (rollouts/s)"],
  ["time/trainer_idle_s", "trainer idle (s/step)"],
  ["runner/utilisation", "runner utilisation"],
  ["train/lr", "learning rate"],
  ["train/tokens_per_s", "train tokens/s"],
];
const COLOURS = ["#2563c9", "#e0761b"];
const UNIT = new Set(["train/reward", "eval/success", "runner/utilisation"]); // drawn on 0..1 at least
const STEP_TICKS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]; // whole steps
const PAGE = 50;

const state = {
  run: null, compare: "", metrics: {}, charts: {}, offset: 0, selected: null,
  traces: {}, asset: null, adminKey: sessionStorage.getItem("tracerl-admin-key") || "",
};

// ---------------------------------------------------------------- helpers

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (v !== null && v !== undefined) el.setAttribute(k, v);
  }
  for (const c of children.flat()) el.append(c instanceof Node ? c : document.createTextNode(String(c ?? "")));
  return el;
}
const $ = (sel) => document.querySelector(sel);
// Statuses read as in every other report (tracerl.types.STATUS_SHOWN): "answered", not
// "succeeded" — whether the answer was right is the reward.
const STATUS_SHOWN = { succeeded: "answered", failed: "error", timed_out: "timed out" };
const shown = (status) => STATUS_SHOWN[status] || status;
const fmt = (x, d = 3) => (x === null || x === undefined ? "–" : typeof x === "number" ? +x.toPrecision(d) : x);

async function api(path, opts) {
  const res = await fetch(path, opts);
  const body = await res.json().catch(() => ({ error: { message: res.statusText } }));
  if (!res.ok) throw new Error(body.error ? body.error.message : res.statusText);
  return body;
}
const runPath = (run) => `/api/runs/${encodeURIComponent(run)}`;

// ---------------------------------------------------------------- runs list

async function refreshRuns() {
  const { runs } = await api("/api/runs");
  const names = runs.map((r) => r.name);
  for (const sel of [$("#run"), $("#compare")]) {
    const keep = sel.value;
    const first = sel.id === "compare" ? [h("option", { value: "" }, "—")] : [];
    sel.replaceChildren(...first, ...names.map((n) => h("option", { value: n }, n)));
    if (names.includes(keep) || keep === "") sel.value = keep;
  }
  if (!state.run && names.length) selectRun(new URLSearchParams(location.search).get("run") || names[0]);
  $("#run").value = state.run || "";
  $("#runs tbody").replaceChildren(...runs.map((r) => h("tr", {
    class: "clickable" + (r.name === state.run ? " selected" : ""), onclick: () => selectRun(r.name),
  }, h("td", {}, r.name), h("td", {}, h("span", { class: `badge ${r.state}` }, r.state)),
     h("td", {}, `${fmt(r.step)}/${fmt(r.steps)}`), h("td", {}, fmt(r.reward)), h("td", {}, fmt(r.success)))));
}

function selectRun(run) {
  state.run = run;
  state.offset = 0;
  state.selected = null;
  $("#trace-panel").hidden = true;
  $("#asset-panel").hidden = true;
  state.asset = null;
  refreshAssets();
  history.replaceState(null, "", `?run=${encodeURIComponent(run)}`);
  $("#run").value = run;
  resetCharts();
  refreshNow();
}

// ---------------------------------------------------------------- metrics and charts

async function pollMetrics(run) {
  const m = (state.metrics[run] = state.metrics[run] || { next: 0, rows: [] });
  const chunk = await api(`${runPath(run)}/metrics?since=${m.next}`);
  if (chunk.reset) m.rows = [];
  m.rows.push(...chunk.rows);
  m.next = chunk.next;
  return chunk.rows.length > 0 || chunk.reset;
}

function series(run, key) {
  const points = new Map();
  for (const r of (state.metrics[run] || { rows: [] }).rows) {
    if (r[key] !== undefined && r[key] !== null) points.set(r.step, r[key]);
  }
  return points;
}

function chartData(key, runs) {
  const per = runs.map((run) => series(run, key));
  const xs = [...new Set(per.flatMap((p) => [...p.keys()]))].sort((a, b) => a - b);
  return [xs, ...per.map((p) => xs.map((x) => (p.has(x) ? p.get(x) : null)))];
}

// uPlot's default labels round a learning rate of 3e-4 to "0".
function tickLabel(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  return a < 0.01 || a >= 1e5 ? v.toExponential(1) : +v.toPrecision(3);
}

function resetCharts() {
  for (const c of Object.values(state.charts)) if (c.plot) c.plot.destroy();
  state.charts = {};
  $("#charts").replaceChildren(...CHARTS.map(([key, title]) => {
    const body = h("div", { class: "plot" });
    const el = h("div", { class: "chart", id: `chart-${key.replace(/\W/g, "-")}`, "data-key": key, "data-points": "0" },
      h("h3", {}, title), body);
    state.charts[key] = { el, body, plot: null };
    return el;
  }));
}

function drawCharts() {
  const runs = [state.run, state.compare].filter((r, i) => r && (i === 0 || r !== state.run));
  for (const [key] of CHARTS) {
    const c = state.charts[key];
    const data = chartData(key, runs);
    const points = data.slice(1).reduce((n, ys) => n + ys.filter((y) => y !== null).length, 0);
    c.el.dataset.points = points;
    c.el.dataset.lastStep = data[0].length ? data[0][data[0].length - 1] : "";
    if (!points) {
      if (c.plot) { c.plot.destroy(); c.plot = null; }
      c.body.replaceChildren(h("div", { class: "empty" }, "no data yet"));
      continue;
    }
    if (c.plot && c.plot.series.length === runs.length + 1) { c.plot.setData(data); continue; }
    if (c.plot) c.plot.destroy();
    c.body.replaceChildren();
    const unit = UNIT.has(key) ? { range: (u, lo, hi) => [Math.min(0, lo), Math.max(1, hi)] } : {};
    c.plot = new uPlot({
      width: Math.max(280, c.el.clientWidth - 10), height: 170,
      scales: { x: { time: false }, y: unit },
      axes: [{ incrs: STEP_TICKS }, { values: (u, ticks) => ticks.map(tickLabel), size: 56 }],
      legend: { show: runs.length > 1 }, // a single run's colour needs no key
      series: [{ label: "step" }, ...runs.map((run, i) => ({
        label: run, stroke: COLOURS[i], width: 2, spanGaps: true, dash: i ? [6, 4] : undefined,
        points: { show: true, size: 4 },
      }))],
    }, data, c.body);
  }
}

// ---------------------------------------------------------------- status, health, control

async function refreshStatus() {
  const s = await api(`${runPath(state.run)}/status`);
  const badge = $("#run-state");
  badge.textContent = s.state;
  badge.className = `badge ${s.state}`;
  $("#control-log").replaceChildren(
    ...s.pending.map((c) => h("div", {}, h("span", {}, `${c.op} ${c.key ?? ""} ${c.value ?? ""}`), h("span", { class: "dim" }, "pending"))),
    ...s.applied.slice().reverse().map((a) => h("div", {},
      h("span", {}, `${a.op} ${a.key ?? ""} ${a.value ?? ""}`),
      h("span", { class: a.ok ? "dim" : "msg" }, a.ok ? `step ${a.step}` : a.error))));
}

async function refreshHealth() {
  let hl;
  try { hl = await api(`${runPath(state.run)}/health`); } catch (e) { $("#health").textContent = e.message; return; }
  const kv = (k, v) => h("div", { class: "kv" }, h("span", {}, k), h("b", {}, fmt(v)));
  $("#health").replaceChildren(
    kv("queue depth (queued)", hl.counts.queued), kv("running", hl.counts.running),
    kv("answered / error / timed out", `${hl.counts.succeeded} / ${hl.counts.failed} / ${hl.counts.timed_out}`),
    kv("leases expiring (10 s) / expired", `${hl.leases_expiring} / ${hl.leases_expired}`),
    kv("finished / min", hl.finished_last_min), kv("model calls / min", hl.calls_last_min),
    kv("sampled tokens / min", hl.tokens_last_min), kv("versions published", hl.versions_published),
    ...hl.versions.map((v) => kv(`${v.role} newest`, `v${v.version}${v.path ? " (checkpointed)" : ""}`)));
}

async function control(op, key, value) {
  const headers = { "content-type": "application/json" };
  if (state.adminKey) headers.authorization = `Bearer ${state.adminKey}`;
  const msg = $("#control-msg");
  try {
    const r = await api(`${runPath(state.run)}/control`, { method: "POST", headers, body: JSON.stringify({ op, key, value }) });
    msg.className = "msg ok";
    msg.textContent = `${op} sent (${r.command.id})${r.live ? "" : " — the run is not training: applied when it resumes"}`;
  } catch (e) { msg.className = "msg"; msg.textContent = `${op}: ${e.message}`; }
  refreshStatus();
}

function parseValue(text) { try { return JSON.parse(text); } catch { return text; } }

// ---------------------------------------------------------------- rollouts table

function filters() {
  const params = new URLSearchParams();
  for (const [k, v] of new FormData($("#filters"))) if (String(v).trim() !== "") params.set(k, String(v).trim());
  params.set("limit", PAGE);
  params.set("offset", state.offset);
  return params;
}

async function refreshRollouts() {
  let page;
  try { page = await api(`${runPath(state.run)}/rollouts?${filters()}`); $("#filter-msg").textContent = ""; }
  catch (e) { $("#filter-msg").textContent = e.message; return; }
  $("#rollouts-count").textContent = `${page.total} matching · ${page.query_ms.toFixed(1)} ms`;
  $("#page-info").textContent = page.total ? `${page.offset + 1}–${page.offset + page.rows.length} of ${page.total}` : "none";
  $("#rollouts tbody").replaceChildren(...page.rows.map((row) => {
    const r = row.rollout;
    const versions = row.version_min === null ? "–" : row.version_min === row.version_max ? row.version_min : `${row.version_min}–${row.version_max}`;
    return h("tr", { class: "clickable" + (r.id === state.selected ? " selected" : ""), "data-id": r.id, onclick: () => openTrace(r.id) },
      h("td", {}, r.id), h("td", {}, r.task_id), h("td", {}, r.group_id ?? ""), h("td", {}, fmt(row.step)),
      h("td", {}, shown(r.status)), h("td", {}, fmt(r.reward)), h("td", {}, row.calls), h("td", {}, row.roles.join(" ")),
      h("td", {}, versions), h("td", {}, row.completion_tokens), h("td", { class: "answer", title: r.answer ?? r.error ?? "" }, r.answer ?? r.error ?? ""));
  }));
}

// ---------------------------------------------------------------- assets
// An asset's versions, its comparisons (the pairs that moved link to both traces), its
// optimizations, and the rollouts that ran with each version. Loaded when opened: the use
// table reads every span of the run's store.

async function refreshAssets() {
  let list;
  try { list = await api(`${runPath(state.run)}/assets`); } catch { list = { assets: [] }; }
  $("#assets tbody").replaceChildren(...(list.assets.length ? list.assets.map((a) => h("tr", {
    class: "clickable" + (a.name === state.asset ? " selected" : ""), onclick: () => openAsset(a.name),
  }, h("td", {}, a.name), h("td", {}, a.current === null ? "–" : `v${a.current}`),
     h("td", {}, a.candidates ? `${a.versions} (${a.candidates} candidates)` : a.versions),
     h("td", { class: "answer", title: a.first_line }, a.first_line))) : [h("tr", {}, h("td", { class: "dim" }, "none"))]));
}

const grid = (head, rows) => h("table", {}, h("thead", {}, h("tr", {}, ...head.map((c) => h("th", {}, c)))), h("tbody", {}, ...rows));
const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
const traceLink = (id) => h("a", { class: "trace-link", onclick: () => openTrace(id) }, id);

async function openAsset(name) {
  state.asset = name;
  const page = await api(`${runPath(state.run)}/assets/${encodeURIComponent(name)}`);
  $("#asset-panel").hidden = false;
  $("#asset-name").textContent = name;
  const text = h("pre", {}, page.versions[page.versions.length - 1].text);
  const versions = grid(["version", "kind", "note", "first line"], page.versions.map((v) => h("tr", {
    class: "clickable", onclick: () => { text.textContent = v.text; },
  }, h("td", {}, `v${v.version}`), h("td", {}, v.candidate ? "candidate" : ""), h("td", {}, v.note),
     h("td", { class: "answer" }, v.text.split("\n")[0]))));
  const moved = h("div", {});
  const comparisons = grid(["A vs B", "why", "pairs", "success A → B", "repairs", "regressions", "p", "test"],
    page.comparisons.map(({ comparison: c, pairs }) => h("tr", { class: "clickable", onclick: () => showMoved(moved, c) },
      h("td", {}, `v${c.a} vs v${c.b}`), h("td", {}, c.purpose), h("td", {}, pairs),
      h("td", {}, `${pct(c.success_a)} → ${pct(c.success_b)}`), h("td", {}, c.repairs), h("td", {}, c.regressions),
      h("td", {}, fmt(c.p_value)), h("td", {}, c.test))));
  const optimizations = grid(["optimization", "status", "proposer", "seed", "rounds", "best", "accepted", "held-out p"],
    page.optimizations.map((o) => h("tr", {}, h("td", {}, o.id), h("td", {}, o.status), h("td", {}, o.proposer),
      h("td", {}, `v${o.seed}`), h("td", {}, o.rounds.length), h("td", {}, o.best ? `v${o.best}` : "–"),
      h("td", {}, o.accepted ? `v${o.accepted}` : "–"), h("td", {}, fmt(o.p_value)))));
  const use = grid(["version", "source", "rollouts", "success", "mean reward"], page.use.map((u) => h("tr", {},
    h("td", {}, u.version ? `v${u.version}` : "withheld"), h("td", {}, u.source), h("td", {}, u.rollouts),
    h("td", {}, pct(u.success)), h("td", {}, fmt(u.mean_reward)))));
  $("#asset-body").replaceChildren(h("h3", {}, "Versions (click one for its text)"), versions, text,
    h("h3", {}, "Comparisons (click one for the pairs that moved)"), comparisons, moved,
    h("h3", {}, "Optimizations"), optimizations, h("h3", {}, "Rollouts by version"), use);
  refreshAssets();
}

function showMoved(el, c) {
  el.replaceChildren(grid(["task", "repeat", "moved", `A (v${c.a})`, `B (v${c.b})`], c.pairs.map((p) => h("tr", {},
    h("td", {}, p.task_id), h("td", {}, p.repeat), h("td", {}, p.b ? "repair" : "regression"),
    h("td", {}, traceLink(p.rollout_a)), h("td", {}, traceLink(p.rollout_b))))));
}

// ---------------------------------------------------------------- trace view

async function openTrace(id) {
  state.selected = id;
  $("#trace-panel").hidden = false;
  const t = await loadTrace(id);
  const sibling = $("#sibling");
  const others = t.group.filter((g) => g !== id);
  sibling.replaceChildren(h("option", { value: "" }, "—"), ...others.map((g) => h("option", { value: g }, g)));
  sibling.value = others[0] || "";
  await renderTraces();
  $("#trace-panel").scrollIntoView({ behavior: "instant", block: "start" });
}

async function loadTrace(id) {
  if (!state.traces[id]) state.traces[id] = await api(`${runPath(state.run)}/rollouts/${encodeURIComponent(id)}`);
  return state.traces[id];
}

async function renderTraces() {
  renderTrace($("#trace-a"), await loadTrace(state.selected));
  const other = $("#sibling").value;
  if (other) renderTrace($("#trace-b"), await loadTrace(other));
  else $("#trace-b").replaceChildren(h("div", { class: "dim" }, "no other rollout in this group"));
}

function tokenColour(tok, mode) {
  if (mode === "advantage") {
    if (tok.advantage === null) return "transparent";
    const a = Math.max(-1, Math.min(1, tok.advantage / 2));
    return a >= 0 ? `rgba(34, 160, 80, ${a})` : `rgba(220, 60, 60, ${-a})`;
  }
  const p = Math.exp(tok.logprob);
  return `hsl(${Math.round(p * 120)}, 75%, 82%)`;
}

function renderMessage(m) {
  const parts = [h("b", {}, `${m.role}: `), typeof m.content === "string" ? m.content : JSON.stringify(m.content ?? "")];
  for (const c of m.tool_calls || []) {
    const fn = c.function || {};
    const args = typeof fn.arguments === "string" ? fn.arguments : JSON.stringify(fn.arguments);
    parts.push(h("span", { class: "toolcall" }, ` → ${fn.name}(${args})`));
  }
  return h("div", { class: "message" }, ...parts);
}

function renderTrace(el, t) {
  const mode = $("#colour").value;
  const r = t.rollout;
  const question = t.task ? JSON.stringify(t.task.input) : r.task_id;
  el.replaceChildren(
    h("div", { class: "head" },
      h("div", {}, h("b", {}, r.id), ` · ${shown(r.status)} · reward `, h("b", { class: "reward" }, fmt(r.reward)),
        ` · attempt ${r.attempt} · step ${fmt(t.step)}`),
      h("div", { class: "dim" }, `task ${r.task_id}: ${question}`),
      h("div", { class: "dim" }, `answer: ${r.answer ?? "–"}${r.error ? ` · error: ${r.error}` : ""}`),
      t.decoded ? "" : h("div", { class: "msg" }, "tokenizer not found: token ids shown")),
    ...t.calls.map((c) => h("div", { class: "call" + (c.depth ? " sub" : ""), style: `margin-left:${c.depth * 18}px`, "data-span": c.id },
      h("div", { class: "meta" }, `#${c.seq} ${c.role} · v${c.version} · ${c.prompt_tokens} prompt tokens (${c.prefix_reused} reused) · ${c.tokens.length} sampled · ${c.finish_reason} · ${c.latency_s.toFixed(3)} s`),
      ...c.messages.map(renderMessage),
      h("div", { class: "tokens" }, ...c.tokens.map((tok) => h("span", {
        class: "tok", style: `background:${tokenColour(tok, mode)}`,
        title: `id ${tok.id} · logprob ${tok.logprob.toFixed(3)} · p ${Math.exp(tok.logprob).toFixed(3)}` +
          (tok.advantage === null ? "" : ` · advantage ${tok.advantage.toFixed(3)}`),
      }, tok.text))))));
}

// ---------------------------------------------------------------- the loop

let busy = false;
let forced = false;
let ticks = 0;
// One tick at a time (metrics are appended by offset); a forced refresh asked for while one
// runs is done by the next.
function refreshNow() { forced = true; tick(); }
async function tick() {
  if (!state.run || busy) return;
  busy = true;
  const force = forced;
  forced = false;
  try {
    // Everything in parallel: a tick costs the slowest request, not their sum.
    const runs = [state.run, state.compare].filter(Boolean);
    const table = force || (ticks % 3 === 0 && $("#live-table").checked && state.offset === 0);
    const metrics = Promise.all(runs.map(pollMetrics)).then((changed) => {
      if (changed.some(Boolean) || force) drawCharts();
      const rows = state.metrics[state.run].rows;
      $("#run-step").textContent = rows.length ? `step ${rows[rows.length - 1].step}` : "";
    });
    await Promise.all([metrics, refreshStatus(), refreshHealth(),
      table ? refreshRollouts() : null, ticks % 5 === 4 ? refreshRuns() : null,
      ticks % 10 === 9 ? refreshAssets() : null]);
    document.body.dataset.ready = "1";
  } catch (e) {
    $("#control-msg").className = "msg";
    $("#control-msg").textContent = e.message;
  } finally {
    busy = false;
    ticks += 1;
  }
}

function wire() {
  $("#run").addEventListener("change", (e) => selectRun(e.target.value));
  $("#compare").addEventListener("change", (e) => { state.compare = e.target.value; resetCharts(); refreshNow(); });
  for (const b of document.querySelectorAll("#controls button[data-op]")) {
    b.addEventListener("click", () => {
      if (b.dataset.op === "stop" && !confirm("Stop the run? It evaluates, exports and ends.")) return;
      control(b.dataset.op);
    });
  }
  $("#btn-set").addEventListener("click", () => control("set", $("#set-key").value, parseValue($("#set-value").value)));
  $("#admin-key").value = state.adminKey;
  $("#admin-key").addEventListener("change", (e) => { state.adminKey = e.target.value; sessionStorage.setItem("tracerl-admin-key", state.adminKey); });
  $("#filters").addEventListener("submit", (e) => { e.preventDefault(); state.offset = 0; refreshRollouts(); });
  $("#prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE); refreshRollouts(); });
  $("#next").addEventListener("click", () => { state.offset += PAGE; refreshRollouts(); });
  $("#colour").addEventListener("change", renderTraces);
  $("#sibling").addEventListener("change", renderTraces);
  $("#asset-close").addEventListener("click", () => { $("#asset-panel").hidden = true; state.asset = null; refreshAssets(); });
}

async function main() {
  wire();
  resetCharts();
  api("/api/auth").then((a) => { $("#admin-key").hidden = !a.required; });
  const asked = new URLSearchParams(location.search).get("run");
  if (asked) selectRun(asked); // the run's data and the runs list load in parallel
  await refreshRuns();
  setInterval(tick, 1000);
}
main();
