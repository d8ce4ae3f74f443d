"""Prometheus metrics of an engine, read from its :class:`~parrot.protocol.interface.EngineStatus` snapshot.

One function turns status snapshots into metric families, so an engine's own ``/metrics`` (``parrot engine``) and
the manager's ``/metrics`` (the last status each engine reported, one ``engine`` label per engine) expose the same
names with the same meaning. Nothing is kept between scrapes: a scrape builds a fresh registry around the current
snapshot (:func:`render_status`), so several engines or apps in one process never share state. No torch here.

Gauges mirror the snapshot (requests running / waiting, their tokens, KV blocks); counters are the engine's
cumulative totals since it started (steps, tokens computed, prefix-cache queries and hits, shared-prefix decode
rows, preemptions), so ``rate()`` works on them; an engine that restarts starts them again at 0, which Prometheus
treats as a counter reset.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from parrot.protocol.interface import EngineStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the Prometheus text exposition format
LABELS = ("engine", "model")

# (metric name, help, how to read it from a status); gauges then counters (the counters' names get ``_total``)
_GAUGES = (
    ("parrot_engine_running_requests", "ops (fills / generations) running in the engine's batch",
     lambda s: s.num_running),
    ("parrot_engine_waiting_requests", "ops waiting in the engine's local queue", lambda s: s.num_waiting),
    ("parrot_engine_running_tokens", "tokens of the contexts of the running ops", lambda s: s.running_tokens),
    ("parrot_engine_waiting_tokens", "tokens of the contexts of the waiting ops", lambda s: s.waiting_tokens),
    ("parrot_engine_kv_blocks_total", "KV blocks of the engine's pool", lambda s: s.kv_blocks_total),
    ("parrot_engine_kv_blocks_used", "KV blocks referenced by live contexts", lambda s: s.kv_blocks_used),
    ("parrot_engine_kv_blocks_shared", "KV blocks referenced by more than one context (forks, prefix hits)",
     lambda s: s.kv_blocks_shared),
    ("parrot_engine_kv_blocks_cached", "unreferenced KV blocks kept for the prefix cache (evictable)",
     lambda s: s.kv_blocks_cached),
    ("parrot_engine_contexts", "live contexts on the engine", lambda s: s.num_contexts),
    ("parrot_engine_paused_contexts", "contexts paused while their request waits for a tool call (LAMPS)",
     lambda s: _extra(s, "tool_pauses", "paused")),
    ("parrot_engine_host_kv_blocks", "KV blocks of paused contexts swapped out to the host store",
     lambda s: _extra(s, "host_store", "blocks")),
    ("parrot_engine_prefix_cache_hit_rate", "prompt tokens served from the prefix cache / prompt tokens filled, "
     "since the engine started (0 before any fill)", lambda s: _hit_rate(s)),
)
_COUNTERS = (
    ("parrot_engine_steps", "engine iterations run", lambda s: s.extra.get("steps")),
    ("parrot_engine_tokens_computed", "tokens run through the model (prefill and decode)",
     lambda s: s.extra.get("tokens_computed")),
    ("parrot_engine_prefix_cache_queries_tokens", "prompt tokens filled (looked up in the prefix cache)",
     lambda s: s.extra.get("prefix_cache_query_tokens")),
    ("parrot_engine_prefix_cache_hits_tokens", "prompt tokens served from the prefix cache",
     lambda s: s.extra.get("prefix_cache_hit_tokens")),
    ("parrot_engine_prefix_cache_hit_blocks", "KV blocks taken from the prefix cache",
     lambda s: s.extra.get("prefix_cache_hit_blocks")),
    ("parrot_engine_shared_prefix_decode_rows", "decode rows served by shared-prefix attention (a prefix shared by "
     "forked contexts read once per step)", lambda s: s.extra.get("shared_prefix_decode_rows")),
    ("parrot_engine_kv_blocks_evicted", "cached KV blocks evicted", lambda s: s.extra.get("kv_blocks_evicted")),
    ("parrot_engine_preemptions", "running ops preempted for memory", lambda s: s.num_preempted_total),
    ("parrot_engine_aborted_ops", "queued or running ops stopped because their context was freed (the caller went "
     "away: a client disconnected, a session closed)", lambda s: s.extra.get("ops_aborted")),
    ("parrot_engine_tool_pauses_resumed", "paused contexts resumed by the request's next call",
     lambda s: _extra(s, "tool_pauses", "resumed")),
    ("parrot_engine_tool_pauses_expired", "paused contexts freed because their TTL passed",
     lambda s: _extra(s, "tool_pauses", "expired")),
    ("parrot_engine_tool_pauses_demoted", "preserved pauses demoted to swap or discard under KV pressure",
     lambda s: _extra(s, "tool_pauses", "demoted")),
    ("parrot_engine_host_kv_blocks_restored", "KV blocks copied back from the host store on resume",
     lambda s: _extra(s, "host_store", "hits")),
)
PAUSES = "parrot_engine_tool_pauses"  # counter by handling (preserve / discard / swap), labels + ``handling``
NAMES = tuple(n for n, _, _ in _GAUGES) + tuple(n for n, _, _ in _COUNTERS) + (PAUSES,)


def _extra(s: EngineStatus, group: str, key: str) -> int | float | None:
    """``s.extra[group][key]`` when the engine reports it (engines without tool handling do not)."""
    value = s.extra.get(group, {}).get(key) if isinstance(s.extra.get(group), dict) else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _hit_rate(s: EngineStatus) -> float:
    queries, hits = s.extra.get("prefix_cache_query_tokens"), s.extra.get("prefix_cache_hit_tokens")
    return hits / queries if isinstance(queries, int) and isinstance(hits, int) and queries > 0 else 0.0


def status_families(statuses: Sequence[EngineStatus]) -> list[Metric]:
    """One family per metric of :data:`NAMES`, one sample per status (labels ``engine``, ``model``). A counter
    the status does not report (an engine that does not count it, e.g. an external adapter) is left out for that
    engine rather than reported as 0."""
    out: list[Metric] = []
    for name, doc, read in _GAUGES:
        fam = GaugeMetricFamily(name, doc, labels=LABELS)
        for s in statuses:
            value = read(s)
            if value is not None:
                fam.add_metric([s.name, s.model], float(value))
        out.append(fam)
    for name, doc, read in _COUNTERS:
        fam = CounterMetricFamily(name, doc, labels=LABELS)
        for s in statuses:
            value = read(s)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                fam.add_metric([s.name, s.model], float(value))
        out.append(fam)
    pauses = CounterMetricFamily(PAUSES, "contexts paused for a tool call, by how their KV was handled (preserve / "
                                 "discard / swap, LAMPS 4.2)", labels=(*LABELS, "handling"))
    for s in statuses:
        by = s.extra.get("tool_pauses", {}).get("by_handling") if isinstance(s.extra.get("tool_pauses"), dict) else None
        for handling, n in sorted((by or {}).items()):
            pauses.add_metric([s.name, s.model, str(handling)], float(n))
    out.append(pauses)
    return out


class StatusCollector(Collector):
    """A collector over one engine's current snapshot (``parrot engine``'s ``/metrics``); ``up`` is 1: the
    process answering is alive (the manager's own ``parrot_engine_up`` says what the manager believes)."""

    def __init__(self, status: EngineStatus) -> None:
        self._status = status

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("parrot_engine_up", "1 while the engine is alive", labels=LABELS)
        up.add_metric([self._status.name, self._status.model], 1.0)
        yield up
        yield from status_families([self._status])


def render_status(status: EngineStatus) -> bytes:
    """The Prometheus text of one engine snapshot (a registry of its own per scrape: no shared state)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status))
    return generate_latest(registry)
