"""Flow conditions (parrot.manager.flows.conditions): evaluation of every kind, submission-time validation (message
and param), the wire round trip, and schema_has_path."""

from __future__ import annotations

import logging
import time

import pytest

from parrot.common.errors import InvalidRequestError
from parrot.manager.flows.conditions import (
    All,
    Any_,
    Contains,
    Equals,
    Json,
    Not,
    Number,
    Regex,
    format_path,
    leaves,
    parse_condition,
    parse_path,
    schema_has_path,
)

W = "steps[1].branch.cases[0].when"


def ev(spec: dict, **values: str) -> bool:
    cond = parse_condition(spec, W)
    assert set(cond.names()) <= set(values)
    return cond.evaluate(values)


# ---- leaves ----------------------------------------------------------------------------------------------------
def test_equals_strips_and_folds_case():
    c = {"kind": "equals", "var": "label", "value": "yes"}
    assert ev(c, label="  Yes\n")
    assert ev(c, label="YES")
    assert not ev(c, label="yes!")
    assert not ev(c, label="no")
    assert ev({**c, "value": "Straße"}, label="STRASSE")  # casefold, not lower
    cs = {**c, "case_sensitive": True}
    assert ev(cs, label=" yes ")
    assert not ev(cs, label="Yes")


def test_contains():
    c = {"kind": "contains", "var": "reply", "value": "final answer"}
    assert ev(c, reply="So the FINAL ANSWER: 4")
    assert not ev(c, reply="final  answer")
    assert not ev({**c, "case_sensitive": True}, reply="Final Answer: 4")
    assert ev({**c, "case_sensitive": True}, reply="my final answer")


def test_regex_search_and_case():
    c = {"kind": "regex", "var": "reply", "pattern": "^Final Answer:"}
    assert ev(c, reply="Final Answer: 4")
    assert not ev(c, reply="final answer: 4")  # case sensitive by default
    assert not ev(c, reply="The Final Answer: 4")  # anchored
    assert ev({**c, "case_sensitive": False}, reply="FINAL answer: 4")
    assert ev({"kind": "regex", "var": "r", "pattern": r"\d{3}"}, r="call 555 now")  # search, not match


def test_regex_timeout_is_false_and_logged(caplog):
    c = parse_condition({"kind": "regex", "var": "x", "pattern": "(a|aa)+$"}, W)
    text = "a" * 40 + "b"
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="parrot.manager.flows.conditions"):
        assert c.evaluate({"x": text}) is False
    assert time.monotonic() - t0 < 1.0
    assert any("timed out" in r.getMessage() for r in caplog.records)
    # the brief's classic pattern is also false (the regex module short-cuts it) and fast
    t0 = time.monotonic()
    assert parse_condition({"kind": "regex", "var": "x", "pattern": "(a+)+$"}, W).evaluate({"x": text}) is False
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize(
    ("path", "op", "value", "text", "expected"),
    [
        ("status", "==", "ok", '{"status": "ok"}', True),
        ("status", "==", "ok", '{"status": "bad"}', False),
        ("status", "!=", "ok", '{"status": "bad"}', True),
        ("a.b[1].c", "==", 3, '  {"a": {"b": [{}, {"c": 3.0}]}}\n', True),  # whitespace around, 3 == 3.0
        ("a.b[2].c", "==", 3, '{"a": {"b": [{}, {"c": 3}]}}', False),  # index out of range
        ("missing", "!=", "x", '{"a": 1}', False),  # a missing path is false even for !=
        ("n", ">=", 7, '{"n": 7}', True),
        ("n", "<", 7, '{"n": 7}', False),
        ("n", ">", 1, '{"n": "9"}', False),  # string vs number: no ordering
        ("s", "<", "b", '{"s": "a"}', True),
        ("flag", "==", True, '{"flag": true}', True),
        ("flag", "==", 1, '{"flag": true}', False),  # JSON true is not 1
        ("x", "==", None, '{"x": null}', True),
        ("l", "==", [1, "a"], '{"l": [1, "a"]}', True),
        ("[0]", "==", "first", '["first", "second"]', True),
        ("a", "==", 1, "not json", False),
        ("a", "==", 1, 'Sure: {"a": 1}', False),
        ("a", "==", 1, "[1, 2]", False),  # key on an array
        ("[0]", "==", 1, '{"0": 1}', False),  # index on an object
        ("", "==", 5, "5", True),  # the root
    ],
)
def test_json(path, op, value, text, expected):
    assert ev({"kind": "json", "var": "obj", "path": path, "op": op, "value": value}, obj=text) is expected


