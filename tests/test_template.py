"""parse_template / render_template / text_after / default_stop: segments, and every error path with its position."""

import pytest

from parrot.common.errors import TemplateError
from parrot.common.template import (
    PlaceholderSegment,
    TextSegment,
    default_stop,
    input_names,
    output_names,
    parse_template,
    placeholders,
    render_template,
    text_after,
)

FIG7 = "You are an expert software engineer.\nWrite python code of {{input:task}}.\nCode: {{output:code}}"


def test_fig7_segments():
    assert parse_template(FIG7) == [
        TextSegment("You are an expert software engineer.\nWrite python code of "),
        PlaceholderSegment("task", False),
        TextSegment(".\nCode: "),
        PlaceholderSegment("code", True),
    ]


def test_names_helpers_and_str():
    segs = parse_template("{{input:a}} x {{output:b}} y {{input:c}}{{output:d}}")
    assert input_names(segs) == ["a", "c"]
    assert output_names(segs) == ["b", "d"]
    assert [str(p) for p in placeholders(segs)] == ["{{input:a}}", "{{output:b}}", "{{input:c}}", "{{output:d}}"]
    assert placeholders(segs)[1].kind == "output"


def test_plain_text_and_empty():
    assert parse_template("") == []
    assert parse_template("no placeholders") == [TextSegment("no placeholders")]


def test_spaces_inside_braces_allowed():
    assert parse_template("{{ input : task }}") == [PlaceholderSegment("task", False)]


def test_lone_closing_braces_are_text():
    segs = parse_template('JSON like {"a": {"b": 1}} then {{output:x}}')
    assert segs[0] == TextSegment('JSON like {"a": {"b": 1}} then ')
    assert segs[1] == PlaceholderSegment("x", True)


def test_unicode_text_kept():
    assert parse_template("résumé {{input:x}} 日本")[2] == TextSegment(" 日本")


@pytest.mark.parametrize("prompt, fragment", [
    ("abc {{input:task", "unclosed '{{' at line 1, column 5 (offset 4)"),
    ("line1\n  {{input:x} more", "unclosed '{{' at line 2, column 3"),
    ("{{ {{input:x}}", "is not closed before the next '{{'"),
    ("{{task}}", "has no ':'"),
    ("{{inptu:task}}", "unknown placeholder kind 'inptu'"),
    ("{{:task}}", "unknown placeholder kind ''"),
    ("{{input:}}", "bad placeholder name ''"),
    ("{{input:1abc}}", "bad placeholder name '1abc'"),
    ("{{input:a-b}}", "bad placeholder name 'a-b'"),
    ("{{input:a b}}", "bad placeholder name 'a b'"),
    ("{{output:" + "x" * 65 + "}}", "at most 64 characters"),
    ("{{input:t}} and {{input:t}}", "duplicate placeholder name 't' at line 1, column 17 (offset 16) "
                                    "(first used at line 1, column 1 (offset 0))"),
    ("{{input:t}}\n{{output:t}}", "duplicate placeholder name 't' at line 2, column 1"),
    ("{{{input:x}}}", "unknown placeholder kind '{input'"),
])
def test_errors_name_problem_and_position(prompt, fragment):
    with pytest.raises(TemplateError) as ei:
        parse_template(prompt)
    assert fragment in str(ei.value)
    assert ei.value.status_code == 400 and ei.value.code == "bad_template"


def test_non_string_template_rejected():
    with pytest.raises(TemplateError, match="must be a string"):
        parse_template(None)  # type: ignore[arg-type]


def test_render_full_and_until():
    segs = parse_template(FIG7)
    assert render_template(segs, {"task": "snake", "code": "print()"}).endswith("snake.\nCode: print()")
    prompt = render_template(segs, {"task": "snake"}, until="code")
    assert prompt == "You are an expert software engineer.\nWrite python code of snake.\nCode: "


def test_render_errors():
    segs = parse_template(FIG7)
    with pytest.raises(TemplateError, match=r"no value for placeholder \{\{input:task\}\}"):
        render_template(segs, {}, until="code")
    with pytest.raises(TemplateError, match="no placeholder named 'nope'"):
        render_template(segs, {"task": "x", "code": "y"}, until="nope")


def test_text_after():
    segs = parse_template("A {{output:a}}{{output:b}}. rest\n{{output:c}}")
    assert text_after(segs, "a") is None  # another placeholder follows directly
    assert text_after(segs, "b") == ". rest\n"
    assert text_after(segs, "c") is None  # end of template
    with pytest.raises(TemplateError):
        text_after(segs, "zz")


@pytest.mark.parametrize("template, output, expected", [
    ("Code: {{output:code}}", "code", ()),                                     # end of template
    ("A {{output:a}}. Then B: {{output:b}}", "a", (". Then B:",)),             # up to next placeholder, rstripped
    ("A {{output:a}}\nB: {{output:b}}", "a", ("\n",)),                          # following text starts with \n
    ("A {{output:a}}  \nB {{output:b}}", "a", ("\n",)),                         # blank first line -> \n
    ("A {{output:a}} then more\nnext line", "a", (" then more",)),             # up to the first newline
    ("A {{output:a}}{{output:b}}", "a", ()),                                    # placeholder follows directly
    ("A {{output:a}}   ", "a", ()),                                             # only spaces, no newline
    ("A {{output:a}}. Next \nmore", "a", (". Next",)),                         # trailing spaces dropped
    ("A {{output:a}}   \nx", "a", ("\n",)),                                    # spaces, then a newline -> \n
])
def test_default_stop(template, output, expected):
    assert default_stop(parse_template(template), output) == expected
