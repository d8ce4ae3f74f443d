"""Faults on the network path between the manager and its engines (issue 19 item 5), with real `parrot engine`
processes (tiny random model) and a TCP proxy in this test that breaks connections on purpose:

* refused connections (the engine's port closed, then open again): calls are retried with backoff and succeed;
  when it stays closed they give up as EngineUnavailable;
* connections reset after the engine applied a fill: the fill is retried with its op id and applied once (the
  context length is right, greedy outputs equal a clean run), end to end through the manager too;
* a hung engine (SIGSTOP: it accepts connections and never answers) is declared dead within a bounded time and
  its work runs on the other engine with the same outputs; SIGCONT brings it back; then a SIGKILL mid-generation
  (rescheduling after a crash is also covered by test_failover.py::test_killed_engine_process_requests_rerun_on_
  the_survivor; here the outputs are compared with a clean run);
* the manager goes away and comes back: the engine retries with backoff and registers again.
(`parrot engine` on SIGTERM: tests/test_shutdown.py.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import struct
import threading
import time

import httpx
import pytest

from parrot.common.errors import EngineUnavailable, OpIdConflict
from parrot.common.sampling import SamplingParams
from parrot.engine.clients.http_client import CallPolicy, HTTPEngineClient
from parrot.engine.server.procs import EngineProcess, free_port, stop_all
from engine_procs import SECRET, TINY_ENGINE, wait_until

NO_CACHE = [*TINY_ENGINE, "--no-enable-prefix-cache"]  # every run computes afresh: outputs comparable run to run
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=())


class FaultProxy:
    """A TCP proxy 127.0.0.1:``port`` -> 127.0.0.1:``target`` on its own event-loop thread, with faults:
    ``close()`` stops listening and drops every connection (callers see refused connections) until ``open()``;
    ``reset_fills(n)`` resets (RST) the next ``n`` connections that carry a fill, after the engine's answer
    arrived and instead of passing it on (the engine applied the fill; the caller never hears so)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.fills_seen = 0
        self.resets_done = 0
        self._resets_left = 0
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.open()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def open(self) -> None:
        async def start():
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)
        self._call(start())

    def close(self) -> None:
        async def stop():
            self._server.close()
            for w in list(self._conns):
                w.transport.abort()
        self._call(stop())

    def reset_fills(self, n: int) -> None:
        async def arm():
            self._resets_left = n
        self._call(arm())

    def stop(self) -> None:
        self.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        self._conns.add(writer)
        doomed = False

        async def client_to_engine() -> None:
            nonlocal doomed
            while data := await reader.read(65536):
                if b"POST /engine/v1/fill " in data:
                    self.fills_seen += 1
                    if self._resets_left > 0:
                        self._resets_left -= 1
                        doomed = True
                up_w.write(data)
                await up_w.drain()

        async def engine_to_client() -> None:
            while data := await up_r.read(65536):
                if doomed:  # the engine answered the fill: reset the caller's connection instead of answering
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    self.resets_done += 1
                    return
                writer.write(data)
                await writer.drain()

        try:
            await asyncio.wait([asyncio.ensure_future(client_to_engine()), asyncio.ensure_future(engine_to_client())],
                               return_when=asyncio.FIRST_COMPLETED)
        except OSError:
            pass
        finally:
            self._conns.discard(writer)
            writer.transport.abort()
            up_w.transport.abort()


def _live(url: str) -> dict[str, bool]:
    try:
        return {e["name"]: e["healthy"] for e in httpx.get(f"{url}/api/v1/engines", timeout=5).json()["engines"]}
    except httpx.HTTPError:
        return {}


def _manager(port: int = 0, **settings):
    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings
    from parrot.frontend.local import LocalServer

    defaults = dict(engine_secret=SECRET, engine_heartbeat_s=0.5, heartbeat_timeout_s=5, prefix_sharing=False,
                    engine_retry_backoff_s=0.05)
    app = create_app(ServerSettings(**{**defaults, **settings}), [])
    return app, LocalServer(app, port=port)