@pytest.mark.parametrize(
    ("op", "value", "text", "expected"),
    [
        (">=", 7, "Score: 7/10", True),
        (">=", 7, "Score: 6.5/10", False),
        ("<", 0, "it fell to -3.5 degrees", True),
        ("==", 1500, "1.5e3 units", True),
        ("!=", 2, "first 2 then 3", False),  # only the first number counts
        (">", 0, "no number here", False),
        ("!=", 0, "", False),
    ],
)
def test_number(op, value, text, expected):
    assert ev({"kind": "number", "var": "score", "op": op, "value": value}, score=text) is expected


def test_combinators_and_names():
    cond = parse_condition({"kind": "all", "conds": [
        {"kind": "contains", "var": "a", "value": "x"},
        {"kind": "not", "cond": {"kind": "equals", "var": "b", "value": "stop"}},
        {"kind": "any", "conds": [{"kind": "number", "var": "a", "op": ">", "value": 1},
                                  {"kind": "regex", "var": "c", "pattern": "go"}]},
    ]}, W)
    assert isinstance(cond, All)
    assert cond.names() == ("a", "b", "c")
    assert cond.evaluate({"a": "x 5", "b": "run", "c": ""})
    assert not cond.evaluate({"a": "x 0", "b": "run", "c": "stay"})
    assert cond.evaluate({"a": "x 0", "b": "run", "c": "let's go"})
    assert not cond.evaluate({"a": "x 5", "b": " STOP", "c": ""})
    assert [type(c) for c in leaves(cond)] == [Contains, Equals, Number, Regex]
    assert not parse_condition({"kind": "any", "conds": [{"kind": "equals", "var": "a", "value": "1"}]}, W).evaluate(
        {"a": "2"})
    assert isinstance(parse_condition({"kind": "any", "conds": [{"kind": "equals", "var": "a", "value": "1"}]}, W),
                      Any_)
    assert list(leaves(Equals("a", "b"))) == [Equals("a", "b")]


# ---- round trip ------------------------------------------------------------------------------------------------
ROUND_TRIP = [
    {"kind": "equals", "var": "label", "value": "yes", "case_sensitive": True},
    {"kind": "contains", "var": "reply", "value": "final answer", "case_sensitive": False},
    {"kind": "regex", "var": "reply", "pattern": "^Final Answer:", "case_sensitive": False},
    {"kind": "json", "var": "obj", "path": "a.b[0].c", "op": "<=", "value": 2.5},
    {"kind": "json", "var": "obj", "path": "[1].k", "op": "==", "value": {"x": [1, None]}},
    {"kind": "number", "var": "score", "op": ">=", "value": 7.0},
    {"kind": "not", "cond": {"kind": "all", "conds": [
        {"kind": "equals", "var": "a", "value": "x", "case_sensitive": False},
        {"kind": "any", "conds": [{"kind": "number", "var": "b", "op": "==", "value": -1.0}]}]}},
]


@pytest.mark.parametrize("wire", ROUND_TRIP)
def test_round_trip(wire):
    cond = parse_condition(wire, W)
    assert cond.to_json() == wire
    assert parse_condition(cond.to_json(), W) == cond


def test_defaults_are_filled_in_to_json():
    assert parse_condition({"kind": "regex", "var": "r", "pattern": "x"}, W).to_json()["case_sensitive"] is True
    assert parse_condition({"kind": "equals", "var": "r", "value": "x"}, W).to_json()["case_sensitive"] is False
    assert parse_condition({"kind": "json", "var": "o", "path": "a.b[0]", "op": "==", "value": 1}, W) == Json(
        "o", ("a", "b", 0), "==", 1)
    assert parse_condition({"kind": "not", "cond": {"kind": "number", "var": "n", "op": "<", "value": 3}}, W) == \
        Not(Number("n", "<", 3.0))


