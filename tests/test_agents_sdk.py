"""The OpenAI Agents SDK against a real server on the default model: an agent with one function tool runs on both
of the SDK's model classes (OpenAIResponsesModel on /v1/responses, OpenAIChatCompletionsModel on
/v1/chat/completions), plain (Runner.run) and streamed (Runner.run_streamed); a forced tool choice makes the model
call the tool, the SDK runs the function once with schema-valid arguments, and the run ends with a final output."""

from __future__ import annotations

import asyncio

import pytest
from test_responses_tools import real_server, url  # noqa: F401  (fixtures: one real server for this module)

agents = pytest.importorskip("agents")
pytestmark = pytest.mark.model

INSTRUCTIONS = "You are a helpful assistant for travellers. Use the tools to look things up."
QUESTION = "What is the weather in Paris today?"
MODEL_CLASSES = ("responses", "chat")


def make_agent(base: str, model_class: str, tool_choice: str, calls: list[str], **settings):
    from openai import AsyncOpenAI

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city.

        Args:
            city: the city's name.
        """
        calls.append(city)
        return f"18 C and clear in {city}"

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    name = client_model(base)
    model = (agents.OpenAIResponsesModel(name, client) if model_class == "responses"
             else agents.OpenAIChatCompletionsModel(name, client))
    return agents.Agent(name="travel", instructions=INSTRUCTIONS, tools=[get_weather], model=model,
                        model_settings=agents.ModelSettings(tool_choice=tool_choice, temperature=0, max_tokens=40,
                                                            **settings),
                        tool_use_behavior="stop_on_first_tool")


def client_model(base: str) -> str:
    import httpx

    return httpx.get(f"{base}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module", autouse=True)
def no_tracing():
    agents.set_tracing_disabled(True)


async def run(agent, streamed: bool) -> tuple[object, list[str]]:
    """The run's result and, streamed, the types of the events it sent."""
    if not streamed:
        return await agents.Runner.run(agent, QUESTION, max_turns=2), []
    result = agents.Runner.run_streamed(agent, QUESTION, max_turns=2)
    kinds = [event.type async for event in result.stream_events()]
    return result, kinds


@pytest.mark.parametrize("model_class", MODEL_CLASSES)
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
def test_agent_with_one_function_tool_calls_it_once_and_finishes(url, model_class, streamed, tool_choice):  # noqa: F811
    calls: list[str] = []
    agent = make_agent(url, model_class, tool_choice, calls)
    result, kinds = asyncio.run(run(agent, streamed))
    assert len(calls) == 1 and isinstance(calls[0], str) and calls[0]  # called once, with its one string argument
    assert result.final_output == f"18 C and clear in {calls[0]}"  # stop_on_first_tool: the tool's output
    items = [item.type for item in result.new_items]
    assert items == ["tool_call_item", "tool_call_output_item"]
    if streamed:
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        assert result.is_complete


def test_the_tool_result_goes_back_to_the_model_on_both_apis(url):  # noqa: F811
    """The SDK's default behaviour (run the model again on the tool's result, the forced choice reset): the second
    turn resends the call and its output (the whole history, or by previous_response_id) and ends in a message;
    both APIs render one prompt, so the greedy answers agree."""
    finals = {}
    for model_class, by_id in (("chat", False), ("responses", False), ("responses", True)):
        calls: list[str] = []
        agent = make_agent(url, model_class, "get_weather", calls)
        agent = agent.clone(tool_use_behavior="run_llm_again",
                            model_settings=agent.model_settings.resolve(agents.ModelSettings(max_tokens=120)))
        result = asyncio.run(agents.Runner.run(agent, QUESTION, max_turns=3, auto_previous_response_id=by_id))
        assert len(calls) == 1 and calls[0]
        assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item",
                                                            "message_output_item"]
        assert isinstance(result.final_output, str) and result.final_output
        finals[(model_class, by_id)] = result.final_output
    assert len(set(finals.values())) == 1, finals
