"""Engine policies (parrot.engine.scheduler.policies): one registry read by the settings, the CLI, the builtin engine
and the simulator; a new policy is one class (its own module in the tree) plus one registry entry."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from parrot.common.sampling import SamplingParams
from parrot.engine.runtime.context import Context, Op, OpKind
from parrot.protocol.interface import OpHint, ToolHint
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.scheduler import policies
from parrot.engine.scheduler.policies import EnginePolicy, EngineView, make_engine_policy
from parrot.engine.scheduler.policies.fcfs import FcfsSwap
from parrot.engine.scheduler.scheduler import Scheduler
from parrot.engine.scheduler.tool_handling import Handling
from parrot.sim.cost_model import CostModel

BS = 4
SEARCH = ToolHint("search", 1.0)


# ---- the toy policy: what a new module (e.g. policies/newest_first.py) would hold --------------------------------
class NewestFirst(EnginePolicy):
    """Admits the most recently arrived waiting op first (LIFO); discards every paused context."""

    def order(self, view: EngineView) -> list[Op]:
        return sorted(view.waiting, key=lambda op: op.sort_key, reverse=True)

    def after_admission(self, admitted: Sequence[Op], still_waiting: Sequence[Op]) -> None:
        return None

    def forget(self, op: Op) -> None:
        return None

    def handling_when_queued(self, op: Op, view: EngineView) -> Handling | None:
        return None

    def handling_at_pause(self, ctx: Context, tool: ToolHint, queued: Handling | None,
                          view: EngineView) -> Handling:
        return Handling.DISCARD


@pytest.fixture
def newest_first(monkeypatch):
    """The one registry entry (removed again after the test)."""
    monkeypatch.setitem(policies.ENGINE_POLICIES, "newest-first", lambda name, cfg: NewestFirst(name))
    return "newest-first"


def _op(sch: Scheduler, seq: int, n_tokens: int = 8, hint: OpHint | None = None) -> Op:
    ctx = Context(f"c{seq}", None, tokens=list(range(seq * 100, seq * 100 + n_tokens)))
    op = Op(OpKind.FILL, ctx, arrival=float(seq), hint=hint)
    sch.add(op)
    return op


def test_a_registered_policy_orders_the_scheduler_s_admission(newest_first):
    assert newest_first in policies.engine_policy_names()
    sch = Scheduler(BlockPool(64, BS), 1, 64, policy=make_engine_policy(newest_first))
    ops = [_op(sch, i) for i in range(3)]
    admitted = []
    while sch.waiting:
        (chunk,) = sch.schedule().chunks
        admitted.append(chunk.op)
        sch.remove(chunk.op)
    assert admitted == ops[::-1]


def test_a_registered_policy_is_a_setting_and_a_serve_flag(newest_first):
    from parrot.cli import _engine_flags, _settings_from, build_parser
    from parrot.engine.settings import EngineSettings

    assert EngineSettings(engine_policy=newest_first).engine_policy == newest_first
    skip = {"name", "port", "host"}
    ns = build_parser().parse_args(["serve", "--engine-policy", newest_first])
    assert _settings_from(EngineSettings, ns, skip=skip).engine_policy == newest_first
    flags = _engine_flags(ns, skip)  # handed to each `parrot engine` child
    assert flags[flags.index("--engine-policy") + 1] == newest_first
    with pytest.raises(SystemExit, match="engine-policy"):
        _settings_from(EngineSettings, build_parser().parse_args(["serve", "--engine-policy", "no-such"]), skip=skip)


def test_a_registered_policy_runs_in_the_builtin_engine(newest_first):
    from parrot.engine.loader.builder import build_engine
    from parrot.engine.settings import EngineSettings

    eng = build_engine(EngineSettings(random_model="tiny", dtype="float32", weight_quant="none", kv_dtype="float32",
                                      block_size=16, max_model_len=512, attention_kernel="torch", num_threads=1,
                                      engine_policy=newest_first))
    try:
        assert isinstance(eng.scheduler.policy, NewestFirst)
        eng.fill(list(range(300, 340)), "s1").result(timeout=60)
        eng.generate(SamplingParams(max_tokens=2, ignore_eos=True), "s1").result(timeout=60)
        assert eng.pause_context("s1", SEARCH).result(timeout=60).handling == "discard"
        assert eng.status().extra["engine_policy"] == newest_first
    finally:
        eng.shutdown()


def test_a_registered_policy_runs_in_the_simulator(newest_first):
    from parrot.sim.sim_engine import SimEngine
    from parrot.sim.vloop import run_virtual

    cost = CostModel(name="t", base_s=0.01, prefill_token_s=0.0, prefill_attn_s=0.0, decode_row_s=0.0,
                     decode_ctx_s=0.0, swap_block_s=0.0, kv_cache_tokens=1024, block_size=BS, max_batch_tokens=64,
                     max_num_seqs=1)

    async def main() -> tuple[list[str], str, str]:
        e = SimEngine("e", cost, engine_policy=newest_first)
        done: list[str] = []

        async def fill(ctx: str, seq: int) -> None:
            await e.fill(list(range(seq * 100, seq * 100 + 8)), ctx)
            done.append(ctx)

        await asyncio.gather(*(fill(f"c{i}", i) for i in range(3)))
        await e.generate(SamplingParams(max_tokens=2, ignore_eos=True), "c0")
        pause = await e.pause_context("c0", SEARCH)
        name = e.status().extra["engine_policy"]
        e.shutdown()
        return done, pause.handling, name

    done, handling, name = run_virtual(main())
    assert done == ["c2", "c1", "c0"] and handling == "discard" and name == newest_first


def test_fcfs_admits_by_arrival_even_with_the_manager_s_hints():
    """The fix: ``fcfs`` means arrival order whatever the ops carry; LAMPS' ranking is the ``lamps`` policy."""
    orders = {}
    for name in ("fcfs", "lamps-fcfs", "lamps", "lamps-request"):
        sch = Scheduler(BlockPool(256, BS), 1, 64, policy=make_engine_policy(name))
        big = _op(sch, 1, 40, OpHint(500))  # arrived first, far more memory over time
        small = _op(sch, 2, 40, OpHint(5))
        orders[name] = [c.op for c in sch.schedule().chunks]
        assert orders[name] == ([small] if name.startswith("lamps-r") or name == "lamps" else [big]), name


def test_a_handling_the_engine_cannot_do_becomes_discard():
    sch = Scheduler(BlockPool(64, BS), 1, 64, policy=FcfsSwap("swap"), host=None)
    ctx = Context("c", None, tokens=list(range(8)))
    assert sch.pause(ctx, SEARCH, now=0.0, ttl_s=10.0).handling is Handling.DISCARD


def test_every_registered_policy_module_says_what_it_orders_and_how_it_handles_a_pause():
    import sys

    for name in policies.engine_policy_names():
        doc = sys.modules[type(make_engine_policy(name)).__module__].__doc__ or ""
        assert "order" in doc.lower() and "paused" in doc.lower(), name
