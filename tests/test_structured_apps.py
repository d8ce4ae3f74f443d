"""Structured output in semantic functions (issue 23): ``P.Output(json_schema=..., regex=..., choice=...,
grammar=...)`` through the real server (P.local: frontend -> HTTP API -> manager -> engine) on the default model;
JSON passed between steps, a ``json`` transform on a constrained output, ConstraintIncomplete reaching every
dependent get, the wire's placeholder sampling and its 400s."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel

import parrot as P
from parrot.common.constraints import Constraint, ConstraintKind
from parrot.common.errors import BadSamplingParams, StepFailed

pytestmark = pytest.mark.model


class City(BaseModel):
    name: str
    country: str
    size: Literal["small", "medium", "large"]


@pytest.fixture(scope="module")
def session(default_model_path):
    with P.local(default_model_path, kv_cache_tokens=8192) as s:
        yield s


@P.semantic_function(max_tokens=60, json_schema=City)
def describe(place: P.SemanticVariable):
    """Describe the city {{input:place}} as JSON with its name, country and size.
    JSON: {{output:city}}"""


@P.semantic_function(max_tokens=60, json_schema=City, transforms=[P.json_field("country")])
def country_of(place: P.SemanticVariable):
    """Describe the city {{input:place}} as JSON with its name, country and size.
    JSON: {{output:country}}"""


@P.semantic_function(max_tokens=6, choice=["yes", "no"])
def is_capital(city: P.SemanticVariable):
    """Here is a city: {{input:city}}
    Is it a capital city? Answer yes or no: {{output:answer}}"""


@P.semantic_function(max_tokens=12, regex=r"[0-9]{1,3}(\.[0-9])?")
def temperature(city: P.SemanticVariable):
    """{{input:city}}
    Typical summer temperature there in Celsius: {{output:t}}
    That is all."""


def test_json_flows_between_constrained_steps(session):
    cities = [describe(p) for p in ("Paris", "Tokyo", "Lima")]
    answers = [is_capital(c) for c in cities]  # consumes the JSON, server-side
    temps = [temperature(c) for c in cities]
    for c, a, t in zip(cities, answers, temps):
        City.model_validate(json.loads(c.get(perf=P.LATENCY)))
        assert a.get(perf=P.LATENCY) in ("yes", "no")
        # no default stop under a constraint: the template's "\n" after the output does not cut it
        assert re.fullmatch(r"[0-9]{1,3}(\.[0-9])?", t.get(perf=P.LATENCY))


def test_a_json_transform_on_a_constrained_output_cannot_fail(session):
    countries = [country_of(p) for p in ("Berlin", "Cairo", "Oslo", "Quito")]
    for c in countries:
        assert isinstance(c.get(perf=P.LATENCY), str)  # the json transform parsed the output and took the field


def test_grammar_and_per_output_constraints(session):
    fn = P.SemanticFunction(
        "Pick a colour and a number.\nColour: {{output:colour}}\nNumber: {{output:n}}\n",
        name="two", defaults=P.Output(max_tokens=8),
        outputs={"colour": P.Output(grammar='root ::= "red" | "green" | "blue"'),
                 "n": P.Output(regex="[1-9]")})
    colour, n = fn()
    assert colour.get(perf=P.LATENCY) in ("red", "green", "blue")
    assert re.fullmatch("[1-9]", n.get(perf=P.LATENCY))


def test_an_incomplete_constrained_output_fails_every_dependent_get(session):
    short = describe.options(max_tokens=4)
    city = short("Rome")
    answer = is_capital(city)
    for var in (city, answer):
        with pytest.raises(StepFailed) as e:
            var.get(perf=P.LATENCY)
        assert e.value.cause_code == "constraint_incomplete", (var, e.value.cause_code, str(e.value))
    with pytest.raises(StepFailed) as e:
        city.get()
    assert e.value.cause_code == "constraint_incomplete" and "max_tokens" in str(e.value)


def test_a_stop_string_that_cuts_a_constrained_output_fails_the_step(session):
    fn = P.SemanticFunction("Two words: {{output:w}}", name="two_words",
                            defaults=P.Output(max_tokens=20, stop=[" "], regex="[a-z]{1,8} [a-z]{1,8}"))
    with pytest.raises(StepFailed) as e:
        fn().get(perf=P.LATENCY)  # one output: the call returns its variable
    assert e.value.cause_code == "constraint_incomplete"


def test_constraints_are_checked_when_a_function_is_defined():
    with pytest.raises(BadSamplingParams):
        P.SemanticFunction("{{output:o}}", defaults=P.Output(regex="[0-9"))
    with pytest.raises(BadSamplingParams) as e:
        P.SemanticFunction("{{output:o}}", defaults=P.Output(regex="a", choice=["b"]))
    assert "one constraint" in str(e.value)
    with pytest.raises(BadSamplingParams):
        P.SemanticFunction("{{output:o}}", defaults=P.Output(json_schema=int))  # not a pydantic model
    # an output's own constraint replaces the function-level one
    fn = P.SemanticFunction("{{output:o}}", defaults=P.Output(regex="a"), outputs={"o": P.Output(choice=["b"])})
    assert fn.outputs[0].sampling.constraint == Constraint.choice(["b"])
    assert fn.outputs[0].sampling.stop == ()
    assert fn.outputs[0].to_placeholder()["sampling"]["constraint"] == {"kind": "choice", "spec": '["b"]'}


def test_the_wire_takes_constraints_and_names_bad_ones(session):
    with httpx.Client(base_url=session.url, timeout=120) as c:
        sid = c.post("/api/v1/sessions", json={}).json()
        h = {"X-Parrot-Session-Token": sid["token"]}
        base = f"/api/v1/sessions/{sid['session_id']}"
        out = {"name": "o", "is_output": True}
        bad = c.post(f"{base}/submit", headers=h, json={"prompt": "Q: {{output:o}}\n", "placeholders": [
            {**out, "sampling": {"constraint": {"kind": "regex", "spec": "(unclosed"}}}]})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_sampling_params"
        assert "regex" in bad.json()["error"]["message"]
        ok = c.post(f"{base}/submit", headers=h, json={"prompt": "Spell a number.\nNumber: {{output:o}}\n",
                                                       "placeholders": [{**out, "sampling": {"max_tokens": 8,
                                                                         "constraint": Constraint.regex("[0-9]{2}")
                                                                         .to_dict()}}]})
        assert ok.status_code == 200, ok.text
        vid = ok.json()["outputs"]["o"]
        value = c.get(f"{base}/variables/{vid}", headers=h, params={"criteria": "latency", "timeout": 60}).json()
        assert re.fullmatch("[0-9]{2}", value["value"]), value
    assert ConstraintKind("json_object") is ConstraintKind.JSON_OBJECT
