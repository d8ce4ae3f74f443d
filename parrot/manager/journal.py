"""The session journal: sessions, variables, the DAG and produced values, kept in an embedded SQLite database
under ``--state-dir`` so that a manager restarted after a crash continues every app (:mod:`parrot.manager.restore`).

Who writes what (the graph and the session store call the hooks; nothing else writes)::

    sessions   (session_id, owner, token_sha256, ttl_s, created_at)        <- SessionStore.create / delete, expiry
    variables  (session_id, var_id, number, name, status, value, raw,      <- Graph.add_variable, materialize,
                error, perf, perf_at, origin, client_tool)                     fail_variable, set_perf_obj;
                                                                               raw: an output's text before transforms
    requests   (session_id, request_id, number, spec, status, error)       <- Graph.add_request, set_status
    flows      (session_id, flow_id, number, body, outputs, status)        <- FlowService.submit, a flow's end
    meta       (key, value): schema_version

Schema version 2 added ``flows`` and the variables' ``origin`` / ``client_tool`` (parrot.manager.flows); a version 1
journal is migrated in place when opened (the columns and table are added; nothing is rewritten).

Invariants:

* A session token is never stored: only its SHA-256 (tokens are 256-bit random, so an unsalted digest cannot be
  reversed); a restored session authenticates the client's token against the digest.
* ``spec`` is the submitted request as JSON (name, models, template segments, bindings with their sampling and
  transforms): enough to rebuild the :class:`~parrot.manager.graph.RequestNode`.
* Only final request statuses (finished, failed) are written. waiting / ready / running are not durable: after a
  restart such a request runs again from its head (its engine contexts are gone); outputs it had materialized stay
  (their raw text is filled back, as after an engine failover).
* A deleted or expired session's rows are deleted, so the file holds live sessions only. Freed pages are reused
  by new rows and returned to the file system at open and close (``auto_vacuum=INCREMENTAL`` +
  ``incremental_vacuum``); the write-ahead log is truncated to ``journal_size_limit`` after each checkpoint. So the
  files stay about as large as the largest set of live sessions' values since the last start.
* One writer: the file is opened in ``locking_mode=EXCLUSIVE``; a second manager on the same directory fails at
  open. A killed process's lock dies with it.

Durability and cost: WAL with ``synchronous=NORMAL`` (a commit is an append to the log, no fsync; a process crash
loses nothing that was committed, a power cut may lose the last commits). Writes run on the event loop and go
into one transaction per loop iteration, committed by a callback scheduled on the loop (``call_soon``), so a burst
of DAG events costs one commit; outside an event loop each write commits at once. The measured cost per call is
in docs/results/operations.md (parrot.bench.journal_bench).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parrot.manager.graph import RequestNode, Variable
    from parrot.manager.session import SessionState

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2
DB_NAME = "parrot-journal.sqlite3"
WAL_SIZE_LIMIT = 64 * 1024 * 1024  # bytes the write-ahead log is truncated to after a checkpoint

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE sessions (
    session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, token_sha256 BLOB NOT NULL, ttl_s REAL NOT NULL,
    created_at REAL NOT NULL);
CREATE TABLE variables (
    session_id TEXT NOT NULL REFERENCES sessions(session_id) ON DELETE CASCADE, var_id TEXT NOT NULL,
    number INTEGER NOT NULL, name TEXT, status TEXT NOT NULL, value TEXT, raw TEXT, error TEXT, perf TEXT,
    perf_at REAL, origin TEXT, client_tool INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (session_id, var_id));
CREATE TABLE requests (
    session_id TEXT NOT NULL REFERENCES sessions(session_id) ON DELETE CASCADE, request_id TEXT NOT NULL,
    number INTEGER NOT NULL, spec TEXT NOT NULL, status TEXT NOT NULL, error TEXT,
    PRIMARY KEY (session_id, request_id));
"""
_FLOWS_TABLE = """CREATE TABLE flows (
    session_id TEXT NOT NULL REFERENCES sessions(session_id) ON DELETE CASCADE, flow_id TEXT NOT NULL,
    number INTEGER NOT NULL, body TEXT NOT NULL, outputs TEXT NOT NULL, status TEXT NOT NULL,
    PRIMARY KEY (session_id, flow_id))"""
