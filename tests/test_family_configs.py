"""config.json files as the real checkpoints ship them (older key spellings included) -> the family's ModelConfig
(torch-free: only config.py and the family table run)."""

from __future__ import annotations

import math

import pytest

from parrot.engine.files.config import config_from_hf

QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
              "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
              "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
              "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
             "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
             "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
             "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
             "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
             "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}
MISTRAL_7B_V01 = {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
                  "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
                  "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
                  "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
                  "tie_word_embeddings": False, "vocab_size": 32000}
GEMMA2_2B = {"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0, "bos_token_id": 2,
             "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
             "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
             "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2",
             "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0,
             "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
             "vocab_size": 256000}
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None, "bos_token_id": 2,
             "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
             "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
             "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
             "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
             "sliding_window_pattern": 6, "vocab_size": 262144}
PHI3_MINI_128K = {"architectures": ["Phi3ForCausalLM"], "bos_token_id": 1, "eos_token_id": 32000, "hidden_act": "silu",
                  "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 131072,
                  "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
                  "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
                  "rope_scaling": {"long_factor": [1.0 + i for i in range(48)], "short_factor": [1.0] * 48,
                                   "type": "longrope"},
                  "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": False, "vocab_size": 32064}


def test_qwen2_5() -> None:
    cfg = config_from_hf(QWEN25_05B)
    assert (cfg.arch, cfg.attention_bias, cfg.tie_word_embeddings, cfg.head_dim) == ("qwen2", True, True, 64)
    assert cfg.sliding_window is None and cfg.layer_types is None  # use_sliding_window is false
    windowed = config_from_hf({**QWEN25_05B, "use_sliding_window": True, "sliding_window": 4096})
    assert windowed.layer_types == ("full",) * 21 + ("sliding",) * 3 and windowed.sliding_window == 4096


def test_qwen3() -> None:
    cfg = config_from_hf(QWEN3_06B)
    assert (cfg.arch, cfg.qk_norm, cfg.attention_bias, cfg.head_dim, cfg.q_size) == ("qwen3", True, False, 128, 2048)
    assert cfg.is_plain_llama() is False and cfg.attention_scale == 128 ** -0.5


def test_mistral() -> None:
    cfg = config_from_hf(MISTRAL_7B_V01)
    assert cfg.arch == "mistral" and cfg.sliding_window == 4096 and cfg.layer_types == ("sliding",) * 32
    v03 = config_from_hf({**MISTRAL_7B_V01, "sliding_window": None, "vocab_size": 32768})
    assert v03.sliding_window is None and v03.is_plain_llama()


def test_gemma2() -> None:
    cfg = config_from_hf(GEMMA2_2B)
    assert cfg.arch == "gemma2" and cfg.tie_word_embeddings and cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh"
    assert cfg.layer_types[:4] == ("sliding", "full", "sliding", "full") and cfg.sliding_window == 4096
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)
    assert cfg.embedding_scale == pytest.approx(math.sqrt(2304)) and cfg.attention_scale == 256 ** -0.5
    assert cfg.eos_token_ids == (1, 107) and cfg.bos_token_id == 2


def test_gemma3_text() -> None:
    cfg = config_from_hf(GEMMA3_1B)
    assert cfg.arch == "gemma3" and cfg.qk_norm and cfg.attn_logit_softcap is None
    assert cfg.layer_types[:6] == ("sliding",) * 5 + ("full",) and cfg.layer_types.count("full") == 4
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.sliding_window) == (1e6, 1e4, 512)
    assert cfg.eos_token_ids == (1, 106)
    with pytest.raises(ValueError, match="'gemma3'"):  # the multimodal wrapper config is not a text model
        config_from_hf({"model_type": "gemma3", "text_config": GEMMA3_1B})


def test_phi3_longrope() -> None:
    cfg = config_from_hf(PHI3_MINI_128K)
    assert cfg.arch == "phi3" and cfg.head_dim == 96 and cfg.layer_types == ("sliding",) * 32
    rope = cfg.rope_scaling
    assert rope["type"] == "longrope" and rope["original_max_position_embeddings"] == 4096
    assert rope["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert len(rope["long_factor"]) == 48
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        config_from_hf({**PHI3_MINI_128K, "partial_rotary_factor": 0.75})


@pytest.mark.parametrize("bad,match", [
    ({**QWEN25_05B, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({**GEMMA2_2B, "hidden_activation": "relu", "hidden_act": "relu"}, "relu"),
    ({**MISTRAL_7B_V01, "model_type": "mamba"}, "'mamba'"),
])
def test_unsupported_configs_name_the_problem(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        config_from_hf(bad)
