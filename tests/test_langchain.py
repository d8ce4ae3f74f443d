"""LangChain LCEL chains compiled to Parrot semantic functions (parrot.integrations.langchain).

Three layers: the compiler against an in-memory fake of the Parrot API (what is submitted, before anything is
read; no server), the compiled chains on a real server with the deterministic fake engine (DAG dumps, types,
fallbacks, failures), and on a real server with the real default model (greedy outputs equal to the same program
written with ``P.SemanticFunction``)."""

from __future__ import annotations

import asyncio
import json
import operator
import subprocess
import sys

import httpx
import pytest
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import JsonOutputParser, StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.runnables import RunnableLambda, RunnableParallel, RunnablePassthrough

import parrot as P
from parrot.common.errors import BadSamplingParams, StepFailed
from parrot.frontend.client import Session
from parrot.integrations.langchain import ChainCompileError, ParrotLLM, UnsupportedRunnable, compile_chain
from parrot.integrations.langchain.compiler import Tracer

SUMMARIZE = "Write a concise summary of the following text.\n\nText:\n{doc}\n\nConcise summary:"
REFINE = ("Your job is to produce a final summary.\nExisting summary: {summary}\nRefine it with this context:\n"
          "------------\n{more}\n------------\nRefined summary:")
REDUCE = "The following is a set of summaries:\n- {s0}\n- {s1}\n- {s2}\nDistill them into one summary.\nSummary:"
DOCS = ["Lighthouses guide ships along dangerous coasts with bright rotating lamps and fog horns.",
        "The first lighthouse keepers lived in small stone houses and trimmed the wicks every night.",
        "Modern lighthouses are automated; solar panels charge batteries that run LED lanterns.",
        "Some old towers became museums where visitors climb the spiral stairs to the lantern room."]


def _parrot_template(lc_template: str) -> str:
    """The Parrot template a `PromptTemplate(lc_template) | llm` step becomes ({x} -> {{input:x}}, output last)."""
    out = lc_template
    for name in ("doc", "summary", "more", "s0", "s1", "s2"):
        out = out.replace("{%s}" % name, "{{input:%s}}" % name)
    return out + "{{output:text}}"


def chains(llm):
    summarize = PromptTemplate.from_template(SUMMARIZE, name="summarize") | llm | StrOutputParser()
    refine = ({"summary": summarize, "more": operator.itemgetter("more")}
              | PromptTemplate.from_template(REFINE, name="refine") | llm | StrOutputParser())
    mapper = PromptTemplate.from_template(SUMMARIZE, name="map") | llm | StrOutputParser()
    map_reduce = (RunnableParallel(s0=operator.itemgetter("d0") | mapper, s1=operator.itemgetter("d1") | mapper,
                                   s2=operator.itemgetter("d2") | mapper)
                  | PromptTemplate.from_template(REDUCE, name="reduce") | llm | StrOutputParser())
    return summarize, refine, map_reduce


# ---- the compiler against a fake Parrot API (no server) -----------------------------------------------------------
@pytest.fixture
def fake_session():
    from test_frontend import FakeParrotAPI

    class ProducingIntoGivenVariables(FakeParrotAPI):
        """The fake, plus what docs/api.md says of an output placeholder naming an existing empty variable: the
        request produces into it."""

        def handler(self, request: httpx.Request) -> httpx.Response:
            if not request.url.path.endswith("/submit"):
                return super().handler(request)
            given = {h["name"]: h["var_id"] for h in json.loads(request.content)["placeholders"]
                     if h["is_output"] and h.get("var_id")}
            resp = super().handler(request)
            if resp.status_code != 200:
                return resp
            answer = resp.json()
            with self.cond:
                for name, vid in given.items():
                    self.vars[vid]["producer"] = self.vars.pop(answer["outputs"][name])["producer"]
                answer["outputs"].update(given)
            return httpx.Response(200, json=answer)

    fake = ProducingIntoGivenVariables()
    with Session("http://fake", transport=httpx.MockTransport(fake.handler)) as s:
        yield fake, s


