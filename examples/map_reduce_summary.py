"""Map-reduce summary (paper §8.2, Fig. 1a): summarize every chunk in parallel, then combine the summaries.

The map requests and the reduce request are submitted together; fetching the final summary with LATENCY
lets the server treat the maps as one task group (paper §5.2) and run them as a large batch.

    python examples/map_reduce_summary.py [--url URL | --local] [--chunks 4] [--chunk-words 120] [--max-tokens 32]
"""

import time

from _common import document_chunks, open_session, parser

import parrot as P


@P.semantic_function(stop=[], transforms=[P.strip()])
def summarize(chunk: P.SemanticVariable):
    """Write a concise summary of the following:
    "{{input:chunk}}"
    CONCISE SUMMARY: {{output:summary}}"""


def make_reduce(n: int, max_tokens: int) -> P.SemanticFunction:
    """The reduce step takes one input per chunk, so its template is built for the chunk count."""
    listing = "\n".join("- {{input:s%d}}" % i for i in range(n))
    template = ("The following is a set of summaries:\n" + listing +
                "\nTake these and distill them into a final, consolidated summary.\nSummary: {{output:final}}")
    return P.SemanticFunction(template, name="reduce", defaults=P.Output(max_tokens=max_tokens, stop=[]))


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--chunk-words", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    chunks = document_chunks(args.chunks, args.chunk_words)
    with open_session(args):
        t0 = time.perf_counter()
        mapper = summarize.options(max_tokens=args.max_tokens)
        partial = [mapper(chunk) for chunk in chunks]
        final = make_reduce(len(chunks), args.max_tokens)(*partial)
        result = final.get(perf=P.LATENCY)
        elapsed = time.perf_counter() - t0
        for i, s in enumerate(partial):
            print(f"[chunk {i}] {s.get(perf=P.LATENCY)}")
        print(f"=== final summary ({len(chunks)} maps + 1 reduce, {elapsed:.1f} s) ===\n{result.strip()}")


if __name__ == "__main__":
    main()
