"""Tokenizer (``tokenizers`` library) from GGUF metadata or an HF dir's tokenizer.json, plus chat templates and
streaming detokenization. No transformers at runtime: chat templates render with
:mod:`parrot.common.chat_template` (transformers' semantics), the renderer the manager serves with.

GGUF ``tokenizer.ggml.model``, per family:

    "gpt2"  (LLaMA-3, SmolLM, Qwen2/3)  byte-level BPE from ``tokens`` + ``merges``; the pre-tokenizer (split regex,
                                        Qwen's NFC) follows ``tokenizer.ggml.pre`` (llama.cpp's names)
    "llama" (Mistral, Gemma, Phi-3,     SentencePiece BPE with byte fallback: the merges are recovered from the
             LLaMA-2)                   vocabulary (a pair merges into a token, ranked by the token's score; Gemma's
                                        scores do not rank its merges, its file order does), "▁" for spaces
                                        and, unless ``add_space_prefix`` is false (Gemma), one before the text

Tokens of type CONTROL (3) become special added tokens and USER_DEFINED (4) plain added tokens, so e.g.
``<|im_start|>`` in a rendered chat template encodes as one id. Stop tokens: the EOS / EOT / EOM ids the file
names plus, as llama.cpp does, the end-of-turn tokens it recognizes by text (``<|im_end|>``, ``<end_of_turn>``,
``<|end|>``, ``<|eot_id|>`` ...; not the end-of-document ones). An HF dir's tokenizer.json (any model type) is
taken as is, with BOS / EOS / chat template from tokenizer_config.json (or chat_template.jinja) and the stop ids
of config.json / generation_config.json.

Byte-level streaming: every token id maps to a fixed byte string (the inverse of GPT-2's byte->unicode
alphabet; added tokens map to their UTF-8 content), so decoding a stream is "append bytes, emit what forms
complete UTF-8 codepoints" -- exact, O(1) per token, and equal to ``decode`` of the whole sequence.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
from collections.abc import Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from parrot.common.chat_template import ChatTemplates
from parrot.common.errors import TemplateError
from parrot.engine.files.config import is_gguf_file
from parrot.engine.files.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PRES = ("qwen2", "deepseek-r1-qwen")
# end-of-turn tokens llama.cpp treats as end of generation when the vocabulary has them (llama-vocab.cpp); the
# end-of-document ones (<|endoftext|>, <|end_of_text|>) stop only when the file names them
_STOP_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|eom_id|>", "<EOT>", "<|return|>",
               "<|call|>")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")
_GPT2_PRES = (None, "default", "gpt2", "gpt-2")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char alphabet used by byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, (chr(c) for c in chars)))


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":  # llama.cpp: "\p{N}" then the GPT-2 regex == HF's Digits(individual) + ByteLevel
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _LLAMA3_PRES or pre in _QWEN2_PRES:
        split = _QWEN2_SPLIT if pre in _QWEN2_PRES else _LLAMA3_SPLIT
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in _GPT2_PRES:
        logger.warning("GGUF pre-tokenizer %r is not known here; splitting with the GPT-2 regex", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


class Tokenizer:
    """Encode/decode, chat template, streaming decoder. Build with :func:`load_tokenizer`."""

    def __init__(self, backend: BackendTokenizer, *, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 chat_template: str | None, add_bos: bool, byte_level: bool) -> None:
        self.backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.bos_token = None if bos_token_id is None else backend.id_to_token(bos_token_id)
        self.eos_token = backend.id_to_token(eos_token_ids[0]) if eos_token_ids else None
        # byte-level vocabularies: id -> exact bytes (None: other vocabularies stream by re-decoding a window)
        self.token_bytes: list[bytes] | None = self._build_token_bytes() if byte_level else None
        self._special_ids: frozenset[int] | None = None
        self._templates = ChatTemplates(max_cached=1)
        if chat_template is not None:
            try:
                self._templates.compile(chat_template)
            except TemplateError as exc:
                raise ValueError(exc.message) from exc

    def _build_token_bytes(self) -> list[bytes]:
        inverse = {c: b for b, c in bytes_to_unicode().items()}
        added = {i: tok.content for i, tok in self.backend.get_added_tokens_decoder().items()}
        table: list[bytes] = []
        for i in range(self.vocab_size):
            if i in added:
                table.append(added[i].encode("utf-8"))
                continue
            token = self.backend.id_to_token(i) or ""
            table.append(b"".join(bytes([inverse[c]]) if c in inverse else c.encode("utf-8") for c in token))
        return table

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS added (special tokens written in the text encode as their ids)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` stands for (b"" for an id outside the vocabulary). Byte-level BPE: the
        piece's byte-alphabet characters mapped back to bytes; other vocabularies (sentencepiece style): the piece
        with U+2581 as a space and ``<0xNN>`` byte tokens as that byte; added tokens: their UTF-8 content."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        if self.token_bytes is not None:
            return self.token_bytes[token_id]
        added = self.backend.get_added_tokens_decoder().get(token_id)
        if added is not None:
            return added.content.encode("utf-8")
        piece = self.backend.id_to_token(token_id) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    def is_special(self, token_id: int) -> bool:
        if self._special_ids is None:  # built once: the backend's table is rebuilt on every call
            self._special_ids = frozenset(i for i, tok in self.backend.get_added_tokens_decoder().items()
                                          if tok.special)
        return token_id in self._special_ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: Sequence[dict] | None = None, continue_final_message: bool = False,
                            **variables: object) -> str:
        """Render ``messages`` ([{"role", "content"}, ...]) with the model's template as transformers does
        (:mod:`parrot.common.chat_template`). Raises TemplateError (a ChatTemplateError, 400) when there is no
        template or the messages do not fit it."""
        if self.chat_template is None:
            raise TemplateError("this model has no chat template; send a plain prompt instead", param="messages")
        return self._templates.render(self.chat_template, messages, tools=tools,
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message, bos_token=self.bos_token or "",
                                      eos_token=self.eos_token or "", variables=variables)

    def incremental_decoder(self, *, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Streaming detokenization of one sequence. ``push(id)`` returns the newly complete text ("" while a UTF-8
    codepoint is still incomplete); the concatenation of all pushes (+ ``flush()``) equals ``decode(ids)``.

    Byte-level vocabularies: append the token's bytes to an incremental UTF-8 decoder. Others (window mode):
    re-decode ``ids[prefix:]`` against ``ids[prefix:read]`` and emit the growth once it does not end in U+FFFD
    (the usual TGI/vLLM scheme), so a piece is emitted only when it is stable. ``skip_special_tokens``: special
    tokens add no text (vLLM's option; the concatenation then equals ``decode(ids, skip_special_tokens=True)``)."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        if self._skip and self._tok.is_special(token_id):
            return ""
        table = self._tok.token_bytes
        if table is not None:
            return self._utf8.decode(table[token_id] if 0 <= token_id < len(table) else b"")
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        full_text = self._tok.decode(self._ids[self._prefix:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """End of stream: whatever is still pending (an incomplete codepoint becomes U+FFFD)."""
        if self._tok.token_bytes is not None:
            return self._utf8.decode(b"", final=True)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        full_text = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text):]


# ---- loading ---------------------------------------------------------------------------------------------------
def load_tokenizer(path: str) -> Tokenizer:
    """From a GGUF file's tokenizer.ggml.* metadata, or an HF dir's tokenizer.json (+ tokenizer_config.json).
    Raises ValueError for an unsupported tokenizer, FileNotFoundError when there is none."""
    if is_gguf_file(path):
        return tokenizer_from_gguf(GGUFFile(path))
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return tokenizer_from_hf_dir(path)
    raise FileNotFoundError(f"no tokenizer at {path!r} (expected a GGUF file or a dir with tokenizer.json)")


def tokenizer_from_gguf(gf: GGUFFile) -> Tokenizer:
    kind = gf.get("tokenizer.ggml.model")
    if kind not in _GGUF_BACKENDS:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
                         f"'llama' (SentencePiece BPE)")
    tokens: list[str] = gf.get("tokenizer.ggml.tokens")
    types: list[int] = gf.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    backend = _GGUF_BACKENDS[kind](gf, tokens, types)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED])
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(f"GGUF tokenizer vocabulary is inconsistent ({len(tokens)} tokens, "
                         f"{backend.get_vocab_size(with_added_tokens=True)} after adding special tokens)")
    eos: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = gf.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and t in _STOP_TEXTS and i not in eos:
            eos.append(i)
    bos = gf.get("tokenizer.ggml.bos_token_id")
    add_bos = gf.get("tokenizer.ggml.add_bos_token")
    return Tokenizer(backend, bos_token_id=None if bos is None else int(bos), eos_token_ids=tuple(eos),
                     chat_template=gf.get("tokenizer.chat_template"),
                     add_bos=bool(add_bos) if add_bos is not None else kind == "llama", byte_level=kind == "gpt2")


def _byte_level_backend(gf: GGUFFile, tokens: list[str], types: list[int]) -> BackendTokenizer:
    merges: list[str] = gf.get("tokenizer.ggml.merges") or []
    pre = gf.get("tokenizer.ggml.pre")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # llama.cpp may store added tokens as raw text; the BPE vocabulary must spell them in the byte alphabet
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     ignore_merges=pre in _LLAMA3_PRES)
    backend = BackendTokenizer(bpe)
    if pre in _QWEN2_PRES:  # Qwen's tokenizer.json composes text (NFC) before splitting
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(gf: GGUFFile, tokens: list[str], types: list[int]) -> BackendTokenizer:
    """SentencePiece BPE (tokenizer.json's form of it: BPE with byte fallback over "▁"-spaced text)."""
    gemma = str(gf.get("general.architecture", "")).startswith("gemma")
    if gemma:  # Gemma files spell runs of spaces as spaces; its vocabulary (and text, after Replace) uses U+2581
        tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
    scores = gf.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    # which pair merges first: by the merged token's score, or (Gemma) its position in the file
    rank = {t: -i if gemma else scores[i] for i, t in enumerate(tokens) if types[i] in (_TOKEN_NORMAL,
                                                                                       _TOKEN_USER_DEFINED)}
    unk = int(gf.get("tokenizer.ggml.unknown_token_id", 0))
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=_merges_from_vocab(vocab, rank),
                                          unk_token=tokens[unk], fuse_unk=True, byte_fallback=True))
    prefix = gf.get("tokenizer.ggml.add_space_prefix")
    prefix = not gemma if prefix is None else bool(prefix)
    backend.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if prefix else [])
                                              + [normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _merges_from_vocab(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a ranked token into two vocabulary
    tokens, best-ranked token first (ties as transformers' ``generate_merges``: longer pieces first, then the
    ranked tokens' order, then the pieces' ids)."""
    found: list[tuple[float, int, int, int, int, str, str]] = []
    for n, (token, score) in enumerate(rank.items()):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-score, -len(left), -len(right), n, vocab[left] * len(vocab) + vocab[right], left,
                              right))
    found.sort()
    return [(left, right) for *_, left, right in found]


_GGUF_BACKENDS = {"gpt2": _byte_level_backend, "llama": _sentencepiece_backend}


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: object) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_from_hf_dir(path: str) -> Tokenizer:
    backend = BackendTokenizer.from_file(os.path.join(path, "tokenizer.json"))
    spec = json.loads(backend.to_str())
    backend.post_processor = None  # encode() never adds special tokens; the engine adds BOS itself (add_bos)
    tok_cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    model_cfg = _read_json(os.path.join(path, "config.json"))
    gen_cfg = _read_json(os.path.join(path, "generation_config.json"))
    bos_text = _token_content(tok_cfg.get("bos_token"))
    bos = backend.token_to_id(bos_text) if bos_text else model_cfg.get("bos_token_id")
    eos: list[int] = []
    eos_text = _token_content(tok_cfg.get("eos_token"))
    candidates: list[object] = [backend.token_to_id(eos_text) if eos_text else None]
    for cfg in (model_cfg, gen_cfg):
        value = cfg.get("eos_token_id")
        candidates.extend(value if isinstance(value, list) else [value])
    for cand in candidates:
        if cand is not None and int(cand) not in eos:
            eos.append(int(cand))
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    add_bos = tok_cfg.get("add_bos_token")
    if add_bos is None:  # infer from the post-processor template: does it start with the BOS token?
        post = spec.get("post_processor") or {}
        single = post.get("single") or []
        add_bos = bool(single) and "SpecialToken" in single[0] and single[0]["SpecialToken"]["id"] == bos_text
    decoder = spec.get("decoder") or {}
    return Tokenizer(backend, bos_token_id=None if bos is None else int(bos), eos_token_ids=tuple(eos),
                     chat_template=template, add_bos=bool(add_bos), byte_level=decoder.get("type") == "ByteLevel")