_SCHEMA += _FLOWS_TABLE + ";"
# version 1 -> 2, statement by statement (inside the opening transaction)
_MIGRATE_1_TO_2 = (
    "ALTER TABLE variables ADD COLUMN origin TEXT",
    "ALTER TABLE variables ADD COLUMN client_tool INTEGER NOT NULL DEFAULT 0",
    _FLOWS_TABLE,
)


class JournalError(RuntimeError):
    """The state directory cannot be used: not a directory, not writable, not a Parrot journal, a schema this
    version cannot read, or held by another manager. Raised at start, with the path in the message."""


# ---- what a journal gives back at start -------------------------------------------------------------------------
@dataclass(frozen=True)
class ErrorRecord:
    code: str  # the StepFailed's cause code
    message: str


@dataclass(frozen=True)
class VariableRecord:
    var_id: str
    number: int
    name: str | None
    status: str  # a VarStatus value
    value: str | None
    raw: str | None  # a generated output's text before its transforms (None: set by the client, or not generated)
    error: ErrorRecord | None
    perf: str | None  # a PerfCriteria value recorded by a GET
    perf_at: float | None
    origin: str | None = None  # the flow step that made it
    client_tool: bool = False


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    number: int
    spec: dict  # see request_spec()
    status: str  # a RequestStatus value; only finished / failed are journaled, anything else reads "waiting"
    error: ErrorRecord | None


@dataclass(frozen=True)
class FlowRecord:
    flow_id: str
    number: int
    body: dict  # the declaration as submitted
    outputs: dict[str, str]  # exported name -> var id
    status: str  # a FlowStatus value


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    owner: str
    token_sha256: bytes
    ttl_s: float
    created_at: float
    variables: tuple[VariableRecord, ...]  # in number order
    requests: tuple[RequestRecord, ...]  # in number order
    flows: tuple[FlowRecord, ...] = ()  # in number order


# ---- the interface ---------------------------------------------------------------------------------------------
class Journal(ABC):
    """Records what a restarted manager needs to continue its sessions. Every hook is called from the event loop
    by the one owner of that state (SessionStore, Graph, GraphExecutor) right after the change it records; hooks
    never raise for a session or node the journal no longer holds (a deleted session's late events are dropped)."""

    @abstractmethod
    def session_created(self, session: SessionState) -> None: ...

    @abstractmethod
    def session_deleted(self, session_id: str) -> None:
        """The session was deleted or expired: forget it and everything in it."""

    @abstractmethod
    def variable_added(self, session_id: str, var: Variable) -> None: ...

    @abstractmethod
    def variable_done(self, session_id: str, var: Variable) -> None:
        """``var`` became READY (with its value) or FAILED (with its error)."""

    @abstractmethod
    def output_text(self, session_id: str, var_id: str, raw: str) -> None:
        """The generated text of output ``var_id`` before its transforms (replayed if its request runs again)."""

    @abstractmethod
    def perf_recorded(self, session_id: str, var: Variable) -> None:
        """A GET recorded (or tightened) the perf criterion of ``var``."""

    @abstractmethod
    def request_added(self, session_id: str, req: RequestNode) -> None: ...

    @abstractmethod
    def request_status(self, session_id: str, req: RequestNode) -> None:
        """``req`` changed status (journals keep final ones only: see the module docstring)."""

    @abstractmethod
    def flow_added(self, session_id: str, flow: FlowRecord) -> None: ...

    @abstractmethod
    def flow_status(self, session_id: str, flow_id: str, status: str) -> None: ...

    @abstractmethod
    def load(self) -> list[SessionRecord]:
        """Every journaled session, as the last committed writes left it (oldest first)."""

    @abstractmethod
    def close(self) -> None:
        """Commit and close. Hooks called afterwards record nothing: stopping the manager fails its pending
        variables in memory ("session closed"), which must not reach the journal, where they resume."""


