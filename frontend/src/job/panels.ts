// The chart panels of the job page, built once and updated from the MetricStore: long tail, device time and harvest
// (named after the job's device: GPU or CPU),
// speculative decoding, reward/validation, step time (stacked) and throughput, and every other metric. Every panel
// reads names the worker writes (worker/tlt/metric_catalog.py); units, 0-1 axes and "cumulative" come from the
// catalogue (GET /metrics/catalog). What the headline figures are: frontend/README.md.
import type { Histogram } from "../api";
import { BarChart, LineChart, type LineSpec } from "../charts/line";
import { LengthHeatmap, StepHistogram } from "../charts/heatmap";
import { GpuTimeline, PHASES } from "../charts/timeline";
import { fmt, h } from "../dom";
import type { MetricCatalog } from "./catalog";
import { MetricStore } from "./store";

const POS_RE = /^sd\/accept_rate_pos_(\d+)$/;
const ARM_PREFIX = "sd/arm/";
const TAIL_SD = "perf/seq_tokens_per_s_tail_sd";
const TAIL_PLAIN = "perf/seq_tokens_per_s_tail_plain";
// step-time parts, coloured as the GPU timeline colours the same phase
const TIMING: LineSpec[] = [
  { name: "timing_s/gen", label: "gen", color: PHASES.rollout },
  { name: "timing_s/reward", label: "reward", color: PHASES.reward },
  { name: "timing_s/update", label: "update", color: PHASES.update },
  { name: "timing_s/sync", label: "sync", color: PHASES.sync },
  { name: "timing_s/drafter", label: "drafter", color: PHASES["drafter training"] },
  { name: "timing_s/val", label: "val", color: "#9c755f" },
];

function section(parent: HTMLElement, title: string, testid: string, ...extra: HTMLElement[]): HTMLElement {
  const grid = h("div", { class: "grid" });
  parent.append(h("section", { class: "panel", "data-panel": testid }, h("h2", {}, title, ...extra), grid));
  return grid;
}

function stat(label: string, testid: string, title: string): { el: HTMLElement; set(v: string, label?: string): void } {
  const val = h("b", { "data-testid": testid }, "–");
  const name = document.createTextNode(`${label} `);
  return { el: h("span", { class: "stat", title }, name, val), set: (v, l) => {
    val.textContent = v;
    if (l) name.textContent = `${l} `;
  } };
}

/** Per step, each arm's share of the switch-on decode steps (sd/arm/<name> counts / their sum at that step), loaded
into `out`. */
export function armShares(store: MetricStore, arms: string[], out: MetricStore): void {
  const steps = new Set<number>();
  arms.forEach((n) => store.series.get(n)?.steps.forEach((s) => steps.add(s)));
  const rows = [...steps].sort((a, b) => a - b).map((step) => {
    const counts = arms.map((n) => store.at(n, step) ?? 0);
    const total = counts.reduce((a, b) => a + b, 0);
    return { step, shares: counts.map((c) => (total > 0 ? c / total : 0)) };
  });
  out.loadHistory(arms.map((n, i) => ({ name: n, points: rows.map((r) => ({ step: r.step, value: r.shares[i] })) })));
}

/** The mean of a series over every step it has, and its step range (a whole-run figure, not the last step's). */
function runMean(store: MetricStore, name: string): { mean: number; first: number; last: number } | null {
  const s = store.series.get(name);
  if (!s || !s.steps.length) return null;
  const vals = s.steps.map((st) => store.at(name, st)).filter((v): v is number => v !== null);
  if (!vals.length) return null;
  return { mean: vals.reduce((a, b) => a + b, 0) / vals.length, first: s.steps[0], last: s.steps[s.steps.length - 1] };
}

