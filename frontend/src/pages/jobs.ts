// Job list: status filter, cursor pagination ("more"), and per job its latest step and step time (the list's own
// last_step / last_step_time_s fields), refreshed every few seconds.
import { get, qs, type Job, type JobPage, type User } from "../api";
import { clear, fmt, fmtTime, h } from "../dom";
import type { Cleanup } from "../router";

const STATUSES = ["", "queued", "starting", "running", "recovering", "cancelling", "succeeded", "failed", "cancelled"];
const POLL_MS = 3000;

export function statusBadge(status: string): HTMLElement {
  return h("span", { class: `badge st-${status}`, "data-testid": "status" }, status);
}

export function jobsPage(root: HTMLElement): Cleanup {
  const params = new URLSearchParams(location.hash.split("?")[1] ?? "");
  const filter = h("select", { name: "status" }, ...STATUSES.map((s) => h("option", { value: s }, s || "all statuses")));
  const tbody = h("tbody");
  const more = h("button", { class: "link" }, "more…");
  const err = h("p", { class: "error" });
  const scope = h("p", { class: "muted", "data-testid": "jobs-scope" });
  let jobs: Job[] = [];
  let cursor: string | null = null;
  let timer = 0;
  let alive = true;

  root.append(
    h("div", { class: "row" }, h("h1", {}, "Jobs"), filter, h("a", { class: "button", href: "#/jobs/new" }, "New job")),
    scope,
    h("table", { class: "jobs", "data-testid": "jobs-table" },
      h("thead", {}, h("tr", {}, ...["id", "name", "status", "step", "step time", "attempt", "owner", "worker",
        "created"].map((c) => h("th", {}, c)))),
      tbody),
    more, err,
  );

  function draw(): void {
    clear(tbody);
    if (!jobs.length) tbody.append(h("tr", {}, h("td", { colspan: 9, class: "muted" }, "No jobs yet.")));
    for (const j of jobs) {
      tbody.append(h("tr", { "data-job-id": j.id, class: params.get("new") === String(j.id) ? "fresh" : "" },
        h("td", {}, h("a", { href: `#/jobs/${j.id}` }, `#${j.id}`)),
        h("td", {}, h("a", { href: `#/jobs/${j.id}`, "data-testid": "job-name" }, j.name)),
        h("td", { title: j.reason ?? "" }, statusBadge(j.status)),
        h("td", { "data-testid": "job-step" }, j.last_step ?? "–"),
        h("td", { "data-testid": "job-step-time" }, j.last_step_time_s != null ? `${fmt(j.last_step_time_s)} s` : "–"),
        h("td", {}, j.attempt), h("td", {}, j.owner), h("td", { class: "muted" }, j.worker ?? ""),
        h("td", { class: "muted" }, fmtTime(j.created_at)),
      ));
    }
    more.style.display = cursor ? "" : "none";
  }

  async function load(append = false): Promise<void> {
    try {
      const page = await get<JobPage>(`jobs${qs({ status: filter.value || null, cursor: append ? cursor : null,
        limit: 50 })}`);
      if (!alive) return;
      if (append) jobs = jobs.concat(page.items);
      else {
        // keep the pages already loaded below the first one
        const first = new Set(page.items.map((j) => j.id));
        const rest = jobs.slice(50).filter((j) => !first.has(j.id));
        jobs = page.items.concat(rest);
        if (!rest.length) cursor = page.next_cursor ?? null;
      }
      if (append) cursor = page.next_cursor ?? null;
      draw();
      err.textContent = "";
    } catch (e) {
      err.textContent = `Could not load jobs: ${e}`;
    }
  }

  async function poll(): Promise<void> {
    await load();
    if (alive) timer = window.setTimeout(() => void poll(), POLL_MS);
  }

  // Whose jobs these are: an ordinary token sees its own user's only, so an empty list is not "no jobs anywhere".
  void get<User>("users/me").then((me) => {
    scope.textContent = me.is_admin ? "Every user's jobs (admin token)."
      : `Jobs of ${me.name} only (an ordinary token); an admin token (tlt token create --admin) shows every user's.`;
  }).catch(() => { scope.textContent = ""; });

  filter.value = params.get("status") ?? "";
  filter.addEventListener("change", () => { jobs = []; cursor = null; void load(); });
  more.addEventListener("click", () => void load(true));
  void poll();
  return () => { alive = false; clearTimeout(timer); };
}
