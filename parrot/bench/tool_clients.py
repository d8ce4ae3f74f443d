"""The two clients of the tool benchmark (:mod:`parrot.bench.tool_bench`): agent requests
(:class:`~parrot.workloads.tools.AgentRequest`) sent at their arrival times through the Semantic-Variable
frontend (``sv``) or the OpenAI chat API with tools (``openai``), with per-request latency and TTFT.

- ``sv``: every round a semantic function whose template continues the previous round's prompt and output
  (:func:`step_template`), the tool an ``@P.native_function(tool=name, expected_duration_s=mean)`` that sleeps the
  request's duration and returns its result; the whole DAG is submitted at the arrival (one session per request).
  TTFT = the first streamed piece of the first thought; latency = the answer's ``get``.
- ``openai``: streamed chat completions offering the request's tool with ``tool_choice`` naming it (finish reason
  ``tool_calls``); the client sleeps the tool's duration and sends the follow-up with the assistant call and the
  ``tool`` message; the last turn (``tool_choice: auto``, ``ignore_eos``) is the answer. TTFT = the first streamed
  chunk of the first turn.

A request that fails is counted (``RunStats.failed``, its error kept) and the run goes on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from parrot.bench.tool_stats import RunStats
from parrot.workloads.tools import CPU_TOOLS, AgentRequest


class ToolBenchError(RuntimeError):
    """A request did not go as the protocol says (no tool call where one was forced, a server that exited)."""


# ---- the SV client ----------------------------------------------------------------------------------------------
def _tool_fn(name: str, expected_s: float):
    """A native function named as tool ``name`` that sleeps the request's duration and returns its result."""
    import parrot as P

    def tool(thought: str, duration_s: float, result: str) -> str:
        time.sleep(duration_s)
        return result

    tool.__name__ = name
    return P.native_function(tool=name, expected_duration_s=expected_s)(tool)


def step_template(r: AgentRequest, k: int, final: bool) -> str:
    """Round ``k``'s prompt: the system prompt and question, rounds 0..k-1 (thought, observation), then the output
    (thought k, or the answer). Round k+1's template continues round k's prompt and output exactly."""
    parts = [r.system, "\nQuestion: {{input:question}}\n"]
    parts += [f"Thought: {{{{input:t{i}}}}}\nObservation: {{{{input:o{i}}}}}\n" for i in range(k)]
    parts.append("Answer: {{output:answer}}" if final else f"Thought: {{{{output:t{k}}}}}")
    return "".join(parts)


def sv_request(url: str, r: AgentRequest, t0: float, timeout_s: float, scale: float, out: RunStats,
               lock: threading.Lock) -> None:
    import parrot as P

    time.sleep(max(0.0, t0 + r.arrival_s - time.monotonic()))
    start = time.monotonic()
    try:
        with P.Session(url, native_workers=2) as s:
            inputs: dict = {"question": r.question}
            first = None
            for k, seg in enumerate(r.segments):
                think = P.SemanticFunction(step_template(r, k, False), name=f"think{k}", defaults=P.Output(
                    max_tokens=seg.out_tokens, ignore_eos=True, stop=[], temperature=0.0))
                t = think(session=s, **inputs)
                first = first or t
                tool = _tool_fn(seg.tool, CPU_TOOLS[seg.tool].mean_s * scale)
                inputs[f"t{k}"], inputs[f"o{k}"] = t, tool(t, seg.duration_s, seg.result, session=s)
            final = P.SemanticFunction(step_template(r, len(r.segments), True), name="answer", defaults=P.Output(
                max_tokens=r.final_tokens, ignore_eos=True, stop=[], temperature=0.0))
            answer = final(session=s, **inputs)
            ttft = None
            for _piece in (first or answer).stream():
                ttft = time.monotonic() - start
                break
            answer.get(timeout=timeout_s)
            lat = time.monotonic() - start
        with lock:
            out.latencies_s.append(lat)
            if ttft is not None:
                out.ttfts_s.append(ttft)
    except Exception as e:  # noqa: BLE001 -- a failed request is counted and reported, the run goes on
        with lock:
            out.failed += 1
            out.errors.append(f"sv #{r.index}: {e!r}"[:300])


def run_sv(url: str, reqs: Sequence[AgentRequest], timeout_s: float, duration_scale: float) -> RunStats:
    """Every request in its own thread (and session) at its arrival time; the run's outcomes."""
    out, lock = RunStats(), threading.Lock()
    t0 = time.monotonic() + 0.2
    with ThreadPoolExecutor(max_workers=max(1, len(reqs)), thread_name_prefix="tool-bench-sv") as pool:
        futs = [pool.submit(sv_request, url, r, t0, timeout_s, duration_scale, out, lock) for r in reqs]
        for f in futs:
            f.result()
    return out


# ---- the OpenAI client ------------------------------------------------------------------------------------------
def _tool_schema(name: str, max_chars: int) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": f"the {name} tool",
        "parameters": {"type": "object", "properties": {"input": {"type": "string", "maxLength": max_chars}},
                       "required": ["input"], "additionalProperties": False}}}


async def openai_request(client, model: str, r: AgentRequest, t0: float, out: RunStats) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + r.arrival_s - loop.time()))
    start = loop.time()
    ttft = None
    max_chars = 3 * max((s.out_tokens for s in r.segments), default=8)
    tools = [_tool_schema(n, max_chars) for n in dict.fromkeys(s.tool for s in r.segments)]
    messages: list[dict] = [{"role": "system", "content": r.system}, {"role": "user", "content": r.question}]
    try:
        for k, seg in enumerate(r.segments):
            stream = await client.chat.completions.create(
                model=model, messages=messages, tools=tools, max_tokens=max_chars + 16, temperature=0.0,
                tool_choice={"type": "function", "function": {"name": seg.tool}}, stream=True)
            call_id, args, finish = None, [], None
            async for chunk in stream:
                for ch in chunk.choices:
                    if ttft is None and (ch.delta.content or ch.delta.tool_calls):
                        ttft = loop.time() - start
                    for tc in ch.delta.tool_calls or ():
                        call_id = call_id or tc.id
                        if tc.function is not None and tc.function.arguments:
                            args.append(tc.function.arguments)
                    finish = ch.finish_reason or finish
            if finish != "tool_calls" or call_id is None:
                raise ToolBenchError(f"round {k}: finish_reason {finish!r}, call id {call_id!r} (expected a call)")
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": seg.tool, "arguments": "".join(args)}}]})
            await asyncio.sleep(seg.duration_s)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": seg.result})
        stream = await client.chat.completions.create(
            model=model, messages=messages, tools=tools, tool_choice="auto", max_tokens=r.final_tokens,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if ttft is None and any(ch.delta.content or ch.delta.tool_calls for ch in chunk.choices):
                ttft = loop.time() - start
        out.latencies_s.append(loop.time() - start)
        if ttft is not None:
            out.ttfts_s.append(ttft)
    except Exception as e:  # noqa: BLE001 -- counted and reported
        out.failed += 1
        out.errors.append(f"openai #{r.index}: {e!r}"[:300])


def run_openai(url: str, model: str, reqs: Sequence[AgentRequest], timeout_s: float) -> RunStats:
    """Every request as a task of one event loop at its arrival time; the run's outcomes."""
    from openai import AsyncOpenAI

    async def main() -> RunStats:
        out = RunStats()
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                               timeout=timeout_s) as client:
            t0 = asyncio.get_running_loop().time() + 0.2
            await asyncio.gather(*(openai_request(client, model, r, t0, out) for r in reqs))
        return out

    return asyncio.run(main())
