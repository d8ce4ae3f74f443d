"""Conversation state of the OpenAI Responses API: stored responses (per owner, bounded by a TTL and a count)
and turns that continue them (``previous_response_id``), run by the completion service's chat path.

One turn::

    prompt (chat template):  [system: instructions] + conversation(previous) + input
    stored as its conversation:                       conversation(previous) + input + [assistant: output]

Function tools run as chat completions' do (the plan's :class:`ToolPlan`: tools rendered into the prompt, a
forced call's constraint in the sampling, the output read as calls by :mod:`parrot.manager.responses_output`,
a one-choice answer ending in calls pausing its context for the tool, LAMPS): an output with calls is stored as
an assistant message with ``tool_calls``, and the next turn's ``function_call_output`` items are ``tool``
messages, so the follow-up renders the paused prompt plus the call and its result.

Instructions are per request (as OpenAI does, they are not carried to the next turn). The next turn renders the
old turns as the chat template rendered them before, so the engine's prefix cache serves them
(``Usage.cached_tokens``). An entry is visible only to its owner (the tenant whose API key created it): another
owner's id, an expired one and an unknown one are the same ``previous_response_not_found`` / ``response_not_found``.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from parrot.common.errors import NotFoundError
from parrot.common.sampling import FinishReason
from parrot.manager.completion_types import ChatSpec, ChoiceDelta, ChoiceSpec, CompletionPlan, Usage
from parrot.manager.completions import CompletionService
from parrot.manager.responses_output import CallDelta, OutputSplitter, TextDelta, assistant_message, split_output
from parrot.manager.tool_calls import ToolOutput, ToolPlan

Message = Mapping[str, Any]  # {"role", "content"[, "tool_calls", "tool_call_id"]}, as chat templates take them


class PreviousResponseNotFound(NotFoundError):
    code = "previous_response_not_found"


class ResponseNotFound(NotFoundError):
    code = "response_not_found"


@dataclass(frozen=True)
class ResponseSpec:
    model: str
    input: Sequence[Message]  # this turn's new messages
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None  # None: up to the context window
    sampling: Mapping[str, Any] = field(default_factory=dict)  # SamplingParams fields (temperature, top_p)
    store: bool = True
    metadata: Mapping[str, str] = field(default_factory=dict)
    tools: ToolPlan | None = None  # function tools (their forced call's constraint is in ``sampling``)


@dataclass(frozen=True)
class ResponsePlan:
    id: str
    message_id: str  # id of the output message item
    created_at: int  # unix seconds
    owner: str
    spec: ResponseSpec
    history: tuple[Message, ...]  # the conversation before this turn
    completion: CompletionPlan


@dataclass(frozen=True)
class ResponseResult:
    plan: ResponsePlan
    text: str  # what the engine wrote
    finish_reason: FinishReason
    usage: Usage
    output: ToolOutput  # ``text`` read as message content and function calls

    @property
    def conversation(self) -> tuple[Message, ...]:
        return (*self.plan.history, *self.plan.spec.input, assistant_message(self.output.content, self.output.calls))


class ResponseStore:
    """At most ``max_entries`` responses (the least recently used is evicted first), each kept ``ttl_s``
    seconds of ``clock`` after it was created."""

    def __init__(self, *, ttl_s: float = 3600.0, max_entries: int = 1024,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError(f"ttl_s must be > 0 and max_entries >= 1, got {ttl_s!r}, {max_entries!r}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, ResponseResult]] = OrderedDict()  # id -> (expires, result)

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, result: ResponseResult) -> None:
        now = self.clock()
        for rid in [rid for rid, (expires, _) in self._entries.items() if expires <= now]:
            del self._entries[rid]
        self._entries[result.plan.id] = (now + self.ttl_s, result)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, owner: str, response_id: str) -> ResponseResult | None:
        """The stored response, or None when it is unknown, expired or another owner's."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        expires, result = entry
        if expires <= self.clock():
            del self._entries[response_id]
            return None
        if result.plan.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return result

    def delete(self, owner: str, response_id: str) -> bool:
        """Forget the response; False when :meth:`get` would not have found it."""
        if self.get(owner, response_id) is None:
            return False
        del self._entries[response_id]
        return True


class ResponsesService:
    """Plans and runs Responses turns over the completion service; stores each finished turn (``store``)."""

    def __init__(self, completions: CompletionService, store: ResponseStore) -> None:
        self.completions = completions
        self.store = store

    async def plan(self, spec: ResponseSpec, owner: str) -> ResponsePlan:
        """Validated and tokenized before any engine work. Raises PreviousResponseNotFound (404) for a
        ``previous_response_id`` this owner cannot see."""
        history: tuple[Message, ...] = ()
        if spec.previous_response_id is not None:
            previous = self.store.get(owner, spec.previous_response_id)
            if previous is None:
                raise PreviousResponseNotFound(f"previous response {spec.previous_response_id!r} not found (unknown, "
                                               "expired, not stored, or created with another API key)",
                                               param="previous_response_id")
            history = previous.conversation
        system = ({"role": "system", "content": spec.instructions},) if spec.instructions else ()
        chat = ChatSpec(spec.model, [*system, *history, *spec.input],
                        ChoiceSpec(n=1, max_tokens=spec.max_output_tokens, sampling=spec.sampling), tools=spec.tools)
        completion = await self.completions.plan_chat(chat)
        return ResponsePlan(f"resp_{secrets.token_hex(24)}", f"msg_{secrets.token_hex(24)}", int(time.time()),
                            owner, spec, history, completion)

    async def complete(self, plan: ResponsePlan) -> ResponseResult:
        result = await self.completions.complete(plan.completion)
        choice = result.choices[0]
        output = split_output(plan.completion.tools, choice.text)
        return self._finish(ResponseResult(plan, choice.text, choice.finish_reason, result.usage, output))

    async def stream(self, plan: ResponsePlan) -> AsyncIterator[TextDelta | CallDelta | ResponseResult]:
        """The message text and call arguments as the chat stream brings them, then the finished
        :class:`ResponseResult` (stored by then; its calls have the ids the deltas announced)."""
        splitter, reason = OutputSplitter(plan.completion.tools), FinishReason.STOP
        async with aclosing(self.completions.stream(plan.completion)) as events:
            async for event in events:
                if isinstance(event, ChoiceDelta):
                    reason = event.finish_reason or reason
                    for delta in splitter.push(event.text):
                        yield delta
                else:
                    rest, output = splitter.finish()
                    for delta in rest:
                        yield delta
                    yield self._finish(ResponseResult(plan, splitter.text, reason, event, output))

    def get(self, owner: str, response_id: str) -> ResponseResult:
        result = self.store.get(owner, response_id)
        if result is None:
            raise ResponseNotFound(f"response {response_id!r} not found", param="response_id")
        return result

    def delete(self, owner: str, response_id: str) -> None:
        if not self.store.delete(owner, response_id):
            raise ResponseNotFound(f"response {response_id!r} not found", param="response_id")

    def _finish(self, result: ResponseResult) -> ResponseResult:
        if result.plan.spec.store:
            self.store.put(result)
        return result
