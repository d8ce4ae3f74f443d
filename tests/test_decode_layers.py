"""The all-layers decode op (parrot/engine/kernels/decode_layers.cpp) against the per-layer native path: the same
kernels in the same order with the same decode activation rule, so the hidden states and the written KV caches
are bit-identical; and the cases where the model must not take it. Each CPU path the machine runs is tested: the
bf16 one (quantized / VNNI matmuls, bf16 KV; AVX512-BF16) and the fp32 ones (the quantized matmul on its
avx512vnni and avx2 variants, fp32 compute, fp16 KV)."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from parrot.engine.loader.builder import TINY_RANDOM_CONFIG
from parrot.engine.layers.attention import DecodeGroup, PagedAttention, PrefillMeta
from parrot.engine.layers.linear import MatmulKernels
from parrot.engine.layers.packed import vnni_kernel
from parrot.engine.layers.quant import ActNumerics, quant_kernel
from parrot.engine.models.assembly import build_random_model
from parrot.engine.models.decoder import FUSED_OP_NAMES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# head_dim 64 (the AVX-512 attention path), GQA 2:1, every matmul a multiple of 32 (quantized and VNNI packable)
DECODE = ActNumerics(terms=1, x2_rows=8)  # act_quant="auto"'s decode rule
CONFIG = dataclasses.replace(TINY_RANDOM_CONFIG, vocab_size=512, hidden_size=128, intermediate_size=256,
                             num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64)
BS = 16


@pytest.fixture(scope="module")
def ops(native_kernel):
    ops = torch.ops.parrot_kernels
    if not hasattr(ops, "decode_layers"):
        pytest.fail("the kernel library has no decode_layers op")
    return ops


def bf16_model(ops, quant: str, kernels: MatmulKernels | None = None):
    """The bf16 path's model (``kernels`` None: this machine's VNNI backend and quantized matmul, the auto rule)."""
    if "avx512_bf16" not in ops.vnni_backends() or "avx512vnni" not in ops.qmm_variants():
        pytest.skip("no AVX512-BF16 + VNNI here: the bf16 path's native matmuls do not run")
    if kernels is None:
        kernels = MatmulKernels(vnni=vnni_kernel("avx512_bf16"), quant=quant_kernel("avx512vnni", DECODE))
    return build_random_model(CONFIG, dtype=torch.bfloat16, weight_quant=quant, seed=3, kernels=kernels)


def fp32_model(ops, variant: str, quant: str, act: ActNumerics):
    if variant not in ops.qmm_variants():
        pytest.skip(f"no {variant} quantized matmul on this CPU")
    return build_random_model(CONFIG, dtype=torch.float32, weight_quant=quant, seed=3,
                              kernels=MatmulKernels(quant=quant_kernel(variant, act)))


def per_layer_ops(ops) -> SimpleNamespace:
    """The native fused ops without decode_layers: the model then runs its per-layer path."""
    return SimpleNamespace(**{name: getattr(ops, name) for name in FUSED_OP_NAMES})


def decode_batch(rows: int, seed: int, kv_dtype: torch.dtype = torch.bfloat16):
    """``rows`` sequences of ragged lengths over scattered blocks, their caches holding random earlier K/V, and
    the attention backend for one decode step (each row's new token at its last position)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    lens = [rng.randrange(1, 70) for _ in range(rows)]
    free = list(range(1, 8 * rows + 2))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lens]
    width = max(len(t) for t in tables)
    shape = (8 * rows + 2, BS, CONFIG.num_kv_heads, CONFIG.head_dim)
    caches = [(torch.randn(shape).to(kv_dtype), torch.randn(shape).to(kv_dtype)) for _ in range(CONFIG.num_layers)]
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens)])
    group = DecodeGroup(0, rows, None, 0, torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                                       dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                        max(lens))
    ids = torch.tensor([rng.randrange(CONFIG.vocab_size) for _ in range(rows)])
    return ids, torch.tensor(lens) - 1, caches, slots, group


def run(model, ops, rows: int, seed: int, *, prefills: list[PrefillMeta] | None = None):
    """One decode step (the runner's precise=False: decode rows only)."""
    kv_dtype = torch.float16 if model.dtype == torch.float32 else model.dtype  # the plans' KV dtypes
    ids, pos, caches, slots, group = decode_batch(rows, seed, kv_dtype)
    model.use_fused_ops(ops)
    attn = PagedAttention(caches, slots, [group], prefills or [], CONFIG.head_dim ** -0.5,
                          decode_kernel=torch.ops.parrot_kernels.paged_decode)
    return model(ids, pos, attn, precise=False), caches, attn


@pytest.mark.parametrize("quant,rows", [("int4", 1), ("int4", 8), ("int4", 9), ("int4", 80), ("none", 1),
                                        ("none", 80)])
