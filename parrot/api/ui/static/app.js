// Parrot live view: connects to /ui/api/events (SSE over fetch, so the API key travels as an Authorization
// header, never in a URL), renders each snapshot (engines, sessions' DAGs via dag.js, recent requests).
// The key is kept in sessionStorage (this tab only). A 401 clears the view and waits for another key; a
// dropped stream reconnects with backoff; a stream the server ends ([DONE], after its time bound) reconnects.
// A session's flows (server-side branches and loops) are listed above its DAG: status, iterations per loop,
// each branch's decision and speculation outcome, the newest events; dag.js bands the nodes by flow scope.
(function () {
  "use strict";
  const KEY = "parrot-ui-key";
  const $ = (sel) => document.querySelector(sel);
  let controller = null, snapshots = 0, retryMs = 500;
  const opened = new Set();  // <details> the reader opened (by data-key): kept open across snapshots

  function h(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "text") e.textContent = v; else e.setAttribute(k, String(v));
    }
    for (const c of children) if (c !== null && c !== undefined) e.append(c);
    return e;
  }

  function setConn(state, text) {
    const c = $("#conn");
    c.dataset.state = state;
    c.textContent = text;
  }

  function clearView() {
    $("#engines").replaceChildren();
    $("#sessions").replaceChildren();
    $("#recent tbody").replaceChildren();
    $("#summary").textContent = "";
  }

  const ms = (s) => (s === null || s === undefined ? "—" : s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s");
  const pct = (a, b) => (b > 0 ? Math.min(100, (100 * a) / b) : 0);

  function renderEngines(engines, names) {
    const box = $("#engines");
    if (!engines.length) { box.replaceChildren(h("div", { class: "empty", text: "no engines registered" })); return; }
    box.replaceChildren(...engines.map((e) => {
      const load = e.load || {}, kv = e.kv || {}, placed = e.placed || {};
      const color = window.ParrotDag.engineColor(names, e.name);
      const card = h("div", { class: "engine", "data-engine": e.name, "data-state": e.state,
        "data-running": load.running ?? "", "data-kv-used": kv.blocks_used ?? "",
        "data-prefixes": e.prefixes.length });
      card.style.borderLeftColor = color;
      card.append(h("h3", {}, h("span", { text: e.name }), h("span", { class: "state", text: e.state }),
        h("span", { class: "chip", text: e.model || "?" })));
      card.append(h("div", { class: "row" }, h("span", {}, "running ", h("b", { text: load.running ?? "—" }),
        " · waiting ", h("b", { text: load.waiting ?? "—" })), h("span", {}, "tokens ",
        h("b", { text: load.running_tokens ?? "—" }), " + ", h("b", { text: load.waiting_tokens ?? "—" }))));
      card.append(h("div", { class: "row" }, h("span", {}, "placed by the scheduler ",
        h("b", { text: placed.requests ?? 0 }), " req / ", h("b", { text: placed.tokens ?? 0 }), " tok"),
        h("span", {}, "cap ", h("b", { text: placed.cap ?? "none" }))));
      if (kv.blocks_total) {
        const bar = h("div", { class: "bar", title: "KV blocks: used (blue) / shared (purple) / cached (green)" });
        let left = 0;
        for (const [cls, n] of [["used", kv.blocks_used - kv.blocks_shared], ["shared", kv.blocks_shared],
          ["cached", kv.blocks_cached]]) {
          const w = pct(Math.max(0, n), kv.blocks_total), s = h("span", { class: cls });
          s.style.left = left + "%"; s.style.width = w + "%"; left += w; bar.append(s);
        }
        card.append(h("div", { class: "row" }, h("span", {}, "KV ", h("b", { text: kv.blocks_used }), " / ",
          h("b", { text: kv.blocks_total }), ` blocks of ${kv.block_size}`),
          h("span", {}, "shared ", h("b", { text: kv.blocks_shared }), " · cached ", h("b", { text: kv.blocks_cached }))),
          bar);
      }
      const sc = e.step_cost;
      // the engine's own fitted iteration time: base + per decoded row + per prefilled token (+ per KV token)
      card.append(h("div", { class: "row", "data-step-cost": sc ? "measured" : "none",
        title: sc ? `step_s = ${sc.base_s.toExponential(2)} + ${sc.decode_row_s.toExponential(2)}·rows + ` +
          `${sc.decode_ctx_s.toExponential(2)}·ctx + ${sc.prefill_token_s.toExponential(2)}·prefill` : null },
        h("span", { text: "step" }), h("span", { text: sc ? `${ms(sc.base_s)} + ${ms(sc.decode_row_s)}/row + ` +
          `${ms(sc.prefill_token_s)}/prefill tok` : "not measured yet" })));
      if (e.capabilities) {
        const chips = h("div", { class: "chips" });
        for (const k of ["shared_prefix_attention", "fork", "prefix_cache"]) {
          chips.append(h("span", { class: e.capabilities[k] ? "chip" : "chip off", text: k.replaceAll("_", " ") }));
        }
        card.append(chips);
      }
      card.append(h("div", { class: "prefixes", text: e.prefixes.length
        ? `${e.prefixes.length} cached prefix context(s): ` + e.prefixes.map((p) =>
          `${p.tokens} tok ×${p.children} (${p.state})`).join(", ") : "no cached prefix contexts" }));
      if (e.last_error && e.state !== "alive") card.append(h("div", { class: "prefixes", text: e.last_error }));
      return card;
    }));
  }

  // a <details> that stays open across re-renders
  function details(key, summary, ...body) {
    const d = h("details", { "data-key": key }, h("summary", { text: summary }), ...body);
    if (opened.has(key)) d.open = true;
    d.addEventListener("toggle", () => { if (d.open) opened.add(key); else opened.delete(key); });
    return d;
  }

  const local = (fid, path) => (path === fid ? "(flow)" : path.startsWith(fid + "/") ? path.slice(fid.length + 1) : path);

  function renderFlows(sid, flows) {
    const box = h("div", { class: "flows", "data-flows": flows.length });
    box.append(h("div", { class: "flows-title", text: `${flows.length} flow(s), newest first` }));
    for (const f of flows) {
      const sp = f.speculation || { speculated: 0, hit: 0, miss: 0, wasted_tokens: 0 };
      const card = h("div", { class: "flow", "data-flow": f.flow_id, "data-name": f.name, "data-status": f.status,
        "data-iterations": f.iterations, "data-speculation": `${sp.hit}/${sp.miss}` });
      card.append(h("div", { class: "flow-head" }, h("b", { class: "mono", text: f.flow_id }), h("span", { text: f.name }),
        h("span", { class: "status", "data-status": f.status, text: f.status }),
        h("span", { class: "muted", text: `${f.requests} request(s) · ${f.iterations} iteration(s) evaluated` +
          (sp.speculated ? ` · speculated ${sp.speculated}: ${sp.hit} hit, ${sp.miss} miss` +
            (sp.wasted_tokens ? `, ${sp.wasted_tokens} tok wasted` : "") : "") })));
      if (f.error) card.append(h("div", { class: "flow-error", text: `${f.error.cause}: ${f.error.message}` }));
      const chips = h("div", { class: "chips" });
      for (const lp of f.loops) {
        chips.append(h("span", { class: "chip loop", "data-loop": lp.path, "data-iterations": lp.iterations,
          "data-evaluated": lp.evaluated, "data-state": lp.state, title: `${lp.path}: ${lp.iterations} iteration(s) ` +
            `made, ${lp.evaluated} evaluated (last ${lp.last_until || "—"})`,
          text: `loop ${lp.name || local(f.flow_id, lp.path)}: ${lp.iterations} iteration(s)` +
            (lp.evaluated !== lp.iterations ? ` (${lp.evaluated} evaluated)` : "") +
            (lp.state === "running" ? " …" : lp.state === "max_steps" ? " · max_steps" : " · done") }));
      }
      for (const br of f.branches) {
        const spec = br.speculated === null || br.speculated === undefined ? "" :
          ` · speculated case${br.speculated}: ${br.speculation}` +
          (br.speculation === "miss" && br.wasted_tokens ? ` (${br.wasted_tokens} tok wasted)` : "");
        chips.append(h("span", { class: "chip branch", "data-branch": br.path, "data-case": br.case_label || "",
          "data-speculation": br.speculation || "none", title: br.path,
          text: `branch ${br.name || local(f.flow_id, br.path)} → ${br.case_label || "pending"}${spec}` }));
      }
      for (const mp of f.maps) {
        chips.append(h("span", { class: "chip map", "data-map": mp.path, "data-items": mp.items ?? "",
          title: mp.path, text: `map ${mp.name || local(f.flow_id, mp.path)}: ${mp.items ?? "?"} item(s)` }));
      }
      if (chips.childElementCount) card.append(chips);
      if (f.events.length) {
        const rows = f.events.map((e) => h("tr", { "data-event": e.event },
          h("td", { text: new Date(e.at * 1000).toLocaleTimeString() }),
          h("td", { class: "mono", text: local(f.flow_id, e.path) }),
          h("td", { text: e.event }), h("td", { text: e.detail })));
        card.append(details(`${sid}/${f.flow_id}/events`, f.events_total > f.events.length
          ? `events (newest ${f.events.length} of ${f.events_total})` : `events (${f.events_total})`,
          h("table", { class: "events" }, h("tbody", {}, ...rows))));
      }
      box.append(card);
    }
    return box;
  }

  function renderSessions(sessions, names) {
    const box = $("#sessions");
    if (!sessions.length) { box.replaceChildren(h("div", { class: "empty", text: "no open sessions" })); return; }
    box.replaceChildren(...sessions.map((s) => {
      const counts = {};
      for (const r of s.requests) counts[r.status] = (counts[r.status] || 0) + 1;
      const sec = h("section", { class: "session", "data-session": s.session_id, "data-requests": s.requests.length });
      sec.append(h("h3", { text: s.session_id }));
      sec.append(h("div", { class: "counts", text: `${s.requests.length} requests, ${s.variables.length} variables — ` +
        Object.entries(counts).map(([k, v]) => `${v} ${k}`).join(", ") + (s.truncated ? " (newest shown)" : "") }));
      if (s.flows && s.flows.length) sec.append(renderFlows(s.session_id, s.flows));
      sec.append(window.ParrotDag.draw(s, names));
      sec.append(details(`${s.session_id}/text`, "DAG as text", h("pre", { text: s.text })));
      return sec;
    }));
  }

  function renderRecent(recent) {
    $("#recent tbody").replaceChildren(...recent.map((r) => h("tr", { "data-request": r.request_id || "",
      "data-kind": r.kind, "data-outcome": r.outcome, "data-engine": r.engine || "" },
      h("td", { text: new Date(r.finished * 1000).toLocaleTimeString() }), h("td", { text: r.kind }),
      h("td", { text: r.request_id || "(another tenant's?)" }), h("td", { text: r.label }),
      h("td", { text: r.engine || "—" }), h("td", { class: "outcome", text: r.outcome + (r.error_code ? ` (${r.error_code})` : "") }),
      h("td", { class: "num", text: ms(r.wait_s) }), h("td", { class: "num", text: ms(r.ttft_s) }),
      h("td", { class: "num", text: ms(r.total_s) }),
      h("td", { class: "num", text: r.prefix_context ? `${r.shared_tokens} tok` : "—" }))));
  }

  function render(snap) {
    const names = snap.engines.map((e) => e.name);
    renderEngines(snap.engines, names);
    renderSessions(snap.sessions, names);
    renderRecent(snap.recent);
    const ps = snap.prefix_sharing || {};
    $("#summary").textContent = `tenant ${snap.tenant} · policy ${snap.policy} · queued ${snap.queued} · ` +
      `${snap.sessions.length} session(s) · prefix tokens saved ${ps.tokens_saved ?? 0} · ` +
      `updated ${new Date(snap.at * 1000).toLocaleTimeString()}`;
    snapshots += 1;
    document.body.dataset.snapshots = snapshots;
  }

  function renderLegend() {
    const L = $("#legend"), C = window.ParrotDag.COLORS;
    const parts = [];
    for (const [k, c] of Object.entries(C.request)) parts.push([k, c]);
    parts.push(["latency", C.objective.latency], ["throughput", C.objective.throughput]);
    L.replaceChildren(...parts.flatMap(([k, c]) => { const i = h("i"); i.style.background = c; return [i, k]; }));
  }

  function handle(event) {
    const lines = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6));
    if (!lines.length) return true;
    const data = lines.join("\n");
    if (data === "[DONE]") return false;
    const msg = JSON.parse(data);
    if (msg.error) { setConn("error", msg.error.message); return true; }
    if (msg.type === "snapshot") { render(msg); setConn("live", "live"); }
    return true;
  }

  async function connect() {
    if (controller) controller.abort();
    const mine = (controller = new AbortController());
    const key = sessionStorage.getItem(KEY);
    const headers = key ? { Authorization: "Bearer " + key } : {};
    setConn("connecting", "connecting…");
    let res;
    try {
      res = await fetch("/ui/api/events?interval=0.5", { headers, signal: mine.signal, cache: "no-store" });
    } catch (err) {
      if (mine.signal.aborted) return;
      return retry("error", "server unreachable");
    }
    if (res.status === 401) {
      clearView();
      setConn("unauthorized", key ? "wrong API key" : "this server needs an API key");
      return;  // wait for another key
    }
    if (!res.ok) {
      clearView();
      let text = `HTTP ${res.status}`;
      try { text = (await res.json()).error.message; } catch (e) { /* keep the status */ }
      return retry("error", text);
    }
    const reader = res.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          if (!handle(event)) { retryMs = 500; return connect(); }
        }
        retryMs = 500;
      }
    } catch (err) {
      if (mine.signal.aborted) return;
    }
    if (!mine.signal.aborted) retry("connecting", "reconnecting…");
  }

  function retry(state, text) {
    setConn(state, text);
    const wait = retryMs;
    retryMs = Math.min(10000, retryMs * 2);
    const current = controller;
    setTimeout(() => { if (controller === current) connect(); }, wait);  // unless a new connect() took over
  }

  document.addEventListener("DOMContentLoaded", () => {
    renderLegend();
    $("#keyform").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("#key").value.trim();
      if (key) sessionStorage.setItem(KEY, key); else sessionStorage.removeItem(KEY);
      $("#key").value = "";
      clearView();
      connect();
    });
    $("#forget").addEventListener("click", () => { sessionStorage.removeItem(KEY); clearView(); connect(); });
    connect();
  });
})();
