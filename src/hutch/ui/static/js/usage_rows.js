// Reading GET /v1/usage rows (platform-meter's shape: rows with the group's key, the
// quantities and the cost). Tolerant on purpose: a field the daemon does not send shows
// as "—" rather than breaking the page.

export function groupKey(row, by) {
  const fields = { day: ["day", "date", "key"], sandbox: ["sandbox_id", "sandbox", "key"], project: ["project", "key"] }[by] || ["key"];
  for (const f of fields) if (row[f] !== undefined && row[f] !== null) return String(row[f]);
  return "?";
}

export function costOf(row) {
  if (!row) return null;
  for (const f of ["cost_usd", "total_cost", "cost"]) {
    const v = row[f];
    if (typeof v === "number") return v;
    if (v && typeof v === "object") {
      if (typeof v.total === "number") return v.total;
      if (typeof v.total_usd === "number") return v.total_usd;
    }
  }
  return null;
}

// The quantities of a row as [label, value] pairs, for the tables: every numeric field
// other than the cost.
export function quantities(row) {
  const out = [];
  for (const [k, v] of Object.entries(row || {})) {
    if (typeof v === "number" && !["cost", "cost_usd", "total_cost"].includes(k)) out.push([k, v]);
  }
  return out;
}

export function rowsOf(answer) {
  if (!answer) return [];
  if (Array.isArray(answer)) return answer;
  return answer.rows || answer.usage || answer.groups || [];
}
