// The project's API keys (owners and admin): list, create (the secret shown once),
// revoke.

import { del, get, post } from "../api.js";
import { errorNotice, fmtTime, h, notice, replace } from "../dom.js";

const ROLES = ["viewer", "operator", "developer", "owner"];

export async function render(root, ctx) {
  const project = ctx.project;
  const base = `/v1/projects/${project}/keys`;
  if (!ctx.can("key.manage")) {
    replace(root, h("h1", {}, "Keys"), notice("forbidden", `Your role (${ctx.role}) may not manage keys.`));
    return;
  }
  const rows = h("tbody", { id: "key-rows" });
  const msg = h("div", { id: "keys-status" });
  const created = h("div", { id: "key-created" });
  const name = h("input", { id: "key-name", required: true, pattern: "[a-z0-9][a-z0-9-]{0,62}", placeholder: "ci-bot" });
  const role = h("select", { id: "key-role" }, ROLES.map((r) => h("option", { value: r }, r)));
  const ttl = h("input", { id: "key-ttl", type: "number", min: 60, placeholder: "never" });
  const form = h("form", { id: "key-form", class: "inline-form", method: "post" },
    h("label", {}, "Name ", name), h("label", {}, "Role ", role), h("label", {}, "Expires in (s) ", ttl),
    h("button", { type: "submit", class: "primary" }, "Create key"));
  replace(root, h("h1", {}, `Keys of project ${project}`), form, created, msg,
    h("table", { class: "list", id: "keys" },
      h("thead", {}, h("tr", {}, ["Id", "Name", "Role", "Created", "Expires", "Last used", "Revoked", ""].map((t) => h("th", {}, t)))),
      rows));

  async function refresh() {
    try {
      const answer = await get(base);
      const keys = answer.keys || [];
      replace(rows, keys.map((k) => h("tr", { class: "key-row", "data-id": k.id },
        h("td", {}, h("code", {}, k.id)), h("td", {}, k.name), h("td", {}, k.role),
        h("td", {}, fmtTime(k.created_at)), h("td", {}, fmtTime(k.expires_at)),
        h("td", {}, fmtTime(k.last_used_at)), h("td", {}, fmtTime(k.revoked_at)),
        h("td", {}, k.revoked_at ? null : h("button", {
          type: "button", class: "danger revoke-key",
          onclick: async () => {
            try { await del(`${base}/${k.id}`); } catch (err) { replace(msg, errorNotice(err, "Revoke")); }
            refresh();
          },
        }, "Revoke")))));
      replace(msg);
    } catch (err) {
      replace(msg, errorNotice(err, "Keys"));
    }
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const body = { name: name.value.trim(), role: role.value };
    if (ttl.value) body.ttl_s = Number(ttl.value);
    try {
      const k = await post(base, body);
      // Shown once, here only (the daemon keeps just its hash): as the live value of a
      // password field, set as a property, so it is never part of the page's HTML.
      const secret = h("input", { id: "new-secret", type: "password", readonly: true, autocomplete: "off", size: 60 });
      secret.value = k.secret;
      const show = h("button", { type: "button", onclick: () => { secret.type = secret.type === "password" ? "text" : "password"; } }, "Show");
      const copy = h("button", { type: "button", onclick: async () => {
        try { await navigator.clipboard.writeText(secret.value); copy.textContent = "Copied"; } catch (_) { secret.type = "text"; secret.select(); }
      } }, "Copy");
      replace(created, h("div", { class: "notice ok" }, `Key ${k.id} (${k.role}) created. Copy its secret now; it is not shown again. `,
        secret, " ", show, " ", copy));
      name.value = "";
      refresh();
    } catch (err) {
      replace(created, errorNotice(err, "Create key"));
    }
  });
  await refresh();
}
