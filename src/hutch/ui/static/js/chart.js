// Bar charts drawn as SVG by hand (no chart library to vendor): one bar per group, the
// value's label above it, the group's label below. Text goes in as text nodes.

const SVG = "http://www.w3.org/2000/svg";

function s(tag, attrs, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

// bars: [{label, value}], format: value -> string. Returns an <svg> element.
export function barChart(bars, { title, format = String, width = 720, height = 240 } = {}) {
  const pad = { top: 24, right: 12, bottom: 48, left: 12 };
  const svg = s("svg", {
    viewBox: `0 0 ${width} ${height}`, class: "chart", role: "img",
    "aria-label": title || "chart", "data-bars": bars.length,
  });
  if (title) svg.appendChild(s("title", {}, title));
  const max = Math.max(0, ...bars.map((b) => b.value || 0));
  const innerW = width - pad.left - pad.right;
  const innerH = height - pad.top - pad.bottom;
  svg.appendChild(s("line", { x1: pad.left, y1: pad.top + innerH, x2: width - pad.right, y2: pad.top + innerH, class: "axis" }));
  if (!bars.length) {
    svg.appendChild(s("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }, "no usage in this range"));
    return svg;
  }
  const slot = innerW / bars.length;
  const barW = Math.max(2, Math.min(60, slot * 0.7));
  bars.forEach((b, i) => {
    const v = b.value || 0;
    const bh = max > 0 ? (v / max) * innerH : 0;
    const x = pad.left + i * slot + (slot - barW) / 2;
    const y = pad.top + innerH - bh;
    const g = s("g", { class: "bar", "data-label": b.label, "data-value": v });
    const rect = s("rect", { x, y, width: barW, height: Math.max(bh, v > 0 ? 1 : 0) });
    rect.appendChild(s("title", {}, `${b.label}: ${format(v)}`));
    g.appendChild(rect);
    if (bars.length <= 31) {
      g.appendChild(s("text", { x: x + barW / 2, y: y - 4, "text-anchor": "middle", class: "value" }, format(v)));
      const label = b.label.length > 12 ? b.label.slice(0, 11) + "…" : b.label;
      g.appendChild(s("text", { x: x + barW / 2, y: pad.top + innerH + 16, "text-anchor": "middle", class: "label" }, label));
    }
    svg.appendChild(g);
  });
  return svg;
}
