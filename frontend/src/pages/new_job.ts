// New job: the form is generated from GET /spec/schema and prefilled from a preset (GET /spec/presets); submit
// POSTs {spec} with an Idempotency-Key (a double click makes one job); a 422 shows each message next to its field.
import { ApiError, get, post, type Job } from "../api";
import { h } from "../dom";
import { navigate, type Cleanup } from "../router";
import { SchemaForm } from "../schema_form";

function newKey(): string {
  return globalThis.crypto?.randomUUID?.() ?? `k-${Date.now()}-${Math.random().toString(36).slice(2)}`;
}

export function newJobPage(root: HTMLElement): Cleanup {
  const status = h("p", { class: "muted" }, "Loading the job spec schema…");
  root.append(h("h1", {}, "New job"), status);
  let alive = true;
  void (async () => {
    try {
      const [schema, presets] = await Promise.all([
        get<Record<string, unknown>>("spec/schema"), get<Record<string, Record<string, unknown>>>("spec/presets"),
      ]);
      if (!alive) return;
      status.remove();
      const form = new SchemaForm(schema);
      const names = Object.keys(presets);
      const presetSel = h("select", { name: "preset" }, ...names.map((n) => h("option", { value: n }, n)));
      presetSel.addEventListener("change", () => { form.setValues(presets[presetSel.value]); form.clearErrors(); });
      if (names.length) form.setValues(presets[names[0]]);
      const submit = h("button", { type: "submit" }, "Submit job");
      const out = h("p", { class: "error", "data-testid": "submit-error" });
      let key = newKey();
      const el = h("form", { class: "card", novalidate: true },
        h("div", { class: "row" }, h("label", {}, "Start from preset ", presetSel)),
        form.element, h("div", { class: "row" }, submit), out);
      el.addEventListener("input", () => { key = newKey(); }); // a changed spec is a new submission
      el.addEventListener("submit", async (ev) => {
        ev.preventDefault();
        out.textContent = "";
        submit.disabled = true;
        try {
          const job = await post<Job>("jobs", { spec: form.value() }, { "Idempotency-Key": key });
          navigate(`#/jobs?new=${job.id}`);
        } catch (e) {
          if (e instanceof ApiError && e.status === 422 && e.issues.length) {
            form.showErrors(e.issues);
            out.textContent = `The API rejected the spec (${e.issues.length} problem${e.issues.length > 1 ? "s" : ""}; see the marked fields).`;
          } else out.textContent = String(e instanceof ApiError ? e.message : e);
        } finally {
          submit.disabled = false;
        }
      });
      root.append(el);
    } catch (e) {
      status.textContent = `Could not load the spec schema: ${e}`;
    }
  })();
  return () => { alive = false; };
}
