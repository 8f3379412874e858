// The chart panels of the job page, built once and updated from the MetricStore: long tail, GPU time and harvest,
// speculative decoding, reward/validation, step time (stacked) and throughput, and every other metric.
import type { Histogram } from "../api";
import { BarChart, LineChart, type LineSpec } from "../charts/line";
import { LengthHeatmap, StepHistogram } from "../charts/heatmap";
import { GpuTimeline } from "../charts/timeline";
import { fmt, h } from "../dom";
import type { MetricStore } from "./store";

const POS_RE = /^sd\/accept_rate_pos_?(\d+)$/;
const TIMING = ["timing_s/gen", "timing_s/reward", "timing_s/update", "timing_s/sync", "timing_s/drafter", "timing_s/val"];

function section(parent: HTMLElement, title: string, testid: string, ...extra: HTMLElement[]): HTMLElement {
  const grid = h("div", { class: "grid" });
  parent.append(h("section", { class: "panel", "data-panel": testid }, h("h2", {}, title, ...extra), grid));
  return grid;
}

function stat(label: string, testid: string): { el: HTMLElement; set(v: string): void } {
  const val = h("b", { "data-testid": testid }, "–");
  return { el: h("span", { class: "stat" }, `${label} `, val), set: (v) => { val.textContent = v; } };
}

export class Panels {
  private lines: LineChart[] = [];
  private claimed = new Set<string>();
  private stepHist: StepHistogram;
  private heat: LengthHeatmap;
  private timeline: GpuTimeline;
  private posBars: BarChart;
  private posLines: LineChart;
  private arms: LineChart;
  private tail: LineChart;
  private val: LineChart;
  private otherGrid: HTMLElement;
  private others = new Map<string, LineChart>();
  private harvest = stat("harvest ratio", "harvest-ratio");
  private sdOn = stat("SD on", "sd-on-fraction");
  private tailGain = stat("tail speed-up", "tail-speedup");

  constructor(root: HTMLElement, ngpu: number) {
    const tail = section(root, "Response length — the long tail", "long-tail");
    this.stepHist = new StepHistogram(tail);
    this.heat = new LengthHeatmap(tail);
    this.line(tail, "Response length p50 / p90 / max / mean", [
      { name: "response_length/p50" }, { name: "response_length/p90" }, { name: "response_length/max", color: "#e15759" },
      { name: "response_length/mean", dash: true }], { testid: "length-lines", yLabel: "tokens" });

    const gpu = section(root, "GPU time and idle-time harvesting", "gpu", this.harvest.el);
    this.timeline = new GpuTimeline(gpu, ngpu);
    this.line(gpu, "Idle GPU-seconds available vs used by drafter training", [
      { name: "harvest/idle_gpu_s", label: "idle available" }, { name: "harvest/used_gpu_s", label: "used" }], { testid: "harvest-lines" });
    this.line(gpu, "Harvest ratio", [{ name: "harvest/ratio" }], { testid: "harvest-ratio-line", minY: 0 });

    const sd = section(root, "Speculative decoding", "sd", this.sdOn.el, this.tailGain.el);
    this.line(sd, "Accept length (tokens per verify)", [{ name: "sd/accept_len" }], { testid: "sd-accept-len" });
    this.posBars = new BarChart(sd, "Acceptance per draft position (latest step)", { xLabel: "position", testid: "sd-pos-bars", maxY: 1 });
    this.posLines = this.line(sd, "Acceptance per position over steps", [], { testid: "sd-pos-lines" });
    this.line(sd, "SD-on fraction of decode steps", [{ name: "sd/on_fraction" }], { testid: "sd-on-fraction-line", minY: 0 });
    this.arms = this.line(sd, "Arm choices", [], { testid: "sd-arms" });
    this.tail = this.line(sd, "Tail tokens/s with vs without SD", [], { testid: "sd-tail", yLabel: "tok/s" });
    this.line(sd, "Drafter loss / accuracy", [{ name: "drafter/loss" }, { name: "drafter/acc" }], { testid: "drafter" });

    const rl = section(root, "Reward and validation", "reward");
    this.line(rl, "Reward mean / std", [{ name: "reward/mean" }, { name: "reward/std", dash: true }], { testid: "reward" });
    this.val = this.line(rl, "Validation", [], { testid: "validation" });
    this.line(rl, "Fraction of groups with zero reward std", [{ name: "frac_reward_zero_std" }], { testid: "zero-std" });

    const time = section(root, "Step time and throughput", "time");
    this.line(time, "Step time breakdown (stacked, s)", TIMING.map((name) => ({ name, label: name.slice(9) })),
      { stacked: true, testid: "step-time", yLabel: "s" });
    this.line(time, "Step time (s)", [{ name: "timing_s/step" }], { testid: "step-time-total", minY: 0 });
    this.line(time, "Tokens per second", [{ name: "perf/tokens_per_s" }], { testid: "tokens-per-s", minY: 0 });

    this.otherGrid = h("div", { class: "grid" });
    root.append(h("section", { class: "panel", "data-panel": "other" },
      h("details", {}, h("summary", {}, h("h2", {}, "All other metrics")), this.otherGrid)));
  }

