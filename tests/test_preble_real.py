"""Preble's eviction notices end to end: two real `parrot engine` processes (tiny random model, 16-block KV pools)
push their status over HTTP; the manager's registry records it and E2 drops the prefixes an engine evicted from its
radix tree. E2's own LRU emulation is switched off, so only the notices can drop them."""

from __future__ import annotations

import random
from dataclasses import replace

import httpx

from engine_procs import TINY_ENGINE, wait_until

KV_TOKENS = 256  # 16 blocks of 16: two 128-token prompts do not fit together
ENGINE_ARGS = [a for i, a in enumerate(TINY_ENGINE)
               if a != "--kv-cache-tokens" and (i == 0 or TINY_ENGINE[i - 1] != "--kv-cache-tokens")]


def test_engine_eviction_notices_reach_e2_through_heartbeats(tmp_path, default_model_path):
    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings
    from parrot.engine.server.procs import start_engines, stop_all
    from parrot.frontend.local import LocalServer
    from parrot.manager.policies import E2Policy

    secret = "preble-test-engine-secret"
    app = create_app(ServerSettings(policy="e2", engine_heartbeat_s=0.5, heartbeat_timeout_s=10,
                                    engine_secret=secret), [])
    server = LocalServer(app)
    log = open(tmp_path / "engines.log", "w")
    procs = start_engines(2, server.url, secret=secret, engine_args=[*ENGINE_ARGS, "--kv-cache-tokens", str(KV_TOKENS)],
                          prefix="pn", heartbeat_s=0.2, output=log)
    try:
        registry = app.state.manager.registry

        def live() -> set[str]:
            return {e.name for e in registry.entries() if e.healthy}

        wait_until(lambda: live() == {"pn-0", "pn-1"}, 180, "two engines to register")
        policy = app.state.manager.dispatcher.policy
        assert isinstance(policy, E2Policy)
        policy.config = replace(policy.config, emulate_lru=False)
        model = httpx.get(f"{server.url}/v1/models", timeout=5).json()["data"][0]["id"]
        rng = random.Random(0)

        def complete(tokens: list[int]) -> dict:
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

        def fresh() -> list[int]:
            return [rng.randrange(100, 40000) for _ in range(128)]

        def held(tokens: list[int], engine: str) -> int:
            path, matched = policy.tree.match(tokens)
            return policy.tree.cached_len(path, engine, matched)

        def evicted(engine: str) -> int:
            status = registry.entry(engine).status
            return status.extra["kv_blocks_evicted"] if status is not None else 0

        # a first request so both engines' baselines (seq 0) and block size are known before A is placed
        complete(fresh())
        a = fresh()
        complete(a)
        owner = policy.last.engine
        assert held(a, owner) == 128
        assert policy.notices_applied == 0
        start = evicted(owner)
        for _ in range(30):  # unrelated prompts until the owner's pool has evicted at least A's worth of blocks
            complete(fresh())
            if evicted(owner) >= start + 8:
                break
        assert evicted(owner) >= start + 8, "the flood never reached A's engine"
        wait_until(lambda: (complete(fresh()), held(a, owner) < 128)[1], 20,
                   "E2 to apply the owner's eviction notice (a dispatch round syncs the statuses)")
        assert policy.notices_applied >= 1 and policy.notice_tokens_dropped >= 16
        complete(a + [7])  # A again: no engine is believed to hold it any more
        assert policy.last.cached < 128
        # E2's counters reach the operator: GET /api/v1/stats and /metrics
        stats = httpx.get(f"{server.url}/api/v1/stats", timeout=5).json()["scheduler"]
        assert stats["decisions"]["eviction-notices"] == policy.notices_applied >= 1
        assert sum(n for k, n in stats["decisions"].items() if k != "eviction-notices") >= 5  # one per completion
        metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
        assert 'parrot_policy_decisions_total{kind="eviction-notices",policy="e2"}' in metrics
    finally:
        stop_all(procs)
        server.stop()
        log.close()