def test_paths():
    assert parse_path("a.b[0].c") == ("a", "b", 0, "c")
    assert parse_path("[2][0]") == (2, 0)
    assert parse_path("a.0") == ("a", "0")  # a dotted digit is a key
    assert parse_path("") == ()
    for p in ["a.b[0].c", "[2][0].x", "a.0", "with space.k"]:
        assert format_path(parse_path(p)) == p
    for bad in ["a..b", "a.", ".a", "a[0]c", "a[x]", "a[-1]", "a[0", "a]"]:
        with pytest.raises(ValueError):
            parse_path(bad)


# ---- validation ------------------------------------------------------------------------------------------------
def leaf(**kw) -> dict:
    return {"kind": "equals", "var": "x", "value": "y", **kw}


def nest(depth: int) -> dict:
    c: dict = leaf()
    for _ in range(depth - 1):
        c = {"kind": "not", "cond": c}
    return c


@pytest.mark.parametrize(
    ("obj", "param", "words"),
    [
        ("equals", W, ["must be an object", "str"]),
        ([leaf()], W, ["must be an object"]),
        ({"kind": "like", "var": "x"}, W + ".kind", ["'like'", "equals", "contains", "regex", "json", "number",
                                                       "not", "all", "any"]),
        ({"var": "x", "value": "y"}, W + ".kind", ["missing", "known kinds"]),
        ({"kind": "equals", "var": "x"}, W + ".value", ["needs the field 'value'"]),
        ({"kind": "json", "var": "x", "path": "a", "value": 1}, W + ".op", ["needs the field 'op'"]),
        (leaf(colour="red", size=2), W + ".colour", ["'colour'", "'size'", "unknown field"]),
        (leaf(var="1abc"), W + ".var", ["scope name", "'1abc'"]),
        (leaf(var="a" * 65), W + ".var", ["scope name"]),
        (leaf(var=3), W + ".var", ["scope name"]),
        (leaf(value=3), W + ".value", ["must be a string", "int"]),
        (leaf(case_sensitive="yes"), W + ".case_sensitive", ["true or false"]),
        ({"kind": "contains", "var": "x", "value": ""}, W + ".value", ["must not be empty"]),
        ({"kind": "regex", "var": "x", "pattern": "(unclosed"}, W + ".pattern", ["bad regex", "(unclosed"]),
        ({"kind": "regex", "var": "x", "pattern": "a" * 1001}, W + ".pattern", ["1001", "1000"]),
        ({"kind": "regex", "var": "x", "pattern": ["a"]}, W + ".pattern", ["must be a string"]),
        ({"kind": "number", "var": "x", "op": "=", "value": 1}, W + ".op", ["'='", "== != < <= > >="]),
        ({"kind": "number", "var": "x", "op": ">", "value": "7"}, W + ".value", ["finite number"]),
        ({"kind": "number", "var": "x", "op": ">", "value": True}, W + ".value", ["finite number"]),
        ({"kind": "number", "var": "x", "op": ">", "value": float("inf")}, W + ".value", ["finite number"]),
        ({"kind": "json", "var": "x", "path": "a..b", "op": "==", "value": 1}, W + ".path", ["empty key"]),
        ({"kind": "json", "var": "x", "path": 3, "op": "==", "value": 1}, W + ".path", ["must be a string"]),
        ({"kind": "json", "var": "x", "path": "a", "op": "<", "value": True}, W + ".value", ["number or a string"]),
        ({"kind": "json", "var": "x", "path": "a", "op": "==", "value": float("nan")}, W + ".value",
         ["JSON value"]),
        ({"kind": "json", "var": "x", "path": "a", "op": "~", "value": 1}, W + ".op", ["one of"]),
        ({"kind": "all", "conds": []}, W + ".conds", ["1 to 32"]),
        ({"kind": "any", "conds": [leaf()] * 33}, W + ".conds", ["1 to 32"]),
        ({"kind": "any", "conds": leaf()}, W + ".conds", ["list"]),
        ({"kind": "all", "conds": [leaf(), leaf(var="")]}, W + ".conds[1].var", ["scope name"]),
        ({"kind": "not", "cond": {"kind": "nope"}}, W + ".cond.kind", ["unknown condition kind"]),
        (nest(9), W + ".cond" * 8, ["8 levels"]),
    ],
)
def test_validation_errors(obj, param, words):
    with pytest.raises(InvalidRequestError) as ei:
        parse_condition(obj, W)
    assert ei.value.param == param
    for w in words:
        assert w in ei.value.message, (w, ei.value.message)


