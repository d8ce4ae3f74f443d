"""Simulator core: the virtual loop, cost models, and the simulated engine over the real scheduler/block pool."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

from parrot.common.errors import ContextLengthExceeded, UnknownContext
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.engine.clients.local_client import LocalEngineClient
from parrot.sim.cost_model import (
    GENERATED,
    GPUS,
    LLMS,
    CostModel,
    Sample,
    available_models,
    fit_coefficients,
    load_model,
    roofline_model,
)
from parrot.sim.sim_engine import SimEngine
from parrot.sim.tokenizer import EOS, GEN_TOKEN, OutputLengths, WordTokenizer
from parrot.sim.vloop import VirtualDeadlock, run_virtual

TINY = CostModel(name="tiny", base_s=0.01, prefill_token_s=0.001, prefill_attn_s=0.0, decode_row_s=0.001,
                 decode_ctx_s=0.0, swap_block_s=0.0, kv_cache_tokens=256, block_size=16, max_batch_tokens=64,
                 max_num_seqs=8, max_model_len=512)


@pytest.fixture
def no_real_sleep(monkeypatch):
    """A simulation must not wait in real time: ``time.sleep`` raises."""
    def refuse(seconds):
        raise AssertionError(f"real time.sleep({seconds}) in a simulation")

    monkeypatch.setattr(time, "sleep", refuse)


# ---- virtual loop ------------------------------------------------------------------------------------------------
def test_virtual_loop_jumps_timers_without_waiting(no_real_sleep):
    """An hour of timers: the clock jumps once per idle gap straight to the next timer, with no real sleep
    (a loop that waited for real would run into pytest's timeout)."""

    async def main():
        loop = asyncio.get_running_loop()
        order = []

        async def sleeper(d, tag):
            await asyncio.sleep(d)
            order.append((tag, loop.time()))

        await asyncio.gather(sleeper(3600, "hour"), sleeper(0.5, "half"), sleeper(60, "minute"))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10_000), 5)
        return order, loop.time(), loop.num_jumps

    order, end, jumps = run_virtual(main())
    assert order == [("half", 0.5), ("minute", 60.0), ("hour", 3600.0)]
    assert end == pytest.approx(3605.0)
    assert jumps == 4  # 0 -> 0.5 -> 60 -> 3600 -> 3605 (the wait_for timeout), no intermediate steps


def test_virtual_loop_is_deterministic_and_detects_deadlock():
    async def main():
        import random

        rng = random.Random(7)
        loop = asyncio.get_running_loop()
        log = []

        async def worker(i):
            for _ in range(5):
                await asyncio.sleep(rng.random())
                log.append((i, round(loop.time(), 9)))

        await asyncio.gather(*(worker(i) for i in range(4)))
        return log

    assert run_virtual(main()) == run_virtual(main())

    async def stuck():
        await asyncio.get_running_loop().create_future()  # nothing will ever resolve it

    with pytest.raises(VirtualDeadlock):
        run_virtual(stuck())


# ---- cost models -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("llm, gpu, tp", GENERATED)
def test_gpu_cost_models_load_are_monotone_and_match_their_generator(llm, gpu, tp):
    name = f"{llm}-{gpu}" + (f"-tp{tp}" if tp > 1 else "")
    m = load_model(name)
    assert m.source["gpu"] and m.source["model"] and m.source["base_s"]  # provenance is written down
    assert m == roofline_model(llm, gpu, tp)  # the file is what the documented roofline produces
    assert m.prefill_s(256) < m.prefill_s(1024) < m.prefill_s(1024, 2048)
    assert m.decode_s(1, 100) < m.decode_s(8, 100) < m.decode_s(8, 8000)
    # sanity against the papers: batch-1 decode is well under the 40 ms/token target on an A100 ...
    if gpu == "a100":
        assert 0.008 < m.decode_s(1, 1000) < 0.040
    # ... and the bigger model / slower GPU is slower
    assert load_model("llama13b-a6000").decode_s(8, 4000) > load_model("llama7b-a100").decode_s(8, 4000)


