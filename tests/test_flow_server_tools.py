"""Server tools of flows (parrot.manager.flows.server_tools): results, errors, bounds, and submission checks."""

from __future__ import annotations

import json
import time

import pytest

from parrot.common.errors import InvalidRequestError
from parrot.manager.flows.server_tools import (
    SERVER_TOOLS,
    ServerTool,
    ToolError,
    check_args,
    format_number,
)


def run(name: str, **args: str) -> str:
    return SERVER_TOOLS[name].run(args)


def fails(name: str, **args: str) -> str:
    with pytest.raises(ToolError) as ei:
        run(name, **args)
    return str(ei.value)


def test_registry():
    assert set(SERVER_TOOLS) == {"calculator", "search_text", "json_validate", "json_get", "regex_extract"}
    for name, tool in SERVER_TOOLS.items():
        assert isinstance(tool, ServerTool) and tool.name == name and tool.description
    assert SERVER_TOOLS["search_text"].params == ("query", "text")
    assert SERVER_TOOLS["search_text"].optional == ("top_k",)


# ---- calculator ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I will calculate 12 / 3 now", "4"),
        ("10 / 4", "2.5"),
        ("Action: calculator[15 * 10]", "150"),
        ("What is (3 + 4) * 2?", "14"),
        ("-(2 + 3) * 4.5", "-22.5"),
        ("2 ** 10", "1024"),
        ("2^10", "1024"),
        ("2 ** -1", "0.5"),
        ("-2 ** 2", "-4"),  # ** binds tighter than unary minus, as in Python
        ("2 ** 3 ** 2", "512"),  # right associative
        ("7 // 2 and 7 % 2", "3"),  # the first expression only
        ("17 % 5", "2"),
        ("1 / 3", "0.333333333333"),
        ("2 ** 64", "18446744073709551616"),  # exact for integers
        ("0.1 + 0.2", "0.3"),
        ("1.5e3 + 1", "1501"),
        ("In 2023 we sold 5 + 3 boats", "8"),  # a lone number is not arithmetic
        ("Step 1. 2 + 2.", "4"),
        ("Answer (approx): 5 * 3", "15"),
        ("((((1 + 2))))", "3"),
        ("calc(12 / 3", "4"),  # a stray parenthesis is dropped
        ("6 × 7", "42"),
        ("007 + 1", "8"),
        ("10 ** 64", "1" + "0" * 64),  # the largest exponent allowed
    ],
)
def test_calculator(text, expected):
    assert run("calculator", expression=text) == expected


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("no maths here", ["no arithmetic expression", "no maths here"]),
        ("just 42", ["no arithmetic expression"]),
        ("3 -", ["no arithmetic expression"]),
        ("1 / 0", ["division by zero"]),
        ("5 // (2 - 2)", ["division by zero"]),
        ("5 % 0", ["division by zero"]),
        ("0 ** -1", ["division by zero"]),
        ("2 ** 1000000000", ["exponent", "too large"]),
        ("9 ** 65", ["exponent", "64"]),
        ("1e300 * 10", ["result too large"]),
        ("(10 ** 60) ** 60", ["result too large"]),
        ("1" * 400 + " + 1", ["too large"]),
        ("(-8) ** 0.5", ["not a real number"]),
        ("(" * 200 + "1" + ")" * 200 + " + 1", ["nested"]),
    ],
)
def test_calculator_errors(text, words):
    msg = fails("calculator", expression=text)
    for w in words:
        assert w in msg, msg


def test_calculator_bounds_are_fast():
    t0 = time.monotonic()
    assert "too large" in fails("calculator", expression="(" + " * ".join(["10 ** 60"] * 100) + ")")
    assert "longer than" in fails("calculator", expression=" + ".join(["1"] * 2000))
    assert "no arithmetic" in fails("calculator", expression="word " * 200_000)  # 1 MB of text, no numbers
    assert "larger than" in fails("calculator", expression="1+" * 1_000_000)  # 2 MB
    assert time.monotonic() - t0 < 2.0


def test_format_number():
    assert format_number(4.0) == "4"
    assert format_number(-0.0) == "0"
    assert format_number(150) == "150"
    assert format_number(2.5) == "2.5"
    assert format_number(1e20) == "1e+20"


# ---- search_text -----------------------------------------------------------------------------------------------
TEXT = ("Paris is the capital of France. The Eiffel Tower stands in Paris and attracts many tourists!\n\n"
        "Berlin is the capital city of Germany. Short one. Does Germany border France? Yes it does, on the west")


