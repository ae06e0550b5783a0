"""Tool calls: which format the served model writes them in, and how they are cut out of its text.

The tools a request names go into the model's own chat template (`apply_chat_template(...,
tools=...)`), which tells the model how to call them; the model then writes each call as text
between its family's markers, e.g. Qwen3's `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`. `tool_syntax` finds that format for a tokenizer:

- mlx-lm's tool parsers first (`mlx_lm.tool_parsers`: Qwen3's JSON, Qwen3-Coder, GLM 4.7,
  Kimi K2, MiniMax M2, Mistral, Gemma, LFM's pythonic calls ...), chosen as mlx-lm chooses them:
  the parser `mlx_lm.load` attached to the tokenizer wrapper, else (after the next) mlx-lm's
  inference from the chat template and vocabulary;
- transformers' own response parser where the tokenizer declares a `response_template` (its
  regions: content, tool calls, reasoning), run by `TemplateSplitter`;
- then the formats none of them reads: DeepSeek V3/R1's `<｜tool▁call▁begin｜>` blocks and
  gpt-oss's harmony `to=functions.NAME ... <|message|>{args}<|call|>`;
- Qwen3's JSON-in-tags, read here, only where mlx-lm is not installed (a transformers-only
  install) and the template writes that format.

`ToolCallSplitter` turns the streamed text into text and tool calls as it arrives, for the
streamed and the whole answer alike (so both are the same): text that may be the start of a
marker is held back until it is known not to be; a call's text is held until its end marker and
then parsed. What cannot be parsed (malformed JSON, a call cut off by max_tokens) is handed out
as the text it was, never as an error. Whitespace at the edges of a call (the newline a
template writes between calls) is not text of the answer.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("strata_stream.serve")

# parse(body, tools) -> the calls in one marked span, each {"name": str, "arguments": dict};
# raises (or returns None) when the span is not a call.
Parse = Callable[[str, "list[dict[str, Any]] | None"], Any]


@dataclass(frozen=True)
class ToolSyntax:
    """One family's tool-call format: a call is the text between `start` and `end`.
    source: where the parser comes from (for logs and errors). response_template: instead of
    markers, the tokenizer's own declarative parser (transformers' `response_template`), which
    `splitter` runs."""

    start: str
    end: str
    parse: Parse
    source: str
    response_template: dict[str, Any] | None = None


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. arguments: the JSON text of its arguments object."""

    id: str
    name: str
    arguments: str

    @property
    def input(self) -> dict[str, Any]:
        value = json.loads(self.arguments)
        return value if isinstance(value, dict) else {}


Piece = str | ToolCall


def new_call_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


