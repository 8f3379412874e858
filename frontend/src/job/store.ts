// Metric series of one job: the downsampled history (GET /metrics?points=N) plus every live point from the SSE
// stream after it. A point at or before the history's last step of its series is already in the history (or was
// thinned out of it on purpose), so the stream's backlog of old rows is dropped; a replayed step (resume) replaces.
// A null value (the job wrote NaN or infinity) is left out: the line has a gap there.

export interface Series { steps: number[]; values: number[] }

export class MetricStore {
  readonly series = new Map<string, Series>();
  private historyLast = new Map<string, number>();
  lastStep = -1;
  version = 0; // bumped on every change; charts redraw when it moved

  loadHistory(series: { name: string; points: { step: number; value: number | null }[] }[]): void {
    for (const s of series) {
      const finite = s.points.filter((p): p is { step: number; value: number } => p.value !== null);
      const steps = finite.map((p) => p.step);
      const values = finite.map((p) => p.value);
      this.series.set(s.name, { steps, values });
      if (steps.length) {
        this.historyLast.set(s.name, steps[steps.length - 1]);
        this.lastStep = Math.max(this.lastStep, steps[steps.length - 1]);
      }
    }
    this.version++;
  }

  /** Full-resolution points of a recent window (e.g. for the heat-map's lines): inserted beside the history. */
  merge(series: { name: string; points: { step: number; value: number | null }[] }[]): void {
    for (const s of series) for (const p of s.points) if (p.value !== null) this.insert(s.name, p.step, p.value);
    this.version++;
  }

  /** A live point; returns false when it was dropped as part of the history. */
  add(step: number, name: string, value: number | null): boolean {
    const hl = this.historyLast.get(name);
    if (value === null || (hl !== undefined && step <= hl)) return false;
    this.insert(name, step, value);
    this.lastStep = Math.max(this.lastStep, step);
    this.version++;
    return true;
  }

  private insert(name: string, step: number, value: number): void {
    let s = this.series.get(name);
    if (!s) { s = { steps: [], values: [] }; this.series.set(name, s); }
    const n = s.steps.length;
    if (!n || step > s.steps[n - 1]) { s.steps.push(step); s.values.push(value); }
    else {
      let lo = 0, hi = n; // first index with steps[i] >= step
      while (lo < hi) { const mid = (lo + hi) >> 1; if (s.steps[mid] < step) lo = mid + 1; else hi = mid; }
      if (s.steps[lo] === step) s.values[lo] = value;
      else { s.steps.splice(lo, 0, step); s.values.splice(lo, 0, value); }
    }
  }

  latest(name: string): number | null {
    const s = this.series.get(name);
    return s && s.values.length ? s.values[s.values.length - 1] : null;
  }

  latestStep(name: string): number | null {
    const s = this.series.get(name);
    return s && s.steps.length ? s.steps[s.steps.length - 1] : null;
  }

  at(name: string, step: number): number | null {
    const s = this.series.get(name);
    if (!s) return null;
    let lo = 0, hi = s.steps.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (s.steps[mid] < step) lo = mid + 1; else hi = mid; }
    return s.steps[lo] === step ? s.values[lo] : null;
  }

  names(): string[] { return [...this.series.keys()].sort(); }
}
