"""What one Responses turn outputs: the chat path's text read by the turn's :class:`ToolPlan` (the same reading the
chat completions API does, :mod:`parrot.manager.tool_calls`) as an assistant message and function calls, whole
(:func:`split_output`) or while it streams (:class:`OutputSplitter`); and the chat messages a conversation keeps
for them (what the chat template renders on the next turn).

Streamed, by ``tool_choice`` (one choice; ``none`` or no tools: all text is the message)::

    {"type": "function", "name": f}   every fragment is f's arguments: CallDelta(call_id, f, fragment) ...
    "required"                        nothing until the end; then the calls (or, unparsable, the text)
    "auto"                            message text until a <tool_call> block begins; the calls at the end

The call ids a stream announces are the ids of the finished output (the stored response's function calls).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from parrot.manager.tool_calls import AutoCallStream, ToolCall, ToolChoice, ToolOutput, ToolPlan, new_call_id


@dataclass(frozen=True)
class TextDelta:
    """More text of the turn's assistant message."""

    text: str


@dataclass(frozen=True)
class CallDelta:
    """A fragment of a forced call's arguments; the first one of ``call_id`` opens the call."""

    call_id: str
    name: str
    arguments: str


class OutputSplitter:
    """One streamed turn: engine text in (:meth:`push`), message text and call fragments out; :meth:`finish`
    gives what is left to send and the turn's output."""

    def __init__(self, tools: ToolPlan | None) -> None:
        self.tools = tools if tools is not None and tools.choice is not ToolChoice.NONE else None
        self.auto = AutoCallStream(tools) if self.tools is not None and self.tools.choice is ToolChoice.AUTO else None
        self.call_id = new_call_id() if self.tools is not None and self.tools.choice is ToolChoice.NAMED else None
        self.text = ""  # all the engine wrote
        self.sent = ""  # message text sent so far

    def push(self, text: str) -> list[TextDelta | CallDelta]:
        self.text += text
        if not text:
            return []
        if self.tools is None:
            return self._content(text)
        if self.call_id is not None:  # NAMED
            assert self.tools.name is not None
            return [CallDelta(self.call_id, self.tools.name, text)]
        if self.auto is not None:
            return self._content(self.auto.push(text))
        return []  # REQUIRED: read whole at the end

    def finish(self) -> tuple[list[TextDelta], ToolOutput]:
        """The message text not sent yet, and the whole output (its content: all the message text)."""
        if self.tools is None:
            return [], ToolOutput(self.text or None)
        if self.call_id is not None:
            assert self.tools.name is not None
            return [], ToolOutput(None, (ToolCall(self.call_id, self.tools.name, self.text.strip()),))
        if self.auto is not None:
            out = self.auto.finish()
        else:
            out = self.tools.parse(self.text)
        rest = self._content(out.content or "")  # "auto": the text after the calls; unparsable: all of it
        return rest, ToolOutput(self.sent or None, out.calls)

    def _content(self, text: str) -> list[TextDelta]:
        self.sent += text
        return [TextDelta(text)] if text else []


def split_output(tools: ToolPlan | None, text: str) -> ToolOutput:
    """A whole turn's text as its output (as a stream of it would end)."""
    splitter = OutputSplitter(tools)
    splitter.push(text)
    return splitter.finish()[1]


def call_item_id(call: ToolCall) -> str:
    """The id of the ``function_call`` output item of ``call`` (``call_id`` is ``call.id``)."""
    return "fc_" + call.id.removeprefix("call_")


def tool_call_dict(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A call as chat messages carry it; its arguments a dict when they are JSON (HF templates expect one), as
    the chat completions API passes them."""
    try:
        args: Any = json.loads(arguments)
    except json.JSONDecodeError:
        args = arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def assistant_message(content: str | None, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The chat message of an assistant turn that wrote ``content`` and made ``calls``."""
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        message["tool_calls"] = [tool_call_dict(c.id, c.name, c.arguments) for c in calls]
    return message
