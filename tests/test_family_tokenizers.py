"""Tokenizers of every family from GGUF metadata and from an HF dir (tokenizer.json + tokenizer_config.json), against
HF tokenizers / sentencepiece on a multilingual text set. No tokenizer files are downloaded: tiny ones are trained
here -- a byte-level BPE with Qwen2's pre-tokenizer (Qwen2/3) and SentencePiece BPE models with byte fallback
(Mistral / Phi-3 with a space prefix, Gemma without) -- and written both ways, as the real files are."""

from __future__ import annotations

import json

import pytest

from parrot.engine.files.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TEXTS = [
    "Hello, world! How are you today?",
    "Bonjour à tous, ça va très bien. L'été est là.",
    "Größe und Übermaß: Straße 12345, 3.14159.",
    "Привет, как дела? Всё хорошо.",
    "こんにちは世界、東京タワーへ行きます。",
    "你好，世界！我们在北京吃饭。",
    "مرحبا بالعالم، كيف حالك؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "안녕하세요 세계, 반갑습니다.",
    "Emoji 🦜🚀 and  double  spaces\nnew line\ttab\n\nend",
    "code: def f(x):\n    return x ** 2  # 1234567890",
    "  leading spaces and trailing  ",
    "combining e\u0301 vs é, ﬁ ligature, Ｆｕｌｌ width",
]
CORPUS = TEXTS * 3 + [t.lower() for t in TEXTS] + [" ".join(TEXTS)]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Sé breve."}, {"role": "user", "content": "东京の天気は？"}]


