"""Prompt templates with Semantic Variable placeholders: ``{{input:name}}`` and ``{{output:name}}``.

A template is parsed into a flat list of segments, e.g.::

    "Write code of {{input:task}}.\\nCode: {{output:code}}"
    -> [Text("Write code of "), In(task), Text(".\\nCode: "), Out(code)]

Rules (shared by the frontend, which checks at definition time, and the server, which checks on submit):

* ``{{`` always opens a placeholder; it must be closed by ``}}`` and hold ``kind:name`` with optional
  spaces around either part. A lone ``}}`` is ordinary text (JSON examples in prompts stay legal).
* ``kind`` is ``input`` or ``output``; ``name`` is an identifier (``[A-Za-z_][A-Za-z0-9_]*``, at most
  :data:`MAX_NAME_LEN` characters).
* Every name appears once: a variable is referenced by a single placeholder of a single kind.

Errors raise :class:`~parrot.common.errors.TemplateError` whose message names the problem and its position
(line, column and character offset of the offending ``{{``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from parrot.common.errors import TemplateError

MAX_NAME_LEN = 64
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_KINDS = {"input": False, "output": True}  # kind -> is_output


@dataclass(frozen=True)
class TextSegment:
    """Constant prompt text."""

    text: str


@dataclass(frozen=True)
class PlaceholderSegment:
    """A Semantic Variable reference: an input rendered into the prompt or an output generated there."""

    name: str
    is_output: bool

    @property
    def kind(self) -> str:
        return "output" if self.is_output else "input"

    def __str__(self) -> str:
        return "{{" + f"{self.kind}:{self.name}" + "}}"


Segment = TextSegment | PlaceholderSegment


def _position(prompt: str, offset: int) -> str:
    line = prompt.count("\n", 0, offset) + 1
    col = offset - (prompt.rfind("\n", 0, offset) + 1) + 1
    return f"line {line}, column {col} (offset {offset})"


def parse_template(prompt: str) -> list[Segment]:
    """Split ``prompt`` into text and placeholder segments (adjacent text is merged, empty text dropped).

    Raises TemplateError on an unclosed ``{{``, a missing ``:``, an unknown kind, a bad or duplicate name.
    """
    if not isinstance(prompt, str):
        raise TemplateError(f"template must be a string, got {type(prompt).__name__}", param="prompt")
    segments: list[Segment] = []
    seen: dict[str, int] = {}
    text_start = 0
    pos = 0
    while True:
        open_at = prompt.find("{{", pos)
        if open_at < 0:
            break
        where = _position(prompt, open_at)
        close_at = prompt.find("}}", open_at + 2)
        if close_at < 0:
            raise TemplateError(f"unclosed '{{{{' at {where}: expected '{{{{input:NAME}}}}' or "
                                f"'{{{{output:NAME}}}}'", param="prompt")
        body = prompt[open_at + 2:close_at]
        if "{{" in body:
            raise TemplateError(f"'{{{{' at {where} is not closed before the next '{{{{'", param="prompt")
        kind, sep, name = body.partition(":")
        kind, name = kind.strip(), name.strip()
        if not sep:
            raise TemplateError(f"placeholder '{{{{{body}}}}}' at {where} has no ':' "
                                f"(expected '{{{{input:NAME}}}}' or '{{{{output:NAME}}}}')", param="prompt")
        if kind not in _KINDS:
            raise TemplateError(f"unknown placeholder kind {kind!r} at {where} (expected 'input' or 'output')",
                                param="prompt")
        if len(name) > MAX_NAME_LEN or not _NAME_RE.match(name):
            raise TemplateError(f"bad placeholder name {name!r} at {where}: names are identifiers "
                                f"([A-Za-z_][A-Za-z0-9_]*, at most {MAX_NAME_LEN} characters)", param="prompt")
        if name in seen:
            raise TemplateError(f"duplicate placeholder name {name!r} at {where} (first used at "
                                f"{_position(prompt, seen[name])})", param="prompt")
        seen[name] = open_at
        if open_at > text_start:
            segments.append(TextSegment(prompt[text_start:open_at]))
        segments.append(PlaceholderSegment(name, _KINDS[kind]))
        pos = text_start = close_at + 2
    if text_start < len(prompt):
        segments.append(TextSegment(prompt[text_start:]))
    return segments


def placeholders(segments: list[Segment]) -> list[PlaceholderSegment]:
    """The placeholders of a parsed template, in template order."""
    return [s for s in segments if isinstance(s, PlaceholderSegment)]


def input_names(segments: list[Segment]) -> list[str]:
    return [p.name for p in placeholders(segments) if not p.is_output]


def output_names(segments: list[Segment]) -> list[str]:
    return [p.name for p in placeholders(segments) if p.is_output]


def render_template(segments: list[Segment], values: Mapping[str, str], *, until: str | None = None) -> str:
    """Render the text of a template with ``values`` for its placeholders.

    With ``until=name`` rendering stops right before that placeholder (the prompt a completion API gets to
    generate that output: what a client-side framework such as LangChain sends). Otherwise every placeholder
    must have a value. A missing value raises TemplateError.
    """
    out: list[str] = []
    for seg in segments:
        if isinstance(seg, TextSegment):
            out.append(seg.text)
            continue
        if seg.name == until:
            return "".join(out)
        if seg.name not in values:
            raise TemplateError(f"no value for placeholder {seg}", param=seg.name)
        out.append(values[seg.name])
    if until is not None:
        raise TemplateError(f"template has no placeholder named {until!r}", param=until)
    return "".join(out)


def text_after(segments: list[Segment], name: str) -> str | None:
    """The constant text that directly follows placeholder ``name`` (None if another placeholder or the
    end of the template follows it). :func:`default_stop` picks an output's stop string from it."""
    for i, seg in enumerate(segments):
        if isinstance(seg, PlaceholderSegment) and seg.name == name:
            nxt = segments[i + 1] if i + 1 < len(segments) else None
            return nxt.text if isinstance(nxt, TextSegment) else None
    raise TemplateError(f"template has no placeholder named {name!r}", param=name)


def default_stop(segments: list[Segment], output: str) -> tuple[str, ...]:
    """Where ``output`` ends when its sampling names no stop: where the constant text after it begins.

    The stop is that text up to its first newline (trailing spaces dropped), or ``"\\n"`` if it starts with a
    newline (or its first line is blank); no stop if only spaces, another placeholder or the end follows. The
    frontend applies it when a function is defined, the server on a submit whose output names no ``stop``; an
    explicit ``stop`` (even an empty one) replaces it. An output under a constraint (``SamplingParams.constraint``)
    gets no default stop: its grammar says where it ends, and a stop inside the value would cut it.
    """
    following = text_after(segments, output)
    if not following:
        return ()
    head = following.split("\n", 1)[0].rstrip()
    if head.strip():
        return (head,)
    return ("\n",) if "\n" in following else ()
