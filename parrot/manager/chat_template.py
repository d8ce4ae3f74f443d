"""Chat prompts for the manager: the model's own (HF-style) chat template, rendered by the one renderer
(:mod:`parrot.common.chat_template`, transformers' semantics), plus what only serving needs: tool polyfills.

Messages arrive as plain dicts (``role``, ``content`` text, optional ``name``; assistant ``tool_calls`` with
arguments as dicts, ``tool`` messages with ``tool_call_id``): the API layer flattens its request models into them,
so the manager never sees an HTTP schema.

Tools: they reach the template as its ``tools`` variable (HF's convention). A template that does not mention
``tools`` also gets them described in the system prompt, and one that does not mention ``tool_calls`` sees calls
and results as text blocks (:mod:`parrot.manager.tool_calls`) -- there the prompt differs from transformers',
which would silently drop them.

vLLM's controls: ``template_kwargs`` become extra template variables (e.g. Qwen3's ``enable_thinking``);
``continue_final_message`` renders the conversation without a generation prompt and cuts the text right after the
last message's content (as transformers does), so the model continues that message instead of starting a new one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from parrot.common.chat_template import MAX_CACHED_TEMPLATES, ChatTemplateError, ChatTemplates
from parrot.manager.tool_calls import polyfill_messages, with_tools_prompt

__all__ = ["MAX_CACHED_TEMPLATES", "ChatRenderer", "ChatTemplateError"]

_TOOLS_VAR = re.compile(r"\btools\b")  # the template reads a ``tools`` variable


class ChatRenderer:
    """One per app (the completion service's): the template cache lives here."""

    def __init__(self) -> None:
        self._templates = ChatTemplates()

    def render(self, template: str | None, messages: Sequence[Mapping[str, Any]], *, bos_token: str = "",
               eos_token: str = "", add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] = (), continue_final_message: bool = False,
               template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text for ``messages`` (and ``tools``: OpenAI dicts ``{"type": "function", "function":
        {...}}``; ``template_kwargs``: more template variables; ``continue_final_message``: end inside the last
        message, see the module). Raises ChatTemplateError (400) if the model has no template or the template
        rejects the conversation (e.g. roles out of order), or the last message's content is not in the text."""
        if not template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions", param="messages")
        msgs = [dict(m) for m in messages]
        if "tool_calls" not in template:
            msgs = polyfill_messages(msgs)
        if tools and not _TOOLS_VAR.search(template):
            msgs = with_tools_prompt(msgs, tools)
        return self._templates.render(template, msgs, tools=tools or None, bos_token=bos_token,
                                      eos_token=eos_token, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message, variables=template_kwargs)
