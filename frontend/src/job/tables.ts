// The job page's tables: samples of the latest step, artifacts (download with the bearer token, checked against
// the server's sha256), events and the log tail.
import { API, ApiError, authHeaders, type Artifact, type JobEvent, type LogLine, type Sample } from "../api";
import { clear, fmt, fmtBytes, fmtTime, h } from "../dom";

const LOG_KEEP = 500;

export function samplesTable(el: HTMLElement, samples: Sample[]): void {
  clear(el);
  const latest = samples.length ? Math.max(...samples.map((s) => s.step)) : null;
  const rows = samples.filter((s) => s.step === latest).flatMap((s) => s.rows);
  if (!rows.length) { el.append(h("p", { class: "muted" }, "No samples yet.")); return; }
  el.append(h("p", { class: "muted small" }, `step ${latest}`), h("table", { class: "samples", "data-testid": "samples" },
    h("thead", {}, h("tr", {}, h("th", {}, "prompt"), h("th", {}, "response"), h("th", {}, "reward"), h("th", {}, "length"))),
    h("tbody", {}, ...rows.map((r) => h("tr", {},
      h("td", {}, h("pre", {}, String(r.prompt ?? ""))),
      h("td", {}, h("pre", {}, String(r.response ?? "")), r.answer != null ? h("div", { class: "muted small" }, `answer: ${r.answer}`) : null),
      h("td", { class: "num" }, typeof r.reward === "number" ? fmt(r.reward) : String(r.reward ?? "")),
      h("td", { class: "num" }, String(r.length ?? ""), r.finish_reason ? h("div", { class: "muted small" }, String(r.finish_reason)) : null),
    )))));
}

async function sha256Hex(blob: Blob): Promise<string | null> {
  if (!globalThis.crypto?.subtle || blob.size > 1 << 30) return null; // not a secure context, or too big to hash here
  const d = await crypto.subtle.digest("SHA-256", await blob.arrayBuffer());
  return [...new Uint8Array(d)].map((b) => b.toString(16).padStart(2, "0")).join("");
}

/** Fetch with the token (a plain link cannot send it), check the sha256, and hand the file to the browser. */
export async function download(a: Artifact, status: HTMLElement): Promise<void> {
  status.textContent = "downloading…";
  const url = a.download_url.startsWith("/") ? a.download_url : `${API}/artifacts/${a.id}/download`;
  const res = await fetch(url, { headers: authHeaders() });
  if (!res.ok) {
    let detail = res.statusText;
    try { detail = (await res.json()).detail ?? detail; } catch { /* keep the status text */ }
    throw new ApiError(res.status, detail);
  }
  const blob = await res.blob();
  const want = res.headers.get("X-Checksum-Sha256") ?? a.sha256;
  const got = await sha256Hex(blob);
  if (got !== null && got !== want) throw new Error(`sha256 mismatch: got ${got.slice(0, 12)}…, expected ${want.slice(0, 12)}…`);
  const cd = res.headers.get("Content-Disposition") ?? "";
  const name = cd.match(/filename="?([^";]+)"?/)?.[1] ?? `${a.name}${a.is_dir ? ".tar" : ""}`;
  const link = h("a", { href: URL.createObjectURL(blob), download: name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 60_000);
  status.textContent = `saved ${name} (${fmtBytes(blob.size)})${got ? ", sha256 verified" : ""}`;
}

export function artifactsTable(el: HTMLElement, arts: Artifact[]): void {
  clear(el);
  if (!arts.length) { el.append(h("p", { class: "muted" }, "No artifacts yet.")); return; }
  el.append(h("table", { "data-testid": "artifacts" },
    h("thead", {}, h("tr", {}, ...["kind", "name", "step", "size", "sha256", "created", ""].map((c) => h("th", {}, c)))),
    h("tbody", {}, ...arts.map((a) => {
      const st = h("span", { class: "muted small", "data-testid": "download-status" });
      const btn = h("button", { "data-artifact-id": a.id, disabled: !!a.deleted_at }, a.deleted_at ? "deleted" : "Download");
      btn.addEventListener("click", () => {
        btn.disabled = true;
        download(a, st).catch((e) => { st.textContent = `download failed: ${e instanceof Error ? e.message : e}`; })
          .finally(() => { btn.disabled = false; });
      });
      return h("tr", { "data-artifact-kind": a.kind },
        h("td", {}, a.kind), h("td", {}, a.name, a.is_dir ? " (dir → .tar)" : ""), h("td", {}, a.step ?? ""),
        h("td", { class: "num" }, fmtBytes(a.size)), h("td", { class: "mono", title: a.sha256 }, a.sha256.slice(0, 12) + "…"),
        h("td", { class: "muted" }, fmtTime(a.created_at)), h("td", {}, btn, " ", st));
    }))));
}

export class EventsLog {
  readonly events = h("tbody");
  readonly log = h("pre", { class: "log", "data-testid": "log-tail" });
  private lines: string[] = [];

  addEvents(evs: JobEvent[]): void {
    for (const e of evs) {
      this.events.prepend(h("tr", { "data-event-id": e.id },
        h("td", { class: "muted" }, fmtTime(e.created_at)),
        h("td", {}, e.kind === "transition" ? `${e.from_status ?? "∅"} → ${e.to_status}` : e.kind),
        h("td", {}, e.reason ?? ""), h("td", { class: "muted" }, e.worker ?? ""), h("td", {}, e.attempt)));
    }
  }

  addLogs(lines: LogLine[]): void {
    if (!lines.length) return;
    const stick = this.log.scrollTop + this.log.clientHeight >= this.log.scrollHeight - 4;
    for (const l of lines) this.lines.push(`${l.stream === "output" ? "│ " : ""}${l.line}`);
    if (this.lines.length > LOG_KEEP) this.lines = this.lines.slice(-LOG_KEEP);
    this.log.textContent = this.lines.join("\n");
    if (stick) this.log.scrollTop = this.log.scrollHeight;
  }

  element(): HTMLElement {
    return h("div", { class: "grid two" },
      h("div", {}, h("h3", {}, "Events"), h("table", { "data-testid": "events" },
        h("thead", {}, h("tr", {}, ...["time", "change", "reason", "worker", "attempt"].map((c) => h("th", {}, c)))), this.events)),
      h("div", {}, h("h3", {}, `Log tail (last ${LOG_KEEP} lines)`), this.log));
  }
}
