// GPU timeline of the last few RL steps: one lane per GPU with intervals of rollout / idle (the long tail) / drafter
// training (harvested idle time) / reward / update / sync. Multi-GPU jobs report each GPU's phases
// (`timeline/gpu{g}/{rollout,drafter,idle,reward,update,sync}_s`, in that order); other jobs only the step's
// timing_s/* and per-step harvest/{idle,used}_gpu_s (the rollout's tail and the drafter training inside it, never the
// cumulative *_total counters), split evenly over the lanes. Drafter training after the update (timing_s/drafter)
// is drawn after sync: it is step time, not harvested idle time.
import { fmt, h } from "../dom";
import { setupCanvas } from "./heatmap";
import type { MetricStore } from "../job/store";

export const PHASES: Record<string, string> = {
  rollout: "#4e79a7", idle: "#d3d3d3", "drafter training": "#59a14f", reward: "#edc948", update: "#f28e2b",
  sync: "#b07aa1", other: "#ece6df",
};

export interface Segment { phase: string; start: number; end: number }

const LANE_PHASES: [string, string][] = [["rollout", "rollout"], ["drafter", "drafter training"], ["idle", "idle"],
  ["reward", "reward"], ["update", "update"], ["sync", "sync"]];

/** GPU g's own segments for one step, or null when the job did not report per-GPU phases. */
export function laneSegments(store: MetricStore, step: number, g: number): Segment[] | null {
  if (store.at(`timeline/gpu${g}/rollout_s`, step) === null) return null;
  const segs: Segment[] = [];
  let t = 0;
  for (const [key, phase] of LANE_PHASES) {
    const d = store.at(`timeline/gpu${g}/${key}_s`, step) ?? 0;
    if (d > 0) { segs.push({ phase, start: t, end: t + d }); t += d; }
  }
  const total = store.at("timing_s/step", step);
  if (total !== null && total > t) segs.push({ phase: "other", start: t, end: total });
  return segs;
}

/** The segments of one lane for one step from the step totals, times relative to the step's start (seconds). */
export function stepSegments(store: MetricStore, step: number, ngpu: number): Segment[] {
  const v = (n: string) => store.at(n, step) ?? 0;
  const gen = v("timing_s/gen"), reward = v("timing_s/reward"), update = v("timing_s/update"), sync = v("timing_s/sync");
  const drafter = v("timing_s/drafter");
  const idle = Math.min(gen, v("harvest/idle_gpu_s") / ngpu);
  const used = Math.min(idle, v("harvest/used_gpu_s") / ngpu);
  const segs: Segment[] = [];
  let t = 0;
  const push = (phase: string, d: number) => { if (d > 0) { segs.push({ phase, start: t, end: t + d }); t += d; } };
  push("rollout", gen - idle);
  push("drafter training", used);
  push("idle", idle - used);
  push("reward", reward);
  push("update", update);
  push("sync", sync);
  push("drafter training", drafter);
  const total = store.at("timing_s/step", step);
  if (total !== null) push("other", total - t);
  return segs;
}

export class GpuTimeline {
  readonly box: HTMLElement;
  private canvas = h("canvas");
  private title: HTMLElement;
  private ro: ResizeObserver;
  private width = 400;
  private seen = -1;
  private store: MetricStore | null = null;

  constructor(parent: HTMLElement, private ngpu: number, private steps = 4) {
    const legend = h("div", { class: "legend" }, ...Object.entries(PHASES).map(([k, c]) =>
      h("span", {}, h("i", { style: `background:${c}` }), k)));
    this.box = h("div", { class: "chart", "data-chart": "gpu-timeline" },
      this.title = h("div", { class: "chart-title" }, `${ngpu ? "GPU" : "CPU"} timeline — last ${steps} steps`),
      this.canvas, legend);
    this.box.classList.add("wide");
    parent.append(this.box);
    this.ro = new ResizeObserver(() => { this.width = Math.max(250, this.box.clientWidth - 2); this.draw(); });
    this.ro.observe(this.box);
  }

  update(store: MetricStore): void {
    this.store = store;
    if (store.version === this.seen) return;
    this.seen = store.version;
    this.draw();
  }

  private draw(): void {
    const lanes = Math.max(1, this.ngpu);
    const laneH = 18, T = 16, L = 46, B = 16;
    const height = T + lanes * (laneH + 4) + B;
    const ctx = setupCanvas(this.canvas, this.width, height);
    const s = this.store?.series.get("timing_s/step") ?? this.store?.series.get("timing_s/gen");
    if (!this.store || !s || !s.steps.length) { ctx.fillStyle = "#888"; ctx.fillText("no timing metrics yet", L, T + 12); return; }
    const steps = s.steps.slice(-this.steps);
    const shared = steps.map((st) => stepSegments(this.store!, st, lanes));
    // per lane: the GPU's own phases when reported, else the even split of the step totals
    const perLane = steps.map((st, k) => Array.from({ length: lanes }, (_, g) => laneSegments(this.store!, st, g) ?? shared[k]));
    const estimated = steps.some((st) => laneSegments(this.store!, st, 0) === null);
    this.title.textContent = `${this.ngpu ? "GPU" : "CPU"} timeline — last ${this.steps} steps${estimated && lanes > 1 ? " (per-GPU split estimated from step totals)" : ""}`;
    const span = (k: number) => Math.max(0, ...perLane[k].map((segs) => (segs.length ? segs[segs.length - 1].end : 0)));
    const total = steps.reduce((a, _, k) => a + span(k), 0) || 1;
    const w = this.width - L - 8;
    const X = (t: number) => L + (t / total) * w;
    for (let g = 0; g < lanes; g++) {
      ctx.fillStyle = "#555";
      ctx.fillText(this.ngpu ? `GPU ${g}` : "CPU", 4, T + g * (laneH + 4) + 13);
    }
    let off = 0;
    steps.forEach((st, k) => {
      for (let g = 0; g < lanes; g++) {
        const y = T + g * (laneH + 4);
        for (const sg of perLane[k][g]) {
          ctx.fillStyle = PHASES[sg.phase];
          ctx.fillRect(X(off + sg.start), y, Math.max(1, X(off + sg.end) - X(off + sg.start)), laneH);
        }
      }
      ctx.fillStyle = "#333";
      ctx.fillText(`step ${st}`, X(off) + 2, 11);
      ctx.strokeStyle = "#333";
      ctx.beginPath(); ctx.moveTo(X(off), T - 2); ctx.lineTo(X(off), height - B); ctx.stroke();
      off += span(k);
    });
    ctx.fillStyle = "#666";
    ctx.fillText(`${fmt(total)} s`, L + w - 40, height - 3);
  }

  destroy(): void { this.ro.disconnect(); }
}
