"""A tool-using agent (issue 17, LAMPS): think -> search -> think -> calculate -> answer, for several questions at
once. The tools are native functions that name themselves (``@P.native_function(tool=...)``): plain local Python
(a keyword search over the shipped lighthouse essay and an arithmetic evaluator), nothing on the network.

Each step's prompt continues the previous step's prompt and output, so while a tool runs the server keeps,
swaps out or drops (and later recomputes) the paused context, as its ``--tool-policy`` decides, and the next
step resumes it. The whole DAG of every question is submitted at once; the server runs each step as soon as the
tool's value arrives.

    python examples/agent.py [--url URL | --local] [--questions 3] [--max-tokens 24]
"""

from __future__ import annotations

import ast
import operator
import re
import time

from _common import DATA, open_session, parser

import parrot as P

QUESTIONS = [  # (question, the arithmetic it needs: the calculator's fallback when the model's is not arithmetic)
    ("Why did keepers climb the tower at night, and how many climbs is one every 3 hours of a 12-hour night?",
     "12 / 3"),
    ("What turned the heavy rotating lens, and how many minutes are 2 hours and 30 minutes?", "2 * 60 + 30"),
    ("What were lightships, and how many days of a year are not among its 52 Sundays?", "365 - 52"),
    ("Why did coal fires waste light, and what percent is one part in 8?", "100 / 8"),
    ("Why were lenses floated on mercury, and what do 3 lenses of 4 tons weigh?", "3 * 4"),
]

# ---- the tools: local Python ------------------------------------------------------------------------------------
_SENTENCES = [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n\s*\n", (DATA / "lighthouses.txt").read_text(
    encoding="utf-8")) if len(s.split()) > 6]
_STOP = frozenset("the a an of to and in on for by with what why how did do does was were is are it its that this "
                  "at from as be have has had".split())


def _terms(text: str) -> set[str]:
    """Content words, crudely stemmed (a trailing s dropped: keepers ~ keeper)."""
    return {w[:-1] if w.endswith("s") and len(w) > 4 else w for w in re.findall(r"[a-z]+", text.lower())
            if w not in _STOP and len(w) > 2}


@P.native_function(tool="search", expected_duration_s=0.01)
def search(question: str, query: str) -> str:
    """The sentence of the essay sharing the most words with the query (and the question, so that a weak model's
    query still finds something)."""
    want = _terms(query) | _terms(question)
    best = max(_SENTENCES, key=lambda s: len(want & _terms(s)))
    return best[:300]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.Pow: operator.pow}


def evaluate(expression: str) -> float:
    """Arithmetic only (+ - * / ** and parentheses on numbers): ValueError for anything else."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 16:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
    try:
        return ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(str(e)) from None


@P.native_function(tool="calculator", expected_duration_s=0.001)
def calculator(planned: str, expression: str) -> str:
    """Evaluates the model's expression if it is arithmetic, else the planned one."""
    for candidate in (expression, planned):
        match = re.search(r"[-+*/().\d\s]*\d[-+*/().\d\s]*", candidate)
        if match:
            try:
                return f"{match.group().strip()} = {evaluate(match.group()):g}"
            except ValueError:
                continue
    return "no arithmetic found"


# ---- the model's steps: each template continues the previous one -------------------------------------------------
@P.semantic_function(max_tokens=24, stop=["\n"])
def think_search(question: P.SemanticVariable):
    """You are a careful assistant with two tools: search (finds a sentence in an essay about lighthouses) and
    calculator (does arithmetic). Work step by step: search, then calculate, then answer in one sentence.
    Question: {{input:question}}
    Thought: I will search for {{output:query}}"""


@P.semantic_function(max_tokens=24, stop=["\n"])
def think_calculate(question: P.SemanticVariable, query: P.SemanticVariable, found: P.SemanticVariable,
                    arithmetic: P.SemanticVariable):
    """You are a careful assistant with two tools: search (finds a sentence in an essay about lighthouses) and
    calculator (does arithmetic). Work step by step: search, then calculate, then answer in one sentence.
    Question: {{input:question}}
    Thought: I will search for {{input:query}}
    Observation: {{input:found}}
    Thought: The essay says enough. I also need {{input:arithmetic}}, so I will calculate {{output:expression}}"""


@P.semantic_function(max_tokens=40, stop=["\n"])
def answer(question: P.SemanticVariable, query: P.SemanticVariable, found: P.SemanticVariable,
           arithmetic: P.SemanticVariable, expression: P.SemanticVariable, result: P.SemanticVariable):
    """You are a careful assistant with two tools: search (finds a sentence in an essay about lighthouses) and
    calculator (does arithmetic). Work step by step: search, then calculate, then answer in one sentence.
    Question: {{input:question}}
    Thought: I will search for {{input:query}}
    Observation: {{input:found}}
    Thought: The essay says enough. I also need {{input:arithmetic}}, so I will calculate {{input:expression}}
    Observation: {{input:result}}
    Answer: {{output:answer}}"""


def ask(question: str, arithmetic: str, max_tokens: int) -> dict[str, P.SemanticVariable]:
    """Submit one question's whole loop (returns at once): think -> search -> think -> calculate -> answer."""
    q, arith = P.SemanticVariable(question), P.SemanticVariable(arithmetic)
    query = think_search.options(max_tokens=max_tokens)(q)
    found = search(q, query)
    expression = think_calculate.options(max_tokens=max_tokens)(q, query, found, arith)
    result = calculator(arith, expression)
    final = answer.options(max_tokens=2 * max_tokens)(q, query, found, arith, expression, result)
    return {"query": query, "found": found, "expression": expression, "result": result, "answer": final}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24, help="per thought (the answer gets twice this)")
    args = p.parse_args()
    picked = (QUESTIONS * (args.questions // len(QUESTIONS) + 1))[:args.questions]
    with open_session(args):
        t0 = time.perf_counter()
        runs = [(qa[0], ask(*qa, args.max_tokens)) for qa in picked]  # every question's DAG before any wait
        for question, steps in runs:
            print(f"Q: {question}")
            print(f"  think  -> search for: {steps['query'].get(perf=P.LATENCY).strip()}")
            print(f"  search -> {steps['found'].get(perf=P.LATENCY)[:100]}...")
            print(f"  think  -> calculate: {steps['expression'].get(perf=P.LATENCY).strip()}")
            print(f"  calculator -> {steps['result'].get(perf=P.LATENCY)}")
            print(f"A: {steps['answer'].get(perf=P.LATENCY).strip()}\n")
        print(f"{len(runs)} questions, 2 tool calls each, answered in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
