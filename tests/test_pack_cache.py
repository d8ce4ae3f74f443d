"""The packed-weight cache (parrot/engine/loader/pack_cache.py): a second load of a GGUF reads its packed weights
from the mapped cache file, packs nothing and computes the same; a stale or corrupt file never changes a result."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from family_models import our_logits

from parrot.engine.files.config import read_model_config
from parrot.engine.layers.quant import QuantEmbedding, QuantWeight
from parrot.engine.loader import iter_weights
from parrot.engine.loader.pack_cache import PackCache, cache_key, for_model
from parrot.engine.models.assembly import assemble_model, load_model

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def ops(native_kernel):
    return torch.ops.parrot_kernels


def test_second_load_maps_the_cache_and_computes_the_same(ops, default_model_path, tmp_path) -> None:
    first = load_model(default_model_path, dtype=torch.float32, weight_quant="auto", pack_cache_dir=str(tmp_path))
    files = list(tmp_path.glob("*.qpk"))
    assert len(files) == 1
    cfg = read_model_config(default_model_path)
    cache = PackCache(files[0])
    second = assemble_model(cfg, iter_weights(default_model_path, cfg, keep_codes=True), dtype=torch.float32,
                            weight_quant="auto", cache=cache)
    quantized = [lin for lin in second.linears() if isinstance(lin.path, QuantWeight)]
    assert quantized and cache.hits == len(quantized)  # every matmul from the file, none packed
    for a, b in zip(first.linears(), second.linears()):
        assert torch.equal(a.path.packed, b.path.packed)
    assert isinstance(second.embedding, QuantEmbedding)  # the tied head's codes
    ids = [1, 504, 3060, 28, 1070, 9, 2]
    assert torch.equal(our_logits(first, ids), our_logits(second, ids))


def test_untied_quantized_table_is_cached_too(ops, tmp_path) -> None:
    """A model whose token table is its own quantized tensor: the table's packed form is an entry as well."""
    from parrot.engine.files.config import ModelConfig
    from parrot.engine.layers.linear import MatmulKernels
    from parrot.engine.layers.quant import QTensor, quantize_float
    from parrot.engine.models.assembly import random_weights

    cfg = ModelConfig(name="t", arch="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
    weights = {n: (quantize_float(w, "q8_0") if w.dim() == 2 else w) for n, w in random_weights(cfg).items()}
    assert all(isinstance(w, QTensor) for n, w in weights.items() if n.endswith("proj.weight"))
    path = tmp_path / "c.qpk"
    kernels = MatmulKernels.available("cpu", torch.float32)
    m1 = assemble_model(cfg, weights.items(), dtype=torch.float32, weight_quant="auto", kernels=kernels,
                        cache=(c1 := PackCache(path)))
    c1.save()
    m2 = assemble_model(cfg, weights.items(), dtype=torch.float32, weight_quant="auto", kernels=kernels,
                        cache=(c2 := PackCache(path)))
    assert isinstance(m2.embedding, QuantEmbedding) and c2.hits == 4 + 1 + 1  # 4 matmuls, the head, the table
    assert torch.equal(m1.embedding.dense(), m2.embedding.dense())


def test_stale_and_corrupt_files_are_repacked(ops, default_model_path, tmp_path, caplog) -> None:
    key = cache_key(default_model_path, "lib-a", "rule")
    assert key != cache_key(default_model_path, "lib-b", "rule") != cache_key(default_model_path, "lib-a", "r2")
    path = tmp_path / f"{key}.qpk"
    path.write_bytes(b"PQPK0001" + b"\xff" * 64)  # a header that does not parse
    with caplog.at_level(logging.WARNING):
        cache = PackCache(path)
    assert "corrupt" in caplog.text and cache.get("anything") is None
    path.write_bytes(b"")
    assert PackCache(path).get("anything") is None
    cache = for_model(tmp_path, default_model_path, "lib-a", "rule")
    assert cache.path == path
    cache.put("w", torch.arange(100, dtype=torch.uint8))
    cache.put("v", torch.arange(7, dtype=torch.uint8))
    cache.save()
    again = PackCache(path)
    assert torch.equal(again.get("w"), torch.arange(100, dtype=torch.uint8))
    assert torch.equal(again.get("v"), torch.arange(7, dtype=torch.uint8)) and again.hits == 2
    assert os.path.getsize(path) % 64 == 0
    # a newer kernel build's file of the same GGUF and rule replaces it; another rule's stays
    other_rule = for_model(tmp_path, default_model_path, "lib-a", "r2")
    other_rule.put("w", torch.zeros(3, dtype=torch.uint8))
    other_rule.save()
    newer = for_model(tmp_path, default_model_path, "lib-b", "rule")
    newer.put("w", torch.ones(3, dtype=torch.uint8))
    newer.save()
    assert sorted(p.name for p in tmp_path.glob("*.qpk")) == sorted([other_rule.path.name, newer.path.name])
