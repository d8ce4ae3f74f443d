"""Chain summary (paper §8.2): summarize the first chunk, then refine the summary with each next chunk.

All N requests are submitted at once; each refine step waits server-side for the previous summary, so the
client pays no round trip between steps and fetches only the final summary.

    python examples/chain_summary.py [--url URL | --local] [--chunks 4] [--chunk-words 120] [--max-tokens 40]
"""

import time

from _common import document_chunks, open_session, parser

import parrot as P


@P.semantic_function(stop=[])
def summarize(chunk: P.SemanticVariable):
    """Write a concise summary of the following text.

    Text:
    {{input:chunk}}

    Concise summary: {{output:summary}}"""


@P.semantic_function(stop=[])
def refine(previous: P.SemanticVariable, chunk: P.SemanticVariable):
    """Your job is to produce a final summary.
    We have provided an existing summary up to a certain point: {{input:previous}}
    We have the opportunity to refine the existing summary with some more context below.
    ------------
    {{input:chunk}}
    ------------
    Given the new context, refine the original summary.
    Refined summary: {{output:summary}}"""


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--chunk-words", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=40)
    args = p.parse_args()
    chunks = document_chunks(args.chunks, args.chunk_words)
    with open_session(args) as session:
        t0 = time.perf_counter()
        summary = summarize.options(max_tokens=args.max_tokens)(chunks[0])
        step = refine.options(max_tokens=args.max_tokens)
        for chunk in chunks[1:]:
            summary = step(summary, chunk)  # submitted now; runs when `summary` is ready
        submitted = time.perf_counter() - t0
        final = summary.get(perf=P.LATENCY)
        print(f"{len(chunks)} requests submitted in {submitted:.2f} s; final summary after "
              f"{time.perf_counter() - t0:.1f} s (session {session.session_id}):\n{final.strip()}")


if __name__ == "__main__":
    main()