class NullJournal(Journal):
    """The journal of a manager without ``--state-dir``: nothing is durable, so every hook records nothing by
    design and :meth:`load` finds no session. A restart starts empty, as before journals existed."""

    def session_created(self, session: SessionState) -> None:
        return None

    def session_deleted(self, session_id: str) -> None:
        return None

    def variable_added(self, session_id: str, var: Variable) -> None:
        return None

    def variable_done(self, session_id: str, var: Variable) -> None:
        return None

    def output_text(self, session_id: str, var_id: str, raw: str) -> None:
        return None

    def perf_recorded(self, session_id: str, var: Variable) -> None:
        return None

    def request_added(self, session_id: str, req: RequestNode) -> None:
        return None

    def request_status(self, session_id: str, req: RequestNode) -> None:
        return None

    def flow_added(self, session_id: str, flow: FlowRecord) -> None:
        return None

    def flow_status(self, session_id: str, flow_id: str, status: str) -> None:
        return None

    def load(self) -> list[SessionRecord]:
        return []

    def close(self) -> None:
        return None


# ---- encoding ----------------------------------------------------------------------------------------------------
def request_spec(req: RequestNode) -> dict:
    """The JSON form of a submitted request: what :func:`parrot.manager.restore.rebuild_request` reads back."""
    from parrot.common.template import TextSegment

    return {
        "name": req.name,
        "models": list(req.models),
        "submitted": req.times.submitted,
        "origin": req.origin,
        "segments": [{"text": s.text} if isinstance(s, TextSegment) else {"name": s.name, "is_output": s.is_output}
                     for s in req.segments],
        "bindings": [{"name": b.name, "is_output": b.is_output, "var_id": b.var_id,
                      "sampling": b.sampling.to_dict() if b.sampling is not None else None,
                      "transforms": [t.to_spec() for t in b.transforms]} for b in req.bindings.values()],
    }


def _error_json(err) -> str | None:
    return None if err is None else json.dumps({"code": err.cause_code, "message": err.message})


def _error_record(text: str | None) -> ErrorRecord | None:
    if text is None:
        return None
    d = json.loads(text)
    return ErrorRecord(d["code"], d["message"])


