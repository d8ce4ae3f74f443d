"""Constrained decoding in the engine (issue 23) on the real default model: JSON schema, regex, choice and
grammar constraints in one batch, forks and the prefix cache keeping each op's own constraint, streaming that
only ever shows valid prefixes, the interplay with min_tokens / ignore_eos / stop, the wire, the simulator's
refusal, and the sampler's bitmask application against a direct reference."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from parrot.common.constraints import Constraint
from parrot.common.errors import BadSamplingParams
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.engine.loader.builder import build_engine
from parrot.engine.runtime.guided import GrammarCompiler
from parrot.engine.clients.http_client import HTTPEngineClient
from parrot.engine.clients.local_client import LocalEngineClient
from parrot.engine.runtime.sampler import apply_bitmask, mask_bias
from parrot.engine.server.app import create_engine_app
from parrot.engine.settings import EngineSettings

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3}}}
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
YESNO_GBNF = 'root ::= "yes" | "no" | "it depends"'


def check_person(text: str) -> None:
    """``text`` is a JSON object satisfying PERSON (checked by hand: jsonschema is not a dependency)."""
    value = json.loads(text)
    assert set(value) == {"name", "age", "tags"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 20
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(t in ("red", "green") for t in value["tags"])


@pytest.fixture(scope="module")
def engine(default_model_path):
    eng = build_engine(EngineSettings(model=default_model_path, kv_cache_tokens=8192, max_num_seqs=16))
    yield eng
    eng.shutdown()


def prompt(eng, question: str) -> list[int]:
    tok = eng.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))


def replay(eng, constraint: Constraint, token_ids) -> bool:
    """Feed ``token_ids`` to an independent matcher of ``constraint`` (raises if one leaves the language);
    return whether the constraint is then complete."""
    checker = GrammarCompiler(eng.tokenizer).guide(constraint)
    for t in token_ids:
        checker.consume(t)
    return checker.complete


def run(fut):
    return fut.result(timeout=300)


def test_a_batch_with_mixed_constraints_gives_every_request_a_valid_output(engine):
    asks = [("Describe a person as JSON.", Constraint.json_schema(PERSON)),
            ("What is your phone number?", Constraint.regex(PHONE)),
            ("Is this review good? 'Loved it.'", Constraint.choice(CHOICES)),
            ("Should I learn Rust?", Constraint.grammar(YESNO_GBNF)),
            ("Any JSON object about cats, please.", Constraint.json_object()),
            ("Say hello.", None)] * 2
    for i, (q, _) in enumerate(asks):
        run(engine.fill(prompt(engine, q), f"mix{i}"))
    # sampled (seeded) rows and greedy rows share the batch: the constraint holds for both
    futs = [engine.generate(SamplingParams(max_tokens=80, constraint=c, temperature=0.9 if i % 2 else 0.0, seed=i),
                            f"mix{i}") for i, (_, c) in enumerate(asks)]
    results = [run(f) for f in futs]
    for i, ((_, c), r) in enumerate(zip(asks, results)):
        run(engine.free_context(f"mix{i}"))
        if c is None:
            assert r.constraint_complete is None
            continue
        if c.kind.value == "json_object" and r.finish_reason is FinishReason.LENGTH:
            replay(engine, c, r.token_ids)  # an open-ended object may outlast max_tokens: still a valid prefix
            continue
        assert r.finish_reason is FinishReason.STOP and r.constraint_complete, (c.kind, r.text)
        if c.kind.value == "json_schema":
            check_person(r.text)
        elif c.kind.value == "json_object":
            assert isinstance(json.loads(r.text), dict)
        elif c.kind.value == "regex":
            assert re.fullmatch(PHONE, r.text), r.text
        elif c.kind.value == "choice":
            assert r.text in CHOICES
        else:
            assert r.text in ("yes", "no", "it depends")


def test_forks_of_one_prompt_keep_their_own_constraints_over_the_prefix_cache(engine):
    ids = prompt(engine, "Tell me about the weather today.")
    run(engine.fill(ids, "parent"))
    a = engine.generate(SamplingParams(max_tokens=40, constraint=Constraint.choice(["sunny", "rainy"])), "f1", "parent")
    b = engine.generate(SamplingParams(max_tokens=40, constraint=Constraint.regex(r"[A-Z][a-z]{2,8} [0-9]{2}C")),
                        "f2", "parent")
    c = engine.generate(SamplingParams(max_tokens=20), "f3", "parent")
    ra, rb, rc = run(a), run(b), run(c)
    assert ra.text in ("sunny", "rainy")
    assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}C", rb.text), rb.text
    assert rc.text and rc.text not in ("sunny", "rainy")  # the unconstrained fork is free
    # the same prompt again in a new context: served by the prefix cache, under yet another constraint
    fill = run(engine.fill(ids, "again"))
    assert fill.num_cached >= len(ids) // 2
    rd = run(engine.generate(SamplingParams(max_tokens=60, constraint=Constraint.json_schema(PERSON)), "again"))
    check_person(rd.text)
    for cid in ("parent", "f1", "f2", "f3", "again"):
        run(engine.free_context(cid))


def test_streaming_shows_only_prefixes_the_constraint_accepts(engine):
    client = LocalEngineClient(engine, owns_engine=False)
    constraint = Constraint.json_schema(PERSON)
    checker = GrammarCompiler(engine.tokenizer).guide(constraint)  # an independent matcher replays the stream

    async def main():
        await client.fill(prompt(engine, "A person as JSON."), "s")
        chunks = [ch async for ch in client.generate_stream(SamplingParams(max_tokens=80, constraint=constraint), "s")]
        await client.free_context("s")
        return chunks

    chunks = asyncio.run(main())
    text = ""
    for ch in chunks:
        for t in ch.token_ids:
            checker.consume(t)  # raises if a streamed token left the language
        text += ch.text
    assert chunks[-1].finish_reason is FinishReason.STOP and checker.complete
    check_person(text)


def test_min_tokens_yields_to_the_grammar_and_ignore_eos_still_ends_it(engine):
    run(engine.fill(prompt(engine, "Yes or no?"), "m"))
    r = run(engine.generate(SamplingParams(max_tokens=30, min_tokens=10, constraint=Constraint.choice(["no"])), "m"))
    assert r.text == "no" and r.finish_reason is FinishReason.STOP
    run(engine.free_context("m"))
    run(engine.fill(prompt(engine, "Yes or no?"), "m2"))
    r = run(engine.generate(SamplingParams(max_tokens=30, ignore_eos=True, constraint=Constraint.choice(["yes", "no"])),
                            "m2"))
    assert r.text in ("yes", "no") and r.finish_reason is FinishReason.STOP
    run(engine.free_context("m2"))


def test_max_tokens_cuts_a_constrained_output_with_length(engine):
    run(engine.fill(prompt(engine, "A person as JSON."), "cut"))
    r = run(engine.generate(SamplingParams(max_tokens=3, constraint=Constraint.json_schema(PERSON)), "cut"))
    assert r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 3 and r.constraint_complete is False
    run(engine.free_context("cut"))
    # a stop string may cut it too: finished with STOP, yet incomplete
    run(engine.fill(prompt(engine, "Two words please."), "cut2"))
    r = run(engine.generate(SamplingParams(max_tokens=20, stop=[" "], constraint=Constraint.regex("[a-z]{1,8} [a-z]{1,8}")),
                            "cut2"))
    assert r.finish_reason is FinishReason.STOP and r.constraint_complete is False and " " not in r.text
    run(engine.free_context("cut2"))


def test_constraints_that_do_not_compile_are_refused_by_name():
    bad = [lambda: Constraint.regex("[0-9"), lambda: Constraint.json_schema({"type": "nonsense"}),
           lambda: Constraint.json_schema("{not json"), lambda: Constraint.grammar("root ::= missing_rule"),
           lambda: Constraint.choice([]), lambda: SamplingParams.from_dict({"constraint": {"kind": "xml"}})]
    for make in bad:
        with pytest.raises(BadSamplingParams) as e:
            make()
        assert e.value.param == "constraint"
    c = Constraint.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    assert c == Constraint.json_schema('{"type": "object",\n "properties": {"b": {}, "a": {}}}')  # compact text
    assert list(c.schema["properties"]) == ["b", "a"]  # declared order kept: it is the order of generation


def test_the_wire_carries_constraints(engine):
    from parrot.frontend.local import LocalServer

    srv = LocalServer(create_engine_app(LocalEngineClient(engine, owns_engine=False)))
    sp = SamplingParams(max_tokens=40, constraint=Constraint.regex(PHONE))

    async def main():
        c = HTTPEngineClient(srv.url, "m")
        try:
            await c.fill(prompt(engine, "Your phone number?"), "w")
            whole = await c.generate(sp, "w1", "w")
            streamed = "".join([ch.text async for ch in c.generate_stream(sp, "w2", "w")])
            for cid in ("w", "w1", "w2"):
                await c.free_context(cid)
            return whole, streamed
        finally:
            await c.close()

    try:
        whole, streamed = asyncio.run(main())
    finally:
        srv.stop()
    assert re.fullmatch(PHONE, whole.text) and streamed == whole.text and whole.constraint_complete is True


def test_the_simulator_refuses_constraints_by_name():
    from parrot.sim.sim_engine import SimEngine
    from parrot.sim.vloop import run_virtual
    from test_sim_core import TINY as SIM_COST

    async def main():
        eng = SimEngine("sim", SIM_COST)
        client = LocalEngineClient(eng, owns_engine=False)
        await client.fill([5, 6, 7], "a")
        try:
            await client.generate(SamplingParams(max_tokens=2, constraint=Constraint.choice(["x"])), "a")
        except BadSamplingParams as e:
            return e.param
        finally:
            eng.shutdown()

    assert run_virtual(main()) == "constraint"


def test_json_whitespace_between_tokens_is_bounded(engine):
    """A model may pretty-print, but cannot run to max_tokens on blanks: at most 40 between two JSON tokens."""
    from parrot.engine.runtime.guided import GrammarCompiler

    tok = engine.tokenizer
    space = tok.encode(" ")
    assert len(space) == 1
    for n, ok in ((40, True), (41, False)):
        guide = GrammarCompiler(tok).guide(Constraint.json_object())
        guide.consume(tok.encode("{")[0])
        if ok:
            for _ in range(n):
                guide.consume(space[0])
        else:
            with pytest.raises(Exception, match="refused"):
                for _ in range(n):
                    guide.consume(space[0])


def test_the_benchmark_json_replays_under_its_schema(engine):
    from parrot.bench.structured_bench import SCHEMA, sample_json

    ids = engine.tokenizer.encode(sample_json())
    assert not replay(engine, Constraint.json_schema(SCHEMA), ids)  # a valid prefix that cannot be complete yet


def test_bitmask_application_matches_a_direct_reference():
    g = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partial, columns past the mask are never allowed
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 3), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(3, vocab, generator=g)
    expect = logits.clone()
    for r in range(3):
        for t in range(vocab):
            word, bit = divmod(t, 32)
            if t >= 96 or not (int(bitmask[r, word]) >> bit) & 1:
                expect[r, t] = float("-inf")
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expect)
    bias = mask_bias(bitmask, 64)  # a narrower vocabulary than the mask covers: cut, not padded
    assert bias.shape == (3, 64) and torch.equal(bias == 0, torch.isfinite(expect[:, :64]))