def test_gqa_and_tensor_parallel_rooflines():
    mha, gqa = LLMS["llama7b"], LLMS["mistral7b"]
    assert gqa.kv_bytes_per_token * 4 == mha.kv_bytes_per_token  # 8 of 32 heads keep K/V
    four = roofline_model("llama3-70b", "h100", 4)
    assert four.name == "llama3-70b-h100-tp4" and four.max_model_len == 8192
    # 70B does not fit one 80 GB GPU at fp16; four hold it with room for ~400k tokens of GQA KV
    with pytest.raises(ValueError, match="does not fit"):
        roofline_model("llama3-70b", "h100", 1)
    assert 300_000 < four.kv_cache_tokens < 500_000
    # tensor parallelism splits the weight stream but adds the all-reduces: a 70B decode on 4 GPUs is faster than
    # streaming its weights from one GPU, slower than a quarter of that
    one_gpu_weights_s = 2 * LLMS["llama3-70b"].params / GPUS["h100"].mem_bw
    assert one_gpu_weights_s / 4 < four.decode_s(1, 1024) < one_gpu_weights_s
    with pytest.raises(ValueError, match="GPU link"):
        roofline_model("llama7b", "a6000", 2)  # no NVLink modelled for the A6000


def test_cost_model_files_reject_bad_data(tmp_path):
    assert {"llama7b-a100", "llama13b-a6000"} <= set(available_models())
    bad = load_model("llama7b-a100").to_dict() | {"decode_ctx_s": -1.0}
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="decode_ctx_s"):
        load_model(p)
    p.write_text(json.dumps(load_model("llama7b-a100").to_dict() | {"surprise": 1}))
    with pytest.raises(ValueError, match="unknown keys"):
        load_model(p)
    with pytest.raises(ValueError, match="no cost model"):
        load_model("no-such-model")


def test_fit_recovers_a_linear_model():
    truth = dict(base_s=0.02, prefill_token_s=0.002, prefill_attn_s=1e-7, decode_row_s=0.003, decode_ctx_s=1e-5)
    samples = []
    for n in (16, 64, 256):
        for c in (0, 512):
            a = n * (c + n / 2)
            t = truth["base_s"] + truth["prefill_token_s"] * n + truth["prefill_attn_s"] * a
            samples.append(Sample(n, a, 0, 0, t))
    for b in (1, 4, 16):
        for c in (64, 512):
            t = truth["base_s"] + truth["decode_row_s"] * b + truth["decode_ctx_s"] * b * c
            samples.append(Sample(0, 0, b, b * c, t))
    got = fit_coefficients(samples)
    for k, v in truth.items():
        assert got[k] == pytest.approx(v, rel=1e-3)


# ---- simulated engine --------------------------------------------------------------------------------------------
def test_word_tokenizer_counts_words():
    tok = WordTokenizer()
    ids = tok.encode("the lighthouse keeper")
    assert len(ids) == 4  # "lighthouse" (>6 chars) takes two tokens
    assert tok.encode("the lighthouse keeper") == ids
    assert tok.decode(ids[:1]) == "the"


def test_engine_fill_fork_generate_free_and_kv_accounting():
    async def main():
        loop = asyncio.get_running_loop()
        e = SimEngine("e", TINY)
        r = await e.fill(list(range(100, 140)), "a")  # 40 tokens: one iteration (budget 64)
        assert (r.num_filled, r.context_len) == (40, 40)
        assert loop.time() == pytest.approx(TINY.prefill_s(40))
        assert e.pool.num_used == 3  # ceil(40 / 16) blocks
        # fork: the child references the parent's two full blocks (no copy)
        r = await e.fill([200, 201], "b", "a")
        assert r.context_len == 42
        assert e.pool.num_shared == 2
        g = await e.generate(SamplingParams(max_tokens=5, ignore_eos=True), "b")
        assert g.token_ids == (GEN_TOKEN,) * 5 and g.finish_reason is FinishReason.LENGTH and g.prompt_len == 42
        assert g.latency_s > g.ttft_s > 0
        assert len(e.contexts["b"].tokens) == 47  # generated tokens are part of the context
        st = e.status()
        assert (st.num_contexts, st.num_running) == (2, 0)
        await e.free_context("a")
        assert e.pool.num_shared == 0 and e.pool.num_used == 3  # b keeps the shared blocks
        await e.free_context("b")
        assert e.pool.num_used == 0
        with pytest.raises(UnknownContext):
            await e.free_context("b")
        with pytest.raises(ContextLengthExceeded):
            await e.fill(list(range(100, 700)), "c")
        e.shutdown()

    run_virtual(main())


def test_engine_output_lengths_are_seeded_and_honour_max_tokens():
    async def lengths(seed):
        e = SimEngine("e", TINY, seed=seed, output_lengths=OutputLengths(mean=6))
        out = []
        for i in range(6):
            await e.fill([100 + i, 101, 102], f"c{i}")
            g = await e.generate(SamplingParams(max_tokens=10), f"c{i}")
            out.append((len(g.token_ids), g.finish_reason))
            assert len(g.token_ids) <= 10
            if g.finish_reason is FinishReason.STOP:
                assert g.token_ids[-1] == EOS
        e.shutdown()
        return out

    a, b = run_virtual(lengths(1)), run_virtual(lengths(1))
    assert a == b
    assert len({n for n, _ in a}) > 1  # drawn, not fixed


