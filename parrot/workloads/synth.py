"""Seeded synthetic inputs for the paper-scale experiments: long documents, GPTs system prompts, chat requests.

Documents are words drawn (seeded) from the shipped example text, so no two chunks repeat and no prefix-cache
hit happens by accident; sizes are given in tokens and converted with the simulator tokenizer's ~1.3 tokens
per word. Apps are the paper's :mod:`parrot.workloads.apps` programs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from parrot.workloads.apps import APPS, DEFAULT_DOCUMENT, App, load_document

TOKENS_PER_WORD = 1.25  # measured: WordTokenizer gives ~1.25 tokens per word of the example text


@lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    return tuple(load_document(DEFAULT_DOCUMENT).split())


def words_for_tokens(tokens: int) -> int:
    return max(1, round(tokens / TOKENS_PER_WORD))


def synth_text(tokens: int, rng: random.Random) -> str:
    """About ``tokens`` simulator tokens of seeded random words."""
    vocab = _vocabulary()
    return " ".join(rng.choice(vocab) for _ in range(words_for_tokens(tokens)))


def document_chunks(num_chunks: int, chunk_tokens: int, seed: int) -> list[str]:
    rng = random.Random(f"doc:{seed}")
    return [synth_text(chunk_tokens, rng) for _ in range(num_chunks)]


def app(kind: str, num_chunks: int, chunk_tokens: int, output_len: int, seed: int) -> App:
    """A chain or map-reduce summary of a fresh seeded document (tagged so runs never share a prefix)."""
    return APPS[kind](document_chunks(num_chunks, chunk_tokens, seed), output_len, tag=f"[doc {seed}] ")


@dataclass(frozen=True)
class GptsApp:
    name: str
    system_prompt: str

    @property
    def template(self) -> str:
        return self.system_prompt + "\nUser: {{input:query}}\nAssistant: {{output:answer}}"


def gpts_apps(n: int, prompt_tokens: int, seed: int) -> list[GptsApp]:
    rng = random.Random(f"gpts:{seed}")
    return [GptsApp(f"gpt{i}", f"[GPT {i}] You are an assistant. " + synth_text(prompt_tokens, rng)) for i in range(n)]
