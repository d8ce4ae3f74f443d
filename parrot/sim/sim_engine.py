"""SimEngine: the builtin engine's core (contexts, op lifecycle, scheduler, KV block pool, prefix cache) driven by
an asyncio task on the virtual clock, with :class:`~parrot.sim.runner.SimRunner` in place of the model.

Everything but the forward pass is the real engine code (:class:`~parrot.engine.runtime.core.EngineCore`). The owner
here is a task instead of a thread; each turn::

    plan = core.next_plan()              # the real batch plan
    await asyncio.sleep(runner.cost_s(plan))   # the cost model instead of a forward (virtual seconds)
    core.apply(runner.execute(plan))     # tokens counted as computed, blocks registered, synthetic tokens

As in the builtin engine, commands run only between iterations: one that arrives while an iteration "runs"
waits for its end (an idle engine runs it at once). Its calls return asyncio futures, so the manager talks to
it through the same :class:`~parrot.engine.clients.local_client.LocalEngineClient` as to an in-process builtin engine
(create it with ``owns_engine=False`` and call :meth:`SimEngine.shutdown` yourself: no threads here).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable

from parrot.common.errors import EngineError
from parrot.engine.runtime.core import Command, EngineCore
from parrot.protocol.interface import EngineStatus
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.kv_cache.host_store import HostStore
from parrot.engine.scheduler.scheduler import Scheduler
from parrot.engine.scheduler.policies import EnginePolicy, make_engine_policy
from parrot.sim.cost_model import CostModel
from parrot.sim.runner import SimRunner
from parrot.sim.tokenizer import OutputLengths, WordTokenizer

log = logging.getLogger(__name__)


class SimEngine(EngineCore):
    def __init__(self, name: str, cost: CostModel, *, model_name: str = "sim-llm", seed: int = 0,
                 output_lengths: OutputLengths = OutputLengths(), vocab_size: int = 32000,
                 enable_prefix_cache: bool = True, shared_prefix_attention: bool = True,
                 clock: Callable[[], float] | None = None, profiled: bool = True,
                 engine_policy: str | EnginePolicy = "fcfs",
                 swap_space_blocks: int | None = None, tool_pause_ttl_s: float | None = None,
                 chunked_prefill: bool = True) -> None:
        """Create inside the running (virtual) loop; ``clock`` defaults to that loop's time. ``profiled``: the
        engine's step-time statistics start from its cost model's profile grid (:func:`seed_step_stats`), as a
        real engine warmed up over several batch shapes; otherwise they start empty and learn from its steps.
        ``engine_policy``: a name of ``ENGINE_POLICIES`` (parrot.engine.scheduler.policies; fcfs: FCFS, pauses
        preserved) or a policy made for this engine alone;
        ``swap_space_blocks``: host slots for swapped KV (None: as many as the pool has blocks; 0: no swap);
        ``tool_pause_ttl_s``: see EngineCore; ``chunked_prefill=False``: the 2023 vLLM scheduler (whole prompts
        first, decodes wait; Scheduler._prefill_step)."""
        self._loop = asyncio.get_running_loop()
        pool = BlockPool(-(-cost.kv_cache_tokens // cost.block_size), cost.block_size,
                         enable_prefix_cache=enable_prefix_cache)
        runner = SimRunner(cost, random.Random(f"{seed}:{name}"), output_lengths,
                           shared_prefix_attention=shared_prefix_attention)
        policy = make_engine_policy(engine_policy) if isinstance(engine_policy, str) else engine_policy
        slots = pool.num_blocks if swap_space_blocks is None else swap_space_blocks
        super().__init__(name=name, model_name=model_name, runner=runner, pool=pool,
                         scheduler=Scheduler(pool, cost.max_num_seqs, cost.max_batch_tokens,
                                             policy=policy,
                                             host=HostStore(slots) if slots else None,
                                             chunked_prefill=chunked_prefill),
                         tokenizer=WordTokenizer(vocab_size), max_model_len=cost.max_model_len,
                         clock=clock or self._loop.time, cached_status=False, computes_logits=False,
                         tool_pause_ttl_s=tool_pause_ttl_s)
        self.runner: SimRunner = runner
        self.cost = cost
        if profiled:
            seed_step_stats(self, cost)
        self.busy_s = 0.0  # virtual seconds spent in iterations
        self.peak_kv_blocks = 0  # most KV blocks in use at once (paper Fig. 18b: KV memory)
        self._in_step = False  # between a plan and its apply: commands wait in _deferred
        self._deferred: list[Command] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False

    def status(self) -> EngineStatus:
        """A fresh snapshot (callers share the owner's loop), with the simulator's own counters."""
        st = self.snapshot()
        return dataclasses.replace(st, extra={**st.extra, "busy_s": self.busy_s, "cost_model": self.cost.name})

    def shutdown(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            self._task = None

    # ---- the owner: a task on the loop -----------------------------------------------------------------------
    def _new_future(self) -> asyncio.Future:
        return self._loop.create_future()

    def _submit(self, cmd: Command) -> None:
        if self._closed:
            raise EngineError("engine is shut down")
        if self._in_step:
            self._deferred.append(cmd)
        else:
            cmd()
        if self._task is None:
            self._task = self._loop.create_task(self._run(), name=f"sim-engine-{self.name}")
        self._wake.set()

    async def _run(self) -> None:
        while True:
            plan = self.next_plan() if self.scheduler.has_work() else None
            if plan is None:  # idle, or waiting work that cannot be admitted: wait for a command
                self._wake.clear()
                await self._wake.wait()
                continue
            dt = self.runner.cost_s(plan)
            self.busy_s += dt
            self._in_step = True
            try:
                await asyncio.sleep(dt)
                self.peak_kv_blocks = max(self.peak_kv_blocks, self.pool.num_used)
                self.apply(self.runner.execute(plan))
            except Exception:
                log.exception("simulated engine step failed; failing running ops")
                self.fail_all(EngineError("internal engine error during a step"))
            finally:
                self._in_step = False
            deferred, self._deferred = self._deferred, []
            for cmd in deferred:
                cmd()


# the shapes ``parrot profile`` measures (parrot.sim.profile.ProfilePlan): prefills after 0 / 768 tokens of
# context, decodes at batch 1 / 4 / 12 over 64- and 512-token contexts
_PROFILE_PREFILLS = ((32, 0), (128, 0), (512, 0), (32, 768), (128, 768), (512, 768))
_PROFILE_DECODES = ((1, 64), (4, 64), (12, 64), (1, 512), (4, 512), (12, 512))


def seed_step_stats(engine: SimEngine, cost: CostModel) -> None:
    """Record the profile grid's iterations, timed by the cost model, in ``engine.step_stats``."""
    for n, ctx in _PROFILE_PREFILLS:
        n = min(n, cost.max_batch_tokens)
        engine.step_stats.add(0, 0, n, cost.prefill_s(n, ctx))
    for batch, ctx in _PROFILE_DECODES:
        engine.step_stats.add(batch, batch * ctx, 0, cost.decode_s(batch, batch * ctx))
