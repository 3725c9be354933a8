"""The OpenAI API's request bodies, and what each field means to the engine.

`/v1/completions` and `/v1/chat/completions` bodies are pydantic models that forbid
unknown fields, so a field the server does not know is a 400 naming it, never ignored.
Fields the API defines but this engine does not implement (`logit_bias`, `echo`,
`suffix`, `tools`, ...) are declared so that sending one is refused by name too.
`sampling_params()` maps a body onto `SamplingParams` (vLLM's names): the OpenAI
fields, vLLM's extensions (`top_k`, `min_p`, `ignore_eos`, `min_tokens`,
`stop_token_ids`, `repetition_penalty`, `structured_outputs` and the older `guided_*`)
and ours (`so_args`); `response_format` (`json_object`, `json_schema`) becomes a JSON
grammar. A value SamplingParams refuses is a 400 naming the request's field.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.sampling_params import SamplingParams


class OpenAIError(Exception):
    """An error answered in the OpenAI shape: {"error": {"message", "type", "param"}}."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchema(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None


# Request field -> the `so_args` schema_type it means (response_format is mapped apart).
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "ebnf"}
_GUIDED_CHOICE = "guided_choice"
# Declared so that a client sending one hears it is not supported, by name.
_REFUSED = ("logit_bias", "tools", "functions", "function_call", "suffix")


class _SamplingBody(_Body):
    """The fields both endpoints share."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    so_args: dict[str, Any] | None = None
    priority: int = 0
    user: str | None = None  # the end user's id: for the client's records, unused here
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    suffix: str | None = None

    def _max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> tuple[int | None, str]:
        return None, "logprobs"

    def sampling_params(self) -> SamplingParams:
        """The SamplingParams this body asks for; OpenAIError naming the field when a
        value is refused."""
        for name in _REFUSED:
            if getattr(self, name) not in (None, [], {}):
                raise OpenAIError(f"{name}: not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options: only allowed with stream=true", "stream_options")
        max_tokens, max_name = self._max_tokens()
        logprobs, logprobs_name = self._logprobs()
        so_args, so_name = self._so_args()
        values: dict[str, Any] = {
            "n": self.n,
            "best_of": self.best_of,
            "max_tokens": max_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
            "so_args": so_args,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        names = {"max_tokens": max_name, "logprobs": logprobs_name, "so_args": so_name}
        try:
            return SamplingParams(**values)
        except ValueError as e:
            raise field_error(e, names) from None

    def structured_field(self) -> str | None:
        """The field that asks for a structured output (response_format json_*,
        structured_outputs, guided_*, so_args), or None."""
        so_args, name = self._so_args()
        return name if so_args is not None else None

    def _so_args(self) -> tuple[dict[str, Any] | None, str]:
        given: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"schema_type": "json", "schema": {"type": "object"}}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise OpenAIError(
                    "response_format.json_schema.schema: required with type json_schema",
                    "response_format",
                )
            if rf.json_schema.strict is False:  # (its grammar cannot be followed loosely)
                raise OpenAIError(
                    "response_format.json_schema.strict: false is not supported; the "
                    "output always follows the schema (strict)",
                    "response_format",
                )
            given.append(
                ("response_format", {"schema_type": "json", "schema": rf.json_schema.schema_})
            )
        so = self.structured_outputs
        if so is not None:
            kinds = [
                (k, v)
                for k, v in (
                    ("json", so.json_),
                    ("regex", so.regex),
                    ("ebnf", so.grammar),
                    ("choice", so.choice),
                )
                if v is not None
            ]
            if len(kinds) != 1:
                raise OpenAIError(
                    "structured_outputs: give exactly one of json, regex, grammar, choice",
                    "structured_outputs",
                )
            given.append(
                ("structured_outputs", {"schema_type": kinds[0][0], "schema": kinds[0][1]})
            )
        for name, kind in _GUIDED.items():
            if getattr(self, name) is not None:
                given.append((name, {"schema_type": kind, "schema": getattr(self, name)}))
        if self.guided_choice is not None:
            given.append((_GUIDED_CHOICE, {"schema_type": "choice", "schema": self.guided_choice}))
        if self.so_args is not None:
            given.append(("so_args", self.so_args))
        if len(given) > 1:
            names = ", ".join(n for n, _ in given)
            raise OpenAIError(f"{names}: one structured-output constraint at most", given[1][0])
        return (given[0][1], given[0][0]) if given else (None, "so_args")


def field_error(e: ValueError, names: dict[str, str] | None = None) -> OpenAIError:
    """A `SamplingParams.FIELD...` error as the request's field names it (`names`: the
    SamplingParams field -> the request's, where they differ)."""
    text = str(e)
    m = re.match(r"SamplingParams\.(\w+)", text)
    field = m.group(1) if m else None
    param = (names or {}).get(field, field) if field else None
    if m and param:
        text = param + text[m.end() :]
    return OpenAIError(text, param)


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # (the OpenAI API's default for completions)
    logprobs: int | None = None
    echo: bool = False

    def _logprobs(self) -> tuple[int | None, str]:
        return self.logprobs, "logprobs"

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the body: one text or token-id list, or a batch of them."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError("prompt: empty", "prompt")
        if all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise OpenAIError("echo: not supported by this server", "echo")
        return super().sampling_params()


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def _max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None and self.max_tokens is not None:
            raise OpenAIError(
                "max_tokens and max_completion_tokens: one limit under two names; give one",
                "max_completion_tokens",
            )
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> tuple[int | None, str]:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs: needs logprobs=true", "top_logprobs")
        if not self.logprobs:
            return None, "logprobs"
        return (self.top_logprobs or 0), "top_logprobs"

    def sampling_params(self) -> SamplingParams:
        if self.tool_choice not in (None, "none"):
            raise OpenAIError("tool_choice: tools are not supported by this server", "tool_choice")
        if self.parallel_tool_calls:
            raise OpenAIError("parallel_tool_calls: tools are not supported", "parallel_tool_calls")
        if self.continue_final_message and self.add_generation_prompt:
            raise OpenAIError(
                "continue_final_message: needs add_generation_prompt=false",
                "continue_final_message",
            )
        if not self.messages:
            raise OpenAIError("messages: empty", "messages")
        return super().sampling_params()


def validation_error(e: Any) -> OpenAIError:
    """A pydantic ValidationError as one line naming the first field at fault."""
    errors = e.errors()
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"]) or "body"
    if first["type"] == "extra_forbidden":
        message = f"{loc}: unknown field"
    else:
        message = f"{loc}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more)"
    param = str(first["loc"][0]) if first["loc"] else None
    return OpenAIError(message, param)
