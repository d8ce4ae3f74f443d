"""LAMPS on the simulator: tool policies (lamps / lamps-request / infercept / discard = vLLM / preserve) on a GPU
cost model, each table with the zero-load bound no policy can beat.

    python -m parrot.sim.tool_experiments [main|ablation|errors|all] [--quick] [--seed N] [--cost-model NAME]
        [--mix single|multi|toolbench] [--rates R ...] [--policies P ...]
    python -m parrot.sim.experiments tools [--quick]

One simulated engine (the real EngineCore + Scheduler with a cost model, on the virtual clock) is driven through
the in-process EngineClient, request by request, as a tool-calling client would::

    fill(prompt, c0, hint=h0); generate(c0, hint=h0)    h0 = OpHint(predicted_output_tokens, ToolHint(tool, predicted_s),
                                                              predicted_return_tokens, later=(h1, h2, ...))
    pause_context(c0, ToolHint(...))           # instead of free_context: the engine keeps / swaps / drops its KV
    sleep(tool duration)                       # the tool runs (virtual clock)
    fill(prompt + out_0 + ret_0, c1)           # a new context whose prefix continues c0: resumed by content match
    generate(c1, hint=...) ... free_context(c_k)

End-to-end latency is arrival -> last token; TTFT is arrival -> the first generated token. Every policy replays
the same seeded workload (:mod:`parrot.workloads.tools`); each op's hint states the request's later calls and its
time so far (``OpHint.later`` / ``elapsed_s``, what ``lamps-request`` ranks and ages by). The KV pool is the cost
model's, by default an A100 limited to 40 GB as in LAMPS §6.1 (GPT-J-6B-class model: LLaMA-7B's
roofline).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from parrot.common.report import format_table, p99, ratio
from parrot.common.sampling import SamplingParams
from parrot.protocol.interface import OpHint, ToolHint
from parrot.engine.clients.local_client import LocalEngineClient
from parrot.sim.cost_model import GPU_MEM_UTILIZATION, LLMS, CostModel, load_model
from parrot.sim.sim_engine import SimEngine
from parrot.sim.tokenizer import FIRST_WORD_ID
from parrot.sim.vloop import run_virtual
from parrot.workloads.tools import ToolRequest, describe, make_workload, with_prediction_error

log = logging.getLogger(__name__)

POLICIES = ("lamps", "lamps-request", "infercept", "discard", "preserve")
LAMPS_NO_RANKING = "lamps-fcfs"  # the ablation: predicted handling, FCFS order
"""LAMPS §6.3's first step: predicted handling, FCFS admission."""


SWAP_GIB = 128.0
"""Host swap space: INFERCEPT's runs use ``--swap-space 128`` (GiB, vLLM's flag)."""


def gpu_40gb(name: str = "llama7b-a100") -> CostModel:
    """``name``'s cost model with its KV pool cut to what a 40 GB GPU leaves (LAMPS §6.1 limits each A100 to
    40 GB), by the roofline's own rule: 90 % of memory minus weights minus a 3 GB reserve."""
    cost = load_model(name)
    llm = LLMS[name.split("-")[0]]
    kv = int((GPU_MEM_UTILIZATION * 40e9 - 2 * llm.params - 3e9) // llm.kv_bytes_per_token)
    return dataclasses.replace(cost, name=f"{name}-40gb", kv_cache_tokens=min(cost.kv_cache_tokens, kv))


def host_blocks(cost: CostModel, gib: float = SWAP_GIB) -> int:
    """KV blocks ``gib`` GiB of host memory holds for ``cost``'s model (bytes per block from its swap time)."""
    block_bytes = cost.swap_s(1) * cost.swap_bytes_per_s
    return int(gib * 2 ** 30 // block_bytes)


# ---- one run ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestResult:
    rid: int
    kind: str
    ttft_s: float
    latency_s: float
    num_calls: int
    resume_tokens: int   # context tokens re-filled at the resumes
    resume_cached: int   # of those, served by the prefix cache (preserved blocks, swapped-in or cached ones)


@dataclass(frozen=True)
class RunResult:
    policy: str
    requests: tuple[RequestResult, ...]
    pauses: dict          # the engine's tool_pauses status (counts by handling, demotions, ...)
    preemptions: int
    makespan_s: float

    def _vals(self, attr: str) -> list[float]:
        return [getattr(r, attr) for r in self.requests]

    def mean(self, attr: str) -> float:
        return statistics.fmean(self._vals(attr))

    def p99(self, attr: str) -> float:
        return p99(self._vals(attr))

    @property
    def throughput(self) -> float:
        return len(self.requests) / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def resume_hit(self) -> float:
        tot = sum(r.resume_tokens for r in self.requests)
        return sum(r.resume_cached for r in self.requests) / tot if tot else 0.0


def _token_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_WORD_ID, vocab) for _ in range(n)]


