"""Logprobs in the engine (issue 24): generation logprobs and prompt logprobs on an exact fp32 engine (tiny random
LLaMA, real tokenizer) against a direct full forward of the same model; chunked prefill, appended and forked fills,
preemption, the prompt-logprob cache over the prefix cache; streaming, the HTTP client and the simulator."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
import torch.nn.functional as F

from parrot.common.errors import BadSamplingParams
from parrot.common.sampling import PositionLogprobs, SamplingParams
from parrot.engine.loader.builder import build_engine
from parrot.engine.clients.http_client import HTTPEngineClient
from parrot.engine.clients.local_client import LocalEngineClient
from parrot.engine.models.assembly import build_random_model
from parrot.engine.server.app import create_engine_app
from parrot.engine.settings import EngineSettings
from test_engine import TINY, default_tokenizer  # noqa: F401  (fixture)

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_model():
    return build_random_model(TINY, dtype=torch.float32, seed=0)


@pytest.fixture(scope="module")
def engine(tiny_model, default_tokenizer):  # noqa: F811
    eng = _engine(tiny_model, default_tokenizer)
    yield eng
    eng.shutdown()


def _engine(model, tok, **kw):
    settings = EngineSettings(dtype="float32", weight_quant="none", **{"kv_cache_tokens": 4096, **kw})
    return build_engine(settings, model=model, tokenizer=tok)


def run(fut):
    return fut.result(timeout=120)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 40000) for _ in range(n)]


# ---- the reference: one causal forward over the whole sequence ------------------------------------------------------
def causal_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(0, 1).reshape(q.shape[0], -1)


def ref_logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab]: row p predicts token p + 1."""
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), causal_attention)).float()


def assert_position(got: PositionLogprobs, logp_row: torch.Tensor, token: int, k: int) -> None:
    """``got`` equals the chosen token's logprob and the top ``k`` of the reference log_softmax row."""
    assert got.chosen.token_id == token
    assert got.chosen.logprob == pytest.approx(logp_row[token].item(), abs=TOL)
    vals, idx = logp_row.topk(k)
    assert [t.token_id for t in got.top] == idx.tolist()
    assert [t.logprob for t in got.top] == pytest.approx(vals.tolist(), abs=TOL)
    assert all(a.logprob >= b.logprob for a, b in zip(got.top, got.top[1:]))  # most likely first


def assert_prompt_logprobs(lps, model, ids: list[int], start: int, k: int) -> None:
    """``lps`` (a fill of ``ids[start:]`` after ``ids[:start]``) equal the reference, None at position 0."""
    logp = torch.log_softmax(ref_logits(model, ids), dim=-1)
    assert len(lps) == len(ids) - start
    for i, got in enumerate(lps):
        pos = start + i
        if pos == 0:
            assert got is None
        else:
            assert got is not None, pos
            assert_position(got, logp[pos - 1], ids[pos], k)


