// The REST client of the console: every call carries the signed-in key as
// `Authorization: Bearer` (never in a URL). The key lives in sessionStorage only, so it
// goes away with the tab and is never written into the page.

const KEY = "hutch.key";
const PROJECT = "hutch.project";

export class ApiError extends Error {
  constructor(status, code, message, path) {
    super(message);
    this.status = status;
    this.code = code;
    this.path = path;
  }
  // The route itself is missing on this daemon (an older one, or a part not merged
  // yet): the framework's bare 404, not hutch's "no sandbox ..." one.
  get missing() {
    return this.status === 404 && this.message === "Not Found";
  }
}

export const session = {
  get key() { return sessionStorage.getItem(KEY); },
  get project() { return sessionStorage.getItem(PROJECT) || ""; },
  signIn(key, project) {
    sessionStorage.setItem(KEY, key);
    if (project) sessionStorage.setItem(PROJECT, project);
    else sessionStorage.removeItem(PROJECT);
  },
  signOut() {
    sessionStorage.removeItem(KEY);
    sessionStorage.removeItem(PROJECT);
  },
};

function headers(extra) {
  const h = { Authorization: `Bearer ${session.key}`, ...extra };
  if (session.project) h["Hutch-Project"] = session.project;
  return h;
}

export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) {
    if (v !== undefined && v !== null && v !== "") q.append(k, String(v));
  }
  const s = q.toString();
  return s ? `?${s}` : "";
}

async function fail(res, path) {
  let code = "http_" + res.status;
  let message = `${res.status} ${res.statusText}`;
  try {
    const body = await res.json();
    if (body && body.error) {
      code = body.error.code || code;
      message = body.error.message || message;
    } else if (body && body.detail) {
      message = String(body.detail);
    }
  } catch (_) { /* not JSON */ }
  if (res.status === 401) window.dispatchEvent(new CustomEvent("hutch:unauthorized", { detail: message }));
  throw new ApiError(res.status, code, message, path);
}

export async function request(method, path, { body, params, raw } = {}) {
  const init = { method, headers: headers(), cache: "no-store", credentials: "omit" };
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  const res = await fetch(path + query(params), init);
  if (!res.ok) await fail(res, path);
  if (raw) return res;
  if (res.status === 204) return null;
  return res.json();
}

export const get = (path, params) => request("GET", path, { params });
export const post = (path, body, params) => request("POST", path, { body, params });
export const del = (path, params) => request("DELETE", path, { params });

// The terminal WebSocket's URL: same origin, ws or wss; the key goes in the first
// message ({"type":"auth"}), never here.
export function socketUrl(path, params) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}${path}${query(params)}`;
}
