// uPlot wrappers: LineChart (metrics over steps; optional stacking) and BarChart (values per category, e.g.
// acceptance per draft position). Each redraws from the MetricStore only when its data changed, and resizes with
// its container. A series with a single point is drawn as a point (a line needs two); `fraction` charts (values in
// [0, 1], from the metric catalogue) keep a 0-1 axis.
import uPlot from "uplot";
import { fmt, h } from "../dom";
import type { MetricStore } from "../job/store";

export const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
  "#9c755f", "#bab0ac"];

/** Tick spacings of a step axis: whole steps only. */
const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000];

export interface LineSpec { name: string; label?: string; color?: string; dash?: boolean; points?: boolean }

function chartBox(parent: HTMLElement, title: string, testid?: string): { box: HTMLElement; plot: HTMLElement } {
  const plot = h("div", { class: "plot" });
  const box = h("div", { class: "chart", "data-chart": testid ?? title }, h("div", { class: "chart-title" }, title), plot);
  parent.append(box);
  return { box, plot };
}

function observeWidth(el: HTMLElement, fn: (w: number) => void): ResizeObserver {
  const ro = new ResizeObserver(() => fn(Math.max(200, Math.floor(el.clientWidth))));
  ro.observe(el);
  return ro;
}

export class LineChart {
  readonly box: HTMLElement;
  private u: uPlot | null = null;
  private plot: HTMLElement;
  private seen = -1;
  private ro: ResizeObserver;
  private raw: (number | null)[][] = [];
  private empty: HTMLElement;

  constructor(
    parent: HTMLElement, title: string, private specs: LineSpec[],
    private opts: { height?: number; stacked?: boolean; yLabel?: string; testid?: string; minY?: number; fraction?: boolean } = {},
  ) {
    ({ box: this.box, plot: this.plot } = chartBox(parent, title, opts.testid));
    this.empty = h("div", { class: "muted small empty" }, "no data yet");
    this.plot.append(this.empty);
    this.ro = observeWidth(this.plot, (w) => this.u?.setSize({ width: w, height: opts.height ?? 180 }));
  }

  /** Replace the series list (e.g. positions discovered later); forces a rebuild. */
  setSpecs(specs: LineSpec[]): void {
    if (specs.map((s) => s.name).join() === this.specs.map((s) => s.name).join()) return;
    this.specs = specs;
    this.rebuild();
  }

  /** Axis label and 0-1 range from the metric catalogue, once it has loaded; forces a rebuild when they change. */
  setAxis(yLabel: string | undefined, fraction: boolean): void {
    if (yLabel === this.opts.yLabel && fraction === !!this.opts.fraction) return;
    this.opts = { ...this.opts, yLabel, fraction };
    this.rebuild();
  }

  names(): string[] { return this.specs.map((s) => s.name); }

  /** What the chart says while it has no data (default "no data yet"). */
  setEmptyText(text: string): void { this.empty.textContent = text; }

  private rebuild(): void {
    this.u?.destroy();
    this.u = null;
    this.seen = -1;
  }

  update(store: MetricStore): void {
    if (store.version === this.seen) return;
    this.seen = store.version;
    const present = this.specs.filter((s) => store.series.get(s.name)?.steps.length);
    if (!present.length) return;
    this.empty.remove();
    const data = align(store, this.specs);
    this.raw = data.slice(1) as (number | null)[][];
    let shown = data;
    if (this.opts.stacked) {
      const cum = this.raw.map((r) => r.slice());
      for (let i = 1; i < cum.length; i++) for (let j = 0; j < cum[i].length; j++) cum[i][j] = (cum[i][j] ?? 0) + (cum[i - 1][j] ?? 0);
      shown = [data[0], ...cum.reverse()]; // the largest sum first: each later (smaller) fill covers its part
    }
    if (!this.u) this.build(shown);
    else this.u.setData(shown as uPlot.AlignedData);
    const xs = data[0] as number[];
    this.box.dataset.points = String(xs.length); // what is drawn, for tests and for a quick look in devtools
    this.box.dataset.lastX = String(xs[xs.length - 1]);
  }

