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
// Flows: a node a flow made (snapshot "flow": its origin described) is drawn in its scope's band — one band per
// loop iteration, branch case or map item (flow.scope), stacked under the nodes made by the client, each boxed
// and titled ("f_1 · loop counting iteration 2", a case: taken / speculative / cancelled) — and a request gets a
// badge line (flow id + "loop[2] › case1"). They carry data-flow, data-origin, data-scope and data-badge.
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
  const FLOW_REQUEST = [190, 62];  // a request a flow made: one more line, its badge
  const COL_GAP = 70, ROW_GAP = 14, PAD = 16;
  const BAND_TOP = 34, BAND_BOTTOM = 10, BAND_GAP = 12;  // a flow scope's box: room for its title above
  const CASE_COLORS = { taken: "#188038", speculative: "#e37400", cancelled: "#c5221f", pending: "#80868b" };
  const SCOPE_COLORS = ["#1a73e8", "#e8710a"];  // alternating loop iterations / map items
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

  function sizeOf(n) { return n.kind === "request" && n.data.flow ? FLOW_REQUEST : SIZE[n.kind]; }

  // The band of a node: "" (made by the client) or its flow scope (a loop iteration, a case, a map item, the
  // flow's top level). A prefix context goes with the first request forked from it.
  function bandOf(n) { return n.data.flow ? n.data.flow.scope : ""; }

  function innermost(flow) { return flow && flow.scopes.length ? flow.scopes[flow.scopes.length - 1] : null; }

  function scopeColor(scope) {
    if (!scope) return "#5f6368";
    if (scope.kind === "case") return CASE_COLORS[scope.case_state] || CASE_COLORS.pending;
    return SCOPE_COLORS[scope.index % 2];
  }

  function scopeTitle(flow) {
    const inner = innermost(flow);
    const name = flow.flow_name ? `${flow.flow_id} ${flow.flow_name}` : flow.flow_id;
    if (!inner) return `${name} (top level)`;
    const outer = flow.scopes.slice(0, -1).map((sc) => sc.label);
    return `${name} · ${outer.length ? outer.join(" › ") + " › " : ""}${inner.title}`;
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
          tokens: r.num_shared_tokens, engine: r.engine, flow: r.flow || null }, order: order++ });
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
    // coordinates: columns left to right; top to bottom one band per flow scope (the client's nodes first,
    // then each scope in the order its first node was made), each column centred vertically in its band
    const bandFirst = new Map();
    for (const n of g.nodes.values()) {
      const b = bandOf(n);
      if (!bandFirst.has(b)) bandFirst.set(b, n.order);
    }
    const bands = [...bandFirst.keys()].sort((a, b) =>
      (a === "" ? -1 : b === "" ? 1 : bandFirst.get(a) - bandFirst.get(b)));
    const widths = columns.map((col) => Math.max(0, ...(col || []).map((id) => sizeOf(g.nodes.get(id))[0])));
    const xs = [];
    let x = PAD;
    columns.forEach((col, l) => { xs[l] = x; x += widths[l] + COL_GAP; });
    let y0 = PAD + 14;
    for (const band of bands) {
      const cols = columns.map((col) => (col || []).filter((id) => bandOf(g.nodes.get(id)) === band));
      const heights = cols.map((col) => col.reduce((h, id) => h + sizeOf(g.nodes.get(id))[1] + ROW_GAP, -ROW_GAP));
      const bandH = Math.max(0, ...heights);
      if (band !== "") y0 += BAND_TOP;
      cols.forEach((col, l) => {
        let y = y0 + (bandH - heights[l]) / 2;
        for (const id of col) {
          const n = g.nodes.get(id), [w, h] = sizeOf(n);
          Object.assign(n, { x: xs[l] + (widths[l] - w) / 2, y, w, h });
          y += h + ROW_GAP;
        }
      });
      y0 += bandH + (band !== "" ? BAND_BOTTOM + BAND_GAP : ROW_GAP);
    }
    const height = Math.max(60 + 2 * PAD + 14, y0 + PAD);
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
    const flow = r.flow || null;
    const g = el("g", { "data-node": "request", "data-id": r.request_id, "data-state": r.status,
      "data-objective": obj, "data-group": group || "", "data-engine": r.engine || "",
      "data-prefix": r.prefix_context || "", "data-flow": flow ? flow.flow_id : null,
      "data-origin": flow ? flow.origin : null, "data-scope": flow ? flow.scope : null,
      "data-badge": flow ? flow.badge : null, transform: `translate(${n.x},${n.y})` }, svg);
    const ts = r.timestamps || {};
    el("title", {}, g).textContent = [`${r.request_id} ${r.label}`, `state: ${r.status}`,
      `objective: ${obj}${group ? ", task group " + group : ""}`, `engine: ${r.engine || "—"}`,
      r.prefix_context ? `prefix: ${r.prefix_context} (${r.num_shared_tokens} tokens shared)` : "prefix: —",
      `dispatched +${fmt(ts.submitted, ts.dispatched)}, first token +${fmt(ts.submitted, ts.first_token)}, ` +
      `finished +${fmt(ts.submitted, ts.finished)}`, flow ? `flow: ${scopeTitle(flow)}\norigin: ${flow.origin}` : "",
      r.error ? `error: ${r.error.cause}: ${r.error.message}` : ""]
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
    if (flow) drawBadge(g, flow, n.w);
  }

  // A request's flow badge: "f_1 · loop[2] › case1", coloured like its scope's box; a cancelled case crossed out.
  function drawBadge(g, flow, w) {
    const inner = innermost(flow), color = scopeColor(inner);
    const text = clip(flow.flow_id + (flow.badge ? " · " + flow.badge : "") +
      (inner && inner.kind === "case" && inner.case_state !== "taken" ? ` (${inner.case_state})` : ""), 32);
    const b = el("g", { class: "flow-badge",
      "data-case-state": inner && inner.case_state ? inner.case_state : null }, g);
    el("rect", { x: 6, y: 47, width: Math.min(w - 12, 12 + text.length * 5.6), height: 12, rx: 6, fill: "#fff",
      "fill-opacity": 0.92, stroke: color, "stroke-width": 1 }, b);
    el("text", { x: 11, y: 56.5, "font-size": 9, "font-weight": 600, fill: color, class: "mono",
      "text-decoration": inner && inner.case_state === "cancelled" ? "line-through" : null }, b).textContent = text;
  }

  function drawVariable(svg, n) {
    const v = n.data, flow = v.flow || null;
    const g = el("g", { "data-node": "variable", "data-id": v.var_id, "data-state": v.status,
      "data-objective": v.perf || "none", "data-flow": flow ? flow.flow_id : null,
      "data-origin": flow ? flow.origin : null, "data-scope": flow ? flow.scope : null,
      "data-badge": flow ? flow.badge : null, transform: `translate(${n.x},${n.y})` }, svg);
    el("title", {}, g).textContent = `%${v.number} ${v.name || v.var_id} (${v.var_id}): ${v.status}` +
      (v.perf ? `, get: ${v.perf}` : "") + (flow ? `\nflow: ${scopeTitle(flow)}\norigin: ${flow.origin}` : "") +
      (v.preview ? `\n${v.preview}` : "") + (v.error ? `\nerror: ${v.error.cause}` : "");
    el("rect", { width: n.w, height: n.h, rx: n.h / 2, fill: COLORS.variable[v.status] || "#fff",
      stroke: v.perf ? COLORS.objective[v.perf] : flow ? scopeColor(innermost(flow)) : "#80868b",
      "stroke-width": v.perf ? 2 : 1, "stroke-dasharray": flow && !v.perf ? "3 2" : null }, g);
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

  // One box per flow scope (the band its nodes were laid out in), titled with where it is in its flow.
  function drawFlowScopes(svg, g) {
    const scopes = new Map();
    for (const n of g.nodes.values()) {
      const flow = n.data.flow;
      if (!flow) continue;
      if (!scopes.has(flow.scope)) scopes.set(flow.scope, { flow, members: [] });
      scopes.get(flow.scope).members.push(n);
    }
    for (const [path, { flow, members }] of scopes) {
      const inner = innermost(flow), color = scopeColor(inner);
      const x0 = Math.min(...members.map((m) => m.x)) - 12, y0 = Math.min(...members.map((m) => m.y)) - BAND_TOP + 2;
      const x1 = Math.max(...members.map((m) => m.x + m.w)) + 12;
      const y1 = Math.max(...members.map((m) => m.y + m.h)) + BAND_BOTTOM - 2;
      const box = el("g", { "data-node": "flow-scope", "data-id": path, "data-flow": flow.flow_id,
        "data-scope": path, "data-badge": flow.badge, "data-kind": inner ? inner.kind : "flow",
        "data-case-state": inner && inner.case_state ? inner.case_state : null, "data-size": members.length }, svg);
      el("title", {}, box).textContent = `${scopeTitle(flow)}\n${path}: ${members.length} node(s)`;
      el("rect", { x: x0, y: y0, width: x1 - x0, height: y1 - y0, rx: 8, fill: color, "fill-opacity": 0.05,
        stroke: color, "stroke-opacity": 0.55, "stroke-dasharray": inner && inner.kind === "case" &&
          inner.case_state !== "taken" ? "6 4" : null }, box);
      el("text", { x: x0 + 8, y: y0 + 12, "font-size": 10.5, "font-weight": 600, fill: color }, box).textContent =
        clip(scopeTitle(flow), Math.max(12, Math.floor((x1 - x0) / 6)));
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
    drawFlowScopes(svg, g);
    drawGroups(svg, g);
    for (const [a, b, kind] of g.edges) drawEdge(svg, g.nodes.get(a), g.nodes.get(b), kind, marker);
    for (const n of g.nodes.values()) {
      if (n.kind === "request") drawRequest(svg, n, engines);
      else if (n.kind === "variable") drawVariable(svg, n);
      else drawPrefix(svg, n, engines);
    }
    return svg;
  }

  window.ParrotDag = { draw, COLORS, engineColor, scopeColor, CASE_COLORS };
})();
