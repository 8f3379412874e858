// REST client of the control plane (/api/v1): bearer token from localStorage, typed responses, ApiError on non-2xx.
// Types mirror backend/schemas.py.

const TOKEN_KEY = "tlt.token";
export const API = "/api/v1";

export interface Job {
  id: number; name: string; owner: string; status: string; reason: string | null; attempt: number;
  worker: string | null; queue: string; spec: Record<string, unknown>; idempotency_key: string | null;
  created_at: string; updated_at: string; started_at: string | null; finished_at: string | null;
  heartbeat_at: string | null;
  last_step: number | null; last_step_time_s: number | null; // newest step with metrics, its timing_s/step
}
export interface Page<T> { items: T[]; next_cursor: string | null }
export interface JobEvent {
  id: number; job_id: number; created_at: string; kind: string; from_status: string | null; to_status: string;
  reason: string | null; worker: string | null; attempt: number;
}
export interface MetricPoint { step: number; value: number }
export interface MetricSeries { name: string; points: MetricPoint[]; total: number }
export interface MetricHistory {
  series: MetricSeries[]; last_step: number | null;
  stream_cursor?: string | null; // the SSE cursor at the time of this query (resume the stream from here)
}
export interface Histogram { step: number; name: string; edges: number[]; counts: number[] }
export interface LogLine { id: number; created_at: string; attempt: number; stream: string; line: string }
export interface Sample { id: number; step: number; rows: Record<string, unknown>[] }
export interface Artifact {
  id: number; job_id: number; kind: string; name: string; is_dir: boolean; size: number; sha256: string;
  step: number | null; created_at: string; deleted_at: string | null; download_url: string;
}
export interface User { id: number; name: string; is_admin: boolean }
/** One entry of FastAPI's 422 `detail` list. */
export interface ValidationIssue { loc: (string | number)[]; msg: string; type: string }

export const FINAL_STATUSES = new Set(["succeeded", "failed", "cancelled"]);

export function getToken(): string | null { return localStorage.getItem(TOKEN_KEY); }
export function setToken(t: string): void { localStorage.setItem(TOKEN_KEY, t); }
export function clearToken(): void { localStorage.removeItem(TOKEN_KEY); }

export class ApiError extends Error {
  constructor(public status: number, public detail: unknown) {
    super(typeof detail === "string" ? detail : `HTTP ${status}: ${JSON.stringify(detail)}`);
  }
  /** The 422 issues, when the API answered with FastAPI's validation format. */
  get issues(): ValidationIssue[] {
    return Array.isArray(this.detail) ? (this.detail as ValidationIssue[]) : [];
  }
}

/** Listeners told when the API refuses the token (401): the app goes back to sign-in. */
const unauthorized: (() => void)[] = [];
export function onUnauthorized(fn: () => void): void { unauthorized.push(fn); }

export function authHeaders(extra: Record<string, string> = {}): Record<string, string> {
  const t = getToken();
  return t ? { ...extra, Authorization: `Bearer ${t}` } : extra;
}

export async function request(
  path: string, init: { method?: string; body?: unknown; headers?: Record<string, string>; signal?: AbortSignal } = {},
): Promise<Response> {
  const headers = authHeaders(init.headers);
  let body: BodyInit | undefined;
  if (init.body !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(init.body);
  }
  const res = await fetch(path.startsWith("/") ? path : `${API}/${path}`, {
    method: init.method ?? "GET", headers, body, signal: init.signal,
  });
  if (!res.ok) {
    let detail: unknown = res.statusText;
    try { detail = (await res.json()).detail ?? detail; } catch { /* a non-JSON error body: keep the status text */ }
    if (res.status === 401) unauthorized.forEach((fn) => fn());
    throw new ApiError(res.status, detail);
  }
  return res;
}

export async function get<T>(path: string, signal?: AbortSignal): Promise<T> {
  return (await request(path, { signal })).json() as Promise<T>;
}

export async function post<T>(path: string, body?: unknown, headers?: Record<string, string>): Promise<T> {
  return (await request(path, { method: "POST", body, headers })).json() as Promise<T>;
}

/** Query string from a record; arrays repeat the key, undefined/null are left out. */
export function qs(params: Record<string, string | number | (string | number)[] | null | undefined>): string {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v === null || v === undefined) continue;
    for (const x of Array.isArray(v) ? v : [v]) p.append(k, String(x));
  }
  const s = p.toString();
  return s ? `?${s}` : "";
}
