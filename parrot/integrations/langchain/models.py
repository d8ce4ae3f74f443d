"""LangChain models served by Parrot: :class:`ParrotLLM` (a ``BaseLLM``) and :class:`ChatParrot` (a
``BaseChatModel``).

Used alone (``llm.invoke("...")``, or inside a chain that is not compiled) each call is one request: with
``api="openai"`` (default) to the server's ``/v1/completions`` / ``/v1/chat/completions``, with ``api="parrot"``
as one semantic call ``{{input:prompt}}{{output:text}}`` in a fresh session. Inside a chain passed to
:func:`~parrot.integrations.langchain.compile_chain` the model is not called: the compiler turns each
``prompt | model`` step into a semantic function built from the same fields (:meth:`ParrotModelParams.sampling`).

Sampling: ``temperature``, ``max_tokens``, ``top_p``, ``stop``, ``seed`` are fields; ``invoke(..., **kwargs)`` /
``.bind(...)`` may set any :class:`~parrot.common.sampling.SamplingParams` field (``top_k``, ``min_tokens``,
``repetition_penalty``, ...); an unknown one raises ``BadSamplingParams`` naming it. ``temperature=0`` is greedy.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, BaseLLM
from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatResult, Generation, LLMResult
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from parrot.common.errors import BadSamplingParams, InvalidRequestError
from parrot.common.sampling import SamplingParams
from parrot.frontend.client import DEFAULT_URL
from parrot.frontend.client import _raise_for as raise_for

_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# what the OpenAI-compatible routes take besides max_tokens / temperature / top_p / stop / seed (vLLM's extras)
_OPENAI_EXTRAS = frozenset({"top_k", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
                            "ignore_eos", "stop_token_ids"})
_ROLES: dict[type, str] = {HumanMessage: "user", AIMessage: "assistant", SystemMessage: "system"}


@dataclass(frozen=True)
class ServerModel:
    """What the compiler needs to know about the served model: its id and chat template (``/tokenizer_info``)."""

    model: str
    chat_template: str | None
    bos_token: str
    eos_token: str


def message_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as the chat template's ``{"role", "content"}`` dicts. Only text messages of the
    roles system / user / assistant (or a ChatMessage's own role) are supported; anything else is an
    InvalidRequestError naming the message."""
    out = []
    for i, m in enumerate(messages):
        role = m.role if isinstance(m, ChatMessage) else _ROLES.get(type(m))
        if role is None or not isinstance(m.content, str):
            raise InvalidRequestError(f"message {i} ({type(m).__name__}) is not a text system / human / ai message; "
                                      "Parrot renders only those", param=f"messages[{i}]")
        out.append({"role": role, "content": m.content})
    return out


