// The tokenmill dashboard: usage from the ledger (/dashboard/api/usage) and the live queue and
// workers (/dashboard/api/live), drawn with Chart.js. The view (range, tenants) lives in the URL's
// hash, so a link reproduces it.
"use strict";

const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
                 "#9c755f", "#bab0ac", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf"];
const OUTCOME_COLOURS = {finished: "#59a14f", cancelled: "#edc948", failed: "#e15759", shed: "#b07aa1"};
const charts = {};
window.tokenmillCharts = charts;  // read by the browser test, handy in the console too

function colourOf(name) {  // the same tenant or model keeps its colour in every chart
  let h = 0;
  for (const c of name) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return PALETTE[h % PALETTE.length];
}

function view() {
  const params = new URLSearchParams(location.hash.slice(1));
  return {range: params.get("range") || "1h", tenants: params.getAll("tenant")};
}

function setView(v) {
  const params = new URLSearchParams();
  params.set("range", v.range);
  v.tenants.forEach(t => params.append("tenant", t));
  history.replaceState(null, "", "#" + params.toString());
  loadUsage();
}

function timeLabel(ms, bucketS) {
  const d = new Date(ms);
  const opts = bucketS >= 86400 ? {month: "short", day: "numeric"}
             : bucketS >= 3600 ? {month: "short", day: "numeric", hour: "2-digit", minute: "2-digit"}
             : {hour: "2-digit", minute: "2-digit"};
  return d.toLocaleString(undefined, opts);
}

function draw(id, type, labels, datasets, options = {}) {
  const chart = charts[id];
  if (chart) {
    chart.data.labels = labels;
    chart.data.datasets = datasets;
    chart.update("none");
    return;
  }
  charts[id] = new Chart(document.getElementById(id), {
    type, data: {labels, datasets},
    options: Object.assign({animation: false, maintainAspectRatio: false, responsive: true,
                            plugins: {legend: {position: "bottom", labels: {boxWidth: 12}}}}, options),
  });
}

const STACKED = {scales: {x: {stacked: true}, y: {stacked: true, beginAtZero: true}}};

function stackedBars(id, labels, series) {
  draw(id, "bar", labels, Object.entries(series).map(([name, values]) => ({
    label: name, data: values, backgroundColor: colourOf(name), stack: "s"})), STACKED);
}

function latencyLines(id, labels, latency, kind) {
  const styles = {p50: [], p95: [6, 3], p99: [2, 2]};
  draw(id, "line", labels, Object.entries(styles).map(([q, dash]) => ({
    label: q, data: latency[`${kind}_${q}_ms`], borderColor: "#4e79a7", borderDash: dash, pointRadius: 2,
    spanGaps: false})), {scales: {y: {beginAtZero: true}}});
}

const fmt = new Intl.NumberFormat(undefined, {maximumFractionDigits: 0});
const usd = v => "$" + (v < 0.01 && v > 0 ? v.toExponential(2) : v.toFixed(2));

function renderTenantFilter(all, selected) {
  const box = document.getElementById("tenant-checkboxes");
  const names = [...new Set([...all, ...selected])].sort();
  box.replaceChildren(...names.map(name => {
    const label = document.createElement("label");
    const input = document.createElement("input");
    input.type = "checkbox";
    input.value = name;
    input.checked = selected.includes(name);
    input.addEventListener("change", () => {
      const chosen = [...box.querySelectorAll("input:checked")].map(i => i.value);
      setView({...view(), tenants: chosen});
    });
    label.append(input, " ", name);
    return label;
  }));
  document.getElementById("tenant-filter-label").textContent = selected.length ? selected.join(", ") : "all";
}

