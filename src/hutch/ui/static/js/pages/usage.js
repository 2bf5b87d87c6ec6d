// Usage over time as charts: cost per day, per sandbox and (admin) per project, from
// GET /v1/usage?group_by=...; the quantities in a table under each chart.

import { get } from "../api.js";
import { errorNotice, fmtCost, h, replace } from "../dom.js";
import { barChart } from "../chart.js";
import { costOf, groupKey, quantities, rowsOf } from "../usage_rows.js";

const DAY_MS = 86400 * 1000;

function table(rows, by) {
  const cols = new Set();
  for (const r of rows) for (const [k] of quantities(r)) cols.add(k);
  const names = [...cols];
  return h("table", { class: "list usage-table", "data-group": by },
    h("thead", {}, h("tr", {}, h("th", {}, by), names.map((n) => h("th", {}, n)), h("th", {}, "cost"))),
    h("tbody", {}, rows.map((r) => h("tr", {},
      h("td", {}, groupKey(r, by)),
      names.map((n) => h("td", {}, typeof r[n] === "number" ? String(Math.round(r[n] * 1000) / 1000) : "—")),
      h("td", {}, fmtCost(costOf(r)))))));
}

async function block(root, by, title, range) {
  const box = h("section", { class: "card", id: `usage-${by}` }, h("h2", {}, title), h("p", { class: "muted" }, "Loading…"));
  root.appendChild(box);
  try {
    const rows = rowsOf(await get("/v1/usage", { group_by: by, from: range.from, to: range.to }));
    if (by === "day") rows.sort((a, b) => groupKey(a, by).localeCompare(groupKey(b, by)));
    else rows.sort((a, b) => (costOf(b) || 0) - (costOf(a) || 0));
    const total = rows.reduce((s, r) => s + (costOf(r) || 0), 0);
    replace(box, h("h2", {}, title),
      h("p", { class: "muted" }, `Total ${fmtCost(total)} in ${rows.length} ${by === "day" ? "days" : by === "sandbox" ? "sandboxes" : "projects"}`),
      barChart(rows.map((r) => ({ label: groupKey(r, by), value: costOf(r) || 0 })), { title, format: fmtCost }),
      rows.length ? table(rows, by) : null);
  } catch (err) {
    replace(box, h("h2", {}, title), errorNotice(err, title));
  }
}

export async function render(root, ctx) {
  const days = h("select", { id: "usage-days" },
    [7, 30, 90].map((d) => h("option", { value: d, selected: d === 30 }, `last ${d} days`)));
  const body = h("div", { id: "usage-body" });
  replace(root, h("div", { class: "page-head" }, h("h1", {}, "Usage"), days), body);
  async function load() {
    replace(body);
    const to = new Date();
    const from = new Date(to.getTime() - Number(days.value) * DAY_MS);
    const range = { from: from.toISOString(), to: to.toISOString() };
    const blocks = [block(body, "day", "Cost per day", range), block(body, "sandbox", "Cost per sandbox", range)];
    // Per project is the instance admin's view (group_by=project is admin only).
    if (ctx.can("project.manage")) blocks.push(block(body, "project", "Cost per project", range));
    await Promise.all(blocks);
  }
  days.addEventListener("change", load);
  await load();
}
