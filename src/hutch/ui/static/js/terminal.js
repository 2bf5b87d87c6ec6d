// A live terminal in the sandbox: xterm.js on the PTY WebSocket
// (/v1/sandboxes/{id}/pty). A browser cannot set headers on a WebSocket, so the key
// goes in the first message ({"type":"auth","token":...}); never in the URL.
// Binary frames are terminal bytes both ways; text frames are JSON control.

import { Terminal } from "../vendor/xterm/xterm.mjs";
import { FitAddon } from "../vendor/xterm/addon-fit.mjs";
import { session, socketUrl } from "./api.js";

export function openTerminal(container, sandboxId, onStatus) {
  const term = new Terminal({ cursorBlink: true, fontSize: 13, convertEol: false, scrollback: 2000 });
  const fit = new FitAddon();
  term.loadAddon(fit);
  term.open(container);
  try { fit.fit(); } catch (_) { /* not laid out yet */ }
  const ws = new WebSocket(socketUrl(`/v1/sandboxes/${sandboxId}/pty`, { rows: term.rows, cols: term.cols }));
  ws.binaryType = "arraybuffer";
  const encoder = new TextEncoder();
  let closedByUs = false;

  ws.addEventListener("open", () => {
    ws.send(JSON.stringify({ type: "auth", token: session.key }));
    onStatus("connecting", "authenticating…");
  });
  ws.addEventListener("message", (ev) => {
    if (typeof ev.data !== "string") {
      term.write(new Uint8Array(ev.data));
      return;
    }
    let msg;
    try { msg = JSON.parse(ev.data); } catch (_) { return; }
    if (msg.type === "ready") {
      onStatus("ready", `connected (pty ${msg.pty_id}, pid ${msg.pid})`);
      term.focus();
    } else if (msg.type === "exit") {
      onStatus("exited", `the shell exited (code ${msg.exit_code ?? "—"}${msg.signal ? `, signal ${msg.signal}` : ""})`);
    } else if (msg.type === "detached") {
      onStatus("detached", "another client attached to this terminal");
    } else if (msg.type === "error") {
      onStatus("error", `${msg.code}: ${msg.message}`);
    }
  });
  ws.addEventListener("close", (ev) => {
    if (!closedByUs && ev.code !== 1000) onStatus("closed", `connection closed (${ev.code}${ev.reason ? ` ${ev.reason}` : ""})`);
    else if (!closedByUs) onStatus("closed", "connection closed");
  });
  term.onData((data) => {
    if (ws.readyState === WebSocket.OPEN) ws.send(encoder.encode(data));
  });
  term.onResize(({ rows, cols }) => {
    if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "resize", rows, cols }));
  });
  const onWindowResize = () => { try { fit.fit(); } catch (_) { /* detached */ } };
  window.addEventListener("resize", onWindowResize);

  return {
    term,
    close() {
      closedByUs = true;
      window.removeEventListener("resize", onWindowResize);
      // Hang up: the shell ends instead of running on unattached in the guest.
      if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "close" }));
      setTimeout(() => ws.close(1000), 200);
      term.dispose();
    },
  };
}