async function getJSON(path) {
  const response = await fetch(path, {credentials: "same-origin"});
  if (response.status === 401) { location.reload(); throw new Error("signed out"); }
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function showErrors(source, errors) {
  showErrors.by = Object.assign(showErrors.by || {}, {[source]: errors});
  const all = Object.values(showErrors.by).flat();
  const box = document.getElementById("errors");
  box.hidden = all.length === 0;
  box.textContent = all.join(" · ");
}

let usageSeq = 0;
async function loadUsage() {
  const v = view();
  document.getElementById("range").value = v.range;
  const params = new URLSearchParams({since: v.range});
  v.tenants.forEach(t => params.append("tenant", t));
  const seq = ++usageSeq;
  let u;
  try {
    u = await getJSON("/dashboard/api/usage?" + params);
  } catch (e) { showErrors("usage", [String(e.message || e)]); return; }
  if (seq !== usageSeq) return;  // a newer view was asked for meanwhile
  showErrors("usage", []);
  const labels = u.buckets.map(t => timeLabel(t, u.bucket_s));
  stackedBars("tokens-by-tenant", labels, u.tokens_by_tenant);
  stackedBars("cost-by-tenant", labels, u.cost_by_tenant);
  stackedBars("tokens-by-model", labels, u.tokens_by_model);
  stackedBars("cost-by-model", labels, u.cost_by_model);
  draw("outcomes", "bar", labels, Object.entries(u.outcomes).map(([name, values]) => ({
    label: name, data: values, backgroundColor: OUTCOME_COLOURS[name], stack: "s"})), STACKED);
  const top = u.top_tenants.slice(0, 10);
  draw("top-tenants", "bar", top.map(t => t.tenant_id), [{label: "tokens", data: top.map(t => t.tokens),
    backgroundColor: top.map(t => colourOf(t.tenant_id))}],
    {indexAxis: "y", plugins: {legend: {display: false}}});
  latencyLines("ttft", labels, u.latency, "ttft");
  latencyLines("tpot", labels, u.latency, "tpot");
  document.getElementById("total-requests").textContent = fmt.format(u.totals.requests);
  document.getElementById("total-tokens").textContent = fmt.format(u.totals.tokens);
  document.getElementById("total-cost").textContent = usd(u.totals.cost_usd);
  renderTenantFilter(u.tenants, u.selected_tenants);
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  document.body.dataset.usageLoads = String(Number(document.body.dataset.usageLoads) + 1);
}

function cell(text) { const td = document.createElement("td"); td.textContent = text; return td; }
function row(cells) { const tr = document.createElement("tr"); tr.append(...cells.map(cell)); return tr; }

async function loadLive() {
  let live;
  try {
    live = await getJSON("/dashboard/api/live");
  } catch (e) { showErrors("live", [String(e.message || e)]); return; }
  showErrors("live", live.errors);
  const tenants = live.queue ? live.queue.tenants : [];
  const names = tenants.map(t => t.tenant_id);
  draw("queue", "bar", names, [
    {label: "queued", data: tenants.map(t => t.queued || 0), backgroundColor: "#f28e2b", stack: "s"},
    {label: "running", data: tenants.map(t => t.running || 0), backgroundColor: "#4e79a7", stack: "s"},
  ], STACKED);
  const sum = key => tenants.reduce((a, t) => a + (t[key] || 0), 0);
  document.getElementById("queued-now").textContent = live.queue ? fmt.format(sum("queued")) : "-";
  document.getElementById("running-now").textContent = live.queue ? fmt.format(sum("running")) : "-";
  document.querySelector("#gate tbody").replaceChildren(...tenants.map(t => row([
    t.tenant_id, fmt.format(t.queued || 0), fmt.format(t.running || 0), fmt.format(t.released || 0),
    fmt.format(t.shed || 0), fmt.format(t.rejected || 0),
    fmt.format((t.preempted_fairness || 0) + (t.preempted_priority || 0))])));
  document.querySelector("#workers tbody").replaceChildren(...live.workers.map(w => {
    const tr = row([w.worker, w.model, fmt.format(w.running || 0), fmt.format(w.waiting || 0), "",
                    fmt.format(w.preemptions || 0),
                    w.prefix_queries ? Math.round(100 * w.prefix_hits / w.prefix_queries) + "%" : "-"]);
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = Math.round(60 * (w.kv_usage || 0)) + "px";
    tr.children[4].append(bar, Math.round(100 * (w.kv_usage || 0)) + "%");
    return tr;
  }));
  const credits = live.queue ? Object.entries(live.queue.models)
    .map(([m, c]) => `${m}: ${fmt.format(c.credits || 0)} free slots, ${fmt.format(c.in_transit || 0)} in transit`) : [];
  document.getElementById("credits").textContent = credits.length ? "Credits: " + credits.join("; ") : "";
  const gateRejected = sum("rejected");
  const edge = live.rejections.map(r => `${fmt.format(r.count)} × ${r.status} ${r.code}`);
  document.getElementById("rejected-summary").textContent =
    [...edge, `${fmt.format(gateRejected)} by the gate's quota`].join(", ");
  document.body.dataset.liveLoads = String(Number(document.body.dataset.liveLoads) + 1);
}

document.getElementById("range").addEventListener("change", e => setView({...view(), range: e.target.value}));
document.getElementById("tenants-all").addEventListener("click", () => setView({...view(), tenants: []}));
window.addEventListener("hashchange", loadUsage);
loadUsage();
loadLive();
setInterval(loadUsage, 10000);
setInterval(loadLive, 2000);
