"""The builtin engine on a tiny random LLaMA (real tokenizer): fork semantics, paging under pressure,
sampling controls, context lifecycle and typed errors. fp32 so batched and solo runs agree exactly."""

from __future__ import annotations

import random
from concurrent.futures import wait

import pytest
import torch

from parrot.common.errors import ContextExists, ContextLengthExceeded, EngineError, UnknownContext
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.engine.loader.builder import build_engine
from parrot.engine.files.config import ModelConfig
from parrot.engine.models.assembly import build_random_model
from parrot.engine.settings import EngineSettings

# untied head: a random tied head just echoes the last input token
TINY = ModelConfig(
    name="tiny-llama", arch="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
    max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
)


@pytest.fixture(scope="module")
def default_tokenizer():
    from parrot.common.errors import ModelNotFound
    from parrot.engine.files.model_files import default_model_path
    from parrot.engine.files.tokenizer import load_tokenizer

    try:
        return load_tokenizer(default_model_path())
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tiny_parts(default_tokenizer):
    model = build_random_model(TINY, dtype=torch.float32, seed=0)
    return model, default_tokenizer


def make_engine(parts, **kw):
    model, tok = parts
    settings = EngineSettings(dtype="float32", weight_quant="none", **{"kv_cache_tokens": 4096, **kw})
    return build_engine(settings, model=model, tokenizer=tok)


@pytest.fixture
def engine(tiny_parts):
    eng = make_engine(tiny_parts)
    yield eng
    eng.shutdown()


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def run(fut):
    return fut.result(timeout=60)


@pytest.mark.parametrize("prefix_len", [16, 21, 32])
def test_fork_equals_single_fill(engine, prefix_len):
    rng = random.Random(prefix_len)
    prefix = [rng.randrange(3, 40000) for _ in range(prefix_len)]
    suffix = [rng.randrange(3, 40000) for _ in range(9)]
    run(engine.fill(prefix, "parent"))
    r = run(engine.fill(suffix, "child", parent_context_id="parent"))
    assert r.context_len == prefix_len + 9
    forked = run(engine.generate(GREEDY, "child"))
    run(engine.fill(prefix + suffix, "whole"))
    whole = run(engine.generate(GREEDY, "whole"))
    assert forked.token_ids == whole.token_ids and len(whole.token_ids) == 12
    assert len(set(whole.token_ids)) > 3  # the random model is not degenerate, so equality means something
    # the child really shares the parent's full blocks
    bs = engine.pool.block_size
    shared = prefix_len // bs
    assert engine.contexts["child"].block_table[:shared] == engine.contexts["parent"].block_table[:shared]


def test_generate_continues_context_and_fill_after_generate(engine):
    toks = list(range(100, 130))
    run(engine.fill(toks, "a"))
    g1 = run(engine.generate(SamplingParams(max_tokens=5, ignore_eos=True), "a"))
    run(engine.fill([7, 8, 9], "a"))
    g2 = run(engine.generate(GREEDY, "a"))
    ref_tokens = toks + list(g1.token_ids) + [7, 8, 9]
    run(engine.fill(ref_tokens, "ref"))
    ref = run(engine.generate(GREEDY, "ref"))
    assert g2.token_ids == ref.token_ids
    assert g2.prompt_len == len(ref_tokens)


def test_free_parent_with_children_is_safe(engine):
    run(engine.fill(list(range(200, 240)), "p"))
    run(engine.fill([5, 6], "c1", parent_context_id="p"))
    before = run(engine.generate(GREEDY, "c1"))
    run(engine.fill([5, 6], "c2", parent_context_id="p"))
    run(engine.free_context("p"))
    after = run(engine.generate(GREEDY, "c2"))
    assert before.token_ids == after.token_ids
    run(engine.free_context("c1"))
    run(engine.free_context("c2"))
    assert engine.pool.num_used == 0  # every block returned once all sharers are gone


