"""The per-session DAG: primitives, validation (cycles, producers, unknown ids), dumps, submit checks."""

from __future__ import annotations

import pytest

from parrot.common.errors import (
    BadSamplingParams,
    CycleError,
    InvalidRequestError,
    TemplateError,
    TransformSpecError,
    UnknownVariable,
    VariableAlreadySet,
)
from parrot.common.perf import PerfCriteria
from parrot.common.template import parse_template
from parrot.manager.graph import Graph, PlaceholderBinding, RequestStatus, VarStatus
from parrot.manager.prefix_store import ContextRef, PrefixStore, prefix_hashes
from parrot.manager.submit import PlaceholderSpec, SubmitSpec, build_bindings


def _add(graph: Graph, prompt: str, inputs: dict[str, str], outputs: dict[str, str | None], name: str = "f"):
    bindings = [PlaceholderBinding(n, False, v) for n, v in inputs.items()]
    bindings += [PlaceholderBinding(n, True, v) for n, v in outputs.items()]
    return graph.add_request(name, parse_template(prompt), bindings)


def test_producer_consumer_primitives_and_perf_obj():
    g = Graph("s")
    task = g.add_variable("task", "a snake game")
    code_req = _add(g, "Write {{input:task}}: {{output:code}}", {"task": task.var_id}, {"code": None}, "write_code")
    code = code_req.outputs[0]
    test_req = _add(g, "{{input:task}} {{input:code}} -> {{output:test}}",
                    {"task": task.var_id, "code": code}, {"test": None}, "write_test")
    assert g.get_producer(task.var_id) is None
    assert g.get_producer(code) is code_req
    assert [r.request_id for r in g.get_consumers(task.var_id)] == [code_req.request_id, test_req.request_id]
    assert g.get_consumers(code) == [test_req]
    assert g.variable(code).name == "code" and test_req.inputs == (task.var_id, code)

    assert g.get_perf_obj(code) is None
    g.set_perf_obj(code, PerfCriteria.THROUGHPUT)
    assert g.get_perf_obj(code) is PerfCriteria.THROUGHPUT
    g.set_perf_obj(code, PerfCriteria.LATENCY)  # latency is stricter and wins
    g.set_perf_obj(code, PerfCriteria.THROUGHPUT)
    assert g.get_perf_obj(code) is PerfCriteria.LATENCY

    text = g.dump_text().splitlines()
    assert text[0] == "%1 = input task = 'a snake game'  [ready]"
    assert text[1] == "%2 = r_1 write_code(code) <- %1  [waiting, get:latency]"
    assert text[2] == "%3 = r_2 write_test(test) <- %1, %2  [waiting]"
    data = g.to_json()
    assert [r["request_id"] for r in data["requests"]] == ["r_1", "r_2"]
    assert data["variables"][1]["producer"] == "r_1" and data["variables"][1]["consumers"] == ["r_2"]
    assert set(data["requests"][0]["timestamps"]) == {"submitted", "dispatched", "first_token", "finished"}


def test_cycle_rejected_direct_and_indirect_and_graph_unchanged():
    g = Graph("s")
    a = g.add_variable("a")
    # direct: the same variable as input and output of one request
    with pytest.raises(CycleError):
        _add(g, "{{input:x}} {{output:y}}", {"x": a.var_id}, {"y": a.var_id})
    # indirect: a -> r1 -> b ; then r2 consumes b and produces into a
    r1 = _add(g, "{{input:x}} {{output:y}}", {"x": a.var_id}, {"y": None})
    b = r1.outputs[0]
    before = (dict(g.variables), dict(g.requests), list(g.variable(b).consumers))
    with pytest.raises(CycleError) as e:
        _add(g, "{{input:x}} {{output:y}}", {"x": b}, {"y": a.var_id})
    assert e.value.status_code == 400 and e.value.code == "cycle"
    assert (dict(g.variables), dict(g.requests), list(g.variable(b).consumers)) == before
    assert g.variable(a.var_id).producer is None


