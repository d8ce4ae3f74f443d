"""Model zoo: GGUF files of real model shapes, built on this machine without downloading any weights.

    python -m parrot.bench.model_zoo list [--out bench_out/models]
    python -m parrot.bench.model_zoo build --shape llama3.2-1b --format Q4_K_M [--out bench_out/models]
                                           [--threads 2] [--seed 0] [--force]
    python -m parrot.bench.model_zoo check FILE.gguf [...]        # our config + tensor types of each file
    python -m parrot.bench.model_zoo check-padded [--out ...]     # the padded model computes SmolLM2's function

``--shape`` and ``--format`` take comma-separated lists. Files are cached by name in ``--out``
(``{shape}.{format}.gguf``); an existing file is reused unless ``--force``.

Two kinds of shape:

* **random weights** (``llama3.2-1b``, ``llama3.2-3b``, ``qwen2.5-1.5b``; ``tiny`` / ``tiny-qwen2`` for tests): the
  real model's hyper-parameters with the SmolLM2 tokenizer (49152 tokens; its ``tokenizer.*`` metadata and chat
  template are copied from the default model's GGUF) and tied embeddings. Written as F16 (F32 when asked) with
  ``gguf.GGUFWriter``: llama.cpp's tensor names and metadata keys, one tensor generated (normal, std 0.02; norms
  1 + N(0, 0.02); a fixed seed per tensor) and written at a time, so memory stays at the largest tensor. LLaMA
  files carry llama.cpp's ``rope_freqs`` tensor for Llama 3's RoPE scaling (factor 32, as Llama 3.2 has), like
  llama.cpp's converter writes it. GGUF's LLaMA Q/K rows are in llama.cpp's interleaved-RoPE order; for random
  weights that changes nothing, the names and shapes are the converter's.
* **real weights** (``smollm2-135m-padded``): the default SmolLM2-135M GGUF dequantized (``gguf.quants``) and
  zero-padded so every matmul's input dimension is a multiple of 256 (what the K-quants need; 576 is not):
  hidden 576 -> 768, heads 9 -> 12 and KV heads 3 -> 4 (the new heads all zero; the GQA ratio stays 3, so q head
  i still reads KV head i // 3), intermediate 1536 unchanged, head_dim 64. RMSNorm over 768 dims sees
  mean(x^2) * 576/768 for the same values, so eps' = 0.75 * eps and every norm weight is multiplied by sqrt(0.75):
  the padded model computes exactly SmolLM2's function (the padded dims of the residual stream stay zero).
  Written as F32 (the dequantized values exactly).

Every other format comes from llama.cpp's own quantizer (:func:`parrot.bench.peers.llama_quantize`) run on the
shape's base file (F16, or F32 for the padded model), which stays cached next to it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

DEFAULT_OUT = "bench_out/models"
PADDED = "smollm2-135m-padded"
BASE_FORMATS = ("F32", "F16")  # written here; every other format by llama.cpp's quantizer


@dataclass(frozen=True)
class Shape:
    """Hyper-parameters of a random-weight model (vocabulary: the SmolLM2 tokenizer's)."""

    name: str
    arch: str  # GGUF general.architecture: llama | qwen2
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float
    rms_eps: float
    context_length: int
    qkv_bias: bool = False
    tied: bool = True
    llama3_rope: tuple[float, float, float, int] | None = None  # (factor, low_freq, high_freq, original context)
    listed: bool = True  # False: test shapes, hidden from `list`

    def param_count(self, vocab: int) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = 2 * self.hidden + self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        if self.qkv_bias:
            per_layer += q + 2 * kv
        return vocab * self.hidden * (1 if self.tied else 2) + self.hidden + self.layers * per_layer


_LLAMA32_ROPE = (32.0, 1.0, 4.0, 8192)
SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("llama3.2-1b", "llama", hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192,
          rope_theta=500000.0, rms_eps=1e-5, context_length=131072, llama3_rope=_LLAMA32_ROPE),
    Shape("llama3.2-3b", "llama", hidden=3072, layers=28, heads=24, kv_heads=8, head_dim=128, intermediate=8192,
          rope_theta=500000.0, rms_eps=1e-5, context_length=131072, llama3_rope=_LLAMA32_ROPE),
    Shape("qwen2.5-1.5b", "qwen2", hidden=1536, layers=28, heads=12, kv_heads=2, head_dim=128, intermediate=8960,
          rope_theta=1000000.0, rms_eps=1e-6, context_length=32768, qkv_bias=True),
    # tests: small, every matmul input a multiple of 256 (K-quants), one untied LLaMA and one Qwen2 with biases
    Shape("tiny", "llama", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512,
          rope_theta=10000.0, rms_eps=1e-5, context_length=2048, tied=False, listed=False),
    Shape("tiny-qwen2", "qwen2", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512,
          rope_theta=1000000.0, rms_eps=1e-6, context_length=2048, qkv_bias=True, listed=False),
)}


