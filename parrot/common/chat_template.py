"""The one renderer of HF-style (jinja2) chat templates, used by the engine's tokenizer and the manager's chat path.

It follows transformers' ``apply_chat_template`` (``transformers/utils/chat_template_utils.py``), so a served
prompt is the prompt the model was trained on:

* jinja2 ImmutableSandboxedEnvironment with ``trim_blocks`` / ``lstrip_blocks``, loop controls and the
  ``{% generation %}`` tag (renders its body; only training code tracks it);
* ``tojson`` is json.dumps with HF's arguments (``ensure_ascii=False``, ``indent``, ``separators``,
  ``sort_keys=False``): no HTML escaping and keys in their given order, unlike jinja's own filter, which
  escapes ``<``, ``>``, ``&`` and ``'`` as ``\\u003c``... and sorts keys;
* globals ``raise_exception(msg)`` (-> :class:`ChatTemplateError`), ``strftime_now(fmt)``, a limited ``dict``
  and a ``namespace`` that refuses underscore names;
* the template sees ``messages`` (message keys whose value is None dropped; a reasoning field also under
  ``reasoning_content`` and ``thinking``), ``tools`` (None when there are none), ``documents`` (None),
  ``add_generation_prompt``, ``bos_token`` / ``eos_token`` and any extra variables (which win over the tokens);
* ``continue_final_message``: the last message's content is tagged, rendered without a generation prompt and
  the text cut where the tag starts, so the model continues that message.

Templates come from model files, i.e. from outside: they only run in the sandbox. Compiled templates are cached
per template string in the renderer instance (its owner's; no module-global state).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from parrot.common.errors import TemplateError

MAX_CACHED_TEMPLATES = 16
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


class ChatTemplateError(TemplateError):
    """A 400: no template, a template that does not compile, or one that rejects the conversation."""

    code = "bad_chat_template"


class ChatTemplates:
    """Compile (cached) and render chat templates; one instance per owner (a tokenizer, a manager's service)."""

    def __init__(self, max_cached: int = MAX_CACHED_TEMPLATES) -> None:
        self._env = _environment()
        self._cache: dict[str, jinja2.Template] = {}
        self._max_cached = max_cached

    def compile(self, template: str) -> jinja2.Template:
        """The compiled template (cached); ChatTemplateError if it does not compile."""
        compiled = self._cache.get(template)
        if compiled is None:
            try:
                compiled = self._env.from_string(template)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None
            if len(self._cache) >= self._max_cached:
                self._cache.pop(next(iter(self._cache)))
            self._cache[template] = compiled
        return compiled

    def render(self, template: str, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, bos_token: str = "", eos_token: str = "",
               variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text, as transformers renders it (see the module). ``tools``: OpenAI-shaped dicts, given to
        the template as is (None or empty: ``tools`` is None); ``variables``: more template variables (e.g.
        Qwen3's ``enable_thinking``). Raises ChatTemplateError (param ``messages``) if the messages are not a list
        of objects, the template raises or fails on them, or ``continue_final_message`` finds no final content."""
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping) for m in messages):
            raise ChatTemplateError("messages must be a list of objects with 'role' and 'content'", param="messages")
        msgs = [_alias_reasoning({k: _plain(v) for k, v in m.items() if v is not None}) for m in messages]
        final = ""
        if continue_final_message:
            add_generation_prompt = False
            final = _tag_final_message(template, msgs)
        context = {"bos_token": bos_token, "eos_token": eos_token, **_plain(dict(variables or {}))}
        compiled = self.compile(template)
        try:
            text = compiled.render(messages=msgs, tools=_plain(list(tools)) if tools else None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **context)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:  # SecurityError too
            raise ChatTemplateError(f"chat template failed for these messages: {type(e).__name__}: {e}",
                                    param="messages") from None
        return _cut_at_tag(text, final) if continue_final_message else text


# ---- continue_final_message (transformers' tag trick) -------------------------------------------------------------
def _tag_final_message(template: str, msgs: list[dict[str, Any]]) -> str:
    """Append the tag to the last message's content (its last text part for a list); returns the content."""
    if not msgs or msgs[-1].get("content") is None:
        raise ChatTemplateError("continue_final_message: there is no final message content to continue",
                                param="messages")
    if "content" not in template:
        raise ChatTemplateError("continue_final_message: the chat template does not read message content",
                                param="messages")
    content = msgs[-1]["content"]
    if isinstance(content, str):
        msgs[-1]["content"] = content + _CONTINUE_TAG
        return content
    for part in reversed(content if isinstance(content, list) else []):
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            final = part["text"]
            part["text"] = final + _CONTINUE_TAG
            return final
    raise ChatTemplateError("continue_final_message: the final message has no text to continue", param="messages")


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message: the last message's content is not in the rendered prompt "
                                "(changed by the template)", param="messages")
    at = text.rindex(tag)
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the content's trailing space, and the tag's


# ---- the template's inputs -----------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """A copy made of plain JSON types (the sandbox sees no caller objects; templates cannot change inputs)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, str):  # subclasses (enums ...) back to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


# ---- the sandbox ---------------------------------------------------------------------------------------------------
class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without the type's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's ``namespace`` refusing underscore-prefixed names (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: ``namespace(self=...)`` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates cannot store {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the conversation: {message}", param="messages")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