def _by_name(fake) -> dict[str, dict]:
    return {r["name"]: r for r in fake.requests}


def test_whole_chain_is_submitted_before_anything_is_read(fake_session):
    fake, s = fake_session
    llm = ParrotLLM(base_url="http://fake", temperature=0, max_tokens=12, model="m1")
    _, refine, _ = chains(llm.bind(stop=["\n\n"]))
    tracer = Tracer(s)
    out = tracer.run(refine, {"doc": DOCS[0], "more": DOCS[1]})
    assert fake.requests == [] and len(tracer.pending) == 2  # traced, nothing sent yet
    tracer.flush()  # two concurrent waves: variables, then submits
    assert fake.gets == []  # nothing read: both steps were submitted on symbols
    assert sorted(r["name"] for r in fake.requests) == ["refine", "summarize"]
    first, second = _by_name(fake)["summarize"], _by_name(fake)["refine"]
    assert first["prompt"] == _parrot_template(SUMMARIZE)
    assert second["prompt"] == _parrot_template(REFINE)
    assert first["models"] == ["m1"]
    (out1,) = [h for h in first["placeholders"] if h["is_output"]]
    assert out1["sampling"]["max_tokens"] == 12 and out1["sampling"]["temperature"] == 0
    assert out1["sampling"]["stop"] == ["\n\n"]  # .bind(stop=...) reached the sampling
    ins = {h["name"]: h["var_id"] for h in second["placeholders"] if not h["is_output"]}
    (summary_out,) = [h["var_id"] for h in first["placeholders"] if h["is_output"]]
    assert ins["summary"] == summary_out  # refine reads summarize's output variable, by id
    assert fake.vars[summary_out]["producer"] == fake.requests.index(first)
    assert fake.vars[ins["more"]]["value"] == DOCS[1]
    assert [st.where for st in tracer.steps] == ["server", "server"]
    fake.produce(out.var.id, "final")
    assert tracer.materialize(out) == "final"


def test_map_reduce_and_chat_prompts_compile_to_templates(fake_session):
    fake, s = fake_session
    llm = ParrotLLM(base_url="http://fake", temperature=0, max_tokens=8, model="m1")
    _, _, map_reduce = chains(llm)
    tracer = Tracer(s)
    tracer.run(map_reduce, {"d0": DOCS[0], "d1": DOCS[1], "d2": DOCS[2]})
    tracer.flush()
    assert sorted(r["name"] for r in fake.requests) == ["map", "map", "map", "reduce"]
    reduce_ins = [h["var_id"] for h in _by_name(fake)["reduce"]["placeholders"] if not h["is_output"]]
    maps = [i for i, r in enumerate(fake.requests) if r["name"] == "map"]
    assert sorted(fake.vars[v]["producer"] for v in reduce_ins) == maps

    # a variable used twice gets two placeholders bound to one variable; partials are constant text
    twice = PromptTemplate.from_template("{a} and {a} for {who}:").partial(who="Bob") | llm
    tracer = Tracer(s)
    tracer.run(twice, {"a": "x"})
    tracer.flush()
    req = fake.requests[-1]
    assert req["prompt"] == "{{input:a}} and {{input:a_2}} for Bob:{{output:text}}"
    a_ids = [h["var_id"] for h in req["placeholders"] if not h["is_output"]]
    assert len(set(a_ids)) == 1