def shape_names(include_hidden: bool = False) -> list[str]:
    return [n for n, s in SHAPES.items() if s.listed or include_hidden] + [PADDED]


def quant_formats() -> tuple[str, ...]:
    from parrot.bench.peers import LLAMA_QUANTS

    return tuple(dict.fromkeys((*BASE_FORMATS, *LLAMA_QUANTS)))


def base_format(shape: str) -> str:
    """The format a shape is written in by this module (the quantizer's input for every other format)."""
    return "F32" if shape == PADDED else "F16"


def model_path(out_dir: str, shape: str, fmt: str) -> str:
    return os.path.join(out_dir, f"{shape}.{fmt}.gguf")


# ---- GGUF writing (gguf.GGUFWriter, one tensor in memory at a time) ------------------------------------------------
@dataclass(frozen=True)
class _KV:
    key: str
    value: Any
    vtype: Any  # gguf.GGUFValueType
    sub_type: Any = None


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order ([out, in] for a matmul)
    dtype: Any  # np.float32 / np.float16
    make: Callable[[], np.ndarray]


def _write_gguf(path: str, arch: str, kvs: list[_KV], tensors: list[_Tensor]) -> None:
    """Write a GGUF file: metadata, the tensor directory, then each tensor's data as ``make()`` produces it.
    Atomic (``path.part`` renamed)."""
    from gguf import GGUFWriter

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".part"
    writer = GGUFWriter(tmp, arch)
    try:
        for kv in kvs:
            writer.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
        for t in tensors:
            nbytes = math.prod(t.shape) * np.dtype(t.dtype).itemsize
            writer.add_tensor_info(t.name, t.shape, np.dtype(t.dtype), nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            arr = np.ascontiguousarray(t.make(), dtype=t.dtype)
            if arr.shape != t.shape:
                raise AssertionError(f"{t.name}: made shape {arr.shape}, declared {t.shape}")
            writer.write_tensor_data(arr)
            del arr
    finally:
        writer.close()
    os.replace(tmp, path)


@lru_cache(maxsize=4)
def _source_kvs(path: str) -> tuple[_KV, ...]:
    """Every metadata key of a GGUF file with its exact GGUF type (gguf.GGUFReader), GGUF.* pseudo keys excluded."""
    from gguf import GGUFReader, GGUFValueType

    out = []
    for key, field in GGUFReader(path, "r").fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        out.append(_KV(key, field.contents(), vtype, sub))
    return tuple(out)


def tokenizer_kvs(source: str | None = None) -> list[_KV]:
    """The ``tokenizer.*`` metadata (vocabulary, merges, special ids, chat template) of ``source`` (default: the
    default SmolLM2 model's GGUF), as typed in that file."""
    from parrot.engine.files.model_files import default_model_path

    return [kv for kv in _source_kvs(source or default_model_path()) if kv.key.startswith("tokenizer.")]


def _vocab_size(kvs: list[_KV]) -> int:
    return next(len(kv.value) for kv in kvs if kv.key == "tokenizer.ggml.tokens")


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq: float, high_freq: float,
                        original_context: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3's RoPE scaling, as llama.cpp's converter writes them (rope_freqs)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wavelen, high_wavelen = original_context / low_freq, original_context / high_freq
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq) / (high_freq - low_freq)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _gguf_name(tensor, bid: int | None = None, suffix: str = "weight") -> str:
    import gguf

    base = gguf.TENSOR_NAMES[tensor]
    return (base.format(bid=bid) if bid is not None else base) + "." + suffix


