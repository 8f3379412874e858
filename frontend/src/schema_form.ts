// A form generated from a JSON schema (pydantic's model_json_schema of worker.tlt.config.JobSpec, served at
// GET /api/v1/spec/schema): nested objects become fieldsets, enums selects, booleans checkboxes, numbers and strings
// text inputs (the API validates; its 422 messages are shown next to the field their `loc` names).
import type { ValidationIssue } from "./api";
import { h } from "./dom";

type Schema = Record<string, unknown> & {
  $ref?: string; allOf?: Schema[]; anyOf?: Schema[]; type?: string; enum?: unknown[]; properties?: Record<string, Schema>;
  items?: Schema; title?: string; description?: string; default?: unknown; minimum?: number; maximum?: number;
  exclusiveMinimum?: number; exclusiveMaximum?: number; $defs?: Record<string, Schema>;
};

interface Field {
  get(): unknown; // undefined = leave out (the model's default applies)
  set(v: unknown): void;
  error: HTMLElement;
}

export class SchemaForm {
  readonly element: HTMLElement;
  private fields = new Map<string, Field>();
  private groups = new Map<string, HTMLElement>(); // path -> the group's error element ("" = whole form)

  constructor(private schema: Schema) {
    const err = h("div", { class: "error", "data-error-for": "" });
    this.groups.set("", err);
    this.element = h("div", { class: "schema-form" }, err, this.object(schema, []));
  }

  private resolve(s: Schema): Schema {
    if (s.$ref) {
      const name = s.$ref.split("/").pop()!;
      return this.resolve({ ...(this.schema.$defs?.[name] ?? {}), ...s, $ref: undefined });
    }
    if (s.allOf?.length === 1) return this.resolve({ ...s.allOf[0], ...s, allOf: undefined });
    return s;
  }

  private object(s: Schema, path: string[]): HTMLElement {
    const box = h("div", { class: "fields" });
    for (const [name, raw] of Object.entries(s.properties ?? {})) {
      const p = [...path, name];
      const sub = this.resolve(raw);
      if (sub.type === "object" && sub.properties) {
        const err = h("div", { class: "error", "data-error-for": p.join(".") });
        this.groups.set(p.join("."), err);
        box.append(h("fieldset", { "data-group": p.join(".") },
          h("legend", {}, name), sub.description ? h("p", { class: "muted small" }, sub.description) : null,
          err, this.object(sub, p)));
      } else {
        box.append(this.field(name, sub, p.join(".")));
      }
    }
    return box;
  }

  private field(name: string, s: Schema, path: string): HTMLElement {
    const nullable = !!s.anyOf?.some((x) => x.type === "null");
    const inner = this.resolve(s.anyOf?.find((x) => x.type !== "null") ?? s);
    const error = h("span", { class: "error field-error", "data-error-for": path });
    let input: HTMLInputElement | HTMLSelectElement;
    let field: Field;
    if (inner.enum) {
      const sel = h("select", { name: path },
        nullable ? h("option", { value: "" }, "(none)") : null,
        ...inner.enum.map((v) => h("option", { value: String(v) }, String(v))));
      input = sel;
      const options = inner.enum;
      // the option's own value (an integer enum must not be posted as a string), read by index
      field = { error, get: () => (sel.value === "" && nullable ? null : options[sel.selectedIndex - (nullable ? 1 : 0)]),
                set: (v) => { sel.value = v == null ? "" : String(v); } };
    } else if (inner.type === "boolean") {
      const cb = h("input", { type: "checkbox", name: path });
      input = cb;
      field = { error, get: () => cb.checked, set: (v) => { cb.checked = !!v; } };
    } else {
      const numeric = inner.type === "number" || inner.type === "integer";
      const isArray = inner.type === "array";
      const itemNumeric = isArray && ["number", "integer"].includes(this.resolve(inner.items ?? {}).type ?? "");
      const txt = h("input", { type: "text", name: path, inputmode: numeric ? "decimal" : null, autocomplete: "off",
        placeholder: nullable ? "(none)" : isArray ? "comma-separated" : "" });
      input = txt;
      const parseNum = (t: string): unknown => (t !== "" && Number.isFinite(Number(t)) ? Number(t) : t);
      field = {
        error,
        get: () => {
          const t = txt.value.trim();
          if (t === "") return nullable ? null : numeric ? undefined : isArray ? [] : "";
          if (numeric) return parseNum(t); // not a number: sent as typed, so the API names the problem
          if (isArray) return t.split(",").map((x) => x.trim()).filter(Boolean).map((x) => (itemNumeric ? parseNum(x) : x));
          return txt.value;
        },
        set: (v) => { txt.value = v == null ? "" : Array.isArray(v) ? v.join(", ") : String(v); },
      };
    }
    if (s.default !== undefined) field.set(s.default);
    this.fields.set(path, field);
    return h("label", { class: "field", "data-field": path },
      h("span", { class: "name" }, name), input, h("span", { class: "hint" }, hint(inner, s.default)), error);
  }

