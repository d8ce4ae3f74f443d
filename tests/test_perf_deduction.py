"""Performance-objective deduction (paper §5.2, Fig. 9) on the DAGs of Fig. 1: labels and task groups, deduction
at GET time (value still pending), late submits labeled on arrival, latency targets, and the DAG dump / API."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from parrot.api.app import create_app
from parrot.api.settings import ServerSettings
from parrot.common.errors import InvalidRequestError
from parrot.common.perf import LatencyTargets, PerfCriteria, PinnedTargets
from parrot.common.template import parse_template
from parrot.manager import EngineRegistry, Manager, ManagerConfig
from parrot.manager.graph import Graph, PlaceholderBinding
from parrot.manager.perf_deduction import PerfDeduction, RequestLabel, deduce, request_depths
from parrot.manager.submit import PlaceholderSpec, SubmitSpec
from fakes import FakeEngine

LAT, THR = PerfCriteria.LATENCY, PerfCriteria.THROUGHPUT


def call(graph: Graph, name: str, *inputs: str, output: str | None = None):
    """A request reading ``inputs`` (var ids) and producing one output (into ``output`` if given)."""
    names = [f"i{k}" for k in range(len(inputs))]
    prompt = name + ": " + " ".join("{{input:%s}}" % n for n in names) + " -> {{output:out}}"
    bindings = [PlaceholderBinding(n, False, v) for n, v in zip(names, inputs)]
    bindings.append(PlaceholderBinding("out", True, output))
    return graph.add_request(name, parse_template(prompt), bindings)


def labels_by_name(graph: Graph, labels: dict[str, RequestLabel]) -> dict[str, tuple]:
    return {graph.requests[r].name: (lab.criteria, lab.task_group) for r, lab in labels.items()}


def map_reduce(n: int = 4):
    g = Graph("s")
    chunks = [g.add_variable(f"c{i}", f"chunk {i}").var_id for i in range(n)]
    maps = [call(g, f"map{i}", c) for i, c in enumerate(chunks)]
    reduce = call(g, "reduce", *(m.outputs[0] for m in maps))
    return g, maps, reduce


def test_map_reduce_latency_labels_reduce_and_groups_the_maps():
    g, maps, reduce = map_reduce()
    g.set_perf_obj(reduce.outputs[0], LAT)
    got = labels_by_name(g, deduce(g))
    assert got == {"map0": (LAT, "g0"), "map1": (LAT, "g0"), "map2": (LAT, "g0"), "map3": (LAT, "g0"),
                   "reduce": (LAT, None)}
    assert request_depths(g) == {**{m.request_id: 0 for m in maps}, reduce.request_id: 1}


def test_map_reduce_throughput_marks_every_producer_without_groups():
    g, maps, reduce = map_reduce(3)
    g.set_perf_obj(reduce.outputs[0], THR)
    assert labels_by_name(g, deduce(g)) == {"map0": (THR, None), "map1": (THR, None), "map2": (THR, None),
                                            "reduce": (THR, None)}
    # one intermediate fetched for latency on top: that map (direct producer) is latency, the rest stays
    g.set_perf_obj(maps[1].outputs[0], LAT)
    got = labels_by_name(g, deduce(g))
    assert got["map1"] == (LAT, None) and got["map0"] == (THR, None) and got["reduce"] == (THR, None)


def test_chain_labels_only_the_last_step_and_its_predecessor():
    g = Graph("s")
    chunks = [g.add_variable(f"c{i}", f"chunk {i}").var_id for i in range(4)]
    steps = [call(g, "s0", chunks[0])]
    for i in range(1, 4):
        steps.append(call(g, f"s{i}", steps[-1].outputs[0], chunks[i]))
    g.set_perf_obj(steps[-1].outputs[0], LAT)
    assert labels_by_name(g, deduce(g)) == {"s2": (LAT, None), "s3": (LAT, None)}
    # throughput on the same final output walks the whole chain, but latency still wins where it applies
    g.set_perf_obj(steps[1].outputs[0], THR)
    got = labels_by_name(g, deduce(g))
    assert got == {"s0": (THR, None), "s1": (THR, None), "s2": (LAT, None), "s3": (LAT, None)}


def test_multi_agent_revisers_coders_and_reviewers_form_three_task_groups():
    """Fig. 1c / §8.4: architect -> coders (parallel) -> reviewers -> revisers; every revised file fetched."""
    g = Graph("s")
    task = g.add_variable("task", "a snake game").var_id
    architect = call(g, "architect", task)
    coders = [call(g, f"coder{i}", architect.outputs[0]) for i in range(3)]
    reviewers = [call(g, f"reviewer{i}", c.outputs[0]) for i, c in enumerate(coders)]
    revisers = [call(g, f"reviser{i}", c.outputs[0], r.outputs[0]) for i, (c, r) in enumerate(zip(coders, reviewers))]
    for r in revisers:
        g.set_perf_obj(r.outputs[0], LAT)
    got = labels_by_name(g, deduce(g))
    assert "architect" not in got  # two steps upstream of every fetched value
    assert {got[f"reviser{i}"] for i in range(3)} == {(LAT, "g0")}
    assert {got[f"coder{i}"] for i in range(3)} == {(LAT, "g1")}  # depth 1
    assert {got[f"reviewer{i}"] for i in range(3)} == {(LAT, "g2")}  # depth 2: after the coders


def test_fig9_two_latency_outputs_of_one_stage_and_their_predecessor():
    g = Graph("s")
    x = g.add_variable("x", "input").var_id
    r3 = call(g, "R3", x)
    r1 = call(g, "R1", r3.outputs[0])
    r2 = call(g, "R2", r3.outputs[0])
    g.set_perf_obj(r1.outputs[0], LAT)
    g.set_perf_obj(r2.outputs[0], LAT)
    assert labels_by_name(g, deduce(g)) == {"R3": (LAT, None), "R1": (LAT, "g0"), "R2": (LAT, "g0")}


def test_code_and_test_are_dependent_so_no_group():
    """Fig. 7: write_test consumes write_code's output; both fetched for latency."""
    g = Graph("s")
    task = g.add_variable("task", "a snake game").var_id
    code = call(g, "write_code", task)
    test = call(g, "write_test", task, code.outputs[0])
    g.set_perf_obj(code.outputs[0], LAT)
    g.set_perf_obj(test.outputs[0], LAT)
    assert labels_by_name(g, deduce(g)) == {"write_code": (LAT, None), "write_test": (LAT, None)}