@pytest.fixture(scope="module")
def proxied(tmp_path_factory, default_model_path):
    """A manager (fixed port) and one engine process it reaches only through a FaultProxy (--advertise-url)."""
    port, engine_port = free_port(), free_port()
    app, server = _manager(port)
    log = open(tmp_path_factory.mktemp("faults") / "engine.log", "w")
    proxy = FaultProxy(engine_port)
    proc = EngineProcess("px", server.url, secret=SECRET, port=engine_port, heartbeat_s=0.2, output=log,
                         engine_args=[*NO_CACHE, "--advertise-url", proxy.url, "--manager-max-backoff-s", "1"])
    state = {"app": app, "server": server, "port": port}
    try:
        wait_until(lambda: _live(server.url).get("px"), 120, "the proxied engine to register")
        yield state, proxy, proc
    finally:
        proc.stop()
        state["server"].stop()
        proxy.stop()
        log.close()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_refused_connections_are_retried_with_backoff_until_the_port_opens(proxied):
    _, proxy, _ = proxied

    async def main():
        # full jitter has no lower bound: 7 retries once waited 0.45 s in all and the 0.5 s outage outlasted them
        # (CI, 2026-11-26); 15 retries wait ~3 s on average, and under 0.5 s with negligible probability
        client = HTTPEngineClient(proxy.url, "px", policy=CallPolicy(attempts=16, backoff_s=0.1, max_backoff_s=0.4))
        try:
            proxy.close()
            asyncio.get_running_loop().call_later(0.5, proxy.open)
            t0 = time.monotonic()
            status = await client.status()  # refused for 0.5 s, then answered
            took = time.monotonic() - t0
            retries = client.num_retries
            # generate is retried too while the connection is refused (the engine never saw it)
            proxy.close()
            asyncio.get_running_loop().call_later(0.5, proxy.open)
            fill = await client.fill([5, 6, 7, 8], "refused-ctx")
            result = await client.generate(GREEDY, "refused-ctx")
            await client.free_context("refused-ctx")
            return status, took, retries, client.num_retries, fill, result
        finally:
            await client.close()

    status, took, retries, total, fill, result = _run(main())
    assert status.name == "px" and 0.4 < took < 5 and retries >= 1
    assert total > retries and fill.context_len == 4 and len(result.token_ids) == 12


def test_a_port_that_stays_closed_gives_up_as_engine_unavailable(proxied):
    _, proxy, _ = proxied

    async def main():
        client = HTTPEngineClient(proxy.url, "px", policy=CallPolicy(attempts=3, backoff_s=0.05, max_backoff_s=0.1))
        proxy.close()
        try:
            with pytest.raises(EngineUnavailable, match="unreachable"):
                await client.status()
            return client.num_retries
        finally:
            proxy.open()
            await client.close()

    assert _run(main()) == 2  # three attempts in all


def test_a_fill_whose_answer_is_lost_on_a_reset_is_applied_once(proxied):
    _, proxy, proc = proxied
    tokens = list(range(10, 50))

    async def main():
        direct = HTTPEngineClient(f"http://127.0.0.1:{proc.port}", "px")
        via = HTTPEngineClient(proxy.url, "px", policy=CallPolicy(attempts=5, backoff_s=0.05))
        try:
            clean = await direct.fill(tokens, "clean-ctx")
            clean_out = await direct.generate(GREEDY, "clean-ctx")
            seen, resets = proxy.fills_seen, proxy.resets_done
            proxy.reset_fills(2)
            fill = await via.fill(tokens, "reset-ctx")  # applied by the engine, answer reset twice, then replayed
            out = await via.generate(GREEDY, "reset-ctx")
            for c, ctx in ((direct, "clean-ctx"), (via, "reset-ctx")):
                await c.free_context(ctx)
            return clean, clean_out, fill, out, proxy.fills_seen - seen, proxy.resets_done - resets, via.num_retries
        finally:
            await direct.close()
            await via.close()

    clean, clean_out, fill, out, fills_sent, resets, retries = _run(main())
    assert resets == 2 and fills_sent == 3 and retries == 2  # three sends of one fill...
    assert fill.context_len == clean.context_len == len(tokens)  # ...applied once, not three times
    assert out.token_ids == clean_out.token_ids and out.prompt_len == len(tokens)


