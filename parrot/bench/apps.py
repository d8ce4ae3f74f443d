"""The paper's long-document apps (§8.2) written once as data, with a Parrot driver and a baseline driver.

An :class:`App` is a list of steps in topological order; each step fills one template whose inputs are
constant text (a chunk) or the output of an earlier step, and generates one output of a fixed length
(``max_tokens`` with ``ignore_eos``, so both drivers generate exactly the same number of tokens).

* chain summary: ``s0 = summarize(c0)``, ``s_i = refine(s_{i-1}, c_i)``  (LangChain "refine")
* map-reduce:    ``m_i = summarize(c_i)`` in parallel, ``final = combine(m_0..m_{n-1})``

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
from pathlib import Path

from parrot.bench.baseline_client import BaselineClient, EmulatedLatency
from parrot.common.template import parse_template, render_template
from parrot.frontend.client import Session
from parrot.frontend.function import Output, SemanticFunction
from parrot.frontend.variable import LATENCY, SemanticVariable

OUT = "summary"  # the output placeholder of every step

CHAIN_FIRST = ("Write a concise summary of the following text.\n\nText:\n{{input:chunk}}\n\n"
               "Concise summary: {{output:summary}}")
CHAIN_REFINE = ("Your job is to produce a final summary.\n"
                "We have provided an existing summary up to a certain point: {{input:previous}}\n"
                "We have the opportunity to refine the existing summary with some more context below.\n"
                "------------\n{{input:chunk}}\n------------\n"
                "Given the new context, refine the original summary.\nRefined summary: {{output:summary}}")
MAP = 'Write a concise summary of the following:\n"{{input:chunk}}"\nCONCISE SUMMARY: {{output:summary}}'
REDUCE_HEAD = "The following is a set of summaries:\n"
REDUCE_TAIL = "\nTake these and distill them into a final, consolidated summary.\nSummary: {{output:summary}}"


@dataclass(frozen=True)
class Const:
    text: str


@dataclass(frozen=True)
class FromStep:
    step: str


@dataclass(frozen=True)
class Step:
    name: str
    template: str
    inputs: tuple[tuple[str, Const | FromStep], ...]


@dataclass(frozen=True)
class App:
    name: str
    steps: tuple[Step, ...]  # topological order
    final: str
    output_len: int

    @property
    def num_calls(self) -> int:
        return len(self.steps)


@dataclass(frozen=True)
class RunResult:
    app: str
    mode: str  # "baseline" | "parrot"
    e2e_s: float
    charged_latency_s: float
    round_trips: int
    calls: int
    final_text: str


def split_words(text: str, num_chunks: int, chunk_words: int) -> list[str]:
    """``num_chunks`` consecutive chunks of ``chunk_words`` words from the start of ``text``."""
    words = text.split()
    if num_chunks * chunk_words > len(words):
        raise ValueError(f"document has {len(words)} words; {num_chunks} chunks of {chunk_words} words need "
                         f"{num_chunks * chunk_words}")
    return [" ".join(words[i * chunk_words:(i + 1) * chunk_words]) for i in range(num_chunks)]


def load_document(path: str | Path) -> str:
    return Path(path).read_text(encoding="utf-8")


def chain_summary(chunks: list[str], output_len: int, tag: str = "") -> App:
    steps = [Step("s0", tag + CHAIN_FIRST, (("chunk", Const(chunks[0])),))]
    for i, chunk in enumerate(chunks[1:], start=1):
        steps.append(Step(f"s{i}", tag + CHAIN_REFINE, (("previous", FromStep(f"s{i - 1}")), ("chunk", Const(chunk)))))
    return App("chain", tuple(steps), steps[-1].name, output_len)


def map_reduce_summary(chunks: list[str], output_len: int, tag: str = "") -> App:
    maps = [Step(f"m{i}", tag + MAP, (("chunk", Const(c)),)) for i, c in enumerate(chunks)]
    reduce_template = tag + REDUCE_HEAD + "\n".join("- {{input:m%d}}" % i for i in range(len(chunks))) + REDUCE_TAIL
    reduce = Step("reduce", reduce_template, tuple((f"m{i}", FromStep(f"m{i}")) for i in range(len(chunks))))
    return App("map_reduce", (*maps, reduce), "reduce", output_len)


APPS = {"chain": chain_summary, "map_reduce": map_reduce_summary}


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
