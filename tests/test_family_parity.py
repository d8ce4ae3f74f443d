"""Every model family against HF transformers: tiny random-weight models built from each family's real config shape
(tests/family_models.py), saved as a safetensors dir and as a GGUF file, loaded by our loaders.

fp32 logits within 1e-4 of transformers' (a direct forward, and the prompt logprobs of a fill through the paged
engine); greedy continuations token-identical through the paged engine -- one request at a time, all batched,
forked from a shared parent, and with chunked prefill -- on the torch attention path (portable plan) and on the
native one (avx2 plan: fused norm / RoPE ops, paged-decode and causal-prefill kernels). Prompts are longer than
the families' 8-token windows, so windowed attention really slides."""

from __future__ import annotations

import random

import pytest
import torch

from family_models import (FAMILIES, hf_greedy, hf_logits, hf_model, our_logits, save_hf_dir, word_tokenizer,
                           write_gguf)
from parrot.common.sampling import SamplingParams
from parrot.engine.loader.builder import build_engine
from parrot.engine.files.config import read_model_config
from parrot.engine.models.assembly import load_model
from parrot.engine.settings import EngineSettings

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES = list(FAMILIES)
FORMATS = ("safetensors", "gguf")
N_NEW = 10


@pytest.fixture(scope="module", params=NAMES)
def family(request, tmp_path_factory):
    """(name, HF model, {format: path})."""
    name = request.param
    ref = hf_model(name, seed=11)
    root = tmp_path_factory.mktemp(name)
    paths = {"safetensors": str(save_hf_dir(ref, root / "hf")), "gguf": str(write_gguf(name, ref, root / "m.gguf"))}
    return name, ref, paths


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (37, 21, 9)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_config_has_the_family_features(family, fmt) -> None:
    name, ref, paths = family
    cfg = read_model_config(paths[fmt])
    for key, want in FAMILIES[name].features.items():
        got = getattr(cfg, key)
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, (key, got, want)
    assert cfg.num_layers == ref.config.num_hidden_layers and cfg.vocab_size == ref.config.vocab_size


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp32_logits_match_transformers(family, fmt) -> None:
    name, ref, paths = family
    ours = load_model(paths[fmt], dtype=torch.float32)
    for ids in prompts(ours.config.vocab_size):
        got, want = our_logits(ours, ids), hf_logits(ref, ids)
        assert (got - want).abs().max().item() < 1e-4, (name, fmt, (got - want).abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))


ENGINE_PATHS = {
    "torch": dict(cpu_path="portable", attention_kernel="torch"),
    "native": dict(cpu_path="avx2", kv_dtype="float32"),
}


def make_engine(model, kernel: str, **kw):
    if kernel == "native":
        pytest.importorskip("parrot.engine.kernels")
        from parrot.engine.runtime.cpu import probe_cpu

        if not {"avx2", "fma"} <= probe_cpu().flags:
            pytest.skip("the avx2 plan needs AVX2 + FMA")
    settings = EngineSettings(dtype="float32", weight_quant="none", block_size=4, kv_cache_tokens=2048,
                              max_batch_tokens=16, shared_prefix_attention="on", **ENGINE_PATHS[kernel], **kw)
    return build_engine(settings, model=model, tokenizer=word_tokenizer(model.config.vocab_size))


def run(fut):
    return fut.result(timeout=120)


@pytest.mark.parametrize("fmt,kernel", [("safetensors", "torch"), ("gguf", "native")])
def test_engine_greedy_matches_transformers(family, fmt, kernel) -> None:
    """Single, batched, forked and chunked-prefill (16-token budget, 4-token blocks) greedy runs all equal
    transformers' generate; the prompt logprobs of a fill equal its log-softmax."""
    name, ref, paths = family
    model = load_model(paths[fmt], dtype=torch.float32)
    ps = prompts(model.config.vocab_size)
    want = [hf_greedy(ref, ids, N_NEW) for ids in ps]
    greedy = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    eng = make_engine(model, kernel)
    if kernel == "native":  # the fused ops and the native attention kernels really run
        assert model.fused_ops is not None and eng.runner.decode_kernel is not None
        assert (eng.runner.prefill_kernel is not None) == (model.config.head_dim % 32 == 0)
    try:
        single = []
        for i, ids in enumerate(ps):
            run(eng.fill(ids, f"s{i}"))
            single.append(list(run(eng.generate(greedy, f"s{i}")).token_ids))
        assert single == want, (name, "single")
        futs = []
        for i, ids in enumerate(ps):
            eng.fill(ids, f"b{i}")
            futs.append(eng.generate(greedy, f"b{i}"))
        assert [list(run(f).token_ids) for f in futs] == want, (name, "batched")
        # forks of one 36-token parent (9 full blocks: the shared-prefix decode path) with different suffixes
        parent = ps[0][:36]
        run(eng.fill(parent, "parent"))
        suffixes = [[5, 6, 7], [9], [11, 12, 13, 14, 15]]
        futs = []
        for i, sfx in enumerate(suffixes):
            run(eng.fill(sfx, f"c{i}", parent_context_id="parent"))
            futs.append(eng.generate(greedy, f"c{i}"))
        forked = [list(run(f).token_ids) for f in futs]
        assert forked == [hf_greedy(ref, parent + sfx, N_NEW) for sfx in suffixes], (name, "forked")
        assert eng.runner.num_shared_prefix_rows > 0
        # prompt logprobs through the paged engine (chunked prefill) equal transformers' log-softmax
        res = run(eng.fill(ps[0], "lp", prompt_logprobs=0))
        ref_lp = torch.log_softmax(hf_logits(ref, ps[0]), -1)
        got = torch.tensor([p.chosen.logprob for p in res.prompt_logprobs[1:]])
        expect = ref_lp[torch.arange(len(ps[0]) - 1), torch.tensor(ps[0][1:])]
        assert (got - expect).abs().max().item() < 1e-4, (name, (got - expect).abs().max().item())
    finally:
        eng.shutdown()