def test_the_engine_answers_a_repeated_op_id_and_refuses_it_for_another_fill(proxied):
    _, _, proc = proxied
    url = f"http://127.0.0.1:{proc.port}/engine/v1"
    body = {"token_ids": [1, 2, 3], "context_id": "memo-ctx", "op_id": "op-0123456789"}
    with httpx.Client(timeout=30) as c:
        first, again = c.post(f"{url}/fill", json=body).json(), c.post(f"{url}/fill", json=body).json()
        other = c.post(f"{url}/fill", json={**body, "token_ids": [4, 5]})
        no_id = c.post(f"{url}/fill", json={k: v for k, v in body.items() if k != "op_id"}).json()  # appended
        c.post(f"{url}/free_context", json={"context_id": "memo-ctx"})
    assert first == again and first["context_len"] == 3
    assert other.status_code == 409 and other.json()["error"]["code"] == OpIdConflict.code
    assert no_id["context_len"] == 6


def test_an_app_through_resetting_connections_gives_the_clean_run_outputs(proxied):
    from parrot.frontend.client import connect
    from parrot.frontend.function import Output, SemanticFunction

    state, proxy, _ = proxied
    out = Output(max_tokens=16, ignore_eos=True, temperature=0.0, stop=[])
    two = SemanticFunction("A: {{input:a}}\nB: {{output:b}}\nC: {{output:c}}", name="two", defaults=out)
    then = SemanticFunction("Next {{input:x}} -> {{output:y}}", name="then", defaults=out)

    def app_run() -> list[str]:
        session = connect(state["server"].url, make_default=False)
        try:
            b, c = two("hello", session=session)
            y = then(c, session=session)
            return [v.get(timeout=60) for v in (b, c, y)]
        finally:
            session.close()

    clean = app_run()
    client = state["app"].state.manager.registry.entry("px").client
    retries, resets = client.num_retries, proxy.resets_done
    proxy.reset_fills(3)  # the first three fills of the app lose their answers after being applied
    faulty = app_run()
    stats = httpx.get(f"{state['server'].url}/api/v1/stats", timeout=5).json()["failover"]
    assert proxy.resets_done - resets == 3 and client.num_retries - retries >= 3
    assert faulty == clean and all(faulty)
    assert stats["rescheduled"] == 0  # retried on the same engine, not failed over


def test_the_engine_registers_again_when_the_manager_comes_back(proxied):
    state, _, _ = proxied
    state["server"].stop()  # the manager goes away; the engine's heartbeats fail and back off (at most 1 s)
    time.sleep(2.0)
    app, server = _manager(state["port"])
    state.update(app=app, server=server)
    t0 = time.monotonic()
    wait_until(lambda: _live(server.url).get("px"), 30, "the engine to register with the new manager")
    assert time.monotonic() - t0 < 1 + 2  # within the engine's longest backoff, plus its status and the check