def test_depth_limit_is_eight_levels():
    assert len(list(leaves(parse_condition(nest(8), W)))) == 1


# ---- schema_has_path -------------------------------------------------------------------------------------------
SCHEMA = {
    "$defs": {"Item": {"type": "object", "properties": {"name": {"type": "string"}}, "additionalProperties": False}},
    "definitions": {"Old": {"type": "object", "properties": {"legacy": {"type": "integer"}}}},
    "type": "object",
    "properties": {
        "status": {"enum": ["ok", "error"]},
        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
        "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#/definitions/Old"}],
                 "items": False},
        "few": {"type": "array", "maxItems": 2},
        "result": {"anyOf": [{"type": "object", "properties": {"value": {"type": "number"}}},
                             {"type": "object", "properties": {"error": {"type": "string"}}}]},
        "both": {"allOf": [{"properties": {"a": {}}}, {"required": ["a"]}]},
        "free": {"type": "object"},
        "map": {"type": "object", "additionalProperties": {"type": "object", "properties": {"n": {}}}},
        "pat": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
        "const": {"const": {"k": [1]}},
        "scalar": {"type": "string"},
    },
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("", True),
        ("status", True),
        ("stauts", False),  # a typo: not in properties, additionalProperties false
        ("status.x", False),  # an enum of strings has no keys
        ("items[5].name", True),  # $ref to $defs
        ("items[0].nom", False),
        ("items.name", False),  # a key on an array
        ("pair[0]", True),
        ("pair[1].legacy", True),  # $ref to definitions through prefixItems
        ("pair[2]", False),  # items: false after the prefix
        ("few[1]", True),
        ("few[2]", False),  # maxItems
        ("result.value", True),  # anyOf: one branch has it
        ("result.error", True),
        ("result.other", False),
        ("both.a", True),
        ("both.b", False),  # allOf: every branch must allow it
        ("free.anything.deep[3]", True),  # a free-form object
        ("map.whatever.n", True),
        ("map.whatever.m", False),
        ("pat.x_1", True),
        ("pat.y", False),
        ("const.k[0]", True),
        ("const.k[1]", False),
        ("scalar.x", False),
    ],
)
def test_schema_has_path(path, expected):
    assert schema_has_path(SCHEMA, parse_path(path)) is expected


def test_schema_has_path_edge_cases():
    assert schema_has_path(True, ("a", 0))
    assert not schema_has_path(False, ())
    assert schema_has_path({}, ("a", 0, "b"))
    assert schema_has_path({"$ref": "https://example.com/s.json"}, ("a",))  # remote: benefit of the doubt
    recursive = {"$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}, "v": {}}}},
                 "$ref": "#/$defs/N"}
    assert schema_has_path(recursive, ("next", "next", "next", "v"))
    assert not schema_has_path(recursive, ("next", "w"))
    loop = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
    assert schema_has_path(loop, ("x",))  # a ref cycle terminates
    one_of = {"oneOf": [{"type": "array", "items": {"type": "string"}}, {"type": "object",
                                                                        "properties": {"a": {}}}]}
    assert schema_has_path(one_of, (0,))
    assert schema_has_path(one_of, ("a",))
    assert not schema_has_path(one_of, ("b",))
    assert not schema_has_path(one_of, (0, "x"))
