"""The sizes of :mod:`parrot.bench.cluster_bench`'s scenarios (map-reduce, chain with background load,
multi-chain, mixed chat + map-reduce) and the document chunks its apps summarize; the simulator's ``mixed_cpu``
(:mod:`parrot.sim.experiments`) replays the same ``mixed`` scenario with these sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from parrot.workloads.apps import DEFAULT_DOCUMENT, load_document, split_words


@dataclass(frozen=True)
class Workload:
    chunk_words: int = 120
    map_chunks: int = 8
    chain_chunks: int = 4
    output_len: int = 32
    background: int = 2
    apps: int = 4  # multi_chain
    multi_chunks: int = 3
    mixed_engines: int = 2
    mixed_apps: int = 2
    mixed_chunks: int = 6
    chat_rate: float = 1.0  # requests per second
    chat_min: int = 10  # chat requests sent at least (the stream goes on until the map-reduce apps are done)
    chat_words: int = 60
    chat_out: tuple[int, int] = (16, 48)
    latency_cap: int = 512
    throughput_cap: int = 16384


QUICK = Workload(chunk_words=40, map_chunks=4, chain_chunks=3, output_len=12, background=1, apps=3, multi_chunks=2,
                 mixed_apps=1, mixed_chunks=4, chat_rate=1.0, chat_min=4, chat_words=30, chat_out=(8, 16),
                 latency_cap=160, throughput_cap=16384)


def chunks(w: Workload, n: int, offset: int) -> list[str]:
    """``n`` chunks of ``w.chunk_words`` words of the example document, starting at a place set by ``offset``."""
    words = load_document(DEFAULT_DOCUMENT).split()
    start = (offset * n * w.chunk_words) % max(1, len(words) - n * w.chunk_words)
    return split_words(" ".join(words[start:]), n, w.chunk_words)