# ---- a hung engine, then a killed one -------------------------------------------------------------------------
def test_hung_then_killed_engine_work_moves_with_the_same_outputs(tmp_path, default_model_path):
    from parrot.frontend.client import connect
    from parrot.frontend.function import Output, SemanticFunction

    app, server = _manager(heartbeat_timeout_s=2, engine_read_timeout_s=1, policy="least-loaded")
    log = open(tmp_path / "engines.log", "w")
    procs = [EngineProcess(f"h{i}", server.url, secret=SECRET, heartbeat_s=0.2, output=log, engine_args=NO_CACHE)
             for i in range(2)]
    session = None
    try:
        wait_until(lambda: _live(server.url) == {"h0": True, "h1": True}, 120, "two engines")
        session = connect(server.url, make_default=False)
        gen = SemanticFunction("Tell part {{input:n}}: {{output:s}}", name="tell",
                               defaults=Output(max_tokens=1500, ignore_eos=True, temperature=0.0, stop=[]))
        reference = gen("7", session=session).get(timeout=120)  # a clean run

        def running_on() -> str | None:
            reqs = [r for r in session.dag()["requests"] if r["status"] == "running" and r["engine"]]
            return reqs[-1]["engine"] if reqs else None

        figures = {}
        for fault, sig in (("hung", signal.SIGSTOP), ("killed", signal.SIGKILL)):
            v = gen("7", session=session)
            victim_name = wait_until(running_on, 30, "the step to start")
            victim = next(p for p in procs if p.name == victim_name)
            t0 = time.monotonic()
            os.kill(victim.pid, sig)
            wait_until(lambda: _live(server.url).get(victim_name) is False, 30, f"the {fault} engine to be dead")
            figures[fault] = time.monotonic() - t0
            assert v.get(timeout=120) == reference  # rerun from its head on the survivor: the same greedy output
            # its output is in; the request may still be freeing its context: wait for the status
            req = wait_until(lambda: (r := session.dag()["requests"][-1])["status"] == "finished" and r, 30,
                             "the rerun to finish")
            assert req["engine"] != victim_name
            if sig is signal.SIGSTOP:
                os.kill(victim.pid, signal.SIGCONT)  # the same process answers again: alive
                wait_until(lambda: _live(server.url).get(victim_name), 30, "the stopped engine to come back")
        # detection bound: heartbeat_timeout_s + 2 * engine_heartbeat_s + max(engine_heartbeat_s, 1 s) = 4 s
        assert figures["hung"] < 4 + 1.5, figures
        assert figures["killed"] < 2, figures  # refused connections / a broken call: dead at once
        stats = httpx.get(f"{server.url}/api/v1/stats", timeout=5).json()["failover"]
        assert stats["rescheduled"] >= 2 and stats["engine_deaths"] >= 2
        logging.getLogger(__name__).info("time to declare dead: %s", figures)  # --log-cli-level=INFO shows it
    finally:
        if session is not None:
            session.close()
        for p in procs:
            if p.alive:
                os.kill(p.pid, signal.SIGCONT)
        stop_all(procs)
        server.stop()
        log.close()


def test_op_memo_runs_an_op_once_answers_repeats_and_forgets_after_its_ttl():
    from parrot.engine.server.op_memo import OpMemo

    now = [0.0]
    memo = OpMemo(ttl_s=10, max_entries=2, clock=lambda: now[0])
    runs: list[str] = []

    async def main():
        async def work(tag: str, gate: asyncio.Event | None = None) -> str:
            runs.append(tag)
            if gate is not None:
                await gate.wait()
            return tag

        gate = asyncio.Event()
        first = asyncio.ensure_future(memo.run("op-a", "k", lambda: work("a", gate)))
        await asyncio.sleep(0)
        again = asyncio.ensure_future(memo.run("op-a", "k", lambda: work("a-again")))  # while the first runs
        first.cancel()  # the first caller goes away (its connection dropped): the op goes on for the retry
        gate.set()
        assert await again == "a" and runs == ["a"] and memo.replays == 1
        with pytest.raises(OpIdConflict):
            await memo.run("op-a", "other key", lambda: work("x"))
        now[0] += 11  # past the TTL: forgotten, a reuse of the id runs again
        assert await memo.run("op-a", "k", lambda: work("a2")) == "a2"
        for op in ("op-b", "op-c", "op-d"):  # beyond max_entries: the oldest finished ones go
            await memo.run(op, "k", lambda op=op: work(op))
        return len(memo)

    assert asyncio.run(main()) <= 3 and runs == ["a", "a2", "op-b", "op-c", "op-d"]