def test_search_text_best_sentence():
    assert run("search_text", query="What is the capital of Germany?", text=TEXT) == \
        "Berlin is the capital city of Germany."
    # stemming: "tourist" matches "tourists"; ties go to the earlier sentence
    assert run("search_text", query="tourist", text=TEXT) == \
        "The Eiffel Tower stands in Paris and attracts many tourists!"
    assert run("search_text", query="capital", text=TEXT) == "Paris is the capital of France."


def test_search_text_top_k_and_ranking():
    out = run("search_text", query="Germany France capital", text=TEXT, top_k="3")
    assert out.split("\n") == [
        "Paris is the capital of France.",  # 2 terms, earliest
        "Berlin is the capital city of Germany.",  # 2 terms
        "Does Germany border France?",  # 2 terms, latest
    ]
    # fragments under 4 words are dropped
    assert "Short one." not in run("search_text", query="short one", text=TEXT + " Short one indeed here.",
                                   top_k="10")


def test_search_text_cuts_long_sentences_and_uses_short_text():
    long = "alpha " * 200 + "end."
    assert len(run("search_text", query="alpha", text=long)) == 500
    assert run("search_text", query="Paris", text="Paris!") == "Paris!"  # nothing of 4 words: keep what there is


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"query": "x", "text": "  \n "}, ["empty"]),
        ({"query": "the and of", "text": TEXT}, ["no content terms"]),
        ({"query": "zebra", "text": TEXT}, ["no sentence", "zebra"]),
        ({"query": "Paris", "text": TEXT, "top_k": "0"}, ["1 to 10"]),
        ({"query": "Paris", "text": TEXT, "top_k": "11"}, ["1 to 10"]),
        ({"query": "Paris", "text": TEXT, "top_k": "two"}, ["1 to 10", "two"]),
        ({"query": "Paris", "text": "x" * 2_000_000}, ["larger than"]),
    ],
)
def test_search_text_errors(args, words):
    msg = fails("search_text", **args)
    for w in words:
        assert w in msg, msg


# ---- json_validate ---------------------------------------------------------------------------------------------
PERSON = json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                                                      "age": {"type": "integer", "minimum": 0},
                                                      "tags": {"type": "array", "items": {"type": "string"}}},
                     "required": ["name"], "additionalProperties": False})


@pytest.mark.parametrize(
    "value",
    [
        '{"name": "Zoë", "age": 3}',
        '```json\n{"name": "Zoë", "age": 3}\n```',
        '```\n{"name": "Zoë", "age": 3}\n```',
        'Here is the JSON: {"name": "Zoë", "age": 3} -- hope it helps',
        '\n  {"name": "Zoë", "age": 3}  \n',
    ],
)
def test_json_validate_ok(value):
    assert run("json_validate", value=value, schema=PERSON) == '{"name": "Zoë", "age": 3}'


def test_json_validate_embedded_array():
    assert run("json_validate", value='Result: [1, 2] done', schema='{"type": "array"}') == "[1, 2]"


@pytest.mark.parametrize(
    ("value", "schema", "words"),
    [
        ('{"name": 5}', PERSON, ["at $.name: 5 is not of type 'string'"]),
        ('{"age": -1}', PERSON, ["'name' is a required property", "at $.age:", "minimum"]),
        ('{"name": "a", "extra": 1}', PERSON, ["'extra'", "not allowed"]),
        ('{"name": "a", "tags": ["x", 1]}', PERSON, ["at $.tags[1]:"]),
        ('[1, "a", "b", "c", "d"]', '{"items": {"type": "integer"}}', ["$[1]", "$[2]", "$[3]", "(and more)"]),
        ('{"name": ', PERSON, ["not valid JSON", "line 1 column"]),
        ("no json at all", PERSON, ["not valid JSON"]),
        ('{"a": 1}', '{"type": ', ["schema is not valid JSON"]),
        ('{"a": 1}', '{"type": 5}', ["invalid schema", "$.type"]),
        ('{"a": 1}', '{"$ref": "#/$defs/missing"}', ["invalid schema", "unresolvable"]),
        ('{"a": 1}', '{"$ref": "https://example.com/remote.json"}', ["unresolvable"]),
        ('{"d": "not a date"}', '{"properties": {"d": {"format": "date"}}}', ["is not a 'date'"]),
        ('{"s": "' + "a" * 40 + 'b"}', '{"properties": {"s": {"pattern": "(a|aa)+$"}}}', ["100 ms"]),
        ('{"' + "a" * 40 + 'b": 1}', '{"patternProperties": {"(a|aa)+$": {}}}', ["100 ms"]),
        ("[" * 100_000 + "]" * 100_000, "{}", ["nested too deeply"]),
    ],
)
def test_json_validate_errors(value, schema, words):
    msg = fails("json_validate", value=value, schema=schema)
    for w in words:
        assert w in msg, msg


