"""The flows frontend (parrot.frontend.flow): the JSON it traces for every construct and condition (checked with
the server's own parser, parrot.manager.flows.spec.parse_flow), its client-side validation errors, then end to end
on a real `parrot serve` with the default model: a branch, a loop with a server tool, a loop with a client tool
(the worker thread answers), a map, and both examples as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

import parrot as P
from parrot.common.errors import InvalidRequestError, StepFailed, TemplateError
from parrot.frontend import flow as F
from parrot.frontend import tool_worker as W
from servers import parrot_serve_default_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@P.semantic_function(max_tokens=4, outputs={"label": P.Output(choice=["billing", "tech", "other"])})
def classify(msg: P.SemanticVariable):
    """Classify the message: {{input:msg}}
    Label: {{output:label}}"""


@P.semantic_function(max_tokens=4, transforms=[P.strip()])
def answer(msg: P.SemanticVariable, kind: P.SemanticVariable):
    """Answer the {{input:kind}} question {{input:msg}}
    Reply: {{output:reply}}"""


@P.semantic_function(max_tokens=3)
def two(x: P.SemanticVariable):
    """Topic {{input:x}}. A: {{output:a}}. B: {{output:b}}."""


@P.native_function(tool="incr", expected_duration_s=0.01)
def incr(n: str) -> str:
    return str(int(n.strip()) + 1)


def body_of(fn, *args, **kwargs) -> dict:
    """The traced flow's body with fake input ids, after the server's parser accepted it."""
    from parrot.manager.flows.spec import parse_flow

    traced = F.trace(fn, *args, **kwargs)
    body = traced.body({n: f"v_{i}" for i, n in enumerate(traced.input_values())})
    parse_flow(body, max_loop_steps=16)
    return body


# ---- steps -------------------------------------------------------------------------------------------------------
def test_generate_step():
    body = body_of(lambda m: answer.options(models=["m"])(m, "tech"), "hello", name="g")
    assert body["name"] == "g" and list(body["inputs"]) == ["m_1", "kind_2"] and body["outputs"] == ["reply_3"]
    g = body["steps"][0]["generate"]
    assert g["prompt"] == "Answer the {{input:kind_2}} question {{input:m_1}}\nReply: {{output:reply_3}}"
    assert g["name"] == "answer" and g["models"] == ["m"]
    assert g["sampling"] == {"reply_3": answer.outputs[0].sampling.to_dict()}
    assert g["transforms"] == {"reply_3": [{"op": "strip"}]}
    traced = F.trace(lambda m: answer(m, "tech"), "hello")
    assert [sv.get() for sv in traced.input_values().values()] == ["hello", "tech"]


def test_generate_several_outputs_and_constraint():
    body = body_of(lambda x: dict(zip("ab", two(x))), "t")
    g = body["steps"][0]["generate"]
    assert g["prompt"] == "Topic {{input:x_1}}. A: {{output:a_2}}. B: {{output:b_3}}."
    assert "transforms" not in g and "models" not in g and g["sampling"]["a_2"]["stop"] == [". B:"]
    assert body["outputs"] == ["a_2", "b_3"]
    c = body_of(classify, "m")["steps"][0]["generate"]["sampling"]["label_2"]["constraint"]
    assert c["kind"] == "choice"


def test_text_and_server_tool_steps():
    def fn(x):
        s = F.text("{{input:a}} + {{input:b}}", a=x, b="2")
        return F.tool("calculator", expression=s, on_error="value", expected_duration_s=0.5)

    body = body_of(fn, "1")
    text, tool = body["steps"][0]["text"], body["steps"][1]["tool"]
    assert text == {"template": "{{input:x_1}} + {{input:b_2}}", "output": "text_3"}
    assert tool == {"name": "calculator", "args": {"expression": "text_3"}, "output": "calculator_4",
                    "runs": "server", "on_error": "value", "expected_duration_s": 0.5}
    lit = body_of(lambda q: F.tool("search_text", query=q, text="some text", top_k=2), "q")["steps"][0]["tool"]
    assert lit["args"] == {"query": "q_1", "text": {"value": "some text"}, "top_k": {"value": "2"}}


def test_client_tool_step():
    traced = F.trace(lambda n: incr(n), "1")
    assert traced.steps and F._wire(traced.steps)[0]["tool"] == {
        "name": "incr", "args": {"n": "n_1"}, "output": "incr_2", "runs": "client", "on_error": "fail",
        "expected_duration_s": 0.01}
    assert traced.client_tools == {"incr": incr}


# ---- conditions ---------------------------------------------------------------------------------------------------
def test_every_condition():
    seen = {}

    def fn(x):
        seen["conds"] = [x.equals("Yes"), x.contains("final", case_sensitive=True), x.matches(r"^\d+$"),
                         x.json("a.b[0]") == "ok", x.json("n") != 3, x.json("n") < 1, x.json("n") <= 1.5,
                         x.json("n") > 0, x.json("ok") >= True, x.number() >= 7, x.number() < -1,
                         ~x.equals("no"), x.equals("a") & x.equals("b") & x.equals("c"),
                         x.equals("a") | (x.number() == 1)]
        return x

    F.trace(fn, "v")
    got = [c.to_dict() for c in seen["conds"]]
    x = "x_1"
    assert got[:4] == [
        {"kind": "equals", "var": x, "value": "Yes", "case_sensitive": False},
        {"kind": "contains", "var": x, "value": "final", "case_sensitive": True},
        {"kind": "regex", "var": x, "pattern": r"^\d+$", "case_sensitive": True},
        {"kind": "json", "var": x, "path": "a.b[0]", "op": "==", "value": "ok"}]
    assert [g["op"] for g in got[4:11]] == ["!=", "<", "<=", ">", ">=", ">=", "<"]
    assert got[9] == {"kind": "number", "var": x, "op": ">=", "value": 7}
    assert got[11] == {"kind": "not", "cond": {"kind": "equals", "var": x, "value": "no", "case_sensitive": False}}
    assert got[12]["kind"] == "all" and [c["value"] for c in got[12]["conds"]] == ["a", "b", "c"]  # flattened
    assert got[13]["kind"] == "any" and got[13]["conds"][1]["kind"] == "number"


def test_condition_errors():
    def fn(x):
        with pytest.raises(TemplateError, match="bad regex"):
            x.matches("(")
        with pytest.raises(TypeError):
            x.number() > "7"  # noqa: B015
        with pytest.raises(TypeError):
            x.json("a") == {"no": "dicts"}  # noqa: B015
        with pytest.raises(TypeError, match="truth value"):
            bool(x.equals("a"))
        with pytest.raises(TypeError, match="truth value"):
            bool(x)
        with pytest.raises(TypeError, match="symbolic"):
            x.get()
        return x

    F.trace(fn, "v")


def test_semantic_variable_conditions_become_inputs():
    v = P.SemanticVariable("tech", name="label")
    body = body_of(lambda: F.branch(cases=[(v.equals("tech") | v.contains("bug"), lambda: F.text("T")),
                                           (v.number() > 2, lambda: F.text("N"))]))
    when = body["steps"][0]["branch"]["cases"][0]["when"]
    assert len(body["inputs"]) == 1 and {c["var"] for c in when["conds"]} == set(body["inputs"])


# ---- constructs ---------------------------------------------------------------------------------------------------
def test_branch_renames_case_results_and_copies_outer_values():
    def fn(msg):
        label = classify(msg)
        return F.branch(label, cases={"billing": lambda: answer(msg, "billing"), "tech": lambda: msg},
                        default=lambda: "sorry", name="route")

    body = body_of(fn, "hi")
    b = body["steps"][1]["branch"]
    out = b["outputs"][0]
    assert b["name"] == "route" and body["outputs"] == [out]
    assert [c["when"]["value"] for c in b["cases"]] == ["billing", "tech"]
    assert b["cases"][0]["steps"][0]["generate"]["prompt"].endswith("{{output:%s}}" % out)  # renamed, no copy
    assert b["cases"][1]["steps"] == [{"text": {"template": "{{input:msg_1}}", "output": out}}]  # copied
    assert b["default"][0]["text"]["output"] == out


def test_branch_shapes():
    def fn(x):
        return F.branch(x, cases={"a": lambda: {"p": two(x)[0], "q": x}, "b": lambda: {"p": x, "q": x}})

    body = body_of(fn, "x")
    assert "default" not in body["steps"][0]["branch"] and len(body["outputs"]) == 2
    with pytest.raises(TemplateError, match="same shape"):
        F.trace(lambda x: F.branch(x, cases={"a": lambda: x, "b": lambda: (x, x)}), "x")
    with pytest.raises(TemplateError, match="same shape"):
        F.trace(lambda x: F.branch(x, cases={"a": lambda: {"p": x}, "b": lambda: {"q": x}}), "x")
    with pytest.raises(TypeError, match="no variable"):
        F.trace(lambda x: F.branch(None, cases={"a": lambda: x}), "x")
    with pytest.raises(TypeError, match="condition"):
        F.trace(lambda x: F.branch(x, cases=[(3, lambda: x)]), "x")


def test_scope_visibility_checked_while_tracing():
    def fn(x):
        inner = {}

        def case():
            inner["v"] = two(x)[0]
            return inner["v"]

        F.branch(x, cases={"a": case})
        return F.text("{{input:v}}", v=inner["v"])

    with pytest.raises(TemplateError, match="not visible"):
        F.trace(fn, "x")


def test_loop():
    def fn(prompt):
        def step(history, n):
            a = answer(history, n)
            obs = F.tool("calculator", expression=a)
            return {"history": F.text("{{input:h}} {{input:o}}", h=history, o=obs), "n": obs, "answer": a}

        return F.loop(step, carry={"history": prompt, "n": "1"}, max_steps=5, on_max="last", name="react",
                      until=lambda out: out["answer"].contains("Final Answer") | (out["n"].number() >= 3))

    body = body_of(fn, "p")
    lp = body["steps"][0]["loop"]
    assert lp["name"] == "react" and lp["max_steps"] == 5 and lp["on_max"] == "last"
    assert lp["carry"] == {"history_3": "prompt_1", "n_4": "n_2"}
    tool = lp["steps"][1]["tool"]["output"]
    assert set(lp["next"]) == {"history_3", "n_4"} and lp["next"]["n_4"] == tool
    assert lp["until"]["kind"] == "any" and lp["outputs"] == body["outputs"] == [lp["next"]["history_3"], tool,
                                                                                "reply_5"]
    assert [next(iter(s)) for s in lp["steps"]] == ["generate", "tool", "text"]


def test_loop_errors():
    with pytest.raises(TemplateError, match="every carried name"):
        F.trace(lambda p: F.loop(lambda h: {"x": h}, carry={"h": p}, until=lambda o: o["x"].equals("a"),
                                 max_steps=2), "p")
    for bad in ({"max_steps": 0}, {"max_steps": 2, "on_max": "never"}):
        with pytest.raises(TypeError):
            F.trace(lambda p: F.loop(lambda h: {"h": h}, carry={"h": p}, until=lambda o: o["h"].equals("a"),
                                     **bad), "p")
    with pytest.raises(TypeError, match="dict"):
        F.trace(lambda p: F.loop(lambda h: h, carry={"h": p}, until=None, max_steps=2), "p")
    with pytest.raises(TypeError, match="condition"):
        F.trace(lambda p: F.loop(lambda h: {"h": h}, carry={"h": p}, until=lambda o: True, max_steps=2), "p")


def test_map():
    body = body_of(lambda items: F.map(items, lambda item: answer(item, "x"), split="json_array", join=", ",
                                       max_items=4), "[1, 2]")
    m = body["steps"][0]["map"]
    assert m["over"] == "items_1" and m["split"] == "json_array" and m["join"] == ", " and m["max_items"] == 4
    assert m["output"] == "reply_4" and body["outputs"] == [m["into"]] and m["as"] == "item_2"
    assert m["steps"][0]["generate"]["prompt"].startswith("Answer the {{input:kind_3}} question {{input:item_2}}")
    ident = body_of(lambda items: F.map(items, lambda item: item), "a")["steps"][0]["map"]["steps"]
    assert ident[0]["text"]["template"] == "{{input:item_2}}"  # the item itself is copied into a body name
    with pytest.raises(TypeError, match="split"):
        F.trace(lambda items: F.map(items, lambda i: i, split="words"), "a")


def test_misuse():
    keep = {}
    F.trace(lambda x: keep.setdefault("x", x), "x")
    with pytest.raises(TypeError, match="outside the flow"):
        answer(keep["x"], "k")
    with pytest.raises(TypeError, match="declare it a tool"):
        F.trace(lambda x: P.native_function(lambda t: t)(x), "x")
    with pytest.raises(TypeError, match="function of no arguments"):
        F.trace(lambda x: F.branch(x, cases={"a": "not callable"}), "x")


def test_public_names_exported():
    for name in ("flow", "trace", "branch", "loop", "map", "text", "tool", "FlowVar", "FlowRun", "Cond"):
        assert getattr(P, name) is getattr(F, name), name


# ---- end to end on the default model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    yield from parrot_serve_default_model()


@pytest.mark.model
def test_e2e_branch_and_map(server):
    with P.connect(server) as s:
        label = P.SemanticVariable("Tech", name="label")
        reply = F.branch(label, cases={"billing": lambda: F.text("B"), "tech": lambda: answer("my bug", label)},
                         default=lambda: F.text("other"), name="route")
        assert isinstance(reply, P.SemanticVariable) and reply.get(timeout=60) not in ("B", "other")
        joined = F.map(P.SemanticVariable("a\nb\nc"), lambda item: F.text("<{{input:i}}>", i=item), join="|")
        assert joined.get(timeout=30) == "<a>|<b>|<c>"
        with pytest.raises(InvalidRequestError):  # a server 400 surfaces as the client's typed error
            F.tool("no_such_tool", x="1")
        assert s.closed is False


def _counter_loop(count_with):
    def fn(start):
        def step(n):
            nxt = count_with(n)
            return {"n": nxt, "note": two(nxt)[0]}

        return F.loop(step, carry={"n": start}, until=lambda out: out["n"].number() >= 4, max_steps=6, name="count")

    return fn


@pytest.mark.model
def test_e2e_loop_with_server_tool(server):
    with P.connect(server):
        run = F.flow(_counter_loop(lambda n: F.tool("calculator", expression=F.text("{{input:n}} + 1", n=n))), "1")
        assert run.outputs["n"].get(timeout=60) == "4"
        assert isinstance(run.outputs["note"].get(timeout=60), str)
        status = run.wait(timeout=30)
        assert status["status"] == "finished" and run.iterations(status) == 3


@pytest.mark.model
def test_e2e_loop_with_client_tool(server, monkeypatch):
    monkeypatch.setattr(W, "TOOL_POLL_S", 1.0)
    with P.connect(server) as s:
        run = F.flow(_counter_loop(incr), "1", name="client_count")
        assert run.outputs["n"].get(timeout=60) == "4" and run.iterations(run.wait(timeout=30)) == 3
        worker = W.worker_for(s)
        assert worker.thread.is_alive()
        failing = F.flow(lambda n: incr(n), "not a number")
        with pytest.raises(StepFailed):
            failing.outputs.get(timeout=30)
    worker.thread.join(10)
    assert not worker.thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("parrot-flow-tools")]


def _example(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.model
@pytest.mark.parametrize("tools", [[], ["--client-tools"]])
def test_e2e_react_agent_example(server, tools):
    out = _example("react_agent.py", "--url", server, "--questions", "2", "--max-steps", "3", "--max-tokens", "8",
                   *tools)
    lines = out.splitlines()
    assert sum(ln.startswith("Q: ") for ln in lines) == 2 and sum(ln.startswith("A: ") for ln in lines) == 2
    iterations = [int(x) for ln in lines if ln.startswith("A: ")
                  for x in [ln.rsplit("[", 1)[1].split(" iterations")[0]]]
    assert all(1 <= n <= 3 for n in iterations)
    assert f"({'client' if tools else 'server'} tools), one submission each" in lines[-1]


@pytest.mark.model
def test_e2e_refine_example(server):
    ok = _example("refine_until_valid.py", "--url", server)
    assert ok.startswith("valid JSON: ") or ok.startswith("no valid JSON after 3 attempts")
    if ok.startswith("valid JSON: "):
        json.loads(ok.splitlines()[0][len("valid JSON: "):])
    failed = _example("refine_until_valid.py", "--url", server, "--attempts", "2", "--max-tokens", "4")
    assert failed.startswith("no valid JSON after 2 attempts (cause loop_max_steps)")


def test_top_level_submission_with_fake_session(monkeypatch):
    """Top level without a server: a one-step flow is submitted and its outputs are SemanticVariables."""
    sent = []

    class FakeSession:
        session_id, closed, _base = "s1", False, "/api/v1/sessions/s1"

        def _request(self, method, path, json=None, **kw):
            sent.append((method, path, json))
            return {"flow_id": "f_1", "outputs": {n: f"v_{n}" for n in json["outputs"]}}

    monkeypatch.setattr(P.SemanticVariable, "_bind", lambda self, s: "v_in")
    out = F.branch(P.SemanticVariable("x"), cases={"x": lambda: F.text("yes")}, session=FakeSession())
    assert isinstance(out, P.SemanticVariable) and out._var_id.startswith("v_text")
    method, path, body = sent[0]
    assert (method, path) == ("POST", "/api/v1/sessions/s1/flows") and list(body["inputs"].values()) == ["v_in"]
