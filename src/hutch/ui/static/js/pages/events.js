// The project's audit trail (GET /v1/events): who (key id, address) did what, newest
// first, filterable by type; "Older" pages back with after=.

import { get } from "../api.js";
import { errorNotice, fmtTime, h, replace } from "../dom.js";

const PAGE = 200;

function summary(data) {
  if (!data || typeof data !== "object") return "";
  return Object.entries(data).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
}

export async function render(root) {
  const type = h("input", { id: "events-type", placeholder: "type, e.g. sandbox.* or sandbox.exec" });
  const sandbox = h("input", { id: "events-sandbox", placeholder: "sandbox id" });
  const rows = h("tbody", { id: "audit-rows" });
  const msg = h("div", { id: "audit-status" });
  const form = h("form", { class: "inline-form", method: "post" },
    h("label", {}, "Type ", type), h("label", {}, "Sandbox ", sandbox),
    h("button", { type: "submit" }, "Filter"));
  replace(root, h("h1", {}, "Audit trail"), form, msg,
    h("table", { class: "list", id: "audit" },
      h("thead", {}, h("tr", {}, ["Time", "Type", "Sandbox", "Key", "From", "Details"].map((t) => h("th", {}, t)))),
      rows));

  async function load() {
    try {
      // Oldest first from the API, paged with after=; walk to the newest page.
      let after = 0;
      let all = [];
      for (let i = 0; i < 20; i += 1) {
        const page = await get("/v1/events", { type: type.value.trim(), sandbox: sandbox.value.trim(), after, limit: PAGE });
        all = all.concat(page.events || []);
        if (!page.events || page.events.length < PAGE) break;
        after = page.next_after;
        if (all.length > 2000) all = all.slice(-2000);
      }
      all.reverse();
      replace(rows, all.length ? all.map((ev) => h("tr", { class: "audit-row", "data-type": ev.type },
        h("td", {}, fmtTime(ev.at)), h("td", {}, ev.type),
        h("td", {}, ev.sandbox_id ? h("a", { href: `#/sandboxes/${ev.sandbox_id}` }, ev.sandbox_id) : "—"),
        h("td", {}, ev.actor || "(daemon)"), h("td", {}, ev.source || "—"), h("td", {}, h("code", {}, summary(ev.data)))))
        : h("tr", {}, h("td", { colspan: 6, class: "muted" }, "No events.")));
      replace(msg);
    } catch (err) {
      replace(msg, errorNotice(err, "The audit trail"));
    }
  }
  form.addEventListener("submit", (ev) => { ev.preventDefault(); load(); });
  await load();
}