def write_random_gguf(shape: Shape, path: str, *, fmt: str = "F16", seed: int = 0,
                      tokenizer_source: str | None = None) -> None:
    """A GGUF of ``shape`` with random weights (module docstring) in F16 or F32."""
    import gguf
    from gguf import GGUFValueType as V

    if fmt not in BASE_FORMATS:
        raise ValueError(f"write_random_gguf writes {BASE_FORMATS}, not {fmt!r}")
    arch = gguf.MODEL_ARCH_NAMES
    arch_enum = next(a for a, n in arch.items() if n == shape.arch)
    supported = set(gguf.MODEL_TENSORS[arch_enum])
    dtype = np.float16 if fmt == "F16" else np.float32
    tok = tokenizer_kvs(tokenizer_source)
    vocab = _vocab_size(tok)
    a = shape.arch
    kvs = [
        _KV("general.type", "model", V.STRING),
        _KV("general.name", f"parrot model zoo {shape.name} (random weights, seed {seed})", V.STRING),
        _KV(f"{a}.block_count", shape.layers, V.UINT32),
        _KV(f"{a}.context_length", shape.context_length, V.UINT32),
        _KV(f"{a}.embedding_length", shape.hidden, V.UINT32),
        _KV(f"{a}.feed_forward_length", shape.intermediate, V.UINT32),
        _KV(f"{a}.attention.head_count", shape.heads, V.UINT32),
        _KV(f"{a}.attention.head_count_kv", shape.kv_heads, V.UINT32),
        _KV(f"{a}.attention.key_length", shape.head_dim, V.UINT32),
        _KV(f"{a}.attention.value_length", shape.head_dim, V.UINT32),
        _KV(f"{a}.rope.freq_base", float(shape.rope_theta), V.FLOAT32),
        _KV(f"{a}.rope.dimension_count", shape.head_dim, V.UINT32),
        _KV(f"{a}.attention.layer_norm_rms_epsilon", float(shape.rms_eps), V.FLOAT32),
        _KV(f"{a}.vocab_size", vocab, V.UINT32),
        _KV("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16 if fmt == "F16" else gguf.LlamaFileType.ALL_F32),
            V.UINT32),
        *tok,
    ]
    T = gguf.MODEL_TENSOR
    plan: list[tuple[str, tuple[int, ...], str]] = []  # (name, shape, kind: matmul | norm | bias)
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    h, inter = shape.hidden, shape.intermediate
    plan.append((_gguf_name(T.TOKEN_EMBD), (vocab, h), "matmul"))
    for i in range(shape.layers):
        plan.append((_gguf_name(T.ATTN_NORM, i), (h,), "norm"))
        for t, rows in ((T.ATTN_Q, q), (T.ATTN_K, kv), (T.ATTN_V, kv)):
            plan.append((_gguf_name(t, i), (rows, h), "matmul"))
            if shape.qkv_bias:
                plan.append((_gguf_name(t, i, "bias"), (rows,), "bias"))
        plan.append((_gguf_name(T.ATTN_OUT, i), (h, q), "matmul"))
        plan.append((_gguf_name(T.FFN_NORM, i), (h,), "norm"))
        plan.append((_gguf_name(T.FFN_GATE, i), (inter, h), "matmul"))
        plan.append((_gguf_name(T.FFN_UP, i), (inter, h), "matmul"))
        plan.append((_gguf_name(T.FFN_DOWN, i), (h, inter), "matmul"))
    plan.append((_gguf_name(T.OUTPUT_NORM), (h,), "norm"))
    if not shape.tied:
        plan.append((_gguf_name(T.OUTPUT), (vocab, h), "matmul"))
    for t in (T.TOKEN_EMBD, T.ATTN_Q, T.FFN_DOWN, T.OUTPUT_NORM) + ((T.OUTPUT,) if not shape.tied else ()):
        if t not in supported:
            raise ValueError(f"gguf names no {t.name} tensor for arch {shape.arch!r}")

    def random(idx: int, dims: tuple[int, ...], kind: str) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            rng = np.random.default_rng([seed, idx])  # per tensor: the same values whatever the order or format
            noise = rng.standard_normal(dims, dtype=np.float32)
            noise *= 0.02
            if kind == "norm":
                noise += 1.0
            return noise.astype(dtype, copy=False)
        return make

    tensors = []
    if shape.llama3_rope is not None:  # llama.cpp's converter writes it first; always F32
        factors = llama3_rope_factors(shape.head_dim, shape.rope_theta, *shape.llama3_rope)
        tensors.append(_Tensor(_gguf_name(T.ROPE_FREQS), factors.shape, np.float32, lambda: factors))
    for idx, (name, dims, kind) in enumerate(plan):
        tdtype = np.float32 if kind in ("norm", "bias") else dtype  # 1-D tensors stay F32 (llama.cpp's converter)
        tensors.append(_Tensor(name, dims, tdtype, random(idx, dims, kind)))
    _write_gguf(path, shape.arch, kvs, tensors)