def test_targets_direct_producers_get_all_predecessors_only_the_deadline():
    g, maps, reduce = map_reduce(2)
    final = reduce.outputs[0]
    g.set_perf_obj(final, LAT)
    labels = deduce(g, {final: PinnedTargets(ttft_s=0.5, tpot_s=0.05, deadline=100.0)})
    assert labels[reduce.request_id].targets == PinnedTargets(0.5, 0.05, 100.0)
    assert labels[maps[0].request_id].targets == PinnedTargets(deadline=100.0)
    assert PinnedTargets(ttft_s=1.0, deadline=5.0).tightest(PinnedTargets(ttft_s=2.0, tpot_s=0.1)) == \
        PinnedTargets(1.0, 0.1, 5.0)
    with pytest.raises(InvalidRequestError):
        PinnedTargets(tpot_s=0.0)
    # the relative form a client states, pinned at the GET's time on the manager's clock; one validation rule
    assert LatencyTargets(ttft_s=0.5, tpot_s=0.05, deadline_s=10.0).pinned(90.0) == PinnedTargets(0.5, 0.05, 100.0)
    assert LatencyTargets(tpot_s=0.05).pinned(90.0) == PinnedTargets(tpot_s=0.05)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(InvalidRequestError, match="ttft_s"):
            PinnedTargets(ttft_s=bad)
        with pytest.raises(InvalidRequestError, match="ttft_s"):
            LatencyTargets(ttft_s=bad)