@pytest.mark.parametrize("dtype,quant", [(torch.bfloat16, "none"), (torch.float32, "auto")])
def test_low_precision_paths_stay_close(family, dtype, quant) -> None:
    """The other numerics paths run every family: bf16, and the quantized matmul of the avx2 / avx512 plans (fp32
    compute, Q8_0 weights here: the GGUF is F32; two activation terms) stay close to fp32 (measured: bf16 1-3 %,
    Q8_0 1-6 % of the largest logit; the 6-layer Gemma-3 is the noisiest) and agree on the next token almost
    everywhere."""
    name, ref, paths = family
    kernels = None
    if quant != "none":
        from parrot.engine.layers.linear import MatmulKernels
        from parrot.engine.layers.quant import quant_kernel

        kernels_mod = pytest.importorskip("parrot.engine.kernels")
        ops = kernels_mod.load_kernels(build_if_missing=True)
        if ops is None:
            pytest.skip("native kernels not built")
        variant = "avx2" if "avx2" in ops.qmm_variants() else "scalar"
        kernels = MatmulKernels(quant=quant_kernel(variant))
    fp32 = load_model(paths["gguf"], dtype=torch.float32)
    low = load_model(paths["gguf"], dtype=dtype, weight_quant=quant, kernels=kernels)
    ids = prompts(fp32.config.vocab_size)[0]
    want, got = our_logits(fp32, ids), our_logits(low, ids)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < 0.1, (name, dtype, quant, rel)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def test_unknown_architecture_fails_at_load_naming_it(tmp_path) -> None:
    import json

    import gguf

    hf = {"model_type": "falcon_mamba", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="unsupported model_type 'falcon_mamba'"):
        load_model(str(tmp_path / "hf"), dtype=torch.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
        load_model(str(tmp_path / "m.gguf"), dtype=torch.float32)


def test_phi3_longrope_table_matches_transformers(tmp_path) -> None:
    """Phi-3's LongRoPE: below the original length our table is transformers' short-factor rotation (the parity
    tests above run there), from it on the long-factor one (with the same cos/sin factor), in both formats."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from parrot.engine.layers.rotary import RotaryEmbedding

    ref = hf_model("phi3", seed=1)
    paths = [str(save_hf_dir(ref, tmp_path / "hf")), str(write_gguf("phi3", ref, tmp_path / "m.gguf"))]
    orig = ref.config.original_max_position_embeddings
    short, att = ROPE_INIT_FUNCTIONS["longrope"](ref.config, "cpu")
    long, att_long = ROPE_INIT_FUNCTIONS["longrope"](ref.config, "cpu", seq_len=orig + 1)
    assert att == att_long > 1.0
    pos = torch.arange(ref.config.max_position_embeddings, dtype=torch.float64)
    want = torch.where(pos[:, None] < orig, pos[:, None] * short.double(), pos[:, None] * long.double())
    for path in paths:
        cfg = read_model_config(path)
        assert cfg.rope_scaling["type"] == "longrope" and cfg.rope_scaling["original_max_position_embeddings"] == orig
        rot = RotaryEmbedding(cfg)
        table = rot.table(torch.arange(cfg.max_position_embeddings))[:, 0]  # grows from its first rows to all
        torch.testing.assert_close(table, torch.polar(torch.full_like(want, att), want).to(torch.complex64),
                                   atol=2e-5, rtol=1e-5)


def test_default_plan_runs_every_family(family) -> None:
    """This CPU's default numerics plan (on AVX2: the quantized matmul on Q8_0 weights and an fp16 KV cache; on
    AVX512-BF16: dense bf16 weights, the GGUF being F32) serves every family through the engine: greedy
    continuations mostly equal fp32's."""
    from parrot.engine.loader.builder import plan_for
    from parrot.engine.layers.linear import MatmulKernels

    name, ref, paths = family
    settings = EngineSettings(block_size=4, kv_cache_tokens=2048, max_batch_tokens=16)
    plan = plan_for(settings)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[plan.dtype]
    model = load_model(paths["gguf"], dtype=dtype, weight_quant=plan.weight_quant,
                       kernels=MatmulKernels.for_plan(plan, "cpu", dtype))
    eng = build_engine(settings, model=model, tokenizer=word_tokenizer(model.config.vocab_size))
    try:
        futs = []
        for i, ids in enumerate(prompts(model.config.vocab_size)):
            eng.fill(ids, f"d{i}")
            futs.append(eng.generate(SamplingParams(max_tokens=N_NEW, ignore_eos=True), f"d{i}"))
        got = [list(run(f).token_ids) for f in futs]
    finally:
        eng.shutdown()
    want = [hf_greedy(ref, ids, N_NEW) for ids in prompts(model.config.vocab_size)]
    first = sum(g[0] == w[0] for g, w in zip(got, want))
    assert all(len(g) == N_NEW for g in got) and first >= 2, (name, plan.describe(), got, want)
