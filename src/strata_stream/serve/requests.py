"""The request bodies of the OpenAI endpoints, parsed and validated into typed objects.

Bodies are read raw and validated here rather than by FastAPI, so that malformed JSON and
invalid fields come back as OpenAI-style 400 errors naming the offending parameter."""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from strata_stream.serve.errors import APIError, bad_request

# Upper bounds of counts no model reaches (a context of 2**31 tokens), so that no value a client
# sends overflows the integers of a sampler or a cache.
MAX_TOKENS = 2**31 - 1
# Each generated token is matched against the stop sequences (serve/stop.py): their length
# is what every token of the request costs the worker the batch shares.
MAX_STOP_CHARS = 4096
MAX_STOPS = 4
MAX_PROMPTS = 64
REPETITION_PENALTY_MIN = 0.01
REPETITION_PENALTY_MAX = 100.0


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Generation(BaseModel):
    # OpenAI clients send fields this server does not use (user, ...): ignore them.
    # Numbers must be finite (JSON's NaN and Infinity extensions are refused by name), a seed
    # must fit the 64 bits a sampler key holds (unsigned: MLX's key and torch's generator take
    # 0..2**64-1), and every bound keeps the sampler's arithmetic finite: a field out of range
    # is a 400 naming it, never a failure inside the batch. top_k is also checked against the
    # model's vocabulary (app.py), which this model does not know.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # mlx-lm server extensions.
    top_k: int = Field(default=0, ge=0, le=MAX_TOKENS)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    # 0 is off (as is 1). Logits are divided or multiplied by it: beyond these bounds a
    # logit overflows to infinity and the row's probabilities become NaN.
    repetition_penalty: float = Field(default=0.0, ge=0.0, le=REPETITION_PENALTY_MAX)

    @field_validator("repetition_penalty")
    @classmethod
    def _penalty_range(cls, p: float) -> float:
        if p != 0 and p < REPETITION_PENALTY_MIN:
            raise ValueError(
                f"must be 0 (off) or between {REPETITION_PENALTY_MIN} and {REPETITION_PENALTY_MAX}"
            )
        return p

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        longest = max(map(len, [stop] if isinstance(stop, str) else stop or []), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop sequence is at most {MAX_STOP_CHARS} characters")
        return stop

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    arguments: str = "{}"  # the JSON text of the arguments object, as the API sends it


class ToolCallItem(BaseModel):
    """One call of an assistant turn the client sends back."""

    model_config = ConfigDict(extra="ignore")

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")  # strict, ... go to the template as sent

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


MAX_TOOLS = 512


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolSpec] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request(
                "Invalid value for 'top_logprobs': it needs logprobs: true",
                param="top_logprobs", code="invalid_value",
            )  # fmt: skip
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise bad_request(
                    f"Invalid value for 'tool_choice': no tool is named "
                    f"{self.tool_choice.function.name!r}",
                    param="tool_choice", code="invalid_value",
                )  # fmt: skip
        elif self.tool_choice == "required" and not self.tools:
            raise bad_request(
                "Invalid value for 'tool_choice': 'required' needs tools",
                param="tool_choice", code="invalid_value",
            )  # fmt: skip
        for i, m in enumerate(self.messages):
            for j, call in enumerate(m.tool_calls or []):
                try:
                    args = json.loads(call.function.arguments or "{}")
                except json.JSONDecodeError as e:
                    args, why = None, f"not JSON ({e})"
                else:
                    why = "not a JSON object"
                if not isinstance(args, dict):
                    at = f"messages.{i}.tool_calls.{j}.function.arguments"
                    raise bad_request(
                        f"Invalid value for '{at}': {why}", param=at, code="invalid_value"
                    )

    def tool_specs(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them; None without tools or with
        tool_choice "none" (the model is not told of them)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat templates read it: an assistant turn's calls with their
        arguments as objects, a tool turn with its call's id (and name, where known)."""
        names: dict[str, str] = {}
        out: list[dict[str, Any]] = []
        for m in self.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                msg["tool_calls"] = []
                for call in m.tool_calls:
                    names[call.id] = call.function.name
                    msg["tool_calls"].append({
                        "id": call.id,
                        "type": "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": json.loads(call.function.arguments or "{}"),
                        },
                    })  # fmt: skip
            if m.role == "tool":
                msg["tool_call_id"] = m.tool_call_id or ""
                name = m.name or names.get(m.tool_call_id or "")
                if name:
                    msg["name"] = name
            out.append(msg)
        return out

    def top(self) -> int | None:
        """How many alternatives each token reports; None when logprobs are not asked."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Generation):
    # A string, token ids, or a list of either (one choice per prompt, index in order).
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 is allowed with echo: the prompt's log-probabilities alone (checked below).
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _some_prompt(
        cls, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt list is empty")
        # A list of prompts (strings or token-id lists) holds at most 64; a list of ints is
        # one prompt's token ids, bounded by the context instead (app.py).
        several = isinstance(prompt, list) and not isinstance(prompt[0], int)
        if several and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return prompt

    def check(self) -> None:
        if self.max_tokens == 0 and not self.echo:
            raise bad_request(
                "Invalid value for 'max_tokens': 0 is allowed only with echo: true",
                param="max_tokens", code="invalid_value",
            )  # fmt: skip
        if self.stream and self.echo:
            raise bad_request(
                "Invalid value for 'echo': echo is answered whole, not streamed",
                param="echo", code="invalid_value",
            )  # fmt: skip
        if self.stream and len(self.prompts()) > 1:
            raise bad_request(
                "Invalid value for 'prompt': streaming takes one prompt per request",
                param="prompt", code="invalid_value",
            )  # fmt: skip

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [[int(t) for t in p]]
        return list(p)

    def token_budget(self) -> int | None:
        return self.max_tokens


R = TypeVar("R", bound=BaseModel)


def parse_body(cls: type[R], raw: bytes) -> R:
    """The body validated as `cls`; a 400 naming the field for anything else. Blocking (a
    large body takes a while): the routes call it off the event loop."""
    return validate_body(cls, load_body(raw))


def load_body(raw: bytes) -> dict[str, Any]:
    """The body's JSON object. Nesting too deep to parse, and strings that are not Unicode
    text (a lone surrogate, escaped as "\\ud800" or in raw bytes: no tokenizer can encode
    it), are 400s."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object", code="invalid_json")
    # A surrogate comes from an escape, or from its UTF-8-like bytes (0xED 0xA0..0xBF), which
    # json.loads lets through: look only where one may be.
    if (b"\\u" in raw or b"\xed" in raw) and (at := _surrogate_at(body)) is not None:
        raise bad_request(
            f"Invalid value for '{at}': the string holds a lone UTF-16 surrogate, not text",
            param=at, code="invalid_value",
        )  # fmt: skip
    return body


