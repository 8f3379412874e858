// The "TLT over training" panel of the job page: what adaptive SD did for this run as the policy sharpened. Policy
// entropy, drafter top-1 accuracy and accept length over the steps (TLT's claim: entropy falls, the drafter follows,
// acceptance rises), and the time SD saved in the tail: per step, the tail seconds SD steps took vs the cost model's
// plain-decoding estimate for the same tokens (worker/tlt/sd_savings.py), and the job's running total.
import { LineChart } from "../charts/line";
import { fmt, h } from "../dom";
import type { MetricStore } from "./store";

export const ENTROPY = "actor/entropy";
export const DRAFTER_ACC = "drafter/acc";
export const ACCEPT_LEN = "sd/accept_len";
export const TAIL_SD_S = "perf/tail_sd_s";
export const PLAIN_ESTIMATE_S = "sd/plain_estimate_s";
export const SAVED_S_TOTAL = "sd/saved_s_total";

/** "first → latest" of a series, or null without points. */
export function trend(store: MetricStore, name: string, digits = 3): string | null {
  const s = store.series.get(name);
  if (!s || !s.values.length) return null;
  return `${fmt(s.values[0], digits)} → ${fmt(s.values[s.values.length - 1], digits)}`;
}

export class TltPanel {
  readonly el: HTMLElement;
  private charts: LineChart[];
  private saved = h("b", { "data-testid": "tlt-saved-total" }, "–");
  private accept = h("b", { "data-testid": "tlt-accept-trend" }, "–");
  private entropy = h("b", { "data-testid": "tlt-entropy-trend" }, "–");

  /** Placed right after the speculative-decoding panel of `root` when there is one, else at its end. */
  constructor(root: HTMLElement) {
    const grid = h("div", { class: "grid" });
    const stat = (label: string, val: HTMLElement, title: string) => h("span", { class: "stat", title }, `${label} `, val);
    this.el = h("section", { class: "panel", "data-panel": "tlt" },
      h("h2", {}, "TLT over training",
        stat("SD saved (job)", this.saved, "tail seconds SD saved since the job started: the cost model's plain-decoding estimate for the SD steps' tokens minus their seconds"),
        stat("accept length", this.accept, "tokens per verify, first step → latest"),
        stat("entropy", this.entropy, "policy entropy (nats/token), first step → latest")),
      grid);
    const sd = root.querySelector('[data-panel="sd"]');
    if (sd) sd.after(this.el); else root.append(this.el);
    this.charts = [
      new LineChart(grid, "Policy entropy (nats/token)", [{ name: ENTROPY }], { testid: "tlt-entropy", yLabel: "nats/token" }),
      new LineChart(grid, "Drafter top-1 accuracy", [{ name: DRAFTER_ACC, points: true }], { testid: "tlt-drafter-acc", fraction: true }),
      new LineChart(grid, "Accept length (tokens per verify)", [{ name: ACCEPT_LEN, points: true }], { testid: "tlt-accept-len", yLabel: "tokens" }),
      new LineChart(grid, "Tail time of SD steps vs plain estimate (s)", [
        { name: TAIL_SD_S, label: "with SD", points: true }, { name: PLAIN_ESTIMATE_S, label: "plain estimate", points: true, dash: true }],
      { testid: "tlt-saved", minY: 0, yLabel: "s" }),
    ];
  }

  update(store: MetricStore): void {
    const total = store.latest(SAVED_S_TOTAL);
    this.saved.textContent = total === null ? "–" : `${fmt(total, 3)} s`;
    this.accept.textContent = trend(store, ACCEPT_LEN) ?? "–";
    this.entropy.textContent = trend(store, ENTROPY) ?? "–";
    this.charts.forEach((c) => c.update(store));
  }

  destroy(): void { this.charts.forEach((c) => c.destroy()); }
}