def assert_same(a, b) -> None:
    """Two logprob records of the same positions agree: same tokens, logprobs within TOL."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is y
            continue
        assert [x.chosen.token_id] + [t.token_id for t in x.top] == [y.chosen.token_id] + [t.token_id for t in y.top]
        assert [x.chosen.logprob] + [t.logprob for t in x.top] == pytest.approx(
            [y.chosen.logprob] + [t.logprob for t in y.top], abs=TOL)


# ---- generation logprobs --------------------------------------------------------------------------------------------
def test_greedy_logprobs_equal_log_softmax_of_a_direct_forward(engine, tiny_model):
    prompt = tokens(1, 37)
    run(engine.fill(prompt, "g1"))
    r = run(engine.generate(SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5), "g1a", "g1"))
    assert len(r.logprobs) == len(r.token_ids) == 8
    logp = torch.log_softmax(ref_logits(tiny_model, prompt + list(r.token_ids)), dim=-1)
    for i, (tok, got) in enumerate(zip(r.token_ids, r.logprobs)):
        assert_position(got, logp[len(prompt) - 1 + i], tok, 5)
        assert got.top[0].token_id == tok  # greedy: the chosen token is the most likely one
    # text and bytes are the token's own
    t = r.logprobs[0].chosen
    assert t.token_bytes == engine.tokenizer.token_to_bytes(t.token_id)
    assert t.token == t.token_bytes.decode("utf-8", errors="replace")
    # logprobs=0: the chosen token only
    r0 = run(engine.generate(SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0), "g1b", "g1"))
    assert r0.token_ids == r.token_ids[:3]
    assert [p.top for p in r0.logprobs] == [(), (), ()]
    assert [p.chosen for p in r0.logprobs] == [p.chosen for p in r.logprobs[:3]]
    for cid in ("g1", "g1a", "g1b"):
        run(engine.free_context(cid))


def test_logprobs_reflect_the_penalized_logits(engine, tiny_model):
    prompt = tokens(2, 21)
    sp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4, repetition_penalty=1.7, presence_penalty=0.8,
                        frequency_penalty=0.5)
    run(engine.fill(prompt, "p1"))
    r = run(engine.generate(sp, "p1"))
    ids = prompt + list(r.token_ids)
    raw = ref_logits(tiny_model, ids)
    for i, (tok, got) in enumerate(zip(r.token_ids, r.logprobs)):
        row = raw[len(prompt) - 1 + i].clone()
        seen = torch.tensor(sorted(set(ids[: len(prompt) + i])))  # the sampler's repetition penalty
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
        out = r.token_ids[:i]
        for t in set(out):  # presence + frequency over the output so far
            row[t] -= sp.presence_penalty + sp.frequency_penalty * out.count(t)
        assert_position(got, torch.log_softmax(row, dim=-1), tok, 4)
    run(engine.free_context("p1"))


def test_sampler_logprobs_are_taken_after_penalties_and_before_temperature():
    """The sampler on designed logits: the seen tokens are the most likely ones, so the penalties reorder the top;
    temperature and top-k change the draw, not the reported numbers."""
    from parrot.engine.runtime.context import Context, Op, OpKind
    from parrot.engine.runtime.sampler import Sampler

    vocab = 50
    logits = torch.linspace(4.0, -4.0, vocab).unsqueeze(0)  # token 0 most likely
    sp = SamplingParams(max_tokens=9, logprobs=3, repetition_penalty=2.0, presence_penalty=0.5,
                        frequency_penalty=0.25, temperature=0.7, top_k=5, seed=3)
    op = Op(OpKind.GENERATE, Context("c", None, tokens=[0, 1, 7, 1]), sampling=sp)
    op.output_ids = [1, 1]
    row = logits[0].clone()
    for t in (0, 1, 7):
        row[t] = row[t] / 2.0 if row[t] > 0 else row[t] * 2.0
    row[1] -= 0.5 + 0.25 * 2
    want = torch.log_softmax(row, dim=-1)
    sampler = Sampler(eos_token_ids=(2,))
    work = logits.clone()
    tok = sampler.sample(work, [op])
    (got,) = sampler.logprobs(work, [op], tok)
    assert got.token_id == tok[0] and got.logprob == pytest.approx(want[tok[0]].item(), abs=1e-6)
    assert list(got.top_ids) == want.topk(3).indices.tolist() and got.top_ids[0] == 2  # not token 0 any more
    assert list(got.top_logprobs) == pytest.approx(want.topk(3).values.tolist(), abs=1e-6)
    # min_tokens bans EOS (2): it leaves the distribution the sampler draws from
    op_min = Op(OpKind.GENERATE, Context("d", None, tokens=[5]), sampling=SamplingParams(min_tokens=3, logprobs=2))
    work = logits.clone()
    tok = sampler.sample(work, [op_min])
    (banned,) = sampler.logprobs(work, [op_min], tok)
    assert 2 not in banned.top_ids and tok == [0]


def test_rows_without_logprobs_get_none_and_batching_does_not_change_them(engine):
    prompt = tokens(3, 30)
    run(engine.fill(prompt, "b0"))
    with_lp = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3)
    solo = run(engine.generate(with_lp, "solo", "b0"))
    futs = [engine.generate(with_lp if i % 2 else SamplingParams(max_tokens=5, ignore_eos=True), f"b{i + 1}", "b0")
            for i in range(4)]
    res = [run(f) for f in futs]
    for i, r in enumerate(res):
        assert r.token_ids == solo.token_ids
        if i % 2:
            assert [p.chosen.token_id for p in r.logprobs] == list(r.token_ids)
            for a, b in zip(r.logprobs, solo.logprobs):
                assert a.chosen.logprob == pytest.approx(b.chosen.logprob, abs=TOL)
                assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
        else:
            assert r.logprobs == ()
    for cid in ["solo", "b0"] + [f"b{i + 1}" for i in range(4)]:
        run(engine.free_context(cid))


def test_sampled_tokens_report_their_own_logprob_under_a_seed(engine):
    run(engine.fill(tokens(4, 19), "s0"))
    sp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2, temperature=1.3, top_k=50, seed=11)
    a = run(engine.generate(sp, "s1", "s0"))
    b = run(engine.generate(sp, "s2", "s0"))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert [p.chosen.token_id for p in a.logprobs] == list(a.token_ids)
    for cid in ("s1", "s2", "s0"):
        run(engine.free_context(cid))


# ---- prompt logprobs ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 16, 75])
def test_prompt_logprobs_equal_a_direct_forward(engine, tiny_model, n):
    prompt = tokens(10 + n, n)
    r = run(engine.fill(prompt, f"f{n}", prompt_logprobs=4))
    assert r.num_filled == n and r.prompt_logprobs[0] is None
    assert_prompt_logprobs(r.prompt_logprobs, tiny_model, prompt, 0, 4)
    run(engine.free_context(f"f{n}"))


def test_fill_without_prompt_logprobs_reports_none(engine):
    r = run(engine.fill(tokens(5, 20), "plain"))
    assert r.prompt_logprobs == ()
    run(engine.free_context("plain"))


def test_chunked_prefill_gives_every_token_its_logprob(tiny_model, default_tokenizer):  # noqa: F811
    eng = _engine(tiny_model, default_tokenizer, max_batch_tokens=16)
    try:
        prompt = tokens(6, 75)  # five chunks of at most 16 tokens
        r = run(eng.fill(prompt, "c", prompt_logprobs=3))
        assert_prompt_logprobs(r.prompt_logprobs, tiny_model, prompt, 0, 3)
        assert eng.status().extra["steps"] >= 5
    finally:
        eng.shutdown()


@pytest.mark.parametrize("first", [16, 21])
def test_appended_and_forked_fills_predict_their_first_token_from_the_context(engine, tiny_model, first):
    head, tail = tokens(20 + first, first), tokens(30 + first, 29)
    run(engine.fill(head, "h"))
    r = run(engine.fill(tail, "h", prompt_logprobs=2))  # appended to a computed context
    assert r.prompt_logprobs[0] is not None  # position `first` is predicted by the context's last token
    assert_prompt_logprobs(r.prompt_logprobs, tiny_model, head + tail, first, 2)
    run(engine.fill(head, "p"))
    r = run(engine.fill(tail, "k", parent_context_id="p", prompt_logprobs=2))  # a fork's first fill
    assert_prompt_logprobs(r.prompt_logprobs, tiny_model, head + tail, first, 2)
    # the context still generates the tokens of a plain fill (its last hidden state is the fill's)
    g = run(engine.generate(SamplingParams(max_tokens=4, ignore_eos=True), "k"))
    run(engine.fill(head + tail, "w"))
    assert run(engine.generate(SamplingParams(max_tokens=4, ignore_eos=True), "w")).token_ids == g.token_ids
    for cid in ("h", "p", "k", "w"):
        run(engine.free_context(cid))


def test_prompt_logprobs_are_served_over_the_prefix_cache(engine, tiny_model):
    prompt = tokens(7, 75)  # 4 full blocks of 16 and a tail of 11
    bs = engine.pool.block_size
    first = run(engine.fill(prompt, "r1", prompt_logprobs=5))
    assert first.num_cached == 0
    hits = engine.status().extra["prompt_logprob_cache_hits"]
    again = run(engine.fill(prompt, "r2", prompt_logprobs=5))
    # blocks 0-2 from the prefix cache; block 3 is recomputed: its last row's logits predict the tail's first token
    assert again.num_cached == 3 * bs
    # blocks 0-3 are served as stored; the tail is computed again, in another chunk shape (fp32 rounding only)
    assert again.prompt_logprobs[: 4 * bs] == first.prompt_logprobs[: 4 * bs]
    assert_same(again.prompt_logprobs[4 * bs:], first.prompt_logprobs[4 * bs:])
    assert engine.status().extra["prompt_logprob_cache_hits"] - hits == 4 * bs - 1  # position 0 needs none
    fewer = run(engine.fill(prompt, "r3", prompt_logprobs=2))  # fewer alternatives: served, truncated
    assert fewer.num_cached == 3 * bs
    assert [p.top for p in fewer.prompt_logprobs[1: 4 * bs]] == [p.top[:2] for p in first.prompt_logprobs[1: 4 * bs]]
    more = run(engine.fill(prompt, "r4", prompt_logprobs=8))  # more alternatives than stored: recomputed
    assert more.num_cached == 0
    assert_prompt_logprobs(more.prompt_logprobs, tiny_model, prompt, 0, 8)
    after = run(engine.fill(prompt, "r5", prompt_logprobs=8))  # ... and stored at the larger k
    assert after.num_cached == 3 * bs and after.prompt_logprobs[: 4 * bs] == more.prompt_logprobs[: 4 * bs]
    assert_same(after.prompt_logprobs, more.prompt_logprobs)
    for i in range(1, 6):
        engine.kv.check(engine.contexts[f"r{i}"])
        run(engine.free_context(f"r{i}"))


def test_kv_cached_without_logprobs_is_recomputed_for_them(engine, tiny_model):
    prompt = tokens(8, 64)  # exactly 4 blocks
    run(engine.fill(prompt, "n1"))  # KV cached, no logprob entries
    r = run(engine.fill(prompt, "n2", prompt_logprobs=1))
    assert r.num_cached == 0
    assert_prompt_logprobs(r.prompt_logprobs, tiny_model, prompt, 0, 1)
    whole = run(engine.fill(prompt, "n3", prompt_logprobs=1))  # all full blocks known: nothing to compute
    assert whole.num_cached == 64 and whole.prompt_logprobs == r.prompt_logprobs
    g3 = run(engine.generate(SamplingParams(max_tokens=3, ignore_eos=True), "n3"))
    assert run(engine.generate(SamplingParams(max_tokens=3, ignore_eos=True), "n1")).token_ids == g3.token_ids
    for cid in ("n1", "n2", "n3"):
        run(engine.free_context(cid))


def test_a_cached_prefix_of_a_longer_prompt_serves_its_blocks(engine, tiny_model):
    shared = tokens(9, 48)
    a, b = shared + tokens(91, 20), shared + tokens(92, 27)
    run(engine.fill(a, "x1", prompt_logprobs=3))
    r = run(engine.fill(b, "x2", prompt_logprobs=3))
    assert r.num_cached == 32  # blocks 0-1 taken, block 2 recomputed for the hidden state of token 47
    assert_prompt_logprobs(r.prompt_logprobs, tiny_model, b, 0, 3)
    for cid in ("x1", "x2"):
        run(engine.free_context(cid))


def test_a_preempted_prompt_logprob_fill_keeps_what_it_computed(tiny_model, default_tokenizer):  # noqa: F811
    """An older generate grows into the whole pool: the younger fill gives up its KV mid-prompt, waits, and is
    recomputed; its logprobs still equal the reference."""
    eng = _engine(tiny_model, default_tokenizer, kv_cache_tokens=96, max_batch_tokens=16)
    try:
        run(eng.fill(tokens(50, 40), "old"))
        gen = eng.generate(SamplingParams(max_tokens=50, ignore_eos=True), "old")
        prompt = tokens(51, 60)
        fill = eng.fill(prompt, "young", prompt_logprobs=2)
        r = run(fill)
        run(gen)
        assert eng.status().num_preempted_total > 0
        assert_prompt_logprobs(r.prompt_logprobs, tiny_model, prompt, 0, 2)
    finally:
        eng.shutdown()


def test_bad_prompt_logprobs_are_rejected_by_name(engine):
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(BadSamplingParams) as e:
            engine.fill([5, 6], "bad", prompt_logprobs=bad)
        assert e.value.param == "prompt_logprobs"


# ---- streaming, HTTP, simulator -------------------------------------------------------------------------------------
def test_stream_chunks_carry_the_logprobs_of_the_result(engine):
    client = LocalEngineClient(engine, owns_engine=False)
    sp = SamplingParams(max_tokens=7, ignore_eos=True, logprobs=3)

    async def main():
        await client.fill(tokens(12, 33), "st")
        whole = await client.generate(sp, "st1", "st")
        chunks = [ch async for ch in client.generate_stream(sp, "st2", "st")]
        for cid in ("st", "st1", "st2"):
            await client.free_context(cid)
        return whole, chunks

    whole, chunks = asyncio.run(main())
    assert all(len(ch.logprobs) == len(ch.token_ids) for ch in chunks)
    assert tuple(p for ch in chunks for p in ch.logprobs) == whole.logprobs


def test_http_engine_client_round_trips_logprobs(engine):
    from parrot.frontend.local import LocalServer

    srv = LocalServer(create_engine_app(LocalEngineClient(engine, owns_engine=False)))
    local = LocalEngineClient(engine, owns_engine=False)
    sp = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=4)
    text = "naïve café — 東京 ✓"  # multi-byte tokens: bytes must survive JSON as lists of ints

    async def main():
        c = HTTPEngineClient(srv.url, "tiny")
        try:
            ids = await c.tokenize(text)
            fill = await c.fill(ids, "w1", prompt_logprobs=3)
            ref = await local.fill(ids, "w2", prompt_logprobs=3)
            gen = await c.generate(sp, "w3", "w1")
            ref_gen = await local.generate(sp, "w4", "w2")
            chunks = [ch async for ch in c.generate_stream(sp, "w5", "w1")]
            with pytest.raises(BadSamplingParams):
                await c.fill(ids, "w6", prompt_logprobs=99)
            for cid in ("w1", "w2", "w3", "w4", "w5"):
                await c.free_context(cid)
            return fill, ref, gen, ref_gen, chunks
        finally:
            await c.close()

    try:
        fill, ref, gen, ref_gen, chunks = asyncio.run(main())
    finally:
        srv.stop()
    assert fill.prompt_logprobs == ref.prompt_logprobs and fill.prompt_logprobs[0] is None
    assert any(len(p.chosen.token_bytes) > 1 and p.chosen.token_bytes[0] >= 0x80 for p in fill.prompt_logprobs[1:])
    assert gen.logprobs == ref_gen.logprobs and len(gen.logprobs) == 5
    assert tuple(p for ch in chunks for p in ch.logprobs) == gen.logprobs


def test_the_simulator_refuses_logprobs_by_name():
    from parrot.sim.sim_engine import SimEngine
    from parrot.sim.vloop import run_virtual
    from test_sim_core import TINY as SIM_COST

    async def main():
        eng = SimEngine("sim", SIM_COST)
        client = LocalEngineClient(eng, owns_engine=False)
        errors = []
        try:
            await client.fill([5, 6, 7], "a", prompt_logprobs=1)
        except BadSamplingParams as e:
            errors.append(e.param)
        await client.fill([5, 6, 7], "a")
        try:
            await client.generate(SamplingParams(max_tokens=2, logprobs=1), "a")
        except BadSamplingParams as e:
            errors.append(e.param)
        try:
            [ch async for ch in client.generate_stream(SamplingParams(max_tokens=2, logprobs=0), "a")]
        except BadSamplingParams as e:
            errors.append(e.param)
        ok = await client.generate(SamplingParams(max_tokens=2, ignore_eos=True), "a")
        eng.shutdown()
        return errors, ok

    errors, ok = run_virtual(main())
    assert errors == ["prompt_logprobs", "logprobs", "logprobs"]
    assert len(ok.token_ids) == 2 and ok.logprobs == ()


# ---- tokenizer: a token's bytes -------------------------------------------------------------------------------------
def test_token_bytes_of_a_byte_level_vocabulary(default_tokenizer):  # noqa: F811
    tok = default_tokenizer
    ids = tok.encode("héllo 東京 world")
    joined = b"".join(tok.token_to_bytes(i) for i in ids)
    assert joined.decode("utf-8") == "héllo 東京 world"
    assert tok.token_to_bytes(tok.vocab_size + 5) == b""


def test_token_bytes_of_a_sentencepiece_style_vocabulary():
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from parrot.engine.files.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "▁hello": 1, "<0xE2>": 2, "<0x9C>": 3, "<0x93>": 4, "world": 5}
    tok = Tokenizer(Backend(models.WordLevel(vocab, unk_token="<unk>")), bos_token_id=None, eos_token_ids=(),
                    chat_template=None, add_bos=False, byte_level=False)
    assert tok.token_to_bytes(1) == b" hello"
    assert tok.token_to_bytes(2) + tok.token_to_bytes(3) + tok.token_to_bytes(4) == "✓".encode()
    assert tok.token_to_bytes(5) == b"world"


# ---- the real default model ----------------------------------------------------------------------------------------
@pytest.mark.model
def test_default_model_fp32_logprobs_equal_a_direct_forward(default_model_path):
    eng = build_engine(EngineSettings(model=default_model_path, cpu_path="portable", kv_cache_tokens=2048))
    try:
        model = eng.runner.model
        prompt = eng.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
        fill = run(eng.fill(prompt, "m", prompt_logprobs=3))
        gen = run(eng.generate(SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3), "m"))
        ids = prompt + list(gen.token_ids)
        logp = torch.log_softmax(ref_logits(model, ids), dim=-1)
        assert_prompt_logprobs(fill.prompt_logprobs, model, prompt, 0, 3)
        for i, (tok, got) in enumerate(zip(gen.token_ids, gen.logprobs)):
            assert_position(got, logp[len(prompt) - 1 + i], tok, 3)
        assert gen.logprobs[0].chosen.token == " Rome"
    finally:
        eng.shutdown()
