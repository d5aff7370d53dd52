// The admin's Realtime cluster screen: follows the health channel; cluster totals, one
// card per process (healthy, degraded or gone), live charts kept client-side, and the
// drill-down to one process's top connections and channels, where staff may close one.
import { RealtimeClient } from "./realtime.js";
import { TimeChart, formatBytes, formatNumber } from "./admin_charts.js";

const root = document.getElementById("realtime-cluster");
const cards = document.getElementById("rc-cards");
const totalsBox = document.getElementById("rc-totals");
const connectionsBody = root.querySelector("[data-connections] tbody");
const templatesBody = root.querySelector("[data-templates] tbody");
const presenceBody = root.querySelector("[data-presence] tbody");
const presenceSummary = root.querySelector("[data-presence-summary]");
const channelsBody = root.querySelector("[data-channels] tbody");
const GONE_KEEP_MS = 60 * 1000;

const chart = (name, options) => new TimeChart(root.querySelector(`[data-chart="${name}"]`), options);
const charts = {
  frames: chart("frames_out", { unit: "frames/s" }),
  queued: chart("queued_bytes", { unit: "", format: formatBytes, floor: 1024 }),
  drops: chart("drops_closes", { unit: "/s" }),
  admission: chart("admission", { unit: "requests/s", stacked: true }),
  http: chart("http_pools", { unit: "requests" }),
  httpWait: chart("http_wait", { unit: "ms" }),
  backlog: chart("write_behind", { unit: "objects" }),
  backlogAge: chart("write_behind_age", { unit: "s" }),
  resumes: chart("resumes", { unit: "/s" }),
  cpu: chart("cpu", { unit: "%", floor: 10 }),
  memory: chart("memory", { unit: "", format: formatBytes, floor: 1024 * 1024 }),
};

const seen = new Map(); // instance -> {probe, at (ms), previous probe, rates}
let selected = null; // the instance whose connections the drill-down shows

const sum = (values) => values.reduce((a, b) => a + (b || 0), 0);
const short = (instance) => instance.split("-").slice(-2).join("-"); // pid-token: short and unique

/** Per-second rate of a counter between two probes of one process (its own clock, uptime). */
function rate(now, before, read) {
  if (!before) return undefined;
  const dt = now.uptime_s - before.uptime_s;
  const dv = read(now) - read(before);
  return dt > 0 && dv >= 0 ? dv / dt : undefined; // a restart (dv < 0) or the same probe again: no point
}

function degradedWhy(p) {
  const why = [];
  if (p.backplane && p.backplane.up === false) {
    const down = (p.backplane.shards || []).filter((shard) => !shard.up);
    why.push(down.length && p.backplane.shards.length > 1
      ? `backplane ${down.map((shard) => `shard ${shard.index} (${shard.address})`).join(", ")} down`
      : "backplane down");
  }
  if ((p.failing_tickers || []).length) why.push(`failing tickers: ${p.failing_tickers.join(", ")}`);
  for (const [name, store] of Object.entries(p.write_behind || {})) {
    if (store.consecutive_failures > 0) why.push(`${name}: ${store.consecutive_failures} failed flushes`);
    else if (store.oldest_unsaved_s > 2 * store.delay_s) why.push(`${name}: backlog aging (${store.oldest_unsaved_s.toFixed(1)} s)`);
  }
  return why;
}

function term(dl, label, value) {
  const dt = document.createElement("dt");
  dt.textContent = label;
  const dd = document.createElement("dd");
  dd.textContent = value;
  dl.append(dt, dd);
}

