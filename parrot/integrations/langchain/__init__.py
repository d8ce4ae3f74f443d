"""LangChain on Parrot (paper §4, §6): LCEL chains submitted as Semantic-Variable programs, not rendered text.

::

    from langchain_core.prompts import PromptTemplate
    from langchain_core.output_parsers import StrOutputParser
    from parrot.integrations.langchain import ParrotLLM, compile_chain

    llm = ParrotLLM(base_url="http://127.0.0.1:8000", temperature=0, max_tokens=64)
    summarize = PromptTemplate.from_template("Summarize:\\n{text}\\nSummary:") | llm | StrOutputParser()
    chain = compile_chain({"summary": summarize} | refine_prompt | llm | StrOutputParser())
    chain.invoke({"text": doc})        # every step submitted at once; runs server-side as one DAG

:class:`ParrotLLM` / :class:`ChatParrot` are ordinary LangChain models too (``llm.invoke("...")`` calls the
server's OpenAI API, or the Parrot API with ``api="parrot"``). :func:`compile_chain` walks the chain
(:mod:`.compiler`) and returns a LangChain :class:`~langchain_core.runnables.Runnable`.

Needs ``langchain-core`` (``pip install parrot-serve[langchain]``); importing this package without it raises an
ImportError that says so. Names are resolved lazily (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, tuple[str, str]] = {
    "ParrotLLM": ("parrot.integrations.langchain.models", "ParrotLLM"),
    "ChatParrot": ("parrot.integrations.langchain.models", "ChatParrot"),
    "compile_chain": ("parrot.integrations.langchain.runnable", "compile_chain"),
    "ParrotChain": ("parrot.integrations.langchain.runnable", "ParrotChain"),
    "UnsupportedRunnable": ("parrot.integrations.langchain.compiler", "UnsupportedRunnable"),
    "ChainCompileError": ("parrot.integrations.langchain.compiler", "ChainCompileError"),
}

__all__ = sorted(_EXPORTS)


def _require_langchain() -> None:
    try:
        importlib.import_module("langchain_core")
    except ImportError as e:
        raise ImportError("parrot.integrations.langchain needs langchain-core: pip install 'parrot-serve[langchain]' "
                          "(or pip install 'langchain-core>=0.3')") from e


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    _require_langchain()
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from parrot.integrations.langchain.compiler import ChainCompileError, UnsupportedRunnable
    from parrot.integrations.langchain.models import ChatParrot, ParrotLLM
    from parrot.integrations.langchain.runnable import ParrotChain, compile_chain
