"""``compile_chain(chain)``: an LCEL chain as one LangChain Runnable whose calls submit the whole chain to Parrot.

::

    chain = compile_chain(prompt | ParrotLLM(temperature=0) | StrOutputParser())
    chain.invoke({"topic": "lighthouses"})          # -> str, as the plain chain returns
    chain.batch([{...}, {...}])                      # every input traced (submitted) before any is read
    await chain.ainvoke({...})

Sessions: ``session=`` (a :class:`~parrot.frontend.client.Session`) runs every call in that session (its DAG
then shows the calls: ``session.dag()["text"]``); without it the default session (``P.connect``) is used, or a
fresh session on the chain's first Parrot model's server is opened for the call and deleted after it.
Callbacks see the compiled chain as one run (the steps run on the server, not in this process).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from langchain_core.runnables import Runnable
from langchain_core.runnables.base import coerce_to_runnable
from langchain_core.runnables.config import RunnableConfig, ensure_config, get_config_list

from parrot.common.perf import PerfCriteria
from parrot.frontend.client import Session, default_session
from parrot.integrations.langchain.compiler import Tracer, TracedStep, UnsupportedRunnable, unsupported, walk
from parrot.integrations.langchain.models import ChatParrot, ParrotLLM


class ParrotChain(Runnable[Any, Any]):
    """A compiled LCEL chain (see the module docstring). ``last_steps``: what the last call ran where."""

    def __init__(self, chain: Any, *, session: Session | None = None, strict: bool = False,
                 perf: PerfCriteria | str = PerfCriteria.LATENCY, name: str | None = None) -> None:
        self.chain: Runnable = coerce_to_runnable(chain)
        self.session = session
        self.strict = strict
        self.perf = PerfCriteria(perf)
        self.name = name or f"Parrot[{self.chain.get_name()}]"
        self.models = [r for r in walk(self.chain) if isinstance(r, (ParrotLLM, ChatParrot))]
        if strict:
            refused = unsupported(self.chain)
            if refused:
                raise UnsupportedRunnable(f"these runnables would run client-side: {refused}", param=refused[0])
        if not self.models and session is None:
            raise UnsupportedRunnable("the chain has no ParrotLLM / ChatParrot step: nothing to run on Parrot",
                                      param="chain")
        self.last_steps: list[TracedStep] = []

    @property
    def InputType(self) -> Any:  # noqa: N802 -- LangChain's name
        return self.chain.InputType

    @property
    def OutputType(self) -> Any:  # noqa: N802
        return self.chain.OutputType

    @contextlib.contextmanager
    def _session(self) -> Iterator[Session]:
        session = self.session or default_session()
        if session is not None:
            yield session
            return
        model = self.models[0]
        with Session(model.url, model.api_key.get_secret_value() if model.api_key else None) as own:
            yield own

    def _tracer(self, session: Session, config: RunnableConfig | None, pending: list | None = None) -> Tracer:
        return Tracer(session, strict=self.strict, config=config, perf=self.perf, pending=pending)

    def _invoke(self, value: Any, config: RunnableConfig) -> Any:
        with self._session() as session:
            tracer = self._tracer(session, config)
            out = tracer.run(self.chain, value)
            self.last_steps = tracer.steps
            return tracer.materialize(out)

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:  # noqa: A002
        """Submit the whole chain for ``input``, then read its output (the type the plain chain returns)."""
        return self._call_with_config(self._invoke, input, ensure_config(config), run_type="chain")

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:  # noqa: A002
        return await asyncio.to_thread(self.invoke, input, config, **kwargs)

    def batch(self, inputs: list[Any], config: RunnableConfig | Sequence[RunnableConfig] | None = None, *,
              return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """Trace (submit) every input first, in one session, then read the outputs in order: the server sees all
        the chains at once. With ``return_exceptions`` a failing input's exception takes its place."""
        if not inputs:
            return []
        configs = get_config_list(config, len(inputs))
        with self._session() as session:
            traced: list[tuple[Tracer, Any, BaseException | None]] = []
            pending: list = []  # one queue: the first read sends every input's calls in the same two waves
            for value, cfg in zip(inputs, configs):
                tracer = self._tracer(session, cfg, pending)
                try:
                    traced.append((tracer, tracer.run(self.chain, value), None))
                except Exception as e:  # noqa: BLE001 -- reported in place or re-raised below
                    if not return_exceptions:
                        raise
                    traced.append((tracer, None, e))
            results: list[Any] = []
            for tracer, out, error in traced:
                if error is not None:
                    results.append(error)
                    continue
                try:
                    results.append(tracer.materialize(out))
                except Exception as e:  # noqa: BLE001
                    if not return_exceptions:
                        raise
                    results.append(e)
            self.last_steps = [s for tracer, _, _ in traced for s in tracer.steps]
            return results

    async def abatch(self, inputs: list[Any], config: RunnableConfig | Sequence[RunnableConfig] | None = None, *,
                     return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        return await asyncio.to_thread(self.batch, inputs, config, return_exceptions=return_exceptions)

    def get_name(self, suffix: str | None = None, *, name: str | None = None) -> str:
        base = name or self.name
        return f"{base}{suffix}" if suffix else base


def compile_chain(chain: Any, *, session: Session | None = None, strict: bool = False,
                  perf: PerfCriteria | str = PerfCriteria.LATENCY) -> ParrotChain:
    """``chain`` (an LCEL runnable, or a dict of them) as a :class:`ParrotChain`. ``strict``: refuse (raise
    UnsupportedRunnable, naming them) chains with steps that would run client-side; ``perf``: the criterion
    the outputs are read with (LATENCY, or THROUGHPUT for batch jobs)."""
    return ParrotChain(chain, session=session, strict=strict, perf=perf)