function card(entry, gone) {
  const p = entry.probe;
  const div = document.createElement("div");
  const why = gone ? ["gone: no probe since " + new Date(entry.at).toLocaleTimeString()] : degradedWhy(p);
  div.className = `rc-card ${gone ? "gone" : why.length ? "degraded" : "healthy"}${selected === p.instance ? " selected" : ""}`;
  div.dataset.instance = p.instance;
  div.dataset.state = gone ? "gone" : why.length ? "degraded" : "healthy";
  const h = document.createElement("h3");
  h.textContent = `${p.host} · pid ${p.pid}`;
  h.title = p.instance;
  const dl = document.createElement("dl");
  const bp = p.backpressure || {};
  term(dl, "instance", p.instance);
  term(dl, "uptime", `${Math.round(p.uptime_s)} s`);
  term(dl, "memory (RSS)", formatBytes(p.rss_bytes || 0));
  term(dl, "CPU", entry.cpu === undefined ? "–" : `${entry.cpu.toFixed(0)} %`);
  term(dl, "connections", p.connections);
  term(dl, "subscriptions", p.subscriptions);
  term(dl, "tickers", p.ticker_count);
  term(dl, "queued", formatBytes(bp.total_buffered_amount || 0));
  term(dl, "backplane", p.backplane && p.backplane.up === false ? "down" : "up");
  term(dl, "failing tickers", (p.failing_tickers || []).length || "none");
  div.append(h, dl);
  if (why.length) {
    const p2 = document.createElement("p");
    p2.className = "why";
    p2.textContent = why.join("; ");
    div.append(p2);
  }
  div.addEventListener("click", () => { selected = p.instance; renderAll(); });
  return div;
}

function totals(live) {
  const rates = [...seen.values()].filter((e) => live.has(e.probe.instance));
  const items = [
    ["processes", live.size],
    ["connections", sum(rates.map((e) => e.probe.connections))],
    ["subscriptions", sum(rates.map((e) => e.probe.subscriptions))],
    ["frames out / s", formatNumber(sum(rates.map((e) => e.frames)))],
    ["queued", formatBytes(sum(rates.map((e) => (e.probe.backpressure || {}).total_buffered_amount)))],
    ["drops / s", formatNumber(sum(rates.map((e) => e.drops)))],
    ["requests running", sum(rates.map((e) => (e.probe.admission || {}).running))],
    ["unsaved objects", sum(rates.flatMap((e) => Object.values(e.probe.write_behind || {}).map((s) => s.dirty)))],
  ];
  totalsBox.replaceChildren(...items.map(([label, value]) => {
    const div = document.createElement("div");
    const b = document.createElement("b");
    b.textContent = value;
    div.append(b, label);
    return div;
  }));
}

function cell(tr, text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  tr.append(td);
  return td;
}

function drill() {
  const entry = seen.get(selected);
  document.getElementById("rc-drill-title").textContent = entry
    ? `Connections of ${entry.probe.host} · pid ${entry.probe.pid}` : "Connections";
  connectionsBody.replaceChildren();
  channelsBody.replaceChildren();
  if (templatesBody) templatesBody.replaceChildren();
  if (presenceBody) presenceBody.replaceChildren();
  if (!entry) return;
  const presence = entry.probe.presence;
  if (presence && presenceBody) {
    for (const [name, members] of Object.entries(presence.members || {})) {
      const tr = document.createElement("tr");
      tr.dataset.presence = name;
      cell(tr, name, "channels");
      cell(tr, members, "num");
      presenceBody.append(tr);
    }
    presenceSummary.textContent = `${presence.channels} presence channels, ${presence.connections} connections in them, `
      + `${presence.watchers} watching; ${presence.diffs} frames sent, ${presence.coalesced} merged for slow watchers.`;
  }
  for (const [pattern, t] of Object.entries(entry.probe.templates || {})) {
    const tr = document.createElement("tr");
    tr.dataset.template = pattern;
    cell(tr, pattern, "channels");
    cell(tr, t.instances, "num");
    cell(tr, t.subscribers, "num");
    cell(tr, t.published, "num");
    cell(tr, Object.entries(t.busiest || {}).map(([name, n]) => `${name} (${n})`).join(" "), "channels");
    if (templatesBody) templatesBody.append(tr);
  }
  const closeUrl = root.dataset.closeUrl;
  for (const c of entry.probe.top_connections || []) {
    const tr = document.createElement("tr");
    tr.dataset.connection = c.id;
    cell(tr, c.id);
    cell(tr, c.user || c.address || "anonymous");
    cell(tr, c.channels.join(" ") + (c.channel_count > c.channels.length ? ` (+${c.channel_count - c.channels.length})` : ""), "channels");
    cell(tr, formatBytes(c.queued_bytes), "num");
    cell(tr, c.conflated ? `${c.drops} (+${c.conflated} conflated)` : c.drops, "num");
    cell(tr, c.in_flight, "num");
    cell(tr, `${Math.round(c.age_s)} s`, "num");
    const td = cell(tr, "");
    if (closeUrl && !entry.gone) {
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = "close";
      button.dataset.close = c.id;
      button.addEventListener("click", () => closeConnection(entry.probe.instance, c, button));
      td.append(button);
    }
    connectionsBody.append(tr);
  }
  const history = (entry.probe.history || {}).channels || {};
  for (const [name, subscribers] of Object.entries(entry.probe.channels || {})) {
    const tr = document.createElement("tr");
    tr.dataset.channel = name;
    const cadence = (entry.probe.channel_cadences || {})[name];  // the registry's, not a trailing id
    cell(tr, name, "channels");
    cell(tr, subscribers, "num");
    cell(tr, cadence ? `${cadence} ms` : "–", "num");
    const perS = entry.channelRates ? entry.channelRates[name] : undefined;
    cell(tr, perS === undefined ? "–" : perS.toFixed(1), "num");
    cell(tr, history[name] ? history[name].kept : "–", "num");
    channelsBody.append(tr);
  }
}

