// Parrot live view: a session's DAG drawn as SVG (no library). Exposes window.ParrotDag = {draw, COLORS}.
//
// Nodes: variables (pills), requests (boxes), prefix contexts (dashed boxes). Edges: variable -> request
// (consumed), request -> variable (produced), prefix context -> request (forked from it; dashed).
// Layout, left to right in topological layers:
//   layer(node) = 0 for a node without predecessors, else 1 + max(layer(predecessor))
//   (a prefix context has no predecessor: it sits in the first layer, its requests after it);
//   within a layer nodes start in creation order, then two barycenter sweeps reduce edge crossings.
// Fill colour = state, outline = deduced objective (latency: solid purple, throughput: dashed teal), a
// coloured tag = the engine it ran on, translucent boxes = task groups. Every node carries data-* attributes
// (data-node, data-id, data-state, data-objective, data-group, data-engine, data-prefix) for tests and tools.
(function () {
  "use strict";
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = {
    request: { waiting: "#bdc1c6", ready: "#fbbc04", running: "#4285f4", finished: "#34a853", failed: "#ea4335" },
    variable: { pending: "#ffffff", ready: "#ceead6", failed: "#fad2cf" },
    objective: { latency: "#9334e6", throughput: "#12b5cb", none: "#5f6368" },
    engines: ["#e8710a", "#1a73e8", "#d01884", "#188038", "#9334e6", "#b06000", "#007b83", "#c5221f"],
  };
  const SIZE = { request: [190, 48], variable: [140, 26], prefix: [150, 30] };
  const COL_GAP = 70, ROW_GAP = 14, PAD = 16;
  let drawn = 0;  // makes each drawing's marker id unique in the page

  function el(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) e.setAttribute(k, String(v));
    if (parent) parent.appendChild(e);
    return e;
  }

  function clip(text, n) { return text.length > n ? text.slice(0, n - 1) + "…" : text; }

  function engineColor(engines, name) {
    if (!name) return null;
    const i = engines.indexOf(name);
    return COLORS.engines[(i < 0 ? engines.length : i) % COLORS.engines.length];
  }

  function fmt(t0, t) { return t === null || t === undefined ? "—" : (t - t0).toFixed(2) + " s"; }

  // Build nodes and edges of one session.
  function graphOf(session) {
    const nodes = new Map(), edges = [];
    let order = 0;
    for (const v of session.variables) nodes.set("v:" + v.var_id, { kind: "variable", data: v, order: order++ });
    for (const r of session.requests) {
      nodes.set("r:" + r.request_id, { kind: "request", data: r, order: order++ });
      for (const vid of r.inputs) if (nodes.has("v:" + vid)) edges.push(["v:" + vid, "r:" + r.request_id, "in"]);
      for (const vid of r.outputs) if (nodes.has("v:" + vid)) edges.push(["r:" + r.request_id, "v:" + vid, "out"]);
      if (r.prefix_context) {
        const pid = "p:" + r.prefix_context;
        if (!nodes.has(pid)) nodes.set(pid, { kind: "prefix", data: { context_id: r.prefix_context,
          tokens: r.num_shared_tokens, engine: r.engine }, order: order++ });
        edges.push([pid, "r:" + r.request_id, "prefix"]);
      }
    }
    return { nodes, edges };
  }

  function layout(g) {
    const preds = new Map(), succs = new Map();
    for (const id of g.nodes.keys()) { preds.set(id, []); succs.set(id, []); }
    for (const [a, b] of g.edges) { preds.get(b).push(a); succs.get(a).push(b); }
    // Kahn's order; the graph is acyclic (the manager rejects cycles)
    const indeg = new Map([...preds].map(([k, v]) => [k, v.length]));
    const queue = [...g.nodes.keys()].filter((k) => indeg.get(k) === 0);
    const layer = new Map();
    while (queue.length) {
      const id = queue.shift();
      layer.set(id, Math.max(0, ...preds.get(id).map((p) => layer.get(p) + 1)));
      for (const s of succs.get(id)) { indeg.set(s, indeg.get(s) - 1); if (indeg.get(s) === 0) queue.push(s); }
    }
    const columns = [];
    for (const [id, l] of layer) (columns[l] = columns[l] || []).push(id);
    for (const col of columns) if (col) col.sort((a, b) => g.nodes.get(a).order - g.nodes.get(b).order);
    const pos = new Map();
    const index = () => columns.forEach((col) => (col || []).forEach((id, i) => pos.set(id, i)));
    index();
    for (let sweep = 0; sweep < 2; sweep++) {
      for (const col of columns) {
        if (!col) continue;
        const bary = new Map(col.map((id) => {
          const ps = preds.get(id);
          return [id, ps.length ? ps.reduce((s, p) => s + pos.get(p), 0) / ps.length : pos.get(id)];
        }));
        col.sort((a, b) => bary.get(a) - bary.get(b) || g.nodes.get(a).order - g.nodes.get(b).order);
        col.forEach((id, i) => pos.set(id, i));
      }
    }
    // sources (no predecessor: inputs, prefix contexts) move next to what they feed: successors' barycenter
    for (const col of columns) {
      if (!col || !col.every((id) => !preds.get(id).length)) continue;
      const bary = new Map(col.map((id) => {
        const ss = succs.get(id);
        return [id, ss.length ? ss.reduce((s, x) => s + pos.get(x), 0) / ss.length : pos.get(id)];
      }));
      col.sort((a, b) => bary.get(a) - bary.get(b) || g.nodes.get(a).order - g.nodes.get(b).order);
      col.forEach((id, i) => pos.set(id, i));
    }
    // coordinates: columns left to right, each column centred vertically
    const heights = columns.map((col) => (col || []).reduce((h, id) => h + SIZE[g.nodes.get(id).kind][1] + ROW_GAP, -ROW_GAP));
    const height = Math.max(60, ...heights) + 2 * PAD + 14;
    const widths = columns.map((col) => Math.max(0, ...(col || []).map((id) => SIZE[g.nodes.get(id).kind][0])));
    let x = PAD;
    columns.forEach((col, l) => {
      let y = PAD + 14 + (height - 2 * PAD - 14 - heights[l]) / 2;
      for (const id of col || []) {
        const n = g.nodes.get(id), [w, h] = SIZE[n.kind];
        Object.assign(n, { x: x + (widths[l] - w) / 2, y, w, h });
        y += h + ROW_GAP;
      }
      x += widths[l] + COL_GAP;
    });
    return { width: Math.max(200, x - COL_GAP + PAD), height };
  }

  function drawEdge(svg, a, b, kind, marker) {
    const x1 = a.x + a.w, y1 = a.y + a.h / 2, x2 = b.x, y2 = b.y + b.h / 2, dx = Math.max(20, (x2 - x1) / 2);
    el("path", { d: `M${x1},${y1} C${x1 + dx},${y1} ${x2 - dx},${y2} ${x2},${y2}`, fill: "none",
      stroke: kind === "prefix" ? "#a142f4" : "#9aa0a6", "stroke-width": 1.3,
      "stroke-dasharray": kind === "prefix" ? "4 3" : null, "marker-end": `url(#${marker})`, "data-edge": kind }, svg);
  }

  function objectiveOf(r) { return r.sched && r.sched.criteria ? r.sched.criteria : "none"; }

  function drawRequest(svg, n, engines) {
    const r = n.data, obj = objectiveOf(r), group = r.sched && r.sched.task_group;
    const g = el("g", { "data-node": "request", "data-id": r.request_id, "data-state": r.status,
      "data-objective": obj, "data-group": group || "", "data-engine": r.engine || "",
      "data-prefix": r.prefix_context || "", transform: `translate(${n.x},${n.y})` }, svg);
    const ts = r.timestamps || {};
    el("title", {}, g).textContent = [`${r.request_id} ${r.label}`, `state: ${r.status}`,
      `objective: ${obj}${group ? ", task group " + group : ""}`, `engine: ${r.engine || "—"}`,
      r.prefix_context ? `prefix: ${r.prefix_context} (${r.num_shared_tokens} tokens shared)` : "prefix: —",
      `dispatched +${fmt(ts.submitted, ts.dispatched)}, first token +${fmt(ts.submitted, ts.first_token)}, ` +
      `finished +${fmt(ts.submitted, ts.finished)}`, r.error ? `error: ${r.error.cause}: ${r.error.message}` : ""]
      .filter(Boolean).join("\n");
    el("rect", { class: "body", width: n.w, height: n.h, rx: 6, fill: COLORS.request[r.status] || "#eee",
      stroke: COLORS.objective[obj], "stroke-width": obj === "none" ? 1 : 2.5,
      "stroke-dasharray": obj === "throughput" ? "6 3" : null }, g);
    el("text", { x: 8, y: 17, "font-size": 12, "font-weight": 600, fill: "#202124" }, g).textContent =
      clip(`${r.request_id} ${r.label}`, 26);
    const notes = [r.status, obj !== "none" ? obj : null, group ? "grp " + group : null].filter(Boolean).join(" · ");
    el("text", { x: 8, y: 32, "font-size": 10.5, fill: "#202124" }, g).textContent = clip(notes, 32);
    const ec = engineColor(engines, r.engine);
    if (ec) {
      el("rect", { x: 6, y: 36, width: 8, height: 8, rx: 2, fill: ec }, g);
      el("text", { x: 18, y: 44, "font-size": 10, fill: "#202124", class: "mono" }, g).textContent =
        clip(r.engine + (r.prefix_context ? ` · forked ${r.num_shared_tokens} tok` : ""), 30);
    }
  }

  function drawVariable(svg, n) {
    const v = n.data;
    const g = el("g", { "data-node": "variable", "data-id": v.var_id, "data-state": v.status,
      "data-objective": v.perf || "none", transform: `translate(${n.x},${n.y})` }, svg);
    el("title", {}, g).textContent = `%${v.number} ${v.name || v.var_id} (${v.var_id}): ${v.status}` +
      (v.perf ? `, get: ${v.perf}` : "") + (v.preview ? `\n${v.preview}` : "") +
      (v.error ? `\nerror: ${v.error.cause}` : "");
    el("rect", { width: n.w, height: n.h, rx: n.h / 2, fill: COLORS.variable[v.status] || "#fff",
      stroke: v.perf ? COLORS.objective[v.perf] : "#80868b", "stroke-width": v.perf ? 2 : 1 }, g);
    el("text", { x: n.w / 2, y: 17, "font-size": 11, "text-anchor": "middle", fill: "#202124" }, g).textContent =
      clip(`%${v.number} ${v.name || v.var_id}`, 20);
  }

  function drawPrefix(svg, n, engines) {
    const p = n.data;
    const g = el("g", { "data-node": "prefix", "data-id": p.context_id, "data-engine": p.engine || "",
      transform: `translate(${n.x},${n.y})` }, svg);
    el("title", {}, g).textContent = `prefix context ${p.context_id}: ${p.tokens} tokens on ${p.engine || "—"}`;
    el("rect", { width: n.w, height: n.h, rx: 4, fill: "#f3e8fd", stroke: engineColor(engines, p.engine) || "#a142f4",
      "stroke-dasharray": "4 3", "stroke-width": 1.5 }, g);
    el("text", { x: 8, y: 19, "font-size": 10.5, fill: "#202124" }, g).textContent =
      clip(`prefix ${p.tokens} tok · ${p.engine || ""}`, 26);
  }

  function drawGroups(svg, g) {
    const groups = new Map();
    for (const n of g.nodes.values()) {
      const grp = n.kind === "request" && n.data.sched && n.data.sched.task_group;
      if (grp) (groups.get(grp) || groups.set(grp, []).get(grp)).push(n);
    }
    for (const [name, members] of groups) {
      const x0 = Math.min(...members.map((m) => m.x)) - 7, y0 = Math.min(...members.map((m) => m.y)) - 16;
      const x1 = Math.max(...members.map((m) => m.x + m.w)) + 7, y1 = Math.max(...members.map((m) => m.y + m.h)) + 7;
      const box = el("g", { "data-node": "group", "data-id": name, "data-size": members.length }, svg);
      el("rect", { x: x0, y: y0, width: x1 - x0, height: y1 - y0, rx: 8, fill: "#9334e6", "fill-opacity": 0.07,
        stroke: "#9334e6", "stroke-opacity": 0.35 }, box);
      el("text", { x: x0 + 6, y: y0 + 11, "font-size": 10, fill: "#7627bb" }, box).textContent =
        `task group ${name} (${members.length})`;
    }
  }

  // Draw `session` into a fresh <svg>; `engines` is the list of engine names (a stable colour each).
  function draw(session, engines) {
    const g = graphOf(session);
    const { width, height } = layout(g);
    const svg = el("svg", { class: "dag", width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
      "aria-label": `DAG of session ${session.session_id}` });
    const defs = el("defs", {}, svg);
    const marker = `parrot-arrow-${++drawn}`;
    const m = el("marker", { id: marker, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7,
      orient: "auto-start-reverse" }, defs);
    el("path", { d: "M0,0 L10,5 L0,10 z", fill: "#9aa0a6" }, m);
    drawGroups(svg, g);
    for (const [a, b, kind] of g.edges) drawEdge(svg, g.nodes.get(a), g.nodes.get(b), kind, marker);
    for (const n of g.nodes.values()) {
      if (n.kind === "request") drawRequest(svg, n, engines);
      else if (n.kind === "variable") drawVariable(svg, n);
      else drawPrefix(svg, n, engines);
    }
    return svg;
  }

  window.ParrotDag = { draw, COLORS, engineColor };
})();
