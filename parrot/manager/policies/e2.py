"""Preble's E2 global scheduler (Preble §4.2, Algorithms 1-2): exploit a cached prefix when it saves more than it
leaves to compute, otherwise explore by load cost; post-assignment rebalancing, hot-prefix replication and
prefill/decode balancing. For requests that carry their prompt's token ids (OpenAI completions); no torch.

One decision (:meth:`E2Policy.choose`) for a prompt of ``n`` tokens::

    match the prompt in the global radix tree (parrot.manager.policies.radix)
    cached_e = tokens of the matched path engine e holds;  best = max_e cached_e
    best > n - best  (exploit):  KS = engines holding the *key node* (the longest node of the held path)
        e = argmin_{KS} L + M + P + D  (D: the decoding now in flight there, E2Config.current_decode)
        rebalance: L_e > th_bal * min L   -> the lightest engine instead (its exploit traffic moves)
        replicate: the key node's mean queueing estimate doubled over the window H -> the lightest engine not
                   holding it (the prefix gets a second home; later exploits split by cost)
    else (explore):
        P/D balance: an engine whose in-flight requests are mostly decode units (>= decode_unit_cached of their
                   prompt cached) beyond decode_ratio takes the prefill-heavy newcomer
        e = argmin_{all} L + M + P

Costs (seconds, from the engine's fitted :class:`~parrot.common.step_cost.StepCost`, else DEFAULT_COST):

* L = sum over the engine's requests in the window of PREFILL(missed tokens) + DECODE(average output length).
  DECODE(k) (``E2Config.decode_cost``): ``request`` (default, the paper's DT_r: a request's decoding time) =
  k * (base_s + decode_row_s + decode_ctx_s * average context), the time of k decode iterations of it alone;
  ``marginal`` = k * (decode_row_s + decode_ctx_s * average context), what one more row adds to iterations that
  run anyway (batching taken as free: on a 1-thread CPU engine this hides most of a request's decode time, and
  E2 piles decode-heavy requests onto the engine holding their prefix);
* M = sum over the nodes the engine's LRU would evict to make room for the missed tokens (emulated on the tree)
  of PREFILL(node tokens) * requests of the window sharing the node there;
* P = PREFILL(missed tokens of this request on the engine).
* D (``E2Config.current_decode``, default on; only among the holders of an exploited key node) = the engine time
  its in-flight requests' decoding still takes. They decode together, so D = base_s x the most tokens any of them
  has left + sum over them of tokens left x (decode_row_s + decode_ctx_s x its context) (``marginal``: no base_s
  term); a request's tokens left = its max new tokens minus what it can have decoded since it was placed (elapsed
  time after its own prefill, one token per iteration of it alone). L is a window history, blind to what runs now:
  with a prefix cached on every engine (Preble's programming workload: a long demo prompt, the longest outputs)
  every request exploits, the holders' histories are alike, and E2 stacked decode-heavy requests on one holder
  while another was idle. Explore and rebalancing keep Preble's history-only L (a placed prefix has a longer-term
  effect than one moment's load, §4.2; adding D there moved requests off their prefixes: toolbench and loogle
  lost up to 9 % in the simulator).

The tree keeps what engines hold true through eviction notices: an engine reporting ``kv_evicted`` in its
status (``{"seq": total evicted blocks, "hashes": the latest evicted blocks' chain hashes}``) has the nodes of
those blocks (and their subtrees) dropped for it; between notices the tree emulates each engine's LRU against its
KV capacity.

State: the policy is stateful (the tree, per-engine histories, the in-flight requests' missed tokens); one
instance serves one dispatcher.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from parrot.common.step_cost import StepCost
from parrot.protocol.block_hashes import chain_hashes
from parrot.manager.perf_deduction import SchedInfo
from parrot.manager.policies.base import (
    ClusterView,
    Demand,
    DispatchRequest,
    Placement,
    Policy,
    QueuedRequest,
    WorkKind,
)
from parrot.manager.policies.radix import Node, RadixTree

logger = logging.getLogger(__name__)

# LLaMA-7B on an A6000 (parrot/sim/cost_models/llama7b-a6000.json), used until an engine reports step statistics:
# only the ratios of the terms matter to a comparison, and these are the paper's setting
DEFAULT_COST = StepCost(base_s=0.025, decode_row_s=1.45e-4, decode_ctx_s=1.37e-6, prefill_token_s=1.45e-4)


@dataclass(frozen=True)
class E2Config:
    window_s: float = 60.0  # W (tree hits) and H (load history, hot-prefix windows), seconds
    th_bal: float = 1.5  # rebalance when the heaviest engine's load exceeds th_bal x the lightest's
    min_window_requests: int = 2  # rebalancing / replication need this many requests in the window
    rebalance: bool = True
    replicate: bool = True
    hot_factor: float = 2.0  # a key node is hot when its mean queueing estimate grows this much over a window
    min_hot_wait_s: float = 0.05  # ... and exceeds this
    pd_balance: bool = True
    decode_unit_cached: float = 0.8  # a request with this share of its prompt cached is a decode unit
    decode_ratio: float = 0.8  # IMBALR: an engine with more decode units than this share takes explorations
    emulate_lru: bool = True  # evict on the tree when an engine's held tokens exceed its KV capacity
    decode_cost: Literal["request", "marginal"] = "request"  # DECODE(k) in L (see the module docstring)
    current_decode: bool = True  # exploit picks among holders by L + M + P + D (D: the module docstring)

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s!r}")
        if not self.th_bal >= 1:
            raise ValueError(f"th_bal must be >= 1, got {self.th_bal!r}")
        if not self.hot_factor > 1:
            raise ValueError(f"hot_factor must be > 1, got {self.hot_factor!r}")
        if self.decode_cost not in ("request", "marginal"):
            raise ValueError(f"decode_cost must be request or marginal, got {self.decode_cost!r}")
        for name in ("decode_unit_cached", "decode_ratio"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")


@dataclass
class _History:
    """One engine's requests in the window H: (time, missed tokens, output tokens, context tokens), with sums."""

    items: deque = field(default_factory=deque)
    missed: int = 0
    out: int = 0
    ctx: int = 0

    def add(self, t: float, missed: int, out: int, ctx: int) -> None:
        self.items.append((t, missed, out, ctx))
        self.missed += missed
        self.out += out
        self.ctx += ctx

    def expire(self, limit: float) -> None:
        while self.items and self.items[0][0] < limit:
            _, m, o, c = self.items.popleft()
            self.missed -= m
            self.out -= o
            self.ctx -= c


