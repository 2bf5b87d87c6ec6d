// Sandboxes: state, shape, uptime and cost so far; create and delete where the role may.

import { del, get, post } from "../api.js";
import { errorNotice, fmtCost, fmtDuration, h, notice, replace } from "../dom.js";
import { costOf, rowsOf } from "../usage_rows.js";

const LIVE = new Set(["creating", "running", "pausing", "paused", "resuming"]);

export function shape(sb) {
  return `${sb.vcpus} vCPU · ${sb.memory_mib} MiB · ${sb.disk_gib} GiB`;
}

// Seconds the sandbox has been up: since it started, until it ended (or now).
export function uptime(sb, now = Date.now()) {
  if (!sb.started_at) return null;
  const end = sb.ended_at ? Date.parse(sb.ended_at) : now;
  return (end - Date.parse(sb.started_at)) / 1000;
}

async function costs() {
  // Cost so far per sandbox, from the meter; null when this daemon has no meter.
  try {
    // from=0: since the beginning (the meter's default window is this month only).
    const rows = rowsOf(await get("/v1/usage", { group_by: "sandbox", from: 0 }));
    const out = new Map();
    for (const r of rows) out.set(String(r.sandbox_id ?? r.sandbox ?? r.key), costOf(r));
    return { map: out };
  } catch (err) {
    return { error: err };
  }
}

function createForm(ctx, onCreated) {
  const status = h("div", { class: "form-status" });
  const image = h("select", { id: "create-image", name: "image" });
  get("/v1/images").then(({ images }) => {
    for (const im of images) image.appendChild(h("option", { value: im.name, selected: im.name === "base" }, im.name));
  }).catch((err) => replace(status, errorNotice(err, "Images")));
  const name = h("input", { id: "create-name", name: "name", placeholder: "optional", pattern: "[a-z0-9][a-z0-9-]{0,62}" });
  const vcpus = h("input", { id: "create-vcpus", name: "vcpus", type: "number", min: 1, max: 16, value: 1 });
  const memory = h("input", { id: "create-memory", name: "memory_mib", type: "number", min: 128, step: 128, value: 256 });
  const button = h("button", { type: "submit", class: "primary", id: "create-submit" }, "Create");
  const form = h("form", { id: "create-form", class: "inline-form", method: "post" },
    h("label", {}, "Image ", image), h("label", {}, "Name ", name),
    h("label", {}, "vCPUs ", vcpus), h("label", {}, "Memory MiB ", memory), button, status);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    button.disabled = true;
    replace(status, notice("info", "Creating…"));
    const body = { image: image.value || "base", vcpus: Number(vcpus.value), memory_mib: Number(memory.value) };
    if (name.value.trim()) body.name = name.value.trim();
    try {
      const sb = await post("/v1/sandboxes", body);
      replace(status, notice("ok", `Created ${sb.id}.`));
      onCreated();
    } catch (err) {
      replace(status, errorNotice(err, "Create"));
    } finally {
      button.disabled = false;
    }
  });
  return form;
}

export async function render(root, ctx) {
  const canCreate = ctx.can("sandbox.create");
  const canDelete = ctx.can("sandbox.delete");
  const table = h("tbody", { id: "sandbox-rows" });
  const msg = h("div", { id: "sandboxes-status" });
  const costNote = h("div", { id: "cost-status" });
  const showEnded = h("input", { type: "checkbox", id: "show-ended" });
  replace(root,
    h("div", { class: "page-head" }, h("h1", {}, "Sandboxes"),
      h("label", { class: "muted" }, showEnded, " show ended")),
    canCreate ? createForm(ctx, () => { cost = null; refresh(); }) : null,
    msg, costNote,
    h("table", { class: "list", id: "sandboxes" },
      h("thead", {}, h("tr", {}, ["Sandbox", "Image", "State", "Shape", "Uptime", "Cost so far", ""].map((t) => h("th", {}, t)))),
      table));
  let timer = null;
  let gone = false;
  let cost = null;
  let costAt = 0;

  async function refresh() {
    clearTimeout(timer);
    let list;
    try {
      list = (await get("/v1/sandboxes")).sandboxes;
      replace(msg);
    } catch (err) {
      replace(msg, errorNotice(err, "Sandboxes"));
      list = null;
    }
    // The list refreshes every 3 s; the costs (a sum over the meter) every 15 s.
    if (!cost || Date.now() - costAt > 15000) {
      cost = await costs();
      costAt = Date.now();
    }
    if (gone) return;
    replace(costNote, cost.error ? errorNotice(cost.error, "Cost so far (usage)") : null);
    if (list) {
      const shown = list.filter((sb) => showEnded.checked || LIVE.has(sb.state));
      shown.sort((a, b) => String(b.created_at).localeCompare(String(a.created_at)));
      replace(table, shown.length ? shown.map((sb) => row(sb, cost.map)) :
        h("tr", {}, h("td", { colspan: 7, class: "muted" }, "No sandboxes.")));
    }
    timer = setTimeout(refresh, 3000);
  }

  function row(sb, costMap) {
    const actions = h("td", { class: "actions" });
    if (canDelete && LIVE.has(sb.state)) {
      actions.appendChild(h("button", {
        type: "button", class: "danger delete-sandbox", "data-id": sb.id,
        onclick: async (ev) => {
          ev.target.disabled = true;
          try { await del(`/v1/sandboxes/${sb.id}`); } catch (err) { replace(msg, errorNotice(err, `Delete ${sb.id}`)); }
          refresh();
        },
      }, "Delete"));
    }
    const c = costMap ? costMap.get(sb.id) : undefined;
    return h("tr", { class: "sandbox-row", "data-id": sb.id, "data-state": sb.state },
      h("td", {}, h("a", { href: `#/sandboxes/${sb.id}`, class: "sandbox-link" }, sb.name ? `${sb.name} (${sb.id})` : sb.id)),
      h("td", {}, sb.image),
      h("td", {}, h("span", { class: `state state-${sb.state}` }, sb.state), sb.error ? h("div", { class: "muted" }, sb.error) : null),
      h("td", {}, shape(sb)),
      h("td", { class: "uptime" }, fmtDuration(uptime(sb))),
      h("td", { class: "cost" }, costMap ? fmtCost(c ?? 0) : "—"),
      actions);
  }

  showEnded.addEventListener("change", refresh);
  await refresh();
  return () => { gone = true; clearTimeout(timer); };
}
