"""Flows (docs/flows.md) as data: the ReAct agent loop and the router app, as flow JSON bodies and as the same
programs driven step by step by a client. The real benchmark (:mod:`parrot.bench.flow_bench`) and the simulator
(:mod:`parrot.sim.flow_experiments`) both build their requests here.

**ReAct agent** (:func:`react_agent_flow`)::

    prompt0 = text(AGENT_HEAD + question)
    loop react (history <- prompt0), at most max_steps iterations, on_max "last":
        thought  = generate(history + "\\nThought:" {{output:thought}})            think_tokens tokens
        branch tool: thought contains "calculate" -> obs = calculator(expression=thought)
                     default                      -> obs = search_text(query=thought, text=doc)
        history2 = text(history + "\\nThought:" thought + "\\nObservation: " obs)
        until thought contains "Final Answer"          (or the never-firing marker, below)
        next history <- history2
    outputs: thought, history2 (the last iteration's)

Both tools answer errors as values (``on_error: "value"``: a thought without arithmetic gives ``error: ...``), so
every iteration completes. For a benchmark the iteration count must not depend on what the model writes:
``deterministic=True`` (the default) makes the loop run exactly ``max_steps`` iterations -- ``until`` looks for
:data:`NEVER` and every thought is generated with ``stop: [NEVER]``, so no thought can contain it (a stop string is
never part of the output) -- and every thought has exactly ``think_tokens`` tokens (``ignore_eos``). There is no
counter primitive; this is the honest way to fix N.

**The client loop** (:func:`run_client_agent`) is the same program with the control flow on the client: per
iteration one generate (through an :class:`AgentApi`: on the Parrot API a submit of the rendered prompt + one get,
on an OpenAI-style API one completion), then the branch, the tool (the server's own functions, run locally) and
the history in Python. The flow's question and document may be session variables or inline text (``question=``,
``doc=``: one call fewer per input, as the client loop inlines its history).

**Router** (:func:`router_flow`): a router generate, then a branch over three handlers (each a generate of the
query), the reply being the taken handler's. The router's *decision* must follow a given distribution (80/15/5)
in the simulator, whose outputs are placeholder tokens, and on the real CPU model, whose choice we cannot steer to
a distribution. The simplest honest form that runs identically in both (``label_source="seeded"``): the router is
a real generate of ``router_tokens`` tokens (its latency is real: the branch cannot be decided before it is done),
and its decision is a seeded draw passed as an input variable ``label``; a text step
``decision = label + "|" + route`` joins them, and the cases test ``decision`` with ``regex "^label\\|"``. So the
condition is ready exactly when the router's generate is, its value follows the seeded 80/15/5, and the router's
own text (after the ``|``) cannot affect it. ``label_source="model"`` is the production form: the router's output
is constrained to the labels (a ``choice`` constraint) and the cases are ``equals`` on it.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from parrot.common.template import parse_template, render_template

# ---- the agent -------------------------------------------------------------------------------------------------
NEVER = "#end-of-agent#"
"""The deterministic loop's ``until`` marker; every thought stops on it, so none contains it."""
FINAL = "Final Answer"
CALC_WORD = "calculate"

AGENT_HEAD = ("Answer the question. You can use two tools: calculator (write 'calculate' and an arithmetic "
              "expression) and search (anything else searches the document). Write 'Final Answer:' when done.\n"
              "Question: ")
PROMPT0_TEMPLATE = AGENT_HEAD + "{{input:question}}"
THINK_TEMPLATE = "{{input:history}}\nThought:{{output:thought}}"
STEP_TEMPLATE = "{{input:history}}\nThought:{{input:thought}}\nObservation: {{input:obs}}"


AGENT_MODES = ("flow+rtt", "client+rtt", "openai+rtt", "flow", "client")
"""How the agent loop is driven: flow = one submission; client = the Parrot API, a submit + a get per iteration;
openai = one completion per iteration; +rtt = every client call pays an emulated round trip (the others: none)."""
MODE_BASE = {"flow+rtt": "flow+rtt", "client+rtt": "flow+rtt", "openai+rtt": "flow+rtt", "flow": "flow",
             "client": "flow"}
"""The flow mode each mode is compared with (the same network)."""


@dataclass(frozen=True)
class AgentConfig:
    max_steps: int = 6
    think_tokens: int = 24
    deterministic: bool = True   # exactly max_steps iterations of exactly think_tokens tokens each
    top_k: int = 1               # search_text's sentences per observation
    name: str = "react_agent"

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.think_tokens < 1:
            raise ValueError(f"max_steps and think_tokens must be >= 1, got {self.max_steps}, {self.think_tokens}")

    @property
    def until_marker(self) -> str:
        return NEVER if self.deterministic else FINAL

    def think_sampling(self) -> dict:
        """The sampling dict of every thought (the submit API's form)."""
        if self.deterministic:
            return {"max_tokens": self.think_tokens, "ignore_eos": True, "temperature": 0.0, "stop": [NEVER]}
        return {"max_tokens": self.think_tokens, "temperature": 0.0, "stop": ["\nObservation:"]}


