"""The engine core (op lifecycle, stop handling, token accounting, context freeing) without torch or threads:
a synchronous owner and a runner whose sampled tokens follow a script. The builtin engine (LLMEngine) and the
simulator (SimEngine) are both this core with another owner and runner."""

from __future__ import annotations

import random
from collections import Counter
from concurrent.futures import Future

import pytest

from parrot.common.errors import ContextLengthExceeded, EngineError, UnknownContext
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.engine.runtime.core import EngineCore
from parrot.engine.runtime.engine_loop import LLMEngine
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.scheduler.scheduler import Scheduler
from parrot.sim.cost_model import CostModel
from parrot.sim.sim_engine import SimEngine
from parrot.sim.runner import SimRunner
from parrot.sim.tokenizer import EOS, WordTokenizer

COST = CostModel(name="t", base_s=0.0, prefill_token_s=0.0, prefill_attn_s=0.0, decode_row_s=0.0, decode_ctx_s=0.0,
                 swap_block_s=0.0, kv_cache_tokens=1024, block_size=16, max_batch_tokens=64, max_num_seqs=8)


WORDS = WordTokenizer()  # scripts are encoded with the engines' tokenizer, so it can decode them
PROMPT = WORDS.encode("a short prompt of some words")


class ScriptedRunner(SimRunner):
    """The simulator's runner, sampling the i-th token of ``script`` as an op's i-th token."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(COST, random.Random(0))
        self.script = script

    def _next_token(self, op) -> int:
        return self.script[len(op.output_ids)]


class SyncEngine(EngineCore):
    """An owner that runs commands at once and steps only when the test says so."""

    def __init__(self, script: list[int], max_model_len: int = 512, num_blocks: int = 64) -> None:
        pool = BlockPool(num_blocks, 16)
        self.now = 0.0
        super().__init__(name="core", model_name="m", runner=ScriptedRunner(script), pool=pool,
                         scheduler=Scheduler(pool, 8, 64), tokenizer=WORDS, max_model_len=max_model_len,
                         clock=lambda: self.now, cached_status=False)
        self.closed = False

    def _new_future(self) -> Future:
        return Future()

    def _submit(self, cmd) -> None:
        cmd()

    def shutdown(self) -> None:
        self.closed = True

    def run(self, steps: int = 1000) -> None:
        while self.scheduler.has_work() and steps:
            self.now += 1.0
            self.step()
            steps -= 1


def _generate(engine: SyncEngine, sp: SamplingParams, ctx: str = "c"):
    """Fill PROMPT into ``ctx``, generate after it (queued behind the fill), run to the end."""
    chunks = []
    fill = engine.fill(PROMPT, ctx)
    fut = engine.generate(sp, ctx, on_chunk=lambda ch: chunks.append((ch.token_ids, ch.text, ch.finish_reason)))
    engine.run()
    assert fill.result(timeout=0).num_filled == len(PROMPT)
    return fut.result(timeout=0), chunks


def test_eos_stops_only_after_min_tokens_and_is_reported_but_not_decoded():
    eng = SyncEngine(WORDS.encode("one") + [EOS] + WORDS.encode("two three") + [EOS, EOS])
    res, chunks = _generate(eng, SamplingParams(max_tokens=10, min_tokens=3))
    assert res.finish_reason is FinishReason.STOP
    assert len(res.token_ids) == 5 and res.token_ids[-1] == EOS  # the EOS at 2 was too early
    assert res.text == " one two three"  # EOS tokens carry no text
    assert chunks[-1][2] is FinishReason.STOP and all(c[2] is None for c in chunks[:-1])
    assert "".join(c[1] for c in chunks) == res.text
    assert eng.contexts["c"].tokens[-5:] == list(res.token_ids)  # generated tokens are part of the context


def test_stop_string_across_tokens_is_held_back_then_cut():
    eng = SyncEngine(WORDS.encode("we stop here now please"))
    res, chunks = _generate(eng, SamplingParams(max_tokens=10, stop=("here now",)))
    assert res.finish_reason is FinishReason.STOP and len(res.token_ids) == 4
    assert res.text == " we stop "
    # "here" might start the stop string: held back, and never streamed since it did
    assert [c[1] for c in chunks] == [" we", " stop", " ", ""]


def test_stop_token_ids_and_length_limits():
    script = WORDS.encode("x y z w v u")
    eng = SyncEngine(script)
    res, _ = _generate(eng, SamplingParams(max_tokens=10, stop_token_ids=(script[2],)))
    assert res.finish_reason is FinishReason.STOP and res.token_ids == tuple(script[:3]) and res.text == " x y"
    res, _ = _generate(SyncEngine(script), SamplingParams(max_tokens=4, ignore_eos=True))
    assert res.finish_reason is FinishReason.LENGTH and len(res.token_ids) == 4
    # the model's window ends a generation too, and a fill past it fails typed
    eng = SyncEngine(script, max_model_len=len(PROMPT) + 2)
    res, _ = _generate(eng, SamplingParams(max_tokens=10))
    assert res.finish_reason is FinishReason.LENGTH and len(res.token_ids) == 2
    with pytest.raises(ContextLengthExceeded):
        eng.fill(PROMPT, "c").result(timeout=0)


def test_free_aborts_the_active_generate_and_fails_queued_fills():
    eng = SyncEngine(WORDS.encode("a b c d e f g h"))
    eng.fill(PROMPT, "c")
    eng.run()
    gen = eng.generate(SamplingParams(max_tokens=8), "c")
    queued = eng.fill(PROMPT, "c")  # waits behind the generate on the same context
    eng.run(steps=3)
    assert eng.status().num_running == 1 and not gen.done()
    eng.free_context("c").result(timeout=0)
    res = gen.result(timeout=0)
    assert res.finish_reason is FinishReason.ABORT and 0 < len(res.token_ids) < 8
    with pytest.raises(EngineError, match="freed"):
        queued.result(timeout=0)
    assert eng.pool.num_used == 0 and eng.status().num_contexts == 0
    with pytest.raises(UnknownContext):
        eng.free_context("c").result(timeout=0)


def test_fork_shares_full_blocks_and_timestamps_come_from_the_clock():
    eng = SyncEngine(WORDS.encode("p q r"))
    long_prompt = list(range(100, 140))  # 2 full blocks + 8 tokens
    eng.fill(long_prompt, "parent")
    eng.run()
    eng.fill([7, 8], "child", "parent")
    assert eng.pool.num_shared == 2  # the child references the parent's two full blocks
    t0 = eng.now
    gen = eng.generate(SamplingParams(max_tokens=3), "child")
    eng.run()
    res = gen.result(timeout=0)
    assert res.prompt_len == 42 and res.latency_s == eng.now - t0 and 0 < res.ttft_s <= res.latency_s


def test_builtin_and_simulated_engines_are_the_same_core():
    """No second copy of the op lifecycle: both engines inherit every step of it from EngineCore."""
    lifecycle = ("fill", "generate", "free_context", "set_token_cap", "pin_prefix", "_start", "_complete", "apply",
                 "_on_token", "next_plan", "fail_all", "snapshot")
    for cls in (LLMEngine, SimEngine):
        assert issubclass(cls, EngineCore)
        assert not set(lifecycle) & set(vars(cls)), f"{cls.__name__} overrides the core's op lifecycle"


def _check_kv(eng: SyncEngine) -> None:
    """Each context's KV invariants (KVManager.check), and each block referenced exactly by the tables holding it."""
    holders: Counter[int] = Counter()
    for ctx in eng.contexts.values():
        eng.kv.check(ctx)
        holders.update(ctx.block_table)
    assert all(eng.pool.refcount(b) == holders[b] for b in range(eng.pool.num_blocks))