# ---- SQLite ------------------------------------------------------------------------------------------------------
class SqliteJournal(Journal):
    """The journal in ``<state_dir>/parrot-journal.sqlite3`` (see the module docstring for the schema and the
    durability it gives). Used from one thread, the event loop's."""

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / DB_NAME
        self._open_dir(Path(state_dir))
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        try:
            # autocommit mode: transactions are begun explicitly (one per loop iteration); timeout 0: a held lock
            # is another manager, fail now instead of waiting
            self._db = sqlite3.connect(self.path, isolation_level=None, timeout=0, check_same_thread=False)
        except sqlite3.Error as e:
            raise JournalError(f"cannot open the journal {self.path}: {e}") from e
        try:
            self._setup(fresh)
        except sqlite3.OperationalError as e:
            self._db.close()
            if "locked" in str(e):
                raise JournalError(f"the journal {self.path} is in use by another Parrot manager (one writer per "
                                   "--state-dir)") from e
            raise JournalError(f"cannot use the journal {self.path}: {e}") from e
        except sqlite3.DatabaseError as e:
            self._db.close()
            raise JournalError(f"{self.path} is not a readable Parrot journal ({e}); move it away to start "
                               "empty, or point --state-dir elsewhere") from e
        self._in_txn = False
        self._commit_scheduled = False
        self._closed = False
        self.failed_writes = 0  # writes and commits that failed (logged): the journal is behind by these

    @staticmethod
    def _open_dir(state_dir: Path) -> None:
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JournalError(f"--state-dir {state_dir}: cannot create it: {e}") from e
        if not state_dir.is_dir():
            raise JournalError(f"--state-dir {state_dir} is not a directory")

    def _setup(self, fresh: bool) -> None:
        db = self._db
        db.execute("PRAGMA locking_mode=EXCLUSIVE")
        if fresh:
            db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # only takes effect before the first table
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise JournalError(f"{self.path}: SQLite refused WAL mode (got {mode!r})")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
        db.execute("BEGIN IMMEDIATE")  # takes the exclusive lock now: a second manager fails here
        try:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not tables:
                for statement in _SCHEMA.split(";"):  # not executescript: it would commit the open transaction
                    if statement.strip():
                        db.execute(statement)
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif "meta" not in tables:
                raise JournalError(f"{self.path} is an SQLite database but not a Parrot journal (no meta table)")
            else:
                row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
                if row is not None and row[0] == "1":
                    for statement in _MIGRATE_1_TO_2:
                        db.execute(statement)
                    db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
                    logger.info("journal %s: migrated from schema 1 to %d", self.path, SCHEMA_VERSION)
                    row = (str(SCHEMA_VERSION),)
                if row is None or row[0] != str(SCHEMA_VERSION):
                    raise JournalError(f"{self.path} has journal schema version {row[0] if row else None}; this "
                                       f"Parrot reads version {SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.executescript("PRAGMA incremental_vacuum;")  # no transaction is open here

    # ---- writing -----------------------------------------------------------------------------------------------
    def _write(self, sql: str, params: tuple) -> None:
        """One write into this iteration's transaction. A failing write (disk full, I/O error) is logged and
        counted, never raised: the hooks run inside graph transitions, which must complete (a raise there could
        leave a dependent GET waiting); the journal is then behind, and says so."""
        if self._closed:
            return
        try:
            if not self._in_txn:
                self._db.execute("BEGIN")
                self._in_txn = True
            self._db.execute(sql, params)
        except sqlite3.Error:
            self.failed_writes += 1
            logger.exception("journal %s: write failed (%d so far); this change is not durable", self.path,
                             self.failed_writes)
            return
        if self._commit_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._commit()  # no event loop (a script, a unit test): commit each write
            return
        self._commit_scheduled = True
        loop.call_soon(self._commit)

    def _commit(self) -> None:
        self._commit_scheduled = False
        if not self._in_txn or self._closed:
            return
        self._in_txn = False
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error:  # e.g. the disk is full: the batch is lost; say so loudly, keep serving
            self.failed_writes += 1
            logger.exception("journal %s: commit failed; this batch of DAG events is not durable", self.path)
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")

    def session_created(self, session: SessionState) -> None:
        self._write("INSERT INTO sessions VALUES (?, ?, ?, ?, ?)", (
            session.session_id, session.owner, session.token_digest, session.ttl_s, session.created_at))

    def session_deleted(self, session_id: str) -> None:
        self._write("DELETE FROM sessions WHERE session_id = ?", (session_id,))  # cascades to its nodes

    def variable_added(self, session_id: str, var: Variable) -> None:
        self._write("INSERT OR IGNORE INTO variables (session_id, var_id, number, name, status, origin, client_tool) "
                    "SELECT ?, ?, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM sessions WHERE session_id = ?)",
                    (session_id, var.var_id, var.number, var.name, var.status.value, var.origin, int(var.client_tool),
                     session_id))

    def variable_done(self, session_id: str, var: Variable) -> None:
        self._write("UPDATE variables SET status = ?, value = ?, error = ? WHERE session_id = ? AND var_id = ?",
                    (var.status.value, var.value, _error_json(var.error), session_id, var.var_id))

    def output_text(self, session_id: str, var_id: str, raw: str) -> None:
        self._write("UPDATE variables SET raw = ? WHERE session_id = ? AND var_id = ?", (raw, session_id, var_id))

    def perf_recorded(self, session_id: str, var: Variable) -> None:
        if var.perf is None:
            return
        self._write("UPDATE variables SET perf = ?, perf_at = ? WHERE session_id = ? AND var_id = ?",
                    (var.perf.criteria.value, var.perf.recorded_at, session_id, var.var_id))

    def request_added(self, session_id: str, req: RequestNode) -> None:
        self._write("INSERT OR IGNORE INTO requests (session_id, request_id, number, spec, status) "
                    "SELECT ?, ?, ?, ?, 'waiting' WHERE EXISTS (SELECT 1 FROM sessions WHERE session_id = ?)",
                    (session_id, req.request_id, req.number, json.dumps(request_spec(req)), session_id))

    def request_status(self, session_id: str, req: RequestNode) -> None:
        if req.status.value not in ("finished", "failed"):
            return  # not durable: the request runs again after a restart
        self._write("UPDATE requests SET status = ?, error = ? WHERE session_id = ? AND request_id = ?",
                    (req.status.value, _error_json(req.error), session_id, req.request_id))

    def flow_added(self, session_id: str, flow: FlowRecord) -> None:
        self._write("INSERT OR IGNORE INTO flows (session_id, flow_id, number, body, outputs, status) "
                    "SELECT ?, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM sessions WHERE session_id = ?)",
                    (session_id, flow.flow_id, flow.number, json.dumps(flow.body), json.dumps(flow.outputs),
                     flow.status, session_id))

    def flow_status(self, session_id: str, flow_id: str, status: str) -> None:
        self._write("UPDATE flows SET status = ? WHERE session_id = ? AND flow_id = ?", (status, session_id, flow_id))

    # ---- reading -----------------------------------------------------------------------------------------------
    def load(self) -> list[SessionRecord]:
        self._commit()
        db = self._db
        variables: dict[str, list[VariableRecord]] = {}
        for r in db.execute("SELECT session_id, var_id, number, name, status, value, raw, error, perf, perf_at, "
                            "origin, client_tool FROM variables ORDER BY session_id, number"):
            variables.setdefault(r[0], []).append(VariableRecord(r[1], r[2], r[3], r[4], r[5], r[6],
                                                                 _error_record(r[7]), r[8], r[9], r[10], bool(r[11])))
        flows: dict[str, list[FlowRecord]] = {}
        for r in db.execute("SELECT session_id, flow_id, number, body, outputs, status FROM flows "
                            "ORDER BY session_id, number"):
            flows.setdefault(r[0], []).append(FlowRecord(r[1], r[2], json.loads(r[3]), json.loads(r[4]), r[5]))
        requests: dict[str, list[RequestRecord]] = {}
        for r in db.execute("SELECT session_id, request_id, number, spec, status, error FROM requests "
                            "ORDER BY session_id, number"):
            requests.setdefault(r[0], []).append(RequestRecord(r[1], r[2], json.loads(r[3]), r[4],
                                                               _error_record(r[5])))
        return [SessionRecord(sid, owner, bytes(digest), ttl, created, tuple(variables.get(sid, ())),
                              tuple(requests.get(sid, ())), tuple(flows.get(sid, ())))
                for sid, owner, digest, ttl, created in db.execute(
                    "SELECT session_id, owner, token_sha256, ttl_s, created_at FROM sessions ORDER BY created_at")]

    def size_bytes(self) -> int:
        """The database plus its write-ahead log, in bytes."""
        wal = self.path.with_name(self.path.name + "-wal")
        return self.path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)

    def close(self) -> None:
        if self._closed:
            return
        self._commit()
        self._closed = True
        try:
            self._db.executescript("PRAGMA incremental_vacuum;")  # stepped to the end (execute frees one page)
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as e:  # the data is committed; only the tidying failed (e.g. a read-only file)
            logger.warning("journal %s: could not compact at close: %s", self.path, e)
        finally:
            self._db.close()


def open_journal(state_dir: str | Path | None) -> Journal:
    """The journal for ``--state-dir`` (a :class:`NullJournal` when unset). Raises JournalError."""
    if state_dir is None:
        return NullJournal()
    journal = SqliteJournal(state_dir)
    logger.info("journal %s (schema %d)", journal.path, SCHEMA_VERSION)
    return journal
