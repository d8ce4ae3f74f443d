"""Chat prompt rendering with the model's own (HF-style) jinja2 chat template, sandboxed.

Messages arrive as plain dicts (``role``, ``content`` text, optional ``name``; assistant ``tool_calls`` with
arguments as dicts, ``tool`` messages with ``tool_call_id``): the API layer flattens its request models into them,
so the manager never sees an HTTP schema.

Tools: a template that mentions ``tools`` gets them as its ``tools`` variable (HF's convention); otherwise they
are described in the system prompt, and a template that does not mention ``tool_calls`` sees calls and results
as text blocks (:mod:`parrot.manager.tool_calls`).

vLLM's controls: ``template_kwargs`` become extra template variables (e.g. Qwen3's ``enable_thinking``);
``continue_final_message`` renders the conversation without a generation prompt and cuts the text right after the
last message's content (as transformers does), so the model continues that message instead of starting a new one.

Templates come from model files, i.e. from outside; they run in jinja2's ImmutableSandboxedEnvironment
(no attribute access to internals, no mutation of inputs) with the helpers HF templates expect:
``raise_exception(msg)`` and ``strftime_now(fmt)``. Compiled templates are cached per template string in
the renderer instance (one per app, no module-global state).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from parrot.common.errors import InvalidRequestError
from parrot.manager.tool_calls import polyfill_messages, with_tools_prompt

MAX_CACHED_TEMPLATES = 16
_TOOLS_VAR = re.compile(r"\btools\b")  # the template reads a ``tools`` variable


class ChatTemplateError(InvalidRequestError):
    code = "bad_chat_template"


class ChatRenderer:
    def __init__(self) -> None:
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                  extensions=["jinja2.ext.loopcontrols"])
        self._env.globals["raise_exception"] = _raise_exception
        self._env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._cache: dict[str, jinja2.Template] = {}

    def _compile(self, template: str) -> jinja2.Template:
        compiled = self._cache.get(template)
        if compiled is None:
            try:
                compiled = self._env.from_string(template)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None
            if len(self._cache) >= MAX_CACHED_TEMPLATES:
                self._cache.pop(next(iter(self._cache)))
            self._cache[template] = compiled
        return compiled

    def render(self, template: str | None, messages: Sequence[Mapping[str, Any]], *, bos_token: str = "",
               eos_token: str = "", add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] = (), continue_final_message: bool = False,
               template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text for ``messages`` (and ``tools``: OpenAI dicts ``{"type": "function", "function":
        {...}}``; ``template_kwargs``: more template variables; ``continue_final_message``: end inside the last
        message, see the module). Raises ChatTemplateError (400) if the model has no template or the template
        rejects the conversation (e.g. roles out of order), or the last message's content is not in the text."""
        if continue_final_message:
            text = self._render(template, messages, bos_token=bos_token, eos_token=eos_token,
                                add_generation_prompt=False, tools=tools, template_kwargs=template_kwargs)
            final = str(messages[-1].get("content") or "").strip() if messages else ""
            at = text.rfind(final) if final else -1
            if at < 0:
                raise ChatTemplateError("continue_final_message: the last message's content is not in the rendered "
                                        "prompt (empty, or changed by the template)", param="messages")
            return text[:at + len(final)]
        return self._render(template, messages, bos_token=bos_token, eos_token=eos_token,
                            add_generation_prompt=add_generation_prompt, tools=tools, template_kwargs=template_kwargs)

    def _render(self, template: str | None, messages: Sequence[Mapping[str, Any]], *, bos_token: str,
                eos_token: str, add_generation_prompt: bool, tools: Sequence[Mapping[str, Any]],
                template_kwargs: Mapping[str, Any] | None) -> str:
        if not template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions", param="messages")
        msgs = [dict(m) for m in messages]
        if "tool_calls" not in template:
            msgs = polyfill_messages(msgs)
        extra: dict[str, Any] = dict(template_kwargs or {})
        if tools and _TOOLS_VAR.search(template):
            extra["tools"] = [dict(t) for t in tools]
        elif tools:
            msgs = with_tools_prompt(msgs, tools)
        try:
            return self._compile(template).render(messages=msgs, bos_token=bos_token, eos_token=eos_token,
                                                  add_generation_prompt=add_generation_prompt, **extra)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:  # SecurityError is a TemplateError
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}", param="messages") from None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the conversation: {message}", param="messages")
