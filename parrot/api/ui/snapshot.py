"""What the live web view shows, as one JSON document per update: a tenant's view of the manager.

Read-only over the manager (never a writer of its state), bounded whatever the load::

    {"type": "snapshot", "at": <manager clock>, "tenant": "alice", "policy": "parrot", "queued": 0,
     "sessions": [ {session_id, created_at, last_access, truncated, text,
                    requests:  [DAG request + "sched" {criteria, task_group} (Manager.dag) + "flow" (below)],
                    variables: [DAG variable + "preview" (the first PREVIEW_CHARS of its value) + "flow"],
                    flows:     [ {flow_id, name, status, error, outputs, requests, loops, branches, maps,
                                  speculation, events (the last MAX_FLOW_EVENTS), events_total} ... ]} ... ],
     "engines":  [ {name, state, model, load, kv, capabilities, step_cost, placed, prefixes} ... ],
     "recent":   [ RequestRecord.to_json() ... newest first ],
     "prefix_sharing": {contexts created/freed, forks, tokens saved}}

Flows (docs/flows.md): a node a flow made carries its *origin* (``f_2/0.loop[3]/1.generate``); ``"flow"``
describes it for the drawing: its flow, its innermost scope (the band the page groups it in: a loop iteration, a
branch case, a map item, or the flow's top level) and every enclosing scope with a short label (``loop[3]``,
``case1``, ``map[0]``) and, for a branch case, whether it was taken, is speculative or was cancelled. A session's
``flows`` summarize each run from its events: iterations per loop, each branch's decision and speculation outcome.
Everything is capped (MAX_FLOWS per session, MAX_FLOW_EVENTS and MAX_FLOW_ITEMS per flow).

Who sees what: a tenant sees only the sessions it owns (the rule of the Parrot API: another tenant's session is
not found), its own recent DAG requests, and the unowned OpenAI-side records without their ids (see
:mod:`parrot.manager.recent`). Engines, their load, their cached prefix contexts (ids and sizes only) and the
prefix-sharing counters are the cluster's and shown to every tenant, as ``/health`` and ``/api/v1/stats`` are.

:func:`fingerprint` digests a snapshot without its timestamp: the stream sends a snapshot only when it changed.
"""

from __future__ import annotations

import hashlib
import json
import re

from parrot.common.step_cost import StepStats
from parrot.protocol.interface import EngineCapabilities
from parrot.manager.engine_registry import EngineEntry
from parrot.manager.flows.spec import Block, BranchStep, LoopStep, MapStep
from parrot.manager.manager import Manager
from parrot.manager.recent import RequestRecord
from parrot.manager.session import SessionState

MAX_SESSIONS = 20  # the most recently active sessions of the tenant
MAX_REQUESTS = 400  # per session: the newest ones (a page cannot draw more usefully)
MAX_RECENT = 60
PREVIEW_CHARS = 160
MAX_FLOWS = 20  # per session: the newest ones
MAX_FLOW_EVENTS = 50  # per flow: the newest events
MAX_FLOW_ITEMS = 50  # per flow: loops, branches and maps listed (the newest)


def build(manager: Manager, tenant: str, *, open_server: bool) -> dict:
    """The snapshot ``tenant`` may see. ``open_server``: no keys configured, everyone is one tenant, so the
    unowned records keep their ids."""
    now = manager.clock()
    sessions = sorted((s for s in manager.sessions.owned(tenant) if not s.expired(now)),
                      key=lambda s: s.last_access, reverse=True)[:MAX_SESSIONS]
    stats = manager.dispatcher.stats()
    placed = stats.get("engines", {})
    return {
        "type": "snapshot",
        "at": now,
        "tenant": tenant,
        "policy": stats.get("policy"),
        "queued": stats.get("queued", 0),
        "sessions": [_session(manager, s) for s in sessions],
        "engines": [_engine(manager, e, placed.get(e.name))  # by name: a stable order (and colour) on the page
                    for e in sorted(manager.registry.entries(), key=lambda e: e.name)],
        "recent": [_record(r, open_server) for r in manager.recent.visible_to(tenant, limit=MAX_RECENT)],
        "prefix_sharing": manager.prefix_stats().to_dict(),
    }