def react_agent_flow(question_var: str | None, doc_var: str | None, max_steps: int = 6, *, think_tokens: int = 24,
                     deterministic: bool = True, top_k: int = 1, name: str = "react_agent",
                     speculate: bool | None = None, question: str | None = None, doc: str | None = None) -> dict:
    """The flow body (docs/flows.md) of the ReAct agent over session variables ``question_var`` and ``doc_var``
    (or, given ``question`` / ``doc`` instead, with that text inline: no variable to create first); its outputs are
    ``thought`` (the last one) and ``history2`` (the whole trace)."""
    cfg = AgentConfig(max_steps, think_tokens, deterministic, top_k, name)
    return agent_flow(cfg, question_var, doc_var, speculate=speculate, question=question, doc=doc)


def agent_flow(cfg: AgentConfig, question_var: str | None = None, doc_var: str | None = None, *,
               speculate: bool | None = None, question: str | None = None, doc: str | None = None) -> dict:
    """See :func:`react_agent_flow`. Exactly one of ``question_var`` / ``question`` and of ``doc_var`` / ``doc``."""
    if (question_var is None) == (question is None) or (doc_var is None) == (doc is None):
        raise ValueError("give exactly one of question_var / question and one of doc_var / doc")
    inputs = {k: v for k, v in (("question", question_var), ("doc", doc_var)) if v is not None}
    head = PROMPT0_TEMPLATE if question is None else AGENT_HEAD + escape_literal(question)
    doc_arg = "doc" if doc is None else {"value": doc}
    calc = {"tool": {"name": "calculator", "args": {"expression": "thought"}, "output": "obs", "runs": "server",
                     "on_error": "value"}}
    search = {"tool": {"name": "search_text",
                       "args": {"query": "thought", "text": doc_arg, "top_k": {"value": str(cfg.top_k)}},
                       "output": "obs", "runs": "server", "on_error": "value"}}
    body = {
        "name": cfg.name,
        "inputs": inputs,
        "steps": [
            {"text": {"template": head, "output": "prompt0"}},
            {"loop": {
                "name": "react", "carry": {"history": "prompt0"},
                "steps": [
                    {"generate": {"prompt": THINK_TEMPLATE, "name": "think",
                                  "sampling": {"thought": cfg.think_sampling()}}},
                    {"branch": {"name": "tool",
                                "cases": [{"when": {"kind": "contains", "var": "thought", "value": CALC_WORD,
                                                    "case_sensitive": False},
                                           "steps": [calc]}],
                                "default": [search], "outputs": ["obs"]}},
                    {"text": {"template": STEP_TEMPLATE, "output": "history2"}},
                ],
                "next": {"history": "history2"},
                "until": {"kind": "contains", "var": "thought", "value": cfg.until_marker,
                          "case_sensitive": cfg.deterministic},
                "max_steps": cfg.max_steps, "on_max": "last",
                "outputs": ["thought", "history2"]}},
        ],
        "outputs": ["thought", "history2"],
    }
    if speculate is not None:
        body["speculate"] = speculate
    return body


# ---- the server tools, run locally by the client loop ---------------------------------------------------------
def run_tool(thought: str, doc: str, top_k: int = 1) -> str:
    """The branch and the tool of one iteration as the flow takes them, with the server's own tool functions
    (:mod:`parrot.manager.flows.server_tools`), so both modes observe exactly the same text; errors become values
    (``on_error: "value"``)."""
    from parrot.manager.flows.server_tools import ToolError, calculate, search_text

    try:
        if CALC_WORD in thought.lower():
            return calculate(thought)
        return search_text(thought, doc, str(top_k))
    except ToolError as e:
        return f"error: {e}"


def agent_done(cfg: AgentConfig, thought: str) -> bool:
    return cfg.until_marker in thought if cfg.deterministic else cfg.until_marker.lower() in thought.lower()


_PROMPT0 = parse_template(PROMPT0_TEMPLATE)
_THINK = parse_template(THINK_TEMPLATE)
_STEP = parse_template(STEP_TEMPLATE)


def prompt0(question: str) -> str:
    return render_template(_PROMPT0, {"question": question})


