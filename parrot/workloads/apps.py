"""The paper's long-document apps (§8.2) written once as data: the benchmark's drivers
(:mod:`parrot.bench.apps`) and the simulated cluster (:mod:`parrot.sim.cluster`) both run them.

An :class:`App` is a list of steps in topological order; each step fills one template whose inputs are
constant text (a chunk) or the output of an earlier step, and generates one output of a fixed length
(``max_tokens`` with ``ignore_eos``, so every driver generates exactly the same number of tokens).

* chain summary: ``s0 = summarize(c0)``, ``s_i = refine(s_{i-1}, c_i)``  (LangChain "refine")
* map-reduce:    ``m_i = summarize(c_i)`` in parallel, ``final = combine(m_0..m_{n-1})``

Every run gets a unique tag at the start of each template, so no run reuses another run's cached prefix
(within a run, prompts share prefixes the same way in every mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_DOCUMENT = Path(__file__).resolve().parents[2] / "examples" / "data" / "lighthouses.txt"

OUT = "summary"  # the output placeholder of every step

CHAIN_FIRST = ("Write a concise summary of the following text.\n\nText:\n{{input:chunk}}\n\n"
               "Concise summary: {{output:summary}}")
CHAIN_REFINE = ("Your job is to produce a final summary.\n"
                "We have provided an existing summary up to a certain point: {{input:previous}}\n"
                "We have the opportunity to refine the existing summary with some more context below.\n"
                "------------\n{{input:chunk}}\n------------\n"
                "Given the new context, refine the original summary.\nRefined summary: {{output:summary}}")
MAP = 'Write a concise summary of the following:\n"{{input:chunk}}"\nCONCISE SUMMARY: {{output:summary}}'
REDUCE_HEAD = "The following is a set of summaries:\n"
REDUCE_TAIL = "\nTake these and distill them into a final, consolidated summary.\nSummary: {{output:summary}}"


@dataclass(frozen=True)
class Const:
    text: str


@dataclass(frozen=True)
class FromStep:
    step: str


@dataclass(frozen=True)
class Step:
    name: str
    template: str
    inputs: tuple[tuple[str, Const | FromStep], ...]


@dataclass(frozen=True)
class App:
    name: str
    steps: tuple[Step, ...]  # topological order
    final: str
    output_len: int

    @property
    def num_calls(self) -> int:
        return len(self.steps)


def split_words(text: str, num_chunks: int, chunk_words: int) -> list[str]:
    """``num_chunks`` consecutive chunks of ``chunk_words`` words from the start of ``text``."""
    words = text.split()
    if num_chunks * chunk_words > len(words):
        raise ValueError(f"document has {len(words)} words; {num_chunks} chunks of {chunk_words} words need "
                         f"{num_chunks * chunk_words}")
    return [" ".join(words[i * chunk_words:(i + 1) * chunk_words]) for i in range(num_chunks)]


def load_document(path: str | Path) -> str:
    return Path(path).read_text(encoding="utf-8")


def chain_summary(chunks: list[str], output_len: int, tag: str = "") -> App:
    steps = [Step("s0", tag + CHAIN_FIRST, (("chunk", Const(chunks[0])),))]
    for i, chunk in enumerate(chunks[1:], start=1):
        steps.append(Step(f"s{i}", tag + CHAIN_REFINE, (("previous", FromStep(f"s{i - 1}")), ("chunk", Const(chunk)))))
    return App("chain", tuple(steps), steps[-1].name, output_len)


def map_reduce_summary(chunks: list[str], output_len: int, tag: str = "") -> App:
    maps = [Step(f"m{i}", tag + MAP, (("chunk", Const(c)),)) for i, c in enumerate(chunks)]
    reduce_template = tag + REDUCE_HEAD + "\n".join("- {{input:m%d}}" % i for i in range(len(chunks))) + REDUCE_TAIL
    reduce = Step("reduce", reduce_template, tuple((f"m{i}", FromStep(f"m{i}")) for i in range(len(chunks))))
    return App("map_reduce", (*maps, reduce), "reduce", output_len)


APPS = {"chain": chain_summary, "map_reduce": map_reduce_summary}