# ---- the padded SmolLM2 ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Padding:
    hidden: int = 768
    heads: int = 12
    kv_heads: int = 4
    intermediate: int | None = None  # None: unchanged


_PADDED_DEFAULT = Padding()


def write_padded_gguf(src: str, path: str, pad: Padding = _PADDED_DEFAULT, *, num_layers: int | None = None) -> dict:
    """``src`` (a LLaMA / Qwen2 GGUF) dequantized to F32 and zero-padded to ``pad`` (module docstring), so that
    it computes the same function. ``num_layers`` keeps only the first layers (tests: a small pair of files whose
    unpadded twin is ``Padding(hidden=H, heads=h, kv_heads=kv)``, the identity padding). Returns the new sizes."""
    from gguf import GGUFValueType as V
    from gguf import LlamaFileType
    from gguf.quants import dequantize

    from parrot.engine.files.config import config_from_gguf
    from parrot.engine.files.gguf_file import GGUFFile

    gf = GGUFFile(src)
    cfg = config_from_gguf(gf)
    if cfg.arch not in ("llama", "qwen2"):
        raise ValueError(f"padding supports llama / qwen2 files, not {cfg.arch!r}")
    arch, hd = gf.get("general.architecture"), cfg.head_dim
    inter = pad.intermediate or cfg.intermediate_size
    ratio = cfg.num_heads // cfg.num_kv_heads
    if pad.hidden < cfg.hidden_size or pad.heads < cfg.num_heads or pad.kv_heads < cfg.num_kv_heads \
            or inter < cfg.intermediate_size:
        raise ValueError(f"padding {pad} would shrink {cfg.name}")
    if pad.heads != ratio * pad.kv_heads:
        raise ValueError(f"padding to {pad.heads} heads / {pad.kv_heads} KV heads changes the GQA ratio {ratio}")
    layers = cfg.num_layers if num_layers is None else num_layers
    scale = cfg.hidden_size / pad.hidden  # mean(x^2) over the padded width = scale * mean over the real one
    eps = cfg.rms_norm_eps * scale
    norm_mul = np.float32(math.sqrt(scale))
    q, kv = pad.heads * hd, pad.kv_heads * hd
    h = pad.hidden
    targets = {  # GGUF tensor (layer part) -> padded numpy shape
        "token_embd.weight": (cfg.vocab_size, h), "output.weight": (cfg.vocab_size, h), "output_norm.weight": (h,),
        "attn_norm.weight": (h,), "ffn_norm.weight": (h,),
        "attn_q.weight": (q, h), "attn_k.weight": (kv, h), "attn_v.weight": (kv, h), "attn_output.weight": (h, q),
        "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
        "ffn_gate.weight": (inter, h), "ffn_up.weight": (inter, h), "ffn_down.weight": (h, inter),
    }

    def make(info, target: tuple[int, ...], norm: bool) -> Callable[[], np.ndarray]:
        def run() -> np.ndarray:
            w = np.asarray(dequantize(gf.raw(info), info.qtype), dtype=np.float32).reshape(info.shape)
            if norm:
                w = w * norm_mul
            out = np.zeros(target, dtype=np.float32)
            out[tuple(slice(0, d) for d in w.shape)] = w  # new heads / dims at the end of each axis, all zero
            return out
        return run

    tensors = []
    for info in gf.tensors:
        name = info.name
        if name.startswith("blk."):
            bid, _, part = name[4:].partition(".")
            if int(bid) >= layers:
                continue
        else:
            part = name
        if part == "rope_freqs.weight":
            tensors.append(_Tensor(name, info.shape, np.float32, make(info, info.shape, False)))
            continue
        if part not in targets:
            raise ValueError(f"padding does not know tensor {name!r}")
        norm = part.endswith("norm.weight")
        tensors.append(_Tensor(name, targets[part], np.float32, make(info, targets[part], norm)))
    overrides = {
        f"{arch}.embedding_length": pad.hidden, f"{arch}.attention.head_count": pad.heads,
        f"{arch}.attention.head_count_kv": pad.kv_heads, f"{arch}.feed_forward_length": inter,
        f"{arch}.block_count": layers, f"{arch}.attention.layer_norm_rms_epsilon": eps,
        "general.file_type": int(LlamaFileType.ALL_F32),
    }
    kvs, seen = [], set()
    for kv_ in _source_kvs(src):
        if kv_.key in ("general.architecture", "general.quantization_version"):
            continue
        value = overrides.get(kv_.key, kv_.value)
        if kv_.key == "general.name":
            identity = (pad.hidden, pad.heads, pad.kv_heads, inter) == (cfg.hidden_size, cfg.num_heads,
                                                                       cfg.num_kv_heads, cfg.intermediate_size)
            value = f"{kv_.value} (" + ("dequantized to F32" if identity else
                                        f"zero-padded: hidden {pad.hidden}, {pad.heads} heads, {pad.kv_heads} "
                                        f"KV heads") + ")"
        kvs.append(_KV(kv_.key, value, kv_.vtype, kv_.sub_type))
        seen.add(kv_.key)
    for key, value in overrides.items():  # keys the source lacked
        if key not in seen:
            kvs.append(_KV(key, value, V.FLOAT32 if isinstance(value, float) else V.UINT32))
    _write_gguf(path, arch, kvs, tensors)
    return {"hidden": pad.hidden, "heads": pad.heads, "kv_heads": pad.kv_heads, "intermediate": inter,
            "layers": layers, "rms_eps": eps, "norm_scale": float(norm_mul)}