def test_typed_errors(engine):
    with pytest.raises(UnknownContext):
        run(engine.free_context("nope"))
    with pytest.raises(UnknownContext):
        run(engine.fill([1, 2], "x", parent_context_id="missing"))
    run(engine.fill([1, 2, 3], "y"))
    with pytest.raises(ContextExists):
        run(engine.fill([4], "y", parent_context_id="other"))
    with pytest.raises(ContextLengthExceeded):
        run(engine.fill(list(range(3, 600)), "too-long"))
    with pytest.raises(Exception) as ei:
        engine.fill([10**9], "z")
    assert "outside the vocabulary" in str(ei.value)
    # a generate that reaches the model window ends with finish_reason=length
    run(engine.fill(list(range(3, 505)), "near-end"))
    r = run(engine.generate(SamplingParams(max_tokens=100, ignore_eos=True), "near-end"))
    assert r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 512 - 502


def test_free_aborts_running_generate(engine):
    run(engine.fill(list(range(300, 320)), "long"))
    fut = engine.generate(SamplingParams(max_tokens=400, ignore_eos=True), "long")
    run(engine.free_context("long"))
    res = run(fut)
    assert res.finish_reason is FinishReason.ABORT and len(res.token_ids) < 400
    fill_fut = engine.fill(list(range(3, 400)), "gone")
    engine.free_context("gone")
    with pytest.raises((EngineError, UnknownContext)):
        run(fill_fut)


def test_sampling_controls(engine):
    run(engine.fill(list(range(400, 420)), "s"))
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = run(engine.generate(sp, "s1", parent_context_id="s"))
    # same seed, different batch company -> same tokens
    futs = [engine.generate(sp.replace(seed=i), f"o{i}", parent_context_id="s") for i in range(5)]
    b = engine.generate(sp, "s2", parent_context_id="s")
    wait(futs)
    assert run(b).token_ids == a.token_ids
    # different seeds differ (with overwhelming probability at temperature 0.9)
    assert len({tuple(run(f).token_ids) for f in futs}) > 1
    # stop token ids end the generation
    greedy = run(engine.generate(SamplingParams(max_tokens=8, ignore_eos=True), "g", parent_context_id="s"))
    stop_tok = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_tok)
    r = run(engine.generate(SamplingParams(max_tokens=8, stop_token_ids=(stop_tok,)), "g2", parent_context_id="s"))
    assert r.finish_reason is FinishReason.STOP and r.token_ids == greedy.token_ids[: first + 1]
    # min_tokens forbids the stop token early
    r = run(engine.generate(SamplingParams(max_tokens=8, min_tokens=first + 2, stop_token_ids=(stop_tok,)),
                            "g3", parent_context_id="s"))
    assert stop_tok not in r.token_ids[: first + 2]
    # stop strings: cut the text before the stop string
    text = greedy.text
    assert len(text) > 4
    stop = text[2:4]
    r = run(engine.generate(SamplingParams(max_tokens=8, stop=(stop,), ignore_eos=True), "g4", parent_context_id="s"))
    assert r.finish_reason is FinishReason.STOP and r.text == text[: text.index(stop)]
    # repetition penalty changes the greedy output of a repetitive random model or leaves it valid
    r = run(engine.generate(SamplingParams(max_tokens=8, repetition_penalty=1.5, ignore_eos=True), "g5",
                            parent_context_id="s"))
    assert len(r.token_ids) == 8


def test_streaming_chunks_add_up(engine):
    run(engine.fill(list(range(500, 530)), "st"))
    chunks = []
    fut = engine.generate(SamplingParams(max_tokens=10, ignore_eos=True), "st",
                          on_chunk=lambda ch: chunks.append((ch.token_ids, ch.text, ch.finish_reason)))
    res = run(fut)
    assert [t for ids, _, _ in chunks for t in ids] == list(res.token_ids)
    assert "".join(t for _, t, _ in chunks) == res.text
    assert chunks[-1][2] is FinishReason.LENGTH and all(f is None for _, _, f in chunks[:-1])


