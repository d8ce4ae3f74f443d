"""Tokenizer from the GGUF metadata: round trips, parity with transformers, chat template, streaming decode."""

from __future__ import annotations

import json

import pytest

from parrot.common.errors import TemplateError
from parrot.engine.files.tokenizer import IncrementalDecoder, Tokenizer, load_tokenizer

pytestmark = pytest.mark.model

TEXTS = [
    "Hello world!",
    "  leading spaces, trailing  \n\n\ttabs\tand\r\nCRLF ",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 🐍\n",
    "Numbers: 2024, 3.14159, 1234567890 and -42",
    "こんにちは世界 — 你好，世界 — Здравствуй, мир — مرحبا بالعالم",
    "emoji 🦜🦜 👩‍👩‍👧 flags 🇫🇷 and combining é vs é",
    "don't I'll we've THEY'RE",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


@pytest.fixture(scope="module")
def tok(default_model_path: str) -> Tokenizer:
    return load_tokenizer(default_model_path)


def test_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.add_bos is False  # tokenizer.ggml.add_bos_token = false in the SmolLM2 file
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_encode_as_single_ids(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    ids = tok.encode("<|im_start|>assistant\nok<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nok"
    assert tok.is_special(2) and not tok.is_special(ids[1])


def test_parity_with_transformers_gguf_tokenizer(tok: Tokenizer, default_model_path: str) -> None:
    import os

    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_model_path),
                                                     gguf_file=os.path.basename(default_model_path))
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)


def test_chat_template_renders_chatml(tok: Tokenizer) -> None:
    out = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                   "<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    with_system = tok.apply_chat_template(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
        add_generation_prompt=False)
    assert with_system == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                           "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n")
    ids = tok.encode(out)
    assert ids.count(1) == 3 and ids.count(2) == 2  # the markers are single special tokens


def test_chat_template_errors_are_typed(tok: Tokenizer) -> None:
    with pytest.raises(TemplateError):
        tok.apply_chat_template("not a list")  # type: ignore[arg-type]
    with pytest.raises(TemplateError, match="content"):
        tok.apply_chat_template([{"role": "user"}])  # template adds a missing (undefined) content to a str
    strict = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=(2,), add_bos=False, byte_level=True,
                       chat_template="{% if messages|length > 1 %}{{ raise_exception('one message only') }}"
                                     "{% endif %}{{ messages[0]['content'] }}")
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    with pytest.raises(TemplateError, match="one message only"):
        strict.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    none = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=(2,), add_bos=False, byte_level=True,
                     chat_template=None)
    with pytest.raises(TemplateError, match="no chat template"):
        none.apply_chat_template([{"role": "user", "content": "x"}])


def _stream(decoder: IncrementalDecoder, ids: list[int]) -> list[str]:
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", ["🦜 parrots 🦜🦜 say 你好世界 and こんにちは!", "plain ascii", "é👩‍👩‍👧\n<|im_end|>"])
def test_incremental_decoder_equals_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces = _stream(tok.incremental_decoder(), ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    # the window strategy (used for non-byte-level vocabularies) gives the same text
    window = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=(2,), add_bos=False, byte_level=False,
                       chat_template=None)
    assert "".join(_stream(window.incremental_decoder(), ids)) == text


def test_incremental_decoder_holds_back_partial_codepoints(tok: Tokenizer) -> None:
    ids = tok.encode("🦜")
    assert len(ids) > 1  # the emoji's 4 bytes span several byte-level tokens
    pieces = _stream(tok.incremental_decoder(), ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and pieces[-2] == "🦜"


def test_hf_dir_tokenizer(tok: Tokenizer, tmp_path) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": tok.chat_template,
         "add_bos_token": True}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = load_tokenizer(str(tmp_path))
    assert hf.bos_token_id == 1 and hf.eos_token_ids == (2, 0) and hf.add_bos is True
    assert hf.token_bytes is not None  # ByteLevel decoder detected -> exact byte streaming
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)
    messages = [{"role": "user", "content": "hey"}]
    assert hf.apply_chat_template(messages) == tok.apply_chat_template(messages)