# ---- which format ----------------------------------------------------------------------------
def tool_syntax(tokenizer: Any) -> ToolSyntax | None:
    """The tool-call format of `tokenizer` (an mlx-lm TokenizerWrapper, the server's HFTokenizer
    or a transformers tokenizer); None when no parser knows its template. In order: the parser
    mlx_lm.load attached, the tokenizer's own response_template (transformers' parser), mlx-lm's
    inference from the template, then this module's own formats."""
    start = getattr(tokenizer, "tool_call_start", None)
    parser = getattr(tokenizer, "tool_parser", None)
    if isinstance(start, str) and callable(parser):  # mlx_lm.load attached one
        end = getattr(tokenizer, "tool_call_end", None) or ""
        return ToolSyntax(start, end, parser, "mlx-lm")
    hf = _hf_tokenizer(tokenizer)
    declared = vars(hf).get("response_template") if hasattr(hf, "__dict__") else None
    if isinstance(declared, dict) and _response_parser() is not None:
        return ToolSyntax("", "", parse_json_call, "transformers response_template", declared)
    template = getattr(hf, "chat_template", None)
    template = template if isinstance(template, str) else ""
    found = _mlx_lm_syntax(hf)
    if found is not None:
        return found
    if DEEPSEEK_CALL_BEGIN in template:
        return ToolSyntax(DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END, parse_deepseek, "strata-stream")
    if HARMONY_START in template and HARMONY_END in template:
        return ToolSyntax(HARMONY_START, HARMONY_END, parse_harmony, "strata-stream")
    if QWEN_START in template and "tool_call.name" in template:
        return ToolSyntax(QWEN_START, QWEN_END, parse_json_call, "strata-stream")
    return None


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer under the server's wrappers (mlx-lm's and HFTokenizer)."""
    inner = vars(tokenizer).get("_tokenizer") if hasattr(tokenizer, "__dict__") else None
    if inner is not None and hasattr(inner, "get_vocab") and hasattr(inner, "chat_template"):
        return inner
    return tokenizer


def _mlx_lm_syntax(hf: Any) -> ToolSyntax | None:
    """mlx-lm's parser for the tokenizer, chosen by mlx-lm's own inference (None when mlx-lm is
    not installed or knows no parser for it)."""
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser
    except Exception:  # mlx-lm (or MLX) is not installed: a transformers-only install
        return None
    try:
        name = _infer_tool_parser(hf)  # type: ignore[no-untyped-call,unused-ignore]
        if name is None:
            return None
        module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    except Exception:
        log.warning("mlx-lm's tool parser inference failed for this tokenizer", exc_info=True)
        return None
    return ToolSyntax(
        str(module.tool_call_start),
        str(module.tool_call_end or ""),
        module.parse_tool_call,
        f"mlx-lm {name}",
    )


def _response_parser() -> Any:
    """transformers' streaming response parser class; None where this transformers lacks it."""
    try:
        from transformers.utils.chat_parsing.response_parser import ResponseParser
    except Exception:
        return None
    return ResponseParser


# ---- the formats mlx-lm does not read ------------------------------------------------------
QWEN_START, QWEN_END = "<tool_call>", "</tool_call>"
# DeepSeek V3 / R1 (its chat template): <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
# ```json {args} ```<｜tool▁call▁end｜>, one or more inside
# <｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>.
DEEPSEEK_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_CALLS_END = "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DEEPSEEK_CALL_END = "<｜tool▁call▁end｜>"
_DEEPSEEK_SEP = "<｜tool▁sep｜>"
# gpt-oss harmony: <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json
# <|message|>{args}<|call|>; the recipient may also stand before the channel.
HARMONY_START = "to=functions."
HARMONY_END = "<|call|>"
_HARMONY_MESSAGE = "<|message|>"