def dequantize_gguf(src: str, dst: str) -> None:
    """An F32 twin of a LLaMA / Qwen2 GGUF: every tensor dequantized (gguf.quants), same shapes and metadata (the
    identity padding of :func:`write_padded_gguf`)."""
    from parrot.engine.files.config import read_model_config

    cfg = read_model_config(src)
    write_padded_gguf(src, dst, Padding(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads))


# ---- building -------------------------------------------------------------------------------------------------------
def tensor_type_counts(path: str) -> dict[str, int]:
    """Number of tensors per ggml type in a GGUF file."""
    from parrot.engine.files.gguf_file import GGUFFile

    return dict(Counter(t.qtype.name for t in GGUFFile(path).tensors).most_common())


def build(shape: str, fmt: str, out_dir: str = DEFAULT_OUT, *, threads: int = 2, seed: int = 0,
          force: bool = False, log: Callable[[str], None] = print) -> str:
    """The path of ``shape`` in ``fmt`` under ``out_dir``, built if missing (the base file first, then llama.cpp's
    quantizer for any other format)."""
    if shape != PADDED and shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(shape_names(True))}")
    if fmt not in quant_formats():
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(quant_formats())}")
    path = model_path(out_dir, shape, fmt)
    if os.path.isfile(path) and not force:
        return path
    t0 = time.perf_counter()
    base = base_format(shape)
    if shape == PADDED and fmt == base:
        from parrot.engine.files.model_files import default_model_path

        write_padded_gguf(default_model_path(), path)
    elif shape != PADDED and fmt in BASE_FORMATS:
        write_random_gguf(SHAPES[shape], path, fmt=fmt, seed=seed)
    else:
        from parrot.bench.peers import llama_quantize

        src = build(shape, base, out_dir, threads=threads, seed=seed, force=False, log=log)
        llama_quantize(src, path, fmt, threads)
    secs = time.perf_counter() - t0
    log(f"built {path} ({os.path.getsize(path) / 2**20:.1f} MiB) in {secs:.1f} s; tensor types "
        f"{tensor_type_counts(path)}")
    return path