def test_json_validate_lists_at_most_three_errors():
    msg = fails("json_validate", value="[" + ", ".join(f'"{i}"' for i in range(50)) + "]",
                schema='{"items": {"type": "integer"}}')
    assert msg.count("at $[") == 3


def test_json_validate_pattern_ok_and_big_input():
    assert run("json_validate", value='{"id": "ab12"}',
               schema='{"properties": {"id": {"pattern": "^[a-z]+\\\\d+$"}}}') == '{"id": "ab12"}'
    assert "larger than" in fails("json_validate", value='"' + "x" * 2_000_000 + '"', schema="{}")


# ---- json_get --------------------------------------------------------------------------------------------------
DOC = '{"a": {"b": [{"c": "hi"}, {"c": [1, 2], "d": null, "e": true}]}, "n": 2.5, "u": "é"}'


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("a.b[0].c", "hi"),  # strings bare
        ("a.b[1].c", "[1,2]"),  # others as compact JSON
        ("a.b[1].d", "null"),
        ("a.b[1].e", "true"),
        ("n", "2.5"),
        ("u", "é"),
        ("a.b[0]", '{"c":"hi"}'),
        ("", json.dumps(json.loads(DOC), ensure_ascii=False, separators=(",", ":"))),
    ],
)
def test_json_get(path, expected):
    assert run("json_get", value=DOC, path=path) == expected


def test_json_get_fenced_and_errors():
    assert run("json_get", value='```json\n{"status": "ok"}\n```', path="status") == "ok"
    assert "no value at path 'a.b[5].c'" in fails("json_get", value=DOC, path="a.b[5].c")
    assert "no value at path 'a.x'" in fails("json_get", value=DOC, path="a.x")
    assert "empty key" in fails("json_get", value=DOC, path="a..b")
    assert "not valid JSON" in fails("json_get", value="nope", path="a")


# ---- regex_extract ---------------------------------------------------------------------------------------------
def test_regex_extract():
    text = "Thought: look it up\nAction: search[capital of France]"
    assert run("regex_extract", text=text, pattern=r"Action: (\w+)\[") == "search"
    assert run("regex_extract", text=text, pattern=r"\[(.*)\]") == "capital of France"
    assert run("regex_extract", text=text, pattern=r"\[.*\]") == "[capital of France]"  # no group: whole match
    assert run("regex_extract", text=text, pattern=r"(?i)ACTION") == "Action"
    assert run("regex_extract", text="ab", pattern=r"a(x)?") == ""  # group 1 did not take part


def test_regex_extract_errors():
    assert "does not match" in fails("regex_extract", text="abc", pattern=r"\d+")
    assert "bad regex pattern '('" in fails("regex_extract", text="abc", pattern="(")
    t0 = time.monotonic()
    assert "100 ms" in fails("regex_extract", text="a" * 40 + "b", pattern=r"(a|aa)+$")
    assert time.monotonic() - t0 < 1.0
    assert "larger than" in fails("regex_extract", text="x" * 2_000_000, pattern="x")
    assert "longer than" in fails("regex_extract", text="x", pattern="x" * 10_001)


def test_run_rejects_bad_args():
    assert "missing" in fails("regex_extract", text="x")
    with pytest.raises(ToolError, match="unknown"):
        SERVER_TOOLS["json_get"].run({"value": "{}", "path": "a", "extra": "1"})
    with pytest.raises(ToolError, match="must be a string"):
        SERVER_TOOLS["json_get"].run({"value": {}, "path": "a"})  # type: ignore[dict-item]


# ---- check_args ------------------------------------------------------------------------------------------------
WHERE = "steps[2].tool"


def test_check_args_ok():
    assert check_args("search_text", ["query", "text"], WHERE) is SERVER_TOOLS["search_text"]
    assert check_args("search_text", {"query", "text", "top_k"}, WHERE).name == "search_text"


@pytest.mark.parametrize(
    ("name", "given", "param", "words"),
    [
        ("web_search", ["q"], WHERE + ".name", ["'web_search'", "calculator", "regex_extract", "client"]),
        ("json_get", ["value"], WHERE + ".args", ["'path'"]),
        ("calculator", [], WHERE + ".args", ["'expression'"]),
        ("calculator", ["expression", "precision"], WHERE + ".args.precision", ["'precision'", "expression"]),
    ],
)
def test_check_args_errors(name, given, param, words):
    with pytest.raises(InvalidRequestError) as ei:
        check_args(name, given, WHERE)
    assert ei.value.param == param
    for w in words:
        assert w in ei.value.message, ei.value.message
