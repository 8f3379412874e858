// Sign-in: paste an API token (`tlt token create`); it is checked against /users/me and kept in localStorage.
import { ApiError, clearToken, get, setToken, type User } from "../api";
import { h } from "../dom";
import { navigate, type Cleanup } from "../router";

export function signInPage(root: HTMLElement): Cleanup {
  const input = h("input", { type: "password", name: "token", placeholder: "tlt_…", autocomplete: "off", size: 50 });
  const msg = h("p", { class: "error", "data-testid": "signin-error" });
  const form = h("form", { class: "card narrow" },
    h("h1", {}, "Sign in"),
    h("p", { "data-testid": "signin-hint" }, "Paste an API token. Create one with ",
      h("code", {}, "tlt token create --admin"),
      " (an admin token: every user's jobs, the demo's included); ",
      h("code", {}, "tlt token create --user NAME"), " makes an ordinary token that sees NAME's jobs only."),
    h("label", {}, "API token ", input),
    h("button", { type: "submit" }, "Sign in"),
    msg,
  );
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    msg.textContent = "";
    setToken(input.value.trim());
    try {
      await get<User>("users/me");
      navigate("#/jobs");
    } catch (e) {
      clearToken();
      msg.textContent = e instanceof ApiError && e.status === 401 ? "That token is invalid or revoked." : String(e);
    }
  });
  root.append(form);
  input.focus();
  return () => {};
}