def describe(path: str) -> dict:
    """Our engine's reading of a GGUF (read_model_config) and its tensor types."""
    from parrot.bench.peers import gguf_file_type
    from parrot.engine.files.config import read_model_config

    cfg = read_model_config(path)
    return {"path": path, "mib": round(os.path.getsize(path) / 2**20, 1), "file_type": gguf_file_type(path),
            "arch": cfg.arch, "hidden": cfg.hidden_size, "layers": cfg.num_layers, "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "intermediate": cfg.intermediate_size,
            "vocab": cfg.vocab_size, "tied": cfg.tie_word_embeddings, "rope_theta": cfg.rope_theta,
            "rms_eps": cfg.rms_norm_eps, "rope_scaling": (cfg.rope_scaling or {}).get("type"),
            "qkv_bias": cfg.attention_bias, "tensor_types": tensor_type_counts(path)}


# ---- checking the padded model ----------------------------------------------------------------------------------
CHECK_PROMPTS = (
    "The capital of France is",
    "def reverse_string(s):\n    return",
    "<|im_start|>user\nWhat color is the sky on a clear day?<|im_end|>\n<|im_start|>assistant\n",
)


def _causal_attention(layer_idx, q, k, v):
    """One contiguous sequence at positions 0..T-1: causal SDPA with GQA (a plain reference backend)."""
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(0, 1).reshape(q.shape[0], -1)


def engine_logits(path: str, prompts: list[list[int]]) -> list[np.ndarray]:
    """Our engine's fp32 dense model (load_model, weight_quant="none"): the logits of every position of each prompt."""
    import torch

    from parrot.engine.models import load_model

    model = load_model(path, dtype=torch.float32, weight_quant="none")
    out = []
    with torch.inference_mode():
        for ids in prompts:
            hidden = model(torch.tensor(ids), torch.arange(len(ids)), _causal_attention)
            out.append(model.compute_logits(hidden).numpy().copy())
    return out


def llama_cpp_logits(path: str, prompts: list[list[int]], threads: int = 2) -> list[np.ndarray]:
    """llama.cpp's logits of every position of each prompt (fresh KV for each)."""
    from parrot.bench.peers import LlamaCppRunner

    n = max(len(p) for p in prompts)
    runner = LlamaCppRunner(path, threads, max_seqs=1, seq_ctx=-(-n // 256) * 256, n_batch=max(512, n))
    try:
        out = []
        for ids in prompts:
            runner.lc.llama_memory_clear(runner.mem, True)
            runner._decode([(t, i, 0, True) for i, t in enumerate(ids)])
            out.append(np.ctypeslib.as_array(runner.lc.llama_get_logits(runner.ctx),
                                             shape=(len(ids), runner.n_vocab)).copy())
        return out
    finally:
        runner.close()


def check_padded(original: str, padded: str, *, llama_files: list[str] = (), threads: int = 2,
                 log: Callable[[str], None] = print) -> dict:
    """Compare our engine's fp32 logits on ``original`` and ``padded`` (every position of CHECK_PROMPTS), and
    llama.cpp's top-1 on ``original`` and each of ``llama_files`` (padded files in any format)."""
    from parrot.engine.files.tokenizer import load_tokenizer

    tok = load_tokenizer(original)
    prompts = [tok.encode(p) for p in CHECK_PROMPTS]
    ref, got = engine_logits(original, prompts), engine_logits(padded, prompts)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(ref, got))
    scale = max(float(np.abs(a).max()) for a in ref)
    top1 = float(np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(ref, got)])))
    res: dict = {"ours_fp32": {"max_abs_logit_diff": diff, "max_abs_logit": scale, "top1_agreement_all_positions": top1,
                               "next_token_same": all(int(a[-1].argmax()) == int(b[-1].argmax())
                                                      for a, b in zip(ref, got))}}
    log(f"ours fp32: max |logit diff| {diff:.2e} (logits up to {scale:.1f}), top-1 agreement over all positions "
        f"{top1:.3f}")
    if llama_files:
        from parrot.bench.peers import gguf_file_type

        base = llama_cpp_logits(original, prompts, threads)
        res["llama_cpp"] = {}
        for f in llama_files:
            other = llama_cpp_logits(f, prompts, threads)
            nxt = [int(a[-1].argmax()) == int(b[-1].argmax()) for a, b in zip(base, other)]
            allpos = float(np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(base, other)])))
            diff = max(float(np.abs(a - b).max()) for a, b in zip(base, other))
            res["llama_cpp"][os.path.basename(f)] = {"next_token_same": nxt, "top1_agreement_all_positions": allpos,
                                                     "max_abs_logit_diff": diff}
            log(f"llama.cpp {gguf_file_type(original)} original vs {os.path.basename(f)}: next token same {nxt}, "
                f"top-1 agreement over all positions {allpos:.3f}, max |logit diff| {diff:.3f}")
    return res