@dataclass
class _Hot:
    """Queueing estimates of the requests exploiting one key node, per window H."""

    start: float
    total: float = 0.0
    n: int = 0
    prev: float | None = None  # mean of the previous window


@dataclass(frozen=True)
class Decision:
    """Why an engine was chosen (for tests and debugging)."""

    engine: str
    kind: str  # exploit | explore | rebalance | replicate | pd-balance | no-tokens
    cached: int  # tokens of the prompt the engine held
    costs: dict[str, float]


class E2Policy(Policy):
    name = "e2"
    caps_engines = False

    def __init__(self, config: E2Config | None = None) -> None:
        self.config = config or E2Config()
        self.tree = RadixTree(self.config.window_s)
        self._history: dict[str, _History] = {}
        self._inflight: dict[str, tuple[int, int]] = {}  # request id -> (missed tokens, prompt tokens)
        self._hot: dict[Node, _Hot] = {}
        self._notice_seq: dict[str, int] = {}  # engine -> eviction notices seen (its kv_evicted seq)
        self._seen_status: dict[str, object] = {}
        self._block_size: dict[str, int] = {}  # engines that report eviction notices -> their block size
        self._known: set[str] = set()
        self._now = 0.0
        self._round: dict[str, float] = {}  # per-round cache of queueing estimates
        self._round_decode: dict[str, float] = {}  # per-round cache of D (current_decode)
        self.last: Decision | None = None
        self.counts: dict[str, int] = {}  # decisions by kind
        self.notices_applied = 0  # eviction notices that named new evictions (after each engine's baseline)
        self.notice_tokens_dropped = 0  # tree tokens those notices dropped (engine, node) pairs for

    # ---- Policy ---------------------------------------------------------------------------------------------
    def demand(self, request: DispatchRequest, info: SchedInfo, group_tokens: int,
               cost: StepCost | None = None) -> Demand:
        return Demand(None, WorkKind.LATENCY)

    def place(self, queue: Sequence[QueuedRequest], cluster: ClusterView) -> list[Placement]:
        self.sync(cluster)
        return [Placement(q.ticket, self.choose(q.request, q.candidates, cluster).engine)
                for q in sorted(queue, key=lambda q: (q.enqueued_at, q.ticket))]

    # ---- cluster state ----------------------------------------------------------------------------------------
    def sync(self, cluster: ClusterView) -> None:
        """Per round: the clock, engines gone, eviction notices, the window, finished requests."""
        if cluster.now is not None:
            self._now = max(self._now, cluster.now)
        now = self._now
        live = set(cluster.engines)
        for gone in self._known - live:
            self.tree.forget_engine(gone)
            self._history.pop(gone, None)
            self._notice_seq.pop(gone, None)
            self._seen_status.pop(gone, None)
        self._known = live
        for name, view in cluster.engines.items():
            if view.status is not None and self._seen_status.get(name) is not view.status:
                self._seen_status[name] = view.status
                self.ingest_notice(name, view.status.extra.get("kv_evicted"), view.status.block_size)
        self.tree.expire(now)
        limit = now - self.config.window_s
        for h in self._history.values():
            h.expire(limit)
        placed = {p.request_id for v in cluster.engines.values() for p in v.placed}
        if len(self._inflight) > len(placed):
            self._inflight = {r: v for r, v in self._inflight.items() if r in placed}
        self._round = {}
        self._round_decode = {}
        if len(self._hot) > 4 * self.tree.num_nodes:
            self._hot = {n: h for n, h in self._hot.items() if n.parent is not None}

    def ingest_notice(self, engine: str, notice: object, block_size: int) -> int:
        """Apply an engine's eviction notice (see the module docstring); returns the tokens dropped from the tree.
        A malformed notice is ignored. Notices lost between two statuses (more evictions than the notice lists)
        leave those nodes to the LRU emulation."""
        if not isinstance(notice, dict):
            return 0
        try:
            seq = int(notice["seq"])
            hashes = [int(h) for h in notice["hashes"]]
        except (KeyError, TypeError, ValueError):
            return 0
        self._block_size[engine] = block_size
        last = self._notice_seq.get(engine)
        self._notice_seq[engine] = seq
        if last is None or seq <= last:  # the first notice only sets the baseline (nothing was registered yet)
            return 0
        dropped = self._drop_blocks(engine, hashes[-(seq - last):])
        self.notices_applied += 1
        self.notice_tokens_dropped += dropped
        return dropped

    def _drop_blocks(self, engine: str, hashes: Sequence[int]) -> int:
        dropped = 0
        for h in hashes:
            node = self.tree.node_of_block(h)
            if node is not None and engine in node.engines:
                dropped += self.tree.evict(node, engine)
        return dropped

    # ---- costs ------------------------------------------------------------------------------------------------
    @staticmethod
    def cost_of(cluster: ClusterView, engine: str) -> StepCost:
        return cluster.engines[engine].step_cost or DEFAULT_COST

    def _decode_step(self, c: StepCost, ctx: float) -> float:
        """DECODE(1) at context ``ctx``: one decode iteration of the request (``request``) or its row's share of
        an iteration that runs anyway (``marginal``)."""
        return c.decode_row_s + c.decode_ctx_s * ctx + (c.base_s if self.config.decode_cost == "request" else 0.0)

    def load(self, cluster: ClusterView, engine: str) -> float:
        """L: the engine's window history in seconds (Algorithm 2's first loop)."""
        h = self._history.get(engine)
        if h is None or not h.items:
            return 0.0
        c = self.cost_of(cluster, engine)
        n = len(h.items)
        avg_out, avg_ctx = h.out / n, h.ctx / n
        return c.prefill_token_s * h.missed + n * avg_out * self._decode_step(c, avg_ctx)

    def current_decode(self, cluster: ClusterView, engine: str) -> float:
        """D: seconds the engine still needs to decode the requests placed on it and not finished. They run in
        one batch: every iteration pays base_s once and each row its own part, so D = base_s x max(tokens left)
        + sum(tokens left x row part) (``marginal``: no base_s). A request's tokens left = its max new tokens minus
        what it can have decoded since it was placed: one token per iteration of it alone from the end of its own
        prefill (its missed tokens); an unknown placement time: nothing decoded yet."""
        got = self._round_decode.get(engine)
        if got is not None:
            return got
        c = self.cost_of(cluster, engine)
        rows, longest = 0.0, 0.0
        for p in cluster.engines[engine].placed:
            out = p.tokens - p.prompt_tokens
            if out <= 0:
                continue
            missed = self._inflight.get(p.request_id, (p.prompt_tokens, p.prompt_tokens))[0]
            row = c.decode_row_s + c.decode_ctx_s * (p.prompt_tokens + out / 2)
            alone = row + c.base_s
            done = 0.0
            if p.placed_at is not None and alone > 0:
                done = max(0.0, self._now - p.placed_at - c.prefill_token_s * missed) / alone
            left = max(0.0, out - done)
            rows += left * row
            longest = max(longest, left)
        total = rows + (longest * c.base_s if self.config.decode_cost == "request" else 0.0)
        self._round_decode[engine] = total
        return total

    def eviction_cost(self, cluster: ClusterView, engine: str, missed: int, keep: Sequence[Node]) -> float:
        """M: recomputation of what the engine's LRU would evict to hold ``missed`` more tokens, times the requests
        of the window sharing each evicted node there."""
        cap = cluster.engines[engine].capacity_tokens
        if cap is None:
            return 0.0
        need = self.tree.cached_tokens.get(engine, 0) + missed - cap
        if need <= 0:
            return 0.0
        c = self.cost_of(cluster, engine)
        return sum(c.prefill_token_s * v.num_tokens * max(1, v.hits.get(engine, 0))
                   for v in self.tree.lru_victims(engine, need, keep))

    def total_cost(self, cluster: ClusterView, engine: str, n: int, cached: int, path: Sequence[Node]) -> float:
        """L + M + P of placing a prompt of ``n`` tokens, ``cached`` of them held there."""
        missed = n - cached
        return (self.load(cluster, engine) + self.eviction_cost(cluster, engine, missed, path)
                + self.cost_of(cluster, engine).prefill_token_s * missed)

    def queue_wait(self, cluster: ClusterView, engine: str) -> float:
        """Seconds of prefill the engine still has ahead of a newcomer: the in-flight requests' missed tokens,
        drained in placement order at the engine's prefill rate since they were placed."""
        got = self._round.get(engine)
        if got is not None:
            return got
        c = self.cost_of(cluster, engine)
        backlog, t = 0.0, None
        placed = sorted((p for p in cluster.engines[engine].placed if p.placed_at is not None),
                        key=lambda p: p.placed_at)  # type: ignore[arg-type, return-value]
        for p in placed:
            assert p.placed_at is not None
            if t is not None:
                backlog = max(0.0, backlog - (p.placed_at - t))
            missed = self._inflight.get(p.request_id, (p.prompt_tokens, p.prompt_tokens))[0]
            backlog, t = backlog + c.prefill_token_s * missed, p.placed_at
        if t is not None:
            backlog = max(0.0, backlog - (self._now - t))
        self._round[engine] = backlog
        return backlog

    def decode_share(self, cluster: ClusterView, engine: str) -> tuple[float, int]:
        """(share of the engine's in-flight requests that are decode units, in-flight requests)."""
        placed = cluster.engines[engine].placed
        if not placed:
            return 0.0, 0
        units = 0
        for p in placed:
            missed, prompt = self._inflight.get(p.request_id, (p.prompt_tokens, p.prompt_tokens))
            units += missed <= (1.0 - self.config.decode_unit_cached) * prompt
        return units / len(placed), len(placed)

    def _window_requests(self) -> int:
        return sum(len(h.items) for h in self._history.values())

    # ---- the decision -----------------------------------------------------------------------------------------
    def choose(self, request: DispatchRequest, candidates: Sequence[str], cluster: ClusterView) -> Decision:
        """Algorithm 1 for one request (then recorded: tree, history, in-flight)."""
        cfg = self.config
        cands = sorted(candidates)
        toks = request.prompt_token_ids
        if toks is None:  # nothing to match: explore by load with the estimated prompt
            costs = {e: self.total_cost(cluster, e, request.prompt_tokens, 0, ()) for e in cands}
            engine = min(cands, key=lambda e: (costs[e], e))
            self._record(request, engine, None, request.prompt_tokens, 0, cluster)
            return self._decided(Decision(engine, "no-tokens", 0, costs))
        n = len(toks)
        path, matched = self.tree.match(toks)
        cached = {e: self.tree.cached_len(path, e, matched) for e in cands}
        best = max(cached.values(), default=0)
        costs: dict[str, float] = {}

        def cost(e: str) -> float:
            if e not in costs:
                costs[e] = self.total_cost(cluster, e, n, cached[e], path)
            return costs[e]

        if best > n - best:
            # the key portion: the longest node of the best-held prefix (a partly matched last node counts its part)
            key = max((node for node in path if node.start < best),
                      key=lambda node: min(node.end, best) - node.start)
            ks = [e for e in cands if cached[e] >= min(key.end, best)]
            if cfg.current_decode and len(ks) > 1:  # the holders differ by what decodes there now (D)
                held = {e: cost(e) + self.current_decode(cluster, e) for e in ks}
                engine = min(ks, key=lambda e: (held[e], e))
            else:
                engine = min(ks, key=lambda e: (cost(e), e))
            kind = "exploit"
            busy = self._window_requests() >= cfg.min_window_requests
            if cfg.rebalance and busy and len(cands) > 1:
                loads = {e: self.load(cluster, e) for e in cands}
                light = min(cands, key=lambda e: (loads[e], e))
                if light != engine and loads[engine] > cfg.th_bal * loads[light]:
                    engine, kind = light, "rebalance"
            if kind == "exploit" and cfg.replicate and len(ks) < len(cands) \
                    and self._is_hot(key, self.queue_wait(cluster, engine)):
                others = [e for e in cands if e not in ks]
                engine, kind = min(others, key=lambda e: (cost(e), e)), "replicate"
        else:
            engine, kind = "", "explore"
            if cfg.pd_balance and len(cands) > 1:
                shares = {e: self.decode_share(cluster, e) for e in cands}
                top = max(cands, key=lambda e: (shares[e][0], -shares[e][1], e))
                share, inflight = shares[top]
                if inflight >= 2 and share > cfg.decode_ratio:
                    engine, kind = top, "pd-balance"
            if not engine:
                engine = min(cands, key=lambda e: (cost(e), e))
        self._record(request, engine, path, n, cached[engine], cluster, matched)
        return self._decided(Decision(engine, kind, cached[engine], costs))

    def decision_counts(self) -> dict[str, int]:
        return {**self.counts, "eviction-notices": self.notices_applied}

    def _decided(self, d: Decision) -> Decision:
        self.last = d
        self.counts[d.kind] = self.counts.get(d.kind, 0) + 1
        return d

    def _is_hot(self, key: Node, wait: float) -> bool:
        """Record one queueing estimate for ``key``; True (and the window restarts) when the current window's mean
        is ``hot_factor`` x the previous window's (and above min_hot_wait_s)."""
        cfg, now = self.config, self._now
        st = self._hot.get(key)
        if st is None:
            st = self._hot[key] = _Hot(now)
        if now - st.start >= cfg.window_s:
            st.prev = st.total / st.n if st.n else st.prev
            st.start, st.total, st.n = now, 0.0, 0
        st.total += wait
        st.n += 1
        mean = st.total / st.n
        base = st.prev
        if base is None or st.n < 4 or mean < cfg.min_hot_wait_s:
            return False
        if mean >= cfg.hot_factor * max(base, cfg.min_hot_wait_s / cfg.hot_factor):
            st.prev, st.start, st.total, st.n = mean, now, 0.0, 0
            return True
        return False

    def _record(self, request: DispatchRequest, engine: str, path: list[Node] | None, n: int, cached: int,
                cluster: ClusterView, matched: int = 0) -> None:
        missed = n - cached
        self._history.setdefault(engine, _History()).add(self._now, missed, request.max_new_tokens,
                                                         n + request.max_new_tokens // 2)
        self._inflight[request.request_id] = (missed, n)
        self._round.pop(engine, None)
        self._round_decode.pop(engine, None)
        toks = request.prompt_token_ids
        if path is None or toks is None:
            return
        known = min(path[-1].end, matched) if path else 0  # tokens already in the tree before this insertion
        full = self.tree.insert(toks)
        self.tree.record(full, engine, self._now)
        bs = self._block_size.get(engine)
        if bs is not None and len(toks) // bs > known // bs:
            self.tree.register_blocks(full, chain_hashes(toks, bs), bs, known // bs)
        cap = cluster.engines[engine].capacity_tokens
        if self.config.emulate_lru and cap is not None:
            self.tree.evict_lru(engine, cap, keep=full)
