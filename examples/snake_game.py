"""Paper Fig. 7: a two-agent app. ``write_test`` is submitted before ``code`` exists; the server runs it as
soon as ``code`` is produced, with no round trip through this client.

    python examples/snake_game.py [--url URL | --local]
"""

from _common import open_session, parser

import parrot as P


@P.semantic_function(max_tokens=32)
def write_code(task: P.SemanticVariable):
    """You are an expert software engineer.
    Write python code of {{input:task}}.
    Code: {{output:code}}"""


@P.semantic_function(max_tokens=32)
def write_test(task: P.SemanticVariable, code: P.SemanticVariable):
    """You are an experienced QA engineer.
    You write test code for {{input:task}}.
    Code: {{input:code}}.
    Your test code: {{output:test}}"""


def write_snake_game() -> tuple[str, str]:
    task = P.SemanticVariable("a snake game")
    code = write_code(task)
    test = write_test(task, code)
    return code.get(perf=P.LATENCY), test.get(perf=P.LATENCY)


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    with open_session(args):
        code, test = write_snake_game()
    print("=== code ===\n" + code)
    print("=== test ===\n" + test)


if __name__ == "__main__":
    main()
