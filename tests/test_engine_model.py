"""The builtin engine on the real default model (SmolLM2-135M-Instruct Q4_1 GGUF).

fp32 (the portable path: torch's fp32 kernels, fp32 KV): greedy generations through the paged-KV engine equal HF
transformers' greedy generate on the same GGUF, token for token. Default numerics (the plan this CPU gets: bf16 on
AVX512-BF16 / AMX, int8x2 integer dot products with an fp16 KV cache on AVX2): answers stay sane and mostly agree
with fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

from parrot.common.sampling import SamplingParams
from parrot.engine.loader.builder import build_engine
from parrot.engine.settings import EngineSettings

pytestmark = pytest.mark.model

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers."}],
]
N_NEW = 16


@pytest.fixture(scope="module")
def model_path():
    from parrot.common.errors import ModelNotFound
    from parrot.engine.files.model_files import default_model_path

    try:
        return default_model_path()
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def fp32_engine(model_path):
    eng = build_engine(EngineSettings(model=model_path, cpu_path="portable", kv_cache_tokens=8192))
    yield eng
    eng.shutdown()


def _prompt_ids(eng, messages):
    return eng.tokenizer.encode(eng.tokenizer.apply_chat_template(messages))


def _generate_all(eng, prefix: str, max_tokens=N_NEW):
    """All prompts at once (batched decode), greedy."""
    futs = []
    for i, msgs in enumerate(PROMPTS):
        eng.fill(_prompt_ids(eng, msgs), f"{prefix}{i}")
        futs.append(eng.generate(SamplingParams(max_tokens=max_tokens), f"{prefix}{i}"))
    return [f.result(timeout=120) for f in futs]


def test_fp32_greedy_matches_hf_transformers(fp32_engine, model_path):
    transformers = pytest.importorskip("transformers")
    ours = _generate_all(fp32_engine, "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), torch_dtype=torch.float32)
    hf.eval()
    for msgs, res in zip(PROMPTS, ours):
        ids = torch.tensor([_prompt_ids(fp32_engine, msgs)])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False,
                              eos_token_id=list(fp32_engine.eos_token_ids), pad_token_id=0)
        ref = out[0, ids.shape[1]:].tolist()
        assert list(res.token_ids) == ref, (msgs, res.text, fp32_engine.tokenizer.decode(ref))


def test_default_dtype_is_sane(model_path, fp32_engine):
    eng = build_engine(EngineSettings(model=model_path, kv_cache_tokens=8192))  # this CPU's default plan
    try:
        res = _generate_all(eng, "d", max_tokens=24)
    finally:
        eng.shutdown()
    assert "Paris" in res[0].text
    ref = _generate_all(fp32_engine, "ref", max_tokens=24)
    # tokens agree with fp32 up to the first divergence; require a substantial common prefix on average
    agree = []
    for a, b in zip(res, ref):
        n = 0
        for x, y in zip(a.token_ids, b.token_ids):
            if x != y:
                break
            n += 1
        agree.append(n / max(1, min(len(a.token_ids), len(b.token_ids))))
    assert sum(agree) / len(agree) >= 0.5, agree
