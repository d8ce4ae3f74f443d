"""A LangChain (LCEL) map-reduce summary of a document, submitted to Parrot as one DAG of semantic functions.

The chain is ordinary LangChain: ``PromptTemplate | llm | StrOutputParser`` per chunk in a RunnableParallel, then
a reduce prompt over their outputs. ``compile_chain`` sends every step to the server at once (the map steps and
the reduce that waits for them server-side) instead of rendering and sending one prompt at a time; the session's
DAG dump shows the steps and their dependencies. ``--plain`` also runs the same chain as plain LangChain (one
rendered call at a time through the OpenAI-compatible API) for comparison.

    parrot run examples/langchain_chain.py [--chunks 3] [--chunk-words 80] [--max-tokens 24] [--plain]
    python examples/langchain_chain.py --local
"""

import sys
import time
from operator import itemgetter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `parrot run` (runpy) does not put the script's dir first

from _common import document_chunks, open_session, parser  # noqa: E402
from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import PromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableParallel  # noqa: E402

from parrot.integrations.langchain import ParrotLLM, compile_chain  # noqa: E402

MAP = 'Write a concise summary of the following:\n"{chunk}"\nCONCISE SUMMARY:'
REDUCE_HEAD = "The following is a set of summaries:\n"
REDUCE_TAIL = "\nTake these and distill them into a final, consolidated summary.\nSummary:"


def map_reduce(llm, chunks: int):
    summarize = PromptTemplate.from_template(MAP, name="map") | llm | StrOutputParser()
    reduce = PromptTemplate.from_template(
        REDUCE_HEAD + "\n".join("- {s%d}" % i for i in range(chunks)) + REDUCE_TAIL, name="reduce")
    branches = RunnableParallel({f"s{i}": itemgetter(f"c{i}") | summarize for i in range(chunks)})
    return branches | reduce | llm | StrOutputParser()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=3)
    p.add_argument("--chunk-words", type=int, default=80)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--plain", action="store_true", help="also run the chain as plain LangChain (OpenAI API)")
    args = p.parse_args()
    inputs = {f"c{i}": c for i, c in enumerate(document_chunks(args.chunks, args.chunk_words))}
    with open_session(args) as session:
        llm = ParrotLLM(base_url=session.url, api_key=args.api_key, temperature=0, max_tokens=args.max_tokens)
        chain = map_reduce(llm, args.chunks)
        t0 = time.perf_counter()
        summary = compile_chain(chain, session=session).invoke(inputs)
        print(f"=== compiled to Parrot ({args.chunks} maps + 1 reduce, {time.perf_counter() - t0:.1f} s) ===\n"
              f"{summary.strip()}\n=== the session's DAG ===\n{session.dag()['text']}")
        if args.plain:
            t0 = time.perf_counter()
            plain = chain.invoke(inputs)  # the same chain, uncompiled: one rendered /v1/completions call per step
            print(f"=== plain LangChain ({time.perf_counter() - t0:.1f} s) ===\n{plain.strip()}")


if __name__ == "__main__":
    main()
