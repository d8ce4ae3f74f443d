"""Drivers of the paper's long-document apps (:mod:`parrot.workloads.apps`) on a real server: Parrot and baseline.

Both drivers generate exactly the same number of tokens (every step has ``max_tokens`` with ``ignore_eos``).

Drivers and how the emulated network latency (paper §8.1) is charged, so the comparison is fair:

* **baseline** (:func:`run_baseline`): a LangChain-style client renders every prompt itself and calls
  ``/v1/completions`` per step as soon as the step's inputs are back on the client (map steps concurrently,
  as LangChain's map-reduce does). Each call pays one sampled round trip (half before sending, half after).
* **parrot** (:func:`run_parrot`): one submit per step, all issued up front (a submit never waits for
  generation, so real submits stream out back to back and overlap the server's work), then one ``get`` of
  the final output. The app waits on the network once: the first submit's way to the server plus the final
  get's way back, i.e. **one** sampled round trip per app run (half slept before the first submit, half
  after the get returns). The localhost HTTP time of every submit is real and included in the measurement.

Every run gets a unique tag at the start of each template, so no run reuses another run's cached prefix
(within a run, prompts share prefixes the same way in both modes).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from parrot.common.template import parse_template, render_template
from parrot.frontend.client import Session
from parrot.frontend.function import Output, SemanticFunction
from parrot.frontend.variable import LATENCY, SemanticVariable
from parrot.workloads.apps import OUT, App, Const, Step
from parrot.workloads.baseline_client import BaselineClient, EmulatedLatency


@dataclass(frozen=True)
class RunResult:
    app: str
    mode: str  # "baseline" | "parrot"
    e2e_s: float
    charged_latency_s: float
    round_trips: int
    calls: int
    final_text: str


def _functions(app: App) -> dict[str, SemanticFunction]:
    """One semantic function per distinct template, with the fixed output length."""
    fixed = Output(max_tokens=app.output_len, ignore_eos=True, temperature=0.0, stop=[])
    funcs: dict[str, SemanticFunction] = {}
    for step in app.steps:
        if step.template not in funcs:
            funcs[step.template] = SemanticFunction(step.template, name=f"{app.name}_{step.name}", defaults=fixed)
    return funcs


def run_parrot(app: App, session: Session, latency: EmulatedLatency) -> RunResult:
    """Submit every step up front, get the final output once (one emulated round trip, see module doc)."""
    funcs = _functions(app)
    t0 = time.perf_counter()
    charged0 = latency.charged_s
    rtt = latency.sample_s()
    time.sleep(rtt / 2)
    outputs: dict[str, SemanticVariable] = {}
    for step in app.steps:
        args = {k: ref.text if isinstance(ref, Const) else outputs[ref.step] for k, ref in step.inputs}
        outputs[step.name] = funcs[step.template](session=session, **args)
    text = outputs[app.final].get(perf=LATENCY)
    time.sleep(rtt / 2)
    return RunResult(app.name, "parrot", time.perf_counter() - t0, latency.charged_s - charged0, 1,
                     app.num_calls, text)


async def run_baseline(app: App, client: BaselineClient) -> RunResult:
    """Render and call step by step; a step starts once its inputs are back on the client."""
    t0 = time.perf_counter()
    charged0, trips0, calls0 = client.latency.charged_s, client.latency.round_trips, client.calls
    tasks: dict[str, asyncio.Future[str]] = {}

    async def run_step(step: Step) -> str:
        values = {}
        for key, ref in step.inputs:
            values[key] = ref.text if isinstance(ref, Const) else await tasks[ref.step]
        prompt = render_template(parse_template(step.template), values, until=OUT)
        return await client.acomplete(prompt, max_tokens=app.output_len, ignore_eos=True)

    for step in app.steps:  # topological order: every dependency already has its task
        tasks[step.name] = asyncio.ensure_future(run_step(step))
    try:
        text = await tasks[app.final]
    finally:
        for t in tasks.values():
            t.cancel()
    return RunResult(app.name, "baseline", time.perf_counter() - t0, client.latency.charged_s - charged0,
                     client.latency.round_trips - trips0, client.calls - calls0, text)