  /** Fill from a (possibly partial) spec object; fields it does not mention keep their value. */
  setValues(obj: Record<string, unknown>, prefix: string[] = []): void {
    for (const [k, v] of Object.entries(obj)) {
      const p = [...prefix, k].join(".");
      if (this.fields.has(p)) this.fields.get(p)!.set(v);
      else if (v && typeof v === "object" && !Array.isArray(v)) this.setValues(v as Record<string, unknown>, [...prefix, k]);
    }
  }

  value(): Record<string, unknown> {
    const out: Record<string, unknown> = {};
    for (const [path, f] of this.fields) {
      const v = f.get();
      if (v === undefined) continue;
      const keys = path.split(".");
      let o = out;
      for (const k of keys.slice(0, -1)) o = (o[k] ??= {}) as Record<string, unknown>;
      o[keys.at(-1)!] = v;
    }
    return out;
  }

  clearErrors(): void {
    for (const f of this.fields.values()) { f.error.textContent = ""; f.error.parentElement?.classList.remove("invalid"); }
    for (const g of this.groups.values()) g.textContent = "";
  }

  /** Show each issue next to the deepest field or group its loc names (loc relative to the spec). */
  showErrors(issues: ValidationIssue[], locPrefix: string[] = ["body", "spec"]): void {
    this.clearErrors();
    for (const issue of issues) {
      let loc = issue.loc.map(String);
      if (locPrefix.every((p, i) => loc[i] === p)) loc = loc.slice(locPrefix.length);
      const msg = issue.msg.replace(/^Value error, /, "");
      let placed = false;
      for (let n = loc.length; n >= 0 && !placed; n--) {
        const p = loc.slice(0, n).join(".");
        const f = this.fields.get(p);
        if (f) { add(f.error, msg); f.error.parentElement?.classList.add("invalid"); placed = true; }
        else if (this.groups.has(p)) { add(this.groups.get(p)!, n ? msg : `${loc.join(".") || "spec"}: ${msg}`); placed = true; }
      }
    }
  }
}

function add(el: HTMLElement, msg: string): void {
  el.textContent = el.textContent ? `${el.textContent}; ${msg}` : msg;
}

function hint(s: Schema, dflt: unknown): string {
  const parts: string[] = [];
  if (s.minimum !== undefined) parts.push(`≥ ${s.minimum}`);
  if (s.exclusiveMinimum !== undefined) parts.push(`> ${s.exclusiveMinimum}`);
  if (s.maximum !== undefined) parts.push(`≤ ${s.maximum}`);
  if (s.exclusiveMaximum !== undefined) parts.push(`< ${s.exclusiveMaximum}`);
  if (dflt !== undefined && dflt !== null) parts.push(`default ${Array.isArray(dflt) ? dflt.join(", ") : dflt}`);
  return parts.join(", ");
}
