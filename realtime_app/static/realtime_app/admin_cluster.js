// The admin's Realtime cluster screen: follows the health channel, one row per live process,
// and a small chart of each process's total queued bytes over the last minutes.
import { RealtimeClient } from "./realtime.js";

const root = document.getElementById("realtime-cluster");
const rows = document.getElementById("rc-rows");
const chart = document.getElementById("rc-chart");
const legend = document.getElementById("rc-legend");
const WINDOW_MS = 5 * 60 * 1000;
const COLORS = ["#417690", "#c0392b", "#27ae60", "#8e44ad", "#d35400", "#2c3e50"];
const history = new Map(); // instance -> [[t, bytes], ...]

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return i ? `${n.toFixed(1)} ${units[i]}` : `${n} B`;
}

function cell(text, num) {
  const td = document.createElement("td");
  td.textContent = text;
  if (num) td.className = "num";
  return td;
}

function refusedText(refused) {
  const seen = Object.entries(refused).filter(([, n]) => n > 0).sort();
  if (!seen.length) return "0";
  const total = seen.reduce((sum, [, n]) => sum + n, 0);
  return `${total} (${seen.map(([reason, n]) => `${reason} ${n}`).join(", ")})`;
}

function poolsText(pools) {
  const names = Object.keys(pools).sort();
  if (!names.length) return "–";
  return names.map((name) => {
    const pool = pools[name];
    const refused = Object.values(pool.refused).reduce((sum, n) => sum + n, 0);
    return `${name} ${pool.running}/${pool.max_concurrent} running, ${pool.waiting} waiting, ${refused} refused, wait p99 ${pool.wait_ms.p99} ms`;
  }).join("; ");
}

function resumesText(h) {
  const r = h.recoveries || {};
  return `${r.served || 0} recovered, ${r.failed || 0} not, ${h.replayed || 0} replayed`;
}

function unsavedCell(stores) {
  const names = Object.keys(stores).sort();
  const td = cell(names.length ? names.map((name) => {
    const s = stores[name];
    const failing = s.consecutive_failures ? `, ${s.consecutive_failures} failed flushes` : "";
    return `${name}: ${s.dirty} unsaved, oldest ${s.oldest_unsaved_s.toFixed(1)} s${failing}`;
  }).join("; ") : "–");
  // An unsaved backlog at a glance: older than twice the delay, or failing flushes.
  const late = names.some((name) => stores[name].oldest_unsaved_s > 2 * stores[name].delay_s || stores[name].consecutive_failures > 0);
  if (late) { td.style.background = "#fdd"; td.style.fontWeight = "bold"; td.classList.add("rc-backlog"); }
  return td;
}

function render(probe) {
  rows.replaceChildren();
  for (const p of probe.instances) {
    const bp = p.backpressure || {};
    const ad = p.admission || {};
    const tr = document.createElement("tr");
    tr.dataset.instance = p.instance;
    tr.append(
      cell(p.instance), cell(p.host), cell(p.pid, true), cell(`${Math.round(p.uptime_s)} s`, true),
      cell(p.connections, true), cell(p.subscriptions, true), cell(p.ticker_count ?? (p.tickers || []).length, true),
      cell((p.failing_tickers || []).join(", ") || "–"), cell(p.backplane && p.backplane.up === false ? "down" : "up"),
      cell(bytes(bp.max_buffered_amount || 0), true), cell(bytes(bp.total_buffered_amount || 0), true),
      cell(bp.slow_consumers || 0, true), cell(bp.drops || 0, true), cell(bp.closes || 0, true),
      cell(`${ad.running || 0} / ${ad.queued || 0}`, true), cell(ad.admitted || 0, true),
      cell(ad.coalesced || 0, true), cell(refusedText(ad.refused || {})), cell(ad.bucket || "–"),
      cell(poolsText(p.http_pools || {})), unsavedCell(p.write_behind || {}), cell(resumesText(p.history || {})),
    );
    rows.append(tr);
    const series = history.get(p.instance) || [];
    series.push([probe.generated_at, bp.total_buffered_amount || 0]);
    history.set(p.instance, series.filter(([t]) => t > probe.generated_at - WINDOW_MS));
  }
  const live = new Set(probe.instances.map((p) => p.instance));
  for (const id of history.keys()) if (!live.has(id)) history.delete(id);
  draw(probe.generated_at);
  document.getElementById("rc-updated").textContent = `updated ${new Date(probe.generated_at).toLocaleTimeString()}`;
}

/** A round 1-2-5 value at or above `v`. */
function niceCeil(v) {
  const step = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => m * step).find((c) => c >= v);
}

function draw(now) {
  // The scale follows what is usual in the window (90th percentile), not one spike: a
  // spike is drawn clipped at the top instead of flattening every other line.
  const values = [...history.values()].flat().map(([, v]) => v).sort((a, b) => a - b);
  const usual = values.length ? values[Math.floor(0.9 * (values.length - 1))] : 0;
  const max = niceCeil(Math.max(1024, usual * 1.25));
  chart.replaceChildren();
  legend.replaceChildren();
  [...history.entries()].forEach(([id, series], i) => {
    const color = COLORS[i % COLORS.length];
    const points = series.map(([t, v]) => `${(600 * (1 - (now - t) / WINDOW_MS)).toFixed(1)},${(155 - 150 * Math.min(v, max) / max).toFixed(1)}`);
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", points.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", color);
    line.setAttribute("stroke-width", "2");
    chart.append(line);
    const key = document.createElement("span");
    key.style.color = color;
    key.textContent = `■ ${id}`;
    legend.append(key);
  });
  const top = document.createElement("span");
  top.textContent = `scale: ${bytes(max)}`;
  legend.append(top);
}

const client = new RealtimeClient();
client.addEventListener("state", (e) => { document.getElementById("rc-state").textContent = e.detail; });
client.subscribe(root.dataset.channel, (params) => render(params.data));
client.connect();
window.realtimeCluster = { client, history };