// The page's own CSRF token (from the template: works with CSRF_COOKIE_HTTPONLY and
// CSRF_USE_SESSIONS, where the cookie cannot be read).
const csrfToken = () => root.dataset.csrf || "";

async function closeConnection(instance, c, button) {
  if (!window.confirm(`Close connection ${c.id} (${c.user || c.address || "anonymous"})? Its client will not reconnect.`)) return;
  button.disabled = true;
  try {
    const response = await fetch(root.dataset.closeUrl, {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken() },
      body: JSON.stringify({ instance, connection: c.id }),
      credentials: "same-origin",
    });
    button.textContent = response.ok ? "closing…" : `failed (${response.status})`;
  } catch (error) {
    button.textContent = "failed (network)";
    button.disabled = false;
  }
}

function renderAll() {
  const now = Date.now();
  const live = new Set([...seen.values()].filter((e) => !e.gone).map((e) => e.probe.instance));
  const list = [...seen.values()].sort((a, b) => a.probe.instance.localeCompare(b.probe.instance));
  cards.replaceChildren(...list.map((e) => card(e, e.gone)));
  totals(live);
  if (!seen.has(selected)) selected = list.length ? list[0].probe.instance : null;
  drill();
  for (const c of Object.values(charts)) c.draw(now);
}