  private line(parent: HTMLElement, title: string, specs: LineSpec[], opts: ConstructorParameters<typeof LineChart>[3]): LineChart {
    const c = new LineChart(parent, title, specs, opts);
    specs.forEach((s) => this.claimed.add(s.name));
    this.lines.push(c);
    return c;
  }

  private dynamic(chart: LineChart, names: string[], points = false): void {
    names.forEach((n) => this.claimed.add(n));
    chart.setSpecs(names.map((name) => ({ name, label: name.replace(/^(sd|val)\//, ""), points })));
  }

  update(store: MetricStore): void {
    const names = store.names();
    const pos = names.filter((n) => POS_RE.test(n)).sort((a, b) => Number(a.match(POS_RE)![1]) - Number(b.match(POS_RE)![1]));
    this.dynamic(this.posLines, pos);
    this.dynamic(this.arms, names.filter((n) => n === "sd/arm" || n.startsWith("sd/arm/") || n.startsWith("sd/arm_")), true);
    this.dynamic(this.tail, names.filter((n) => n.includes("tail_tokens_per_s")));
    this.dynamic(this.val, names.filter((n) => n.startsWith("val/") && !n.startsWith("val/response_length")));
    if (pos.length) {
      const step = Math.max(...pos.map((n) => store.latestStep(n) ?? -1));
      const ys = pos.map((n) => store.at(n, step) ?? 0);
      this.posBars.set(pos.map((n) => Number(n.match(POS_RE)![1])), ys, `step ${step}`);
    }
    const ratio = store.latest("harvest/ratio");
    this.harvest.set(ratio === null ? "–" : `${fmt(ratio * 100, 3)} %`);
    const on = store.latest("sd/on_fraction");
    this.sdOn.set(on === null ? "–" : `${fmt(on * 100, 3)} %`);
    const tailNames = names.filter((n) => n.includes("tail_tokens_per_s"));
    const withSd = tailNames.find((n) => !/no_?sd|without|base/.test(n));
    const noSd = tailNames.find((n) => /no_?sd|without|base/.test(n));
    const a = withSd ? store.latest(withSd) : null, b = noSd ? store.latest(noSd) : null;
    this.tailGain.set(a !== null && b ? `${fmt(a / b, 3)}×` : "–");

    for (const n of names) {
      if (this.claimed.has(n) || n.startsWith("response_length/") || this.others.has(n)) continue;
      this.others.set(n, new LineChart(this.otherGrid, n, [{ name: n }], { height: 120, testid: `other:${n}` }));
    }
    this.lines.forEach((c) => c.update(store));
    this.others.forEach((c) => c.update(store));
    this.timeline.update(store);
  }

  /** Histograms sorted by step (a window of recent steps). */
  updateHistograms(hists: Histogram[], store: MetricStore): void {
    const last = hists.length ? hists[hists.length - 1] : null;
    const m = (k: string) => (last ? store.at(`response_length/${k}`, last.step) : null);
    this.stepHist.set(last, { p50: m("p50"), p90: m("p90"), max: m("max") });
    const lines: Record<string, Map<number, number>> = {};
    for (const k of ["p50", "p90", "max"]) {
      const mp = new Map<number, number>();
      for (const hh of hists) { const v = store.at(`response_length/${k}`, hh.step); if (v !== null) mp.set(hh.step, v); }
      lines[k] = mp;
    }
    this.heat.set(hists, lines);
  }

  destroy(): void {
    this.lines.forEach((c) => c.destroy());
    this.others.forEach((c) => c.destroy());
    [this.stepHist, this.heat, this.timeline, this.posBars].forEach((c) => c.destroy());
  }
}