# ---- byte-level BPE (Qwen2 / Qwen3) --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory):
    """(HF tokenizer, HF dir, GGUF path) of a tiny Qwen2-style tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from parrot.engine.files.tokenizer import _QWEN2_SPLIT

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), "isolated"),
                                                     pre_tokenizers.ByteLevel(False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(backend.to_str())["model"]
    vocab, merges = spec["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    hf = transformers.Qwen2Tokenizer(vocab=dict(vocab), merges=merges, eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>")
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.chat_template = CHATML
    root = tmp_path_factory.mktemp("qwen-tok")
    hf.save_pretrained(str(root / "hf"))
    (root / "hf" / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")]}))
    # the GGUF as llama.cpp writes a Qwen2 vocabulary: every id's token, added ones marked CONTROL
    full = hf.get_vocab()
    tokens = [t for t, _ in sorted(full.items(), key=lambda kv: kv[1])]
    assert [full[t] for t in tokens] == list(range(len(tokens)))
    special = set(hf.all_special_tokens)
    writer = gguf.GGUFWriter(str(root / "tok.gguf"), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) for m in merges])
    writer.add_eos_token_id(full["<|im_end|>"])
    writer.add_chat_template(CHATML)
    writer.add_add_bos_token(False)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    return hf, str(root / "hf"), str(root / "tok.gguf")


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_qwen_byte_level_bpe_matches_hf(qwen_files, source) -> None:
    hf, hf_dir, gguf_path = qwen_files
    ours = load_tokenizer(hf_dir if source == "hf" else gguf_path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == hf.decode(ids) == text or ours.decode(ids) == hf.decode(ids)
        stream = ours.incremental_decoder()
        assert "".join(stream.push(i) for i in ids) + stream.flush() == ours.decode(ids)
    rendered = ours.apply_chat_template(MESSAGES)
    assert rendered == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.encode(rendered) == hf.encode(rendered, add_special_tokens=False)
    im_end, eot = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")
    assert ours.encode("<|im_end|>") == [im_end] and ours.is_special(im_end)
    # generation_config.json adds <|endoftext|> in the HF dir; the GGUF names <|im_end|> only
    assert set(ours.eos_token_ids) == ({im_end, eot} if source == "hf" else {im_end})
    assert ours.eos_token_ids[0] == im_end and ours.bos_token_id is None and not ours.add_bos


# ---- SentencePiece BPE (Mistral, Phi-3, Gemma) ----------------------------------------------------------------------
SPM_FAMILIES = {
    # (GGUF arch, space prefix, extra pieces, stop token)
    "mistral": ("llama", True, ["[INST]", "[/INST]"], None),
    "phi3": ("phi3", True, ["<|user|>", "<|assistant|>", "<|end|>"], "<|end|>"),
    "gemma": ("gemma2", False, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
}


@pytest.fixture(scope="module", params=list(SPM_FAMILIES))
def spm_files(request, tmp_path_factory):
    """(family, sentencepiece processor, GGUF path) of a tiny SentencePiece BPE model with byte fallback."""
    spm = pytest.importorskip("sentencepiece")
    name = request.param
    arch, prefix, extra, stop = SPM_FAMILIES[name]
    root = tmp_path_factory.mktemp(f"spm-{name}")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(root / "tok"), vocab_size=500, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True, add_dummy_prefix=prefix,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        user_defined_symbols=extra, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(root / "tok.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):  # llama.cpp's _create_vocab_sentencepiece
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                     else 5 if sp.is_unused(i) else 4 if sp.id_to_piece(i) in extra else 1)
    writer = gguf.GGUFWriter(str(root / "tok.gguf"), arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    if not prefix:
        writer.add_add_space_prefix(False)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    return name, sp, str(root / "tok.gguf")


def test_sentencepiece_gguf_matches_sentencepiece(spm_files) -> None:
    name, sp, path = spm_files
    ours = load_tokenizer(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == sp.encode(text), (name, text, ours.backend.encode(text, add_special_tokens=False).tokens,
                                        [sp.id_to_piece(i) for i in sp.encode(text)])
        assert ours.decode(ids) == sp.decode(ids), (name, text)
        assert b"".join(ours.token_to_bytes(i) for i in ids).decode("utf-8", "replace").lstrip(" ") \
            == sp.decode(ids).lstrip(" ")
        stream = ours.incremental_decoder()
        assert "".join(stream.push(i) for i in ids) + stream.flush() == ours.decode(ids)
    assert ours.bos_token_id == 1 and ours.add_bos and 2 in ours.eos_token_ids
    _, _, extra, stop = SPM_FAMILIES[name]
    for piece in extra:  # chat-template markers encode whole, inside text too
        assert ours.encode(f"a{piece}b")[1:-1] == [sp.piece_to_id(piece)] or \
            sp.piece_to_id(piece) in ours.encode(f"a{piece}b")
    if stop is not None:
        assert sp.piece_to_id(stop) in ours.eos_token_ids


def test_sentencepiece_hf_dir_matches_hf(spm_files, tmp_path) -> None:
    """The same vocabulary as an HF dir (transformers' LlamaTokenizer / GemmaTokenizer, saved as tokenizer.json +
    tokenizer_config.json with a chat template, and generation_config.json naming the end-of-turn stop): our
    tokenizer equals HF's, BOS / stop ids and the rendered template included."""
    from transformers.tokenization_utils_base import generate_merges

    name, sp, _ = spm_files
    _, prefix, extra, stop = SPM_FAMILIES[name]
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())}
    cls = transformers.GemmaTokenizer if name == "gemma" else transformers.LlamaTokenizer
    hf = cls(vocab=vocab, merges=generate_merges(vocab, scores), bos_token="<s>", eos_token="</s>",
             unk_token="<unk>", add_bos_token=True)
    hf.add_tokens([p for p in extra], special_tokens=True)
    hf.chat_template = ("{{ bos_token }}{% for m in messages %}" + (extra[0] if extra else "")
                        + "{{ m['content'] }}" + (stop or "") + "{% endfor %}")
    hf.save_pretrained(str(tmp_path))
    if stop is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, vocab[stop]]}))
    ours = load_tokenizer(str(tmp_path))
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), (name, text)
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text, add_special_tokens=False))
    assert ours.bos_token_id == 1 and ours.add_bos
    assert ours.eos_token_ids[0] == 2 and (stop is None or vocab[stop] in ours.eos_token_ids)
    rendered = ours.apply_chat_template(MESSAGES)
    assert rendered == hf.apply_chat_template(MESSAGES, tokenize=False)
    assert ours.encode(rendered) == hf.encode(rendered, add_special_tokens=False)


def test_engine_serves_a_qwen_dir_end_to_end(qwen_files, tmp_path) -> None:
    """A complete HF dir (Qwen2 weights + this tokenizer) through the builder, as ``parrot serve --model DIR``:
    the chat template renders, the prompt encodes, and greedy generation equals transformers'."""
    import shutil

    from family_models import hf_greedy, hf_model, save_hf_dir
    from parrot.common.sampling import SamplingParams
    from parrot.engine.loader.builder import build_engine
    from parrot.engine.settings import EngineSettings

    hf_tok, hf_dir, _ = qwen_files
    ref = hf_model("qwen2", seed=3, vocab_size=len(hf_tok), eos_token_id=hf_tok.convert_tokens_to_ids("<|im_end|>"))
    save_hf_dir(ref, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(f"{hf_dir}/{f}", tmp_path / f)
    eng = build_engine(EngineSettings(model=str(tmp_path), cpu_path="portable", kv_cache_tokens=1024))
    try:
        ids = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(MESSAGES))
        assert ids == hf_tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                                 return_dict=False)
        eng.fill(ids, "chat")
        got = eng.generate(SamplingParams(max_tokens=8, ignore_eos=True), "chat").result(timeout=60)
    finally:
        eng.shutdown()
    assert list(got.token_ids) == hf_greedy(ref, ids, 8)
