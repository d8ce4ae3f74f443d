"""The paper's LangChain apps (§8.2: chain summary, map-reduce summary) as LCEL chains, run both ways in one run.

    python -m parrot.bench.langchain_bench [--url URL] [--apps chain map_reduce] [--chunks 6] [--chunk-words 100]
        [--output-len 20] [--rtt-ms 0 100] [--repeats 3]

The same LCEL chain (built by :func:`chain_summary` / :func:`map_reduce_summary` around a model) runs as:

* **langchain**: plain LangChain with langchain-openai's ``OpenAI`` model against Parrot's OpenAI-compatible
  ``/v1/completions``: every step's prompt rendered client-side and sent when its inputs are back, one call at
  a time (map branches concurrently: LangChain's RunnableParallel runs them in threads). What LangChain users do.
* **parrot**: the chain compiled with :func:`~parrot.integrations.langchain.compile_chain` around a
  :class:`~parrot.integrations.langchain.ParrotLLM`: every step submitted as a semantic function at once, one
  read of the final output. The timed run includes opening and deleting the Parrot session (what
  ``compile_chain(chain).invoke`` does without ``session=``).

Both generate exactly ``--output-len`` tokens per step (``ignore_eos``), greedy. Network: every HTTP request of
either mode pays ``--rtt-ms`` (half before sending, half after the answer; a transport wrapping httpx's), so
a mode is charged for the requests it makes. Documents vary across runs (the chunks are taken from a different
offset of the document each run), so no run is served from another run's prefix cache; the order of the two modes
alternates between repeats. Prints the table, the ratio langchain / parrot (median end-to-end latency) and the
conditions; saves ``<out>/langchain_bench-<time>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import threading
import time
from operator import itemgetter
from pathlib import Path
from typing import Any

import httpx
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import Runnable, RunnableParallel

from parrot.common.report import format_conditions, format_table, save_json
from parrot.frontend.client import Session
from parrot.integrations.langchain import ParrotLLM, compile_chain

log = logging.getLogger(__name__)

DEFAULT_DOCUMENT = Path(__file__).resolve().parents[2] / "examples" / "data" / "lighthouses.txt"
# LangChain's own summarize prompts (load_summarize_chain's "refine" and "map_reduce")
FIRST = "Write a concise summary of the following text.\n\nText:\n{chunk}\n\nConcise summary:"
REFINE = ("Your job is to produce a final summary.\n"
          "We have provided an existing summary up to a certain point: {previous}\n"
          "We have the opportunity to refine the existing summary with some more context below.\n"
          "------------\n{chunk}\n------------\n"
          "Given the new context, refine the original summary.\nRefined summary:")
MAP = 'Write a concise summary of the following:\n"{chunk}"\nCONCISE SUMMARY:'
REDUCE_HEAD = "The following is a set of summaries:\n"
REDUCE_TAIL = "\nTake these and distill them into a final, consolidated summary.\nSummary:"


def chain_summary(llm: Runnable, chunks: int) -> Runnable:
    """``s0 = summarize(c0)``, ``s_i = refine(s_{i-1}, c_i)``: one LCEL chain nesting the previous one."""
    chain: Runnable = ({"chunk": itemgetter("c0")} | PromptTemplate.from_template(FIRST, name="summarize") | llm
                       | StrOutputParser())
    for i in range(1, chunks):
        chain = ({"previous": chain, "chunk": itemgetter(f"c{i}")}
                 | PromptTemplate.from_template(REFINE, name=f"refine{i}") | llm | StrOutputParser())
    return chain


def map_reduce_summary(llm: Runnable, chunks: int) -> Runnable:
    """``m_i = map(c_i)`` in parallel branches, then ``reduce(m_0..m_{n-1})``."""
    mapper = PromptTemplate.from_template(MAP, name="map") | llm | StrOutputParser()
    reduce = PromptTemplate.from_template(
        REDUCE_HEAD + "\n".join("- {m%d}" % i for i in range(chunks)) + REDUCE_TAIL, name="reduce")
    branches = RunnableParallel({f"m{i}": itemgetter(f"c{i}") | mapper for i in range(chunks)})
    return branches | reduce | llm | StrOutputParser()


APPS = {"chain": chain_summary, "map_reduce": map_reduce_summary}


class DelayedTransport(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """httpx's transport with ``rtt_s`` added to every request (half before, half after); counts requests."""

    def __init__(self, rtt_s: float) -> None:
        self.rtt_s = rtt_s
        self.requests = 0
        self._lock = threading.Lock()
        self._sync = httpx.HTTPTransport()
        self._async = httpx.AsyncHTTPTransport()

    def _count(self) -> None:
        with self._lock:
            self.requests += 1

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self._count()
        time.sleep(self.rtt_s / 2)
        response = self._sync.handle_request(request)
        time.sleep(self.rtt_s / 2)
        return response

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self._count()
        await asyncio.sleep(self.rtt_s / 2)
        response = await self._async.handle_async_request(request)
        await asyncio.sleep(self.rtt_s / 2)
        return response

    def close(self) -> None:
        self._sync.close()


