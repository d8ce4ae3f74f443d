"""The paper's apps on every model family (issue 21): for each family, a complete HF model directory (the family's
tiny random weights + a byte-level BPE tokenizer with a ChatML template) served as ``parrot serve --model DIR``
would serve it (P.local: engine, manager and HTTP API in-process), running the Fig. 7 two-step app (the second
call consumes the first's output server-side, with prefix sharing), a structured-output step and an OpenAI chat
completion. Random weights say nothing useful; what is checked is that the whole stack runs each architecture
and that a family's outputs equal transformers' greedy tokens for the same prompt."""

from __future__ import annotations

import shutil

import httpx
import pytest

import parrot as P
from family_models import FAMILIES, hf_greedy, hf_model, save_hf_dir
from test_family_tokenizers import qwen_files  # noqa: F401  (fixture: a tiny tokenizer as an HF dir)


@P.semantic_function(max_tokens=6, min_tokens=6, ignore_eos=True, stop=[])
def write_code(task: P.SemanticVariable):
    """Write python code of {{input:task}}.
    Code: {{output:code}}"""


@P.semantic_function(max_tokens=6, min_tokens=6, ignore_eos=True, stop=[])
def write_test(task: P.SemanticVariable, code: P.SemanticVariable):
    """Write a test of {{input:task}} for this code: {{input:code}}.
    Test: {{output:test}}"""


@P.semantic_function(max_tokens=4, choice=["yes", "no"])
def verdict(code: P.SemanticVariable):
    """Is this code correct? {{input:code}} Answer: {{output:ok}}"""


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_papers_app_runs_on_each_family(family, qwen_files, tmp_path):  # noqa: F811
    hf_tok, hf_dir, _ = qwen_files
    ref = hf_model(family, seed=5, vocab_size=len(hf_tok), eos_token_id=hf_tok.convert_tokens_to_ids("<|im_end|>"),
                   max_position_embeddings=512)
    save_hf_dir(ref, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(f"{hf_dir}/{f}", tmp_path / f)
    # exact numerics (fp32 weights, activations and KV): greedy ties with random weights must not flip
    with P.local(str(tmp_path), kv_cache_tokens=4096, make_default=False, dtype="float32", weight_quant="none",
                 kv_dtype="float32") as s:
        code = write_code("a snake game", session=s)
        test = write_test("a snake game", code, session=s)
        ok = verdict(code, session=s)
        assert code.get() and test.get() and ok.get() in ("yes", "no")
        dag = httpx.get(f"{s.url}/api/v1/sessions/{s.session_id}/dag",
                        headers={"X-Parrot-Session-Token": s._token}).json()
        assert [r["status"] for r in dag["requests"]] == ["finished"] * 3, dag["text"]
        # the OpenAI side on the same engine: greedy tokens equal transformers' for the rendered chat prompt
        msgs = [{"role": "user", "content": "Hello there"}]
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60, json={
            "model": s_model(s), "messages": msgs, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": True})
        assert r.status_code == 200, r.text
        got = [bytes(t["bytes"]) for t in r.json()["choices"][0]["logprobs"]["content"]]
    ids = hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    want = [_token_bytes(hf_tok, t) for t in hf_tok.convert_ids_to_tokens(hf_greedy(ref, ids, 5))]
    assert want == got


def s_model(session) -> str:
    return httpx.get(f"{session.url}/v1/models").json()["data"][0]["id"]


def _token_bytes(hf_tok, token: str) -> bytes:
    """The bytes an HF byte-level BPE token stands for (an added token: its text)."""
    from parrot.engine.files.tokenizer import bytes_to_unicode

    if token in hf_tok.get_added_vocab():
        return token.encode()
    inverse = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(inverse[c] for c in token)
