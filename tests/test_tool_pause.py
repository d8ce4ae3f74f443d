"""Tool pauses (LAMPS / INFERCEPT) in the engine: each handling's memory effect, resume by prefix / fork / op, TTL,
demotion under KV pressure, LAMPS ranking and starvation; swap exactness on the tiny random model; the HTTP wire.

Scheduling tests run the real engine core with the simulator's runner under a synchronous owner and a test clock."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import Future

import pytest

from parrot.common.errors import UnknownContext
from parrot.common.sampling import SamplingParams
from parrot.engine.runtime.context import Context, Op, OpKind
from parrot.engine.runtime.core import EngineCore
from parrot.protocol.interface import OpHint, PauseResult, ToolHint
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.kv_cache.host_store import HostStore
from parrot.engine.scheduler.scheduler import Scheduler
from parrot.engine.scheduler.policies import EnginePolicy, FcfsSwap, make_engine_policy
from parrot.engine.scheduler.policies.lamps import LampsPolicy
from parrot.engine.scheduler.tool_handling import FixedCosts, Handling
from parrot.sim.cost_model import CostModel
from parrot.sim.runner import SimRunner
from parrot.sim.tokenizer import WordTokenizer

BS = 4
COST = CostModel(name="t", base_s=0.0, prefill_token_s=0.0, prefill_attn_s=0.0, decode_row_s=0.0, decode_ctx_s=0.0,
                 swap_block_s=0.0, kv_cache_tokens=1024, block_size=BS, max_batch_tokens=64, max_num_seqs=8)
SWAP = FcfsSwap("swap")  # FCFS, every pause swapped (stateless: shared by the tests)
PROMPT = list(range(100, 120))  # 20 tokens = 5 blocks
GEN = SamplingParams(max_tokens=6, ignore_eos=True)  # -> 26 tokens, 25 computed: 6 full blocks + a partial one
SEARCH = ToolHint("search", 1.0)


class SyncEngine(EngineCore):
    """Runs commands at once; steps when the test says so; the clock is ``now``."""

    def __init__(self, policy: EnginePolicy | None, *, num_blocks: int = 64, host_slots: int = 64,
                 max_num_seqs: int = 8, ttl_s: float | None = None) -> None:
        pool = BlockPool(num_blocks, BS)
        self.now = 0.0
        sch = Scheduler(pool, max_num_seqs, 64, policy=policy, host=HostStore(host_slots) if host_slots else None)
        super().__init__(name="core", model_name="m", runner=SimRunner(COST, random.Random(0)), pool=pool,
                         scheduler=sch, tokenizer=WordTokenizer(), max_model_len=512, clock=lambda: self.now,
                         cached_status=False, tool_pause_ttl_s=ttl_s)

    def _new_future(self) -> Future:
        return Future()

    def _submit(self, cmd) -> None:
        cmd()

    def shutdown(self) -> None:
        pass

    def run(self, steps: int = 1000) -> None:
        while self.scheduler.has_work() and steps:
            self.now += 0.01
            self.step()
            steps -= 1

    def call(self, fut):
        self.run()
        return fut.result(timeout=0)


def s1(eng: SyncEngine, ctx: str = "s1", prompt: list[int] = PROMPT, hint: OpHint | None = None) -> list[int]:
    eng.call(eng.fill(prompt, ctx))
    eng.call(eng.generate(GEN, ctx, hint=hint))
    return list(eng.contexts[ctx].tokens)


def test_preserve_keeps_the_blocks_and_discard_frees_them():
    eng = SyncEngine(make_engine_policy("preserve"))
    s1(eng)
    used = eng.pool.num_used
    assert used == 7
    r = eng.call(eng.pause_context("s1", SEARCH))
    assert r == PauseResult("s1", "preserve", 26, 7)
    assert eng.pool.num_used == used and "s1" not in eng.scheduler.idle_contexts
    eng2 = SyncEngine(make_engine_policy("discard"))
    s1(eng2)
    r2 = eng2.call(eng2.pause_context("s1", SEARCH))
    assert r2.handling == "discard" and r2.num_blocks == 7
    assert eng2.pool.num_used == 0 and eng2.pool.num_cached == 6  # the full blocks stay in the prefix cache
    st = eng2.status().extra["tool_pauses"]
    assert st["paused"] == 1 and st["by_handling"]["discard"] == 1


def test_swap_copies_full_blocks_out_and_frees_the_pool():
    eng = SyncEngine(SWAP)
    s1(eng)
    r = eng.call(eng.pause_context("s1", SEARCH))
    assert r.handling == "swap" and r.num_blocks == 6
    assert eng.pool.num_used == 0 and eng.status().extra["host_store"]["blocks"] == 6
    assert eng.call(eng.pause_context("s1", SEARCH)) == r  # a repeated pause answers the first one's record


def _evict_cached(eng: SyncEngine) -> None:
    """Other work takes the whole pool, so cached blocks are gone."""
    filler = list(range(1000, 1000 + (eng.pool.num_blocks - 1) * BS))
    eng.call(eng.fill(filler, "filler"))
    eng.call(eng.free_context("filler"))


def test_resume_by_prefix_swaps_back_in_and_frees_the_paused_context():
    eng = SyncEngine(SWAP, num_blocks=16)
    toks = s1(eng)
    eng.call(eng.pause_context("s1", SEARCH))
    _evict_cached(eng)
    copied = eng.runner.num_copied_blocks
    assert copied == 6  # the swap-outs ran with the filler's first step
    r = eng.call(eng.fill(toks + [7, 8, 9], "s2"))
    assert r.num_cached == 24  # 6 blocks swapped back in
    assert eng.runner.num_copied_blocks == copied + 6
    assert "s1" not in eng.contexts and len(eng.scheduler.pauses) == 0
    st = eng.status().extra
    assert st["tool_pauses"]["resumed"] == 1 and st["host_store"]["hits"] == 6
    eng.kv.check(eng.contexts["s2"])


def test_resume_of_a_preserved_context_by_prefix_match_shares_its_blocks():
    eng = SyncEngine(make_engine_policy("preserve"))
    toks = s1(eng)
    eng.call(eng.pause_context("s1", SEARCH))
    r = eng.call(eng.fill(toks + [7, 8], "s2"))
    assert r.num_cached == 24 and "s1" not in eng.contexts
    assert eng.pool.num_used == eng.pool.blocks_for(28)  # s1's own partial block went with it


def test_resume_by_fork_and_by_an_op_on_the_paused_context():
    eng = SyncEngine(make_engine_policy("preserve"))
    s1(eng)
    eng.call(eng.pause_context("s1", SEARCH))
    eng.call(eng.generate(GEN, "child", parent_context_id="s1"))
    assert "s1" not in eng.contexts and eng.scheduler.pauses.num_resumed == 1
    s1(eng, "s3")
    eng.call(eng.pause_context("s3", SEARCH))
    eng.call(eng.fill([5, 6], "s3"))  # the caller uses it again: it stays, unpaused
    assert "s3" in eng.contexts and eng.scheduler.pauses.get("s3") is None


def test_ttl_expiry_frees_the_paused_context():
    eng = SyncEngine(make_engine_policy("preserve"))
    s1(eng)
    eng.call(eng.pause_context("s1", ToolHint("slow", 10.0)))  # TTL max(30, 4 x 10) = 40 s
    eng.now += 39.0
    eng.call(eng.set_token_cap(None))
    assert "s1" in eng.contexts
    eng.now += 2.0
    eng.call(eng.set_token_cap(None))
    assert "s1" not in eng.contexts and eng.pool.num_used == 0
    assert eng.status().extra["tool_pauses"]["expired"] == 1
    with pytest.raises(UnknownContext):
        eng.call(eng.pause_context("s1", SEARCH))


@pytest.mark.parametrize("host_slots, demoted_to", [(64, Handling.SWAP), (0, Handling.DISCARD)])
def test_preserved_pauses_are_demoted_under_pressure_instead_of_deadlocking(host_slots, demoted_to):
    eng = SyncEngine(make_engine_policy("preserve"), num_blocks=16, host_slots=host_slots)
    s1(eng, "a")
    eng.call(eng.pause_context("a", SEARCH))
    s1(eng, "b", prompt=list(range(200, 220)))
    eng.call(eng.pause_context("b", SEARCH))
    assert eng.pool.num_used == 14
    r = eng.call(eng.fill(list(range(300, 340)), "big"))  # 10 blocks: only if a pause gives its KV up
    assert r.num_filled == 40 and eng.scheduler.num_preemptions == 0
    pauses = eng.scheduler.pauses
    assert pauses.num_demoted >= 1 and {p.handling for p in pauses if p.handling is not Handling.PRESERVE} \
        == {demoted_to}


def test_dynamic_handling_preserves_for_a_short_tool_and_frees_for_a_long_one():
    eng = SyncEngine(make_engine_policy("infercept"), host_slots=0)
    eng.scheduler.costs = FixedCosts(fwd_per_token_s=1e-3, swap_per_token_s=1e-3, decode_step_s=0.01)
    s1(eng, "short")
    s1(eng, "long", prompt=list(range(200, 220)))
    assert eng.call(eng.pause_context("short", ToolHint("calc", 0.001))).handling == "preserve"
    assert eng.call(eng.pause_context("long", ToolHint("image", 60.0))).handling == "discard"


def test_lamps_predicts_the_handling_at_admission_and_uses_it_at_the_pause():
    eng = SyncEngine(make_engine_policy("lamps"))
    eng.scheduler.costs = FixedCosts(fwd_per_token_s=1e-3, swap_per_token_s=1e-6, decode_step_s=0.01)
    s1(eng, hint=OpHint(6, ToolHint("image", 30.0)))
    r = eng.call(eng.pause_context("s1", ToolHint("image", 0.001)))  # the actual tool says "short": not used
    assert r.handling == "swap"


def _waiting(sch: Scheduler, n_tokens: int, hint: OpHint | None, seq: int) -> Op:
    ctx = Context(f"c{seq}", None, tokens=list(range(seq * 1000, seq * 1000 + n_tokens)))
    op = Op(OpKind.GENERATE, ctx, sampling=SamplingParams(max_tokens=1000), arrival=float(seq), hint=hint)
    sch.add(op)
    return op


def test_lamps_ranking_admits_the_lower_memory_time_op_first():
    sch = Scheduler(BlockPool(256, BS), 1, 64, policy=make_engine_policy("lamps"), host=HostStore(64))
    sch.costs = FixedCosts(fwd_per_token_s=1e-3, swap_per_token_s=1e-5, decode_step_s=0.01)
    big = _waiting(sch, 40, OpHint(500, ToolHint("search", 30.0)), 1)  # arrived first
    small = _waiting(sch, 40, OpHint(5), 2)
    assert sch.policy.score(small, sch.view) < sch.policy.score(big, sch.view)
    plan = sch.schedule()
    assert [c.op for c in plan.chunks] == [small]
    fcfs = Scheduler(BlockPool(256, BS), 1, 64, policy=make_engine_policy("infercept"))
    a = _waiting(fcfs, 40, OpHint(500), 1)
    _waiting(fcfs, 40, OpHint(5), 2)
    assert [c.op for c in fcfs.schedule().chunks] == [a]


def test_a_fill_is_ranked_as_the_segment_its_hint_describes():
    sch = Scheduler(BlockPool(256, BS), 1, 64, policy=make_engine_policy("lamps"), host=HostStore(64))
    sch.costs = FixedCosts(fwd_per_token_s=1e-3, swap_per_token_s=1e-5, decode_step_s=0.01)

    def fill(n_tokens: int, hint: OpHint | None, seq: int) -> Op:
        op = Op(OpKind.FILL, Context(f"f{seq}", None, tokens=list(range(seq * 1000, seq * 1000 + n_tokens))),
                arrival=float(seq), hint=hint)
        sch.add(op)
        return op

    long_answer = fill(8, OpHint(800), 1)  # a short prompt whose request will decode 800 tokens
    short_answer = fill(40, OpHint(4), 2)  # a longer prompt, a 4-token answer: less memory over time
    assert sch.policy.score(short_answer, sch.view) < sch.policy.score(long_answer, sch.view)
    assert [c.op for c in sch.schedule().chunks] == [short_answer]


def test_a_started_request_s_generate_goes_before_newly_ranked_requests():
    """LAMPS ranks requests waiting to start; a generate whose fill was computed here is a running request's next
    phase: it is admitted before any newcomer (else its prompt's KV waits, is evicted and recomputed)."""
    eng = SyncEngine(make_engine_policy("lamps"), max_num_seqs=1)
    eng.scheduler.costs = FixedCosts(fwd_per_token_s=1e-3, swap_per_token_s=1e-5, decode_step_s=0.01)
    eng.call(eng.fill(PROMPT, "big", hint=OpHint(900)))  # computed: the request has started
    eng.fill(list(range(500, 504)), "small", hint=OpHint(1))  # a newcomer with far less memory over time
    big = eng.generate(SamplingParams(max_tokens=3, ignore_eos=True), "big", hint=OpHint(900))
    waiting = {op.ctx.id: op for op in eng.scheduler.waiting}
    sch = eng.scheduler
    assert sch.policy.score(waiting["small"], sch.view) < sch.policy.score(waiting["big"], sch.view)
    plan = eng.scheduler.schedule()
    assert [c.op.ctx.id for c in plan.chunks] == ["big"]
    eng.run()
    assert big.result(timeout=0).token_ids


def test_a_starving_op_goes_to_the_head_after_the_threshold():
    sch = Scheduler(BlockPool(256, BS), 1, 64, policy=LampsPolicy("t", starvation_threshold=2))
    big = _waiting(sch, 40, OpHint(900), 0)
    for seq in range(1, 4):
        small = _waiting(sch, 8, OpHint(1), seq)
        plan = sch.schedule()
        admitted = plan.chunks[0].op
        if seq < 3:
            assert admitted is small and sch.policy.ranker.passes(big.seq_no) == seq
        else:
            assert admitted is big and sch.policy.ranker.is_starving(big.seq_no)
        sch.remove(admitted)  # it finished


# ---- the tiny random model: swapped KV is bit-exact ---------------------------------------------------------------
def _tiny(policy: EnginePolicy, **kw):
    from parrot.engine.loader.builder import build_engine
    from parrot.engine.settings import EngineSettings

    eng = build_engine(EngineSettings(random_model="tiny", dtype="float32", weight_quant="none", kv_dtype="float32",
                                      block_size=16, max_model_len=512, attention_kernel="torch", num_threads=1, **kw))
    eng.scheduler.policy = policy  # before any op: a policy the settings do not name (always swap)
    return eng


def _continue_after_pause(eng, evict: bool) -> tuple[tuple[int, ...], tuple[int, ...], dict]:
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = random.Random(5).sample(range(300, 3000), 70)
    eng.fill(prompt, "s1").result(timeout=60)
    first = eng.generate(sp, "s1").result(timeout=60)
    eng.pause_context("s1", SEARCH).result(timeout=60)
    if evict:  # other work takes the pool: the cached copies of s1's blocks are gone, only the host has them
        eng.fill(list(range(5000, 5000 + 300)), "filler").result(timeout=60)
        eng.free_context("filler").result(timeout=60)
    r = eng.fill(prompt + list(first.token_ids) + [11, 12, 13], "s2").result(timeout=60)
    second = eng.generate(sp, "s2").result(timeout=60)
    return first.token_ids, second.token_ids, {"cached": r.num_cached, **eng.status().extra["host_store"]}


def test_swap_round_trip_continues_exactly_as_preserve():
    pres = _tiny(make_engine_policy("preserve"))
    swap = _tiny(SWAP, kv_cache_tokens=320)
    try:
        a1, a2, _ = _continue_after_pause(pres, evict=False)
        b1, b2, st = _continue_after_pause(swap, evict=True)
    finally:
        pres.shutdown()
        swap.shutdown()
    assert st["hits"] == 4 and st["cached"] == 64  # 4 full blocks came back from the host store
    assert a1 == b1 and a2 == b2
    assert swap.runner.copy_bytes_per_s and swap.runner.copy_bytes_per_s > 0


# ---- HTTP -----------------------------------------------------------------------------------------------------
def test_http_pause_context_round_trip_and_hint_on_the_wire():
    from parrot.engine.clients.http_client import HTTPEngineClient
    from parrot.engine.clients.local_client import LocalEngineClient
    from parrot.engine.server.app import create_engine_app
    from parrot.frontend.local import LocalServer

    eng = _tiny(make_engine_policy("preserve"))
    seen: list[OpHint | None] = []
    client = LocalEngineClient(eng)
    inner = client.generate

    async def recording(sampling, context_id, parent_context_id=None, *, hint=None):
        seen.append(hint)
        return await inner(sampling, context_id, parent_context_id, hint=hint)

    client.generate = recording  # type: ignore[method-assign]
    srv = LocalServer(create_engine_app(client))
    hint = OpHint(7, ToolHint("search", 1.5))

    async def main():
        c = HTTPEngineClient(srv.url, "tiny")
        try:
            await c.fill([300 + i for i in range(40)], "h1")
            await c.generate(SamplingParams(max_tokens=3, ignore_eos=True), "h1", hint=hint)
            r = await c.pause_context("h1", ToolHint("search", 1.5))
            assert r == PauseResult("h1", "preserve", 43, 3)
            with pytest.raises(UnknownContext):
                await c.pause_context("nope", ToolHint("search"))
            st = await c.status()
            assert st.extra["tool_pauses"]["by_handling"]["preserve"] == 1
        finally:
            await c.close()

    try:
        asyncio.run(main())
    finally:
        srv.stop()
        eng.shutdown()
    assert seen == [hint]


def test_an_engine_without_tool_handling_frees_on_pause():
    from fakes import FakeEngine

    async def main():
        e = FakeEngine()
        await e.fill([5, 6, 7], "x")
        assert await e.pause_context("x", ToolHint("t")) is None
        assert "x" not in e.contexts

    asyncio.run(main())


def test_hint_wire_shapes_round_trip():
    h = OpHint(12, ToolHint("search", 0.5))
    assert OpHint.from_wire(h.to_wire()) == h
    assert OpHint.from_wire(None) is None and OpHint.from_wire(OpHint().to_wire()) == OpHint()
    p = PauseResult("c", "swap", 10, 2)
    assert PauseResult.from_wire(p.to_wire()) == p


def test_sim_engine_swap_costs_virtual_time_and_resumes_by_prefix():
    from parrot.sim.sim_engine import SimEngine
    from parrot.sim.vloop import run_virtual

    cost = CostModel(name="t", base_s=0.01, prefill_token_s=0.0, prefill_attn_s=0.0, decode_row_s=0.0,
                     decode_ctx_s=0.0, swap_block_s=0.0, kv_cache_tokens=64, block_size=BS, max_batch_tokens=64,
                     max_num_seqs=8, swap_bytes_per_s=1e3, kv_bytes_per_token=25)  # 0.1 s per block one way

    async def main():
        loop = asyncio.get_running_loop()
        e = SimEngine("e", cost, engine_policy=SWAP)
        await e.fill(PROMPT, "s1")
        g = await e.generate(GEN, "s1", hint=OpHint(6, SEARCH))
        assert (await e.pause_context("s1", SEARCH)).num_blocks == 6
        await e.fill(list(range(500, 560)), "filler")  # takes the pool (its first step also runs the swap-outs)
        await e.free_context("filler")
        t0 = loop.time()
        r = await e.fill(PROMPT + list(g.token_ids) + [1, 2], "s2")
        assert r.num_cached == 24 and "s1" not in e.contexts
        assert loop.time() - t0 == pytest.approx(0.01 + 6 * 0.1)  # one step + 6 blocks copied back in
        e.shutdown()

    run_virtual(main())


def test_an_idle_engine_frees_an_expired_pause_without_further_commands():
    import time

    from parrot.engine.runtime import engine_loop as engine_mod

    eng = _tiny(make_engine_policy("preserve"), tool_pause_ttl_s=0.2)
    try:
        eng.fill(list(range(300, 340)), "s1").result(timeout=60)
        eng.pause_context("s1", SEARCH).result(timeout=60)
        deadline = time.monotonic() + 10 * engine_mod.PAUSE_POLL_S
        while eng.status().extra["tool_pauses"]["expired"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # no command reaches the engine meanwhile: only its idle wake-up can expire the pause
        assert eng.status().extra["tool_pauses"]["expired"] == 1
        assert eng.status().kv_blocks_used == 0
    finally:
        eng.shutdown()
