"""One template, two outputs: the title is generated first (it stops at the newline that follows it in the
template), then the text up to the next output is filled and the summary is generated in the same context.

    python examples/multi_output.py [--url URL | --local] [--topic TEXT]
"""

from _common import open_session, parser

import parrot as P


@P.semantic_function(max_tokens=40, outputs={"title": P.Output(max_tokens=16, transforms=[P.strip()]),
                                             "summary": P.Output(transforms=[P.strip(), P.first_line()])})
def title_and_summary(topic: P.SemanticVariable):
    """You write short magazine articles.
    Topic: {{input:topic}}
    Title: {{output:title}}
    One-sentence summary: {{output:summary}}"""


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--topic", default="why lighthouses were automated")
    args = p.parse_args()
    with open_session(args):
        title, summary = title_and_summary(args.topic)
        print("title:  ", title.get(perf=P.LATENCY))
        print("summary:", summary.get(perf=P.LATENCY))


if __name__ == "__main__":
    main()
