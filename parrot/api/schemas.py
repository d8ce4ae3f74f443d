"""Request/response models of the HTTP APIs (docs/api.md, "Request fields").

Unknown fields: the Parrot API rejects them (400 naming them). The OpenAI-compatible requests (completions, chat,
responses) follow vLLM: the unknown fields are named in one warning per request and dropped (:class:`_Lenient`),
so a client sending a newer or another server's field still gets its answer, and nothing of it reaches the reply.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

logger = logging.getLogger(__name__)

MAX_NAME_CHARS = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    """Base of the OpenAI-compatible request bodies: unknown top-level fields are logged (one warning naming them
    all) and dropped, as vLLM does; known fields are validated as usual (nested objects stay strict)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _drop_unknown(self) -> _Lenient:
        extra = self.__pydantic_extra__
        if extra:
            logger.warning("%s: ignoring unknown field(s) %s", type(self).__name__, ", ".join(sorted(extra)))
            extra.clear()
        return self


# ---- Parrot API ---------------------------------------------------------------------------------------------
class CreateSessionRequest(_Strict):
    ttl_s: float | None = Field(None, gt=0, description="idle seconds before the session expires")


class SessionResponse(BaseModel):
    session_id: str
    token: str
    ttl_s: float


class DeletedResponse(BaseModel):
    deleted: bool


class ToolDeclModel(_Strict):
    """The variable is the output of a tool call the client makes on ``inputs`` (LAMPS): the generates producing
    those inputs pause their contexts for it instead of freeing them."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="the tool's name (its durations are learned "
                      "per name)")
    inputs: list[str] = Field(default_factory=list, max_length=64, description="var ids the tool reads")
    expected_duration_s: float | None = Field(None, gt=0, description="the client's guess of the tool's duration, "
                                              "used until the server has observed the tool")


class CreateVariableRequest(_Strict):
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    value: str | None = None
    tool: ToolDeclModel | None = None


class SetVariableRequest(_Strict):
    value: str


class VariableResponse(BaseModel):
    var_id: str
    name: str | None
    status: Literal["pending", "ready"]
    value: str | None


class PlaceholderModel(_Strict):
    name: str = Field(max_length=MAX_NAME_CHARS)
    is_output: bool
    var_id: str | None = None
    sampling: dict[str, Any] | None = Field(None, description="parrot.common.sampling.SamplingParams fields")
    transforms: list[dict[str, Any]] = Field(default_factory=list, description="declarative ops, in order")


class SubmitRequest(_Strict):
    prompt: str
    placeholders: list[PlaceholderModel] = Field(max_length=256)
    models: list[str] = Field(default_factory=list, max_length=16)
    name: str | None = Field(None, max_length=MAX_NAME_CHARS, description="function name shown in DAG dumps")


class SubmitResponse(BaseModel):
    request_id: str
    outputs: dict[str, str]  # output placeholder name -> var_id


class SubmitFlowResponse(BaseModel):
    flow_id: str
    outputs: dict[str, str]  # exported scope name -> var_id


class FlowStatusResponse(BaseModel):
    flow_id: str
    name: str
    status: str  # running | finished | failed
    outputs: dict[str, str]
    events: list[dict[str, Any]]
    error: dict[str, Any] | None = None


class ToolCallModel(BaseModel):
    call_id: str  # the variable to PUT the answer into
    tool: str
    args: dict[str, str]
    flow_id: str


class ToolCallsResponse(BaseModel):
    calls: list[ToolCallModel]


class ToolCallErrorRequest(_Strict):
    message: str = Field(max_length=10_000, description="why the tool failed (the flow sees it)")


class DagResponse(BaseModel):
    requests: list[dict[str, Any]]
    variables: list[dict[str, Any]]
    text: str


class HealthResponse(BaseModel):
    status: Literal["ok"]
    engines: list[dict[str, Any]]


# ---- OpenAI-compatible API ------------------------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM: usage (so far) on every streamed chunk")


class JsonSchemaFormat(_Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (with ``json_schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: one of its fields."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _SamplingRequest(_Lenient):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras; docs/api.md "Request
    fields" says which are honoured, which only recorded and which refused)."""

    model: str
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = Field(None, description="default 1.0 (OpenAI)")
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100] added to its logit")
    # recorded, change nothing here: metadata / store (nothing is stored), service_tier (one tier), user,
    # reasoning_effort (not passed to the template; Qwen3's thinking is chat_template_kwargs' enable_thinking)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, description="-1 or 0 disables")
    min_p: float | None = Field(None, description="drop tokens below min_p x the top token's probability")
    bad_words: list[str] | None = Field(None, description="words that must not be generated")
    skip_special_tokens: bool = Field(False, description="leave special tokens out of the text (default: kept)")
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, description="logprobs of each prompt token and this many alternatives")
    truncate_prompt_tokens: int | None = Field(None, description="keep only the prompt's last N tokens (-1: the "
                                               "model's window)")
    priority: int = Field(0, description="lower is served earlier (vLLM)")
    request_id: str | None = Field(None, min_length=1, max_length=128, description="the response's id")
    return_tokens_as_token_ids: bool = Field(False, description="logprobs tokens as 'token_id:N'")
    cache_salt: str | None = None  # recorded: the prefix cache is not salted here (results are the same)
    length_penalty: float | None = None  # recorded: it only affects beam search
    use_beam_search: bool = False  # true is refused (no beam search)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # structured output (at most one per request; docs/api.md): OpenAI's response_format, vLLM's guided_* and
    # structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo (score the prompt, generate nothing)")
    echo: bool = False
    logprobs: int | None = Field(None, description="0..20: logprob of each token plus this many alternatives")
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or any(isinstance(x, list) and not x for x in v)):
            raise ValueError("prompt must not be an empty list")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str = Field(description="JSON text of the arguments object")


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="assistant: the calls it made")
    tool_call_id: str | None = Field(None, description="tool: the call this message answers")
    refusal: str | None = None  # accepted (an assistant message copied from an answer), not rendered


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments object")
    strict: bool | None = None  # accepted; a forced call is always held to the schema


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: up to the context window")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat template controls
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables of the chat template")
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="continue the last (assistant) message, left open")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "parrot"
    max_model_len: int
    # per engine serving the model: how it computes (CPU model and family, CPU path, dtypes, matmul kernels)
    numerics: dict[str, dict] = Field(default_factory=dict)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- OpenAI Responses API (text and function tools) -----------------------------------------------------------
class ResponsesRequest(_Lenient):
    """``POST /v1/responses``. The fields after ``metadata`` are accepted only at values that ask for nothing
    this server lacks (400 naming the field otherwise); unknown fields are warned about and ignored, as on the
    other OpenAI endpoints (:class:`_Lenient`)."""

    model: str
    input: str | list[dict[str, Any]] = Field(description="text, or items: messages (input_text / output_text "
                                              "parts), function_call, function_call_output")
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, description="default 1.0 (OpenAI)")
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    stream_options: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128, description="function tools, flat: {type: "
                                               "function, name, description, parameters, strict}")
    tool_choice: str | dict[str, Any] | None = Field(None, description='"none" | "auto" | "required" | '
                                                     '{type: "function", name}')
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    service_tier: str | None = None


# ---- tokenizer endpoints (vLLM's shapes) ----------------------------------------------------------------------
class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = Field(True, description="add BOS when the model adds one (as completions do)")
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant turn's opening")
    continue_final_message: bool = Field(False, description="messages: the last message left open (as in chat)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="messages: extra template variables")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