/** Why the cost switch (rollout.sd_switch: step_costs) left SD on or off, from its latest per-bucket figures:
sd/pays/<bucket>, sd/gain/<bucket>, sd/step_s_plain/<bucket>, sd/step_s_sd/<bucket>. Null for a job without it. */
export function costSwitchText(store: MetricStore): string | null {
  const buckets = store.names().filter((n) => n.startsWith("sd/step_s_plain/")).map((n) => n.slice("sd/step_s_plain/".length));
  if (!buckets.length) return null;
  const judged = buckets.filter((b) => store.latest(`sd/pays/${b}`) !== null);
  if (!judged.length) return "SD switch by measured step costs: no batch size judged yet (SD off until its costs are measured)";
  const parts = judged.map((b) => {
    const on = store.latest(`sd/pays/${b}`)! > 0.5, gain = store.latest(`sd/gain/${b}`);
    const plain = store.latest(`sd/step_s_plain/${b}`), sd = store.latest(`sd/step_s_sd/${b}`);
    const cost = plain && sd ? `, an SD step ${fmt(sd / plain, 2)}× a plain step's time` : "";
    return `${b} active: ${on ? "on" : "off"} (SD ${gain !== null ? fmt(gain, 2) : "?"}× plain tokens/s per sequence${cost})`;
  });
  const anyOn = judged.some((b) => store.latest(`sd/pays/${b}`)! > 0.5);
  return `SD switch by measured step costs: ${anyOn ? "on where it pays" : "off, SD would slow the rollout"} — ${parts.join("; ")}`;
}

/** The newest step at which every name has a value, and those values. */
function latestCommon(store: MetricStore, names: string[]): { step: number; values: number[] } | null {
  const first = store.series.get(names[0]);
  if (!first) return null;
  for (let i = first.steps.length - 1; i >= 0; i--) {
    const step = first.steps[i];
    const values = names.map((n) => store.at(n, step));
    if (values.every((v) => v !== null)) return { step, values: values as number[] };
  }
  return null;
}

export class Panels {
  private lines: LineChart[] = [];
  private claimed = new Set<string>();
  private catalog: MetricCatalog | null = null;
  private stepHist: StepHistogram;
  private heat: LengthHeatmap;
  private timeline: GpuTimeline;
  private posBars: BarChart;
  private posLines: LineChart;
  private arms: LineChart;
  private shares = new MetricStore(); // the arm shares drawn by `arms`, derived from the counts
  private sharesOf = -1; // the store version they were derived from
  private val: LineChart;
  private otherGrid: HTMLElement;
  private others = new Map<string, LineChart>();
  private harvest: ReturnType<typeof stat>;
  private sdRan = stat("SD ran (whole run)", "sd-on-fraction",
    "decode steps that drafted and verified / all decode steps, the mean over the job's steps (the latest step's in brackets)");
  private sdWhy = h("p", { class: "muted small", "data-testid": "sd-decision" });
  private tailGain = stat("tail speed-up", "tail-speedup",
    "one sequence's tail tokens/s with SD / without SD, at the latest step whose tail ran both");

