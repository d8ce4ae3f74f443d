"""The simulator's synthetic tokens: a cheap deterministic word tokenizer and seeded output lengths (no model)."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

BOS, EOS, GEN_TOKEN, FIRST_WORD_ID = 1, 2, 3, 16
GEN_TEXT = " tok"


class WordTokenizer:
    """Deterministic, cheap: one token per word plus one more per word longer than 6 characters (~1.3 tokens
    per English word). Ids are CRC32 hashes into the vocabulary; decode joins the words with spaces."""

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size
        self._words: dict[int, str] = {GEN_TOKEN: GEN_TEXT.strip()}
        self._span = vocab_size - FIRST_WORD_ID

    def encode(self, text: str) -> list[int]:
        out = []
        for w in text.split():
            i = FIRST_WORD_ID + zlib.crc32(w.encode()) % self._span
            self._words.setdefault(i, w)
            out.append(i)
            if len(w) > 6:
                out.append(FIRST_WORD_ID + zlib.crc32(w.encode() + b"#") % self._span)
        return out

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return " ".join(self._words[i] for i in ids if i in self._words and i not in (BOS, EOS))


@dataclass(frozen=True)
class OutputLengths:
    """Lengths of generations that may stop early (not ``ignore_eos``): 1 + exponential(mean - 1), seeded."""

    mean: float = 128.0

    def draw(self, rng: random.Random) -> int:
        return 1 + int(rng.expovariate(1.0 / max(self.mean - 1.0, 1e-9)))
