"""The request bodies of the OpenAI endpoints, parsed and validated into typed objects.

Bodies are read raw and validated here rather than by FastAPI, so that malformed JSON and
invalid fields come back as OpenAI-style 400 errors naming the offending parameter."""

from __future__ import annotations

import json
from typing import Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from strata_stream.serve.errors import APIError, bad_request


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Generation(BaseModel):
    # OpenAI clients send fields this server does not use (user, ...): ignore them.
    # Numbers must be finite (JSON's NaN and Infinity extensions are refused by name), and a
    # seed must fit the 64 bits a sampler key holds.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # mlx-lm server extensions.
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=0.0, ge=0.0)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def check(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request(
                "Invalid value for 'top_logprobs': it needs logprobs: true",
                param="top_logprobs", code="invalid_value",
            )  # fmt: skip

    def top(self) -> int | None:
        """How many alternatives each token reports; None when logprobs are not asked."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Generation):
    # A string, token ids, or a list of either (one choice per prompt, index in order).
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 is allowed with echo: the prompt's log-probabilities alone (checked below).
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _some_prompt(
        cls, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt list is empty")
        if isinstance(prompt, list) and len(prompt) > 64:
            raise ValueError("at most 64 prompts per request")
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
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object", code="invalid_json")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None



def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    # Union members add their type name to the location; keep only the field path.
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPES))]
    param = ".".join(loc) or None
    if err["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'", param=param, code="missing")
    msg = str(err["msg"]).removeprefix("Value error, ")
    return bad_request(f"Invalid value for '{param}': {msg}", param=param, code="invalid_value")


_TYPES = {"str", "int", "float", "bool", "list", "function-after", "function-wrap", "TextPart"}
