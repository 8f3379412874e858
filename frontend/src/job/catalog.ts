// The metric catalogue (GET /metrics/catalog, from worker/tlt/metric_catalog.py): unit, kind and meaning of every
// metric name a job writes. The charts take their axis label and range from it (a `fraction` is drawn on 0-1) and
// say when a series is a running total (`cumulative`) instead of a per-step value.
import { get, type MetricInfo } from "../api";

export class MetricCatalog {
  private exact = new Map<string, MetricInfo>();
  private templates: [RegExp, MetricInfo][] = [];

  constructor(entries: MetricInfo[]) {
    for (const m of entries) {
      if (!m.name.includes("{")) { this.exact.set(m.name, m); continue; }
      const re = m.name.split(/(\{[a-z_]+\})/).map((p) => (p.startsWith("{") ? "[^/]+" : p.replace(/[.*+?^$()|[\]\\]/g, "\\$&"))).join("");
      this.templates.push([new RegExp(`^${re}$`), m]);
    }
  }

  info(name: string): MetricInfo | null {
    return this.exact.get(name) ?? this.templates.find(([re]) => re.test(name))?.[1] ?? null;
  }

  unit(name: string): string | null { return this.info(name)?.unit ?? null; }

  /** True when every name is a value in [0, 1]. */
  fractions(names: string[]): boolean { return names.length > 0 && names.every((n) => this.unit(n) === "fraction"); }
}

let loaded: Promise<MetricCatalog> | null = null;

/** The catalogue, fetched once per page load (an empty one when the API cannot be reached: charts still draw). */
export function metricCatalog(signal?: AbortSignal): Promise<MetricCatalog> {
  loaded ??= get<MetricInfo[]>("metrics/catalog", signal).then((m) => new MetricCatalog(m)).catch(() => {
    loaded = null;
    return new MetricCatalog([]);
  });
  return loaded;
}
