"""The session journal (parrot.manager.journal) and restore (parrot.manager.restore): a manager that "crashes"
(its journal closed where it stood, no shutdown) and a new one on the same state dir continue the sessions: ready
and failed values as they were, the same token authenticating, unfinished requests run again (a half-done
multi-output request without generating its done output twice); deleted sessions leave the file; unusable state
dirs fail with a JournalError naming the problem. Fake engines (tests/fakes.py); the real-process fault test is
tests/test_manager_restart.py."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from parrot.common.errors import InvalidSessionToken, StepFailed, UnknownSession
from parrot.common.perf import PerfCriteria
from parrot.manager import EngineRegistry, Manager, ManagerConfig
from parrot.manager.graph import RequestStatus, VarStatus
from parrot.manager.journal import DB_NAME, SCHEMA_VERSION, JournalError, NullJournal, SqliteJournal, open_journal
from parrot.manager.submit import PlaceholderSpec, SubmitSpec
from fakes import FakeEngine


def _manager(state_dir, engine: FakeEngine, **config) -> Manager:
    return Manager(EngineRegistry([engine]), config=ManagerConfig(engine_heartbeat_s=0, state_dir=str(state_dir),
                                                                  **config))


def _spec(prompt: str, **var_ids: str) -> SubmitSpec:
    names = [p.split("}}")[0] for p in prompt.split("{{")[1:]]
    return SubmitSpec(prompt, [PlaceholderSpec(n.split(":")[1], n.startswith("output"), var_ids.get(n.split(":")[1]),
                                               {"max_tokens": 40, "stop": ["\n"]} if n.startswith("output") else None)
                               for n in names])


async def _wait(cond, what: str, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _crash(mgr: Manager) -> None:
    """What a SIGKILL leaves: the journal as last committed, no shutdown (no session closed, nothing freed)."""
    mgr.journal.close()
    for session in mgr.sessions.all():
        for task in session.tasks:
            task.cancel()


def test_restart_keeps_ready_and_failed_values_and_reruns_unfinished_requests(tmp_path):
    async def main():
        eng = FakeEngine()
        eng.fail_generate_when = "BROKEN"
        mgr = _manager(tmp_path, eng)
        await mgr.start()
        s = mgr.create_session(owner="acme")
        token, sid = s.token, s.session_id
        task = mgr.create_variable(s, "task", "a snake game").var_id
        code = mgr.submit(s, _spec("Write {{input:task}}. Code: {{output:code}}", task=task)).outputs[0]
        bad = mgr.submit(s, _spec("BROKEN {{input:task}}: {{output:bad}}", task=task)).outputs[0]
        later_in = mgr.create_variable(s, "later").var_id
        later = mgr.submit(s, _spec("Then {{input:later}}: {{output:out}}", later=later_in)).outputs[0]
        assert (await mgr.get_variable(s, code, criteria="latency", timeout_s=5)).status is VarStatus.READY
        with pytest.raises(StepFailed):
            await mgr.get_variable(s, bad, timeout_s=5)
        eng.gate = asyncio.Event()  # the next generation hangs: in flight at the crash
        test_req = mgr.submit(s, _spec("Test for {{input:code}}: {{output:test}}", code=code))
        await _wait(lambda: eng.generating == 1, "the in-flight generation")
        assert s.graph.request(test_req.request_id).status is RequestStatus.RUNNING
        before = s.graph.to_json()
        code_value = s.graph.variables[code].value
        _crash(mgr)

        eng2 = FakeEngine()
        mgr2 = _manager(tmp_path, eng2)
        await mgr2.start()
        s2 = mgr2.session(sid, token, "acme")  # the same id and token
        with pytest.raises(InvalidSessionToken):
            mgr2.session(sid, "not-the-token", "acme")
        with pytest.raises(UnknownSession):
            mgr2.session(sid, token, "someone-else")
        graph = s2.graph
        assert (await mgr2.get_variable(s2, code)).value == code_value
        with pytest.raises(StepFailed) as err:
            await mgr2.get_variable(s2, bad)
        assert err.value.cause_code == before["variables"][int(bad[2:]) - 1]["error"]["cause"]
        assert graph.get_perf_obj(code) is PerfCriteria.LATENCY
        # the in-flight request runs again on the new engine and gives what a clean run gives
        view = await mgr2.get_variable(s2, test_req.outputs[0], timeout_s=5)
        clean = mgr2.create_session()
        c_code = mgr2.create_variable(clean, "code", code_value).var_id
        c_test = mgr2.submit(clean, _spec("Test for {{input:code}}: {{output:test}}", code=c_code)).outputs[0]
        assert view.value == (await mgr2.get_variable(clean, c_test, timeout_s=5)).value
        assert view.value.startswith("<") and code_value in "".join(eng2.tokenized)
        # the waiting request still waits for its input, then runs
        assert graph.variables[later].status is VarStatus.PENDING
        mgr2.set_variable(s2, later_in, "ship it")
        assert (await mgr2.get_variable(s2, later, timeout_s=5)).value == FakeEngine.reply_for("Then ship it:")  # the space moves
        # everything else is as it was: same nodes, numbers, links; new ids continue the numbering
        after = graph.to_json()
        assert [(v["var_id"], v["name"], v["producer"], v["consumers"]) for v in after["variables"]] == \
            [(v["var_id"], v["name"], v["producer"], v["consumers"]) for v in before["variables"]]
        assert [r["status"] for r in after["requests"]] == ["finished", "failed", "finished", "finished"]
        assert mgr2.create_variable(s2, "more").var_id == f"v_{len(before['variables']) + 1}"
        await mgr2.stop()

    asyncio.run(main())


class GatedSecondOutput(FakeEngine):
    """Generation hangs once the context holds ``marker`` (the second output of a template) while ``hold`` is set."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker, self.hold, self.generated = marker, asyncio.Event(), []

    async def generate_stream(self, sampling, context_id, parent_context_id=None, *, hint=None):
        text = self.decode(self.contexts.get(context_id, []))
        self.generated.append(text)
        if self.marker in text and not self.hold.is_set():
            await asyncio.Event().wait()  # hangs until cancelled (the crash)
        async for chunk in super().generate_stream(sampling, context_id, parent_context_id, hint=hint):
            yield chunk


