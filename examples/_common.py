"""Shared command line of the examples: ``--url`` (default $PARROT_URL) or ``--local`` (in-process service)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import parrot as P  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--url", default=os.environ.get("PARROT_URL", "http://127.0.0.1:8000"),
                   help="Parrot server (default: $PARROT_URL or http://127.0.0.1:8000)")
    p.add_argument("--local", action="store_true", help="start engine + server in this process (P.local)")
    p.add_argument("--model", default=None, help="with --local: GGUF file or HF dir (default: SmolLM2-135M)")
    p.add_argument("--api-key", default=os.environ.get("PARROT_API_KEY"))
    return p


def open_session(args: argparse.Namespace) -> P.Session:
    """The session (made the default) the example runs in; use it as a context manager."""
    logging.basicConfig(level=logging.WARNING)
    if args.local:
        return P.local(args.model, api_key=args.api_key)
    return P.connect(args.url, api_key=args.api_key)


def document_chunks(num_chunks: int, chunk_words: int, name: str = "lighthouses.txt") -> list[str]:
    words = (DATA / name).read_text(encoding="utf-8").split()
    if num_chunks * chunk_words > len(words):
        raise SystemExit(f"the document has {len(words)} words: at most {len(words) // chunk_words} chunks "
                         f"of {chunk_words} words")
    return [" ".join(words[i * chunk_words:(i + 1) * chunk_words]) for i in range(num_chunks)]
