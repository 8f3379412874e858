// The long tail at a glance, on canvas: StepHistogram draws one step's response-length histogram with p50/p90/max
// markers; LengthHeatmap draws the histograms of many steps as columns (colour = share of the step's responses in
// that length bin, sqrt-scaled so a thin tail still shows) with the p50/p90/max lines over it.
import type { Histogram } from "../api";
import { fmt, h } from "../dom";

const VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725"];
const MARKS: [string, string][] = [["p50", "#ffffff"], ["p90", "#ff9da7"], ["max", "#e15759"]];

function colour(t: number): string {
  const x = Math.max(0, Math.min(1, t)) * (VIRIDIS.length - 1);
  return VIRIDIS[Math.round(x)];
}

/** Size a canvas for the device pixel ratio and return its 2-D context in CSS pixels. */
export function setupCanvas(c: HTMLCanvasElement, width: number, height: number): CanvasRenderingContext2D {
  const dpr = window.devicePixelRatio || 1;
  c.width = Math.floor(width * dpr);
  c.height = Math.floor(height * dpr);
  c.style.width = `${width}px`;
  c.style.height = `${height}px`;
  const ctx = c.getContext("2d")!;
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.font = "11px system-ui, sans-serif";
  return ctx;
}

abstract class CanvasChart {
  readonly box: HTMLElement;
  protected canvas = h("canvas");
  protected ro: ResizeObserver;
  protected width = 300;

  constructor(parent: HTMLElement, title: string, testid: string, protected height: number) {
    this.box = h("div", { class: "chart", "data-chart": testid }, h("div", { class: "chart-title" }, title), this.canvas);
    parent.append(this.box);
    this.ro = new ResizeObserver(() => { this.width = Math.max(200, this.box.clientWidth - 2); this.draw(); });
    this.ro.observe(this.box);
  }

  abstract draw(): void;
  destroy(): void { this.ro.disconnect(); }
}

export interface Marks { p50: number | null; p90: number | null; max: number | null }

export class StepHistogram extends CanvasChart {
  private hist: Histogram | null = null;
  private marks: Marks = { p50: null, p90: null, max: null };

  constructor(parent: HTMLElement) { super(parent, "Response length — current step", "length-histogram", 180); }

  set(hist: Histogram | null, marks: Marks): void {
    this.hist = hist;
    this.marks = marks;
    this.box.dataset.step = hist ? String(hist.step) : "";
    this.draw();
  }

  draw(): void {
    const ctx = setupCanvas(this.canvas, this.width, this.height);
    const L = 40, R = 8, T = 16, B = 22, w = this.width - L - R, ht = this.height - T - B;
    ctx.fillStyle = "#888";
    if (!this.hist) { ctx.fillText("no histogram yet", L, T + 20); return; }
    const { edges, counts, step } = this.hist;
    const x0 = edges[0], x1 = edges[edges.length - 1] || 1, cmax = Math.max(1, ...counts);
    const X = (v: number) => L + ((v - x0) / (x1 - x0 || 1)) * w;
    ctx.fillStyle = "#4e79a7";
    counts.forEach((c, i) => {
      const a = X(edges[i]), b = X(edges[i + 1]), y = (c / cmax) * ht;
      ctx.fillRect(a + 0.5, T + ht - y, Math.max(1, b - a - 1), y);
    });
    ctx.fillStyle = "#666";
    ctx.fillText(`step ${step} · ${counts.reduce((a, b) => a + b, 0)} responses`, L, 11);
    ctx.fillText(String(x0), L, this.height - 6);
    const end = `${fmt(x1)} tokens`;
    ctx.fillText(end, this.width - R - ctx.measureText(end).width, this.height - 6);
    ctx.fillText(String(cmax), 4, T + 8);
    let right = 0;
    for (const [k, col] of MARKS) {
      const v = this.marks[k as keyof Marks];
      if (v == null) continue;
      ctx.strokeStyle = col === "#ffffff" ? "#333" : col;
      ctx.setLineDash([4, 3]);
      ctx.beginPath(); ctx.moveTo(X(v), T); ctx.lineTo(X(v), T + ht); ctx.stroke();
      ctx.setLineDash([]);
      ctx.fillStyle = ctx.strokeStyle;
      // right of its line, or left of it where the text would pass the canvas's right edge
      const text = `${k} ${fmt(v)}`, tw = ctx.measureText(text).width;
      const x = X(v) + 3 + tw <= this.width - 2 ? X(v) + 3 : Math.max(L, X(v) - 3 - tw);
      ctx.fillText(text, x, T + 10 + 12 * MARKS.findIndex((m) => m[0] === k));
      right = Math.max(right, x + tw);
    }
    this.box.dataset.labelsRight = String(Math.ceil(right)); // the browser test checks no label passes the edge
    this.box.dataset.width = String(this.width);
  }
}

