// Job page: header (status, step, live step time, cancel / retry), chart panels, samples, artifacts, events and
// log tail. Loads the downsampled metric history (points=HISTORY_POINTS) plus a full-resolution recent window, then
// follows the job's SSE stream; histograms, samples and artifacts (not on the stream) are refetched when a new step
// arrives. Charts redraw at most every REDRAW_MS, so a 10,000-step job stays responsive. For a long job (more than
// STREAM_BACKLOG_MAX metric rows) the stream carries events and logs only and metrics are polled by step, until the
// API returns the stream cursor with the history (see stream_cursor in api.ts). Leaving the page aborts every request
// in flight and every refresh still scheduled: nothing is fetched for a page no longer shown.
import {
  ApiError, FINAL_STATUSES, get, post, qs, type Artifact, type Histogram, type Job, type JobEvent, type LogLine,
  type MetricHistory, type Sample,
} from "../api";
import { append, clear, fmt, fmtTime, h, throttle } from "../dom";
import { metricCatalog } from "../job/catalog";
import { Panels } from "../job/panels";
import { MetricStore } from "../job/store";
import { TltPanel } from "../job/tlt_panel";
import { artifactsTable, EventsLog, samplesTable } from "../job/tables";
import type { Cleanup } from "../router";
import { EventStream, type SseMessage } from "../sse";
import { statusBadge } from "./jobs";

const HISTORY_POINTS = 1000; // points per series in the initial history
const WINDOW_STEPS = 300; // steps of full-resolution histograms and length lines (heat-map)
const REDRAW_MS = 300;
// Above this many stored metric rows the stream's replay of old rows (it starts at the first row unless given a
// cursor) would hold the live tail back for long: the stream then skips metrics and they are polled by step instead.
const STREAM_BACKLOG_MAX = 20_000;
const SKIP_METRICS = String(Number.MAX_SAFE_INTEGER);
const POLL_MS = 1000;

/** Whether a job validates: every eval_steps steps, on a held-out split of dataset.validation_size rows. */
function validates(spec: Job["spec"]): boolean {
  const data = spec.dataset as Record<string, unknown> | undefined;
  return Number(spec.eval_steps ?? 0) > 0 && Number(data?.validation_size ?? 64) > 0;
}