def document_chunks(words: list[str], chunks: int, chunk_words: int, run: int) -> dict[str, str]:
    """The chain's input: ``chunks`` consecutive chunks starting at a run-dependent offset (wrapping around)."""
    start = (run * 997) % len(words)
    rotated = words[start:] + words[:start]
    need = chunks * chunk_words
    rotated = (rotated * (need // len(rotated) + 1))[:need]
    return {f"c{i}": " ".join(rotated[i * chunk_words:(i + 1) * chunk_words]) for i in range(chunks)}


def run_langchain(app: str, url: str, model: str, args: argparse.Namespace, inputs: dict[str, str],
                  rtt_s: float) -> tuple[float, int, str]:
    """Plain LangChain through langchain-openai: (seconds, HTTP requests, final summary)."""
    from langchain_openai import OpenAI

    transport = DelayedTransport(rtt_s)
    with httpx.Client(transport=transport, timeout=600) as http:
        llm = OpenAI(base_url=url + "/v1", api_key=args.api_key or "none", model=model, temperature=0,
                     max_tokens=args.output_len, max_retries=0, timeout=600, http_client=http,
                     extra_body={"ignore_eos": True})
        chain = APPS[app](llm, args.chunks)
        t0 = time.perf_counter()
        out = chain.invoke(inputs)
        return time.perf_counter() - t0, transport.requests, out


def run_parrot(app: str, url: str, model: str, args: argparse.Namespace, inputs: dict[str, str],
               rtt_s: float) -> tuple[float, int, str]:
    """The same chain compiled to Parrot semantic functions: (seconds, HTTP requests, final summary)."""
    transport = DelayedTransport(rtt_s)
    llm = ParrotLLM(base_url=url, api_key=args.api_key, model=model, temperature=0, max_tokens=args.output_len)
    chain = APPS[app](llm.bind(ignore_eos=True), args.chunks)
    t0 = time.perf_counter()
    with Session(url, args.api_key, transport=transport) as session:
        out = compile_chain(chain, session=session).invoke(inputs)
    return time.perf_counter() - t0, transport.requests, out


MODES = {"langchain": run_langchain, "parrot": run_parrot}


def measure(args: argparse.Namespace, url: str, model: str) -> list[dict[str, Any]]:
    words = Path(args.document).read_text(encoding="utf-8").split()
    run = 0
    for w in range(args.warmup):  # unrecorded: first-use costs hit neither mode
        for app in args.apps:
            for mode in MODES.values():
                run += 1
                mode(app, url, model, args, document_chunks(words, args.chunks, args.chunk_words, run), 0.0)
    rows = []
    for app in args.apps:
        for rtt_ms in args.rtt_ms:
            times: dict[str, list[float]] = {m: [] for m in MODES}
            requests: dict[str, int] = {}
            for rep in range(args.repeats):
                order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    run += 1
                    inputs = document_chunks(words, args.chunks, args.chunk_words, run)
                    seconds, n_requests, out = MODES[mode](app, url, model, args, inputs, rtt_ms / 1000)
                    times[mode].append(seconds)
                    requests[mode] = n_requests
                    log.info("%s rtt %s ms %s: %.2f s, %d requests, %r", app, rtt_ms, mode, seconds, n_requests,
                             out[:60])
            lc, pa = statistics.median(times["langchain"]), statistics.median(times["parrot"])
            rows.append({"app": app, "rtt_ms": rtt_ms, "chunks": args.chunks,
                         "calls": args.chunks + (app == "map_reduce"),
                         "langchain_s": lc, "parrot_s": pa, "ratio": lc / pa,
                         "langchain_http_requests": requests["langchain"], "parrot_http_requests": requests["parrot"],
                         "langchain_runs_s": times["langchain"], "parrot_runs_s": times["parrot"]})
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running Parrot server (default: start one in this process)")
    p.add_argument("--api-key", default=os.environ.get("PARROT_API_KEY"))
    p.add_argument("--model", default=None, help="served model (default: the first of /v1/models); without --url "
                   "the model file the in-process server loads (default SmolLM2-135M)")
    p.add_argument("--apps", nargs="+", default=list(APPS), choices=list(APPS))
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-words", type=int, default=100)
    p.add_argument("--output-len", type=int, default=20)
    p.add_argument("--rtt-ms", nargs="+", type=float, default=[0.0, 100.0],
                   help="network round trip added to every HTTP request of both modes (one row each)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--document", default=str(DEFAULT_DOCUMENT))
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    if args.chunks < 1 or args.output_len < 1 or args.repeats < 1 or args.warmup < 0 or min(args.rtt_ms) < 0:
        p.error("--chunks, --output-len, --repeats must be >= 1; --warmup and --rtt-ms >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    from parrot.bench.machine import describe_machine

    conditions: dict[str, Any] = describe_machine()
    local = None
    if args.url is None:
        from parrot.bench.machine import describe_cpu
        from parrot.frontend.local import local as start_local

        local = start_local(args.model, api_key=args.api_key, make_default=False)
        url, model_arg = local.url, None
        conditions.update(describe_cpu())
    else:
        url, model_arg = args.url.rstrip("/"), args.model
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = model_arg or httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        started = time.strftime("%Y%m%d-%H%M%S")
        rows = measure(args, url, model)
    finally:
        if local is not None:
            local.close()
    import importlib.metadata as md

    conditions.update({"server": "in-process (P.local)" if local else url, "model": model,
                       "chunks": args.chunks, "chunk_words": args.chunk_words, "output_len": args.output_len,
                       "repeats": args.repeats, "warmup": args.warmup, "document": Path(args.document).name,
                       "langchain_core": md.version("langchain-core"),
                       "langchain_openai": md.version("langchain-openai"),
                       "code_path": "langchain: langchain_openai.OpenAI -> /v1/completions per step; "
                                    "parrot: compile_chain(ParrotLLM) -> /api/v1 submit per step, one get"})
    table = format_table(["app", "rtt ms", "calls", "langchain s", "parrot s", "ratio", "HTTP req lc / parrot"],
                         [[r["app"], r["rtt_ms"], r["calls"], r["langchain_s"], r["parrot_s"], f"{r['ratio']:.2f}x",
                           f"{r['langchain_http_requests']} / {r['parrot_http_requests']}"] for r in rows],
                         title="LCEL chain: plain LangChain (OpenAI API, one call at a time) vs compiled to Parrot")
    print(table)
    print(format_conditions(conditions))
    path = save_json(str(Path(args.out) / f"langchain_bench-{started}.json"),
                     {"conditions": conditions, "rows": rows,
                      "args": {k: v for k, v in vars(args).items() if k != "api_key"}})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
