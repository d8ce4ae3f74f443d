"""parrot.bench.model_zoo: random-weight GGUFs of a model shape (tiny test shapes here), the zero-padded SmolLM2
that computes the original's function, and llama.cpp's quantizer on them (only where llama_cpp is installed)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from parrot.bench import model_zoo
from parrot.bench.model_zoo import SHAPES, Padding, write_padded_gguf, write_random_gguf
from parrot.engine.files.config import read_model_config
from parrot.engine.files.gguf_file import GGUFFile

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory, default_model_path) -> dict[str, str]:
    """The tiny LLaMA (untied) as F16 and F32, and the tiny Qwen2 (tied, QKV biases) as F16."""
    root = tmp_path_factory.mktemp("zoo")
    out = {}
    for shape, fmt in (("tiny", "F16"), ("tiny", "F32"), ("tiny-qwen2", "F16")):
        out[f"{shape}.{fmt}"] = str(root / f"{shape}.{fmt}.gguf")
        write_random_gguf(SHAPES[shape], out[f"{shape}.{fmt}"], fmt=fmt, seed=3)
    return out


def _tensors(path: str) -> dict:
    return {t.name: t for t in GGUFFile(path).tensors}


def test_random_llama_reads_as_its_shape(tiny_files, default_model_path):
    shape = SHAPES["tiny"]
    cfg = read_model_config(tiny_files["tiny.F16"])
    assert (cfg.arch, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size) == ("llama", 256, 2, 4, 2, 64, 512)
    assert cfg.vocab_size == 49152 and not cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.rope_theta == shape.rope_theta and cfg.rope_scaling is None
    assert math.isclose(cfg.rms_norm_eps, shape.rms_eps, rel_tol=1e-6)
    src = read_model_config(default_model_path)  # special ids come with the copied tokenizer metadata
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (src.bos_token_id, src.eos_token_ids)
    t = _tensors(tiny_files["tiny.F16"])
    assert t["token_embd.weight"].shape == (49152, 256) and t["output.weight"].shape == (49152, 256)
    assert t["blk.1.attn_q.weight"].shape == (256, 256) and t["blk.1.attn_k.weight"].shape == (128, 256)
    assert t["blk.0.attn_output.weight"].shape == (256, 256) and t["blk.0.ffn_down.weight"].shape == (256, 512)
    assert t["blk.0.ffn_gate.weight"].shape == (512, 256) and t["output_norm.weight"].shape == (256,)
    assert {x.qtype.name for n, x in t.items() if n.endswith("norm.weight")} == {"F32"}
    assert {x.qtype.name for n, x in t.items() if not n.endswith("norm.weight")} == {"F16"}
    assert len(t) == 3 + 2 * 9
    # the same random values in F16 and F32 (per-tensor seeds), std 0.02 / norms near 1
    gf16, gf32 = GGUFFile(tiny_files["tiny.F16"]), GGUFFile(tiny_files["tiny.F32"])
    from gguf.quants import dequantize

    def arr(gf, name):
        info = next(x for x in gf.tensors if x.name == name)
        return dequantize(gf.raw(info), info.qtype).reshape(info.shape)

    w16, w32 = arr(gf16, "blk.0.ffn_up.weight"), arr(gf32, "blk.0.ffn_up.weight")
    np.testing.assert_allclose(w16, w32, atol=1e-4)
    assert abs(float(w32.std()) - 0.02) < 1e-3 and abs(float(w32.mean())) < 1e-3
    assert abs(float(arr(gf32, "blk.1.ffn_norm.weight").mean()) - 1.0) < 0.01


def test_random_qwen2_and_llama3_rope(tiny_files, tmp_path):
    cfg = read_model_config(tiny_files["tiny-qwen2.F16"])
    assert cfg.arch == "qwen2" and cfg.attention_bias and cfg.tie_word_embeddings
    assert math.isclose(cfg.rms_norm_eps, 1e-6, rel_tol=1e-6) and cfg.rope_theta == 1e6
    t = _tensors(tiny_files["tiny-qwen2.F16"])
    assert "output.weight" not in t
    assert t["blk.0.attn_q.bias"].shape == (256,) and t["blk.0.attn_k.bias"].shape == (128,)
    assert t["blk.0.attn_v.bias"].qtype.name == "F32"
    # Llama 3's RoPE scaling as llama.cpp's converter writes it: a rope_freqs tensor of per-frequency divisors
    shape = dataclasses.replace(SHAPES["tiny"], name="tiny-rope", llama3_rope=(32.0, 1.0, 4.0, 8192),
                                rope_theta=500000.0)
    path = str(tmp_path / "rope.gguf")
    write_random_gguf(shape, path, fmt="F16")
    scaling = read_model_config(path).rope_scaling
    assert scaling["type"] == "freq_factors" and len(scaling["factors"]) == 32
    assert scaling["factors"][0] == 1.0 and scaling["factors"][-1] == 32.0
    assert model_zoo.llama3_rope_factors(64, 500000.0, 32.0, 1.0, 4.0, 8192).tolist() == \
        pytest.approx(list(scaling["factors"]))


def test_shapes_are_the_real_models():
    b1, b3, qw = SHAPES["llama3.2-1b"], SHAPES["llama3.2-3b"], SHAPES["qwen2.5-1.5b"]
    assert 1.0e9 < b1.param_count(49152) < 1.3e9 and 2.9e9 < b3.param_count(49152) < 3.3e9
    assert qw.qkv_bias and qw.arch == "qwen2" and 1.3e9 < qw.param_count(49152) < 1.6e9
    for s in SHAPES.values():  # K-quants need every matmul input dimension to be a multiple of 256
        assert s.hidden % 256 == 0 and s.intermediate % 256 == 0 and (s.heads * s.head_dim) % 256 == 0
    assert "tiny" not in model_zoo.shape_names() and model_zoo.PADDED in model_zoo.shape_names()


def test_tiny_f16_loads_in_our_engine(tiny_files):
    import torch

    from parrot.engine.models import load_model

    for key in ("tiny.F16", "tiny-qwen2.F16"):
        model = load_model(tiny_files[key], dtype=torch.float32, weight_quant="none")
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor([1, 2, 3]), torch.arange(3),
                                                model_zoo._causal_attention))
        assert logits.shape == (3, 49152) and torch.isfinite(logits).all()


@pytest.mark.model
def test_padding_preserves_our_logits(default_model_path, tmp_path):
    """The real SmolLM2 (its first layers, to stay fast) and its zero-padded twin: same fp32 logits."""
    src = read_model_config(default_model_path)
    layers = 6
    same = str(tmp_path / "same.gguf")  # the identity padding: the original's first layers as F32
    padded = str(tmp_path / "padded.gguf")
    write_padded_gguf(default_model_path, same, Padding(src.hidden_size, src.num_heads, src.num_kv_heads),
                      num_layers=layers)
    info = write_padded_gguf(default_model_path, padded, num_layers=layers)
    cfg = read_model_config(padded)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.num_layers) == (768, 12, 4, 64, 1536, layers)
    assert math.isclose(cfg.rms_norm_eps, 0.75 * src.rms_norm_eps, rel_tol=1e-6)
    assert cfg.rope_theta == src.rope_theta and cfg.tie_word_embeddings
    assert info["norm_scale"] == pytest.approx(math.sqrt(0.75))
    gf = GGUFFile(padded)
    t = {x.name: gf.raw(x).view(np.float32).reshape(x.shape) for x in gf.tensors}
    assert not t["blk.0.attn_q.weight"][576:].any() and not t["blk.0.attn_q.weight"][:, 576:].any()
    assert not t["blk.0.attn_k.weight"][192:].any() and not t["blk.0.attn_output.weight"][:, 576:].any()
    assert not t["blk.0.ffn_down.weight"][576:].any() and not t["token_embd.weight"][:, 576:].any()
    assert not t["output_norm.weight"][576:].any()
    ref = GGUFFile(same)
    ref_norm = next(ref.raw(x).view(np.float32).reshape(-1) for x in ref.tensors if x.name == "blk.2.ffn_norm.weight")
    np.testing.assert_allclose(t["blk.2.ffn_norm.weight"][:576], ref_norm * np.float32(math.sqrt(0.75)), rtol=1e-6)

    from parrot.engine.files.tokenizer import load_tokenizer

    tok = load_tokenizer(padded)
    prompts = [tok.encode(p) for p in model_zoo.CHECK_PROMPTS[:2]]
    for a, b in zip(model_zoo.engine_logits(same, prompts), model_zoo.engine_logits(padded, prompts)):
        assert (a.argmax(-1) == b.argmax(-1)).all()
        assert float(np.abs(a - b).max()) < 1e-3 * max(1.0, float(np.abs(a).max()))


def test_padding_rejects_a_changed_gqa_ratio(default_model_path, tmp_path):
    with pytest.raises(ValueError, match="GQA ratio"):
        write_padded_gguf(default_model_path, str(tmp_path / "x.gguf"), Padding(768, 12, 6), num_layers=1)


def test_build_caches_and_validates(tmp_path, default_model_path):
    with pytest.raises(ValueError, match="unknown shape"):
        model_zoo.build("nope", "F16", str(tmp_path))
    with pytest.raises(ValueError, match="unknown format"):
        model_zoo.build("tiny", "Q9_9", str(tmp_path))
    lines: list[str] = []
    path = model_zoo.build("tiny-qwen2", "F16", str(tmp_path), log=lines.append)
    assert path == model_zoo.model_path(str(tmp_path), "tiny-qwen2", "F16") and len(lines) == 1
    assert model_zoo.build("tiny-qwen2", "F16", str(tmp_path), log=lines.append) == path and len(lines) == 1
    assert model_zoo.describe(path)["tensor_types"] == {"F16": 15, "F32": 11}


def test_quantized_by_llama_cpp(tmp_path, default_model_path):
    pytest.importorskip("llama_cpp")
    out = str(tmp_path)
    q = model_zoo.build("tiny", "Q4_K_M", out, threads=1, log=lambda _: None)
    types = model_zoo.tensor_type_counts(q)
    assert types.get("Q4_K", 0) > 0 and "F16" not in types
    assert model_zoo.describe(q)["file_type"] == "Q4_K_M"
    cfg = read_model_config(q)
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (256, 2, 49152)
    q4 = model_zoo.build("tiny", "Q4_0", out, threads=1, log=lambda _: None)
    assert model_zoo.tensor_type_counts(q4).get("Q4_0", 0) > 0