  private build(data: (number | null)[][]): void {
    const specs = this.opts.stacked ? [...this.specs].reverse() : this.specs;
    const n = this.specs.length;
    const series: uPlot.Series[] = [{ label: "step" }];
    specs.forEach((s, i) => {
      const color = s.color ?? PALETTE[(this.opts.stacked ? n - 1 - i : i) % PALETTE.length];
      const rawIdx = this.opts.stacked ? n - 1 - i : i;
      series.push({
        label: s.label ?? s.name, stroke: color, width: 1.5, spanGaps: true, dash: s.dash ? [4, 4] : undefined,
        fill: this.opts.stacked ? color : undefined,
        // a lone point (a one-step job, a metric written once) is invisible as a line: draw it as a point
        points: { show: (u, si) => (s.points ?? false) || onePoint(u.data[si] as ArrayLike<number | null | undefined>), size: 5 },
        value: (_u, _v, _si, idx) => (idx == null ? "–" : fmt(this.raw[rawIdx]?.[idx] ?? null)),
      });
    });
    const minY = this.opts.minY;
    const y: uPlot.Scale = this.opts.fraction ? { range: [0, 1] }
      : minY !== undefined ? { range: (_u, _lo, hi) => [minY, hi > minY ? hi : minY + 1] } : { range: (_u, lo, hi) => autoRange(lo, hi) };
    const o: uPlot.Options = {
      width: Math.max(200, this.plot.clientWidth), height: this.opts.height ?? 180, series,
      // one step: widen the x range around it (uPlot's auto range of a single value is empty)
      scales: { x: { time: false, range: (_u, lo, hi) => (lo === hi ? [lo - 1, hi + 1] : [lo, hi]) }, y },
      axes: [{ incrs: STEP_INCRS }, { label: this.opts.yLabel, size: 55, values: (_u, ticks) => ticks.map((t) => fmt(t)) }],
      legend: { live: true }, cursor: { drag: { x: true, y: false } },
    };
    this.u = new uPlot(o, data as uPlot.AlignedData, this.plot);
    this.box.dataset.yRange = this.opts.fraction ? "0-1" : "auto"; // for tests: which y axis was drawn
  }

  destroy(): void { this.ro.disconnect(); this.u?.destroy(); }
}

/** uPlot's padded range. Its rounding collapses a range narrower than about a millionth of its values to a single
value (a ratio of two nearly equal numbers, 1 +- 5e-7), and an empty range asks the axis for ticks 1e-16 apart,
forever: such a range is padded here instead. */
function autoRange(lo: number | null, hi: number | null): uPlot.Range.MinMax {
  if (lo === null || hi === null) return [0, 1];
  const [a, b] = uPlot.rangeNum(lo, hi, 0.1, true);
  if (a !== null && b !== null && b > a) return [a, b];
  const pad = Math.max((hi - lo) * 0.1, Math.abs(hi) * 1e-6, 1e-12);
  return [lo - pad, hi + pad];
}

function onePoint(ys: ArrayLike<number | null | undefined>): boolean {
  let n = 0;
  for (let i = 0; i < ys.length && n < 2; i++) if (ys[i] != null) n++;
  return n === 1;
}

/** [x = union of steps, one column per spec (null where that series has no point at the step)]. */
export function align(store: MetricStore, specs: LineSpec[]): (number | null)[][] {
  const ss = specs.map((s) => store.series.get(s.name));
  const first = ss.find((s) => s && s.steps.length);
  const same = first && ss.every((s) => !s || !s.steps.length || (s.steps.length === first.steps.length &&
    s.steps[0] === first.steps[0] && s.steps[s.steps.length - 1] === first.steps[first.steps.length - 1]));
  if (same && first) {
    return [first.steps.slice(), ...ss.map((s) => (s && s.steps.length ? s.values.slice() : first.steps.map(() => null)))];
  }
  const all = new Set<number>();
  for (const s of ss) if (s) for (const x of s.steps) all.add(x);
  const xs = [...all].sort((a, b) => a - b);
  const idx = new Map(xs.map((x, i) => [x, i]));
  const cols = ss.map((s) => {
    const col: (number | null)[] = new Array(xs.length).fill(null);
    if (s) s.steps.forEach((x, i) => { col[idx.get(x)!] = s.values[i]; });
    return col;
  });
  return [xs, ...cols];
}

export class BarChart {
  readonly box: HTMLElement;
  private u: uPlot | null = null;
  private plot: HTMLElement;
  private ro: ResizeObserver;
  private key = "";

  constructor(parent: HTMLElement, title: string, private opts: { height?: number; xLabel?: string; testid?: string; maxY?: number } = {}) {
    ({ box: this.box, plot: this.plot } = chartBox(parent, title, opts.testid));
    this.ro = observeWidth(this.plot, (w) => this.u?.setSize({ width: w, height: opts.height ?? 180 }));
  }

  set(xs: number[], ys: number[], label: string): void {
    const key = `${label}|${xs.join()}|${ys.join()}`;
    if (key === this.key) return;
    this.key = key;
    const data: uPlot.AlignedData = [xs, ys];
    if (this.u && this.u.series[1].label === label && this.u.data[0].length === xs.length) { this.u.setData(data); return; }
    this.u?.destroy();
    const bars = uPlot.paths.bars!({ size: [0.6, 60] });
    this.u = new uPlot({
      width: Math.max(200, this.plot.clientWidth), height: this.opts.height ?? 180,
      scales: { x: { time: false, range: (_u, lo, hi) => [lo - 0.5, hi + 0.5] },
        y: this.opts.maxY !== undefined ? { range: [0, this.opts.maxY] } : { range: (_u, _lo, hi) => [0, hi || 1] } },
      axes: [{ label: this.opts.xLabel, values: (_u, t) => t.map((v) => (Number.isInteger(v) ? String(v) : "")) },
        { size: 50, values: (_u, t) => t.map((v) => fmt(v)) }],
      series: [{ label: this.opts.xLabel ?? "x" }, { label, stroke: PALETTE[0], fill: PALETTE[0] + "99", paths: bars, points: { show: false } }],
    }, data, this.plot);
  }

  destroy(): void { this.ro.disconnect(); this.u?.destroy(); }
}
