// Server-sent events over fetch(): EventSource cannot send an Authorization header, so this reads the stream with
// fetch + ReadableStream, parses the SSE wire format, and reconnects (honouring `retry:`) with Last-Event-ID so the
// server sends only what was missed. The stream closes for good after an `end` event or stop().
import { authHeaders } from "./api";

export interface SseMessage { event: string; id: string; data: string }
export type StreamState = "connecting" | "open" | "reconnecting" | "ended" | "stopped";

export class SseParser {
  private buf = "";
  private event = "";
  private data: string[] = [];
  private id = "";
  retry: number | null = null;
  lastId = "";

  /** Feed a decoded chunk; returns the complete messages it finished. */
  push(chunk: string): SseMessage[] {
    this.buf += chunk;
    const out: SseMessage[] = [];
    let nl: number;
    while ((nl = this.buf.search(/\r\n|\r|\n/)) >= 0) {
      const line = this.buf.slice(0, nl);
      this.buf = this.buf.slice(nl + (this.buf.startsWith("\r\n", nl) ? 2 : 1));
      if (line === "") {
        if (this.data.length) {
          if (this.id) this.lastId = this.id;
          out.push({ event: this.event || "message", id: this.lastId, data: this.data.join("\n") });
        }
        this.event = ""; this.data = [];
        continue;
      }
      if (line.startsWith(":")) continue; // a comment (keep-alive)
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "event") this.event = value;
      else if (field === "data") this.data.push(value);
      else if (field === "id" && !value.includes("\0")) this.id = value;
      else if (field === "retry" && /^\d+$/.test(value)) this.retry = Number(value);
    }
    return out;
  }
}

export class EventStream {
  private ctrl: AbortController | null = null;
  private stopped = false;
  lastEventId = "";
  reconnects = 0;

  constructor(
    private url: string,
    private onMessages: (msgs: SseMessage[]) => void,
    private onState: (s: StreamState, detail?: string) => void = () => {},
  ) {}

  start(): void { void this.loop(); }

  /** Drop the current connection and open a new one that resumes from the last event id. */
  reconnect(): void { this.ctrl?.abort(); }

  stop(): void {
    this.stopped = true;
    this.ctrl?.abort();
    this.onState("stopped");
  }

  private async loop(): Promise<void> {
    let retryMs = 1000;
    while (!this.stopped) {
      this.ctrl = new AbortController();
      const parser = new SseParser();
      parser.lastId = this.lastEventId;
      let ended = false;
      try {
        this.onState(this.reconnects ? "reconnecting" : "connecting");
        const headers = authHeaders({ Accept: "text/event-stream" });
        if (this.lastEventId) headers["Last-Event-ID"] = this.lastEventId;
        const res = await fetch(this.url, { headers, signal: this.ctrl.signal, cache: "no-store" });
        if (!res.ok || !res.body) throw new Error(`stream answered HTTP ${res.status}`);
        this.onState("open");
        const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          const msgs = parser.push(value);
          if (parser.retry !== null) retryMs = parser.retry;
          if (!msgs.length) continue;
          this.lastEventId = parser.lastId;
          this.onMessages(msgs);
          if (msgs.some((m) => m.event === "end")) { ended = true; break; }
        }
      } catch (e) {
        if (this.stopped) return;
        this.onState("reconnecting", String(e));
      }
      if (ended) { this.stopped = true; this.ctrl.abort(); this.onState("ended"); return; }
      if (this.stopped) return;
      this.reconnects++;
      await new Promise((r) => setTimeout(r, retryMs));
    }
  }
}