def segment_hints(req: ToolRequest) -> tuple[OpHint, ...]:
    """Each segment's predictions as the manager would send them: output tokens, tool and its predicted duration,
    and the tokens the tool returns (exact, as the output and duration hints are without injected error)."""
    return tuple(OpHint(predicted_output_tokens=s.predicted_output_tokens,
                        tool=ToolHint(s.tool.name, s.tool.predicted_s) if s.tool is not None else None,
                        predicted_return_tokens=s.tool.return_tokens if s.tool is not None else None)
                 for s in req.segments)


def zero_load_latency_s(req: ToolRequest, cost: CostModel) -> float:
    """A lower bound on ``req``'s end-to-end latency under any policy: the request alone on the engine (no queue,
    no other request in its batches, its KV kept over every tool call), i.e. its tool time plus one prefill
    iteration per segment (the new tokens after the kept context) and one batch-of-one decode step per output
    token. Any other request only lengthens an iteration (the cost model is increasing in every term)."""
    t = 0.0
    ctx = 0
    new = req.prompt_tokens
    for seg in req.segments:
        t += cost.prefill_s(new, ctx)
        ctx += new
        for k in range(seg.output_tokens - 1):  # the prefill iteration's own token is the first output
            t += cost.decode_s(1, ctx + k)
        ctx += seg.output_tokens
        if seg.tool is None:
            break
        t += seg.tool.duration_s
        new = seg.tool.return_tokens
    return t


