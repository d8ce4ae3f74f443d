"""Chat search (paper §8.3, Bing-Copilot style): a long shared system prompt with "search results" and
instructions, and several user queries answered in parallel. The shared prompt is constant template text,
so the server sees the common prefix (PrefixHash, §5.3) and computes its KV cache once for all queries.

    python examples/chat_search.py [--url URL | --local] [--queries 4] [--max-tokens 32]
"""

import time

from _common import DATA, open_session, parser

import parrot as P

QUERIES = [
    "Why did early lighthouses burn coal, and what was wrong with it?",
    "How did the stepped glass lens improve on mirrors?",
    "What did a keeper do at sunset?",
    "Why were rock towers built with interlocking stones?",
    "What replaced the keepers when lights were automated?",
    "What were lightships and why was the duty unpopular?",
    "How could a navigator tell one lighthouse from another?",
    "What happened to lighthouses that are no longer needed?",
]


def system_prompt(max_words: int = 1300) -> str:
    """Instructions plus numbered "search results" cut from the shipped document (~1.5-2k tokens)."""
    paragraphs = [p.strip() for p in (DATA / "lighthouses.txt").read_text(encoding="utf-8").split("\n\n")
                  if len(p.split()) > 40]
    results, words = [], 0
    for i, para in enumerate(paragraphs):
        if words + len(para.split()) > max_words:
            break
        results.append(f"[{i + 1}] {para}")
        words += len(para.split())
    return ("You are a helpful search assistant. Answer the user's question using only the search results "
            "below. Be brief: answer in one or two sentences, and cite the numbers of the results you used "
            "in square brackets. If the results do not contain the answer, say that you do not know.\n\n"
            "# Search results\n\n" + "\n\n".join(results) + "\n\n# Conversation\n")


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--queries", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    template = system_prompt() + "User: {{input:query}}\nAssistant: {{output:answer}}"
    chat = P.SemanticFunction(template, name="chat_search",
                              defaults=P.Output(max_tokens=args.max_tokens, stop=["\nUser:"],
                                                transforms=[P.strip()]))
    queries = (QUERIES * (args.queries // len(QUERIES) + 1))[:args.queries]
    with open_session(args):
        t0 = time.perf_counter()
        answers = [chat(q) for q in queries]  # all submitted before any answer is awaited
        for q, a in zip(queries, answers):
            print(f"Q: {q}\nA: {a.get(perf=P.LATENCY)}\n")
        print(f"{len(queries)} queries sharing a {len(template.split())}-word prompt prefix answered in "
              f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
