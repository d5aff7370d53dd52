// Small SVG time charts for the admin's Realtime cluster screen: no build step, no library.
// Each chart keeps the last WINDOW_MS of points client-side (the health channel streams
// them) and keeps a readable scale: the top follows what is usual in the window, not one
// spike, which is drawn clipped at the top and marked.

const NS = "http://www.w3.org/2000/svg";
export const WINDOW_MS = 5 * 60 * 1000;
export const COLORS = ["#417690", "#c0392b", "#27ae60", "#8e44ad", "#d35400", "#2c3e50", "#16a085", "#7f8c8d"];
const W = 600;
const H = 140;

/** A round 1-2-5 value at or above `v`. */
export function niceCeil(v) {
  if (!(v > 0)) return 1;
  const step = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => m * step).find((c) => c >= v * (1 - 1e-9));
}

/** The top of a scale: the 90th percentile of `values` plus a quarter, rounded up, at least `floor`. */
export function scaleTop(values, floor = 1) {
  const sorted = values.filter((v) => Number.isFinite(v)).sort((a, b) => a - b);
  const usual = sorted.length ? sorted[Math.floor(0.9 * (sorted.length - 1))] : 0;
  return niceCeil(Math.max(floor, usual * 1.25));
}

export function formatBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return i ? `${n.toFixed(1)} ${units[i]}` : `${Math.round(n)} B`;
}

export function formatNumber(n) {
  if (n >= 1e6) return `${(n / 1e6).toFixed(1)} M`;
  if (n >= 1e4) return `${(n / 1e3).toFixed(1)} k`;
  return Number.isInteger(n) ? String(n) : n.toFixed(n < 10 ? 2 : 1);
}

/**
 * One chart in a `<figure data-chart="name">` holding an `<svg>` and a legend.
 * `add(t, {series: value})` records a point per series; `draw(now)` redraws. `stacked`:
 * series are drawn as stacked areas (parts of one total), else as lines.
 */
export class TimeChart {
  constructor(figure, { unit, format = formatNumber, floor = 1, stacked = false }) {
    this.figure = figure;
    this.svg = figure.querySelector("svg");
    this.legend = figure.querySelector(".legend");
    this.unit = unit;
    this.format = format;
    this.floor = floor;
    this.stacked = stacked;
    this.series = new Map(); // name -> [[t, v], ...]
    this.colors = new Map(); // name -> color, stable while the series lives
    this.draws = 0;
  }

  add(t, values) {
    for (const [name, value] of Object.entries(values)) {
      if (!Number.isFinite(value)) continue;
      if (!this.series.has(name)) {
        this.series.set(name, []);
        const used = new Set(this.colors.values());
        this.colors.set(name, COLORS.find((c) => !used.has(c)) || COLORS[this.colors.size % COLORS.length]);
      }
      this.series.get(name).push([t, value]);
    }
  }

  forget(name) { this.series.delete(name); this.colors.delete(name); }

  _trim(now) {
    for (const [name, points] of this.series) {
      const kept = points.filter(([t]) => t > now - WINDOW_MS);
      if (kept.length) this.series.set(name, kept); else this.forget(name);
    }
  }

  _x(t, now) { return (W * (1 - (now - t) / this.span)).toFixed(1); }

  draw(now) {
    this._trim(now);
    const names = [...this.series.keys()].sort();
    // The x axis spans what was seen (at least a minute), up to WINDOW_MS: a page just
    // opened fills its charts instead of drawing at their right edge only.
    const earliest = Math.min(now, ...names.map((name) => this.series.get(name)[0][0]));
    this.span = Math.max(60 * 1000, Math.min(WINDOW_MS, now - earliest));
    let values;
    if (this.stacked) { // the totals at each instant
      const totals = new Map();
      for (const name of names) for (const [t, v] of this.series.get(name)) totals.set(t, (totals.get(t) || 0) + v);
      values = [...totals.values()];
    } else {
      values = names.flatMap((name) => this.series.get(name).map(([, v]) => v));
    }
    const top = scaleTop(values, this.floor);
    const y = (v) => (H - 2 - (H - 4) * Math.min(v, top) / top).toFixed(1);
    this.svg.replaceChildren();
    for (const frac of [0.5, 1]) { // gridlines: half and full scale
      const line = document.createElementNS(NS, "line");
      Object.entries({ x1: 0, x2: W, y1: y(top * frac), y2: y(top * frac), class: "grid" }).forEach(([k, v]) => line.setAttribute(k, v));
      this.svg.append(line);
    }
    const base = new Map(); // t -> the stack's height so far
    for (const name of names) {
      const points = this.series.get(name);
      const color = this.colors.get(name);
      let shape;
      if (this.stacked) {
        const upper = points.map(([t, v]) => [t, (base.get(t) || 0) + v]);
        const lower = points.map(([t]) => [t, base.get(t) || 0]).reverse();
        for (const [t, v] of upper) base.set(t, v);
        shape = document.createElementNS(NS, "polygon");
        shape.setAttribute("points", [...upper, ...lower].map(([t, v]) => `${this._x(t, now)},${y(v)}`).join(" "));
        shape.setAttribute("fill", color);
        shape.setAttribute("fill-opacity", "0.55");
        shape.setAttribute("stroke", color);
      } else {
        shape = document.createElementNS(NS, "polyline");
        shape.setAttribute("points", points.map(([t, v]) => `${this._x(t, now)},${y(v)}`).join(" "));
        shape.setAttribute("fill", "none");
        shape.setAttribute("stroke", color);
        shape.setAttribute("stroke-width", "2");
        for (const [t, v] of points) { // a spike past the scale: clipped, and marked
          if (v <= top) continue;
          const mark = document.createElementNS(NS, "polygon");
          const x = Number(this._x(t, now));
          mark.setAttribute("points", `${x - 4},8 ${x + 4},8 ${x},1`);
          mark.setAttribute("fill", color);
          mark.setAttribute("class", "clipped");
          this.svg.append(mark);
        }
      }
      shape.dataset.series = name;
      this.svg.append(shape);
    }
    this.legend.replaceChildren();
    for (const name of names) {
      const points = this.series.get(name);
      const key = document.createElement("span");
      key.style.color = this.colors.get(name);
      key.textContent = `■ ${name} ${this.format(points[points.length - 1][1])}`;
      this.legend.append(key);
    }
    const scale = document.createElement("span");
    scale.className = "scale";
    scale.textContent = `scale ${this.format(top)} ${this.unit}`.trim();
    this.legend.append(scale);
    this.draws += 1;
    this.figure.dataset.points = String(names.reduce((n, name) => n + this.series.get(name).length, 0));
  }
}
