"""Pinning the engine's compute threads (parrot/engine/runtime/threads.py, kernels/threads.cpp): when it happens, and that
each intra-op thread then runs on its own CPU (in a subprocess: pinning is for the process's life)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from parrot.engine.runtime.threads import binding


def test_auto_pins_only_an_engine_that_owns_every_cpu() -> None:
    assert binding("auto", 2, [0, 1]) == [0, 1]
    assert binding("auto", 1, [0, 1]) is None  # several engines share the machine: the OS places them
    assert binding("auto", 4, [2, 3, 6, 7]) == [2, 3, 6, 7]  # a process confined to some CPUs owns those
    assert binding("on", 1, [4, 5]) == [4]
    assert binding("off", 2, [0, 1]) is None
    assert binding("on", 3, [0, 1]) is None  # more threads than CPUs: nothing sensible to pin to
    with pytest.raises(ValueError, match="bind_threads must be one of"):
        binding("always", 2, [0, 1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_bound_threads_run_where_they_were_put(native_kernel) -> None:
    cpus = sorted(os.sched_getaffinity(0))[:2]
    code = (f"import torch, json, os; from parrot.engine.kernels import load_kernels; ops = load_kernels(); "
            f"torch.set_num_threads(2); where = list(ops.bind_threads({cpus})); "
            f"print(json.dumps([where, sorted(os.sched_getaffinity(0))]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    where, main_affinity = json.loads(out.stdout.strip().splitlines()[-1])
    assert where == cpus  # thread i reported running on cpus[i]
    assert main_affinity == cpus[:1]  # the calling thread is thread 0: pinned to the first
