"""Streaming Semantic Variables (issue 20 item 3): ``GET .../variables/{vid}/stream`` (SSE) and the frontend's
``var.stream()`` / ``async for piece in var``.

Two halves: the fake engine (tests/fakes.py, paced tokens) behind the real server app on a real socket, for the
exact contract (order, completeness, stop strings, lead spaces, transforms, late readers, DAG values the client
never waited on, failures mid-stream and upstream, 404, criteria recorded); then the real default model through
``P.local()`` (engine + server app + uvicorn in this process) for the same properties on real generation.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

import parrot as P
from parrot.common.errors import EngineError, EngineUnavailable, StepFailed, UnknownVariable

pytest.importorskip("fastapi")

from test_frontend_perf import _define  # noqa: E402  (a semantic function from a template)
from fakes import TAIL, FakeEngine, UnreachableEngine  # noqa: E402


class MidStreamFailingEngine(FakeEngine):
    """Fails a generation with EngineError after ``fail_after`` chunks when its context holds ``fail_marker``."""

    fail_marker = "EXPLODE"
    fail_after = 5

    async def generate_stream(self, sampling, context_id, parent_context_id=None, *, hint=None):
        doomed = self.fail_marker in self.decode(self.contexts.get(context_id, []))
        n = 0
        async for chunk in super().generate_stream(sampling, context_id, parent_context_id, hint=hint):
            yield chunk
            n += 1
            if doomed and n == self.fail_after and chunk.finish_reason is None:
                raise EngineError(f"engine died while generating context {context_id!r}")


@pytest.fixture(scope="module")
def server():
    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings
    from parrot.frontend.local import LocalServer

    engine = MidStreamFailingEngine("fake0", max_model_len=4096)
    srv = LocalServer(create_app(ServerSettings(), [engine]))
    yield srv, engine
    srv.stop()


@pytest.fixture
def fake(server):
    srv, engine = server
    engine.token_delay_s = 0.01
    s = P.connect(srv.url, make_default=False)
    yield s, engine
    s.close()
    engine.token_delay_s = 0.0
    engine.reply_lead = ""


def _request_of(s, var) -> dict:
    dag = s.dag()
    producer = next(v["producer"] for v in dag["variables"] if v["var_id"] == var.id)
    return next(r for r in dag["requests"] if r["request_id"] == producer)


def _raw_events(s, var_id: str, **params) -> list[dict]:
    """The stream's SSE events read with plain httpx (the wire contract, not the frontend's parser)."""
    events = []
    with httpx.stream("GET", f"{s.url}/api/v1/sessions/{s.session_id}/variables/{var_id}/stream", params=params,
                      headers={"X-Parrot-Session-Token": s._token}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


# ---- the fake engine behind the real server: the exact contract ------------------------------------------------
def test_pieces_arrive_in_order_before_the_request_ends_and_join_to_the_value(fake):
    s, _ = fake
    gen = _define("Tell a story about {{input:topic}}\nStory: {{output:story}}", "topic", max_tokens=30,
                  ignore_eos=True, stop=[])
    story = gen("owls", session=s)
    pieces, arrived = [], []
    for piece in story.stream():
        pieces.append(piece)
        arrived.append(time.time())
    value = story.get(timeout=5)
    # FakeEngine's reply is "<the last 24 chars of the context>" then "\nrest of the answer", one token per byte
    assert value == FakeEngine.reply_for("Tell a story about owls\nStory:") + "\nrest of the answer"[:30 - 26]
    assert "".join(pieces) == value and len(pieces) > 5
    finished = _request_of(s, story)["timestamps"]["finished"]
    assert arrived[0] < finished - 0.1  # the first piece came while the engine was still generating

    events = _raw_events(s, story.id)  # a reader of a finished value: its pieces, done, [DONE]
    assert events[-1] == "[DONE]" and events[-2] == {"type": "done", "var_id": story.id, "name": "story",
                                                     "status": "ready", "value": value}
    assert "".join(e["text"] for e in events[:-2]) == value and all(e["type"] == "piece" for e in events[:-2])


def test_stop_strings_and_moved_lead_spaces_never_reach_the_stream(fake):
    s, engine = fake
    engine.reply_lead = " "  # like a BPE model whose first token carries the word's space
    gen = _define("Q: {{input:q}}\nA: {{output:a}}", "q", max_tokens=60, stop=["\nrest"])
    answer = gen("why", session=s)
    pieces = list(answer.stream())
    assert "".join(pieces) == answer.get() == FakeEngine.reply_for("Q: why\nA:")
    assert not any("\n" in p for p in pieces)  # the held-back "\n" of "\nrest" was never sent
    assert not pieces[0].startswith(" ")  # the template's moved space is not part of the value, nor of the stream


def test_transformed_output_streams_the_raw_text_and_ends_with_the_value(fake):
    s, _ = fake
    gen = _define("Name: {{input:n}}\nOut: {{output:o}}", "n", max_tokens=40, stop=["\n"], transforms=[P.upper()])
    out = gen("ada", session=s)
    raw = FakeEngine.reply_for("Name: ada\nOut:")
    assert "".join(out.stream()) == raw  # the generated text (stopped at "\n"), before the transform
    assert out.get() == raw.upper()


def test_value_produced_inside_a_dag_streams_to_a_client_that_never_waited_on_its_input(fake):
    s, _ = fake
    first = _define("Topic: {{input:t}}\nDraft: {{output:draft}}", "t", max_tokens=20, ignore_eos=True)
    second = _define("Polish: {{input:draft}}\nFinal: {{output:final}}", "draft", max_tokens=20, ignore_eos=True)
    draft = first("tea", session=s)
    final = second(draft, session=s)  # the client streams only S2; S1 runs and feeds it server-side
    pieces = list(final.stream())
    assert len(pieces) > 1 and "".join(pieces) == final.get()
    dag = s.dag()
    assert [r["status"] for r in dag["requests"]] == ["finished", "finished"]
    perf = {v["var_id"]: v["perf"] for v in dag["variables"]}
    assert perf[final.id] == "latency" and perf[draft.id] is None  # only S2 was asked for (§5.2 deduces S1)
    assert all(r["sched"]["criteria"] == "latency" for r in dag["requests"])


def test_late_subscriber_gets_the_pieces_so_far_then_the_live_ones(fake):
    s, engine = fake
    engine.token_delay_s = 0.02
    gen = _define("Item: {{input:i}}\nText: {{output:text}}", "i", max_tokens=40, ignore_eos=True, stop=[])
    text = gen("late", session=s)
    early: list[str] = []
    late: list[dict] = []
    started = threading.Event()

    def early_reader():
        for piece in text.stream():
            early.append(piece)
            if len(early) == 10:
                started.set()

    t = threading.Thread(target=early_reader)
    t.start()
    assert started.wait(10)
    late = _raw_events(s, text.id, criteria="throughput")  # joins after >= 10 pieces were generated
    t.join(10)
    value = text.get()
    assert late[-1] == "[DONE]"
    late = late[:-1]
    assert "".join(early) == value == "".join(e["text"] for e in late if e["type"] == "piece")
    assert len(late[0]["text"]) >= 10  # what it missed, joined into its first event
    assert sum(e["type"] == "piece" for e in late) > 1  # then live pieces
    assert late[-1]["type"] == "done" and late[-1]["value"] == value


def test_a_failure_mid_stream_reaches_every_reader_as_the_typed_error(fake):
    s, engine = fake
    gen = _define("Task: {{input:t}}\nOut: {{output:o}}", "t", max_tokens=40, ignore_eos=True)
    follow = _define("Use: {{input:o}}\nNext: {{output:n}}", "o", max_tokens=10)
    out = gen(MidStreamFailingEngine.fail_marker, session=s)
    after = follow(out, session=s)
    got: list[str] = []
    with pytest.raises(StepFailed) as ei:
        for piece in out.stream():
            got.append(piece)
    assert ei.value.cause_code == "engine_error" and "engine died" in ei.value.message
    assert "".join(got) and len(got) <= engine.fail_after  # pieces came first, then the error
    with pytest.raises(StepFailed) as ei2:  # the dependent step's stream: the same root cause
        list(after.stream())
    assert ei2.value.cause_code == "engine_error"
    events = _raw_events(s, out.id)  # a late reader of the failed value: its pieces, then the error event
    assert "".join(e["text"] for e in events[:-2]) == "".join(got)
    assert events[-2]["error"]["code"] == "step_failed" and events[-2]["error"]["cause"] == "engine_error"
    assert events[-1] == "[DONE]"


def test_a_failing_transform_after_the_pieces_and_an_upstream_failure_are_typed_errors(fake):
    s, _ = fake
    gen = _define("Data: {{input:d}}\nJSON: {{output:j}}", "d", max_tokens=30, stop=["\n"],
                  transforms=[P.json_field("a")])
    j = gen("no json here", session=s)

    async def read() -> tuple[list[str], StepFailed]:
        got = []
        try:
            async for piece in j:  # __aiter__: astream() with LATENCY
                got.append(piece)
        except StepFailed as e:
            return got, e
        raise AssertionError("no error")

    got, err = asyncio.run(read())
    assert "".join(got) == FakeEngine.reply_for("Data: no json here\nJSON:") and err.cause_code == "transform_failed"
    with pytest.raises(StepFailed, match="transform"):
        j.get()  # the frontend kept the failure


def test_unknown_variable_is_404_and_client_and_native_values_stream_as_one_piece(fake):
    s, _ = fake
    with pytest.raises(UnknownVariable):
        list(s.stream_variable("v_999", {}))
    r = httpx.get(f"{s.url}/api/v1/sessions/{s.session_id}/variables/v_999/stream",
                  headers={"X-Parrot-Session-Token": s._token})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_variable"

    user = P.SemanticVariable("hello there", session=s)
    assert list(user.stream()) == ["hello there"]
    for bad, param in (({"criteria": "fastest"}, "criteria"), ({"ttft_ms": -5}, "ttft_ms")):
        r = httpx.get(f"{s.url}/api/v1/sessions/{s.session_id}/variables/{user.id}/stream", params=bad,
                      headers={"X-Parrot-Session-Token": s._token})
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert [e["type"] for e in _raw_events(s, user.id)[:-1]] == ["piece", "done"]
    pending = P.SemanticVariable(name="later", session=s)
    pending.id  # bound on the server, no value yet
    threading.Timer(0.3, pending.set, args=("set late",)).start()
    assert [e for e in _raw_events(s, pending.id) if e != "[DONE]"] == [
        {"type": "piece", "var_id": pending.id, "text": "set late"},
        {"type": "done", "var_id": pending.id, "name": "later", "status": "ready", "value": "set late"}]

    @P.native_function
    def shout(text: str) -> str:
        time.sleep(0.2)
        return text.upper()

    loud = shout(user, session=s)
    assert list(loud.stream()) == ["HELLO THERE"]
    gen = _define("Say {{input:x}}\nOut: {{output:o}}", "x", max_tokens=30, stop=["\n"])
    out = gen(shout("quiet", session=s), session=s)  # a server-side value fed by a native function
    assert "".join(out.stream()) == out.get() == FakeEngine.reply_for("Say QUIET\nOut:")


def test_native_failure_upstream_ends_the_stream_with_its_error(fake):
    s, _ = fake

    @P.native_function
    def boom(text: str) -> str:
        raise ValueError("bad " + text)

    gen = _define("Use {{input:x}}\nOut: {{output:o}}", "x", max_tokens=10)
    out = gen(boom("z", session=s), session=s)
    with pytest.raises(StepFailed) as ei:
        list(out.stream())
    assert ei.value.cause_code == "native_function_failed"


def test_deleting_the_session_fails_an_open_stream(fake):
    s, engine = fake
    engine.token_delay_s = 0.05
    gen = _define("Go {{input:x}}\nOut: {{output:o}}", "x", max_tokens=200, ignore_eos=True, stop=[])
    out = gen("far", session=s)
    got: list[str] = []

    async def read():
        async for piece in out.astream(perf=P.THROUGHPUT):
            got.append(piece)
            if len(got) == 3:
                await asyncio.to_thread(httpx.delete, f"{s.url}/api/v1/sessions/{s.session_id}",
                                        headers={"X-Parrot-Session-Token": s._token})

    with pytest.raises(StepFailed) as ei:
        asyncio.run(read())
    assert ei.value.cause_code == "unknown_session" and len(got) >= 3


def test_stream_records_the_criterion_and_targets_like_a_get(fake):
    s, _ = fake
    topic = P.SemanticVariable(name="topic", session=s)  # unset: nothing runs while we look
    first = _define("Topic: {{input:t}}\nDraft: {{output:draft}}", "t", max_tokens=8, ignore_eos=True)
    second = _define("Polish: {{input:draft}}\nFinal: {{output:final}}", "draft", max_tokens=8, ignore_eos=True)
    final = second(first(topic, session=s), session=s)
    done = threading.Event()
    pieces: list[str] = []

    def reader():
        pieces.extend(final.stream(ttft_ms=300.0, tpot_ms=25.5, deadline_s=60))
        done.set()

    threading.Thread(target=reader).start()
    for _ in range(100):  # the stream's GET records the criterion before any event
        if _request_of(s, final)["sched"] is not None:
            break
        time.sleep(0.02)
    label = _request_of(s, final)["sched"]
    assert label["criteria"] == "latency" and label["targets"]["ttft_s"] == 0.3
    assert label["targets"]["tpot_s"] == 25.5 / 1000 and time.time() + 55 < label["targets"]["deadline"]
    topic.set("tea")
    assert done.wait(10) and "".join(pieces) == final.get()


# ---- in process: the manager without HTTP ------------------------------------------------------------------------
class DiesMidStream(UnreachableEngine):
    """Goes unreachable after ``die_after`` chunks of its first generation (a killed engine process)."""

    die_after = 6

    async def generate_stream(self, sampling, context_id, parent_context_id=None, *, hint=None):
        n = 0
        async for chunk in super().generate_stream(sampling, context_id, parent_context_id, hint=hint):
            yield chunk
            n += 1
            if n == self.die_after:
                self.down = True
                raise EngineUnavailable(f"engine {self.name} unreachable (connection reset)")


def test_in_process_reader_across_a_failover_restart_gets_each_char_once():
    from parrot.manager.engine_registry import EngineRegistry
    from parrot.manager.manager import Manager, ManagerConfig
    from parrot.manager.submit import PlaceholderSpec, SubmitSpec
    from parrot.manager.value_stream import follow

    e0, e1 = DiesMidStream("e0"), FakeEngine("e1")
    e0.token_delay_s = e1.token_delay_s = 0.002

    async def main():
        mgr = Manager(EngineRegistry([e0, e1]), config=ManagerConfig(engine_heartbeat_s=0, policy="round-robin"))
        await mgr.start()
        try:
            s = mgr.create_session()
            a = mgr.create_variable(s, "a", "restart me")
            req = mgr.submit(s, SubmitSpec("A: {{input:a}}\nB: {{output:b}}", [
                PlaceholderSpec("a", False, a.var_id), PlaceholderSpec("b", True, None, {"max_tokens": 30,
                                                                                          "stop": []})]))
            events = [e async for e in follow(s.graph.variable(req.outputs[0]))]
            return events, req, mgr.stats()["failover"]
        finally:
            await mgr.stop()

    events, req, failover = asyncio.run(asyncio.wait_for(main(), 30))
    assert failover["rescheduled"] == 1 and req.engine == "e1"
    pieces = [e["text"] for e in events if e["type"] == "piece"]
    assert events[-1]["type"] == "done" and "".join(pieces) == events[-1]["value"]  # nothing sent twice
    assert events[-1]["value"] == (FakeEngine.reply_for("A: restart me\nB:") + TAIL)[:30]
    assert len("".join(pieces[:2])) <= DiesMidStream.die_after  # the first pieces came from the dead engine


def test_follow_sends_keepalives_while_a_value_is_pending_then_the_value():
    from parrot.manager.graph import Graph
    from parrot.manager.value_stream import follow

    async def main():
        graph = Graph("s")
        var = graph.add_variable("x")
        events = []
        async for event in follow(var, keepalive_s=0.02):
            events.append(event)
            if len(events) == 2:
                graph.materialize(var.var_id, "v")  # a client PUT while the reader waits
        return events

    events = asyncio.run(asyncio.wait_for(main(), 5))
    assert [e["type"] for e in events] == ["keepalive", "keepalive", "piece", "done"] and events[2]["text"] == "v"


def test_value_stream_and_sink_invariants():
    from parrot.manager.value_stream import OutputSink, ValueStream

    stream = ValueStream()
    sink = OutputSink(stream, lead=2)
    for piece in (" ", " he", "llo"):  # the two moved lead spaces are held back, then dropped
        sink.push(piece)
    sink.close()
    assert stream.pieces == ["he", "llo"]
    again = OutputSink(stream)  # a restarted run: what readers have is matched, only the rest is added
    for piece in ("h", "ello", " world"):
        again.push(piece)
    assert stream.text == "hello world" and stream.pieces[-1] == " world"
    diverged = OutputSink(stream)
    diverged.push("goodbye")  # a sampled rerun that differs: the log stops growing (the final value decides)
    diverged.push(" more")
    assert stream.text == "hello world"
    short = ValueStream()
    OutputSink(short, lead=3).push(" a")  # an output shorter than its lead keeps its text, as the value does
    assert short.pieces == []
    sink = OutputSink(short, lead=3)
    sink.push(" a")
    sink.close()
    assert short.text == " a"


# ---- the real model through P.local (engine + server app + uvicorn in this process) ------------------------------
@pytest.fixture(scope="module")
def real(default_model_path):
    session = P.local(default_model_path, make_default=False, kv_cache_tokens=8192)
    yield session
    session.close()


@pytest.mark.model
def test_real_model_streams_a_long_output_in_order_before_it_finishes(real):
    gen = _define("You are a poet.\nWrite a long poem about {{input:topic}}.\nPoem: {{output:poem}}", "topic",
                  max_tokens=64, ignore_eos=True, stop=[])
    poem = gen("the sea", session=real)
    pieces, arrived = [], []
    for piece in poem.stream():
        pieces.append(piece)
        arrived.append(time.time())
    value = poem.get()
    assert "".join(pieces) == value and len(pieces) > 3  # ~every 20 ms (LocalEngineClient.stream_interval_s)
    for _ in range(100):  # the value is ready before the request frees its context and finishes
        req = _request_of(real, poem)
        if req["status"] == "finished":
            break
        time.sleep(0.05)
    # more than one piece: they came live (a reader of a finished value gets it as one piece), the first before
    # the request ended
    assert arrived[0] < req["timestamps"]["finished"]


@pytest.mark.model
def test_real_model_dag_value_streams_async_and_a_deleted_session_fails_the_reader(real):
    first = _define("Topic: {{input:t}}\nOne sentence about it: {{output:s}}", "t", max_tokens=16)
    second = _define("Rewrite this as a question: {{input:s}}\nQuestion: {{output:q}}", "s", max_tokens=48,
                     ignore_eos=True)  # long enough to arrive in several pieces even when slow reads merge chunks

    async def read(var) -> list[str]:
        return [piece async for piece in var]

    q = second(first("coffee", session=real), session=real)
    pieces = asyncio.run(read(q))
    assert "".join(pieces) == q.get() and len(pieces) > 1

    s2 = P.connect(real.url, make_default=False)
    try:
        long = _define("Count slowly: {{input:x}}\nNumbers: {{output:n}}", "x", max_tokens=400, ignore_eos=True,
                       stop=[])(f"one two {time.time()}", session=s2)
        got: list[str] = []
        with pytest.raises(StepFailed) as ei:
            for piece in long.stream():
                got.append(piece)
                if len(got) == 3:
                    httpx.delete(f"{s2.url}/api/v1/sessions/{s2.session_id}",
                                 headers={"X-Parrot-Session-Token": s2._token}, timeout=30)
        assert ei.value.cause_code == "unknown_session" and len(got) >= 3
    finally:
        s2.close()  # the server session is gone already: close logs that and releases the client