def think_prompt(history: str) -> str:
    """The text a completion API gets for one thought (the flow's think prompt up to its output)."""
    return render_template(_THINK, {"history": history}, until="thought")


def next_history(history: str, thought: str, obs: str) -> str:
    return render_template(_STEP, {"history": history, "thought": thought, "obs": obs})


class AgentApi(Protocol):
    """One generate of the client loop: ``prompt`` is the rendered text before the thought."""

    async def generate(self, prompt: str, sampling: dict) -> str: ...


@dataclass(frozen=True)
class ClientAgentResult:
    thought: str
    history: str
    iterations: int


async def run_client_agent(api: AgentApi, question: str, doc: str, cfg: AgentConfig) -> ClientAgentResult:
    """The agent with its control flow on the client: one generate per iteration, the branch, the tool and the
    history in Python; the same iterations, prompts and tools as :func:`agent_flow`."""
    history = prompt0(question)
    thought = ""
    for i in range(cfg.max_steps):
        thought = await api.generate(think_prompt(history), cfg.think_sampling())
        obs = run_tool(thought, doc, cfg.top_k)
        history = next_history(history, thought, obs)
        if agent_done(cfg, thought):
            return ClientAgentResult(thought, history, i + 1)
    return ClientAgentResult(thought, history, cfg.max_steps)


def escape_literal(text: str) -> str:
    """Text safe to put literally in a Parrot template (``{{`` always opens a placeholder there)."""
    return text.replace("{{", "{ {")


def agent_questions(n: int, seed: int, doc: str, tag: str = "") -> list[str]:
    """``n`` seeded questions, half arithmetic (their first thought may 'calculate'), half about ``doc``; each
    starts with ``tag`` + its index so no two share a cached prefix beyond the agent's head."""
    rng = random.Random(f"agent-questions:{seed}")
    words = [w for w in re.findall(r"[a-z]+", doc.lower()) if len(w) > 4] or ["lighthouse"]
    out = []
    for i in range(n):
        if i % 2 == 0:
            a, b, c = rng.randint(10, 999), rng.randint(2, 99), rng.randint(1, 9)
            q = f"calculate ({a} + {b}) * {c} and say what the document says about {rng.choice(words)}."
        else:
            q = f"what does the document say about {rng.choice(words)} and {rng.choice(words)}?"
        out.append(f"[{tag}{i}] {q}")
    return out


# ---- the router ------------------------------------------------------------------------------------------------
LABELS = ("billing", "technical", "other")
ROUTER_HEAD = "Route the customer message to billing, technical or other.\nMessage: "
HANDLER_HEADS = {
    "billing": "You are the billing desk. Answer the customer about invoices, payments and refunds.\nCustomer: ",
    "technical": "You are technical support. Help the customer fix the problem step by step.\nCustomer: ",
    "other": "You are the front desk. Answer the customer politely and briefly.\nCustomer: ",
}


@dataclass(frozen=True)
class RouterConfig:
    router_tokens: int = 8
    reply_tokens: int = 32
    labels: tuple[str, ...] = LABELS
    probs: tuple[float, ...] = (0.8, 0.15, 0.05)
    label_source: str = "seeded"   # "seeded" (the decision is an input, see the module doc) | "model"
    name: str = "router"

    def __post_init__(self) -> None:
        if len(self.labels) != len(self.probs) or abs(sum(self.probs) - 1.0) > 1e-9:
            raise ValueError(f"probs {self.probs} must sum to 1 over labels {self.labels}")
        if self.label_source not in ("seeded", "model"):
            raise ValueError(f"label_source must be 'seeded' or 'model', got {self.label_source!r}")


def _fixed(tokens: int) -> dict:
    return {"max_tokens": tokens, "ignore_eos": True, "temperature": 0.0, "stop": []}


def router_flow(query_var: str, label_var: str | None = None, *, probs: Sequence[float] = (0.8, 0.15, 0.05),
                router_tokens: int = 8, reply_tokens: int = 32, labels: Sequence[str] = LABELS,
                label_source: str = "seeded", name: str = "router", speculate: bool | None = None) -> dict:
    """The router app's flow body over session variables ``query_var`` (and ``label_var``, the seeded decision,
    with ``label_source="seeded"``); its output is ``reply``. ``probs`` is the distribution the decisions are
    drawn from (:func:`router_requests`); the body itself does not depend on it."""
    cfg = RouterConfig(router_tokens, reply_tokens, tuple(labels), tuple(probs), label_source, name)
    return build_router_flow(cfg, query_var, label_var, speculate=speculate)


