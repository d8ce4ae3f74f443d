"""``parrot profile``: measure the builtin engine on this machine and fit the simulator's cost model.

Runs the real engine (model load included, ~1-2 minutes on 2 cores): prefill iterations of several chunk sizes
after several context lengths, and decode iterations at several batch sizes and context lengths; then a
non-negative least-squares fit of :class:`~parrot.sim.cost_model.CostModel` (linear in tokens, Preble §2.1).
Then the same engine behind the real server (the in-process one of ``P.local``) for the client's per-call
cost outside the engine (:func:`measure_api`: ``api_call_s``, ``api_completion_s``), which the simulated cluster
charges per client call.
Writes ``parrot/sim/cost_models/this-machine.json`` (or ``--out``) with the samples' fit error in ``source``.
This module imports torch only inside :func:`profile_engine` (the engine needs it; the simulator does not).
"""

from __future__ import annotations

import logging
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass

from parrot.sim.cost_model import CostModel, Sample, fit_coefficients, fit_report

log = logging.getLogger(__name__)


API_CALLS = 12  # calls per kind in measure_api (the median is kept)


@dataclass(frozen=True)
class ApiCosts:
    api_call_s: float  # median wall time of one Parrot API call (create a variable with a value; get a ready one)
    api_completion_s: float  # median wall time of a 1-token /v1/completions call minus its engine time (modelled)
    note: str


SWAP_TOKENS = 1024  # context swapped out per round of measure_swap


