"""A ReAct agent as one flow per question (issue 34): Thought -> Action -> Observation, looped server-side.

Each iteration the model writes a thought, picks an action (``search`` / ``calculator`` / ``Final Answer``, a
choice constraint) and its input; a branch runs the tool the action names, the observation is appended to the
history, and the loop stops when the model gives its Final Answer (or after ``--max-steps`` iterations: with
``on_max="last"`` a weak model still ends with its last answer). The whole loop is one submission; the server
evaluates every condition and starts every step itself, so no round trip to this client happens between steps.

The tools are the server's ``calculator`` and ``search_text`` (over the shipped lighthouse essay, passed once as
a flow input shared by every question), or with ``--client-tools`` native functions of this process: the server
hands their calls to a worker thread of this client (same loop, same prompts).

    python examples/react_agent.py [--url URL | --local] [--questions 4] [--max-steps 8] [--max-tokens 24]
                                   [--client-tools]
"""

from __future__ import annotations

import ast
import operator
import re
import time

from _common import DATA, open_session, parser

import parrot as P

QUESTIONS = [
    "How many climbs does a keeper make in a 12-hour night if he climbs every 3 hours?",
    "What turned the heavy rotating lens, and how many minutes are 2 hours and 30 minutes?",
    "What were lightships, and how many days of a year are not among its 52 Sundays?",
    "Why were lenses floated on mercury, and what do 3 lenses of 4 tons weigh?",
    "Why did coal fires waste light, and what percent is one part in 8?",
]

PROMPT = """Answer the question with the tools. Tools: search (finds a sentence in an essay about lighthouses) and \
calculator (evaluates arithmetic such as 12 / 3). Use this format:
Thought: what to do next
Action: search, calculator or Final Answer
Action Input: the search query, the arithmetic, or the final answer
Observation: the tool's result
(repeat Thought / Action / Action Input / Observation as needed, then end with Action: Final Answer)

Question: {question}
"""
ACTIONS = ["search", "calculator", "Final Answer"]


@P.semantic_function(max_tokens=24, outputs={"action": P.Output(choice=ACTIONS), "action_input": P.Output(stop=["\n"])})
def react_step(history: P.SemanticVariable):
    """{{input:history}}Thought:{{output:thought}}
    Action: {{output:action}}
    Action Input:{{output:action_input}}"""


# ---- client-side tools (--client-tools): the same tools as local Python ------------------------------------------
_SENTENCES = [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n\s*\n", (DATA / "lighthouses.txt").read_text(
    encoding="utf-8")) if len(s.split()) > 6]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError("not arithmetic")


@P.native_function(tool="local_calculator", expected_duration_s=0.001)
def local_calculator(expression: str) -> str:
    """The first arithmetic expression in the text, evaluated (an error is an observation, not a failure)."""
    match = re.search(r"[-+*/().\d\s]*\d[-+*/().\d\s]*", expression)
    try:
        return f"{_evaluate(ast.parse(match.group().strip(), mode='eval').body):g}" if match else "no arithmetic"
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


@P.native_function(tool="local_search", expected_duration_s=0.01)
def local_search(query: str) -> str:
    """The essay's sentence sharing the most words with the query."""
    words = set(re.findall(r"[a-z]+", query.lower()))
    return max(_SENTENCES, key=lambda s: len(words & set(re.findall(r"[a-z]+", s.lower()))))[:300]


# ---- the flow --------------------------------------------------------------------------------------------------------
def make_agent(client_tools: bool, max_steps: int, max_tokens: int):
    """The traced function of one question: ``agent(prompt, question, essay) -> {"history", "answer", "action"}``
    (the loop's values after its last iteration)."""
    think = react_step.options(max_tokens=max_tokens)

    def agent(prompt, question, essay):
        def step(history):
            thought, action, action_input = think(history)
            query = P.text("{{input:q}} {{input:i}}", q=question, i=action_input)  # a weak model's query + context
            if client_tools:
                calculate, search = (lambda: local_calculator(action_input)), (lambda: local_search(query))
            else:
                calculate = lambda: P.tool("calculator", expression=action_input, on_error="value")
                search = lambda: P.tool("search_text", query=query, text=essay, on_error="value")
            observation = P.branch(action, cases={"calculator": calculate, "search": search},
                                   default=lambda: action_input, name="tool")  # Final Answer: nothing to run
            history2 = P.text("{{input:h}}Thought:{{input:t}}\nAction: {{input:a}}\nAction Input:{{input:i}}\n"
                              "Observation: {{input:o}}\n", h=history, t=thought, a=action, i=action_input,
                              o=observation)
            return {"history": history2, "answer": action_input, "action": action}

        return P.loop(step, carry={"history": prompt}, max_steps=max_steps, on_max="last", name="react",
                      until=lambda out: out["action"].equals("Final Answer") | out["answer"].contains("Final Answer"))

    return agent


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=8, help="iterations at most (on_max='last')")
    p.add_argument("--max-tokens", type=int, default=24, help="per thought and per action input")
    p.add_argument("--client-tools", action="store_true", help="tools as native functions of this client")
    args = p.parse_args()
    picked = (QUESTIONS * (args.questions // len(QUESTIONS) + 1))[:args.questions]
    agent = make_agent(args.client_tools, args.max_steps, args.max_tokens)
    with open_session(args):
        essay = P.SemanticVariable((DATA / "lighthouses.txt").read_text(encoding="utf-8"), name="essay")
        t0 = time.perf_counter()
        runs = [(q, P.flow(agent, PROMPT.format(question=q), q, essay, name="react_agent")) for q in picked]
        for question, run in runs:  # every question's flow is running before the first wait
            answer = run.outputs["answer"].get(perf=P.LATENCY).strip()
            iterations = run.iterations(run.wait(timeout=300))
            print(f"Q: {question}")
            print(f"A: {answer}  [{iterations} iterations, last action: "
                  f"{run.outputs['action'].get().strip()}]")
        tools = "client" if args.client_tools else "server"
        print(f"{len(runs)} questions ({tools} tools), one submission each, answered in "
              f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