function record(probe) {
  const t = probe.generated_at;
  const live = new Set(probe.instances.map((p) => p.instance));
  const cluster = { drops: 0, closes: 0, conflated: 0, admitted: 0, merged: 0, recovered: 0, failed: 0, replayed: 0, gaps: 0 };
  const refusedBy = {};
  const http = { running: 0, waiting: 0, "503/s": 0 };
  const waits = {};
  const backlog = { unsaved: 0, "failed flushes": 0 };
  const ages = {};
  let anyRate = false;
  for (const p of probe.instances) {
    const entry = seen.get(p.instance) || {};
    const before = entry.probe;
    const fresh = !before || p.uptime_s !== before.uptime_s;
    const next = { ...entry, probe: p, at: t, gone: false };
    if (fresh && before) {
      const r = (read) => rate(p, before, read);
      next.frames = r((x) => x.frames_out);
      next.drops = r((x) => x.backpressure.drops);
      const cpu = r((x) => x.cpu_seconds);
      next.cpu = cpu === undefined ? undefined : cpu * 100; // a process without the field: no point
      next.channelRates = Object.fromEntries(Object.keys(p.channel_frames || {}).map(
        (name) => [name, r((x) => (x.channel_frames || {})[name] ?? NaN)]).filter(([, v]) => v !== undefined && !Number.isNaN(v)));
      cluster.drops += next.drops || 0;
      cluster.closes += r((x) => x.backpressure.closes) || 0;
      cluster.conflated += r((x) => x.backpressure.conflated || 0) || 0;
      cluster.admitted += r((x) => x.admission.admitted - x.admission.coalesced) || 0;
      cluster.merged += r((x) => x.admission.coalesced) || 0;
      for (const reason of Object.keys(p.admission.refused || {})) {
        refusedBy[`refused: ${reason}`] = (refusedBy[`refused: ${reason}`] || 0) + (r((x) => (x.admission.refused || {})[reason] || 0) || 0);
      }
      cluster.recovered += r((x) => (x.history.recoveries || {}).served || 0) || 0;
      cluster.failed += r((x) => (x.history.recoveries || {}).failed || 0) || 0;
      cluster.replayed += r((x) => x.history.replayed) || 0;
      cluster.gaps += r((x) => x.history.gaps) || 0;
      for (const name of Object.keys(p.http_pools || {})) {
        http["503/s"] += r((x) => sum(Object.values(((x.http_pools || {})[name] || { refused: {} }).refused))) || 0;
      }
      charts.frames.add(t, { [short(p.instance)]: next.frames });
      charts.cpu.add(t, { [short(p.instance)]: next.cpu });
      anyRate = true;
    }
    charts.queued.add(t, { [short(p.instance)]: (p.backpressure || {}).total_buffered_amount || 0 });
    charts.memory.add(t, { [short(p.instance)]: p.rss_bytes || 0 });
    for (const [name, pool] of Object.entries(p.http_pools || {})) {
      http.running += pool.running;
      http.waiting += pool.waiting;
      waits[`${name} p99`] = Math.max(waits[`${name} p99`] || 0, pool.wait_ms.p99);
    }
    for (const [name, store] of Object.entries(p.write_behind || {})) {
      backlog.unsaved += store.dirty;
      backlog["failed flushes"] += store.consecutive_failures;
      ages[`${name} oldest`] = Math.max(ages[`${name} oldest`] || 0, store.oldest_unsaved_s);
    }
    seen.set(p.instance, next);
  }
  for (const [instance, entry] of seen) {
    if (live.has(instance)) continue;
    entry.gone = true;
    if (t - entry.at > GONE_KEEP_MS) seen.delete(instance);
  }
  if (anyRate) {
    charts.drops.add(t, { drops: cluster.drops, conflated: cluster.conflated, "1013 closes": cluster.closes });
    charts.admission.add(t, { admitted: cluster.admitted, merged: cluster.merged, ...refusedBy });
    charts.resumes.add(t, { recovered: cluster.recovered, failed: cluster.failed, replayed: cluster.replayed, gaps: cluster.gaps });
  }
  charts.http.add(t, http);
  charts.httpWait.add(t, waits);
  charts.backlog.add(t, backlog);
  charts.backlogAge.add(t, ages);
  document.getElementById("rc-updated").textContent = `updated ${new Date(t).toLocaleTimeString()}`;
  renderAll();
}

const client = new RealtimeClient();
let closedWhy = "";  // the server's reason for the last close (e.g. "backplane unavailable"), until open
client.addEventListener("close", (e) => { closedWhy = e.detail.reason || ""; });
client.addEventListener("state", (e) => {
  if (e.detail === "open") closedWhy = "";
  document.getElementById("rc-state").textContent = closedWhy ? `${e.detail}: ${closedWhy}` : e.detail;
});
client.subscribe(root.dataset.channel, (params) => record(params.data));
client.connect();
// For the browser console and the tests: the client, the charts, what was seen, and the
// renderer of one probe of the health channel.
window.realtimeCluster = { client, charts, seen, record };