  /** ngpu: the job's GPUs (0: a CPU job, whose time and idle time are CPU-seconds); validation: whether the job
  validates (eval_steps and a validation split), else its chart says how to turn it on. */
  constructor(root: HTMLElement, ngpu: number, validation = true) {
    const dev = ngpu > 0 ? "GPU" : "CPU";
    this.harvest = stat("harvest ratio (job)", "harvest-ratio", `idle ${dev} time used by drafter training / idle time ` +
      "offered: since the job started, or at the latest step for a job without the cumulative harvest counters");
    const tail = section(root, "Response length — the long tail", "long-tail");
    this.stepHist = new StepHistogram(tail);
    this.heat = new LengthHeatmap(tail);
    this.line(tail, "Response length p50 / p90 / max / mean", [
      { name: "response_length/p50" }, { name: "response_length/p90" }, { name: "response_length/max", color: "#e15759" },
      { name: "response_length/mean", dash: true }], { testid: "length-lines", yLabel: "tokens" });

    const gpu = section(root, `${dev} time and idle-time harvesting`, "gpu", this.harvest.el);
    this.timeline = new GpuTimeline(gpu, ngpu);
    this.line(gpu, `Idle ${dev} time per step (${dev}-s): offered vs used by drafter training`, [
      { name: "harvest/idle_gpu_s", label: `idle offered (${dev}-s)` }, { name: "harvest/used_gpu_s", label: `used (${dev}-s)` }],
    { testid: "harvest-lines", minY: 0, yLabel: `${dev}-s` });
    this.line(gpu, "Harvest ratio per step", [{ name: "harvest/ratio" }], { testid: "harvest-ratio-line", minY: 0 });

    const sd = section(root, "Speculative decoding", "sd", this.sdRan.el, this.tailGain.el);
    sd.before(this.sdWhy);
    this.line(sd, "Accept length (tokens per verify)", [{ name: "sd/accept_len" }], { testid: "sd-accept-len" });
    this.posBars = new BarChart(sd, "Acceptance per draft position (latest step)", { xLabel: "position", testid: "sd-pos-bars", maxY: 1 });
    this.posLines = this.line(sd, "Acceptance per position over steps", [], { testid: "sd-pos-lines" });
    this.line(sd, "Decode steps: SD switch on vs SD ran", [
      { name: "sd/on_fraction", label: "switch on" }, { name: "sd/spec_step_fraction", label: "drafted + verified" }],
    { testid: "sd-on-fraction-line", minY: 0 });
    this.arms = new LineChart(sd, "Arm shares of switch-on decode steps", [], { testid: "sd-arms", fraction: true });
    this.line(sd, "Tail speed of one sequence, with vs without SD", [
      { name: TAIL_SD, label: "with SD", points: true }, { name: TAIL_PLAIN, label: "without SD", points: true }],
    { testid: "sd-tail", minY: 0 });
    this.line(sd, "Drafter loss", [{ name: "drafter/loss" }], { testid: "drafter" });
    this.line(sd, "Drafter top-1 accuracy", [{ name: "drafter/acc" }], { testid: "drafter-acc" });

    const rl = section(root, "Reward and validation", "reward");
    this.line(rl, "Reward mean / std", [{ name: "reward/mean" }, { name: "reward/std", dash: true }], { testid: "reward" });
    this.val = this.line(rl, "Validation", [], { testid: "validation" });
    if (!validation) {
      this.val.setEmptyText("Validation is off for this job: set eval_steps (validate every N steps) and " +
        "dataset.validation_size (held-out rows) in the spec to turn it on.");
    }
    this.line(rl, "Fraction of groups with zero reward std", [{ name: "frac_reward_zero_std" }], { testid: "zero-std" });

    const time = section(root, "Step time and throughput", "time");
    this.line(time, "Step time breakdown (stacked, s)", TIMING, { stacked: true, testid: "step-time", yLabel: "s" });
    this.line(time, "Step time (s)", [{ name: "timing_s/step" }], { testid: "step-time-total", minY: 0 });
    this.line(time, "Tokens per second: whole rollout, full batch, tail", [{ name: "perf/tokens_per_s", label: "rollout" },
      { name: "perf/tokens_per_s_full", label: "full batch" }, { name: "perf/tokens_per_s_tail", label: "tail" }],
    { testid: "tokens-per-s", minY: 0 });

    this.otherGrid = h("div", { class: "grid" });
    root.append(h("section", { class: "panel", "data-panel": "other" },
      h("details", {}, h("summary", { "data-testid": "other-metrics" }, h("h2", {}, "All other metrics")), this.otherGrid)));
  }

  /** Units and 0-1 axes from the metric catalogue; charts already drawn are rebuilt with them. */
  setCatalog(catalog: MetricCatalog): void {
    this.catalog = catalog;
    [...this.lines, ...this.others.values()].forEach((c) => this.axis(c));
  }