def measure_swap(engine, tokens: int = SWAP_TOKENS, rounds: int = 3) -> tuple[float | None, str]:
    """The runner's measured rate (bytes/s) of copying a paused context's KV blocks out to the host store, as a
    tool pause under the swap handling does (``rounds`` pauses of ``tokens`` tokens after one unmeasured round
    that allocates the host store); (None, why) when the engine cannot swap."""
    from parrot.protocol.interface import ToolHint
    from parrot.engine.scheduler.policies import FcfsSwap

    runner, sch = engine.runner, engine.scheduler
    if sch.kv.host is None or not hasattr(runner, "copy_bytes_per_s"):
        return None, "not measured (the engine has no swap space)"
    policy = sch.policy
    sch.policy = FcfsSwap("profile-swap")  # the engine is idle here
    rng = random.Random(7)
    n = max(engine.pool.block_size, min(tokens, engine.max_model_len - 8,
                                        engine.pool.num_blocks * engine.pool.block_size // 2))
    try:
        for i in range(rounds + 1):
            if i == 1:
                runner.copy_bytes_per_s = None  # the first round allocated the host store: not a copy rate
            ctx, tick = f"profile-swap-{i}", f"profile-swap-tick-{i}"
            engine.fill([rng.randrange(300, 20000) for _ in range(n)], ctx).result()
            engine.pause_context(ctx, ToolHint("profile", 60.0)).result()
            engine.fill([1, 2, 3], tick).result()  # a plan runs, and the planned copies with it
            engine.free_context(tick).result()
            engine.free_context(ctx).result()
    finally:
        sch.policy = policy
    rate = runner.copy_bytes_per_s
    if rate is None:
        return None, "not measured (no copy ran)"
    return rate, (f"measured {time.strftime('%Y-%m-%d')}: the ModelRunner's block copy out to the host store, "
                  f"{rounds} pauses of {n} tokens ({runner.kv_bytes_per_token} KV bytes per token), EMA "
                  f"{rate / 1e9:.2f} GB/s")


def measure_api(engine, model: CostModel, calls: int = API_CALLS) -> ApiCosts:
    """Serve ``engine`` (a started builtin engine; not shut down here) with the real server app in this process
    and time a client's calls over HTTP on this machine: Parrot API calls that do no engine work, and 1-token
    completions whose engine share (a prefill of the prompt, priced by ``model``) is subtracted. A per-call cost
    of tens of ms here is the network stack (e.g. Nagle's algorithm meeting delayed ACKs on a socket without
    TCP_NODELAY), not Python."""
    import asyncio

    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings
    from parrot.engine.clients.local_client import LocalEngineClient
    from parrot.frontend.client import Session
    from parrot.frontend.local import LocalServer
    from parrot.workloads.baseline_client import BaselineClient

    server = LocalServer(create_app(ServerSettings(), [LocalEngineClient(engine, owns_engine=False)]))
    try:
        session = Session(server.url)
        try:
            api: list[float] = []
            session.create_variable("warm", "x")  # the connection's first call (setup) is not what we measure
            for i in range(calls):
                t = time.perf_counter()
                var = session.create_variable(f"v{i}", f"value {i}")
                api.append(time.perf_counter() - t)
                t = time.perf_counter()
                session.poll_variable(var, None, 0.0)
                api.append(time.perf_counter() - t)
        finally:
            session.close()

        async def completions() -> list[float]:
            out = []
            async with BaselineClient(server.url, latency_ms=(0.0, 0.0)) as client:
                await client.acomplete("warm up", max_tokens=1, ignore_eos=True)
                for i in range(calls):
                    prompt = f"Call {i}: say one word."
                    engine_s = model.prefill_s(len(engine.tokenizer.encode(prompt)) + 1)
                    t = time.perf_counter()
                    await client.acomplete(prompt, max_tokens=1, ignore_eos=True)
                    out.append(max(0.0, time.perf_counter() - t - engine_s))
            return out

        comp = asyncio.run(completions())
    finally:
        server.stop()
    return ApiCosts(statistics.median(api), statistics.median(comp),
                    f"median of {len(api)} Parrot API calls (POST variables with a value, GET of a ready one): "
                    f"{statistics.median(api) * 1e3:.1f} ms (min {min(api) * 1e3:.1f}, max {max(api) * 1e3:.1f}); "
                    f"median of {len(comp)} 1-token /v1/completions calls minus the modelled engine time: "
                    f"{statistics.median(comp) * 1e3:.1f} ms (min {min(comp) * 1e3:.1f}, max {max(comp) * 1e3:.1f}); "
                    "in-process server (parrot.frontend.local.LocalServer), frontend httpx client, 127.0.0.1")


@dataclass(frozen=True)
class ProfilePlan:
    # sized to finish in ~1 minute on 2 cores (the decode contexts' fills dominate)
    prefill_sizes: tuple[int, ...] = (32, 128, 512)
    prefill_contexts: tuple[int, ...] = (0, 768)
    decode_batches: tuple[int, ...] = (1, 4, 12)
    decode_contexts: tuple[int, ...] = (64, 512)
    decode_steps: int = 8
    repeats: int = 2


QUICK_PLAN = ProfilePlan(prefill_sizes=(32, 256), prefill_contexts=(0, 256), decode_batches=(1, 4),
                         decode_contexts=(64,), decode_steps=4, repeats=1)


def profile_engine(settings=None, plan: ProfilePlan = ProfilePlan(), seed: int = 0) -> tuple[CostModel, list[Sample]]:
    """Measure the builtin engine built from ``settings`` (EngineSettings; default: the default model)."""
    from parrot.common.sampling import SamplingParams
    from parrot.engine.loader.builder import build_engine
    from parrot.engine.settings import EngineSettings

    settings = settings or EngineSettings()
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        log.warning("profile: load average %.2f: other processes on this machine slow every sample down (the "
                    "cost model then overstates the engine's time); profile on a quiet machine", load_before[0])
    t_load = time.perf_counter()
    engine = build_engine(settings)
    log.info("profile: engine up in %.1f s", time.perf_counter() - t_load)
    rng = random.Random(seed)
    vocab = engine.tokenizer.vocab_size
    ids = iter(range(10**9))

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]  # random: no prefix-cache hits

    def new_ctx() -> str:
        return f"prof-{next(ids)}"

    samples: list[Sample] = []
    try:
        # Each point is the minimum over ``repeats`` runs (the machine may be shared: the minimum is the
        # least-disturbed measurement). Prefills after a context fork a base context holding it (no refill).
        for c in plan.prefill_contexts:
            base = None
            if c:
                base = new_ctx()
                engine.fill(toks(c), base).result()
            for n in plan.prefill_sizes:
                if n > engine.scheduler.max_batch_tokens:
                    continue  # would take several iterations
                best = float("inf")
                for _ in range(plan.repeats):
                    ctx = new_ctx()
                    t = time.perf_counter()
                    engine.fill(toks(n), ctx, base).result()
                    best = min(best, time.perf_counter() - t)
                    engine.free_context(ctx).result()
                samples.append(Sample(n, n * (c + n / 2), 0, 0, best))
            if base is not None:
                engine.free_context(base).result()
        for c in plan.decode_contexts:
            for b in plan.decode_batches:
                ctxs = [new_ctx() for _ in range(b)]
                for ctx in ctxs:
                    engine.fill(toks(c), ctx).result()
                k = plan.decode_steps
                sp = SamplingParams(max_tokens=k, ignore_eos=True)
                best = float("inf")
                for _ in range(plan.repeats):
                    tokens0 = engine.num_tokens_computed
                    t = time.perf_counter()
                    futs = [engine.generate(sp, ctx) for ctx in ctxs]
                    for f in futs:
                        f.result()
                    dt = time.perf_counter() - t
                    # decode iterations = tokens computed / batch (a first token sampled from the fill's stored
                    # hidden state costs no iteration of its own)
                    steps = max(1, (engine.num_tokens_computed - tokens0) // b)
                    best = min(best, dt / steps)
                samples.append(Sample(0, 0.0, b, b * (c + k), best))
                for ctx in ctxs:
                    engine.free_context(ctx).result()
        coef = fit_coefficients(samples)
        model = CostModel(
            name="this-machine", **coef, swap_block_s=0.0,
            kv_cache_tokens=engine.pool.num_blocks * engine.pool.block_size, block_size=engine.pool.block_size,
            max_batch_tokens=engine.scheduler.max_batch_tokens, max_num_seqs=engine.scheduler.max_num_seqs,
            max_model_len=engine.max_model_len, source={})
        errs = [abs(p - s.seconds) / s.seconds for s, p in fit_report(model, samples)]
        import torch

        source = {
            "generated_by": "parrot profile (parrot.sim.profile.profile_engine): least-squares fit, relative error "
                            "weighting, non-negative coefficients",
            "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": f"{engine.numerics.get('cpu_model', platform.processor() or platform.machine())} "
                       f"[{engine.numerics.get('cpu_family', '?')}], {os.cpu_count()} cores, torch "
                       f"{torch.__version__} threads {torch.get_num_threads()}",
            "engine": f"builtin engine, model {engine.model_name}, numerics {engine.numerics}, block "
                      f"{engine.pool.block_size}, max_batch_tokens {engine.scheduler.max_batch_tokens}",
            "plan": repr(plan),
            "load_average": f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after (1 min; samples are "
                            "slower when other processes run)",
            "fit_relative_error": f"median {statistics.median(errs):.1%}, max {max(errs):.1%} over {len(samples)} "
                                  "samples",
            "samples": [[s.prefill_tokens, s.prefill_attn, s.decode_seqs, s.decode_ctx, round(s.seconds, 6)]
                        for s in samples],
            "swap_block_s": "0: swaps are timed by swap_bytes_per_s x kv_bytes_per_token (the builtin engine "
                            "preempts by recompute; it swaps only tool pauses)",
        }
        api = measure_api(engine, model)
        source["api_call_s"] = source["api_completion_s"] = api.note
        swap_rate, source["swap_bytes_per_s"] = measure_swap(engine)
        swap = {"swap_bytes_per_s": swap_rate, "kv_bytes_per_token": engine.runner.kv_bytes_per_token} \
            if swap_rate else {}
        model = CostModel.from_dict({**model.to_dict(), "api_call_s": api.api_call_s,
                                     "api_completion_s": api.api_completion_s, **swap, "source": source})
        return model, samples
    finally:
        engine.shutdown()


def format_fit(model: CostModel, samples: list[Sample]) -> str:
    lines = [f"{'prefill tok':>11} {'attn pairs':>11} {'decode seqs':>11} {'ctx tok':>8} {'measured ms':>12} "
             f"{'model ms':>9}"]
    for s, p in fit_report(model, samples):
        lines.append(f"{s.prefill_tokens:>11} {s.prefill_attn:>11.0f} {s.decode_seqs:>11} {s.decode_ctx:>8} "
                     f"{s.seconds * 1e3:>12.2f} {p * 1e3:>9.2f}")
    return "\n".join(lines)