@pytest.mark.parametrize("seed", range(4))
def test_random_fills_forks_generates_and_frees_keep_the_kv_invariants(seed):
    """A small pool under random traffic (prefix hits, forks, eviction, preemption): after every step each
    context's KV record is consistent and the pool's refcounts are exactly the block tables' references."""
    rng = random.Random(seed)
    eng = SyncEngine(WORDS.encode(" ".join("abcdefghijklmnopqrstuvwxyz")), num_blocks=10)
    common = [rng.randrange(100, 200) for _ in range(40)]  # a shared prompt head: prefix-cache hits
    names: list[str] = []
    for i in range(60):
        action = rng.random()
        if action < 0.35 or not names:
            name = f"c{i}"
            head = common[: rng.choice([0, 16, 20, 40])]
            eng.fill(head + [rng.randrange(100, 200) for _ in range(rng.randrange(1, 30))], name)
            names.append(name)
        elif action < 0.55:
            name = f"c{i}"
            eng.fill([rng.randrange(100, 200) for _ in range(rng.randrange(0, 10))], name, rng.choice(names))
            names.append(name)
        elif action < 0.85:
            eng.generate(SamplingParams(max_tokens=rng.randrange(1, 24)), rng.choice(names))
        else:
            eng.free_context(names.pop(rng.randrange(len(names))))
        for _ in range(rng.randrange(0, 3)):
            eng.now += 1.0
            eng.step()
            _check_kv(eng)
    eng.run()
    _check_kv(eng)
    assert eng.scheduler.num_preemptions + eng.pool.num_evicted > 0  # the pool was short at times
    for name in names:
        eng.free_context(name)
    assert eng.pool.num_used == 0


def test_a_generate_queues_by_the_arrival_of_the_fill_it_follows():
    """Fair service: a request's decode is not served after every fill that arrived during its own prefill. The
    generate that follows a fill on the same context (or on a fork made of it) ranks by that fill's arrival, so
    the first request finishes while later prompts are still being prefilled; a generate with no fill before
    it ranks by its own arrival."""
    eng = SyncEngine(WORDS.encode("p q r s"))
    prompt = list(range(100, 160))  # 60 tokens: one request's prefill fills a 64-token step
    eng.fill(prompt, "a")
    eng.now = 0.5
    later = [eng.fill([t + i for t in prompt], f"b{i}") for i in range(5)]  # arrive while a is being prefilled
    eng.now += 1.0
    eng.step()
    assert eng.contexts["a"].num_computed == 60 and not any(f.done() for f in later)
    gen = eng.generate(SamplingParams(max_tokens=2, ignore_eos=True), "a")
    assert gen.done() is False
    # forked from a filled context, the child's generate ranks with the parent's turn too
    fork_gen = eng.generate(SamplingParams(max_tokens=2, ignore_eos=True), "a2", "a")
    while not gen.done():
        eng.now += 1.0
        eng.step()
    assert sum(f.done() for f in later) <= 2, "the generate waited for the fills that arrived after its own"
    eng.run()
    assert fork_gen.result(timeout=0).token_ids and all(f.result(timeout=0).num_filled == 60 for f in later)
    # after the generate, a's turn is over: another generate on it ranks by its own arrival, behind waiting fills
    late = [eng.fill([t + 7 for t in prompt], f"c{i}") for i in range(2)]
    eng.now += 1.0
    gen2 = eng.generate(SamplingParams(max_tokens=1, ignore_eos=True), "a")
    while not gen2.done():
        eng.now += 1.0
        eng.step()
    assert all(f.done() for f in late)