def test_engine_batches_concurrent_decodes_and_applies_token_cap():
    async def run(cap):
        loop = asyncio.get_running_loop()
        e = SimEngine("e", TINY)
        await e.set_token_cap(cap)
        for i in range(4):
            await e.fill([100 + i] * 20, f"c{i}")
        t0 = loop.time()
        await asyncio.gather(*(e.generate(SamplingParams(max_tokens=10, ignore_eos=True), f"c{i}") for i in range(4)))
        e.shutdown()
        return loop.time() - t0, e.num_steps

    batched, capped = run_virtual(run(None)), run_virtual(run(40))
    assert batched[0] < capped[0]  # one batch of 4 vs. a cap that admits ~one at a time
    assert capped[1] > batched[1]


def test_engine_streams_tokens_with_the_finish_on_the_last_chunk():
    async def main():
        e = SimEngine("e", TINY)
        await e.fill([100, 101, 102], "s")
        # the builtin engine's in-process client; interval 0: a chunk per token
        client = LocalEngineClient(e, owns_engine=False, stream_interval_s=0)
        chunks = [c async for c in client.generate_stream(SamplingParams(max_tokens=4, ignore_eos=True), "s")]
        # the default interval (20 ms of the engine's clock) merges the tokens of the steps in between
        merging = LocalEngineClient(e, owns_engine=False)
        await e.fill([100, 101, 102], "t")
        merged = [c async for c in merging.generate_stream(SamplingParams(max_tokens=40, ignore_eos=True), "t")]
        e.shutdown()
        return chunks, merged

    chunks, merged = run_virtual(main())
    assert [c.token_ids for c in chunks] == [(GEN_TOKEN,)] * 4
    assert [c.finish_reason for c in chunks] == [None, None, None, FinishReason.LENGTH]
    assert "".join(c.text for c in chunks).split() == ["tok"] * 4
    assert [t for c in merged for t in c.token_ids] == [GEN_TOKEN] * 40 and 1 < len(merged) < 40
    assert [c.finish_reason for c in merged][-1] is FinishReason.LENGTH
    assert all(c.finish_reason is None for c in merged[:-1])
    assert "".join(c.text for c in merged).split() == ["tok"] * 40


def test_a_command_arriving_mid_iteration_waits_for_its_end_as_in_the_builtin_engine():
    async def main():
        loop = asyncio.get_running_loop()
        e = SimEngine("e", TINY)
        fill = asyncio.ensure_future(e.fill(list(range(100, 160)), "a"))  # one 60-token iteration
        await asyncio.sleep(TINY.prefill_s(60) / 2)
        await e.free_context("a")  # the step in flight completes first, then the free runs
        freed_at = loop.time()
        r = await fill
        e.shutdown()
        return freed_at, r, e.pool.num_used

    freed_at, r, used = run_virtual(main())
    assert freed_at == pytest.approx(TINY.prefill_s(60))
    assert r.context_len == 60 and used == 0


def test_forked_decodes_read_their_shared_prefix_once():
    """Shared-prefix attention (the builtin engine's kernel): 4 children of one 64-token parent decode
    together; with the kernel their 4 shared blocks are read once per iteration, not four times."""
    cost = dataclasses.replace(TINY, decode_ctx_s=1e-4)

    async def run(shared):
        e = SimEngine("e", cost, shared_prefix_attention=shared)
        await e.fill(list(range(100, 164)), "p")
        await asyncio.gather(*(e.fill([200 + i], f"c{i}", "p") for i in range(4)))
        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(*(e.generate(SamplingParams(max_tokens=6, ignore_eos=True), f"c{i}") for i in range(4)))
        rows = e.status().extra["shared_prefix_decode_rows"]
        e.shutdown()
        return asyncio.get_running_loop().time() - t0, rows

    (t_on, rows_on), (t_off, rows_off) = run_virtual(run(True)), run_virtual(run(False))
    assert rows_off == 0 and rows_on == 4 * 5  # 5 decode iterations of 4 rows (the first token is sample-only)
    # each of the 5 iterations skips re-reading 3 x 64 shared tokens
    assert t_off - t_on == pytest.approx(5 * 3 * 64 * cost.decode_ctx_s)
