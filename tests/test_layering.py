"""Layering of the benchmarks, the simulator and their workloads: bench and sim import parrot.workloads, never each
other, and parrot.workloads imports neither.

The rule, checked on the source of every module under parrot/bench, parrot/sim and parrot/workloads (imports at any
depth, function-local ones included; ``import parrot.x``, ``from parrot.x import y``, ``from parrot import x``,
relative imports and ``importlib.import_module("parrot.x")`` with a literal name):

    parrot/bench/**      must not import parrot.sim
    parrot/sim/**        must not import parrot.bench
    parrot/workloads/**  must import neither

What both sides need lives where both can import it: the workloads (apps, multi-agent workflow, Preble's workloads,
the Azure trace, the tool mixes, arrival processes, the baseline client) in parrot.workloads, the report tables in
parrot.common.report. An experiment that runs the simulator is a simulator module (e.g.
parrot.sim.preble_experiments), one that runs real engines a benchmark (parrot.bench.preble_bench).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("bench", "sim", "workloads")
FORBIDDEN = {"bench": ("parrot.sim",), "sim": ("parrot.bench",), "workloads": ("parrot.sim", "parrot.bench")}


def _package_of(rel: str) -> str:
    """``parrot/bench/x.py`` -> ``parrot.bench``; ``parrot/bench/__init__.py`` -> ``parrot.bench``."""
    return ".".join(Path(rel).parent.parts)


def imported_modules(source: str, rel: str) -> list[tuple[int, tuple[str, ...]]]:
    """(line, names) for every import in ``source`` (the file at ``rel``, for relative imports), at any depth:
    ``import a.b`` -> ``(a.b,)``; ``from a.b import c`` -> ``(a.b, a.b.c)`` (``c`` may be a module or a name)."""
    out: list[tuple[int, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, (a.name,)) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package_of(rel).split(".")
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            out += [(node.lineno, (base, f"{base}.{a.name}")) for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in ("import_module", "__import__"):
                out.append((node.lineno, (node.args[0].value,)))
    return out


def _within(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def violations(source: str, rel: str) -> list[str]:
    """``file:line: message`` for every import that breaks the rule in the module docstring."""
    layer = Path(rel).parts[1]
    out = []
    for line, names in imported_modules(source, rel):
        for bad in FORBIDDEN[layer]:
            hit = next((n for n in names if _within(n, bad)), None)
            msg = f"{rel}:{line}: imports {hit} (parrot.{layer} must not import {bad})"
            if hit is not None and msg not in out:
                out.append(msg)
    return out


def _modules() -> list[str]:
    files = [p for layer in LAYERS for p in sorted((ROOT / "parrot" / layer).rglob("*.py"))]
    return [p.relative_to(ROOT).as_posix() for p in files]


def test_every_layer_has_modules():
    mods = _modules()
    for layer in LAYERS:
        assert any(m.startswith(f"parrot/{layer}/") for m in mods), layer


def test_bench_and_sim_import_workloads_never_each_other():
    found = [v for rel in _modules() for v in violations((ROOT / rel).read_text(encoding="utf-8"), rel)]
    assert not found, "layering broken:\n" + "\n".join(found)


@pytest.mark.parametrize("rel, source, line, module", [
    ("parrot/bench/x.py", "import os\nimport parrot.sim.cluster\n", 2, "parrot.sim.cluster"),
    ("parrot/bench/x.py", "from parrot.sim.preble_workloads import workload\n", 1, "parrot.sim.preble_workloads"),
    ("parrot/bench/x.py", "def f():\n    if True:\n        from parrot import sim\n", 3, "parrot.sim"),
    ("parrot/bench/x.py", "from ..sim import cluster\n", 1, "parrot.sim"),
    ("parrot/bench/x.py", "import importlib\nm = importlib.import_module('parrot.sim.vloop')\n", 2, "parrot.sim.vloop"),
    ("parrot/sim/x.py", "class A:\n    def f(self):\n        from parrot.bench.report import format_table\n", 3,
     "parrot.bench.report"),
    ("parrot/sim/x.py", "from . import cluster\nfrom ..bench import apps\n", 2, "parrot.bench"),
    ("parrot/workloads/x.py", "from parrot.sim.tokenizer import WordTokenizer\n", 1, "parrot.sim.tokenizer"),
    ("parrot/workloads/x.py", "import parrot.bench.apps as A\n", 1, "parrot.bench.apps"),
    ("parrot/bench/preble_bench.py", "from parrot.sim.cluster import SimCluster\n", 1, "parrot.sim.cluster"),
])
def test_the_check_names_file_and_line(rel, source, line, module):
    found = violations(source, rel)
    assert found and found[0].startswith(f"{rel}:{line}: imports {module} "), found


@pytest.mark.parametrize("rel, source", [
    ("parrot/bench/x.py", "from parrot.workloads.preble import workload\nimport parrot.simulator_notes\n"),
    ("parrot/sim/x.py", "from parrot.workloads.apps import APPS\nfrom parrot.common.report import format_table\n"),
    ("parrot/sim/x.py", "from .cluster import SimCluster\n"),
])
def test_allowed_imports_pass(rel, source):
    assert violations(source, rel) == []


# ---- the engine contract ------------------------------------------------------------------------------------------
CONTRACT_USERS = ("manager", "protocol", "common")  # they speak to engines through parrot.protocol only


def test_the_manager_speaks_to_engines_through_the_protocol_only():
    """parrot.manager, parrot.protocol and parrot.common never import parrot.engine: what they need of an engine (the
    EngineClient interface, its data and wire form, status metrics, block hashes) is the contract, parrot.protocol."""
    found = []
    for layer in CONTRACT_USERS:
        for path in sorted((ROOT / "parrot" / layer).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, names in imported_modules(path.read_text(encoding="utf-8"), rel):
                hit = next((n for n in names if _within(n, "parrot.engine")), None)
                if hit is not None:
                    found.append(f"{rel}:{line}: imports {hit}")
    assert not found, "the engine contract is parrot.protocol:\n" + "\n".join(found)