export function jobPage(root: HTMLElement, jobId: number): Cleanup {
  const store = new MetricStore();
  let job: Job | null = null;
  let hists: Histogram[] = [];
  let panels: Panels | null = null;
  let tlt: TltPanel | null = null;
  let stream: EventStream | null = null;
  let startCursor = "";
  let pollMetrics = false;
  let pollTimer = 0;
  let alive = true;
  const abort = new AbortController();
  const fetchJson = <T>(path: string): Promise<T> => get<T>(path, abort.signal);

  const head = h("div", { class: "jobhead" });
  const err = h("p", { class: "error", "data-testid": "job-error" });
  const streamState = h("span", { class: "muted small", "data-testid": "stream-state" }, "connecting");
  const liveStep = h("b", { "data-testid": "live-step" }, "–");
  const liveStepTime = h("b", { "data-testid": "live-step-time" }, "–");
  const chartsRoot = h("div", { class: "panels" });
  const samplesEl = h("div");
  const artsEl = h("div");
  const evlog = new EventsLog();
  root.append(head, err, chartsRoot,
    h("section", { class: "panel", "data-panel": "samples" }, h("h2", {}, "Samples of the latest step"), samplesEl),
    h("section", { class: "panel", "data-panel": "artifacts" }, h("h2", {}, "Artifacts"), artsEl),
    h("section", { class: "panel", "data-panel": "events" }, evlog.element()));

  const cancelBtn = h("button", { "data-testid": "cancel" }, "Cancel");
  const retryBtn = h("button", { "data-testid": "retry" }, "Retry");
  const reconnectBtn = h("button", { class: "link small", "data-testid": "reconnect", title: "drop the stream and resume from the last event" }, "reconnect");
  reconnectBtn.addEventListener("click", () => stream?.reconnect());
  cancelBtn.addEventListener("click", () => void act("cancel"));
  retryBtn.addEventListener("click", () => void act("retry"));

  function drawHead(): void {
    if (!job) return;
    clear(head);
    const final = FINAL_STATUSES.has(job.status);
    cancelBtn.disabled = final || job.status === "cancelling";
    retryBtn.disabled = !(job.status === "failed" || job.status === "cancelled");
    append(head, [
      h("div", { class: "row" }, h("h1", {}, `${job.name} `, h("span", { class: "muted" }, `#${job.id}`)),
        statusBadge(job.status), cancelBtn, retryBtn),
      h("div", { class: "row small" },
        h("span", { class: "stat" }, "step ", liveStep, ` / ${job.spec.max_steps ?? "?"}`),
        h("span", { class: "stat" }, "step time ", liveStepTime),
        h("span", { class: "stat" }, `attempt ${job.attempt}`), h("span", { class: "stat" }, `queue ${job.queue}`),
        h("span", { class: "stat" }, `owner ${job.owner}`), job.worker ? h("span", { class: "stat" }, `worker ${job.worker}`) : null,
        h("span", { class: "stat muted" }, `created ${fmtTime(job.created_at)}`), h("span", { class: "stat" }, "stream: ", streamState, " ", reconnectBtn)),
      job.reason ? h("p", { class: job.status === "failed" ? "error" : "muted", "data-testid": "reason" }, h("pre", {}, job.reason)) : null,
    ]);
  }

  async function act(what: "cancel" | "retry"): Promise<void> {
    if (what === "cancel" && !window.confirm(`Cancel job #${jobId}?`)) return;
    try {
      job = await post<Job>(`jobs/${jobId}/${what}`);
      drawHead();
      if (what === "retry") { startStream(); if (pollMetrics) { clearTimeout(pollTimer); void poll(); } }
    } catch (e) {
      err.textContent = `${what} failed: ${e instanceof ApiError ? e.message : e}`;
    }
  }

  const redraw = throttle(() => {
    if (!alive || !panels) return;
    panels.update(store);
    tlt?.update(store);
    liveStep.textContent = store.lastStep >= 0 ? String(store.lastStep) : "–";
    const st = store.latest("timing_s/step");
    liveStepTime.textContent = st === null ? "–" : `${fmt(st)} s`;
  }, REDRAW_MS);

  const refreshHists = throttle(async () => {
    if (!alive) return;
    const after = hists.length ? hists[hists.length - 1].step : Math.max(-1, store.lastStep - WINDOW_STEPS);
    const fresh = await fetchJson<Histogram[]>(`jobs/${jobId}/histograms${qs({ name: "response_length", after_step: after })}`).catch(() => []);
    if (!alive) return;
    if (fresh.length) {
      const byStep = new Map(hists.map((x) => [x.step, x]));
      fresh.forEach((x) => byStep.set(x.step, x));
      hists = [...byStep.values()].sort((a, b) => a.step - b.step).slice(-WINDOW_STEPS);
    }
    panels?.updateHistograms(hists, store);
  }, 1000);

  let lastSampleStep = -1;
  const refreshSamples = throttle(async () => {
    if (!alive || store.lastStep < 0) return; // no step yet: nothing to ask for
    const after = Math.max(-1, Math.max(lastSampleStep, store.lastStep - 2) - 1); // the API's after_step is >= -1
    const s = await fetchJson<Sample[]>(`jobs/${jobId}/samples${qs({ after_step: after, limit: 100 })}`).catch(() => [] as Sample[]);
    if (!alive || !s.length) return;
    lastSampleStep = Math.max(...s.map((x) => x.step));
    samplesTable(samplesEl, s);
  }, 1500);

  const refreshArtifacts = throttle(async () => {
    if (!alive) return;
    const arts = await fetchJson<Artifact[]>(`jobs/${jobId}/artifacts`).catch(() => null);
    if (alive && arts) artifactsTable(artsEl, arts);
  }, 3000);

  const refreshJob = throttle(async () => {
    if (!alive) return;
    const j = await fetchJson<Job>(`jobs/${jobId}`).catch(() => null);
    if (alive && j) { job = j; drawHead(); }
  }, 1000);

  function onMessages(msgs: SseMessage[]): void {
    let newStep = false;
    const evs: JobEvent[] = [];
    const logs: LogLine[] = [];
    for (const m of msgs) {
      if (m.event === "metric") {
        const d = JSON.parse(m.data) as { step: number; name: string; value: number };
        const before = store.lastStep;
        if (store.add(d.step, d.name, d.value) && d.step > before) newStep = true;
      } else if (m.event === "event") evs.push(JSON.parse(m.data) as JobEvent);
      else if (m.event === "log") logs.push(JSON.parse(m.data) as LogLine);
      else if (m.event === "end") { refreshJob(); refreshArtifacts(); refreshHists(); refreshSamples(); }
    }
    if (evs.length) { evlog.addEvents(evs); refreshJob(); refreshArtifacts(); }
    evlog.addLogs(logs);
    if (newStep) { refreshHists(); refreshSamples(); refreshArtifacts(); }
    redraw();
  }

  async function poll(): Promise<void> {
    const after = store.lastStep;
    try {
      const m = await fetchJson<MetricHistory>(`jobs/${jobId}/metrics${qs({ after_step: after })}`);
      let newStep = false;
      for (const s of m.series) for (const p of s.points) if (store.add(p.step, s.name, p.value) && p.step > after) newStep = true;
      if (newStep) { refreshHists(); refreshSamples(); refreshArtifacts(); redraw(); }
    } catch { /* the stream's state shows connection trouble; try again */ }
    if (alive && pollMetrics && !(job && FINAL_STATUSES.has(job.status))) pollTimer = window.setTimeout(() => void poll(), POLL_MS);
  }

  function startStream(): void {
    stream?.stop();
    const last = stream?.lastEventId || startCursor;
    stream = new EventStream(`/api/v1/jobs/${jobId}/stream`, onMessages, (s, detail) => {
      streamState.textContent = s;
      streamState.title = detail ?? "";
    });
    stream.lastEventId = last; // after a retry: resume where the last stream stopped
    stream.start();
  }

  void (async () => {
    try {
      job = await fetchJson<Job>(`jobs/${jobId}`);
      drawHead();
      const gpus = Number((job.spec.resources as Record<string, unknown> | undefined)?.gpus ?? 0);
      const ps = new Panels(chartsRoot, gpus, validates(job.spec));
      panels = ps;
      tlt = new TltPanel(chartsRoot);
      void metricCatalog(abort.signal).then((c) => { if (alive) { ps.setCatalog(c); redraw(); } });
      const hist = await fetchJson<MetricHistory>(`jobs/${jobId}/metrics${qs({ points: HISTORY_POINTS })}`);
      store.loadHistory(hist.series);
      const rows = hist.series.reduce((a, x) => a + x.total, 0);
      if (hist.stream_cursor) startCursor = hist.stream_cursor;
      else if (rows > STREAM_BACKLOG_MAX) { startCursor = `${SKIP_METRICS}.0.0`; pollMetrics = true; }
      if (hist.last_step !== null) {
        const win = await fetchJson<MetricHistory>(`jobs/${jobId}/metrics${qs({
          names: ["response_length/p50", "response_length/p90", "response_length/max"].join(","),
          after_step: Math.max(-1, hist.last_step - WINDOW_STEPS),
        })}`);
        store.merge(win.series);
      }
      if (!alive) return;
      redraw();
      refreshHists(); refreshSamples(); refreshArtifacts();
      startStream();
      if (pollMetrics) void poll();
    } catch (e) {
      if (!alive) return; // navigated away: the aborted request is no error
      err.textContent = e instanceof ApiError && e.status === 404 ? `Job ${jobId} not found.` : `Could not load job: ${e}`;
    }
  })();

  return () => { alive = false; abort.abort(); clearTimeout(pollTimer); stream?.stop(); panels?.destroy(); tlt?.destroy(); };
}