def test_bit_identical_to_the_per_layer_path(ops, quant: str, rows: int) -> None:
    """bf16 path: quantized layers (two activation terms up to 8 rows, one above) and dense bf16 layers (VNNI) run
    natively at every row count, so the op is always taken and equals the per-layer path bit for bit."""
    model = bf16_model(ops, quant)
    fused, fused_caches, attn = run(model, ops, rows, seed=rows)
    assert attn.plain_decode() is not None
    assert all(layer.native_calls(rows) is not None for layer in model.layers)
    per_layer, per_layer_caches, _ = run(model, per_layer_ops(ops), rows, seed=rows)
    assert torch.equal(fused, per_layer)
    for (k1, v1), (k2, v2) in zip(fused_caches, per_layer_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("variant", ["avx512vnni", "avx2"])
@pytest.mark.parametrize("quant,act", [("int4", DECODE), ("int4", ActNumerics(2, 0, 256)), ("int8", ActNumerics(1))])
@pytest.mark.parametrize("rows", [1, 5, 16, 80])
def test_fp32_paths_bit_identical_to_the_per_layer_path(ops, variant: str, quant: str, act: ActNumerics,
                                                       rows: int) -> None:
    """fp32 paths (fp16 KV written as it is converted): the quantized matmul runs every decode row count, so the op
    is always taken and equals the per-layer path bit for bit (int4: Q4_1, int8: Q8_0; the activation rules)."""
    model = fp32_model(ops, variant, quant, act)
    fused, fused_caches, attn = run(model, ops, rows, seed=rows)
    assert attn.plain_decode() is not None
    assert all(layer.native_calls(rows) is not None for layer in model.layers)
    per_layer, per_layer_caches, _ = run(model, per_layer_ops(ops), rows, seed=rows)
    assert fused.dtype == torch.float32 and fused_caches[0][0].dtype == torch.float16
    assert torch.equal(fused, per_layer)
    for (k1, v1), (k2, v2) in zip(fused_caches, per_layer_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_precise_batches_never_take_it(ops) -> None:
    """A forward that processes prompt tokens (precise, the default) runs layer by layer with the precise rule,
    even when its rows happen to be plain decode rows."""
    calls = []
    recording = SimpleNamespace(**vars(per_layer_ops(ops)), decode_layers=lambda *a: calls.append(a))
    model = fp32_model(ops, next(iter(ops.qmm_variants())), "int4", DECODE)
    ids, pos, caches, slots, group = decode_batch(2, 1, torch.float16)
    model.use_fused_ops(recording)
    attn = PagedAttention(caches, slots, [group], [], CONFIG.head_dim ** -0.5,
                          decode_kernel=torch.ops.parrot_kernels.paged_decode)
    model(ids, pos, attn)
    assert calls == []


def test_only_plain_decode_batches_take_it(ops) -> None:
    """A batch with a prefill chunk or a shared-prefix group, or without the native attention kernel, is not a
    PlainDecode (the model then runs layer by layer)."""
    _, _, caches, slots, group = decode_batch(4, seed=1)
    scale = CONFIG.head_dim ** -0.5
    kernel = torch.ops.parrot_kernels.paged_decode
    assert PagedAttention(caches, slots, [group], [], scale, decode_kernel=kernel).plain_decode() is not None
    assert PagedAttention(caches, slots, [group], [], scale).plain_decode() is None
    chunk = PrefillMeta(4, 3, 0, None, None)
    assert PagedAttention(caches, slots, [group], [chunk], scale, decode_kernel=kernel).plain_decode() is None
    shared = dataclasses.replace(group, prefix=group.suffix, prefix_len=BS)
    assert PagedAttention(caches, slots, [shared], [], scale, decode_kernel=kernel).plain_decode() is None


@pytest.mark.parametrize("path", ["bf16", "fp32"])
def test_argument_lists_built_once_and_no_op_without_native_matmuls(ops, path: str) -> None:
    """The per-row-count argument lists are built once (every decode step of that size reuses them); the same
    model assembled for the torch plan (no native matmul kernels: torch's int4 / dense fp32 weights) never takes
    the op and runs layer by layer."""
    calls: list[list[torch.Tensor]] = []

    def decode_layers(*args):
        calls.append(args[3])  # the qkv weights' list
        return ops.decode_layers(*args)

    recording = SimpleNamespace(**vars(per_layer_ops(ops)), decode_layers=decode_layers)
    model = bf16_model(ops, "int4") if path == "bf16" else fp32_model(ops, "avx2", "int4", DECODE)
    run(model, recording, 2, seed=1)
    run(model, recording, 2, seed=1)
    assert len(calls) == 2 and calls[0] is calls[1]
    if path == "bf16":
        onednn = MatmulKernels.available("cpu", torch.bfloat16).onednn
        torch_plan = bf16_model(ops, "int4", MatmulKernels(onednn=onednn))
    else:
        torch_plan = build_random_model(CONFIG, dtype=torch.float32, weight_quant="none", seed=3,
                                        kernels=MatmulKernels())
    run(torch_plan, recording, 2, seed=1)
    assert len(calls) == 2
    assert all(layer.native_calls(rows) is None for layer in torch_plan.layers for rows in (1, 2, 8, 64))
