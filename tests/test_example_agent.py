"""examples/agent.py: its tools (local Python), and its whole think -> search -> think -> calculate -> answer loop
on an in-process service with the tiny random model (the tool calls are declared to the server)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import parrot as P

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def agent():
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location("example_agent", EXAMPLES / "agent.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(EXAMPLES))


def test_tools_are_local_python(agent):
    assert agent.evaluate("2 * 60 + 30") == 150
    assert agent.evaluate("-(3 - 5) ** 2") == -4
    for bad in ("__import__('os')", "2 ** 100", "1 / 0", "x + 1"):
        with pytest.raises(ValueError):
            agent.evaluate(bad)
    assert agent.search.tool == "search" and agent.calculator.tool == "calculator"
    assert "mercury" in agent.search.fn("What turned the heavy rotating lens?", "mercury trough").lower()
    assert agent.calculator.fn("3 * 4", "the product 7*6 please") == "7*6 = 42"
    assert agent.calculator.fn("3 * 4", "no numbers here") == "3 * 4 = 12"
    assert agent.calculator.fn("nothing", "nothing") == "no arithmetic found"


def test_loop_runs_and_declares_tools(agent):
    with P.local(random_model="tiny", dtype="float32", kv_cache_tokens=2048) as s:
        runs = [agent.ask(q, a, 6) for q, a in agent.QUESTIONS[:2]]
        for (q, a), steps in zip(agent.QUESTIONS[:2], runs):
            final = steps["answer"].get(timeout=60)
            assert isinstance(final, str)
            found = steps["found"].get(timeout=5)
            assert found in agent._SENTENCES or found == next(x for x in agent._SENTENCES if x.startswith(found))
            result = steps["result"].get(timeout=5)
            assert result.endswith(f"= {agent.evaluate(a):g}") or "=" in result
        dag = s.dag()
    # the server saw the native functions' outputs as tool calls on the thoughts that feed them
    tools = {v["var_id"]: v["tool"] for v in dag["variables"] if v.get("tool")}
    assert sorted(t["name"] for t in tools.values()) == ["calculator", "calculator", "search", "search"]
    producers = {v["var_id"]: v["producer"] for v in dag["variables"]}
    for t in tools.values():
        assert any(producers.get(i) for i in t["inputs"])  # a generated input: its generate pauses for the tool
