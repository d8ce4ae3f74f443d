"""A simulated cluster: the real Manager (sessions, DAG, deduction, prefix sharing, dispatcher + policy) and the
real request-centric completion path over N simulated engines, all on the virtual loop.

Apps are driven through the Manager API exactly as the HTTP routes do (create_session, create_variable,
submit(SubmitSpec), get_variable); baseline calls go through :class:`parrot.manager.completions.CompletionService`
(what ``POST /v1/completions`` runs). The emulated Internet round trip of the paper (§8.1, 200-300 ms per
call) is ``asyncio.sleep`` on the virtual clock: half before the request reaches the service, half after the
answer leaves it, one per baseline call and one per Parrot app (as in :mod:`parrot.bench.apps`).

The client's own HTTP calls cost what the cost model's ``api_call_s`` / ``api_completion_s`` say (measured by
``parrot profile`` on the machine the model describes; 0 for the GPU models): every Parrot API call the client
makes (create a variable, submit, set a value, the answer of a get) blocks the client for ``api_call_s`` after the
service has acted on it, and a completion's answer reaches the client ``api_completion_s`` after the engine is
done. The client is sequential, as the real frontend is, so a later submit reaches the service later.

Build a :class:`SimCluster` inside a running :class:`~parrot.sim.vloop.VirtualEventLoop`
(:func:`parrot.sim.vloop.run_virtual`); everything is deterministic for a seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

from parrot.common.template import parse_template, render_template
from parrot.engine.clients.local_client import LocalEngineClient
from parrot.manager.completion_types import ChoiceSpec, CompletionSpec
from parrot.manager.completions import CompletionService
from parrot.manager.dispatcher import Policy
from parrot.manager.engine_registry import EngineRegistry
from parrot.manager.graph import VarStatus
from parrot.manager.manager import Manager, ManagerConfig
from parrot.manager.session import SessionState
from parrot.manager.submit import PlaceholderSpec, SubmitSpec
from parrot.sim.cost_model import CostModel, load_model
from parrot.sim.sim_engine import SimEngine
from parrot.sim.tokenizer import OutputLengths
from parrot.workloads.apps import OUT, App, Const, FromStep
from parrot.workloads.multi_agent import OUT as WF_OUT
from parrot.workloads.multi_agent import Workflow


GET_POLL_S = 3600.0  # one long-poll of get_variable (capped by ManagerConfig.max_long_poll_s)


@dataclass(frozen=True)
class ClusterConfig:
    engines: int = 1
    cost_model: str = "llama13b-a100"  # a name in parrot/sim/cost_models or a path
    policy: str = "parrot"  # a manager policy name (parrot.manager.policies.POLICY_NAMES)
    latency_cap_tokens: int = 4096  # paper §8.2: the baseline's latency capacity on one engine
    throughput_cap_tokens: int | None = None  # None: the engine's KV capacity
    prefix_sharing: bool = True  # manager-level prefix contexts (paper §5.3)
    engine_prefix_cache: bool = True  # the engine's block-hash prefix cache
    latency_ms: tuple[float, float] = (200.0, 300.0)
    output_mean: float = 128.0  # mean length of generations that may stop early
    seed: int = 0
    local_policy: str = "fcfs"  # the engines' wait-queue order (fcfs | preble)
    kv_cache_tokens: int | None = None  # override the cost model's KV pool (small pools make eviction matter)
    chunked_prefill: bool = True  # False: every engine schedules as vLLM did in 2023 (the paper's baselines)

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError(f"engines must be >= 1, got {self.engines}")
        low, high = self.latency_ms
        if not 0 <= low <= high:
            raise ValueError(f"latency_ms must be (low, high) with 0 <= low <= high, got {self.latency_ms}")


@dataclass(frozen=True)
class CallResult:
    latency_s: float
    tokens: int
    text: str


class SimCluster:
    def __init__(self, config: ClusterConfig, cost: CostModel | None = None, *, policy: Policy | None = None,
                 shared_prefix_attention: bool = True) -> None:
        """``policy`` overrides ``config.policy`` with a policy object (e.g. one with prefix affinity off)."""
        self.config = config
        self.cost = cost or load_model(config.cost_model)
        if config.kv_cache_tokens is not None:
            self.cost = dataclasses.replace(self.cost, kv_cache_tokens=config.kv_cache_tokens)
        loop = asyncio.get_running_loop()
        self.clock = loop.time
        self.engines = [SimEngine(f"sim{i}", self.cost, seed=config.seed, clock=self.clock,
                                  output_lengths=OutputLengths(config.output_mean),
                                  enable_prefix_cache=config.engine_prefix_cache,
                                  shared_prefix_attention=shared_prefix_attention,
                                  engine_policy=config.local_policy, chunked_prefill=config.chunked_prefill)
                        for i in range(config.engines)]
        mconf = ManagerConfig(policy=config.policy, latency_cap_tokens=config.latency_cap_tokens,
                              throughput_cap_tokens=config.throughput_cap_tokens or self.cost.kv_cache_tokens,
                              prefix_sharing=config.prefix_sharing, engine_heartbeat_s=5.0,
                              max_sessions=1_000_000, session_ttl_s=86_400.0, max_long_poll_s=GET_POLL_S)
        # the manager reaches each engine through the builtin engine's in-process client
        self.registry = EngineRegistry([LocalEngineClient(e, owns_engine=False) for e in self.engines],
                                       clock=self.clock)
        # the manager hands its clock to every component (sessions, DAGs, queue order, deduction, sharing)
        self.manager = Manager(self.registry, policy=policy, config=mconf, clock=self.clock)
        # nobody reads variables' streams in the simulator, and per-token stream events would cost wall time only
        self.manager.executor.stream_outputs = False
        self.completions = CompletionService(self.manager.dispatcher)
        self._rng = random.Random(f"rtt:{config.seed}")
        self.model_name = self.engines[0].model_name

    async def start(self) -> None:
        await self.manager.start()

    async def stop(self) -> None:
        await self.manager.stop()
        for e in self.engines:
            e.shutdown()

    async def __aenter__(self) -> "SimCluster":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- network ----------------------------------------------------------------------------------------------
    def sample_rtt(self) -> float:
        low, high = self.config.latency_ms
        return self._rng.uniform(low, high) / 1000.0

    # ---- Parrot driver ----------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _client_session(self, rtt: bool) -> AsyncIterator[SessionState]:
        """One client program's session: half a round trip to reach the service, the session (deleted at the
        end), the other half back."""
        trip = self.sample_rtt() if rtt else 0.0
        await asyncio.sleep(trip / 2)
        session = self.manager.create_session()
        try:
            yield session
        finally:
            await self.manager.delete_session(session)
        await asyncio.sleep(trip / 2)

    async def _api_call(self) -> None:
        """The client waiting for the answer of one Parrot API call (see the module doc)."""
        if self.cost.api_call_s > 0:
            await asyncio.sleep(self.cost.api_call_s)

    async def run_parrot_app(self, app: App, criteria: str = "latency", *, rtt: bool = True,
                             inline_inputs: bool = False) -> float:
        """Declare the app's DAG with pending inputs, get the final output with ``criteria`` (perf deduction
        labels every step), set the inputs, wait for the final value. Returns virtual end-to-end seconds.

        ``inline_inputs``: the client of :func:`parrot.bench.apps.run_parrot` instead -- each step is submitted
        with its constant inputs as values (a step may start while later ones are still being submitted), and the
        final output is fetched with ``criteria`` after the last submit."""
        t0 = self.clock()
        m = self.manager
        async with self._client_session(rtt) as session:
            inputs, outputs = await self._declare(session, [(step, f"{app.name}_{step.name}", OUT, app.output_len)
                                                            for step in app.steps], inline_inputs=inline_inputs)
            final = outputs[app.final]
            await m.get_variable(session, final, criteria=criteria, timeout_s=0.0)
            for var_id, text in inputs:
                m.set_variable(session, var_id, text)
                await self._api_call()
            await self.wait_value(session, final)
            await self._api_call()  # the get's answer
        return self.clock() - t0

    async def _declare(self, session, steps, *, inline_inputs: bool = False
                       ) -> tuple[list[tuple[str, str]], dict[str, str]]:
        """Submit every step of an app / workflow up front, in order: ``steps`` are (step, request name, output
        name, output tokens); a constant input becomes a pending variable (set later; with ``inline_inputs`` a
        variable holding its value), a step's input the output variable of the step it names. Returns
        ([(input var_id, its text)] still to set, {step name: output var_id})."""
        m = self.manager
        inputs: list[tuple[str, str]] = []
        outputs: dict[str, str] = {}
        for step, name, out, tokens in steps:
            holders = []
            for key, ref in step.inputs:
                if isinstance(ref, Const):
                    var = m.create_variable(session, key, ref.text if inline_inputs else None)
                    await self._api_call()
                    if not inline_inputs:
                        inputs.append((var.var_id, ref.text))
                    holders.append(PlaceholderSpec(key, False, var.var_id))
                else:
                    assert isinstance(ref, FromStep)
                    holders.append(PlaceholderSpec(key, False, outputs[ref.step]))
            holders.append(_fixed_output(out, tokens))
            outputs[step.name] = m.submit(session, SubmitSpec(step.template, holders, name=name)).outputs[0]
            await self._api_call()
        return inputs, outputs

    async def run_parrot_call(self, template: str, inputs: dict[str, str], max_tokens: int, *,
                              criteria: str = "latency", rtt: bool = True, output: str = OUT) -> CallResult:
        """One semantic call in its own session (inputs given as values), fetched with ``criteria``."""
        t0 = self.clock()
        m = self.manager
        async with self._client_session(rtt) as session:
            holders = []
            for k, v in inputs.items():
                holders.append(PlaceholderSpec(k, False, m.create_variable(session, k, v).var_id))
                await self._api_call()
            holders.append(_fixed_output(output, max_tokens))
            req = m.submit(session, SubmitSpec(template, holders))
            await self._api_call()
            await m.get_variable(session, req.outputs[0], criteria=criteria, timeout_s=0.0)
            text = await self.wait_value(session, req.outputs[0])
            await self._api_call()  # the get's answer
        return CallResult(self.clock() - t0, max_tokens, text)

    async def wait_value(self, session: SessionState, var_id: str) -> str:
        while True:
            view = await self.manager.get_variable(session, var_id, timeout_s=GET_POLL_S)
            if view.status is VarStatus.READY:
                assert view.value is not None
                return view.value

    # ---- request-centric baseline driver ----------------------------------------------------------------------
    async def complete(self, prompt: str, max_tokens: int, *, ignore_eos: bool = True,
                       rtt: bool = True) -> "CallResult":
        """One OpenAI-style completion (the LangChain-style client's call), round trip included."""
        t0 = self.clock()
        trip = self.sample_rtt() if rtt else 0.0
        await asyncio.sleep(trip / 2)
        plan = await self.completions.plan_completion(CompletionSpec(self.model_name, [prompt], ChoiceSpec(
            max_tokens=max_tokens, sampling={"temperature": 0.0, "ignore_eos": ignore_eos})))
        result = await self.completions.complete(plan)
        # the answer leaves the service: its own time outside the engine (profiled), then the network
        await asyncio.sleep(trip / 2 + self.cost.api_completion_s)
        return CallResult(self.clock() - t0, result.usage.completion_tokens, result.choices[0].text)

    async def run_baseline_app(self, app: App) -> float:
        """Render and call step by step; a step starts once its inputs are back on the client (map steps run
        concurrently, as LangChain's map-reduce does)."""
        return await self._run_baseline([(step, OUT, app.output_len) for step in app.steps], [app.final])

    async def _run_baseline(self, steps, finals: list[str]) -> float:
        """The request-centric client over ``steps`` ((step, output name, output tokens)): each step is rendered
        and called once its inputs are back (independent steps concurrently), one round trip per call; returns
        virtual seconds until every step named in ``finals`` is back."""
        t0 = self.clock()
        tasks: dict[str, asyncio.Future[str]] = {}

        async def run_step(step, out: str, tokens: int) -> str:
            values = {}
            for key, ref in step.inputs:
                values[key] = ref.text if isinstance(ref, Const) else await tasks[ref.step]
            prompt = render_template(parse_template(step.template), values, until=out)
            return (await self.complete(prompt, tokens)).text

        for step, out, tokens in steps:
            tasks[step.name] = asyncio.ensure_future(run_step(step, out, tokens))
        await asyncio.gather(*(tasks[n] for n in finals))
        return self.clock() - t0

    async def run_app(self, app: App, mode: str, criteria: str = "latency", *, inline_inputs: bool = False) -> float:
        """``mode`` "parrot" (Semantic Variables) or "baseline" (request-centric client); ``inline_inputs``: see
        :meth:`run_parrot_app`."""
        if mode == "parrot":
            return await self.run_parrot_app(app, criteria, inline_inputs=inline_inputs)
        if mode == "baseline":
            return await self.run_baseline_app(app)
        raise ValueError(f"mode must be 'parrot' or 'baseline', got {mode!r}")

    # ---- multi-agent workflows (parrot.workloads.multi_agent) -------------------------------------------------
    async def run_parrot_workflow(self, wf: Workflow, criteria: str = "latency") -> float:
        """Submit every step up front, fetch every step's output with ``criteria`` (each role's message is shown
        to the user as it comes), set the inputs, wait for the final outputs. Virtual end-to-end seconds."""
        t0 = self.clock()
        m = self.manager
        async with self._client_session(True) as session:
            inputs, outputs = await self._declare(session, [(step, step.name, WF_OUT, step.max_tokens)
                                                            for step in wf.steps])
            for var_id in outputs.values():
                await m.get_variable(session, var_id, criteria=criteria, timeout_s=0.0)
            for var_id, text in inputs:
                m.set_variable(session, var_id, text)
                await self._api_call()
            for name in wf.finals:
                await self.wait_value(session, outputs[name])
                await self._api_call()  # the get's answer
        return self.clock() - t0

    async def run_baseline_workflow(self, wf: Workflow) -> float:
        """The request-centric client: render and call each step once its inputs are back (parallel steps
        concurrently), one round trip per call."""
        return await self._run_baseline([(step, WF_OUT, step.max_tokens) for step in wf.steps], list(wf.finals))

    def engine_stats(self) -> dict:
        return {e.name: {"steps": e.num_steps, "busy_s": round(e.busy_s, 3), "tokens": e.num_tokens_computed,
                         "preemptions": e.scheduler.num_preemptions, "prefix_hit_blocks": e.pool.num_hit_blocks}
                for e in self.engines}


def _fixed_output(name: str, max_tokens: int) -> PlaceholderSpec:
    """An output of exactly ``max_tokens`` tokens, as the benchmark apps declare them."""
    return PlaceholderSpec(name, True, None, {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
                                              "stop": []})