def build_router_flow(cfg: RouterConfig, query_var: str, label_var: str | None = None, *,
                      speculate: bool | None = None) -> dict:
    inputs = {"query": query_var}
    route_sampling = _fixed(cfg.router_tokens)
    if cfg.label_source == "model":
        route_sampling = {"max_tokens": cfg.router_tokens, "temperature": 0.0,
                          "constraint": {"kind": "choice", "spec": json.dumps(list(cfg.labels))}}
    steps: list[dict] = [{"generate": {"prompt": ROUTER_HEAD + "{{input:query}}\nDepartment:{{output:route}}",
                                       "name": "route", "sampling": {"route": route_sampling}}}]
    if cfg.label_source == "seeded":
        if label_var is None:
            raise ValueError("label_source='seeded' needs label_var")
        inputs["label"] = label_var
        steps.append({"text": {"template": "{{input:label}}|{{input:route}}", "output": "decision"}})

    def when(label: str) -> dict:
        if cfg.label_source == "model":
            return {"kind": "equals", "var": "route", "value": label, "case_sensitive": True}
        return {"kind": "regex", "var": "decision", "pattern": "^" + re.escape(label) + r"\|",
                "case_sensitive": True}

    cases = [{"when": when(label), "steps": [{"generate": {
        "prompt": HANDLER_HEADS.get(label, f"You are the {label} desk.\nCustomer: ")
        + "{{input:query}}\nAnswer:{{output:reply}}",
        "name": f"handle_{label}", "sampling": {"reply": _fixed(cfg.reply_tokens)}}}]} for label in cfg.labels]
    steps.append({"branch": {"name": "route", "cases": cases, "outputs": ["reply"]}})
    body = {"name": cfg.name, "inputs": inputs, "steps": steps, "outputs": ["reply"]}
    if speculate is not None:
        body["speculate"] = speculate
    return body


def draw_labels(n: int, seed: int, labels: Sequence[str] = LABELS,
                probs: Sequence[float] = (0.8, 0.15, 0.05)) -> list[str]:
    """``n`` seeded router decisions drawn from ``probs``."""
    rng = random.Random(f"router-labels:{seed}")
    return rng.choices(list(labels), weights=list(probs), k=n)


def router_requests(n: int, seed: int, cfg: RouterConfig = RouterConfig(), *, tag: str = "",
                    query_words: tuple[int, int] = (12, 30)) -> list[tuple[str, str]]:
    """``n`` seeded (query, decision) pairs: distinct customer messages (each starts with ``tag`` and its index, so
    no two share a cached prefix beyond the fixed heads) and decisions drawn from ``cfg.probs``."""
    rng = random.Random(f"router-queries:{seed}")
    vocab = ["my", "invoice", "shows", "a", "double", "charge", "for", "the", "last", "month", "and", "the", "refund", "never", "arrived", "please", "check", "it", "the", "app", "crashes", "when", "I", "open", "settings", "after", "the", "update", "and", "the", "login", "page", "keeps", "spinning", "forever", "where", "is", "your", "office", "and", "when", "are", "you", "open", "on", "weekends", "thanks", "for", "the", "quick", "help", "earlier"]
    labels = draw_labels(n, seed, cfg.labels, cfg.probs)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(vocab) for _ in range(rng.randint(*query_words)))
        out.append((f"[{tag}{i}] {words}", labels[i]))
    return out


def speculation_counters(stats: dict) -> dict:
    """``Manager.stats()["flows"]`` (or the HTTP stats body's) as flat counters: hit, miss, wasted_tokens,
    flows, iterations (0 where absent)."""
    f = stats.get("flows") or {}
    spec = f.get("speculations") or {}
    return {"hit": int(spec.get("hit", 0)), "miss": int(spec.get("miss", 0)),
            "wasted_tokens": int(f.get("wasted_tokens", 0)), "flows": int(f.get("flows", 0)),
            "iterations": int(f.get("iterations", 0))}


def counter_delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


# ---- the results page ------------------------------------------------------------------------------------------
RESULTS_HEAD = ("# Flows: server-side branches and loops (issue 34)\n\n"
                "The wire format is [docs/flows.md](../flows.md). Real server: `python -m parrot.bench.flow_bench` "
                "(`flows.json` → the run's key); simulator: `python -m parrot.sim.flow_experiments --save` "
                "(`flows.json` → `sim`). Each section is rewritten by its command.\n")


def write_section(path, name: str, text: str) -> None:
    """Replace (or append) the section ``name`` of the markdown file at ``path``: the text between
    ``<!-- name:begin -->`` and ``<!-- name:end -->``; the rest of the file is kept."""
    from pathlib import Path

    p = Path(path)
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    old = p.read_text(encoding="utf-8") if p.exists() else RESULTS_HEAD
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end):]
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(new, encoding="utf-8")