def test_64_concurrent_generates_under_small_pool(tiny_parts):
    """64 mixed-length requests through a pool far too small for all of them: waiting and preemption happen,
    and every output equals the one computed alone."""
    rng = random.Random(7)
    reqs = [([rng.randrange(3, 40000) for _ in range(rng.randrange(4, 90))], rng.randrange(2, 40)) for _ in range(64)]
    solo = make_engine(tiny_parts, max_num_seqs=1)
    try:
        ref = []
        for i, (p, n) in enumerate(reqs):
            run(solo.fill(p, f"r{i}"))
            ref.append(run(solo.generate(SamplingParams(max_tokens=n, ignore_eos=True), f"r{i}")).token_ids)
    finally:
        solo.shutdown()
    eng = make_engine(tiny_parts, kv_cache_tokens=512, block_size=16, max_num_seqs=64, max_batch_tokens=128)
    try:
        gens = []
        for i, (p, n) in enumerate(reqs):
            eng.fill(p, f"c{i}")
            gens.append(eng.generate(SamplingParams(max_tokens=n, ignore_eos=True), f"c{i}"))
        outs = [run(f).token_ids for f in gens]
        assert outs == ref
        assert eng.scheduler.num_preemptions > 0  # the pool really was too small
        assert eng.pool.num_used <= eng.pool.num_blocks
    finally:
        eng.shutdown()


def test_prefix_cache_serves_unstructured_repeats(engine):
    """A plain request whose token prefix was computed before (context since freed) reuses the cached blocks."""
    toks = list(range(600, 650))  # 3 full blocks + 2 tokens
    run(engine.fill(toks, "first"))
    ref = run(engine.generate(GREEDY, "first"))
    run(engine.free_context("first"))
    assert engine.pool.num_cached >= 3
    r = run(engine.fill(toks, "again"))
    assert r.num_cached == 48
    again = run(engine.generate(GREEDY, "again"))
    assert again.token_ids == ref.token_ids
    st = engine.status()
    assert st.extra["prefix_cache_hit_blocks"] >= 3
    # a fill served entirely from the cache (whole blocks, nothing to compute) completes too
    run(engine.fill(toks[:32], "blocks-only-a"))
    run(engine.free_context("blocks-only-a"))
    r = run(engine.fill(toks[:32], "blocks-only-b"))
    assert r.num_cached == 32 and r.context_len == 32
    g = run(engine.generate(GREEDY, "blocks-only-b"))  # no hidden state cached: the last block is recomputed
    run(engine.fill(toks[:32], "plain"))
    assert g.token_ids == run(engine.generate(GREEDY, "plain")).token_ids