def test_a_half_done_multi_output_request_replays_its_done_output(tmp_path):
    async def main():
        eng = GatedSecondOutput(" B:")
        mgr = _manager(tmp_path, eng)
        await mgr.start()
        s = mgr.create_session()
        req = mgr.submit(s, SubmitSpec("A:{{output:a}} B:{{output:b}}", [
            PlaceholderSpec("a", True, sampling={"max_tokens": 40, "stop": ["\n"]},
                            transforms=({"op": "lower"},)),
            PlaceholderSpec("b", True, sampling={"max_tokens": 40, "stop": ["\n"]})]))
        a, b = req.outputs
        assert (await mgr.get_variable(s, a, timeout_s=5)).value == FakeEngine.reply_for("A:").lower()
        await _wait(lambda: len(eng.generated) == 2, "the second output's generation")
        token = s.token
        _crash(mgr)

        eng2 = FakeEngine()
        mgr2 = _manager(tmp_path, eng2)
        await mgr2.start()
        s2 = mgr2.session(s.session_id, token)
        value_b = (await mgr2.get_variable(s2, b, timeout_s=5)).value
        # a is filled back from its raw text (not lower-cased, not generated again): one generation only
        assert [c[0] for c in eng2.calls].count("generate") == 1
        assert value_b == FakeEngine.reply_for(f"A:{FakeEngine.reply_for('A:')} B:")  # raw a, lower case
        assert s2.graph.variables[a].value == FakeEngine.reply_for("A:").lower()
        await mgr2.stop()

    asyncio.run(main())


def test_stop_keeps_pending_work_for_the_next_start_and_delete_forgets_the_session(tmp_path):
    async def main():
        mgr = _manager(tmp_path, FakeEngine())
        await mgr.start()
        keep, gone = mgr.create_session(), mgr.create_session()
        free = mgr.create_variable(keep, "x").var_id
        out = mgr.submit(keep, _spec("{{input:x}} => {{output:y}}", x=free)).outputs[0]
        mgr.create_variable(gone, "big", "z" * 2_000_000)
        await mgr.delete_session(gone)
        await mgr.stop()  # a clean shutdown fails pending variables in memory, not in the journal

        mgr2 = _manager(tmp_path, FakeEngine())
        await mgr2.start()
        assert [s.session_id for s in mgr2.sessions.all()] == [keep.session_id]
        s2 = mgr2.session(keep.session_id, keep.token)
        mgr2.set_variable(s2, free, "go")
        assert (await mgr2.get_variable(s2, out, timeout_s=5)).value == FakeEngine.reply_for("go =>")
        await mgr2.stop()
        journal = SqliteJournal(tmp_path)
        assert journal.size_bytes() < 1_000_000  # the deleted session's 2 MB value left the file
        journal.close()

    asyncio.run(main())


def test_expired_sessions_leave_the_journal(tmp_path):
    now = [1000.0]

    async def main():
        mgr = Manager(EngineRegistry([FakeEngine()]), clock=lambda: now[0],
                      config=ManagerConfig(engine_heartbeat_s=0, state_dir=str(tmp_path)))
        await mgr.start()
        mgr.create_session(ttl_s=10)
        now[0] += 11
        assert await mgr.expire_sessions() == 1
        await mgr.stop()
        journal = SqliteJournal(tmp_path)
        assert journal.load() == []
        journal.close()

    asyncio.run(main())