def test_chat_prompts_render_with_the_model_chat_template_and_map_fans_out(fake_session):
    from fakes import CHAT_TEMPLATE

    from parrot.integrations.langchain import ChatParrot
    from parrot.integrations.langchain.models import ServerModel

    fake, s = fake_session
    chat = ChatParrot(base_url="http://fake", temperature=0, max_tokens=8, model="m1")
    chat._server = ServerModel("m1", CHAT_TEMPLATE, "<s>", "</s>")  # what /tokenizer_info would answer
    ask = ChatPromptTemplate.from_messages([("system", "Be brief."), ("human", "Summarize: {doc}")]) | chat
    tracer = Tracer(s)
    out = tracer.run(ask, {"doc": DOCS[0]})
    tracer.flush()
    assert out.message  # read back as an AIMessage
    assert fake.requests[-1]["prompt"] == ("<|system|>Be brief.\n<|user|>Summarize: {{input:doc}}\n<|assistant|>"
                                           "{{output:text}}")

    llm = ParrotLLM(base_url="http://fake", temperature=0, max_tokens=8, model="m1")
    mapped = (PromptTemplate.from_template(SUMMARIZE, name="each") | llm | StrOutputParser()).map()
    tracer = Tracer(s)
    outs = tracer.run(mapped, [{"doc": d} for d in DOCS])
    tracer.flush()
    assert len(outs) == len(DOCS) and fake.gets == []
    assert [r["name"] for r in fake.requests[-len(DOCS):]] == ["each"] * len(DOCS)


def test_bad_prompts_and_sampling_are_typed_errors(fake_session):
    _, s = fake_session
    llm = ParrotLLM(base_url="http://fake", temperature=0, max_tokens=8, model="m1")
    braces = PromptTemplate.from_template("JSON like {{{{'a': 1}}}} of {x}:") | llm
    with pytest.raises(ChainCompileError, match="holds '{{'"):
        Tracer(s).run(braces, {"x": "y"})
    with pytest.raises(BadSamplingParams) as e:
        Tracer(s).run(PromptTemplate.from_template("{x}") | llm.bind(nucleus=0.5), {"x": "y"})
    assert e.value.param == "nucleus"
    with pytest.raises(KeyError, match="missing variables"):
        Tracer(s).run(PromptTemplate.from_template("{x} {y}") | llm, {"x": "only x"})


def test_strict_refuses_python_steps_and_names_them():
    llm = ParrotLLM(base_url="http://fake", temperature=0)
    chain = PromptTemplate.from_template("{x}") | llm | RunnableLambda(lambda t: t.upper(), name="shout")
    with pytest.raises(UnsupportedRunnable) as e:
        compile_chain(chain, strict=True)
    assert "shout" in str(e.value) and e.value.param.startswith("shout")
    compile_chain(PromptTemplate.from_template("{x}") | llm | JsonOutputParser(), strict=True)  # parsers are fine
    with pytest.raises(UnsupportedRunnable, match="no ParrotLLM"):
        compile_chain(PromptTemplate.from_template("{x}") | StrOutputParser())