def test_deduction_runs_at_get_time_and_late_submits_are_labeled_on_arrival():
    g = Graph("s")
    d = PerfDeduction(clock=lambda: 1000.0)
    out = g.add_variable("answer").var_id  # the app fetches it before submitting its producer
    assert d.annotate(g, out, LAT) is False  # nothing produces it yet: no labels change
    assert g.get_perf_obj(out) is LAT
    doc = g.add_variable("doc").var_id  # pending: the requests below never become ready in this test
    part = g.add_variable("part").var_id  # consumed before a producer exists
    producer = call(g, "answer", part, doc, output=out)
    assert d.submitted(g, producer) is True
    assert d.label("s", producer.request_id) == RequestLabel(LAT)
    late = call(g, "part", doc, output=part)  # an immediate predecessor submitted after the criterion
    assert d.submitted(g, late) is True
    assert d.label("s", late.request_id) == RequestLabel(LAT)
    unrelated = call(g, "other", doc)
    assert d.submitted(g, unrelated) is False and d.label("s", unrelated.request_id) is None
    info = d.info("s", late.request_id)
    assert info.app_order == 1000.0 and info.depth == 0 and d.info("s", producer.request_id).depth == 1
    assert d.annotate(g, out, THR) is False  # latency already recorded: throughput never loosens it
    assert d.annotate(g, out, LAT, PinnedTargets(tpot_s=0.02)) is True
    assert d.label("s", producer.request_id).targets.tpot_s == 0.02
    assert d.info("s", producer.request_id).targets.tpot_s == 0.02  # infos (cached) follow the relabel
    d.forget("s")
    assert d.labels("s") == {}


def test_manager_get_with_criteria_labels_waiting_requests_and_dumps_them():
    async def main():
        mgr = Manager(EngineRegistry([FakeEngine()]), config=ManagerConfig(engine_heartbeat_s=0))
        await mgr.start()
        try:
            s = mgr.create_session()
            doc = mgr.create_variable(s, "doc")  # never set: every request keeps waiting
            maps = [mgr.submit(s, SubmitSpec(f"Part {i} of {{{{input:doc}}}}: {{{{output:m}}}}",
                                             [PlaceholderSpec("doc", False, doc.var_id),
                                              PlaceholderSpec("m", True)], name=f"map{i}")) for i in range(2)]
            red = mgr.submit(s, SubmitSpec("{{input:a}} {{input:b}} => {{output:r}}",
                                           [PlaceholderSpec("a", False, maps[0].outputs[0]),
                                            PlaceholderSpec("b", False, maps[1].outputs[0]),
                                            PlaceholderSpec("r", True)], name="reduce"))
            view = await mgr.get_variable(s, red.outputs[0], criteria="latency", timeout_s=0,
                                          targets=PinnedTargets(ttft_s=0.2))
            return view, mgr.dag(s)
        finally:
            await mgr.stop()

    view, dag = asyncio.run(main())
    assert view.value is None  # still pending, yet labeled
    sched = {r["name"]: r["sched"] for r in dag.requests}
    assert sched["reduce"] == {"criteria": "latency", "task_group": None, "targets": {"ttft_s": 0.2}}
    assert sched["map0"] == sched["map1"] == {"criteria": "latency", "task_group": "g0", "targets": {}}
    assert "# r_1: latency, group g0" in dag.text and "# r_3: latency" in dag.text.splitlines()


def test_get_targets_over_http_imply_latency_and_are_validated():
    with TestClient(create_app(ServerSettings(engine_heartbeat_s=0), [FakeEngine()])) as c:
        s = c.post("/api/v1/sessions").json()
        h = {"X-Parrot-Session-Token": s["token"]}
        base = f"/api/v1/sessions/{s['session_id']}"
        v = c.post(f"{base}/variables", json={"name": "x"}, headers=h).json()["var_id"]
        r = c.post(f"{base}/submit", headers=h, json={
            "prompt": "{{input:x}} {{output:y}}", "placeholders": [
                {"name": "x", "is_output": False, "var_id": v}, {"name": "y", "is_output": True}]}).json()
        y = r["outputs"]["y"]
        assert c.get(f"{base}/variables/{y}", params={"tpot_ms": 40, "deadline_s": 30}, headers=h).status_code == 200
        dag = c.get(f"{base}/dag", headers=h).json()
        sched = dag["requests"][0]["sched"]
        assert sched["criteria"] == "latency" and sched["targets"]["tpot_s"] == pytest.approx(0.04)
        assert dag["variables"][1]["perf"] == "latency"
        bad = c.get(f"{base}/variables/{y}", params={"ttft_ms": -1}, headers=h)
        assert bad.status_code == 400