async def drive_request(client: LocalEngineClient, req: ToolRequest, vocab: int, seed: int) -> RequestResult:
    """Run ``req`` from its arrival: segment by segment, pausing its context over every tool call."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, req.arrival_s - loop.time()))
    rng = random.Random(f"tool-req:{seed}:{req.rid}")
    tokens = _token_ids(rng, req.prompt_tokens, vocab)
    ttft: float | None = None
    resume_tokens = resume_cached = 0
    ctx = ""
    hints = segment_hints(req)
    for i, seg in enumerate(req.segments):
        ctx = f"r{req.rid}.{i}"
        tool = hints[i].tool
        # the request's remaining calls and its age so far (lamps-request ranks and ages by them)
        hint = dataclasses.replace(hints[i], later=hints[i + 1:], elapsed_s=loop.time() - req.arrival_s)
        # as the manager does: the prompt's fill carries the segment's predictions (the engine ranks the request by
        # them), then the generate follows once the fill is done
        filled = await client.fill(tokens, ctx, hint=hint)
        res = await client.generate(SamplingParams(max_tokens=seg.output_tokens, ignore_eos=True), ctx, hint=hint)
        if i > 0:
            resume_tokens += filled.num_filled
            resume_cached += filled.num_cached
        if ttft is None:
            ttft = loop.time() - res.latency_s + res.ttft_s - req.arrival_s
        tokens = tokens + list(res.token_ids)
        if seg.tool is None:
            break
        assert tool is not None
        await client.pause_context(ctx, tool)
        await asyncio.sleep(seg.tool.duration_s)
        tokens = tokens + _token_ids(rng, seg.tool.return_tokens, vocab)
    await client.free_context(ctx)
    return RequestResult(req.rid, req.kind, ttft or 0.0, loop.time() - req.arrival_s, req.num_calls,
                         resume_tokens, resume_cached)


async def _run(requests: Sequence[ToolRequest], policy: str, cost: CostModel, seed: int,
               swap_space_blocks: int) -> RunResult:
    engine = SimEngine("tools-0", cost, seed=seed, engine_policy=policy, swap_space_blocks=swap_space_blocks)
    client = LocalEngineClient(engine, owns_engine=False)
    vocab = engine.tokenizer.vocab_size
    try:
        results = await asyncio.gather(*(drive_request(client, r, vocab, seed) for r in requests))
        st = engine.status()
    finally:
        engine.shutdown()
    start = min((r.arrival_s for r in requests), default=0.0)
    end = max((r.arrival_s + x.latency_s for r, x in zip(requests, results)), default=0.0)
    return RunResult(policy, tuple(results), dict(st.extra.get("tool_pauses") or {}),
                     st.num_preempted_total, end - start)


def run_policy(requests: Sequence[ToolRequest], policy: str, cost: CostModel, *, seed: int = 0,
               swap_gib: float = SWAP_GIB) -> RunResult:
    """Replay ``requests`` on a fresh simulated engine under ``policy`` (a fresh virtual loop) with ``swap_gib``
    GiB of host swap space; ``policy``: an engine policy name (parrot.engine.scheduler.policies)."""
    return run_virtual(_run(requests, policy, cost, seed, host_blocks(cost, swap_gib)))


# ---- experiments -----------------------------------------------------------------------------------------------
def _conditions(cost: CostModel, requests: Sequence[ToolRequest], extra: str = "") -> str:
    return (f"  cost model {cost.name}: KV pool {cost.kv_cache_tokens:,} tokens, max {cost.max_num_seqs} seqs, "
            f"{cost.max_batch_tokens} tokens/iteration, swap {cost.swap_s(1) * 1e3:.3f} ms/block, host swap space "
            f"{SWAP_GIB:g} GiB ({host_blocks(cost):,} blocks)\n"
            f"  workload: {describe(requests)}{extra}")


def compare(mix: str = "multi", rates: Sequence[float] = (2.0, 3.0, 4.0), n: int = 1200, seed: int = 0,
            cost: CostModel | None = None, policies: Sequence[str] = POLICIES) -> str:
    """LAMPS Fig. 6: mean / p99 end-to-end latency and TTFT per policy across request rates, with the zero-load
    bound (:func:`zero_load_latency_s`: no policy can go below it) and, against INFERCEPT, the most any policy
    could gain (``1 - bound / infercept``)."""
    cost = cost or gpu_40gb()
    out = []
    for rate in rates:
        reqs = make_workload(mix, n, rate, seed=seed)
        runs = {p: run_policy(reqs, p, cost, seed=seed) for p in policies}
        lamps = runs.get("lamps")
        infercept = runs.get("infercept")
        rows = []
        for p, r in runs.items():
            rows.append([p, r.mean("latency_s"), r.p99("latency_s"), r.mean("ttft_s"), r.p99("ttft_s"),
                         r.throughput, _pause_mix(r), r.preemptions,
                         f"{ratio(r.mean('latency_s'), lamps.mean('latency_s')):.2f}x" if lamps else "-",
                         f"{ratio(r.mean('latency_s'), infercept.mean('latency_s')):.2f}x" if infercept else "-",
                         f"{ratio(r.p99('latency_s'), infercept.p99('latency_s')):.2f}x" if infercept else "-",
                         f"{ratio(r.mean('ttft_s'), lamps.mean('ttft_s')):.2f}x" if lamps else "-"])
        bound = sorted(zero_load_latency_s(q, cost) for q in reqs)
        b_mean = statistics.fmean(bound)
        b_p99 = p99(bound)
        b_ttft = statistics.fmean(cost.prefill_s(q.prompt_tokens) for q in reqs)
        rows.append(["BOUND (zero load)", b_mean, b_p99, b_ttft, "-", "-", "-", "-",
                     f"{ratio(b_mean, lamps.mean('latency_s')):.2f}x" if lamps else "-",
                     f"{ratio(b_mean, infercept.mean('latency_s')):.2f}x" if infercept else "-", "-", "-"])
        note = ""
        if infercept:
            gain = 1 - b_mean / infercept.mean("latency_s")
            note = (f"\n  bound: each request alone on the engine, KV kept over its tool calls (a lower bound for any "
                    f"policy); the most any policy can cut INFERCEPT's mean latency here is {gain:.1%}")
        out.append(format_table(
            ["policy", "mean lat s", "p99 lat s", "mean TTFT s", "p99 TTFT s", "req/s", "pauses p/s/d",
             "preempt", "lat / lamps", "lat / infercept", "p99 / infercept", "TTFT / lamps"], rows,
            title=f"[LAMPS Fig. 6] {mix}-API mix at {rate:g} req/s (sim)")
            + "\n" + _conditions(cost, reqs) + note)
    return "\n\n".join(out)


def _pause_mix(r: RunResult) -> str:
    by = r.pauses.get("by_handling", {})
    return f"{by.get('preserve', 0)}/{by.get('swap', 0)}/{by.get('discard', 0)}"


def ablation(mix: str = "multi", rate: float = 4.0, n: int = 1200, seed: int = 0, cost: CostModel | None = None) -> str:
    """LAMPS Fig. 10: INFERCEPT, then predicted handling with FCFS, then + memory-over-time ranking."""
    cost = cost or gpu_40gb()
    reqs = make_workload(mix, n, rate, seed=seed)
    rows = []
    for label, pol in (("vLLM (discard)", "discard"), ("INFERCEPT", "infercept"),
                       ("LAMPS w/o scheduling", LAMPS_NO_RANKING), ("LAMPS", "lamps")):
        r = run_policy(reqs, pol, cost, seed=seed)
        rows.append([label, r.mean("latency_s"), r.p99("latency_s"), r.mean("ttft_s"), r.p99("ttft_s"),
                     r.throughput, _pause_mix(r)])
    return (format_table(["system", "mean lat s", "p99 lat s", "mean TTFT s", "p99 TTFT s", "req/s",
                          "pauses p/s/d"], rows,
                         title=f"[LAMPS Fig. 10] components, {mix}-API mix at {rate:g} req/s (sim)")
            + "\n" + _conditions(cost, reqs))


def errors(mix: str = "multi", rates: Sequence[float] = (4.0,), n: int = 1200, seed: int = 0,
           cost: CostModel | None = None, ps: Sequence[float] = (0.0, 0.05, 0.1, 0.3, 0.5)) -> str:
    """LAMPS Fig. 11: Gaussian error N(0, p * m) on the output-length and tool-duration hints."""
    cost = cost or gpu_40gb()
    out = []
    for rate in rates:
        base = make_workload(mix, n, rate, seed=seed)
        rows = []
        for p in ps:
            r = run_policy(with_prediction_error(base, p, seed=seed), "lamps", cost, seed=seed)
            rows.append([f"{p:.0%}", r.mean("latency_s"), statistics.median(r._vals("latency_s")),
                         r.p99("latency_s"), r.mean("ttft_s"), r.throughput, _pause_mix(r)])
        out.append(format_table(["error p", "mean lat s", "median lat s", "p99 lat s", "mean TTFT s", "req/s",
                                 "pauses p/s/d"], rows,
                                title=f"[LAMPS Fig. 11] LAMPS under prediction error, {mix}-API at {rate:g} req/s "
                                      f"(sim)")
                   + "\n" + _conditions(cost, base))
    return "\n\n".join(out)


def tools(quick: bool = False, seed: int = 0) -> str:
    """Everything, sized for ``python -m parrot.sim.experiments tools`` (``quick``: 300 requests at one rate)."""
    if quick:
        return compare(rates=(4.0,), n=300, seed=seed)
    return "\n\n".join([compare(seed=seed), ablation(seed=seed), errors(seed=seed)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", nargs="?", default="all", choices=["main", "ablation", "errors", "all"])
    p.add_argument("--quick", action="store_true", help="one rate, 300 requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", default="multi", choices=["single", "multi", "toolbench"])
    p.add_argument("--requests", type=int, default=1200)
    p.add_argument("--rates", type=float, nargs="+", default=[2.0, 3.0, 4.0])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), help="engine policies to compare (main)")
    p.add_argument("--cost-model", default="llama7b-a100", help="a GPU cost model (its KV cut to 40 GB)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cost = gpu_40gb(args.cost_model)
    n = 300 if args.quick else args.requests
    rates = args.rates[-1:] if args.quick else args.rates
    jobs = {"main": lambda: compare(args.mix, rates, n, args.seed, cost, args.policies),
            "ablation": lambda: ablation(args.mix, rates[-1], n, args.seed, cost),
            "errors": lambda: errors(args.mix, rates[-1:], n, args.seed, cost)}
    for name in (list(jobs) if args.name == "all" else [args.name]):
        t = time.perf_counter()
        print(jobs[name](), flush=True)
        print(f"  ({name}: {time.perf_counter() - t:.1f} s wall)\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
