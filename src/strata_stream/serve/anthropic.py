"""The Anthropic Messages API (`POST /v1/messages`): its request body, the conversation as the
model's chat template reads it, the answer's JSON, its server-sent events and its errors.

A request runs as any other (serve/app.py): one job on the generation worker's queue, batched
with every other client's. Only the shapes differ from the OpenAI routes:

- the conversation: a top-level `system` (a string or text blocks), then user and assistant
  turns whose content is a string or blocks: text, tool_use (an assistant's call) and
  tool_result (the user's answer to one). A tool result becomes the template's `tool` turn,
  named after its call, so the model's own template lays it out as it was trained;
- the answer: content blocks (text and tool_use, in the order the model wrote them), a
  stop_reason (end_turn, max_tokens, stop_sequence or tool_use) and usage;
- streamed: message_start, then per block content_block_start, content_block_delta (text_delta
  or input_json_delta) and content_block_stop, then message_delta (stop_reason, usage) and
  message_stop; each as `event: NAME` and `data: JSON`;
- errors: `{"type": "error", "error": {"type": ..., "message": ...}}` with the status the API
  uses for it (a full queue is 529 overloaded_error).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from strata_stream.serve.errors import APIError, bad_request
from strata_stream.serve.generation import SamplingParams
from strata_stream.serve.jobs import Finished
from strata_stream.serve.requests import MAX_STOP_CHARS, MAX_STOPS, MAX_TOKENS, MAX_TOOLS
from strata_stream.serve.tool_calls import Piece, ToolCall


# ---- the request -----------------------------------------------------------------------------
class _Block(BaseModel):
    # Clients send fields this server has no use for (cache_control, citations): ignored.
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        for block in content if isinstance(content, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind != "text":
                raise ValueError(f"a tool result's blocks must be text, not {kind!r}")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content)


class ThinkingBlock(_Block):
    """A previous turn's thinking, as agent clients send it back: not given to the model."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class Message(_Block):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, content: Any) -> Any:
        # Named here: the union's own error would only say the content is not a string.
        for block in content if isinstance(content, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in _BLOCK_TYPES:
                raise ValueError(
                    f"content blocks of type {kind!r} are not supported (only text, tool_use "
                    "and tool_result)"
                )
        return content


class Tool(_Block):
    # Client tools only: a server tool (web search, ...) names a type such as web_search_...
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(_Block):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=MAX_TOKENS)
    stream: bool = False
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _few_stops(cls, stops: list[str] | None) -> list[str] | None:
        if stops is not None and len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if max(map(len, stops or []), default=0) > MAX_STOP_CHARS:
            raise ValueError(f"a stop sequence is at most {MAX_STOP_CHARS} characters")
        return stops

    def check(self) -> None:
        choice = self.tool_choice
        names = {t.name for t in self.tools or []}
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise bad_request(f"tool_choice: no tool is named {choice.name!r}", param="tool_choice")
        if choice is not None and choice.type == "any" and not self.tools:
            raise bad_request("tool_choice: 'any' needs tools", param="tool_choice")
        for i, m in enumerate(self.messages):
            for j, b in enumerate(m.content if isinstance(m.content, list) else []):
                wrong = (m.role == "user" and isinstance(b, ToolUseBlock)) or (
                    m.role == "assistant" and isinstance(b, ToolResultBlock)
                )
                if wrong:
                    raise bad_request(
                        f"messages.{i}.content.{j}: a {b.type} block cannot be in a {m.role} "
                        "message",
                        param=f"messages.{i}.content.{j}",
                    )

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())

    def token_budget(self) -> int:
        return self.max_tokens

    def tool_specs(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's function layout, which is what
        templates are written for); None without tools or with tool_choice none."""
        if not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none"):
            return None
        specs = []
        for t in self.tools:
            fn: dict[str, Any] = {"name": t.name}
            if t.description is not None:
                fn["description"] = t.description
            fn["parameters"] = t.input_schema
            specs.append({"type": "function", "function": fn})
        return specs

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as the model's chat template reads it."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            out.append({"role": "system", "content": text})
        names: dict[str, str] = {}  # tool_use id -> the tool's name
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
            if m.role == "assistant":
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                calls = [b for b in m.content if isinstance(b, ToolUseBlock)]
                if calls:
                    names.update((c.id, c.name) for c in calls)
                    msg["tool_calls"] = [
                        {"id": c.id, "type": "function",
                         "function": {"name": c.name, "arguments": c.input}}
                        for c in calls
                    ]  # fmt: skip
                out.append(msg)
                continue
            results = [b for b in m.content if isinstance(b, ToolResultBlock)]
            for r in results:
                tool: dict[str, Any] = {"role": "tool", "tool_call_id": r.tool_use_id,
                                        "content": r.text()}  # fmt: skip
                if r.tool_use_id in names:
                    tool["name"] = names[r.tool_use_id]
                out.append(tool)
            if text or not results:
                out.append({"role": "user", "content": text})
        return out


# ---- errors ----------------------------------------------------------------------------------
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_status(e: APIError) -> int:
    """The HTTP status the Messages API answers `e` with: a full queue is 529 (overloaded)."""
    return 529 if e.code == "queue_full" else e.status


def error_body(e: APIError) -> dict[str, Any]:
    status = error_status(e)
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


# ---- the answer ------------------------------------------------------------------------------
def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_reason(end: Finished, calls: int) -> str:
    if end.reason == "length":
        return "max_tokens"
    if end.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if calls else "end_turn"


def content_blocks(pieces: Sequence[Piece]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for p in pieces:
        if isinstance(p, ToolCall):
            blocks.append({"type": "tool_use", "id": p.id, "name": p.name, "input": p.input})
        elif blocks and blocks[-1]["type"] == "text":
            blocks[-1]["text"] += p
        else:
            blocks.append({"type": "text", "text": p})
    return blocks


def message_body(msg_id: str, model: str, pieces: Sequence[Piece], end: Finished) -> dict[str, Any]:
    calls = sum(isinstance(p, ToolCall) for p in pieces)
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(pieces),
        "stop_reason": stop_reason(end, calls),
        "stop_sequence": end.stop_sequence,
        "usage": {"input_tokens": end.prompt_tokens, "output_tokens": end.completion_tokens},
    }


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _block_start(index: int, block: dict[str, Any]) -> bytes:
    data = {"type": "content_block_start", "index": index, "content_block": block}
    return sse_event("content_block_start", data)


def _block_delta(index: int, delta: dict[str, Any]) -> bytes:
    return sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                             "delta": delta})  # fmt: skip


def _block_stop(index: int) -> bytes:
    return sse_event("content_block_stop", {"type": "content_block_stop", "index": index})


async def message_events(
    pieces: AsyncGenerator[Piece | Finished, None],
    msg_id: str,
    model: str,
    prompt_tokens: int,
    raise_for: Any,
) -> AsyncIterator[bytes]:
    """The streamed answer's events from the answer's pieces (text and tool calls) and its end.
    `raise_for(end)` raises the APIError of a failed or cancelled end. A client gone mid-stream
    closes this, and it closes `pieces` at once: the job is cancelled now, not when collected."""
    try:
        async for frame in _message_events(pieces, msg_id, model, prompt_tokens, raise_for):
            yield frame
    finally:
        await pieces.aclose()


async def _message_events(
    pieces: AsyncIterator[Piece | Finished],
    msg_id: str,
    model: str,
    prompt_tokens: int,
    raise_for: Any,
) -> AsyncIterator[bytes]:
    start: dict[str, Any] = {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
    }  # fmt: skip
    yield sse_event("message_start", {"type": "message_start", "message": start})
    index = -1
    open_text = False  # a text block is open at `index`
    calls = 0
    async for p in pieces:
        if isinstance(p, str):
            if not open_text:
                index += 1
                open_text = True
                yield _block_start(index, {"type": "text", "text": ""})
            yield _block_delta(index, {"type": "text_delta", "text": p})
            continue
        if open_text:
            yield _block_stop(index)
            open_text = False
        if isinstance(p, ToolCall):
            calls += 1
            index += 1
            yield _block_start(index, {"type": "tool_use", "id": p.id, "name": p.name, "input": {}})
            yield _block_delta(index, {"type": "input_json_delta", "partial_json": p.arguments})
            yield _block_stop(index)
            continue
        end = p
        if end.reason in ("error", "cancelled"):
            try:
                raise_for(end)
            except APIError as e:
                yield sse_event("error", error_body(e))
            return
        delta = {"stop_reason": stop_reason(end, calls), "stop_sequence": end.stop_sequence}
        usage = {"output_tokens": end.completion_tokens}
        yield sse_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        yield sse_event("message_stop", {"type": "message_stop"})
        return
