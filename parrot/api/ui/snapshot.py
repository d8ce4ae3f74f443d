"""What the live web view shows, as one JSON document per update: a tenant's view of the manager.

Read-only over the manager (never a writer of its state), bounded whatever the load::

    {"type": "snapshot", "at": <manager clock>, "tenant": "alice", "policy": "parrot", "queued": 0,
     "sessions": [ {session_id, created_at, last_access, truncated, text,
                    requests:  [DAG request + "sched" {criteria, task_group} (Manager.dag)],
                    variables: [DAG variable + "preview" (the first PREVIEW_CHARS of its value)]} ... ],
     "engines":  [ {name, state, model, load, kv, capabilities, step_cost, placed, prefixes} ... ],
     "recent":   [ RequestRecord.to_json() ... newest first ],
     "prefix_sharing": {contexts created/freed, forks, tokens saved}}

Who sees what: a tenant sees only the sessions it owns (the rule of the Parrot API: another tenant's session is
not found), its own recent DAG requests, and the unowned OpenAI-side records without their ids (see
:mod:`parrot.manager.recent`). Engines, their load, their cached prefix contexts (ids and sizes only) and the
prefix-sharing counters are the cluster's and shown to every tenant, as ``/health`` and ``/api/v1/stats`` are.

:func:`fingerprint` digests a snapshot without its timestamp: the stream sends a snapshot only when it changed.
"""

from __future__ import annotations

import hashlib
import json

from parrot.common.step_cost import StepStats
from parrot.protocol.interface import EngineCapabilities
from parrot.manager.engine_registry import EngineEntry
from parrot.manager.manager import Manager
from parrot.manager.recent import RequestRecord
from parrot.manager.session import SessionState

MAX_SESSIONS = 20  # the most recently active sessions of the tenant
MAX_REQUESTS = 400  # per session: the newest ones (a page cannot draw more usefully)
MAX_RECENT = 60
PREVIEW_CHARS = 160


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
    return {"session_id": session.session_id, "created_at": session.created_at, "last_access": session.last_access,
            "truncated": truncated, "requests": requests, "variables": variables, "text": dump.text}


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