# ---- CLI ----------------------------------------------------------------------------------------------------------
def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _list(out_dir: str) -> Iterator[str]:
    from parrot.engine.files.model_files import default_model_path

    vocab = _vocab_size(tokenizer_kvs())
    yield f"{'shape':<22} {'arch':<6} {'params':>8}  hidden x layers, heads/kv x head_dim, intermediate"
    for name in shape_names():
        if name == PADDED:
            desc = "SmolLM2-135M's real weights zero-padded (params incl. zeros): 768 x 30, 12/4 x 64, 1536"
            arch, params = "llama", "0.19B"
        else:
            s = SHAPES[name]
            desc = f"{s.hidden} x {s.layers}, {s.heads}/{s.kv_heads} x {s.head_dim}, {s.intermediate}" + \
                   (" (+QKV bias)" if s.qkv_bias else "")
            arch, params = s.arch, f"{s.param_count(vocab) / 1e9:.2f}B"
        yield f"{name:<22} {arch:<6} {params:>8}  {desc}"
        for fmt in quant_formats():
            p = model_path(out_dir, name, fmt)
            if os.path.isfile(p):
                yield f"    built: {p} ({os.path.getsize(p) / 2**20:.1f} MiB)"
    yield f"formats: {', '.join(quant_formats())}"
    yield f"tokenizer from: {default_model_path()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parrot.bench.model_zoo", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("list", help="shapes, formats and the files built so far")
    pl.add_argument("--out", default=DEFAULT_OUT)
    pb = sub.add_parser("build", help="build (or reuse) GGUF files")
    pb.add_argument("--shape", type=_csv, required=True, help=f"comma-separated: {', '.join(shape_names())}")
    pb.add_argument("--format", type=_csv, required=True, help="comma-separated, e.g. F16,Q4_0,Q4_K_M")
    pb.add_argument("--out", default=DEFAULT_OUT)
    pb.add_argument("--threads", type=int, default=2, help="llama.cpp quantizer threads")
    pb.add_argument("--seed", type=int, default=0, help="random weights' seed")
    pb.add_argument("--force", action="store_true", help="rebuild even if the file exists")
    pc = sub.add_parser("check", help="our engine's config and the tensor types of GGUF files")
    pc.add_argument("files", nargs="+")
    pp = sub.add_parser("check-padded", help="the padded SmolLM2 computes the original's function")
    pp.add_argument("--out", default=DEFAULT_OUT)
    pp.add_argument("--llama-formats", type=_csv, default=["F32", "F16"],
                    help="padded files llama.cpp compares with the original (built if missing; '' for none)")
    pp.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.cmd == "list":
        for line in _list(args.out):
            print(line)
        return 0
    if args.cmd == "build":
        for shape in args.shape:
            for fmt in args.format:
                path = build(shape, fmt, args.out, threads=args.threads, seed=args.seed, force=args.force)
                print(path, flush=True)
        return 0
    if args.cmd == "check":
        import json

        for f in args.files:
            print(json.dumps(describe(f)), flush=True)
        return 0
    if args.cmd == "check-padded":
        import json

        from parrot.bench.peers import llama_cpp_available
        from parrot.engine.files.model_files import default_model_path

        padded = build(PADDED, "F32", args.out, threads=args.threads)
        files = [build(PADDED, f, args.out, threads=args.threads) for f in args.llama_formats] \
            if llama_cpp_available() else []
        print(json.dumps(check_padded(default_model_path(), padded, llama_files=files, threads=args.threads)))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
