"""LLMEngine: the builtin engine -- the engine core on its own thread, on the wall clock, with the torch runner.

Callers (any thread) get ``concurrent.futures`` futures; their commands go through a queue to the engine
thread, the only writer of the core's state. Each loop turn: apply commands -> schedule -> run one forward
(ModelRunner) -> apply results -> finish ops (results leave through callbacks, which resolve futures / stream
queues thread-safely). The op lifecycle and step logic are :class:`~parrot.engine.core.EngineCore`'s.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future

from parrot.common.errors import EngineError
from parrot.engine.core import Command, EngineCore, StepRunner
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


class LLMEngine(EngineCore):
    def __init__(
        self, *, name: str, model_name: str, runner: StepRunner, pool: BlockPool, scheduler: Scheduler,
        tokenizer, max_model_len: int,
    ) -> None:
        """``runner`` is the torch :class:`~parrot.engine.runner.ModelRunner` (built by the engine builder)."""
        super().__init__(name=name, model_name=model_name, runner=runner, pool=pool, scheduler=scheduler,
                         tokenizer=tokenizer, max_model_len=max_model_len, clock=time.monotonic,
                         cached_status=True)
        self._cmds: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"parrot-engine-{self.name}", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # ---- the owner: a thread -----------------------------------------------------------------------------------
    def _new_future(self) -> Future:
        return Future()

    def _submit(self, cmd: Command) -> None:
        if self._stop.is_set():
            raise EngineError("engine is shut down")
        self._cmds.put(cmd)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                timeout = None if not self.scheduler.has_work() else 0.0
                try:
                    cmd = self._cmds.get(timeout=timeout) if timeout is None else self._cmds.get_nowait()
                    cmd()
                    while True:
                        self._cmds.get_nowait()()
                except queue.Empty:
                    pass
                if self.scheduler.has_work():
                    self.step()
                self.refresh_status()
            except Exception:
                log.exception("engine loop iteration failed; failing running ops")
                self.fail_all(EngineError("internal engine error during a step"))