def validate_body(cls: type[R], body: dict[str, Any]) -> R:
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None


def _surrogate_at(body: Any) -> str | None:
    """The path (a.0.b) of the first string, key or value, that is not encodable text."""
    todo: list[tuple[Any, str]] = [(body, "")]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or None
        elif isinstance(value, dict):
            for k, v in value.items():
                at = f"{path}.{k}" if path else str(k)
                todo.append((k, at))
                todo.append((v, at))
        elif isinstance(value, list):
            todo.extend((v, f"{path}.{i}") for i, v in reversed(list(enumerate(value))))
    return None


def _validation_error(e: ValidationError) -> APIError:
    errors = e.errors()
    # A union's members each report an error (a content that is neither a string nor valid
    # blocks): the one that got furthest into the value names the actual mistake.
    first = errors[0]["loc"][:1]
    err = max((x for x in errors if x["loc"][:1] == first), key=lambda x: len(x["loc"]))
    # Union members add their type name to the location; keep only the field path.
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPES))]
    param = ".".join(loc) or None
    if err["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'", param=param, code="missing")
    msg = str(err["msg"]).removeprefix("Value error, ")
    return bad_request(f"Invalid value for '{param}': {msg}", param=param, code="invalid_value")


_TYPES = {
    "str", "int", "float", "bool", "list", "dict", "function-after", "function-wrap", "TextPart",
    "NamedToolChoice", "literal['none','auto','required']",
}  # fmt: skip
