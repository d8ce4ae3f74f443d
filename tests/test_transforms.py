"""Declarative transforms: each op's behaviour, every validation error, every runtime failure, regex guards."""

import dataclasses

import pytest

from parrot.common import transforms as T
from parrot.common.errors import TransformFailed, TransformSpecError
from parrot.common.transforms import Transform, apply_transforms, validate_transform, validate_transforms


def run(specs, text):
    return apply_transforms(validate_transforms(specs), text)


@pytest.mark.parametrize("specs, text, expected", [
    ([{"op": "strip"}], "  hi \n", "hi"),
    ([{"op": "first_line"}], "\n  \nfirst\nsecond", "first"),
    ([{"op": "first_line"}], "", ""),
    ([{"op": "lines", "index": 1}], "a\nb\nc", "b"),
    ([{"op": "lines", "index": -1}], "a\nb\nc", "c"),
    ([{"op": "regex", "pattern": r"Answer: (\w+)", "group": 1}], "x Answer: yes!", "yes"),
    ([{"op": "regex", "pattern": r"\d+"}], "abc 42 7", "42"),
    ([{"op": "regex", "pattern": r"(?P<n>\d+)", "group": "n"}], "n=5", "5"),
    ([{"op": "json", "path": "a.b.0"}], '{"a": {"b": ["x", 2]}}', "x"),
    ([{"op": "json", "path": "a.b.1"}], '{"a": {"b": ["x", 2]}}', "2"),
    ([{"op": "json", "path": "a"}], '{"a": {"k": [1, "é"]}}', '{"k": [1, "é"]}'),
    ([{"op": "json", "path": "a.-1"}], '{"a": [1, 2, 3]}', "3"),
    ([{"op": "json", "path": "a"}], 'Sure! Here it is: {"a": "v"} hope it helps', "v"),
    ([{"op": "json", "path": "a"}], '```json\n{"a": null}\n```', "null"),
    ([{"op": "remove_prefix", "text": "A: "}], "A: yes", "yes"),
    ([{"op": "remove_prefix", "text": "A: "}], "yes", "yes"),
    ([{"op": "remove_suffix", "text": "</s>"}], "ok</s>", "ok"),
    ([{"op": "lower"}], "MiXeD", "mixed"),
    ([{"op": "upper"}], "MiXeD", "MIXED"),
    ([{"op": "replace", "old": "a", "new": "o"}], "banana", "bonono"),
    ([{"op": "truncate", "chars": 3}], "abcdef", "abc"),
    ([{"op": "truncate", "chars": 0}], "abcdef", ""),
    ([], "unchanged", "unchanged"),
    ([{"op": "strip"}, {"op": "first_line"}, {"op": "remove_prefix", "text": "Title: "}, {"op": "upper"}],
     "\n Title: parrot\nbody", "PARROT"),
])
def test_ops(specs, text, expected):
    assert run(specs, text) == expected


def test_builders_produce_valid_specs():
    specs = [T.strip(), T.first_line(), T.lines(0), T.regex_group(r"(\w+)", 1), T.json_field("a"),
             T.remove_prefix("x"), T.remove_suffix("y"), T.lower(), T.upper(), T.replace("a", "b"), T.truncate(9)]
    ts = validate_transforms(specs)
    assert [t.op for t in ts] == ["strip", "first_line", "lines", "regex", "json", "remove_prefix",
                                  "remove_suffix", "lower", "upper", "replace", "truncate"]
    assert [t.to_spec() for t in ts] == specs  # round trip: what the frontend sends is what the server checks


def test_defaults_filled_and_transform_instances_accepted():
    t = validate_transform({"op": "regex", "pattern": "a"})
    assert t.to_spec() == {"op": "regex", "pattern": "a", "group": 0}
    assert validate_transforms([t])[0] == t
    assert validate_transforms(None) == []


@pytest.mark.parametrize("spec, fragment", [
    ({"op": "nope"}, "unknown transform op 'nope'"),
    ({}, "unknown transform op None"),
    ({"op": 3}, "unknown transform op 3"),
    ("strip", "must be an object"),
    ({"op": "strip", "x": 1}, "unexpected argument(s) ['x']"),
    ({"op": "lines"}, "needs argument 'index'"),
    ({"op": "lines", "index": "0"}, "'index' must be int, got str"),
    ({"op": "lines", "index": True}, "'index' must be int, got bool"),
    ({"op": "truncate", "chars": 1.5}, "'chars' must be int, got float"),
    ({"op": "truncate", "chars": -1}, "'chars' must be >= 0"),
    ({"op": "regex"}, "needs argument 'pattern'"),
    ({"op": "regex", "pattern": "(", "group": 0}, "invalid regex pattern"),
    ({"op": "regex", "pattern": "a", "group": 1}, "group 1 out of range"),
    ({"op": "regex", "pattern": "(a)", "group": -1}, "group -1 out of range"),
    ({"op": "regex", "pattern": "(a)", "group": "name"}, "no group named 'name'"),
    ({"op": "regex", "pattern": "(a)", "group": [1]}, "must be int or str, got list"),
    ({"op": "regex", "pattern": "a" * 513}, "regex pattern too long (513 > 512"),
    ({"op": "regex", "pattern": "(a+)+$"}, "nests quantifiers"),
    ({"op": "regex", "pattern": "(x|y*)*z"}, "nests quantifiers"),
    ({"op": "regex", "pattern": "((ab)*c){2,}"}, "nests quantifiers"),
    ({"op": "json"}, "needs argument 'path'"),
    ({"op": "json", "path": ""}, "json path ''"),
    ({"op": "json", "path": "a..b"}, "json path 'a..b'"),
    ({"op": "remove_prefix", "text": ""}, "'text' must not be empty"),
    ({"op": "replace", "old": "", "new": "x"}, "'old' must not be empty"),
    ({"op": "replace", "old": "a"}, "needs argument 'new'"),
    ({"op": "replace", "old": "a" * 10_001, "new": ""}, "longer than 10000"),
])
def test_spec_errors(spec, fragment):
    with pytest.raises(TransformSpecError) as ei:
        validate_transforms([{"op": "strip"}, spec])
    assert fragment in str(ei.value)
    assert str(ei.value).startswith("transform #1: ")
    assert ei.value.status_code == 400 and ei.value.code == "bad_transform"