class ParrotModelParams(BaseModel):
    """Connection and sampling fields shared by :class:`ParrotLLM` and :class:`ChatParrot`."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    base_url: str = Field(default_factory=lambda: os.environ.get("PARROT_URL", DEFAULT_URL))
    api_key: SecretStr | None = Field(default_factory=lambda: (SecretStr(os.environ["PARROT_API_KEY"])
                                                               if os.environ.get("PARROT_API_KEY") else None))
    model: str | None = None  # None: the one model the server serves
    api: Literal["openai", "parrot"] = "openai"  # how a call outside a compiled chain is sent
    temperature: float = 0.7  # langchain-openai's OpenAI default
    max_tokens: int = 256
    top_p: float = 1.0
    stop: list[str] | None = None
    seed: int | None = None
    timeout_s: float = 600.0
    _server: ServerModel | None = PrivateAttr(default=None)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key.get_secret_value()}"} if self.api_key else {}

    def _http(self, method: str, path: str, **kwargs: Any) -> dict:
        resp = httpx.request(method, self.url + path, headers=self._headers(), timeout=self.timeout_s, **kwargs)
        raise_for(resp)  # a non-2xx answer as its typed error
        return resp.json()

    def server_model(self) -> ServerModel:
        """The served model's id and chat template (asked once per model object)."""
        if self._server is None:
            model = self.model or self._http("GET", "/v1/models")["data"][0]["id"]
            info = self._http("GET", "/tokenizer_info", params={"model": model})
            self._server = ServerModel(model, info.get("chat_template"), info.get("bos_token") or "",
                                       info.get("eos_token") or "")
        return self._server

    def sampling(self, stop: Sequence[str] | None = None, **kwargs: Any) -> SamplingParams:
        """This model's sampling with per-call ``kwargs`` over the fields (``stop`` wins over both)."""
        unknown = sorted(set(kwargs) - _SAMPLING_FIELDS)
        if unknown:
            raise BadSamplingParams(f"{type(self).__name__}: unknown sampling argument(s) {unknown} "
                                    f"(known: {sorted(_SAMPLING_FIELDS)})", param=unknown[0])
        fields: dict[str, Any] = {"temperature": self.temperature, "max_tokens": self.max_tokens, "top_p": self.top_p,
                                  "stop": list(self.stop or []), "seed": self.seed}
        fields.update(kwargs)
        if stop is not None:
            fields["stop"] = list(stop)
        return SamplingParams(**fields)

    def _openai_body(self, sampling: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.server_model().model, "max_tokens": sampling.max_tokens,
                                "temperature": sampling.temperature, "top_p": sampling.top_p,
                                "stop": list(sampling.stop) or None}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        defaults = SamplingParams()
        body.update({k: getattr(sampling, k) for k in _OPENAI_EXTRAS if getattr(sampling, k) != getattr(defaults, k)})
        return body

    def _parrot_generate(self, prompts: Sequence[str], sampling: SamplingParams) -> list[str]:
        """One semantic call ``{{input:prompt}}{{output:text}}`` per prompt, all submitted before any is read."""
        from parrot.frontend.client import Session
        from parrot.frontend.function import Output, SemanticFunction

        call = SemanticFunction("{{input:prompt}}{{output:text}}", name=f"{self._llm_type}_call",
                                defaults=Output(**dataclasses.asdict(sampling)),
                                models=[self.model] if self.model else ())
        with Session(self.url, self.api_key.get_secret_value() if self.api_key else None) as session:
            outs = [call(p, session=session) for p in prompts]
            return [o.get() for o in outs]

    @property
    def _identifying_params(self) -> Mapping[str, Any]:
        return {"base_url": self.base_url, "model": self.model, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "top_p": self.top_p, "stop": self.stop, "seed": self.seed}


class ParrotLLM(ParrotModelParams, BaseLLM):
    """A text-completion LangChain model on a Parrot server (see the module docstring)."""

    @property
    def _llm_type(self) -> str:
        return "parrot"

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        sampling = self.sampling(stop, **kwargs)
        if self.api == "parrot":
            texts = self._parrot_generate(prompts, sampling)
            return LLMResult(generations=[[Generation(text=t)] for t in texts])
        answer = self._http("POST", "/v1/completions", json={**self._openai_body(sampling), "prompt": prompts})
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        return LLMResult(generations=[[Generation(text=c["text"], generation_info={"finish_reason":
                                                                                   c.get("finish_reason")})]
                                      for c in choices],
                         llm_output={"token_usage": answer.get("usage", {}), "model_name": answer.get("model")})


class ChatParrot(ParrotModelParams, BaseChatModel):
    """A chat LangChain model on a Parrot server: messages are rendered with the served model's chat template
    (by the server for ``api="openai"``, by :func:`render_chat` for the Parrot API and compiled chains)."""

    @property
    def _llm_type(self) -> str:
        return "parrot-chat"

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        sampling = self.sampling(stop, **kwargs)
        if self.api == "parrot":
            (text,) = self._parrot_generate([render_chat(self.server_model(), message_dicts(messages))], sampling)
            return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text))])
        answer = self._http("POST", "/v1/chat/completions",
                            json={**self._openai_body(sampling), "messages": message_dicts(messages)})
        choice = answer["choices"][0]
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=choice["message"]["content"] or ""),
                                                      generation_info={"finish_reason": choice.get("finish_reason")})],
                          llm_output={"token_usage": answer.get("usage", {}), "model_name": answer.get("model")})


def render_chat(server: ServerModel, messages: list[dict[str, str]]) -> str:
    """The prompt text the server's chat path would build for ``messages`` (same renderer, same template)."""
    from parrot.manager.chat_template import ChatRenderer

    return ChatRenderer().render(server.chat_template, messages, bos_token=server.bos_token,
                                 eos_token=server.eos_token, add_generation_prompt=True)
