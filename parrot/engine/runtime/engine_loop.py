"""LLMEngine: the builtin engine -- the engine core on its own thread, on the wall clock, with the torch runner.

Callers (any thread) get ``concurrent.futures`` futures; their commands go through a queue to the engine
thread, the only writer of the core's state. The same thread (:class:`EngineThread`) built the model, so all of
the engine's torch work runs on one thread (why: its docstring). Each loop turn: apply commands -> schedule ->
run one forward (ModelRunner) -> apply results -> finish ops (results leave through callbacks, which resolve
futures / stream queues thread-safely). The op lifecycle and step logic are :class:`~parrot.engine.runtime.core.EngineCore`'s.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from parrot.common.errors import EngineError
from parrot.engine.runtime.core import Command, EngineCore, StepRunner
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

T = TypeVar("T")
PAUSE_POLL_S = 1.0  # how often an idle engine checks its paused contexts' TTLs


class EngineThread:
    """The one thread that runs all of an engine's torch work, in order: building the model (weights, packing, KV
    cache), then the engine loop.

    Why one thread: libgomp (torch's OpenMP) gives every thread that starts a parallel region its own team of
    workers, and once the process has more OpenMP threads than cores -- a model built on the main thread, then
    run on an engine thread, makes two teams -- it stops spinning idle workers and parks them, so every parallel
    region pays a wake-up. Measured on 2 cores: 31 -> 71 us for a 16-row 576x576 matmul, a decode step at 16
    sequences 40 -> 29 ms when model and loop share the thread."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future:
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the thread and return its result (or raise its exception) here."""
        return self.submit(fn).result()

    def stop(self, timeout: float = 30) -> None:
        """Let the thread finish its queued jobs and exit."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller, which raises it
                    fut.set_exception(e)


class LLMEngine(EngineCore):
    def __init__(
        self, *, name: str, model_name: str, runner: StepRunner, pool: BlockPool, scheduler: Scheduler,
        tokenizer, max_model_len: int, thread: EngineThread, numerics: dict | None = None,
    ) -> None:
        """``runner`` is the torch :class:`~parrot.engine.runtime.runner.ModelRunner`, built by the engine builder on
        ``thread``, which then runs the loop."""
        super().__init__(name=name, model_name=model_name, runner=runner, pool=pool, scheduler=scheduler,
                         tokenizer=tokenizer, max_model_len=max_model_len, clock=time.monotonic,
                         cached_status=True, numerics=numerics)
        self._cmds: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._finishers: list[threading.Thread] = []
        self._thread = thread
        self._running: Future | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._running is None and self._thread is not None:
            self._running = self._thread.submit(self._loop)

    def finish_before_shutdown(self, thread: threading.Thread) -> None:
        """A background job of this engine's start (writing the packed-weight cache) that :meth:`shutdown` waits
        for, so a server stopped right after it started does not cut it short."""
        self._finishers.append(thread)

    def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(lambda: None)
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
            self._running = None
        for t in self._finishers:
            t.join(timeout=120)
        self._finishers.clear()

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
                # idle: block on the next command, waking every PAUSE_POLL_S while paused contexts wait for their
                # tools, so a pause whose TTL passes is freed even when nothing else arrives
                timeout = 0.0 if self.scheduler.has_work() else PAUSE_POLL_S if len(self.scheduler.pauses) else None
                try:
                    cmd = self._cmds.get(timeout=timeout) if timeout != 0.0 else self._cmds.get_nowait()
                    cmd()
                    while True:
                        self._cmds.get_nowait()()
                except queue.Empty:
                    pass
                self.expire_pauses()
                if self.scheduler.has_work():
                    self.step()
                self.refresh_status()
            except Exception:
                log.exception("engine loop iteration failed; failing running ops")
                self.fail_all(EngineError("internal engine error during a step"))
