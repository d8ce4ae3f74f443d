"""What a flow does to the prompts and values it builds (pure functions; parrot.manager.flows.runner uses them).

* :func:`inline_texts`: a prompt input that is a text step's value is replaced by that step's template, its
  placeholders bound to the text step's own inputs (recursively), so the prompt renders to the same text but its
  pieces are the ones it was built from (docs/flows.md, "Scheduling")::

      history2 = text("{{input:history}}Thought:{{input:t}}\nObservation: {{input:obs}}\n")
      prompt   = "{{input:history2}}Thought:{{output:t2}}"
            ->   "{{input:history}}Thought:{{input:t}}\nObservation: {{input:obs}}\nThought:{{output:t2}}"
                 (history itself expanded the same way, back to the loop's first prompt)

  Bounded: past MAX_INLINED_SEGMENTS pieces (a history that doubles each iteration) the inputs stay whole.
* :func:`tool_reading`: the tool a later step calls on a generate's output (a lookahead hint).
* :func:`split_items`: a map's items.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from parrot.common.template import PlaceholderSegment, Segment, TextSegment
from parrot.manager.flows.spec import BranchStep, Step, ToolStep
from parrot.manager.graph import PlaceholderBinding

MAX_INLINED_SEGMENTS = 2048  # pieces of one prompt after inlining text steps (beyond: not inlined)


class _TooLong(Exception):
    """Inlining went past MAX_INLINED_SEGMENTS: the prompt keeps its inputs whole."""


def inline_texts(segments: list[Segment], bindings: list[PlaceholderBinding],
                 texts: Mapping[str, tuple[tuple[Segment, ...], dict[str, str]]]
                 ) -> tuple[list[Segment], list[PlaceholderBinding]]:
    """Replace each input that is a text step's value (a key of ``texts``: var id -> its template's segments
    and {placeholder: var id}) by that step's template, recursively (see the module docstring). The prompt's
    prefix hashes then extend the previous iteration's request's: that places an iteration on the engine
    holding its predecessor's (paused) context, lets it reuse that KV, and fills a generated output as the very
    token ids it was generated as (parrot.manager.executor)."""
    by_name = {b.name: b for b in bindings}
    if not any(not b.is_output and b.var_id in texts and not b.transforms for b in bindings):
        return segments, bindings
    out_segs: list[Segment] = []
    out_binds: dict[str, PlaceholderBinding] = {b.name: b for b in bindings if b.is_output}
    names: set[str] = {b.name for b in bindings}

    def fresh(base: str) -> str:
        n, name = 1, base
        while name in names:
            n, name = n + 1, f"{base}_{n}"
        names.add(name)
        return name

    def emit(seg: Segment, var_for: dict[str, str], depth: int, transforms=()) -> None:
        if len(out_segs) > MAX_INLINED_SEGMENTS:  # e.g. a history that doubles each iteration
            raise _TooLong
        if isinstance(seg, TextSegment) or seg.is_output:
            out_segs.append(seg)
            return
        vid = var_for[seg.name]
        if vid in texts and not transforms and depth < 64:
            sub_segs, sub_ids = texts[vid]
            for sub in sub_segs:
                emit(sub, sub_ids, depth + 1)
            return
        name = seg.name if depth == 0 else fresh(seg.name)
        out_binds[name] = PlaceholderBinding(name, False, vid, None, tuple(transforms))
        out_segs.append(PlaceholderSegment(name, False))

    top = {b.name: b.var_id for b in bindings if not b.is_output and b.var_id is not None}
    try:
        for seg in segments:
            transforms = () if isinstance(seg, TextSegment) or seg.is_output else by_name[seg.name].transforms
            emit(seg, top, 0, transforms)
    except _TooLong:
        return segments, bindings  # the text values as whole pieces: correct, only less sharing
    merged: list[Segment] = []
    for seg in out_segs:  # adjacent constant texts are one piece, as a hand-written template would have
        if isinstance(seg, TextSegment) and merged and isinstance(merged[-1], TextSegment):
            merged[-1] = TextSegment(merged[-1].text + seg.text)
        elif not (isinstance(seg, TextSegment) and not seg.text):
            merged.append(seg)
    order = [s.name for s in merged if isinstance(s, PlaceholderSegment)]
    return merged, [out_binds[n] for n in order]


def tool_reading(step: Step, outs: set[str]) -> ToolStep | None:
    """The tool ``step`` calls on one of ``outs`` (a tool step, or the first such one in a branch's cases)."""
    if isinstance(step, ToolStep):
        return step if outs & set(step.refs) else None
    if isinstance(step, BranchStep):
        blocks = [c.block for c in step.cases] + ([step.default] if step.default is not None else [])
        for block in blocks:
            for inner in block.steps:
                found = tool_reading(inner, outs)
                if found is not None:
                    return found
    return None


def split_items(text: str, how: str) -> list[str] | None:
    if how == "lines":
        return [line.strip() for line in text.splitlines() if line.strip()]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list):
        return None
    return [i if isinstance(i, str) else json.dumps(i, ensure_ascii=False) for i in items]