def test_writes_in_one_loop_iteration_share_one_commit(tmp_path):
    async def main():
        mgr = _manager(tmp_path, FakeEngine())
        s = mgr.create_session()
        for i in range(50):
            mgr.create_variable(s, f"v{i}", str(i))
        reader = sqlite3.connect(tmp_path / DB_NAME, timeout=0)
        with pytest.raises(sqlite3.OperationalError, match="locked"):  # one writer: the file is held
            reader.execute("SELECT count(*) FROM variables").fetchone()
        reader.close()
        assert mgr.journal._in_txn  # the batch is open until the loop turns
        await asyncio.sleep(0)
        assert not mgr.journal._in_txn
        mgr.journal.close()
        assert len(SqliteJournal(tmp_path).load()[0].variables) == 50

    asyncio.run(main())


def test_unusable_state_dirs_fail_with_a_clear_error(tmp_path):
    assert isinstance(open_journal(None), NullJournal) and open_journal(None).load() == []
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / DB_NAME).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(JournalError, match="not a readable Parrot journal"):
        open_journal(garbage)
    other = tmp_path / "other"
    other.mkdir()
    sqlite3.connect(other / DB_NAME).execute("CREATE TABLE t (x)").connection.commit()
    with pytest.raises(JournalError, match="not a Parrot journal"):
        open_journal(other)
    old = tmp_path / "old"
    open_journal(old).close()
    db = sqlite3.connect(old / DB_NAME)
    db.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    db.commit()
    db.close()
    with pytest.raises(JournalError, match=f"version 999; this Parrot reads version {SCHEMA_VERSION}"):
        open_journal(old)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(JournalError, match="cannot create|not a directory"):
        open_journal(afile)
    held = open_journal(tmp_path / "held")
    with pytest.raises(JournalError, match="in use by another Parrot manager"):
        open_journal(tmp_path / "held")
    held.close()
    open_journal(tmp_path / "held").close()  # free again once the holder closed it


def test_tokens_are_never_stored_in_clear(tmp_path):
    mgr = _manager(tmp_path, FakeEngine())
    s = mgr.create_session()
    mgr.journal.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    assert s.token.encode() not in raw and s.session_id.encode() in raw


def test_restored_requests_wait_for_a_first_engine_then_fail_after_restore_wait_s(tmp_path):
    async def main():
        eng = FakeEngine()
        eng.gate = asyncio.Event()
        mgr = _manager(tmp_path, eng)
        await mgr.start()
        s = mgr.create_session()
        out = mgr.submit(s, _spec("Hello {{output:y}}")).outputs[0]
        await _wait(lambda: eng.generating == 1, "the in-flight generation")
        _crash(mgr)

        # a manager whose engines register over HTTP: none is live at start
        mgr2 = Manager(EngineRegistry([]), config=ManagerConfig(engine_heartbeat_s=0, state_dir=str(tmp_path)))
        await mgr2.start()
        s2 = mgr2.session(s.session_id, s.token)
        await asyncio.sleep(0.1)
        assert s2.graph.variables[out].status is VarStatus.PENDING  # held, not failed for want of an engine
        late = FakeEngine("late")
        await mgr2.registry.probe(mgr2.registry.register(late))  # it registers and comes alive
        assert (await mgr2.get_variable(s2, out, timeout_s=5)).value == FakeEngine.reply_for("Hello")
        mgr2.journal.close()

        # nobody registers within restore_wait_s: the request fails like any request without an engine
        mgr3 = Manager(EngineRegistry([]), config=ManagerConfig(engine_heartbeat_s=0, state_dir=str(tmp_path / "b"),
                                                                 restore_wait_s=0.2))
        s3 = mgr3.create_session()
        out3 = mgr3.sessions.all()[0].graph.add_request(None, *_bindings("Hi {{output:z}}")).outputs[0]
        mgr3.journal.close()
        mgr4 = Manager(EngineRegistry([]), config=ManagerConfig(engine_heartbeat_s=0, state_dir=str(tmp_path / "b"),
                                                                 restore_wait_s=0.2))
        await mgr4.start()
        with pytest.raises(StepFailed) as err:
            await mgr4.get_variable(mgr4.session(s3.session_id, s3.token), out3, timeout_s=5)
        assert err.value.cause_code == "not_ready"  # an EngineUnavailable: no engine has registered at all
        await mgr4.stop()

    asyncio.run(main())


def _bindings(prompt: str):
    from parrot.manager.submit import build_bindings

    return build_bindings(_spec(prompt))


def test_a_failing_journal_write_is_counted_and_never_breaks_the_dag(tmp_path, caplog):
    async def main():
        mgr = _manager(tmp_path, FakeEngine())
        await mgr.start()
        s = mgr.create_session()
        x = mgr.create_variable(s, "x").var_id
        out = mgr.submit(s, _spec("{{input:x}} => {{output:y}}", x=x)).outputs[0]
        await asyncio.sleep(0)  # committed
        mgr.journal._db.execute("PRAGMA query_only=ON")  # every write fails from now on, like a full disk
        mgr.set_variable(s, x, "go")
        assert (await mgr.get_variable(s, out, timeout_s=5)).value == FakeEngine.reply_for("go =>")
        assert mgr.journal.failed_writes >= 2
        await mgr.stop()

    asyncio.run(main())
    assert "write failed" in caplog.text
