"""SamplingParams: per-request generation settings (vLLM-compatible field names)."""

from __future__ import annotations

import copy
import json as _json
from dataclasses import asdict, dataclass, field
from typing import Any


class SamplingParamsError(ValueError):
    """Invalid sampling parameters; the message names the field and the rule."""


_TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class StructuredOutputsParams:
    """What constrains a request's output (vLLM's `structured_outputs` names), as plain data.

    Body constraint, at most one of: `json` (a JSON schema, dict or JSON text; strict: no extra
    properties), `json_object` (any JSON object), `regex`, `choice` (one of these strings exactly),
    `grammar` (EBNF in XGrammar's dialect). Enforced by k3serve.workers.structured (docs/serving.md
    "Structured outputs").

    `k3_chat`: the output is a K3 assistant turn (set by the chat front end). The constraint then
    covers the XTML envelope (docs/chat-format.md section 4): with `thinking` the think channel is
    free text up to its close marker, then the response body follows the body constraint (free text
    when none), then the response close, the tools channel per `tool_choice` ("none", "auto",
    "required" or {"type": "function", "function": {"name": N}}) over `tools` (OpenAI function dicts:
    name, parameters, strict), and the message close and end of turn. Without `k3_chat` the whole
    output follows the body constraint, then the end of turn.
    """

    json: dict | bool | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    k3_chat: bool = False
    thinking: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise SamplingParamsError(f"structured_outputs.json: not valid JSON ({e})") from None
        self.validate()

    @classmethod
    def from_value(cls, value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams | None:
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise SamplingParamsError(f"structured_outputs: must be an object (got {type(value).__name__})")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise SamplingParamsError(f"structured_outputs: unknown field(s) {sorted(unknown)}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable) with only the fields that differ from the defaults."""
        default = StructuredOutputsParams()
        return {k: v for k, v in asdict(self).items() if v != getattr(default, k)}

    @property
    def body_kind(self) -> str | None:
        """Which body constraint is set: "json", "json_object", "regex", "choice", "grammar" or None."""
        kinds = self._body_kinds()
        return kinds[0] if kinds else None

    def _body_kinds(self) -> list[str]:
        return [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None] + (
            ["json_object"] if self.json_object else [])

    def tool_name(self) -> str | None:
        """The forced function's name for a named `tool_choice`, else None."""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return None

    @property
    def constrains(self) -> bool:
        """Whether a grammar applies: a body constraint, or (chat) a tool choice or strict tool to enforce."""
        if self.body_kind is not None:
            return True
        if not self.k3_chat or not self.tools:
            return False
        if self.tool_choice == "required" or self.tool_name() is not None:
            return True
        return any(t.get("strict") for t in self.tools)

    def validate(self) -> None:
        def bad(name: str, rule: str) -> None:
            raise SamplingParamsError(f"structured_outputs.{name}: {rule}")

        kinds = self._body_kinds()
        if len(kinds) > 1:
            bad(kinds[1], f"only one of json, json_object, regex, choice, grammar may be set (got {kinds})")
        if self.json is not None and not isinstance(self.json, dict | bool):
            bad("json", "must be a JSON schema object")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                bad(name, "must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            bad("choice", "must be a non-empty list of strings")
        if self.tools is not None:
            if not self.k3_chat:
                bad("tools", "only chat requests can constrain tool calls")
            if not isinstance(self.tools, list) or not all(
                    isinstance(t, dict) and isinstance(t.get("name"), str) for t in self.tools):
                bad("tools", "must be a list of function objects with a name")
        tc = self.tool_choice
        if isinstance(tc, dict):
            name = (tc.get("function") or {}).get("name") if isinstance(tc.get("function"), dict) else None
            if tc.get("type", "function") != "function" or not isinstance(name, str):
                bad("tool_choice", 'a named choice is {"type": "function", "function": {"name": NAME}}')
            if name not in {t["name"] for t in self.tools or []}:
                bad("tool_choice", f"function {name!r} is not among the tools")
        elif tc not in _TOOL_CHOICES:
            bad("tool_choice", f"must be one of {list(_TOOL_CHOICES)} or a named function (got {tc!r})")
        elif tc == "required" and not self.tools:
            bad("tool_choice", "'required' needs at least one tool")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0 = only the chosen)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # dict accepted (converted)

    def __post_init__(self) -> None:
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, rule: str) -> None:
            raise SamplingParamsError(f"{name}: {rule} (got {getattr(self, name)!r})")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be 0/-1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be a positive integer")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", "must be <= max_tokens")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", "must be an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if self.logit_bias:
            for k, v in self.logit_bias.items():
                if not isinstance(k, int) or not -100.0 <= float(v) <= 100.0:
                    bad("logit_bias", "keys must be token ids and values in [-100, 100]")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
            if self.ignore_eos and self.structured_outputs.constrains:
                bad("ignore_eos", "cannot be combined with structured outputs (a constrained output ends "
                    "with the end of turn)")
            if self.min_tokens and self.structured_outputs.constrains:
                bad("min_tokens", "cannot be combined with structured outputs (the grammar decides where "
                    "the output ends)")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
