// One sandbox: its state and shape, pause/resume/delete where the role may, the events
// timeline, egress counters and log, a files browser and a live terminal.

import { del, get, post, request } from "../api.js";
import { errorNotice, fmtBytes, fmtDuration, fmtTime, h, notice, replace } from "../dom.js";
import { openTerminal } from "../terminal.js";
import { shape, uptime } from "./sandboxes.js";

const FILE_VIEW_MAX = 64 * 1024;

function section(id, title, ...body) {
  return h("section", { id, class: "card" }, h("h2", {}, title), ...body);
}

function summary(data) {
  if (!data || typeof data !== "object") return "";
  return Object.entries(data)
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`)
    .join(" ");
}

export async function render(root, ctx, [id]) {
  const base = `/v1/sandboxes/${id}`;
  const head = h("div", { id: "sandbox-head" });
  const actions = h("div", { class: "actions", id: "sandbox-actions" });
  const actionMsg = h("div");
  const events = h("ol", { id: "events", class: "timeline" });
  const eventsMsg = h("div", { id: "events-status" });
  const egressCounters = h("div", { id: "egress-counters" });
  const egressLog = h("tbody", { id: "egress-log" });
  const egressMsg = h("div", { id: "egress-status" });
  const filesPath = h("div", { id: "files-path", class: "crumbs" });
  const filesList = h("tbody", { id: "files-list" });
  const fileView = h("pre", { id: "file-view", class: "file-view", hidden: true });
  const filesMsg = h("div", { id: "files-status" });
  const termBox = h("div", { id: "terminal", class: "terminal" });
  const termStatus = h("div", { id: "terminal-status", class: "muted" });
  const termButton = h("button", { type: "button", id: "open-terminal", class: "primary" }, "Open terminal");
  const canUse = ctx.can("sandbox.use");

  replace(root,
    h("p", {}, h("a", { href: "#/sandboxes" }, "← Sandboxes")),
    h("div", { class: "page-head" }, h("h1", {}, id), actions), head, actionMsg,
    section("terminal-card", "Terminal",
      canUse ? h("div", { class: "row" }, termButton, termStatus) : notice("forbidden", `Your role (${ctx.role}) may not open terminals.`),
      termBox),
    section("events-card", "Events", eventsMsg, events),
    section("egress-card", "Egress", egressMsg, egressCounters,
      h("table", { class: "list" }, h("thead", {}, h("tr", {}, ["Time", "Verdict", "Destination", "Name", "Rule", "Reason"].map((t) => h("th", {}, t)))), egressLog)),
    section("files-card", "Files",
      canUse ? [filesMsg, filesPath, h("table", { class: "list" }, h("thead", {}, h("tr", {}, ["Name", "Type", "Size", "Modified"].map((t) => h("th", {}, t)))), filesList), fileView]
        : notice("forbidden", `Your role (${ctx.role}) may not browse files.`)));

  let sb = null;
  let timer = null;
  let gone = false;
  let term = null;
  let lastSeq = null;
  let filesLoaded = false;

  async function loadSandbox() {
    try {
      sb = await get(base);
    } catch (err) {
      replace(head, errorNotice(err, "Sandbox"));
      return false;
    }
    replace(head, h("dl", { class: "facts" },
      h("dt", {}, "State"), h("dd", { id: "sandbox-state" }, h("span", { class: `state state-${sb.state}` }, sb.state), sb.error ? ` — ${sb.error}` : ""),
      h("dt", {}, "Name"), h("dd", {}, sb.name || "—"),
      h("dt", {}, "Image"), h("dd", {}, sb.image),
      h("dt", {}, "Shape"), h("dd", {}, shape(sb)),
      h("dt", {}, "Uptime"), h("dd", {}, fmtDuration(uptime(sb))),
      h("dt", {}, "Created"), h("dd", {}, fmtTime(sb.created_at)),
      h("dt", {}, "Address"), h("dd", {}, (sb.network && sb.network.address) || "—")));
    renderActions();
    return true;
  }

  function act(label, cls, fn) {
    return h("button", {
      type: "button", class: cls, id: `action-${label.toLowerCase()}`,
      onclick: async (ev) => {
        ev.target.disabled = true;
        try { await fn(); replace(actionMsg); } catch (err) { replace(actionMsg, errorNotice(err, label)); }
        await loadSandbox();
      },
    }, label);
  }

  function renderActions() {
    const live = !["destroyed", "failed"].includes(sb.state);
    replace(actions,
      ctx.can("sandbox.lifecycle") && sb.state === "running" ? act("Pause", "", () => post(`${base}/pause`, {})) : null,
      ctx.can("sandbox.lifecycle") && sb.state === "paused" ? act("Resume", "", () => post(`${base}/resume`, {})) : null,
      ctx.can("sandbox.delete") && live ? act("Delete", "danger", () => del(base)) : null);
  }

  async function loadEvents() {
    try {
      const answer = await get(`${base}/events`, { after: lastSeq ?? undefined, limit: 200 });
      const list = answer.events || [];
      if (lastSeq === null) replace(events);
      for (const ev of list) {
        lastSeq = ev.seq ?? lastSeq;
        events.appendChild(h("li", { class: "event", "data-type": ev.type, "data-seq": ev.seq },
          h("time", {}, fmtTime(ev.at)), " ",
          h("strong", { class: "event-type" }, ev.type), " ",
          ev.actor ? h("span", { class: "muted" }, `by ${ev.actor}${ev.source ? ` from ${ev.source}` : ""} `) : null,
          h("code", {}, summary(ev.data))));
      }
      if (lastSeq === null && !list.length) replace(events, h("li", { class: "muted" }, "No events yet."));
      replace(eventsMsg);
    } catch (err) {
      replace(eventsMsg, errorNotice(err, "Events"));
      return !err.missing;
    }
    return true;
  }

  async function loadEgress() {
    try {
      const [e, log] = await Promise.all([get(`${base}/egress`), get(`${base}/egress/log`, { limit: 100 })]);
      replace(egressCounters, h("dl", { class: "facts" },
        h("dt", {}, "Mode"), h("dd", { id: "egress-mode" }, e.mode),
        h("dt", {}, "Rules"), h("dd", {}, e.rules.length ? e.rules.join(", ") : "none (open)"),
        h("dt", {}, "Allowed"), h("dd", { id: "egress-allowed" }, String(e.allowed)),
        h("dt", {}, "Denied"), h("dd", { id: "egress-denied" }, String(e.denied)),
        h("dt", {}, "Rate limited"), h("dd", {}, String(e.rate_limited)),
        h("dt", {}, "Log dropped"), h("dd", {}, String(e.log_dropped))));
      const rows = (log.events || []).slice().reverse();
      replace(egressLog, rows.length ? rows.map((r) => h("tr", { class: `verdict-${r.verdict}` },
        h("td", {}, fmtTime(r.time)), h("td", {}, r.verdict), h("td", {}, `${r.destination}${r.port ? `:${r.port}` : ""} ${r.protocol}`),
        h("td", {}, r.name || "—"), h("td", {}, r.rule || "—"), h("td", {}, r.reason)))
        : h("tr", {}, h("td", { colspan: 6, class: "muted" }, "No connections logged.")));
      replace(egressMsg);
    } catch (err) {
      replace(egressMsg, errorNotice(err, "Egress"));
    }
  }

  async function browse(path) {
    filesLoaded = true;
    fileView.hidden = true;
    try {
      const { entries } = await get(`${base}/files/list`, { path });
      const parts = path.split("/").filter(Boolean);
      replace(filesPath, h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); browse("/"); } }, "/"),
        parts.map((p, i) => [h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); browse("/" + parts.slice(0, i + 1).join("/")); } }, p), "/"]));
      entries.sort((a, b) => (a.type === "dir" ? 0 : 1) - (b.type === "dir" ? 0 : 1) || a.name.localeCompare(b.name));
      replace(filesList, entries.length ? entries.map((e) => h("tr", { class: "file", "data-name": e.name, "data-type": e.type },
        h("td", {}, h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); e.type === "dir" ? browse(e.path) : view(e); } }, e.name + (e.type === "dir" ? "/" : ""))),
        h("td", {}, e.type), h("td", {}, e.type === "dir" ? "—" : fmtBytes(e.size)), h("td", {}, fmtTime(e.mtime))))
        : h("tr", {}, h("td", { colspan: 4, class: "muted" }, "Empty directory.")));
      replace(filesMsg);
    } catch (err) {
      replace(filesMsg, errorNotice(err, "Files"));
    }
  }

  async function view(entry) {
    try {
      const res = await request("GET", `${base}/files`, { params: { path: entry.path }, raw: true });
      const buf = await res.arrayBuffer();
      const text = new TextDecoder("utf-8", { fatal: false }).decode(buf.slice(0, FILE_VIEW_MAX));
      fileView.textContent = `${entry.path} (${fmtBytes(buf.byteLength)})\n\n${text}${buf.byteLength > FILE_VIEW_MAX ? "\n…" : ""}`;
      fileView.hidden = false;
    } catch (err) {
      replace(filesMsg, errorNotice(err, `Read ${entry.path}`));
    }
  }

  termButton.addEventListener("click", () => {
    if (term) { term.close(); term = null; }
    replace(termBox);
    termStatus.textContent = "connecting…";
    term = openTerminal(termBox, id, (state, text) => {
      termStatus.textContent = text;
      termStatus.dataset.state = state;
    });
    termButton.textContent = "Reconnect";
  });

  let eventsLive = true;
  async function tick() {
    clearTimeout(timer);
    if (gone) return;
    const ok = await loadSandbox();
    if (ok) {
      if (eventsLive) eventsLive = await loadEvents();
      await loadEgress();
      if (canUse && !filesLoaded && sb.state === "running") await browse("/root");
    }
    if (!gone) timer = setTimeout(tick, 3000);
  }
  await tick();
  return () => {
    gone = true;
    clearTimeout(timer);
    if (term) term.close();
  };
}
