// REST client of the control plane (/api/v1): bearer token from localStorage, typed responses, ApiError on non-2xx.
// Response types come from the API's OpenAPI schema (src/api_schema.d.ts, written by `npm run gen:api`; never edit it
// by hand: tests/ui/test_api_types.py fails when it differs from a fresh generation).
import type { components } from "./api_schema";

type Schemas = components["schemas"];

const TOKEN_KEY = "tlt.token";
export const API = "/api/v1";

export type Job = Schemas["JobPublic"];
export type JobPage = Schemas["Page_JobPublic_"];
export type JobEvent = Schemas["EventPublic"];
export type MetricPoint = Schemas["MetricPoint"]; // value is null for a NaN / infinite value
export type MetricSeries = Schemas["MetricSeries"];
export type MetricHistory = Schemas["MetricHistory"];
export type MetricInfo = Schemas["MetricInfo"]; // GET /metrics/catalog
export type Histogram = Schemas["HistogramPublic"];
export type LogLine = Schemas["LogLinePublic"];
export type Sample = Schemas["SamplePublic"];
export type Artifact = Schemas["ArtifactPublic"];
export type User = Schemas["UserPublic"];
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