def test_one_producer_per_variable_and_unknown_ids():
    g = Graph("s")
    out = g.add_variable("out")
    _add(g, "{{output:y}}", {}, {"y": out.var_id})
    with pytest.raises(InvalidRequestError, match="already has a producer"):
        _add(g, "{{output:z}}", {}, {"z": out.var_id})
    two = g.add_variable("two")
    with pytest.raises(InvalidRequestError, match="two outputs"):
        _add(g, "{{output:y}} {{output:z}}", {}, {"y": two.var_id, "z": two.var_id})
    with pytest.raises(UnknownVariable) as e:
        _add(g, "{{input:x}} {{output:y}}", {"x": "v_99"}, {"y": None})
    assert e.value.status_code == 404
    done = g.add_variable("done", "value")
    with pytest.raises(VariableAlreadySet):
        _add(g, "{{output:y}}", {}, {"y": done.var_id})
    with pytest.raises(VariableAlreadySet):
        g.check_settable(out.var_id)  # has a producer
    with pytest.raises(VariableAlreadySet):
        g.check_settable(done.var_id)  # already set


def test_two_outputs_keep_template_order_and_default_stops():
    spec = SubmitSpec(
        prompt="A: {{input:a}}\nB: {{output:b}}\nC: {{output:c}}. Done {{output:d}}\n{{output:e}}\nEnd",
        placeholders=[PlaceholderSpec("d", True), PlaceholderSpec("c", True, sampling={"max_tokens": 5}),
                      PlaceholderSpec("a", False, "v_1"),
                      PlaceholderSpec("b", True, sampling={"stop": ["END"]}, transforms=[{"op": "strip"}]),
                      PlaceholderSpec("e", True, sampling={"stop": []})])
    segments, bindings = build_bindings(spec)
    by = {b.name: b for b in bindings}
    assert by["b"].sampling.stop == ("END",)  # explicit stop is kept
    assert by["c"].sampling.stop == (". Done",) and by["c"].sampling.max_tokens == 5
    assert by["d"].sampling.stop == ("\n",)
    assert by["e"].sampling.stop == ()  # explicitly none, though text follows
    assert by["b"].transforms[0].op == "strip"
    g = Graph("s")
    g.add_variable("a", "x")
    req = g.add_request("f", segments, bindings)
    assert list(req.bindings) == ["a", "b", "c", "d", "e"]
    assert [g.variable(v).name for v in req.outputs] == ["b", "c", "d", "e"]


@pytest.mark.parametrize("placeholders, err", [
    ([PlaceholderSpec("x", True)], TemplateError),  # 'y' of the prompt is not listed
    ([PlaceholderSpec("x", True), PlaceholderSpec("y", True), PlaceholderSpec("z", True)], TemplateError),
    ([PlaceholderSpec("x", False, "v_1"), PlaceholderSpec("y", True)], TemplateError),  # kind mismatch
    ([PlaceholderSpec("x", True, sampling={"max_tokens": 0}), PlaceholderSpec("y", True)], BadSamplingParams),
    ([PlaceholderSpec("x", True, sampling={"bogus": 1}), PlaceholderSpec("y", True)], BadSamplingParams),
    ([PlaceholderSpec("x", True, transforms=[{"op": "nope"}]), PlaceholderSpec("y", True)], TransformSpecError),
])
def test_submit_validation_errors(placeholders, err):
    with pytest.raises(err) as e:
        build_bindings(SubmitSpec(prompt="{{output:x}} and {{output:y}}", placeholders=placeholders))
    assert e.value.status_code == 400


def test_prefix_store_tracks_queued_and_contexts():
    h = prefix_hashes(["sys ", "value", " tail"])
    assert len(set(h)) == 3 and prefix_hashes(["sys ", "value"]) == h[:2]
    assert prefix_hashes(["sys value"]) != prefix_hashes(["sys ", "value"])[1:]  # boundaries are identity
    store = PrefixStore()
    store.add_queued("s/r_1", h[:2])
    store.add_queued("s/r_2", h[:1])
    assert store.lookup(h[0]).queued == {"s/r_1", "s/r_2"}
    store.remove_queued("s/r_1")
    assert store.lookup(h[1]).queued == frozenset() and store.lookup(h[0]).queued == {"s/r_2"}
    ref = ContextRef("e0", "ctx1", 12)
    store.add_context(h[0], ref)
    assert store.lookup(h[0]).contexts == {ref}
    store.remove_context("e0", "ctx1")
    assert store.lookup(h[0]).contexts == frozenset()


def test_variable_state_machine():
    g = Graph("s")
    v = g.add_variable("v")
    assert v.status is VarStatus.PENDING and not v.done
    g.materialize(v.var_id, "x")
    assert v.status is VarStatus.READY and v.done and v._done.is_set()
    with pytest.raises(VariableAlreadySet):
        g.materialize(v.var_id, "y")
    r = _add(g, "{{input:a}}{{output:b}}", {"a": v.var_id}, {"b": None})
    assert r.status is RequestStatus.WAITING and g.input_state(r) == (True, None)
