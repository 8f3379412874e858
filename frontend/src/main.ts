// Entry point: hash routes (#/jobs, #/jobs/new, #/jobs/<id>, #/signin), so any URL works from the static mount.
// Build: `npm run build` (dist/ is served by the backend at /). Each page returns a cleanup function.
import "uplot/dist/uPlot.min.css";
import "./style.css";
import { clearToken, get, getToken, onUnauthorized, type User } from "./api";
import { clear, h } from "./dom";
import { jobPage } from "./pages/job";
import { jobsPage } from "./pages/jobs";
import { newJobPage } from "./pages/new_job";
import { signInPage } from "./pages/signin";
import { navigate, onRerender, type Cleanup } from "./router";

let cleanup: Cleanup | null = null;
let me: User | null = null;

async function topbar(): Promise<void> {
  const bar = document.getElementById("topbar")!;
  clear(bar);
  bar.append(h("a", { class: "brand", href: "#/jobs" }, "TLT Studio"));
  if (!getToken()) return;
  if (!me) {
    try { me = await get<User>("users/me"); } catch { me = null; }
  }
  bar.append(
    h("nav", {}, h("a", { href: "#/jobs" }, "Jobs"), h("a", { href: "#/jobs/new" }, "New job")),
    h("span", { class: "who", "data-testid": "who" }, me ? `${me.name}${me.is_admin ? " (admin)" : ""}` : ""),
    h("button", { class: "link", onclick: () => { clearToken(); me = null; navigate("#/signin"); } }, "Sign out"),
  );
}

async function render(): Promise<void> {
  cleanup?.();
  cleanup = null;
  const app = document.getElementById("app")!;
  clear(app);
  const route = location.hash.replace(/^#/, "") || "/jobs";
  if (!getToken() && route !== "/signin") { navigate("#/signin"); return; }
  void topbar();
  let m: RegExpMatchArray | null;
  if (route === "/signin") cleanup = signInPage(app);
  else if (route === "/jobs/new") cleanup = newJobPage(app);
  else if ((m = route.match(/^\/jobs\/(\d+)$/))) cleanup = jobPage(app, Number(m[1]));
  else cleanup = jobsPage(app);
}

onUnauthorized(() => { clearToken(); me = null; if (location.hash !== "#/signin") navigate("#/signin"); });
window.addEventListener("hashchange", () => void render());
onRerender(() => void render());
void render();