def parse_json_call(body: str, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Qwen-style `{"name": ..., "arguments": {...}}`."""
    call = json.loads(body.strip())
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError("a tool call is a JSON object with a name")
    args = call.get("arguments", {})
    if isinstance(args, str):
        args = json.loads(args)
    return {"name": call["name"], "arguments": args}


def parse_deepseek(body: str, tools: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The calls of one DeepSeek block: each `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`."""
    calls = []
    for part in body.split(DEEPSEEK_CALL_BEGIN)[1:]:
        call, closed, rest = part.partition(DEEPSEEK_CALL_END)
        if not closed or rest.strip():
            raise ValueError("a DeepSeek call block holds only whole calls")
        calls.append(_deepseek_call(call))
    if not calls or body.split(DEEPSEEK_CALL_BEGIN)[0].strip():
        raise ValueError("not a DeepSeek call block")
    return calls


def _deepseek_call(body: str) -> dict[str, Any]:
    """One call: `function<｜tool▁sep｜>NAME\\n```json\\n{args}\\n```` (the type before the
    separator is absent in later releases)."""
    head, sep, rest = body.partition(_DEEPSEEK_SEP)
    if not sep:
        rest = head
    name, _, args = rest.strip().partition("\n")
    args = args.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", args, flags=re.DOTALL)
    if fenced is not None:
        args = fenced.group(1)
    value = json.loads(args) if args else {}
    if not name.strip() or not isinstance(value, dict):
        raise ValueError("not a DeepSeek tool call")
    return {"name": name.strip(), "arguments": value}


def parse_harmony(body: str, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One harmony call after `to=functions.`: `NAME ... <|message|>{args}`."""
    head, sep, args = body.partition(_HARMONY_MESSAGE)
    if not sep:
        raise ValueError("a harmony call has a <|message|>")
    name = re.split(r"\s|<\|", head.strip(), maxsplit=1)[0]
    value = json.loads(args.strip()) if args.strip() else {}
    if not name or not isinstance(value, dict):
        raise ValueError("not a harmony tool call")
    return {"name": name, "arguments": value}


# ---- splitting a stream ----------------------------------------------------------------------
@dataclass
class ToolCallSplitter:
    """The answer's text as text pieces and ToolCalls, fed as it is generated. `id_prefix`:
    "call_" (OpenAI) or "toolu_" (Anthropic)."""

    syntax: ToolSyntax
    tools: list[dict[str, Any]] | None
    id_prefix: str = "call_"
    _buf: str = ""
    _inside: bool = False
    _after_call: bool = False  # the last piece was a call: leading whitespace is dropped
    calls: int = field(default=0)

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._inside:
                end = self.syntax.end
                at = self._buf.find(end) if end else -1
                if at < 0:
                    return out
                body = self._buf[:at]
                self._buf = self._buf[at + len(end) :]
                self._inside = False
                out.extend(self._call(body, closed=True))
                continue
            at = self._buf.find(self.syntax.start)
            if at >= 0:
                self._emit_text(self._buf[:at].rstrip(), out)
                self._buf = self._buf[at + len(self.syntax.start) :]
                self._inside = True
                continue
            # Hold back a tail that may begin the start marker, and trailing whitespace (it is
            # dropped should a call follow).
            keep = _partial_suffix(self._buf, self.syntax.start)
            head = self._buf[: len(self._buf) - keep]
            safe = head.rstrip()
            self._emit_text(safe, out)
            self._buf = self._buf[len(safe) :]
            return out

    def finish(self) -> list[Piece]:
        """Whatever is held back, once the answer has ended."""
        out: list[Piece] = []
        if self._inside:
            self._inside = False
            out.extend(self._call(self._buf, closed=False))
        elif not self._after_call or self._buf.strip():
            self._emit_text(self._buf, out)
        self._buf = ""
        return out

    def _emit_text(self, text: str, out: list[Piece]) -> None:
        if self._after_call:
            text = text.lstrip()
        if not text:
            return
        self._after_call = False
        if out and isinstance(out[-1], str):
            out[-1] += text
        else:
            out.append(text)

    def _call(self, body: str, *, closed: bool) -> list[Piece]:
        """The calls in one marked span; the span as text when it does not parse."""
        raw = self.syntax.start + body + (self.syntax.end if closed else "")
        try:
            parsed = self.syntax.parse(body, self.tools)
            calls = _as_calls(parsed, self.id_prefix)
        except Exception as e:
            log.info(
                "a tool call did not parse (%s: %s); it is answered as text", type(e).__name__, e
            )
            calls = None
        if not calls:
            out: list[Piece] = []
            self._emit_text(raw, out)
            return out
        self.calls += len(calls)
        self._after_call = True
        return list(calls)


class TemplateSplitter:
    """The same as ToolCallSplitter, by transformers' own streaming parser of the tokenizer's
    response_template: its regions' text (the answer's content, and any other region such as
    reasoning) is text, each closed tool_calls region a call. It needs the prompt as text (the
    template may have written part of the answer). Should a region not parse, the answer's text
    from the end of what was handed out (the region's markers included) and all that follows
    are handed out as text, however the text was split into feeds."""

    def __init__(
        self, template: dict[str, Any], tools: list[dict[str, Any]] | None, id_prefix: str,
        prompt: str,
    ) -> None:  # fmt: skip
        self._parser = _response_parser()(template, prefix=prompt, tools=tools)
        self._id_prefix = id_prefix
        self._region = ""  # the open tool region's text so far
        self._raw = ""  # all text fed
        self._at = 0  # where in it what was handed out ends (region texts are slices of it)
        self._failed = False
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        """The parser is fed one character at a time, so that what it answers (a failure
        included) never depends on how the text was split into feeds."""
        if self._failed:
            return [text] if text else []
        out: list[Piece] = []
        for i, ch in enumerate(text):
            self._raw += ch
            try:
                events = self._parser.feed(ch)
            except Exception as e:
                rest = [p for p in [*self._fail(e), text[i + 1 :]] if p != ""]
                return merge_pieces(out + rest)
            out += self._pieces(events)
        return merge_pieces([p for p in out if p != ""])

    def finish(self) -> list[Piece]:
        if self._failed:
            return []
        try:
            return self._pieces(self._parser.finalize()[1])
        except Exception as e:
            return self._fail(e)

    def _handed_out(self, text: str) -> None:
        at = self._raw.find(text, self._at)
        if at >= 0:
            self._at = at + len(text)

    def _pieces(self, events: list[dict[str, Any]]) -> list[Piece]:
        out: list[Piece] = []
        for e in events:
            calls_region = e.get("field") == "tool_calls"
            if e["type"] == "region_chunk" and calls_region:
                self._region += e["text"]
            elif e["type"] == "region_chunk" and e["text"]:
                out.append(e["text"])
                self._handed_out(e["text"])
            elif e["type"] == "region_close" and calls_region:
                calls = _template_calls(e["value"], self._id_prefix)
                out.extend(calls if calls else [self._region])
                self._handed_out(self._region)
                self.calls += len(calls or [])
                self._region = ""
        return merge_pieces([p for p in out if p != ""])

    def _fail(self, e: Exception) -> list[Piece]:
        log.info("the response parser failed (%s); the rest is answered as text", e)
        self._failed = True
        rest = self._raw[self._at :]
        return [rest] if rest else []


def _template_calls(value: Any, id_prefix: str) -> list[ToolCall] | None:
    """transformers' parsed calls ({"type": "function", "function": {name, arguments}}, or a
    list of them) as ToolCalls."""
    items = value if isinstance(value, list) else [value]
    flat = [i.get("function", i) if isinstance(i, dict) else i for i in items]
    try:
        return _as_calls(flat, id_prefix)
    except Exception:
        return None


def splitter(
    syntax: ToolSyntax,
    tools: list[dict[str, Any]] | None,
    id_prefix: str,
    prompt: Callable[[], str],
) -> ToolCallSplitter | TemplateSplitter:
    """The splitter of one answer. `prompt()`: the prompt as text (asked only by a
    response_template's parser)."""
    if syntax.response_template is not None:
        return TemplateSplitter(syntax.response_template, tools, id_prefix, prompt())
    return ToolCallSplitter(syntax, tools, id_prefix=id_prefix)


def _as_calls(parsed: Any, id_prefix: str) -> list[ToolCall] | None:
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name, args = item.get("name"), item.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            return None
        calls.append(ToolCall(new_call_id(id_prefix), name, json.dumps(args, ensure_ascii=False)))
    return calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_all(syntax: ToolSyntax, tools: list[dict[str, Any]] | None, text: str) -> list[Piece]:
    """A whole answer split at once (tests and tools)."""
    s = ToolCallSplitter(syntax, tools)
    return merge_pieces(s.feed(text) + s.finish())


def merge_pieces(pieces: Sequence[Piece]) -> list[Piece]:
    """Adjacent text pieces joined: the content blocks of a whole answer."""
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        else:
            out.append(p)
    return out


__all__ = [
    "Piece",
    "ToolCall",
    "ToolCallSplitter",
    "ToolSyntax",
    "TemplateSplitter",
    "merge_pieces",
    "new_call_id",
    "parse_deepseek",
    "parse_harmony",
    "parse_json_call",
    "split_all",
    "splitter",
    "tool_syntax",
]