@pytest.mark.parametrize("prefix_len", [37, 64])
def test_shared_prefix_attention_equals_plain(tiny_parts, prefix_len):
    """Forks of two different parents decode together: with shared-prefix attention (prefix read once per
    group, merged by log-sum-exp) the tokens equal the plain paged-attention path."""
    rng = random.Random(prefix_len)
    parents = {p: [rng.randrange(3, 40000) for _ in range(prefix_len + 10 * i)] for i, p in enumerate("AB")}
    suffixes = [[rng.randrange(3, 40000) for _ in range(i + 1)] for i in range(6)]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = {}
    for shared in (True, False):
        eng = make_engine(tiny_parts, shared_prefix_attention=shared, enable_prefix_cache=False)
        try:
            for p, toks in parents.items():
                run(eng.fill(toks, p))
            futs = []
            for i, suffix in enumerate(suffixes):
                p = "AB"[i % 2]
                eng.fill(suffix, f"{p}{i}", parent_context_id=p)
                futs.append(eng.generate(sp, f"{p}{i}"))
            outs[shared] = [run(f).token_ids for f in futs]
            used = eng.runner.num_shared_prefix_rows
            assert (used > 0) if shared else (used == 0)
        finally:
            eng.shutdown()
    assert outs[True] == outs[False]
    assert len({o for o in outs[True]}) == 6


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_shared_prefix_kernel_matches_plain_attention(native, request):
    """The attention math alone, on random K/V: two groups with different prefixes and ragged suffixes; the
    shared-prefix path, the plain path and a dense reference agree, for the torch path and the native kernel."""
    from parrot.engine.layers.attention import BlockRef, DecodeGroup, PagedAttention

    kernel = request.getfixturevalue("native_kernel") if native else None
    torch.manual_seed(0)
    bs, n_kv, G, hd, nb = 4, 2, 3, 8, 64
    kc = torch.randn(nb, bs, n_kv, hd)
    vc = torch.randn(nb, bs, n_kv, hd)
    tables = [[1, 2, 3, 10], [1, 2, 3, 11, 12], [5, 6, 20], [5, 6, 21, 22]]
    lens = [15, 18, 10, 16]  # tokens per sequence (last token = the one being decoded)
    q = torch.randn(4, n_kv * G, hd)
    dev = torch.device("cpu")

    def group(row0, rows, P):
        ls = [lens[r] - P * bs for r in rows]
        mx = max(ls)
        mb = -(-mx // bs)
        tab = [tables[r][P : P + mb] + [0] * (mb - len(tables[r][P : P + mb])) for r in rows]
        pre = BlockRef.of([tables[rows[0]][:P]], dev) if P else None
        return DecodeGroup(row0, len(rows), pre, P * bs, torch.tensor(tab, dtype=torch.int32),
                           torch.tensor(ls, dtype=torch.int32), mx)

    slots = torch.tensor([tables[r][(lens[r] - 1) // bs] * bs + (lens[r] - 1) % bs for r in range(4)])
    k_new = torch.stack([kc[tables[r][(lens[r] - 1) // bs], (lens[r] - 1) % bs] for r in range(4)])
    v_new = torch.stack([vc[tables[r][(lens[r] - 1) // bs], (lens[r] - 1) % bs] for r in range(4)])
    shared = PagedAttention([(kc, vc)], slots, [group(0, [0, 1], 3), group(2, [2, 3], 2)], [], hd ** -0.5, kernel)
    plain = PagedAttention([(kc, vc)], slots, [group(0, [0, 1, 2, 3], 0)], [], hd ** -0.5, kernel)
    a = shared(0, q, k_new, v_new)
    b = plain(0, q, k_new, v_new)
    ref = []
    for r in range(4):  # dense softmax attention over the sequence's tokens, head by head
        k = torch.cat([kc[blk] for blk in tables[r]])[: lens[r]]  # [L, n_kv, hd]
        v = torch.cat([vc[blk] for blk in tables[r]])[: lens[r]]
        qh = q[r].view(n_kv, G, hd)
        w = torch.softmax(torch.einsum("kgd,lkd->kgl", qh, k) * hd ** -0.5, -1)
        ref.append(torch.einsum("kgl,lkd->kgd", w, v).reshape(-1))
    ref = torch.stack(ref)
    assert torch.allclose(b, ref, atol=1e-5), (b - ref).abs().max()
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_pinned_prefix_survives_eviction(tiny_parts):
    """A pinned hot prefix keeps its cached blocks through memory pressure that evicts everything else."""
    eng = make_engine(tiny_parts, kv_cache_tokens=128, block_size=16)  # 8 blocks
    try:
        hot = list(range(700, 732))  # 2 full blocks
        cold = list(range(800, 832))
        for cid, toks in (("hot", hot), ("cold", cold)):
            run(eng.fill(toks, cid))
            run(eng.free_context(cid))
        assert run(eng.pin_prefix(hot)) == 2
        run(eng.fill(list(range(900, 995)), "pressure"))  # 6 blocks: needs every unpinned block
        run(eng.free_context("pressure"))
        assert run(eng.fill(hot, "hot2")).num_cached == 32  # pinned: still cached
        assert run(eng.fill(cold, "cold2")).num_cached == 0  # evicted by the pressure
        run(eng.free_context("hot2"))
        run(eng.free_context("cold2"))
        assert run(eng.pin_prefix(hot, pinned=False)) == 0
        assert eng.pool.num_pinned == 0 and eng.pool.num_used == 0
        # with 2 of 8 blocks pinned, a context needing 7 can never fit: a typed error, not a hang
        run(eng.pin_prefix(hot))
        with pytest.raises(ContextLengthExceeded):
            run(eng.fill(list(range(900, 1012)), "too-big"))
    finally:
        eng.shutdown()


def test_a_failure_building_a_result_reaches_the_caller_instead_of_hanging(engine, monkeypatch):
    """An internal bug while a result is assembled (here: labelling prompt logprobs) fails that call with
    EngineError instead of leaving its future unresolved; the engine keeps serving."""

    def broken(raw):
        raise RuntimeError("labels broke")

    monkeypatch.setattr(engine._labels, "position", broken)
    with pytest.raises(EngineError, match="internal engine error"):
        engine.fill([5, 6, 7, 8], "boom", prompt_logprobs=1).result(timeout=60)
    monkeypatch.undo()
    engine.fill([9, 10], "boom2").result(timeout=60)
    r = engine.generate(SamplingParams(max_tokens=2, ignore_eos=True), "boom2").result(timeout=60)
    assert len(r.token_ids) == 2