def test_package_imports_without_langchain():
    code = ("import sys; sys.modules['langchain_core'] = None\n"
            "import parrot, parrot.integrations.langchain as lc\n"
            "try:\n    lc.ParrotLLM\nexcept ImportError as e:\n    print('hint' if 'parrot-serve[langchain]' in str(e) "
            "else e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "hint", out.stderr


# ---- compiled chains on a real server with the fake engine ----------------------------------------------------------
@pytest.fixture(scope="module")
def fake_server():
    from fakes import FakeEngine

    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings
    from parrot.frontend.local import LocalServer

    engine = FakeEngine(max_model_len=4096)
    engine.fail_generate_when = "EXPLODE"
    server = LocalServer(create_app(ServerSettings(), [engine]))
    yield server.url
    server.stop()


def _requests(session: Session) -> dict[str, list[dict]]:
    by_name: dict[str, list[dict]] = {}
    for r in session.dag()["requests"]:
        by_name.setdefault(r["name"], []).append(r)
    return by_name


def test_dag_dump_shows_each_chain_step(fake_server):
    llm = ParrotLLM(base_url=fake_server, temperature=0, max_tokens=8)
    _, refine, map_reduce = chains(llm)
    with P.connect(fake_server, make_default=False) as s:
        out = compile_chain(refine, session=s).invoke({"doc": DOCS[0], "more": DOCS[1]})
        assert isinstance(out, str) and out
        reqs = _requests(s)
        (summ,), (ref,) = reqs["summarize"], reqs["refine"]
        assert summ["outputs"][0] in ref["inputs"]  # refine <- summarize's output, server-side
        assert summ["status"] == ref["status"] == "finished"
        text = s.dag()["text"]
        assert "summarize(text) <- %" in text and "refine(text) <- %" in text

    with P.connect(fake_server, make_default=False) as s:
        compile_chain(map_reduce, session=s).invoke({"d0": DOCS[0], "d1": DOCS[1], "d2": DOCS[2]})
        reqs = _requests(s)
        assert len(reqs["map"]) == 3
        (red,) = reqs["reduce"]
        assert sorted(red["inputs"]) == sorted(m["outputs"][0] for m in reqs["map"])


def test_types_batch_async_and_own_session(fake_server):
    llm = ParrotLLM(base_url=fake_server, temperature=0, max_tokens=8)
    summarize, _, _ = chains(llm)
    bare = compile_chain(PromptTemplate.from_template(SUMMARIZE) | llm)  # no session: opens its own per call
    assert isinstance(bare.invoke({"doc": DOCS[0]}), str)
    from parrot.integrations.langchain import ChatParrot

    chat = ChatParrot(base_url=fake_server, temperature=0, max_tokens=8)
    ask = ChatPromptTemplate.from_messages([("system", "Be brief."), ("human", "Summarize: {doc}")]) | chat
    msg = compile_chain(ask).invoke({"doc": DOCS[0]})
    assert isinstance(msg, AIMessage) and msg.content

    compiled = compile_chain(summarize)
    batch = compiled.batch([{"doc": d} for d in DOCS])
    assert batch == [compiled.invoke({"doc": d}) for d in DOCS]  # deterministic engine: same in batch and alone
    assert len(set(batch)) == len(DOCS)
    assert asyncio.run(compiled.ainvoke({"doc": DOCS[1]})) == batch[1]
    assert asyncio.run(compiled.abatch([{"doc": DOCS[2]}])) == [batch[2]]
    # the same chain, plain LangChain (one rendered call at a time through the OpenAI API): same types
    assert isinstance(summarize.invoke({"doc": DOCS[0]}), str)
    # the models alone: OpenAI API or one semantic call through the Parrot API, same text either way (greedy)
    via_parrot = llm.model_copy(update={"api": "parrot"})
    assert llm.invoke("Hello") == via_parrot.invoke("Hello") and llm.invoke("Hello")
    assert isinstance(chat.invoke("Hi"), AIMessage)
    assert chat.invoke("Hi").content == chat.model_copy(update={"api": "parrot"}).invoke("Hi").content
    with pytest.raises(BadSamplingParams):
        llm.invoke("Hello", nucleus=0.3)


def test_python_steps_run_client_side_and_failures_reach_invoke(fake_server, caplog):
    llm = ParrotLLM(base_url=fake_server, temperature=0, max_tokens=8)
    shout = RunnableLambda(lambda t: t.upper(), name="shout")
    chain = (PromptTemplate.from_template("Say {x}:") | llm | StrOutputParser() | shout
             | {"said": RunnablePassthrough()} | PromptTemplate.from_template("Echo {said}:") | llm)
    with P.connect(fake_server, make_default=False) as s:
        compiled = compile_chain(chain, session=s)
        with caplog.at_level("WARNING"):
            out = compiled.invoke({"x": "hi"})
        assert isinstance(out, str)
        assert [(st.name, st.where) for st in compiled.last_steps] == [
            ("ParrotLLM", "server"), ("shout", "client"), ("ParrotLLM", "server")]
        assert any("shout" in r.getMessage() and "client-side" in r.getMessage() for r in caplog.records)
        first, second = sorted(s.dag()["requests"], key=lambda r: r["number"])
        value = httpx.get(f"{fake_server}/api/v1/sessions/{s.session_id}/variables/{second['inputs'][0]}",
                          headers={"X-Parrot-Session-Token": s._token}).json()["value"]
        assert value == value.upper() and value  # the lambda's output went in as a ready input variable

    parse = PromptTemplate.from_template("{x}") | llm | JsonOutputParser()
    with pytest.raises(Exception, match="Invalid json output"):  # parsed client-side, as in LangChain
        compile_chain(parse).invoke({"x": "not json"})

    failing = PromptTemplate.from_template("{x} EXPLODE") | llm | StrOutputParser()
    with pytest.raises(StepFailed):
        compile_chain(failing).invoke({"x": "boom"})
    results = compile_chain(failing).batch([{"x": "a"}], return_exceptions=True)
    assert isinstance(results[0], StepFailed)


# ---- the real model: outputs equal to the direct frontend program ---------------------------------------------------
@pytest.fixture(scope="module")
def real_server(default_model_path):
    from servers import serve

    from parrot.api import ServerSettings, create_app
    from parrot.engine.loader.builder import build_local_engine_client
    from parrot.engine.settings import EngineSettings

    engine = build_local_engine_client(EngineSettings(model=default_model_path, kv_cache_tokens=8192,
                                                                     num_threads=1))
    try:
        with serve(create_app(ServerSettings(engine_heartbeat_s=0), [engine])) as url:
            yield url
    finally:
        asyncio.run(engine.close())


@pytest.mark.model
def test_real_model_outputs_equal_direct_frontend(real_server):
    n = 12
    llm = ParrotLLM(base_url=real_server, temperature=0, max_tokens=n)
    summarize, refine, map_reduce = chains(llm)

    def fn(lc_template: str, name: str) -> P.SemanticFunction:
        return P.SemanticFunction(_parrot_template(lc_template), name=name,
                                  defaults=P.Output(max_tokens=n, temperature=0, stop=[]))

    with P.connect(real_server, make_default=False) as s:
        direct_sum = fn(SUMMARIZE, "summarize")(DOCS[0], session=s)
        direct_ref = fn(REFINE, "refine")(direct_sum, DOCS[1], session=s)
        maps = [fn(SUMMARIZE, "map")(d, session=s) for d in DOCS[:3]]
        direct_red = fn(REDUCE, "reduce")(*maps, session=s)
        expected = [direct_sum.get(), direct_ref.get(), direct_red.get()]
    assert all(expected)

    with P.connect(real_server, make_default=False) as s:
        got = [compile_chain(summarize, session=s).invoke({"doc": DOCS[0]}),
               compile_chain(refine, session=s).invoke({"doc": DOCS[0], "more": DOCS[1]}),
               compile_chain(map_reduce, session=s).invoke({"d0": DOCS[0], "d1": DOCS[1], "d2": DOCS[2]})]
        reqs = _requests(s)
    assert got == expected
    assert len(reqs["summarize"]) == 2 and len(reqs["refine"]) == 1 and len(reqs["map"]) == 3
    (ref,) = reqs["refine"]
    assert reqs["summarize"][1]["outputs"][0] in ref["inputs"]
    (red,) = reqs["reduce"]
    assert sorted(red["inputs"]) == sorted(m["outputs"][0] for m in reqs["map"])
    json.dumps(got)  # plain strings, as the uncompiled chains return


def test_benchmark_runs_both_ways(fake_server, tmp_path):
    from parrot.bench import langchain_bench

    assert langchain_bench.main(["--url", fake_server, "--chunks", "2", "--output-len", "3", "--repeats", "1",
                                 "--warmup", "0", "--rtt-ms", "0", "20", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("langchain_bench-*.json")
    report = json.loads(path.read_text())
    assert [(r["app"], r["rtt_ms"]) for r in report["rows"]] == [("chain", 0), ("chain", 20), ("map_reduce", 0),
                                                                 ("map_reduce", 20)]
    for r in report["rows"]:
        assert r["langchain_s"] > 0 and r["parrot_s"] > 0 and r["ratio"] == r["langchain_s"] / r["parrot_s"]
        assert r["langchain_http_requests"] == r["calls"]  # one completion per step
    assert report["conditions"]["model"] == "fake-model" and report["conditions"]["cpu"]
