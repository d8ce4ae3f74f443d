"""The native paged-decode kernel (parrot/engine/kernels/paged_attention.cpp) against dense attention, its input
checks, whole engines with the native and the torch attention path producing the same tokens, and the sampler's
fast greedy argmax."""

from __future__ import annotations

import random

import pytest
import torch

from parrot.common.sampling import SamplingParams
from parrot.engine.loader.builder import build_engine
from parrot.engine.files.config import ModelConfig
from parrot.engine.models.assembly import build_random_model
from parrot.engine.settings import EngineSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dense_reference(q, kc, vc, tables, lens, scale):
    """Per sequence: concatenate its blocks, softmax(q k^T * scale) v in float64; also the log-sum-exp."""
    B, H, D = q.shape
    n_kv = kc.shape[2]
    G = H // n_kv
    outs, lses = [], []
    for b in range(B):
        k = torch.cat([kc[blk] for blk in tables[b]]).double()[: lens[b]]  # [L, n_kv, D]
        v = torch.cat([vc[blk] for blk in tables[b]]).double()[: lens[b]]
        s = torch.einsum("kgd,lkd->kgl", q[b].double().view(n_kv, G, D), k) * scale
        outs.append(torch.einsum("kgl,lkd->kgd", torch.softmax(s, -1), v).reshape(H, D))
        lses.append(torch.logsumexp(s, -1).reshape(H))
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("dtype,head_dim,kv_dtype", [
    (torch.float32, 64, None), (torch.bfloat16, 64, None), (torch.float32, 128, None), (torch.bfloat16, 128, None),
    (torch.bfloat16, 32, None), (torch.bfloat16, 16, None), (torch.float32, 24, None),
    (torch.float32, 64, torch.float16), (torch.float32, 128, torch.float16), (torch.float32, 32, torch.bfloat16),
    (torch.bfloat16, 64, torch.float16), (torch.float32, 24, torch.float16)])
def test_matches_dense_attention(native_kernel, dtype, head_dim, kv_dtype):
    """Scattered blocks, ragged lengths (1 token, odd counts, partial last blocks, several blocks), GQA 3:1;
    D = 32/64/128 take the AVX-512 path where the CPU has it (bf16: VDPBF16PS scores and the two-tokens-per-
    instruction P.V pass) and the AVX2 one where it has only that, D = 16/24 the portable one. KV caches in another
    dtype than q (fp16 for the integer-dot CPU paths' fp32 models) take the AVX2 path on any x86-64-v3 CPU."""
    kv_dtype = kv_dtype or dtype
    rng = random.Random(0)
    torch.manual_seed(0)
    bs, n_kv, G, nb = 16, 3, 3, 80
    kc = torch.randn(nb, bs, n_kv, head_dim).to(kv_dtype)
    vc = torch.randn(nb, bs, n_kv, head_dim).to(kv_dtype)
    lens = [1, 15, 16, 17, 100, 257, 33, 64]
    free = list(range(nb))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), n_kv * G, head_dim).to(dtype)
    scale = head_dim ** -0.5
    out, lse = native_kernel(q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), scale, True)
    ref_out, ref_lse = dense_reference(q, kc, vc, tables, lens, scale)
    atol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output itself is rounded to 8 mantissa bits
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.allclose(out.double(), ref_out, atol=atol), (out.double() - ref_out).abs().max()
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4), (lse.double() - ref_lse).abs().max()
    # a strided q (a view into a wider buffer, like the model's fused qk tensor) gives the same result
    wide = torch.zeros(q.shape[0], q.shape[1] + 2, head_dim, dtype=dtype)
    wide[:, : q.shape[1]] = q
    out2, _ = native_kernel(wide[:, : q.shape[1]], kc, vc, table, torch.tensor(lens, dtype=torch.int32), scale, False)
    assert torch.equal(out, out2)


def test_rejects_bad_tables(native_kernel):
    """A block id outside the pool or a length beyond the table raises (never reads outside the pool)."""
    kc = torch.zeros(4, 16, 1, 64)
    q = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="block id out of range"):
        native_kernel(q, kc, kc, torch.tensor([[7]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                      1.0, False)
    with pytest.raises(RuntimeError, match="seq_lens out of range"):
        native_kernel(q, kc, kc, torch.tensor([[0]], dtype=torch.int32), torch.tensor([17], dtype=torch.int32),
                      1.0, False)
    with pytest.raises(RuntimeError, match="int32"):
        native_kernel(q, kc, kc, torch.tensor([[0]]), torch.tensor([5], dtype=torch.int32), 1.0, False)


# a small GQA model with head_dim 64 so the engine runs the kernel's vectorized path
SMALL = ModelConfig(
    name="small-llama", arch="llama", vocab_size=49152, hidden_size=128, intermediate_size=256, num_layers=2,
    num_heads=6, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
    max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_engine_native_and_torch_paths_agree(native_kernel, kv_dtype):
    """Concurrent greedy generations, plain and forked (shared-prefix groups), give the same tokens whichever
    attention path decodes them (fp32 compute; KV stored in fp32, or in fp16 as the integer-dot CPU paths keep
    it: the torch path then converts what it reads)."""
    from parrot.engine.files.tokenizer import load_tokenizer
    from parrot.engine.files.model_files import default_model_path

    tok = load_tokenizer(default_model_path())
    model = build_random_model(SMALL, dtype=torch.float32, seed=1)
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(5, 90))] for _ in range(6)]
    prefix = [rng.randrange(100, 40000) for _ in range(70)]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    results = {}
    for path in ("torch", "native"):
        eng = build_engine(EngineSettings(dtype="float32", weight_quant="none", kv_cache_tokens=4096,
                                          attention_kernel=path, kv_dtype=kv_dtype, shared_prefix_attention="on"),
                           model=model, tokenizer=tok)
        try:
            assert (eng.runner.decode_kernel is not None) == (path == "native")
            eng.fill(prefix, "base").result()
            futs = [eng.fill(p, f"p{i}") for i, p in enumerate(prompts)]
            [f.result() for f in futs]
            gens = [eng.generate(sp, f"g{i}", f"p{i}") for i in range(len(prompts))]
            gens += [eng.generate(sp, f"fork{i}", "base") for i in range(4)]
            results[path] = [g.result().token_ids for g in gens]
            assert eng.runner.num_shared_prefix_rows > 0  # the forks decoded as one shared-prefix group
        finally:
            eng.shutdown()
    assert results["native"] == results["torch"]


@pytest.mark.parametrize("vocab", [49152, 50001, 1500, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_argmax(vocab, dtype):
    """The sampler's chunked greedy argmax equals torch's argmax, incl. ties (first index wins) and a maximum in
    the short last chunk."""
    from parrot.engine.runtime.sampler import argmax_rows

    torch.manual_seed(vocab)
    x = torch.randn(8, vocab)
    x[1, 5] = x[1].max() + 1
    x[1, vocab - 1] = x[1, 5]  # tie between the first and the last column: index 5 wins
    x[2, vocab - 1] = x[2].max() + 1  # maximum in the overhang chunk
    x[3, 1030 % vocab] = x[3, 2000 % vocab] = x[3].max() + 1  # tie inside / across chunks
    x = x.to(dtype)
    got = argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[1].item() == 5 and got[2].item() == vocab - 1
