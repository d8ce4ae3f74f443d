"""Validation of a submit (paper §7): template, placeholders, per-output sampling and transforms.

Turns the wire-level :class:`SubmitSpec` into template segments and :class:`PlaceholderBinding` s, raising
400-class errors that name the problem. The default stop of an output
(:func:`~parrot.common.template.default_stop`, the frontend's rule too) is decided here, once, so the executor
only runs what the binding says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from parrot.common.errors import InvalidRequestError, TemplateError
from parrot.common.sampling import SamplingParams
from parrot.common.template import PlaceholderSegment, Segment, default_stop, parse_template
from parrot.common.transforms import validate_transforms
from parrot.manager.graph import PlaceholderBinding

MAX_PROMPT_CHARS = 1_000_000


@dataclass(frozen=True)
class PlaceholderSpec:
    name: str
    is_output: bool
    var_id: str | None = None
    sampling: dict | None = None
    transforms: Sequence[dict] = ()


@dataclass(frozen=True)
class SubmitSpec:
    prompt: str
    placeholders: Sequence[PlaceholderSpec]
    models: Sequence[str] = ()
    name: str | None = None  # the semantic function's name, for DAG dumps


def build_bindings(spec: SubmitSpec) -> tuple[list[Segment], list[PlaceholderBinding]]:
    """Parse and cross-check a submit. Raises TemplateError, BadSamplingParams, TransformSpecError or
    InvalidRequestError (all 400)."""
    if len(spec.prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequestError(f"prompt has {len(spec.prompt)} characters (limit {MAX_PROMPT_CHARS})",
                                  param="prompt")
    segments = parse_template(spec.prompt)
    in_template = {s.name: s for s in segments if isinstance(s, PlaceholderSegment)}
    listed: dict[str, PlaceholderSpec] = {}
    for p in spec.placeholders:
        if p.name in listed:
            raise TemplateError(f"placeholder {p.name!r} is listed twice", param="placeholders")
        listed[p.name] = p
    missing = [n for n in in_template if n not in listed]
    if missing:
        raise TemplateError(f"placeholder(s) {missing} of the prompt are not listed in 'placeholders'",
                            param="placeholders")
    extra = [n for n in listed if n not in in_template]
    if extra:
        raise TemplateError(f"placeholder(s) {extra} are listed but not in the prompt", param="placeholders")
    bindings: list[PlaceholderBinding] = []
    for name, seg in in_template.items():
        p = listed[name]
        if p.is_output != seg.is_output:
            raise TemplateError(f"placeholder {name!r} is {seg.kind} in the prompt but listed with "
                                f"is_output={p.is_output}", param="placeholders")
        transforms = tuple(validate_transforms(list(p.transforms or ())))
        if not p.is_output:
            if p.sampling:
                raise InvalidRequestError(f"input placeholder {name!r} cannot have sampling parameters",
                                          param="placeholders")
            bindings.append(PlaceholderBinding(name, False, p.var_id, None, transforms))
            continue
        sampling = SamplingParams.from_dict(dict(p.sampling or {}))
        # an explicit stop (even an empty list) is the caller's choice; a constrained output ends with its grammar
        if "stop" not in (p.sampling or {}) and sampling.constraint is None:
            stop = default_stop(segments, name)
            if stop:
                sampling = sampling.replace(stop=stop)
        bindings.append(PlaceholderBinding(name, True, p.var_id, sampling, transforms))
    if not any(b.is_output for b in bindings):
        raise TemplateError("the prompt has no {{output:NAME}} placeholder: nothing to generate", param="prompt")
    return segments, bindings
