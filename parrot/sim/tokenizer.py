"""The simulator's synthetic tokens: a cheap deterministic word tokenizer and seeded output lengths (no model)."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

BOS, EOS, GEN_TOKEN, FIRST_WORD_ID = 1, 2, 3, 16
GEN_TEXT = " tok"


class WordTokenizer:
    """Deterministic, cheap: one token per word plus one more per word longer than 6 characters (~1.3 tokens
    per English word). Ids are CRC32 hashes into the vocabulary; decode joins the words with spaces. Has the
    attributes the engine core and the in-process client read of a real tokenizer (special ids, template)."""

    bos_token_id = BOS
    eos_token_ids = (EOS,)
    add_bos = True
    chat_template = None

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size
        self._words: dict[int, str] = {GEN_TOKEN: GEN_TEXT.strip()}  # id -> first word seen with it (decode)
        self._ids: dict[str, tuple[int, ...]] = {}  # word -> its ids (a cache: hashing dominates encode)
        self._span = vocab_size - FIRST_WORD_ID

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for w in text.split():
            ids = self._ids.get(w)
            if ids is None:
                ids = self._ids[w] = self._word_ids(w)
            out.extend(ids)
        return out

    def _word_ids(self, w: str) -> tuple[int, ...]:
        i = FIRST_WORD_ID + zlib.crc32(w.encode()) % self._span
        self._words.setdefault(i, w)
        if len(w) > 6:
            return i, FIRST_WORD_ID + zlib.crc32(w.encode() + b"#") % self._span
        return (i,)

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return " ".join(self._words[i] for i in ids if i in self._words and i not in (BOS, EOS))

    def incremental_decoder(self, *, skip_special_tokens: bool = False) -> "WordDecoder":
        """``skip_special_tokens``: BOS / EOS never add text here, so there is nothing more to skip."""
        return WordDecoder(self._words)


class WordDecoder:
    """Streaming detokenization: each known word comes out with its leading space (``GEN_TOKEN`` -> ``GEN_TEXT``)."""

    def __init__(self, words: dict[int, str]) -> None:
        self._words = words

    def push(self, token_id: int) -> str:
        word = self._words.get(token_id)
        return "" if word is None or token_id in (BOS, EOS) else " " + word


@dataclass(frozen=True)
class OutputLengths:
    """Lengths of generations that may stop early (not ``ignore_eos``): 1 + exponential(mean - 1), seeded."""

    mean: float = 128.0

    def draw(self, rng: random.Random) -> int:
        return 1 + int(rng.expovariate(1.0 / max(self.mean - 1.0, 1e-9)))
