"""The dispatcher's engine capabilities, incremental per-engine caps and policy-requested rounds; the prefix
store's known sizes (placement from known token counts)."""

from __future__ import annotations

import asyncio
import dataclasses

from parrot.protocol.interface import EngineCapabilities, EngineStatus
from parrot.manager import EngineRegistry
from parrot.manager.dispatcher import Dispatcher
from parrot.manager.policies import CapacityConfig, DispatchRequest, make_policy
from parrot.manager.policies.baseline import FifoPolicy
from parrot.manager.prefix_store import ContextRef, PrefixStore
from fakes import FakeEngine

CAPS = CapacityConfig(latency_cap_tokens=1000, throughput_cap_tokens=8000)


class Advertising(FakeEngine):
    """A fake engine that advertises capabilities in its status."""

    def __init__(self, name: str, caps: EngineCapabilities) -> None:
        super().__init__(name)
        self.capabilities = caps
        self.caps_pushed: list[int | None] = []

    async def status(self) -> EngineStatus:
        st = await super().status()
        return dataclasses.replace(st, extra={"capabilities": self.capabilities.to_wire()})

    async def set_token_cap(self, max_running_tokens: int | None) -> bool:
        self.caps_pushed.append(max_running_tokens)
        return True


def test_capabilities_round_trip_and_missing_means_none():
    caps = EngineCapabilities(shared_prefix_attention=True, fork=True, prefix_cache=False, kv_tokens=4096)
    st = EngineStatus("e", "m", 512, 0, 0, 0, 0, 1, 0, 0, 0, 16, 0, extra={"capabilities": caps.to_wire()})
    assert EngineCapabilities.from_status(st) == caps
    assert EngineCapabilities.from_status(dataclasses.replace(st, extra={})) is None
    assert EngineCapabilities.from_status(None) is None


def test_count_once_credit_only_where_the_engine_advertises_shared_prefix_attention():
    async def main():
        registry = EngineRegistry([Advertising("k", EngineCapabilities(shared_prefix_attention=True, fork=True)),
                                   Advertising("p", EngineCapabilities(shared_prefix_attention=False, fork=True)),
                                   FakeEngine("x")])
        await registry.refresh()
        view = Dispatcher(registry, make_policy("parrot", CAPS))._cluster()
        return {n: v.shared_prefix_attention for n, v in view.engines.items()}

    assert asyncio.run(main()) == {"k": True, "p": False, "x": False}


def test_caps_are_recomputed_only_for_the_engines_that_changed_and_match_a_full_rebuild():
    async def main():
        e0, e1 = (Advertising(n, EngineCapabilities()) for n in ("e0", "e1"))
        registry = EngineRegistry([e0, e1])
        await registry.refresh()
        d = Dispatcher(registry, make_policy("fifo-latency", CAPS))
        built = []
        orig = d._cluster

        def counting(queued=(), only=None):
            built.append(None if only is None else set(only))
            return orig(queued, only)

        d._cluster = counting
        a = await d.acquire(DispatchRequest("a", prompt_tokens=600))
        b = await d.acquire(DispatchRequest("b", prompt_tokens=600))
        await asyncio.sleep(0.05)
        # every acquire built the view once (its round): the caps reused it
        assert built == [None, None]  # one view per round; the caps reused it
        assert e0.caps_pushed[-1] == 1000 and e1.caps_pushed[-1] == 1000
        built.clear()
        a.release()
        await asyncio.sleep(0.05)
        assert built == [{a.engine}]  # only the released engine's view was rebuilt
        released = e0 if a.engine == "e0" else e1
        other = e1 if released is e0 else e0
        assert released.caps_pushed[-1] is None and other.caps_pushed[-1] == 1000
        full = orig()  # the full rebuild agrees with what was pushed
        assert [p.demand.cap for p in full.engines[b.engine].placed] == [1000]
        assert not full.engines[a.engine].placed
        b.release()
        await d.close()

    asyncio.run(main())


def test_dispatcher_runs_the_round_a_policy_asks_for():
    class Later(FifoPolicy):
        """Holds everything back until a time it names, then places it (stands in for a paced policy)."""

        def __init__(self, clock):
            super().__init__(1000, name="later")
            self.clock, self.open_at = clock, None

        def place(self, queue, cluster):
            if self.open_at is None:
                self.open_at = self.clock() + 0.05
            return super().place(queue, cluster) if self.clock() >= self.open_at else []

        def next_round_at(self):
            return self.open_at

    async def main():
        loop = asyncio.get_running_loop()
        registry = EngineRegistry([FakeEngine("e0")])
        await registry.refresh()
        policy = Later(loop.time)
        d = Dispatcher(registry, policy, clock=loop.time)
        t0 = loop.time()
        lease = await asyncio.wait_for(d.acquire(DispatchRequest("a", prompt_tokens=10)), 1)
        waited = loop.time() - t0
        lease.release()
        await d.close()
        return waited

    assert 0.04 <= asyncio.run(main()) < 0.5  # no other event happened: the timer round placed it


def test_prefix_store_remembers_sizes_and_learns_chars_per_token():
    store = PrefixStore()
    assert store.known_tokens("h1") is None and store.longest_known(["h0", "h1"]) is None
    assert store.chars_per_token() == 4.0
    store.add_context("h1", ContextRef("e0", "c1", 301))
    store.remove_context("e0", "c1")  # the context is gone, its size stays known
    assert store.known_tokens("h1") == 301
    assert store.longest_known(["h0", "h1", "h2"]) == (1, 301)
    store.observe("h1", 1410)  # 300 tokens of text in 1410 characters
    store.observe("h1", 99999)  # a prefix counts once
    assert abs(store.chars_per_token() - 4.7) < 1e-9