export class LengthHeatmap extends CanvasChart {
  private hists: Histogram[] = [];
  private lines: Record<string, Map<number, number>> = {};

  constructor(parent: HTMLElement) {
    super(parent, "Response length over steps (heat-map: share of the step's responses per length bin) with p50 / p90 / max", "length-heatmap", 240);
    this.box.classList.add("wide");
    this.canvas.addEventListener("mousemove", (e) => this.hover(e));
  }

  /** hists sorted by step; lines: p50/p90/max values per step. */
  set(hists: Histogram[], lines: Record<string, Map<number, number>>): void {
    this.hists = hists;
    this.lines = lines;
    this.box.dataset.steps = String(hists.length);
    this.box.dataset.lastStep = hists.length ? String(hists[hists.length - 1].step) : "";
    this.draw();
  }


  draw(): void {
    const ctx = setupCanvas(this.canvas, this.width, this.height);
    const L = 40, T = 8, w = this.width - L - 8, ht = this.height - T - 22;
    if (!this.hists.length) { ctx.fillStyle = "#888"; ctx.fillText("no histograms yet", L, T + 20); return; }
    const ymax = Math.max(...this.hists.map((hh) => hh.edges[hh.edges.length - 1])) || 1;
    const n = this.hists.length, cw = w / n, rows = 64;
    const Y = (v: number) => T + ht - (v / ymax) * ht;
    ctx.fillStyle = VIRIDIS[0];
    ctx.fillRect(L, T, w, ht);
    const grids = this.hists.map((hh) => {
      const total = hh.counts.reduce((a, b) => a + b, 0) || 1;
      const grid = new Float64Array(rows);
      hh.counts.forEach((c, j) => {
        const mid = (hh.edges[j] + hh.edges[j + 1]) / 2;
        grid[Math.min(rows - 1, Math.floor((mid / ymax) * rows))] += c / total;
      });
      return grid;
    });
    const top = Math.max(1e-9, ...grids.map((g) => Math.max(...g)));
    grids.forEach((grid, i) => {
      for (let r = 0; r < rows; r++) {
        if (!grid[r]) continue;
        ctx.fillStyle = colour(0.15 + 0.85 * Math.sqrt(grid[r] / top)); // sqrt: a thin tail still shows
        const y0 = T + ht - ((r + 1) / rows) * ht;
        ctx.fillRect(L + i * cw, y0, Math.ceil(cw), Math.ceil(ht / rows));
      }
    });
    for (const [k, col] of MARKS) {
      const m = this.lines[k];
      if (!m) continue;
      ctx.strokeStyle = col;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let started = false;
      this.hists.forEach((hh, i) => {
        const v = m.get(hh.step);
        if (v == null) return;
        const x = L + (i + 0.5) * cw;
        if (started) ctx.lineTo(x, Y(v)); else { ctx.moveTo(x, Y(v)); started = true; }
      });
      ctx.stroke();
    }
    ctx.fillStyle = "#666";
    ctx.fillText(`step ${this.hists[0].step}`, L, this.height - 6);
    const last = `step ${this.hists[n - 1].step}`;
    ctx.fillText(last, L + w - ctx.measureText(last).width, this.height - 6);
    ctx.fillText(fmt(ymax), 2, T + 8);
    ctx.fillText("0", 2, T + ht);
    MARKS.forEach(([k, col], i) => { ctx.fillStyle = col === "#ffffff" ? "#333" : col; ctx.fillText(k, L + w / 2 - 60 + i * 40, this.height - 6); });
  }

  private hover(e: MouseEvent): void {
    if (!this.hists.length) return;
    const r = this.canvas.getBoundingClientRect();
    const L = 40, w = this.width - L - 8;
    const i = Math.floor(((e.clientX - r.left - L) / w) * this.hists.length);
    const hh = this.hists[i];
    if (!hh) return;
    const parts = MARKS.map(([k]) => `${k} ${fmt(this.lines[k]?.get(hh.step) ?? null)}`);
    this.canvas.title = `step ${hh.step}: ${hh.counts.reduce((a, b) => a + b, 0)} responses, ${parts.join(", ")}`;
  }
}
