// The console's shell: sign-in, who am I, the hash router and the navigation.
// Pages live in pages/*.js; each exports render(main, ctx, params) and may return a
// cleanup function (timers, sockets) called when the user leaves the page.

import { ApiError, get, session } from "./api.js";
import { h, notice, replace } from "./dom.js";
import * as sandboxes from "./pages/sandboxes.js";
import * as sandbox from "./pages/sandbox.js";
import * as usage from "./pages/usage.js";
import * as keys from "./pages/keys.js";
import * as events from "./pages/events.js";

const main = document.getElementById("main");
const nav = document.getElementById("nav");
const who = document.getElementById("who");
const signOutButton = document.getElementById("sign-out");
let cleanup = null;
let ctx = null;

// Who the key is and what its role may do (GET /v1/whoami). The buttons follow it; the
// API checks every call anyway.
async function loadWho() {
  try {
    const me = await get("/v1/whoami");
    const perms = new Set(me.permissions || []);
    return { ...me, known: true, can: (p) => perms.has(p) };
  } catch (err) {
    if (err instanceof ApiError && err.missing) {
      // A daemon from before roles: one key that may do everything.
      return { key_id: "?", project: "default", role: "unknown", known: false, can: () => true };
    }
    throw err;
  }
}

function leave() {
  if (cleanup) {
    try { cleanup(); } catch (_) { /* the page is gone either way */ }
    cleanup = null;
  }
}

function signInPage(message) {
  leave();
  nav.hidden = true;
  signOutButton.hidden = true;
  who.textContent = "";
  const keyInput = h("input", {
    id: "api-key", name: "api-key", type: "password", autocomplete: "off",
    spellcheck: "false", required: true, placeholder: "hk_…",
  });
  const projectInput = h("input", {
    id: "project", name: "project", type: "text", autocomplete: "off",
    placeholder: "default", pattern: "[a-z0-9][a-z0-9-]{0,62}",
  });
  const error = h("div", { id: "sign-in-error" });
  if (message) replace(error, notice("error", message));
  // method=post and CSP form-action 'none': even without this script the key could
  // never be sent in a URL.
  const form = h("form", { id: "sign-in", method: "post", class: "card narrow" },
    h("h1", {}, "Sign in"),
    h("p", { class: "muted" }, "Use an API key of this hutch. It is kept in this tab's session storage only and sent as a header."),
    h("label", { for: "api-key" }, "API key"), keyInput,
    h("label", { for: "project" }, "Project (admin keys only; empty: the key's own)"), projectInput,
    h("button", { type: "submit", id: "sign-in-button", class: "primary" }, "Sign in"),
    error,
  );
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const key = keyInput.value.trim();
    keyInput.value = "";
    if (!key) return;
    session.signIn(key, projectInput.value.trim());
    await start();
  });
  replace(main, form);
  keyInput.focus();
}

async function start() {
  if (!session.key) return signInPage();
  try {
    ctx = await loadWho();
  } catch (err) {
    session.signOut();
    return signInPage(err.status === 401 ? `Sign-in refused: ${err.message}` : `Could not reach hutch: ${err.message}`);
  }
  nav.hidden = false;
  signOutButton.hidden = false;
  document.getElementById("nav-keys").hidden = !ctx.can("key.manage");
  document.getElementById("nav-events").hidden = !ctx.can("events.read");
  who.textContent = `${ctx.key_id} · ${ctx.role} · project ${ctx.project}`;
  document.body.dataset.role = ctx.role;
  route();
}

const PAGES = [
  [/^#\/sandboxes\/([a-z0-9-]+)$/, sandbox, "sandboxes"],
  [/^#\/usage$/, usage, "usage"],
  [/^#\/keys$/, keys, "keys"],
  [/^#\/events$/, events, "events"],
  [/^#\/sandboxes$/, sandboxes, "sandboxes"],
];

async function route() {
  if (!ctx) return;
  leave();
  const hash = location.hash || "#/sandboxes";
  let page = sandboxes;
  let params = [];
  let name = "sandboxes";
  for (const [re, mod, n] of PAGES) {
    const m = hash.match(re);
    if (m) { page = mod; params = m.slice(1); name = n; break; }
  }
  for (const a of nav.querySelectorAll("a")) a.classList.toggle("active", a.dataset.page === name);
  clearTimeout(route.t);
  const container = h("div", { class: "page", id: `page-${name}` });
  replace(main, container);
  try {
    cleanup = (await page.render(container, ctx, params)) || null;
  } catch (err) {
    replace(container, notice("error", `This page failed: ${err.message}`));
  }
}

signOutButton.addEventListener("click", () => {
  session.signOut();
  ctx = null;
  history.replaceState(null, "", location.pathname);
  signInPage();
});
window.addEventListener("hashchange", route);
window.addEventListener("hutch:unauthorized", (ev) => {
  if (!ctx) return;
  session.signOut();
  ctx = null;
  signInPage(`Signed out: ${ev.detail}`);
});

start();