def test_list_level_errors():
    with pytest.raises(TransformSpecError, match="must be a list"):
        validate_transforms({"op": "strip"})  # type: ignore[arg-type]
    with pytest.raises(TransformSpecError, match="at most 16 transforms"):
        validate_transforms([{"op": "strip"}] * 17)


@pytest.mark.parametrize("pattern", [r"(\d+)-(\d+)", r"[(a+)+]", r"\(a+\)+", r"(a+)?b", r"(ab)+", r"x{", r"a{2,3}"])
def test_safe_patterns_accepted(pattern):
    validate_transform({"op": "regex", "pattern": pattern})


@pytest.mark.parametrize("specs, text, fragment", [
    ([{"op": "lines", "index": 3}], "a\nb", "index 3 out of range for a text of 2 line(s)"),
    ([{"op": "lines", "index": 0}], "", "out of range for a text of 0 line(s)"),
    ([{"op": "regex", "pattern": r"Answer: (\w+)", "group": 1}], "no answer", "did not match 'no answer'"),
    ([{"op": "regex", "pattern": r"(a)|(b)", "group": 2}], "a", "group 2 did not take part"),
    ([{"op": "json", "path": "a"}], "not json at all", "not valid JSON"),
    ([{"op": "json", "path": "a"}], '{"a": ', "not valid JSON"),
    ([{"op": "json", "path": "a.b"}], '{"a": {"c": 1}}', "key 'b' not found at 'a'"),
    ([{"op": "json", "path": "x"}], '{"a": 1}', "key 'x' not found at '$'"),
    ([{"op": "json", "path": "a.k"}], '{"a": [1]}', "'a' is a list; 'k' is not an index"),
    ([{"op": "json", "path": "a.5"}], '{"a": [1]}', "index 5 out of range at 'a' (length 1)"),
    ([{"op": "json", "path": "a.b"}], '{"a": 3}', "cannot descend into int at 'a'"),
])
def test_runtime_failures(specs, text, fragment):
    with pytest.raises(TransformFailed) as ei:
        run([{"op": "strip"}] + specs, text)
    assert fragment in str(ei.value)
    assert str(ei.value).startswith("transform #1 (")
    assert ei.value.code == "transform_failed"


def test_regex_input_length_limit():
    with pytest.raises(TransformFailed, match="exceeds the limit"):
        run([{"op": "regex", "pattern": "a"}], "a" * (T.MAX_REGEX_INPUT_CHARS + 1))


class _BudgetSpy:
    """A compiled pattern that records the ``timeout`` of every search and refuses a search without one."""

    def __init__(self, compiled):
        self.compiled, self.timeouts = compiled, []

    def search(self, text, *args, timeout=None, **kwargs):
        assert timeout is not None, "regex search without a time budget"
        self.timeouts.append(timeout)
        return self.compiled.search(text, *args, timeout=timeout, **kwargs)


def test_regex_time_budget_stops_backtracking(monkeypatch):
    """An alternation with overlapping branches is exponential (2**40 paths here) yet passes the nesting
    scan: the search runs with the configured budget and the engine's timeout becomes TransformFailed."""
    monkeypatch.setattr(T, "REGEX_TIMEOUT_S", 0.05)
    t = validate_transform({"op": "regex", "pattern": r"^(a|a)*$"})
    spy = _BudgetSpy(t.compiled)
    with pytest.raises(TransformFailed, match=r"exceeded its time budget of 0\.05 s"):
        apply_transforms([dataclasses.replace(t, compiled=spy)], "a" * 40 + "b")
    assert spy.timeouts == [0.05]  # the budget given to the regex engine is REGEX_TIMEOUT_S


def test_transform_is_frozen_data():
    t = validate_transform({"op": "truncate", "chars": 2})
    assert isinstance(t, Transform) and t.arg("chars") == 2
    with pytest.raises(AttributeError):
        t.op = "upper"  # type: ignore[misc]
