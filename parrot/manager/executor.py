"""The graph executor (paper §5.1): runs a request the moment its inputs are materialized; values move
server-side; failures propagate to every dependent.

Event-driven, no polling: materializing or failing a variable walks its consumers (a worklist, so deep chains
do not recurse) and starts each request whose inputs are now all READY as an asyncio task, or fails each one
with a FAILED input. A request runs in one fresh engine context (tokens per template piece)::

    | BOS? | text | input value | text | <gen out1> | text | <gen out2> |
           ^boundary            ^boundary           ^boundary            (PrefixHash positions)

fill everything before an output, generate the output (its tokens join the context), materialize it (so its
consumers start right away, even before the request's later outputs), continue; free the context at the end.
An unconstrained output is generated through the engine's stream, its pieces appended to the variable's
:class:`~parrot.manager.value_stream.ValueStream` as they arrive (readers of ``GET .../stream`` follow it).
With prefix sharing (:mod:`parrot.manager.prefix_sharing`) the context is instead created as a fork of a
prefix context holding the pieces up to a boundary, and the first fill carries only the pieces after it.

Failover (:class:`~parrot.manager.failover.Failover`, the loop the completion service uses too): if the engine
becomes unreachable (a call raises EngineUnavailable) or is declared dead while the request runs (its lease is
lost), the request is rescheduled: it restarts from its head on another engine, up to ``max_attempts`` runs in
all. Outputs it already materialized stay: their generated text is filled back instead of generated again, so
every consumer sees one value per variable. A request that loses its engine after materializing every output
(while freeing its context) is finished, not rescheduled.

Tool calls (LAMPS; :mod:`parrot.manager.tool_context`). Every generate carries an ``OpHint`` with its predicted
output length; one whose output is read by a tool-produced variable (``graph.ToolDecl``) also names the tool and
its predicted duration. When such a request finishes, its context is handed to ``engine.pause_context`` instead
of being freed (the engine owns it from then on). The follow-up request's prompt continues it::

    S1 context:  | prompt of S1 | generated out1 (token ids g) |              paused while the tool runs
    S2 prompt:   | prompt of S1 | out1 as an input: the ids g   | tool result | ...   -> prefix match on S1's KV

An input whose text is exactly what a generate wrote for it is filled as that generate's token ids
(``graph.GeneratedTokens``), not retokenized, so S2's tokens equal S1's context token for token. When the client
sets the tool's output, the time since its inputs were ready is the tool's observed duration.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable

from parrot.common.errors import (ConstraintIncomplete, EngineUnavailable, LimitExceeded, ParrotError, StepFailed,
                                  UnknownContext, UnknownSession)
from parrot.common.log_context import set_log_context
from parrot.common.perf import PerfCriteria
from parrot.common.sampling import FinishReason
from parrot.common.template import TextSegment
from parrot.common.transforms import apply_transforms
from parrot.protocol.interface import EngineClient, FillResult, ModelInfo, OpHint, ToolHint
from parrot.manager.dispatcher import Dispatcher, DispatchRequest, Lease
from parrot.manager.failover import Failover, Loss, OrphanContexts
from parrot.manager.graph import GeneratedTokens, PlaceholderBinding, RequestNode, RequestStatus, Variable, VarStatus
from parrot.manager.metrics import CancelReason, ManagerMetrics
from parrot.manager.prefix_sharing import Boundary, Fork, PrefixSharing, PromptHead
from parrot.manager.prefix_store import ContextRef, PrefixHasher, PrefixStore
from parrot.manager.recent import RecentRequests
from parrot.manager.session import SessionState
from parrot.manager.tool_context import DagTools, pause_context
from parrot.manager.tool_predict import Predictors
from parrot.manager.value_stream import OutputSink, generate_streamed

logger = logging.getLogger(__name__)

CLOSE_WAIT_S = 10.0  # how long closing a session waits for its cancelled tasks to finish their cleanup


class GraphExecutor:
    def __init__(self, dispatcher: Dispatcher, prefix_store: PrefixStore, *, sharing: PrefixSharing | None = None,
                 on_activity: Callable[[SessionState], None] | None = None, clock: Callable[[], float] = time.time,
                 max_attempts: int = 3, recent: RecentRequests | None = None, stream_outputs: bool = True,
                 metrics: ManagerMetrics | None = None, predictors: Predictors | None = None):
        """``stream_outputs``: generate unconstrained outputs through the engine's stream, so readers of a variable
        get its pieces while it is generated (:mod:`parrot.manager.value_stream`); False: one piece when done.
        ``predictors``: output-length and tool-duration predictors (the manager's, shared with the OpenAI path)."""
        self.failover = Failover(dispatcher, max_attempts=max_attempts)  # raises ValueError for max_attempts < 1
        self.dispatcher = dispatcher
        self.prefix_store = prefix_store
        self.sharing = sharing  # None or disabled: every request fills its whole prompt
        self._on_activity = on_activity or (lambda session: None)
        self._clock = clock
        self.stream_outputs = stream_outputs
        self.recent = recent or RecentRequests(clock=clock)  # every run request, when it ends (the web view's feed)
        self.metrics = metrics or ManagerMetrics()  # requests by status, TTFT / TPOT / end-to-end (GET /metrics)
        self.predictors = predictors or Predictors()
        self.tools = DagTools(self.predictors, clock=clock)
        # request key -> {output var id: raw generated text} of outputs materialized by an earlier run
        self._generated: dict[str, dict[str, str]] = {}
        self._orphans = OrphanContexts(dispatcher.registry)  # contexts left on engines while they were dead

    @property
    def num_rescheduled(self) -> int:
        """Runs restarted on another engine after an engine failure."""
        return self.failover.num_restarts

    # ---- entry points ---------------------------------------------------------------------------------------
    def submitted(self, session: SessionState, req: RequestNode, *, generated: dict[str, str] | None = None) -> None:
        """A request was added to the graph: queue its known prefix hashes and start it if it is ready.
        ``generated``: {output var id: raw text} of outputs an earlier run materialized (a request restored from
        the journal, parrot.manager.restore): they are filled back, not generated again, as after a failover."""
        if generated:
            self._generated[_key(session, req)] = dict(generated)
        self.prefix_store.add_queued(_key(session, req), self._known_boundaries(session, req))
        self._advance(session, [req.request_id])

    def set_value(self, session: SessionState, var_id: str, value: str) -> Variable:
        """A client PUT: materialize a free variable and start what waited for it."""
        graph = session.graph
        var = graph.check_settable(var_id)
        graph.reserve_text(value, "the value")
        self.tools.tool_done(graph, var, self._clock())  # a tool's output: its duration is learned
        return self._materialize(session, var_id, value)

    async def close_session(self, session: SessionState, reason: CancelReason) -> None:
        """Cancel the session's requests, fail its pending variables (waiting gets wake up with a StepFailed
        whose cause is ``unknown_session``) and free every engine context it still holds. The requests that had
        not ended are counted as cancelled for ``reason``."""
        session.closed = True
        unfinished = sum(1 for r in session.graph.requests.values()
                         if r.status not in (RequestStatus.FINISHED, RequestStatus.FAILED))
        self.metrics.cancelled("parrot", reason, unfinished)
        tasks = list(session.tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
        graph = session.graph
        for req in graph.requests.values():
            self.prefix_store.remove_queued(_key(session, req))
            if req.status not in (RequestStatus.FINISHED, RequestStatus.FAILED):
                req.error = StepFailed(f"request {req.request_id} {req.label} cancelled: session "
                                       f"{session.session_id!r} was closed", cause_code=UnknownSession.code)
                graph.set_status(req, RequestStatus.FAILED)
        for var in graph.variables.values():
            graph.fail_variable(var.var_id, StepFailed(
                f"variable {var.var_id!r} was never produced: session {session.session_id!r} was closed",
                cause_code=UnknownSession.code))
        for ctx in list(session.contexts):
            await self._free(session, ctx)
        await self.tools.release_session(session.session_id, self._orphans)
        if self.sharing is not None:
            await self.sharing.close_session(session.session_id)

    async def cancel_request(self, session: SessionState, req: RequestNode, err: StepFailed) -> bool:
        """Stop one request (a speculated flow step that was not taken): its task is cancelled, which frees its
        context (the engine drops its op within an iteration), then it and its pending outputs fail with ``err``
        (their consumers with it). False if it had already ended."""
        if req.status in (RequestStatus.FINISHED, RequestStatus.FAILED):
            return False
        task = session.request_tasks.get(req.request_id)
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=CLOSE_WAIT_S)
        if req.status in (RequestStatus.FINISHED, RequestStatus.FAILED):
            return False
        self.prefix_store.remove_queued(_key(session, req))
        self._fail(session, req, err)
        return True

    def fail_free_variable(self, session: SessionState, var_id: str, err: StepFailed) -> None:
        """Fail a pending variable without a producer (a flow's text / tool / exported value) and what reads it."""
        if session.graph.fail_variable(var_id, err):
            self._advance(session, session.graph.variables[var_id].consumers)

    def materialize_free(self, session: SessionState, var_id: str, value: str, *,
                         generated: GeneratedTokens | None = None) -> Variable:
        """Materialize a variable the manager itself computes (a flow step) and start what waited for it."""
        session.graph.reserve_text(value, "the value")
        self.tools.tool_done(session.graph, session.graph.variables[var_id], self._clock())
        return self._materialize(session, var_id, value, generated=generated)

    # ---- propagation ----------------------------------------------------------------------------------------
    def _materialize(self, session: SessionState, var_id: str, value: str, *,
                     generated: GeneratedTokens | None = None) -> Variable:
        var = session.graph.materialize(var_id, value, generated=generated)
        self._advance(session, var.consumers)
        return var

    def _advance(self, session: SessionState, request_ids: Iterable[str]) -> None:
        """Start each WAITING request whose inputs are all READY; fail (transitively) those with a failed input."""
        graph = session.graph
        work = deque(request_ids)
        while work:
            req = graph.request(work.popleft())
            if req.status is not RequestStatus.WAITING or session.closed:
                continue
            ready, failed = graph.input_state(req)
            if failed is not None:
                assert failed.error is not None
                name = next(b.name for b in req.bindings.values() if b.var_id == failed.var_id)
                err = StepFailed(f"request {req.request_id} {req.label} not run: its input {name!r} "
                                 f"({failed.var_id}) failed: {failed.error.message}",
                                 cause_code=failed.error.cause_code)
                work.extend(self._fail_request(session, req, err))
            elif ready:
                self._start(session, req)

    def _fail_request(self, session: SessionState, req: RequestNode, err: StepFailed) -> list[str]:
        """Fail ``req`` and its still-pending outputs; return the consumers to re-examine."""
        graph = session.graph
        req.error = err
        graph.set_status(req, RequestStatus.FAILED)
        self.prefix_store.remove_queued(_key(session, req))
        consumers: list[str] = []
        for vid in req.outputs:
            if graph.fail_variable(vid, err):
                consumers.extend(graph.variables[vid].consumers)
        return consumers

    def _fail(self, session: SessionState, req: RequestNode, err: StepFailed) -> None:
        logger.info("session %s: %s", session.session_id, err.message)
        self._advance(session, self._fail_request(session, req, err))

    def _start(self, session: SessionState, req: RequestNode) -> None:
        session.graph.set_status(req, RequestStatus.READY)
        # every input is materialized now: queue the full head's hashes, so requests that become ready together
        # (consumers of one generated document, §8.4) see each other as sharers
        self.prefix_store.add_queued(_key(session, req), self._known_boundaries(session, req))
        task = asyncio.create_task(self._execute(session, req), name=f"{session.session_id}/{req.request_id}")
        session.tasks.add(task)
        session.request_tasks[req.request_id] = task
        task.add_done_callback(session.tasks.discard)
        task.add_done_callback(lambda _t: session.request_tasks.pop(req.request_id, None))

    # ---- execution ------------------------------------------------------------------------------------------
    async def _execute(self, session: SessionState, req: RequestNode) -> None:
        set_log_context(request_id=req.request_id, session_id=session.session_id)  # this task's log records
        key = _key(session, req)
        graph = session.graph
        ready = self._clock()  # inputs materialized: the request's latencies count from here

        async def run(lease: Lease, attempt: int) -> None:
            await self._run(session, req, lease)
            lease.release()  # after a failure the failover loop releases it, once the dispatcher knows

        def on_lost(loss: Loss) -> None:
            if loss.restarting:
                graph.set_status(req, RequestStatus.READY)  # queued again until another engine takes it

        try:
            try:
                await self.failover.run(self._dispatch_request(session, req), run,
                                        what=f"request {req.request_id} of session {session.session_id}",
                                        restartable=lambda: not self._outputs_done(session, req), on_lost=on_lost)
            except EngineUnavailable:
                if not self._outputs_done(session, req):
                    raise
                # it lost the engine while freeing its context: nothing was left to compute
            graph.set_status(req, RequestStatus.FINISHED)
        except asyncio.CancelledError:
            raise  # the session is closing; close_session fails what is left and frees contexts
        except ParrotError as e:
            cause = e.cause_code if isinstance(e, StepFailed) else e.code
            self._fail(session, req, StepFailed(f"request {req.request_id} {req.label} failed: {e.code}: "
                                                f"{e.message}", cause_code=cause))
        except Exception as e:  # a bug: log it with its traceback, still never leave a get hanging
            logger.exception("request %s/%s crashed", session.session_id, req.request_id)
            self._fail(session, req, StepFailed(f"request {req.request_id} {req.label} failed: internal "
                                                f"error {type(e).__name__}: {e}", cause_code="internal_error"))
        finally:
            self._generated.pop(key, None)
            self._on_activity(session)
            self.recent.dag_request_done(session.session_id, session.owner, req)
            self.metrics.dag_request_done(req, ready, self._clock())

    async def _run(self, session: SessionState, req: RequestNode, lease: Lease) -> None:
        graph, client, info = session.graph, lease.client, lease.info
        ctx = f"{req.request_id}-{secrets.token_hex(8)}"
        req.engine, req.context_id = lease.engine, ctx
        graph.set_status(req, RequestStatus.RUNNING)
        session.contexts[ctx] = lease.engine  # before the first fill: a cancelled fill is still freed
        key = _key(session, req)
        fork: Fork | None = None
        completed = False
        held: list[Boundary] = []  # boundaries registered for ctx (a paused ctx keeps their placement affinity)
        try:
            head, n_head, hasher = await self._tokenize_head(session, req, client, info)
            if self.sharing is not None:
                fork = self.sharing.plan(session.session_id, key, lease.engine, client, head, lease.tpot_s)
            self.prefix_store.remove_queued(key)  # after planning: queued peers are what makes a prefix shared
            if fork is not None and self.sharing is not None and not await self.sharing.wait(fork):
                self.sharing.release(fork)  # its fill failed: run unshared
                fork = None
            fork = await self._first_fill(req, client, ctx, head, fork,
                                          self._fill_hint(session, req, n_head, lease, len(head.tokens)))
            await self.tools.release_for(session.session_id, req, self._orphans)  # its prompt took a paused KV
            self._register(head.boundaries, lease.engine, ctx)
            held.extend(head.boundaries)
            pending: list[int] = []
            offset = len(head.tokens)  # tokens in the context once `pending` is filled
            boundaries: list[Boundary] = []  # (prefix hash, token offset) not yet registered
            for i in range(n_head, len(req.segments)):
                seg = req.segments[i]
                replayed: str | None = None  # raw text of an output materialized by an earlier run
                if not isinstance(seg, TextSegment):
                    binding = req.bindings[seg.name]
                    boundaries.append(Boundary(hasher.hexdigest, offset))
                    if binding.is_output:
                        replayed = self._generated.get(key, {}).get(binding.var_id or "")
                    if binding.is_output and replayed is None:
                        _check_prompt_limit(session, offset, binding.name)
                        if pending:
                            self._filled(req, await client.fill(pending, ctx,
                                                                hint=self._fill_hint(session, req, i, lease, offset)))
                            pending = []
                        self._register(boundaries, lease.engine, ctx)
                        held.extend(boundaries)
                        boundaries = []
                        piece, n = await self._generate(session, req, binding, lease, ctx, offset,
                                                        lead=_moved_spaces(req.segments, i - 1))
                        offset += n
                        hasher.update(piece)
                        continue
                piece = _piece(session, req, i) if replayed is None else replayed
                toks = await self.tools.piece_tokens(graph, req, i, piece, client, info)
                pending.extend(toks)
                offset += len(toks)
                hasher.update(piece)
            completed = True
        finally:
            tool = self.tools.tool_after(graph, req) if completed else None
            if tool is not None:
                await self._pause(session, ctx, lease, *tool, held)
            else:
                await self._free(session, ctx)
            if fork is not None and self.sharing is not None:
                self.sharing.release(fork)

    async def _tokenize_head(self, session: SessionState, req: RequestNode, client: EngineClient,
                             info: ModelInfo) -> tuple[PromptHead, int, PrefixHasher]:
        """BOS + every piece before the first output, each piece tokenized on its own, with a boundary after
        each piece; the number of segments the head covers; the hasher positioned after them."""
        tokens: list[int] = [info.bos_token_id] if info.add_bos and info.bos_token_id is not None else []
        hasher, bounds = PrefixHasher(), []
        n = 0
        for n, seg in enumerate(req.segments):
            if not isinstance(seg, TextSegment) and req.bindings[seg.name].is_output:
                break
            piece = _piece(session, req, n)
            tokens.extend(await self.tools.piece_tokens(session.graph, req, n, piece, client, info))
            bounds.append(Boundary(hasher.update(piece), len(tokens)))
        else:
            n = len(req.segments)
        return PromptHead(tuple(tokens), tuple(bounds)), n, hasher

    async def _first_fill(self, req: RequestNode, client: EngineClient, ctx: str, head: PromptHead,
                          fork: Fork | None, hint: OpHint | None) -> Fork | None:
        """Create ``ctx`` holding the head: a fork of the prefix context plus the rest, or the whole head.
        Returns the fork actually used (None if unshared)."""
        if fork is not None:
            pc = fork.prefix
            try:
                self._filled(req, await client.fill(list(head.tokens[pc.num_tokens:]), ctx, pc.context_id,
                                                    hint=hint))
            except UnknownContext:
                # only the parent can be unknown (ctx is new): the engine lost it, e.g. after a restart
                assert self.sharing is not None
                self.sharing.invalidate(pc)
                self.sharing.release(fork)
                fork = None
            else:
                assert self.sharing is not None
                self.sharing.forked(fork)
                req.prefix_context, req.num_shared_tokens = pc.context_id, pc.num_tokens
                return fork
        if head.tokens:
            self._filled(req, await client.fill(list(head.tokens), ctx, hint=hint))
        return None

    @staticmethod
    def _filled(req: RequestNode, fill: FillResult) -> None:
        req.num_cached_tokens += fill.num_cached

    def _fill_hint(self, session: SessionState, req: RequestNode, i: int, lease: Lease,
                   prompt_tokens: int) -> OpHint | None:
        """The predictions of the generate segment ``i`` is, if it is an output to generate: the fill of its prompt
        (``prompt_tokens`` long) carries them, so an engine ranking by memory over time admits the whole segment."""
        seg = req.segments[i] if i < len(req.segments) else None
        if seg is None or isinstance(seg, TextSegment):
            return None
        binding = req.bindings[seg.name]
        if not binding.is_output or binding.sampling is None:
            return None
        return lease.targeted(self.tools.hint(session.graph, req, binding, lease.info.name, prompt_tokens)[1])

    async def _generate(self, session: SessionState, req: RequestNode, binding: PlaceholderBinding, lease: Lease,
                        ctx: str, prompt_tokens: int, *, lead: int = 0) -> tuple[str, int]:
        """Generate one output into ``ctx`` (holding ``prompt_tokens``) and materialize it; return (raw text,
        tokens generated).

        ``lead``: spaces the template had right before this output, left out of the fill (see _moved_spaces);
        the model generates them itself, and they are not part of the value."""
        assert binding.sampling is not None and binding.var_id is not None
        features, hint = self.tools.hint(session.graph, req, binding, lease.info.name, prompt_tokens)
        hint = lease.targeted(hint)
        started = self._clock()
        if self.stream_outputs and binding.sampling.constraint is None:
            # pieces reach the variable's readers as they arrive (value_stream); a constrained output is not
            # streamed: only the whole result says whether it completed its grammar
            def counted(n: int) -> None:
                req.generated_tokens += n

            sink = OutputSink(session.graph.variables[binding.var_id].pieces, lead, on_tokens=counted)
            result = await generate_streamed(lease.client, binding.sampling, ctx, sink, self._clock, hint=hint)
        else:
            result = await lease.client.generate(binding.sampling, ctx, hint=hint)
            req.generated_tokens += len(result.token_ids)
        self.tools.generated(features, len(result.token_ids))
        if req.times.first_token is None:
            # the engine reports its time to first token (queueing included); the call started at `started`
            req.times.first_token = min(started + result.ttft_s, self._clock())
        self.metrics.generated("parrot", result)
        text = result.text
        constraint = binding.sampling.constraint
        if constraint is not None and (result.constraint_complete is False or (  # None: the engine cannot tell
                result.constraint_complete is None and result.finish_reason is not FinishReason.STOP)):
            raise ConstraintIncomplete(
                f"output {binding.name!r} ended ({result.finish_reason.value}) after {len(result.token_ids)} tokens "
                f"before its {constraint.kind.value} constraint was complete; raise max_tokens "
                f"(now {binding.sampling.max_tokens}) or drop its stop strings", param=binding.name)
        if lead and text.startswith(" " * lead):
            text = text[lead:]
        value = apply_transforms(list(binding.transforms), text) if binding.transforms else text
        ids = result.token_ids
        stops = set(lease.info.eos_token_ids) | set(binding.sampling.stop_token_ids)
        if ids and ids[-1] in stops:  # an EOS / stop token is in the context but not in the text
            ids = ids[:-1]
        generated = GeneratedTokens(lease.info.name, result.text, tuple(ids))
        self._materialize(session, binding.var_id, value, generated=generated)
        self._generated.setdefault(_key(session, req), {})[binding.var_id] = result.text
        session.graph.journal.output_text(session.session_id, binding.var_id, result.text)
        return result.text, len(result.token_ids)

    async def _pause(self, session: SessionState, ctx: str, lease: Lease, tool_var: str, tool: ToolHint,
                     held: list[Boundary]) -> None:
        """Hand ``ctx`` (holding the prefixes ``held``) to its engine while the tool producing ``tool_var`` runs,
        instead of :meth:`_free` (tool_context.pause_context); it is freed once a request reading ``tool_var`` has
        filled its prompt, and keeps that request's placement on its engine until then (DagTools.prefix_tokens)."""
        engine = session.contexts.pop(ctx, None)
        if engine is None:
            return
        self.prefix_store.remove_context(engine, ctx)
        if await pause_context(lease.client, engine, ctx, tool, registry=self.dispatcher.registry,
                               orphans=self._orphans, predictors=self.predictors):
            self.tools.paused(session.session_id, tool_var, engine, lease.client, ctx,
                              [(b.prefix_hash, b.num_tokens) for b in held], tool)

    async def _free(self, session: SessionState, ctx: str) -> None:
        engine = session.contexts.pop(ctx, None)
        if engine is None:
            return
        self.prefix_store.remove_context(engine, ctx)
        await self._orphans.free(engine, ctx)  # kept for later if the engine is dead (a call could hang)

    def _register(self, boundaries: Iterable[Boundary], engine: str, ctx: str) -> None:
        for b in boundaries:
            self.prefix_store.add_context(b.prefix_hash, ContextRef(engine, ctx, b.num_tokens))

    # ---- helpers --------------------------------------------------------------------------------------------
    def _known_boundaries(self, session: SessionState, req: RequestNode) -> list[str]:
        """Boundary hashes computable now (before each placeholder and after each piece): up to the first
        input that is not ready, or the first output."""
        hasher, out = PrefixHasher(), []
        for i, seg in enumerate(req.segments):
            if not isinstance(seg, TextSegment):
                binding = req.bindings[seg.name]
                if binding.is_output or session.graph.variables[binding.var_id].status is not VarStatus.READY:
                    break
            try:
                out.append(hasher.update(_piece(session, req, i)))
            except ParrotError:
                break
        return out

    @staticmethod
    def _outputs_done(session: SessionState, req: RequestNode) -> bool:
        return all(session.graph.variables[v].status is VarStatus.READY for v in req.outputs)

    def _dispatch_request(self, session: SessionState, req: RequestNode) -> DispatchRequest:
        graph = session.graph
        chars = sum(len(s.text) for s in req.segments if isinstance(s, TextSegment))
        chars += sum(len(graph.variables[v].value or "") for v in req.inputs)
        hashes = tuple(self._known_boundaries(session, req))
        prompt_tokens = self._prompt_estimate(session, req, hashes, chars)
        outputs = [b for b in req.bindings.values() if b.is_output]
        perfs = {graph.get_perf_obj(b.var_id) for b in outputs}
        perf = PerfCriteria.LATENCY if PerfCriteria.LATENCY in perfs else (
            PerfCriteria.THROUGHPUT if PerfCriteria.THROUGHPUT in perfs else None)
        return DispatchRequest(
            request_id=req.request_id, session_id=session.session_id, models=req.models,
            prompt_tokens=prompt_tokens,
            max_new_tokens=sum(b.sampling.max_tokens for b in outputs if b.sampling is not None),
            perf=perf, prefix_hashes=hashes)

    def _prompt_estimate(self, session: SessionState, req: RequestNode, hashes: tuple[str, ...], chars: int) -> int:
        """Prompt tokens before tokenization (the engine is not chosen yet): the longest prefix whose size an
        engine already reported (PrefixStore.known_tokens) plus the remaining characters at the characters per
        token the store measured on known prefixes (4 until it has)."""
        store = self.prefix_store
        known = store.longest_known(hashes)
        if known is None:
            return int(chars / store.chars_per_token())
        index, tokens = known
        head = 0
        for i in range(index + 1):
            try:
                head += len(_piece(session, req, i))
            except ParrotError:
                break
        store.observe(hashes[index], head)
        return tokens + int(max(0, chars - head) / store.chars_per_token())


def _moved_spaces(segments, i: int) -> int:
    """Trailing spaces of text segment ``i`` that move to the placeholder after it.

    BPE tokenizers attach a word's leading space to the word ("Title: Paris" is `Title` `:` ` Paris`), so a
    prompt piece ending in a space followed by a value tokenized on its own would give the model a lone
    space token it never saw in training (and a small model then derails). Moving the spaces onto the value
    (input) or leaving them for the model to generate (output) keeps the tokens natural. Pieces are still
    tokenized one by one, so token ids stay identical across requests that share a prefix."""
    if 0 <= i < len(segments) - 1 and isinstance(segments[i], TextSegment) \
            and not isinstance(segments[i + 1], TextSegment):
        text = segments[i].text
        return len(text) - len(text.rstrip(" "))
    return 0


def _piece(session: SessionState, req: RequestNode, i: int) -> str:
    """The text segment ``i`` of ``req`` or the value of its input placeholder, as filled into the context."""
    seg = req.segments[i]
    if isinstance(seg, TextSegment):
        return seg.text[: len(seg.text) - _moved_spaces(req.segments, i)]
    binding = req.bindings[seg.name]
    return " " * _moved_spaces(req.segments, i - 1) + _input_value(session.graph.variables[binding.var_id], binding)


def _input_value(var: Variable, binding: PlaceholderBinding) -> str:
    assert var.value is not None
    return apply_transforms(list(binding.transforms), var.value) if binding.transforms else var.value


def _key(session: SessionState, req: RequestNode) -> str:
    return f"{session.session_id}/{req.request_id}"


def _check_prompt_limit(session: SessionState, num_tokens: int, output: str) -> None:
    """LimitExceeded (the step fails) when the prompt before ``output`` is over the session owner's limit."""
    limit = session.max_prompt_tokens
    if limit is not None and num_tokens > limit:
        raise LimitExceeded(f"the prompt before output {output!r} has {num_tokens} tokens; the max_prompt_tokens "
                            f"limit of tenant {session.owner!r} is {limit}", param="prompt")