def fingerprint(snapshot: dict) -> str:
    """A digest of everything but the timestamp (unchanged state = unchanged digest)."""
    body = {k: v for k, v in snapshot.items() if k != "at"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _session(manager: Manager, session: SessionState) -> dict:
    dump = manager.dag(session)
    requests = dump.requests
    truncated = len(requests) > MAX_REQUESTS
    if truncated:
        requests = requests[-MAX_REQUESTS:]
        wanted = {v for r in requests for v in (*r["inputs"], *r["outputs"])}
        variables = [v for v in dump.variables if v["var_id"] in wanted]
    else:
        variables = dump.variables
    graph = session.graph
    for v in variables:
        value = graph.variables[v["var_id"]].value
        v["preview"] = None if value is None else value[:PREVIEW_CHARS]
    flows = _flows(session)
    by_id = {f["flow_id"]: f for f in flows}
    for node in (*requests, *variables):
        node["flow"] = _describe(node.get("origin"), by_id)
    for f in flows:  # internal lookups, not for the page
        del f["_names"], f["_branches"]
    return {"session_id": session.session_id, "created_at": session.created_at, "last_access": session.last_access,
            "truncated": truncated, "requests": requests, "variables": variables, "text": dump.text,
            "flows": flows}


# ---- flows ------------------------------------------------------------------------------------------------------
_STEP = re.compile(r"(\d+)\.([a-z]+)(?:\[(\d+)\])?")
_CASE = re.compile(r"case(\d+)")
_INDEX = re.compile(r"\[\d+\]")
_CASE_OF = re.compile(r"case (\d+)")
_WASTED = re.compile(r"(\d+) tokens wasted")


def _static_names(block: Block, prefix: str, out: dict[str, tuple[str, str, int]]) -> None:
    """Origin without iteration indexes -> (kind, declared name, number of cases) of every loop, branch, map."""
    for i, step in enumerate(block.steps):
        if isinstance(step, BranchStep):
            origin = f"{prefix}/{i}.branch"
            out[origin] = ("branch", step.name, len(step.cases))
            for k, case in enumerate(step.cases):
                _static_names(case.block, f"{origin}/case{k}", out)
            if step.default is not None:
                _static_names(step.default, f"{origin}/case{len(step.cases)}", out)
        elif isinstance(step, LoopStep):
            origin = f"{prefix}/{i}.loop"
            out[origin] = ("loop", step.name, 0)
            _static_names(step.block, origin, out)
        elif isinstance(step, MapStep):
            origin = f"{prefix}/{i}.map"
            out[origin] = ("map", step.into, 0)
            _static_names(step.block, origin, out)


def _declared(names: dict, path: str) -> tuple[str, str, int] | None:
    return names.get(_INDEX.sub("", path))


def _case_of(detail: str) -> int | None:
    m = _CASE_OF.search(detail)
    return int(m.group(1)) if m else None


def _flows(session: SessionState) -> list[dict]:
    runs = sorted(session.flows.values(), key=lambda r: r.number, reverse=True)[:MAX_FLOWS]
    out = [_flow(run) for run in runs]
    by_id = {f["flow_id"]: f for f in out}
    if not by_id:
        return out
    graph = session.graph
    started: dict[str, dict[str, int]] = {fid: {} for fid in by_id}  # loop path -> iterations made (by nodes)
    for origin, node in graph.by_origin.items():
        fid = origin.split("/", 1)[0]
        if fid not in by_id:
            continue
        if node in graph.requests:
            by_id[fid]["requests"] += 1
        path = origin.split(":", 1)[0]
        cur = fid
        for comp in path.split("/")[1:]:
            cur = f"{cur}/{comp}"
            m = _STEP.fullmatch(comp)
            if m and m.group(2) == "loop" and m.group(3) is not None:
                loop = cur[: -len(f"[{m.group(3)}]")]
                seen = started[fid]
                seen[loop] = max(seen.get(loop, 0), int(m.group(3)) + 1)
    for fid, f in by_id.items():
        loops = {lp["path"]: lp for lp in f["loops"]}
        for path, n in started[fid].items():
            lp = loops.get(path)
            if lp is None:
                lp = loops[path] = _new_loop(f["_names"], path)
            lp["iterations"] = max(lp["iterations"], n)
        f["loops"] = list(loops.values())[-MAX_FLOW_ITEMS:]
        f["iterations"] = sum(lp["evaluated"] for lp in loops.values())
    return out


def _new_loop(names: dict, path: str) -> dict:
    decl = _declared(names, path)
    return {"path": path, "name": decl[1] if decl else None, "iterations": 0, "evaluated": 0, "state": "running",
            "last_until": None}


def _flow(run) -> dict:
    """One FlowRun (parrot.manager.flows.runner) summarized from its events."""
    names: dict[str, tuple[str, str, int]] = {}
    _static_names(run.spec.block, run.flow_id, names)
    loops: dict[str, dict] = {}
    branches: dict[str, dict] = {}
    maps: dict[str, dict] = {}
    spec = {"speculated": 0, "hit": 0, "miss": 0, "wasted_tokens": 0}
    for ev in run.events:
        if ev.event == "iteration":
            path = ev.path[: ev.path.rfind("[")] if ev.path.endswith("]") else ev.path
            lp = loops.get(path) or loops.setdefault(path, _new_loop(names, path))
            lp["evaluated"] += 1
            lp["iterations"] = max(lp["iterations"], lp["evaluated"])
            lp["last_until"] = ev.detail
        elif ev.event in ("loop_done", "loop_max_steps"):
            lp = loops.get(ev.path) or loops.setdefault(ev.path, _new_loop(names, ev.path))
            lp["state"] = "done" if ev.event == "loop_done" else "max_steps"
        elif ev.event in ("branch", "speculated", "speculation_hit", "speculation_miss"):
            br = branches.get(ev.path)
            if br is None:
                decl = _declared(names, ev.path)
                br = branches[ev.path] = {"path": ev.path, "name": decl[1] if decl else None,
                                          "cases": decl[2] if decl else None, "case": None, "case_label": None,
                                          "speculated": None, "speculation": None, "wasted_tokens": 0}
            case = _case_of(ev.detail)
            if ev.event == "branch":
                br["case"] = case
                br["case_label"] = _case_label(case, br["cases"])
            elif ev.event == "speculated":
                br["speculated"], br["speculation"] = case, "pending"
                spec["speculated"] += 1
            elif ev.event == "speculation_hit":
                br["speculation"] = "hit"
                spec["hit"] += 1
            else:
                m = _WASTED.search(ev.detail)
                wasted = int(m.group(1)) if m else 0
                br["speculation"], br["wasted_tokens"] = "miss", wasted
                spec["miss"] += 1
                spec["wasted_tokens"] += wasted
        elif ev.event == "map":
            m = re.match(r"(\d+)", ev.detail)
            decl = _declared(names, ev.path)
            maps[ev.path] = {"path": ev.path, "name": decl[1] if decl else None,
                             "items": int(m.group(1)) if m else None}
    err = run.error
    return {"flow_id": run.flow_id, "number": run.number, "name": run.spec.name, "status": run.status.value,
            "speculate": run.speculate, "outputs": dict(run.outputs),
            "error": None if err is None else {"code": err.code, "cause": err.cause_code,
                                               "message": err.message[:PREVIEW_CHARS]},
            "requests": 0, "iterations": 0, "loops": list(loops.values()),
            "branches": list(branches.values())[-MAX_FLOW_ITEMS:], "maps": list(maps.values())[-MAX_FLOW_ITEMS:],
            "speculation": spec, "events": [e.to_json() for e in run.events[-MAX_FLOW_EVENTS:]],
            "events_total": len(run.events), "_names": names, "_branches": branches}


def _case_label(case: int | None, cases: int | None) -> str | None:
    if case is None:
        return None
    return "default" if cases is not None and case >= cases else f"case{case}"


def _describe(origin: str | None, flows: dict[str, dict]) -> dict | None:
    """Where a flow-made node sits in its flow: its scopes (outermost first) and the innermost one's path."""
    if not origin:
        return None
    path, _, var = origin.partition(":")
    comps = path.split("/")
    fid = comps[0]
    flow = flows.get(fid)
    names = flow["_names"] if flow else {}
    branches = flow["_branches"] if flow else {}
    scopes: list[dict] = []
    cur, step = fid, None
    for i, comp in enumerate(comps[1:], start=1):
        parent, cur = cur, f"{cur}/{comp}"
        m = _STEP.fullmatch(comp)
        c = _CASE.fullmatch(comp)
        if m and m.group(3) is not None:  # a loop iteration or a map item
            kind, index = m.group(2), int(m.group(3))
            decl = _declared(names, cur)
            name = decl[1] if decl else None
            what = "iteration" if kind == "loop" else "item"
            scopes.append({"path": cur, "kind": kind, "index": index, "name": name, "label": f"{kind}[{index}]",
                           "title": f"{kind} {name or comps[i]} {what} {index}"})
        elif c:  # a case of the branch ``parent``
            index = int(c.group(1))
            decl = _declared(names, parent)
            br = branches.get(parent, {})
            label = _case_label(index, decl[2] if decl else None)
            taken = br.get("case")
            if taken is not None:
                state = "taken" if taken == index else "cancelled"
            elif br.get("speculated") == index:
                state = "speculative"
            else:
                state = "pending"
            name = decl[1] if decl else None
            scopes.append({"path": cur, "kind": "case", "index": index, "name": name, "label": label,
                           "branch": parent, "case_state": state,
                           "title": f"branch {name or parent.rsplit('/', 1)[-1]} {label} ({state})"})
        elif i == len(comps) - 1:
            step = comp
    inner = scopes[-1]["path"] if scopes else fid
    return {"flow_id": fid, "flow_name": flow["name"] if flow else None, "origin": origin, "step": step,
            "var": var or None, "scope": inner, "scopes": scopes,
            "badge": " › ".join(s["label"] for s in scopes)}


def _engine(manager: Manager, entry: EngineEntry, placed: dict | None) -> dict:
    s = entry.status
    caps = EngineCapabilities.from_status(s)
    out: dict = {"name": entry.name, "state": entry.state.value, "model": entry.info.name if entry.info else None,
                 "max_model_len": entry.info.max_model_len if entry.info else None, "last_error": entry.last_error,
                 "deaths": entry.deaths, "capabilities": caps.to_wire() if caps is not None else None,
                 "placed": placed, "load": None, "kv": None, "step_cost": _step_cost(entry),
                 "prefixes": [{"context_id": pc.context_id, "tokens": pc.num_tokens, "children": pc.children,
                               "state": pc.state.value, "parent": pc.parent.context_id if pc.parent else None}
                              for pc in manager.prefix_store.prefix_contexts(entry.name)]}
    if s is not None:
        out["load"] = {"running": s.num_running, "waiting": s.num_waiting, "running_tokens": s.running_tokens,
                       "waiting_tokens": s.waiting_tokens, "contexts": s.num_contexts,
                       "preempted_total": s.num_preempted_total}
        out["kv"] = {"blocks_total": s.kv_blocks_total, "blocks_used": s.kv_blocks_used,
                     "blocks_shared": s.kv_blocks_shared, "blocks_cached": s.kv_blocks_cached,
                     "block_size": s.block_size}
    return out


def _step_cost(entry: EngineEntry) -> dict | None:
    """The engine's own measured iteration time model (its reported step statistics, fitted), in seconds."""
    raw = entry.status.extra.get("step_stats") if entry.status is not None else None
    if raw is None:
        return None
    try:
        fit = StepStats.from_wire(raw).fit()
    except ValueError:
        return None
    if fit is None:
        return None
    return {"base_s": fit.base_s, "decode_row_s": fit.decode_row_s, "decode_ctx_s": fit.decode_ctx_s,
            "prefill_token_s": fit.prefill_token_s}


def _record(record: RequestRecord, open_server: bool) -> dict:
    out = record.to_json()
    if record.owner is None and not open_server:  # another tenant's, perhaps: metadata only
        out["request_id"] = None
    return out
