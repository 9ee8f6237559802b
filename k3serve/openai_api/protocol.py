"""The OpenAI HTTP protocol, shared by `k3serve serve`, the worker and the router.

Contents (no engine, torch or web-framework imports, so any component can use it):

* `ProtocolError` and `error_body()`: OpenAI-style errors
  ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status to send.
* Request models (pydantic, strict types, unknown fields ignored): `ChatCompletionRequest`,
  `CompletionRequest`, parsed from raw bytes by `parse_request()`, which turns every failure (bad
  JSON, wrong type, out-of-range value, bad tool schema) into a `ProtocolError` (400) naming the field.
* `sampling_kwargs()`: a request's generation settings as keyword arguments of
  `k3serve.sampling_params.SamplingParams` (plain dict; the caller builds the object).
* `resolve_max_tokens()`: the context-length check shared by every front end.
* Response builders (plain dicts in OpenAI's wire shape) and SSE framing (`sse_data`, `SSE_DONE`,
  `iter_sse_data`).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# ----------------------------------------------------------------------------------------------
# errors

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


def error_body(message: str, *, status_code: int = 400, param: str | None = None,
               err_type: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": message,
            "type": err_type or _ERROR_TYPES.get(status_code, "server_error"),
            "param": param,
            "code": code,
        }
    }


class ProtocolError(Exception):
    """A request the server rejects: `status_code` is the HTTP status, `body()` the JSON body."""

    def __init__(self, message: str, *, status_code: int = 400, param: str | None = None,
                 err_type: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.err_type = err_type
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, status_code=self.status_code, param=self.param,
                          err_type=self.err_type, code=self.code)


def model_not_found(model: str, available: Iterable[str]) -> ProtocolError:
    names = ", ".join(sorted(available)) or "(none)"
    return ProtocolError(f"The model `{model}` does not exist. Available models: {names}.",
                         status_code=404, param="model", code="model_not_found")


def _loc_str(loc: tuple) -> str:
    # Drop pydantic's union-member tags ("str", "list[int]", "function-after[...]") from the path.
    parts = [str(p) for p in loc if isinstance(p, int) or not re.search(r"[\[\]]|^(str|int|float|bool)$", str(p))]
    return ".".join(parts)


def validation_error_to_protocol(exc: ValidationError) -> ProtocolError:
    """The first error of a pydantic ValidationError as a 400 naming the field."""
    errors = exc.errors(include_url=False)
    if not errors:  # pragma: no cover - pydantic always reports at least one
        return ProtocolError("invalid request")
    err = errors[0]
    if err["type"] == "json_invalid":
        return ProtocolError(f"Request body is not valid JSON: {err['msg'].removeprefix('Invalid JSON: ')}")
    loc = _loc_str(tuple(err["loc"]))
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "missing":
        return ProtocolError(f"{loc}: field required", param=loc or None)
    if err["type"] == "model_type" and not loc:
        return ProtocolError("Request body must be a JSON object")
    if not loc:
        m = re.match(r"^([A-Za-z_][\w.]*): ", msg)
        return ProtocolError(msg, param=m.group(1) if m else None)
    return ProtocolError(f"{loc}: {msg}", param=loc)


# ----------------------------------------------------------------------------------------------
# request models

class _Model(BaseModel):
    # no NaN/Infinity literals: every float field has a finite range
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True, allow_inf_nan=False)


INT64_MAX = 2**63 - 1  # every integer field is bounded by it (the engine and sampler hold them in int64)
MAX_STOP_SEQUENCES = 4  # OpenAI's limit on `stop`
MAX_JSON_DEPTH = 64  # nesting of `tool_calls[].function.arguments` (parsed by the chat renderer)


def json_depth(text: str) -> int:
    """Deepest nesting of [ and { in JSON-ish `text`, ignoring brackets inside strings (no parsing, no
    recursion: the bound is checked before anything recursive sees the text)."""
    depth = deepest = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(depth - 1, 0)
    return deepest


_JSON_SCHEMA_TYPES = {"string", "number", "integer", "boolean", "null", "object", "array"}
_TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def check_json_schema(schema: Any, path: str = "parameters") -> None:
    """Structural check of a tool's JSON schema; raises ValueError naming the bad part.

    Checks what the renderer and parsers rely on: schemas are objects, `type` names are JSON types,
    `properties`/`$defs` map names to schemas, `required` lists strings, `items`/`anyOf`/... are
    schemas. (Not a full meta-schema validation.)
    """
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{path} must be a JSON schema object")
    t = schema.get("type")
    if t is not None:
        types = t if isinstance(t, list) else [t]
        for x in types:
            if not isinstance(x, str) or x not in _JSON_SCHEMA_TYPES:
                raise ValueError(f"{path}.type: {x!r} is not a JSON schema type")
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if key in schema:
            sub = schema[key]
            if not isinstance(sub, dict):
                raise ValueError(f"{path}.{key} must be an object")
            for name, s in sub.items():
                check_json_schema(s, f"{path}.{key}.{name}")
    if "required" in schema:
        req = schema["required"]
        if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
            raise ValueError(f"{path}.required must be an array of strings")
    if "items" in schema:
        items = schema["items"]
        for i, s in enumerate(items if isinstance(items, list) else [items]):
            check_json_schema(s, f"{path}.items" + (f".{i}" if isinstance(items, list) else ""))
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                raise ValueError(f"{path}.{key} must be a non-empty array of schemas")
            for i, s in enumerate(schema[key]):
                check_json_schema(s, f"{path}.{key}.{i}")
    if "additionalProperties" in schema:
        check_json_schema(schema["additionalProperties"], f"{path}.additionalProperties")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise ValueError(f"{path}.enum must be an array")


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _TOOL_NAME_RE.match(v):
            raise ValueError(f"invalid function name {v!r}: use 1-64 characters of a-z, A-Z, 0-9, _, - or .")
        return v

    @field_validator("parameters")
    @classmethod
    def _params(cls, v: dict | None) -> dict | None:
        if v is None:
            return v
        check_json_schema(v)
        if v.get("type", "object") != "object":
            raise ValueError("parameters.type must be 'object'")
        return v


class ToolDefinition(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: _FunctionName


class ToolCallFunction(_Model):
    name: str
    arguments: str = "{}"

    @field_validator("arguments")
    @classmethod
    def _depth(cls, v: str) -> str:
        if json_depth(v) > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        return v


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(_Model):
    type: str
    text: str | None = None
    model_config = ConfigDict(strict=True, extra="allow")


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if isinstance(self.content, list):
            for i, part in enumerate(self.content):
                if part.type not in ("text", "input_text"):
                    raise ValueError(f"content.{i}: content part type {part.type!r} is not supported "
                                     "by this server (only text)")
                if part.text is None:
                    raise ValueError(f"content.{i}.text: field required")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: required for role 'tool'")
        if self.role != "assistant" and self.tool_calls:
            raise ValueError("tool_calls: only assistant messages may carry tool calls")
        return self

    def text(self) -> str | None:
        """Content as one string (text parts joined), or None."""
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content)
        return self.content

    def to_plain(self) -> dict:
        """The message as a plain OpenAI dict with string content (what the chat renderer takes)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [tc.model_dump() for tc in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return out


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("json_schema: required when type is 'json_schema'")
            if "schema" not in self.json_schema:
                raise ValueError("json_schema.schema: required when type is 'json_schema'")
            if not isinstance(self.json_schema["schema"], dict | bool):
                raise ValueError("json_schema.schema: must be a JSON schema object")
            check_json_schema(self.json_schema["schema"], "json_schema.schema")
        return self

    def body(self) -> dict:
        """The body constraint as `StructuredOutputsParams` fields ({} for text)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema["schema"]}
        return {}


class StructuredOutputsRequest(_Model):
    """vLLM's `structured_outputs` request field: exactly one of json / json_object / regex / choice /
    grammar (EBNF). Unknown keys are an error, so an unsupported option never silently goes unenforced."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)
    backend: Literal["auto", "xgrammar"] | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputsRequest:
        set_ = [k for k, v in (("json", self.json_), ("json_object", self.json_object or None),
                               ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar))
                if v is not None]
        if len(set_) != 1:
            raise ValueError("exactly one of json, json_object, regex, choice, grammar must be set"
                             + (f" (got {', '.join(set_)})" if set_ else ""))
        if isinstance(self.json_, str):
            try:
                self.json_ = json.loads(self.json_)
            except ValueError as e:
                raise ValueError(f"json: not valid JSON ({e})") from None
        if self.json_ is not None:
            if not isinstance(self.json_, dict | bool):
                raise ValueError("json: must be a JSON schema object")
            check_json_schema(self.json_, "json")
        return self

    def body(self) -> dict:
        if self.json_ is not None:
            return {"json": self.json_}
        if self.json_object:
            return {"json_object": True}
        return {k: getattr(self, k) for k in ("regex", "choice", "grammar") if getattr(self, k) is not None}


class _GenerationFields(_Model):
    """Fields shared by chat and completions (OpenAI names plus vLLM's extensions)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's extension

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # Many clients send explicit nulls for fields they do not set; treat them as absent. (An explicit
        # null max_tokens keeps its meaning: no limit but the context.)
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in ("max_tokens", "max_completion_tokens")}
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(items)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, val in (v or {}).items():
            if not re.fullmatch(r"\d+", key):
                raise ValueError(f"key {key!r} is not a token id")
            if not -100.0 <= val <= 100.0:
                raise ValueError(f"bias {val} for token {key} is outside [-100, 100]")
        return v

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v):
        if v is not None and not v:
            raise ValueError("must be a non-empty string")
        return v

    @model_validator(mode="after")
    def _common(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("response_format and structured_outputs: send only one of them")
        return self

    def structured_body(self) -> dict:
        """The body constraint (`StructuredOutputsParams` fields) from response_format / structured_outputs."""
        if self.structured_outputs is not None:
            return self.structured_outputs.body()
        return self.response_format.body() if self.response_format is not None else {}

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `stream_options.continuous_usage_stats`: usage so far on every content chunk."""
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)


_CHAT_TEMPLATE_KWARGS = {"thinking", "enable_thinking", "reasoning_effort"}


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.tools is not None:
            names = [t.function.name for t in self.tools]
            dup = {n for n in names if names.count(n) > 1}
            if dup:
                raise ValueError(f"tools: duplicate function name {sorted(dup)[0]!r}")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice: function {self.tool_choice.function.name!r} is not "
                                 "among the declared tools")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice: 'required' needs at least one tool in tools")
        for key in self.chat_template_kwargs or {}:
            if key not in _CHAT_TEMPLATE_KWARGS:
                raise ValueError(f"chat_template_kwargs: unsupported key {key!r} "
                                 f"(supported: {', '.join(sorted(_CHAT_TEMPLATE_KWARGS))})")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def tool_choice_value(self) -> str | dict | None:
        """`tool_choice` as plain data ("auto"/"none"/"required", a named-function dict, or None)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice

    def render_kwargs(self) -> dict:
        """Keyword arguments for `render_chat(tokenizer, messages, **kw)` (everything but messages)."""
        ctk = dict(self.chat_template_kwargs or {})
        return {
            "tools": [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
            "tool_choice": self.tool_choice_value(),
            "thinking": ctk.get("thinking"),
            "enable_thinking": ctk.get("enable_thinking"),
            "reasoning_effort": self.reasoning_effort if self.reasoning_effort is not None
            else ctk.get("reasoning_effort"),
            "response_format": self.response_format.model_dump(exclude_none=True)
            if self.response_format else None,
        }

    def plain_messages(self) -> list[dict]:
        return [m.to_plain() for m in self.messages]


PromptInput = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_GenerationFields):
    prompt: Any
    max_tokens: int | None = Field(default=16, ge=1, le=INT64_MAX)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=None, ge=1, le=128)
    suffix: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        bad = ValueError("must be a string, an array of strings, an array of token ids, "
                         "or an array of token-id arrays")
        if isinstance(v, str):
            return v
        if not isinstance(v, list) or not v:
            raise ValueError("must not be empty") if v == [] else bad
        if all(isinstance(x, str) for x in v):
            return v
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return v
        if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
               for x in v):
            return v
        raise bad

    @model_validator(mode="after")
    def _completion(self) -> CompletionRequest:
        if self.suffix is not None:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: each item a text prompt or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


def parse_request(cls: type[_Model], raw: bytes | str | dict) -> Any:
    """Parse and validate a request body; raises ProtocolError (400) naming the problem."""
    try:
        if isinstance(raw, dict):
            return cls.model_validate(raw)
        return cls.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error_to_protocol(e) from None


# ----------------------------------------------------------------------------------------------
# request → sampling

def sampling_kwargs(req: _GenerationFields, *, max_tokens: int | None, chat: bool) -> dict:
    """Keyword arguments for SamplingParams; `max_tokens` is the resolved limit (resolve_max_tokens)."""
    kw: dict[str, Any] = {
        "n": req.n,
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "stop": req.stop_list(),
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "seed": req.seed,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        val = getattr(req, name)
        if val is not None:
            kw[name] = val
    if req.logit_bias:
        kw["logit_bias"] = {int(k): float(v) for k, v in req.logit_bias.items()}
    if chat:
        assert isinstance(req, ChatCompletionRequest)
        kw["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
        kw["skip_special_tokens"] = False
        kw["spaces_between_special_tokens"] = False
        so = chat_structured_outputs(req)
    else:
        assert isinstance(req, CompletionRequest)
        kw["logprobs"] = req.logprobs
        kw["skip_special_tokens"] = req.skip_special_tokens
        kw["spaces_between_special_tokens"] = req.spaces_between_special_tokens
        so = req.structured_body() or None
    if so is not None:
        kw["structured_outputs"] = so
    return kw


def chat_structured_outputs(req: ChatCompletionRequest) -> dict | None:
    """`StructuredOutputsParams` fields for a chat request, or None when nothing is enforced.

    Enforced (docs/serving.md "Structured outputs"): a response_format / structured_outputs body;
    tool_choice "required" or a named function (always); tools marked `strict` (under "auto" their
    calls follow their schemas, under "none" no call can be made). Plain "auto"/"none" without strict
    tools are left to the model and the parser.
    """
    from k3serve.chat.renderer import resolve_thinking  # lazy: the chat package imports no protocol

    body = req.structured_body()
    so: dict[str, Any] = dict(body)
    tools = [t.function.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice_value() or "auto"
    if tools:
        so.update(tools=tools, tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls is not False)
    enforce_tools = tools and (choice == "required" or isinstance(choice, dict)
                               or any(t.get("strict") for t in tools))
    if not body and not enforce_tools:
        return None
    rk = req.render_kwargs()  # the same thinking switches the renderer resolves
    try:
        thinking, _ = resolve_thinking(rk["thinking"], rk["enable_thinking"], rk["reasoning_effort"])
    except ValueError as e:
        raise ProtocolError(str(e)) from None
    so.update(k3_chat=True, thinking=thinking)
    return so


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int, *,
                       prompt_param: str = "messages", max_tokens_param: str = "max_tokens") -> int:
    """The generation limit for a prompt: `requested`, or what fits in the context when None.

    Raises ProtocolError (400) when the prompt leaves no room for one token or prompt + requested
    exceeds `max_model_len`.
    """
    if prompt_len + 1 > max_model_len:
        raise ProtocolError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for a completion. Please reduce the length of "
            "the prompt.", param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise ProtocolError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
            f"Please reduce the length of the prompt or of {max_tokens_param}.", param=max_tokens_param,
            code="context_length_exceeded")
    return requested


# ----------------------------------------------------------------------------------------------
# responses (plain dicts in the OpenAI wire shape)

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, *, cached_tokens: int | None = None,
          reasoning_tokens: int | None = None) -> dict:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def model_list(names: Iterable[str], *, max_model_len: int | None = None, owned_by: str = "k3serve",
               created: int | None = None) -> dict:
    created = now() if created is None else created
    data = []
    for name in names:
        card = {"id": name, "object": "model", "created": created, "owned_by": owned_by, "root": name}
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        data.append(card)
    return {"object": "list", "data": data}


def tool_call_dict(name: str, arguments: str, *, call_id: str | None = None, index: int | None = None) -> dict:
    out: dict[str, Any] = {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": name, "arguments": arguments}}
    if index is not None:
        out["index"] = index
    return out


def chat_choice(index: int, *, content: str | None, reasoning: str | None = None,
                tool_calls: list[dict] | None = None, finish_reason: str | None,
                stop_reason: int | str | None = None, logprobs: dict | None = None) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    message["tool_calls"] = tool_calls or []
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_response(rid: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_chunk(rid: str, created: int, model: str, choices: list[dict], *, usage_: dict | None = None,
               include_usage_field: bool = False) -> dict:
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": choices}
    if usage_ is not None or include_usage_field:
        out["usage"] = usage_
    return out


def chat_delta_choice(index: int, delta: dict, *, finish_reason: str | None = None,
                      stop_reason: int | str | None = None, logprobs: dict | None = None) -> dict:
    out: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        out["stop_reason"] = stop_reason
    return out


def completion_choice(index: int, text: str, *, finish_reason: str | None,
                      stop_reason: int | str | None = None, logprobs: dict | None = None) -> dict:
    out: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        out["stop_reason"] = stop_reason
    return out


def completion_response(rid: str, created: int, model: str, choices: list[dict], usage_: dict | None,
                        *, chunk: bool = False) -> dict:
    out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": choices}
    if usage_ is not None or not chunk:
        out["usage"] = usage_
    return out


# ----------------------------------------------------------------------------------------------
# SSE framing

SSE_DONE = "data: [DONE]\n\n"


def sse_data(obj: dict) -> str:
    """One server-sent event carrying `obj` as compact JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def iter_sse_data(lines: Iterable[str]) -> Iterator[dict]:
    """Decode an SSE stream (lines without their newlines) into the JSON objects of its `data:` events.

    Stops at `data: [DONE]`; multi-line `data:` fields are joined with newlines as the SSE spec says.
    """
    buf: list[str] = []
    for line in lines:
        if line == "":
            if buf:
                payload = "\n".join(buf)
                buf = []
                if payload == "[DONE]":
                    return
                yield json.loads(payload)
            continue
        if line.startswith(":"):
            continue
        if line.startswith("data:"):
            buf.append(line[5:].removeprefix(" "))
    if buf and "\n".join(buf) != "[DONE]":
        yield json.loads("\n".join(buf))
