"""Every GGUF format a file brings, end to end through the loader: the ones the quantized matmul reads run from the
file's own codes (no conversion logged), a format without a kernel (Q3_K here) is dequantized and run as Q8_0 with
the conversion logged by tensor name -- and the model computes what the same weights, dequantized into an F32 file,
compute densely."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from family_models import our_logits
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from parrot.engine.files.config import read_model_config
from parrot.engine.layers.linear import MatmulKernels
from parrot.engine.layers.quant import ActNumerics, QuantWeight, quant_kernel
from parrot.engine.models.assembly import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 512, 2, 4, 2, 64, 512
# one format per matrix, cycled (q3_k: no kernel reads it)
FORMATS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "q3_k"]


def _raw(fmt: str, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The GGUF bytes of ``w`` in ``fmt``: gguf's reference quantizer where it has one, else random codes under
    sane scales (K-quants: what matters here is that both models read the same bytes)."""
    qt = GGMLQuantizationType[fmt.upper()]
    try:
        return quantize(w, qt)
    except NotImplementedError:
        values, size = GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // values, size), dtype=np.uint8)
        halves = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q3_k": (108,)}[fmt]
        for off in halves:
            scale = rng.uniform(0.0, 0.002, size=raw.shape[:2]).astype(np.float16)
            raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
        return raw.reshape(w.shape[0], -1)


def write_pair(tmp_path) -> tuple[str, str]:
    """A tiny LLaMA as a GGUF of mixed formats and as an F32 GGUF of the same (dequantized) values."""
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (VOCAB, HIDDEN), "output": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.attn_q": (HEADS * HEAD_DIM, HIDDEN), f"blk.{i}.attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
                   f"blk.{i}.attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), f"blk.{i}.attn_output": (HIDDEN, HEADS * HEAD_DIM),
                   f"blk.{i}.ffn_gate": (INTER, HIDDEN), f"blk.{i}.ffn_up": (INTER, HIDDEN),
                   f"blk.{i}.ffn_down": (HIDDEN, INTER)}
    paths = (str(tmp_path / "mixed.gguf"), str(tmp_path / "f32.gguf"))
    writers = [GGUFWriter(p, "llama") for p in paths]
    for w in writers:
        w.add_name("tiny-formats")
        w.add_block_count(LAYERS)
        w.add_context_length(256)
        w.add_embedding_length(HIDDEN)
        w.add_feed_forward_length(INTER)
        w.add_head_count(HEADS)
        w.add_head_count_kv(KV_HEADS)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(VOCAB)
        w.add_uint32("tokenizer.ggml.bos_token_id", 1)
        w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for j, (name, shape) in enumerate(shapes.items()):
        fmt = FORMATS[j % len(FORMATS)]
        floats = rng.normal(0, 0.05, size=shape).astype(np.float32)
        raw = _raw(fmt, floats, rng)
        qt = GGMLQuantizationType[fmt.upper()]
        writers[0].add_tensor(f"{name}.weight", raw, raw_dtype=qt)
        writers[1].add_tensor(f"{name}.weight", np.ascontiguousarray(dequantize(raw, qt).reshape(shape)))
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            v = (1 + 0.1 * rng.normal(size=HIDDEN)).astype(np.float32)
            for w in writers:
                w.add_tensor(f"blk.{i}.{norm}.weight", v)
    v = (1 + 0.1 * rng.normal(size=HIDDEN)).astype(np.float32)
    for w in writers:
        w.add_tensor("output_norm.weight", v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return paths


def test_every_format_runs_from_the_file_and_q3_k_converts_logged(native_kernel, tmp_path, caplog) -> None:
    mixed, f32 = write_pair(tmp_path)
    assert read_model_config(mixed).hidden_size == HIDDEN
    variant = next(iter(torch.ops.parrot_kernels.qmm_variants()))
    kernels = MatmulKernels(quant=quant_kernel(variant, ActNumerics(terms=2)))
    with caplog.at_level(logging.INFO):
        ours = load_model(mixed, dtype=torch.float32, weight_quant="auto", kernels=kernels)
    text = caplog.text
    assert "Q3_K, which has no native kernel" in text and "q3_k -> q8_0" in text  # named, not silent
    assert all(f"{f} -> " not in text for f in FORMATS if f != "q3_k")  # the others are read as they are
    run = {fmt for lin in ours.linears() if isinstance(lin.path, QuantWeight) for fmt in lin.quant.split("+")}
    assert run == set(FORMATS) - {"q3_k"} | {"q8_0"}
    dense = load_model(f32, dtype=torch.float32, weight_quant="none", kernels=MatmulKernels())
    ids = [int(x) for x in np.random.default_rng(1).integers(3, VOCAB, 24)]
    got, want = our_logits(ours, ids), our_logits(dense, ids)
    # two activation terms against fp32 on the same values, but Q3_K's matrix requantized to Q8_0
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
