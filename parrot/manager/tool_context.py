"""The manager's side of a tool call (LAMPS): what a DAG generate tells the engine, how a context is
handed over while a tool runs, and how the follow-up prompt continues it token for token. No torch.

::

    S1 generate(hint=OpHint(predicted_output_tokens, ToolHint("search", predicted s)))     DagTools.hint
    S1 done  -> engine.pause_context(ctx_S1, ToolHint)  (instead of free_context)        pause_context
    client runs the tool, PUTs its output                -> observed duration learned      DagTools.tool_done
    S2 prompt = S1's pieces + S1's output (its generated ids) + tool result ...            DagTools.piece_tokens
           -> the engine's prefix match resumes S1's KV

The graph executor (:mod:`parrot.manager.executor`) calls :class:`DagTools`; the OpenAI completion service
(:mod:`parrot.manager.completion_run`) calls :func:`pause_context` for a chat answer that ends in tool calls and
keeps it in :class:`PausedChats`. A chat follow-up re-renders the history, so its prompt continues the paused
prompt but usually not the generated call (a forced call's arguments come back wrapped, JSON re-dumped)::

    paused:     | prompt (system, user, assistant header) | generated call |
    follow-up:  | prompt (system, user, assistant header) | rendered call | tool result | assistant header |
                  ^ served from the paused KV by the engine's prefix match

The engine drops a pause once a context covers its last full block; a follow-up that stops short of it would
leave the context paused until its TTL, so the service frees it itself once the follow-up's prompt is filled.
In the DAG likewise: a context paused for a tool-produced variable is freed once a request reading that variable
has filled its prompt, and until then draws that request to its engine (placement's prefix affinity).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from parrot.common.errors import ParrotError, UnknownContext
from parrot.common.template import TextSegment
from parrot.manager.engine_registry import EngineRegistry, EngineState
from parrot.manager.failover import OrphanContexts
from parrot.manager.graph import (
    Graph,
    PlaceholderBinding,
    RequestNode,
    ToolDecl,
    Variable,
)
from parrot.manager.tool_predict import Predictors, PromptFeatures, ToolDurations
from parrot.protocol.interface import EngineClient, ModelInfo, OpHint, ToolHint

logger = logging.getLogger(__name__)


async def pause_context(client: EngineClient, engine: str, ctx: str, tool: ToolHint, *, registry: EngineRegistry,
                        orphans: OrphanContexts, predictors: Predictors) -> bool:
    """Hand ``ctx`` to its engine while ``tool`` runs, instead of freeing it: from here on the engine owns it (it
    resumes it when a later context continues it, or frees it after a TTL). A context on a dead engine is kept
    for later freeing as a free would be; a failed pause falls back to freeing. Never raises a ParrotError.
    Counts the pause in ``predictors`` by the engine's handling ("free" for an engine without tool handling).
    Returns whether the context is paused on the engine now."""
    try:
        entry = registry.entry(engine)
        if entry.state is EngineState.DEAD and entry.client is client:  # a call could hang: freed if it returns
            await orphans.free(engine, ctx, client)
            return False
        result = await client.pause_context(ctx, tool)
    except UnknownContext:
        return False
    except ParrotError as e:
        logger.warning("pausing context %s on engine %s failed (%s); freeing it", ctx, engine, e)
        await orphans.free(engine, ctx, client)
        return False
    predictors.paused(result.handling if result is not None else "free")
    return result is not None


HEAD_TOKENS = 32  # paused prompts are indexed by their first HEAD_TOKENS tokens
PROMPT_SLACK = 8  # a follow-up may differ from the paused prompt in its last few tokens (a generation header)


@dataclass(frozen=True)
class PausedChat:
    engine: str
    client: EngineClient
    context_id: str
    prompt: tuple[int, ...]
    at: float
    tool: str = ""  # the tool call it waits for ("" unknown)


class PausedChats:
    """Chat contexts paused for a tool call, until the follow-up continuing their prompt is filled (module
    docstring). Bounded: at most ``max_entries`` (oldest dropped: their engine frees them by TTL) and none older
    than ``ttl_s``."""

    def __init__(self, *, max_entries: int = 1024, ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._by_head: dict[tuple[int, ...], list[PausedChat]] = {}
        self._order: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()  # (engine, ctx) -> head
        self.num_released = 0

    def __len__(self) -> int:
        return len(self._order)

    def add(self, engine: str, client: EngineClient, context_id: str, prompt: Sequence[int], tool: str = "") -> None:
        if len(prompt) < HEAD_TOKENS:
            return  # too short to tell conversations apart: the engine's TTL frees it
        head = tuple(prompt[:HEAD_TOKENS])
        self._by_head.setdefault(head, []).append(PausedChat(engine, client, context_id, tuple(prompt),
                                                             self._clock(), tool))
        self._order[(engine, context_id)] = head
        while len(self._order) > self.max_entries:
            (e, c), h = self._order.popitem(last=False)
            self._drop(h, e, c)

    def _drop(self, head: tuple[int, ...], engine: str, context_id: str) -> None:
        rest = [p for p in self._by_head.get(head, ()) if (p.engine, p.context_id) != (engine, context_id)]
        if rest:
            self._by_head[head] = rest
        else:
            self._by_head.pop(head, None)

    def take(self, prompt: Sequence[int]) -> list[PausedChat]:
        """The paused chats ``prompt`` continues (it starts with all but the last PROMPT_SLACK tokens of
        theirs), removed; entries past their TTL are dropped on the way."""
        head = tuple(prompt[:HEAD_TOKENS])
        found, keep = [], []
        now = self._clock()
        for p in self._by_head.get(head, ()):
            need = max(HEAD_TOKENS, len(p.prompt) - PROMPT_SLACK)
            if now - p.at > self.ttl_s:
                self._order.pop((p.engine, p.context_id), None)
            elif len(prompt) > need and tuple(prompt[:need]) == p.prompt[:need]:
                self._order.pop((p.engine, p.context_id), None)
                found.append(p)
            else:
                keep.append(p)
        if keep:
            self._by_head[head] = keep
        else:
            self._by_head.pop(head, None)
        return found

    def now(self) -> float:
        """This table's clock (a follow-up's arrival is stamped with it)."""
        return self._clock()

    async def release(self, prompt: Sequence[int], orphans: OrphanContexts,
                      durations: ToolDurations | None = None, arrived: float | None = None) -> int:
        """Free the paused chats ``prompt`` continues (its fill has taken their KV by prefix match); how many.
        With ``durations`` and the follow-up's ``arrived`` time (:meth:`now` when it reached the service, before
        any queueing here), each one's pause (answer with the call -> follow-up with its result: what the client's
        tool and round trip took) is learned as its tool's duration, as a DAG tool's is."""
        found = self.take(prompt)
        for p in found:
            if durations is not None and arrived is not None and p.tool:
                durations.observe(p.tool, arrived - p.at)
            await orphans.free(p.engine, p.context_id, p.client)  # gone already (resumed, expired): fine
        self.num_released += len(found)
        return len(found)


@dataclass(frozen=True)
class _Held:
    """A context paused for a tool-produced variable: where it is and the prompt prefixes (PrefixHash, tokens)
    it holds there, until ``until`` (the engine's TTL at the least)."""

    engine: str
    client: EngineClient
    context_id: str
    prefixes: tuple[tuple[str, int], ...]
    until: float


MIN_HOLD_S = 30.0  # the engine keeps a pause at least this long (its default TTL: max(30 s, 4 x the tool's))


class DagTools:
    """Predictions, tool hints, pauses and generated-token reuse for the graph executor's requests.

    It also remembers each context paused for a tool-produced variable until a request reading that variable has
    filled its prompt (or the session closes): the follow-up took the paused KV by prefix match then, so the
    context is freed rather than left paused on the engine until its TTL when the follow-up's prompt stops short
    of its last full block (a stop string cut inside a token, a template that does not continue the output).
    Meanwhile :meth:`prefix_tokens` reports the prefixes it holds, so placement keeps the follow-up on its engine
    (the dispatcher's prefix affinity; the context itself is no longer in the PrefixStore: nobody may fork it)."""

    def __init__(self, predictors: Predictors, *, clock: Callable[[], float] = time.time) -> None:
        self.predictors = predictors
        self._clock = clock
        self._paused: dict[tuple[str, str], _Held] = {}  # (session id, tool-produced var id) -> paused for it
        self._affinity: dict[str, dict[tuple[str, str], tuple[str, int]]] = {}  # hash -> {key: (engine, tokens)}

    # ---- a generate's hint ----------------------------------------------------------------------------------------
    def hint(self, graph: Graph, req: RequestNode, binding: PlaceholderBinding, model: str,
             prompt_tokens: int) -> tuple[PromptFeatures, OpHint]:
        """The features the output-length predictor sees for ``binding``'s generate (a context of
        ``prompt_tokens``) and the hint sent with it: the predicted length, and the tool that reads the output."""
        assert binding.sampling is not None and binding.var_id is not None
        reader = graph.tool_reading(binding.var_id)
        ahead = req.lookahead
        decl = reader.tool if reader is not None else (ahead.tool if ahead is not None else None)
        features = PromptFeatures(model, prompt_tokens, binding.sampling.max_tokens, template_id(req, binding),
                                  (decl.name,) if decl is not None else ())
        predicted = self.predictors.output_length.predict(features)
        tool = self.tool_hint(decl)
        if ahead is None:
            return features, OpHint(predicted, tool)
        # a flow's expectations: the tool's result size, and its loop's next iterations (the same generate and
        # tool again, each after the previous tool's result)
        returned = ahead.return_tokens if tool is not None else None
        step = OpHint(predicted, tool, predicted_return_tokens=returned)
        elapsed = None if ahead.started_at is None else max(0.0, self._clock() - ahead.started_at)
        return features, OpHint(predicted, tool, predicted_return_tokens=returned,
                                later=(step,) * max(0, ahead.later_steps), elapsed_s=elapsed)

    def generated(self, features: PromptFeatures, output_tokens: int) -> None:
        self.predictors.output_length.observe(features, output_tokens)

    def tool_hint(self, decl: ToolDecl | None) -> ToolHint | None:
        """``decl``'s tool with its predicted duration (observed mean, else the client's guess)."""
        if decl is None:
            return None
        return ToolHint(decl.name, self.predictors.tool_durations.predict(decl.name, decl.expected_duration_s))

    # ---- the pause --------------------------------------------------------------------------------------------------
    def tool_after(self, graph: Graph, req: RequestNode) -> tuple[str, ToolHint] | None:
        """The tool called after ``req`` finished (one of its outputs, the last first, is read by a pending
        tool-produced variable): that variable and the hint to pause ``req``'s context with. None: free it."""
        for vid in reversed(req.outputs):
            reader = graph.tool_reading(vid)
            if reader is not None:
                return reader.var_id, self.tool_hint(reader.tool)  # type: ignore[return-value]  # tool is set
        return None

    def paused(self, session_id: str, tool_var: str, engine: str, client: EngineClient, context_id: str,
               prefixes: Sequence[tuple[str, int]], tool: ToolHint) -> None:
        """``context_id`` (holding ``prefixes``: PrefixHash, tokens) was paused on ``engine`` for ``tool_var``."""
        key = (session_id, tool_var)
        self._pop(key)
        hold = max(MIN_HOLD_S, 4 * (tool.expected_duration_s or 0.0))
        held = _Held(engine, client, context_id, tuple(prefixes), self._clock() + hold)
        self._paused[key] = held
        for h, n in held.prefixes:
            self._affinity.setdefault(h, {})[key] = (engine, n)

    def _pop(self, key: tuple[str, str]) -> _Held | None:
        held = self._paused.pop(key, None)
        if held is not None:
            for h, _ in held.prefixes:
                holders = self._affinity.get(h)
                if holders is not None:
                    holders.pop(key, None)
                    if not holders:
                        del self._affinity[h]
        return held

    def prefix_tokens(self, engine: str, prefix_hashes: Sequence[str]) -> int:
        """Tokens of the longest of ``prefix_hashes`` a context paused on ``engine`` holds (0: none), within the
        time the engine keeps it (PrefixStore.engine_prefix_tokens's answer for paused contexts)."""
        best, now = 0, self._clock()
        for h in prefix_hashes:
            for key, (e, n) in self._affinity.get(h, {}).items():
                if e == engine and n > best and self._paused[key].until > now:
                    best = n
        return best

    async def release_for(self, session_id: str, req: RequestNode, orphans: OrphanContexts) -> None:
        """``req`` filled its prompt: free the contexts paused for the tool outputs it reads (gone already when the
        engine resumed or expired them: fine)."""
        if not self._paused:
            return
        for vid in req.inputs:
            held = self._pop((session_id, vid))
            if held is not None:
                await orphans.free(held.engine, held.context_id, held.client)

    async def release_session(self, session_id: str, orphans: OrphanContexts) -> None:
        for key in [k for k in self._paused if k[0] == session_id]:
            held = self._pop(key)
            assert held is not None
            await orphans.free(held.engine, held.context_id, held.client)

    def tool_done(self, graph: Graph, var: Variable, now: float) -> None:
        """The client set tool-produced ``var`` at ``now``: the tool ran from its last input's readiness."""
        if var.tool is None or not var.tool.inputs:
            return
        starts = [graph.variables[v].ready_at for v in var.tool.inputs]
        if all(t is not None for t in starts):
            self.predictors.tool_durations.observe(var.tool.name, now - max(t for t in starts if t is not None))

    # ---- the follow-up prompt ---------------------------------------------------------------------------------------
    @staticmethod
    async def piece_tokens(graph: Graph, req: RequestNode, i: int, piece: str, client: EngineClient,
                           info: ModelInfo) -> list[int]:
        """Token ids of piece ``i`` of ``req`` (text ``piece``). An input holding exactly what a generate on this
        model wrote for it (``graph.GeneratedTokens``) is filled as the generated ids, checked by detokenizing
        them (without the last one when a stop string ended the text inside it): the prompt then continues the
        producer's context token for token, where retokenizing the text may split it otherwise and lose the
        prefix match after the first difference. Anything else is tokenized. (Text equal to a generated value
        but from another variable is tokenized afresh: two prompts with one text may then differ in tokens, which
        costs only a prefix-cache hit.)"""
        seg = req.segments[i]
        if not isinstance(seg, TextSegment):
            binding = req.bindings[seg.name]
            gen = None if binding.is_output else graph.variables[binding.var_id or ""].generated
            if gen is not None and gen.model == info.name and gen.text == piece and gen.token_ids:
                ids = list(gen.token_ids)
                for n in (len(ids), len(ids) - 1):
                    if n > 0 and await client.detokenize(ids[:n]) == piece:
                        return ids[:n]
        return await client.tokenize(piece)


def template_id(req: RequestNode, binding: PlaceholderBinding) -> str:
    """Identity of a request's template and output for the output-length predictor: its name, the output and a
    digest of its text pieces (requests of one function share it)."""
    h = hashlib.blake2b(digest_size=8)
    for seg in req.segments:
        h.update(seg.text.encode() if isinstance(seg, TextSegment) else b"\x00{{" + seg.name.encode() + b"}}")
    return f"{req.name or ''}:{binding.name}:{h.hexdigest()}"