  private axis(c: LineChart): void {
    const names = c.names();
    if (!this.catalog || !names.length) return;
    const units = new Set(names.map((n) => this.catalog!.unit(n)));
    const unit = units.size === 1 ? [...units][0] : null;
    c.setAxis(unit && unit !== "fraction" ? unit : undefined, this.catalog.fractions(names));
  }

  private line(parent: HTMLElement, title: string, specs: LineSpec[], opts: ConstructorParameters<typeof LineChart>[3]): LineChart {
    const c = new LineChart(parent, title, specs, opts);
    specs.forEach((s) => this.claimed.add(s.name));
    this.lines.push(c);
    return c;
  }

  private dynamic(chart: LineChart, names: string[], points = false, catalogAxis = true): void {
    names.forEach((n) => this.claimed.add(n));
    chart.setSpecs(names.map((name) => ({ name, label: name.replace(/^(sd\/arm|sd|val)\//, ""), points })));
    if (catalogAxis) this.axis(chart);
  }

  private other(name: string): LineChart {
    const info = this.catalog?.info(name);
    const title = info?.kind === "cumulative" ? `${name} (cumulative)` : name;
    const c = new LineChart(this.otherGrid, title, [{ name }], { height: 120, testid: `other:${name}` });
    c.box.title = info?.meaning ?? "";
    this.axis(c);
    return c;
  }

  update(store: MetricStore): void {
    const names = store.names();
    const pos = names.filter((n) => POS_RE.test(n)).sort((a, b) => Number(a.match(POS_RE)![1]) - Number(b.match(POS_RE)![1]));
    this.dynamic(this.posLines, pos);
    const arms = names.filter((n) => n.startsWith(ARM_PREFIX));
    this.dynamic(this.arms, arms, true, false); // drawn as shares (0-1), not as the catalogue's counts
    this.dynamic(this.val, names.filter((n) => n.startsWith("val/") && !n.startsWith("val/response_length")));
    if (pos.length) {
      const step = Math.max(...pos.map((n) => store.latestStep(n) ?? -1));
      const ys = pos.map((n) => store.at(n, step) ?? 0);
      this.posBars.set(pos.map((n) => Number(n.match(POS_RE)![1])), ys, `step ${step}`);
    }
    // over the job from the cumulative counters; a job without them (multi-GPU) shows its latest step's ratio
    const used = store.latest("harvest/used_gpu_s_total"), idle = store.latest("harvest/idle_gpu_s_total");
    const job = used !== null && idle !== null;
    const ratio = job ? (idle > 0 ? used / idle : 0) : store.latest("harvest/ratio");
    this.harvest.set(ratio === null ? "–" : `${fmt(ratio * 100, 3)} %`,
      job ? "harvest ratio (job)" : "harvest ratio (latest step)");
    const ran = runMean(store, "sd/spec_step_fraction"), ranLast = store.latest("sd/spec_step_fraction");
    this.sdRan.set(ran === null ? "–" : `${fmt(ran.mean * 100, 3)} % (latest step ${fmt((ranLast ?? 0) * 100, 3)} %)`,
      ran === null ? undefined : `SD ran (mean of steps ${ran.first}-${ran.last})`);
    this.sdWhy.textContent = costSwitchText(store) ?? "";
    const tail = latestCommon(store, [TAIL_SD, TAIL_PLAIN]);
    this.tailGain.set(tail && tail.values[1] > 0 ? `${fmt(tail.values[0] / tail.values[1], 3)}× (step ${tail.step})` : "–");

    for (const n of names) {
      if (this.claimed.has(n) || n.startsWith("response_length/") || this.others.has(n)) continue;
      this.others.set(n, this.other(n));
    }
    this.lines.forEach((c) => c.update(store));
    if (this.sharesOf !== store.version) {
      armShares(store, arms, this.shares);
      this.sharesOf = store.version;
    }
    this.arms.update(this.shares);
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
    this.arms.destroy();
    this.others.forEach((c) => c.destroy());
    [this.stepHist, this.heat, this.timeline, this.posBars].forEach((c) => c.destroy());
  }
}
