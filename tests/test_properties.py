"""Property tests (hypothesis) for what clients send as data (issue 19, item 6): the template parser, transform
specs and their application, sampling parameters and output constraints. On any input each either succeeds
with a well-formed result or raises its typed 4xx error; nothing else escapes (no crash on any input)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parrot.common.constraints import Constraint
from parrot.common.errors import BadSamplingParams, TemplateError, TransformFailed, TransformSpecError
from parrot.common.sampling import SamplingParams
from parrot.common.template import PlaceholderSegment, TextSegment, parse_template, render_template
from parrot.common.transforms import apply_transforms, validate_transforms

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)

# template-ish text: braces, colons and names appear far more often than in uniform text
TEMPLATE_CHARS = st.sampled_from(["{", "}", "{{", "}}", ":", "input", "output", "x", "y_1", " ", "\n", "é", "{{input:a}}",
                                  "{{output:b}}", "\\"])
template_text = st.lists(st.one_of(TEMPLATE_CHARS, st.text(max_size=5)), max_size=30).map("".join)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                                                    max_size=4), max_leaves=12)


@FAST
@given(template_text)
def test_templates_parse_or_fail_with_a_template_error(text):
    try:
        segments = parse_template(text)
    except TemplateError as e:
        assert e.status_code == 400 and str(e)
        return
    names = [s.name for s in segments if isinstance(s, PlaceholderSegment)]
    assert len(names) == len(set(names))  # one placeholder per name
    # rendering with every placeholder bound is the constant text with each value in its place
    values = {n: f"<{n}>" for n in names}
    expect = "".join(s.text if isinstance(s, TextSegment) else values[s.name] for s in segments)
    assert render_template(segments, values) == expect


@FAST
@given(st.lists(st.dictionaries(st.sampled_from(["op", "path", "pattern", "group", "index", "text", "old", "new",
                                                 "chars", "extra"]),
                                st.one_of(st.sampled_from(["strip", "json", "regex", "lines", "truncate", "replace",
                                                           "first_line", "eval", "a.b.0", "(a+)+", "[0-9]+"]),
                                          st.integers(-5, 5), st.text(max_size=6), st.none(), st.booleans())),
                max_size=4),
       st.text(max_size=60))
def test_transform_specs_validate_or_fail_typed_and_apply_or_fail_typed(specs, text):
    try:
        transforms = validate_transforms(specs)
    except TransformSpecError as e:
        assert e.status_code == 400
        return
    try:
        out = apply_transforms(transforms, text)
    except TransformFailed as e:
        assert e.status_code == 422
        return
    assert isinstance(out, str)


@FAST
@given(json_values, st.sampled_from(["", "a", "a.b", "0", "a.0.b"]))
def test_the_json_transform_on_any_json_text(value, path):
    text = json.dumps(value)
    specs = [{"op": "json", "path": path}] if path else [{"op": "strip"}]
    try:
        out = apply_transforms(validate_transforms(specs), text)
    except (TransformFailed, TransformSpecError):
        return
    assert isinstance(out, str)


@FAST
@given(st.dictionaries(st.sampled_from(["max_tokens", "min_tokens", "temperature", "top_p", "top_k", "stop",
                                        "repetition_penalty", "presence_penalty", "seed", "logprobs", "ignore_eos",
                                        "stop_token_ids", "constraint", "bogus"]),
                       json_values, max_size=6))
def test_sampling_params_from_any_dict_are_valid_or_a_400(d):
    try:
        sp = SamplingParams.from_dict(d)
    except BadSamplingParams as e:
        assert e.status_code == 400 and e.param
        return
    assert sp.max_tokens >= 1 and 0.0 < sp.top_p <= 1.0
    assert SamplingParams.from_dict(json.loads(json.dumps(sp.to_dict()))) == sp  # the wire round-trips it


@FAST
@given(st.sampled_from(["json_schema", "regex", "choice", "grammar", "json_object", "xml"]), json_values)
def test_constraints_from_any_spec_compile_or_are_a_400(kind, spec):
    try:
        c = Constraint.from_dict({"kind": kind, "spec": spec if isinstance(spec, str) else json.dumps(spec)})
    except BadSamplingParams as e:
        assert e.param == "constraint"
        return
    assert c.llguidance_grammar()  # whatever was accepted builds a grammar
