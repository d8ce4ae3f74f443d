"""The engine's per-iteration step budget (parrot/engine/scheduler/step_budget.py): while an op with a per-token
target (OpHint.tpot_s) is in an iteration, the prompt tokens of the other ops are limited to an allowance learned
from measured step times; ops with a target are admitted first. No torch."""

import pytest

from parrot.common.sampling import SamplingParams
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.runtime.context import Context, Op, OpKind
from parrot.engine.scheduler.scheduler import Scheduler
from parrot.engine.scheduler.step_budget import StepBudget
from parrot.protocol.interface import OpHint


def _op(ctx_id: str, n: int, arrival: float, *, tpot_s: float | None = None, kind: OpKind = OpKind.FILL) -> Op:
    ctx = Context(ctx_id, None, tokens=list(range(10_000 * arrival, 10_000 * arrival + n)))
    hint = OpHint(predicted_output_tokens=8, tpot_s=tpot_s) if tpot_s is not None else None
    sampling = SamplingParams(max_tokens=8) if kind is OpKind.GENERATE else None
    return Op(kind, ctx, arrival=arrival, hint=hint, sampling=sampling)


def _run(s: Scheduler, plan) -> None:
    for c in plan.chunks:
        s.kv.mark_computed(c.op.ctx, c.num_tokens)


def test_additive_increase_multiplicative_decrease_within_bounds():
    b = StepBudget(max_tokens=100, min_tokens=16, increase_tokens=16)
    assert b.allowance == 16
    for _ in range(3):
        b.observe(0.020, target_s=0.030)
    assert b.allowance == 64
    b.observe(0.040, target_s=0.030)
    assert b.allowance == 32 and b.num_over == 1 and b.num_guarded == 4
    for _ in range(10):
        b.observe(0.010, target_s=0.030)
    assert b.allowance == 100  # never above the batch budget
    for _ in range(10):
        b.observe(0.050, target_s=0.030)
    assert b.allowance == 16  # never below the floor: the rest keeps progressing
    with pytest.raises(ValueError):
        StepBudget(max_tokens=8, min_tokens=16)
    with pytest.raises(ValueError):
        OpHint(tpot_s=0.0)


def test_the_rest_gets_only_the_allowance_next_to_an_op_with_a_target():
    s = Scheduler(BlockPool(400, 16), max_num_seqs=8, max_batch_tokens=512)
    chat = _op("chat", 40, 0, tpot_s=0.03)
    s.add(chat)
    _run(s, s.schedule())  # the chat's prompt (a fill with a target)
    s.remove(chat)
    gen = _op("chat", 0, 1, tpot_s=0.03, kind=OpKind.GENERATE)
    gen.ctx = chat.ctx
    mapper = _op("map", 1000, 2)
    s.add(gen)
    s.add(mapper)
    plan = s.schedule()
    by_op = {c.op.ctx.id: c.num_tokens for c in plan.chunks}
    assert by_op["map"] == s.step_budget.allowance == 16  # not the 511 tokens the batch budget leaves
    _run(s, plan)
    s.observe_step(0.010)  # within the target: the allowance grows by a block
    assert s.step_budget.allowance == 32
    plan = s.schedule()
    assert {c.op.ctx.id: c.num_tokens for c in plan.chunks}["map"] == 32


def test_without_a_target_every_op_gets_the_whole_budget_and_nothing_is_learned():
    s = Scheduler(BlockPool(400, 16), max_num_seqs=8, max_batch_tokens=512)
    s.add(_op("a", 40, 0))
    s.add(_op("b", 1000, 1))
    plan = s.schedule()
    assert plan.num_tokens == 512
    s.observe_step(1.0)
    assert s.step_budget.num_guarded == 0 and s.step_budget.allowance == 16


def test_ops_with_a_target_are_admitted_before_earlier_ops_without():
    s = Scheduler(BlockPool(400, 16), max_num_seqs=8, max_batch_tokens=64)
    mapper = _op("map", 1000, 0)
    chat = _op("chat", 48, 1, tpot_s=0.03)
    s.add(mapper)
    s.add(chat)
    plan = s.schedule()
    assert [(c.op.ctx.id, c.num_tokens) for c in plan.chunks] == [("chat", 48), ("map", 16)]


def test_a_requests_tpot_target_reaches_the_engine_with_its_generate():
    """A GET with a TPOT target labels the producing request; its lease carries the target into the fill's and the
    generate's OpHint, which is what the engine's step budget keeps."""
    from fakes import FakeEngine
    from test_manager_executor import inp, out, run

    from parrot.common.perf import PinnedTargets
    from parrot.manager.submit import SubmitSpec

    class Recorder(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.hints: list = []

        async def fill(self, tokens, context_id, parent_context_id=None, **kw):
            self.hints.append(("fill", kw.get("hint")))
            return await super().fill(tokens, context_id, parent_context_id, **kw)

        async def generate_stream(self, sampling, context_id, parent_context_id=None, *, hint=None):
            self.hints.append(("generate", hint))
            async for chunk in super().generate_stream(sampling, context_id, parent_context_id, hint=hint):
                yield chunk

        async def generate(self, sampling, context_id, parent_context_id=None, *, hint=None):
            self.hints.append(("generate", hint))
            return await super().generate(sampling, context_id, parent_context_id, hint=hint)

    async def body(mgr, eng):
        s = mgr.create_session()
        a = mgr.create_variable(s, "a", "hi")
        req = mgr.submit(s, SubmitSpec("A: {{input:a}}\nB: {{output:b}}", [inp("a", a.var_id), out("b")]))
        await mgr.get_variable(s, req.outputs[0], timeout_s=5, targets=PinnedTargets(tpot_s=0.02))
        plain = mgr.submit(s, SubmitSpec("C: {{input:a}}\nD: {{output:d}}", [inp("a", a.var_id), out("d")]))
        await mgr.get_variable(s, plain.outputs[0], timeout_s=5)
        return eng.hints

    hints = run(body, Recorder())
    generates = [h for kind, h in hints if kind == "generate"]
    assert generates[0] is not None and generates[0].tpot_s == 0.02
    assert [h.tpot_s for kind, h in hints if kind == "fill" and h is not None][:1] == [0.02]
    assert generates[-1] is not None and generates[-1].tpot_s is None  # no target, none sent
