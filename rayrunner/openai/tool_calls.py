"""Tool calls in generated text: the model family's output format, a parser for whole and streamed output, and the
JSON Schema that constrains a forced call (`tool_choice` `required` or a named function).

Formats: Hermes/Qwen (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, or a JSON
array of calls in one block as SmolLM2 writes them), Llama 3.x JSON (`{"name": ..., "parameters": {...}}` at the
start of the answer or after a call, or after `<|python_tag|>`), Mistral (`[TOOL_CALLS][{"name": ..., "arguments":
{...}}, ...]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`, a `[CALL_ID]id` perhaps before `[ARGS]`), Granite
(`<|tool_call|>[{"name": ..., "arguments": {...}}]`), Cohere (`<|START_ACTION|>[{"tool_name": ..., "parameters":
{...}}]<|END_ACTION|>`), gpt-oss's harmony (`<|start|>assistant<|channel|>commentary to=functions.NAME
<|constrain|>json<|message|>{...}<|call|>`, the recipient before `<|channel|>` too; the header of any other message is
dropped, its text is content) and OLMo 3 (`<function_calls>name(key=value, ...)</function_calls>`, one Python-style
call a line, JSON or Python literals as values). Text that looks like a call but is not a valid one stays content.
Whitespace (and Llama's `;`) touching a call is dropped. Pure Python: no torch, no transformers.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from rayrunner.errors import InvalidRequestError
from rayrunner.protocol import FunctionCall, NamedToolChoice, Tool, ToolCall, ToolCallDelta

MAX_FORCED_CALLS = 4  # bounds the array a forced call with parallel calls allowed may hold
_WS = " \t\r\n"


class ToolFormat(Enum):
    HERMES = "hermes"
    LLAMA = "llama"
    MISTRAL = "mistral"
    GRANITE = "granite"
    COHERE = "cohere"
    HARMONY = "harmony"
    OLMO = "olmo"


def tool_format(chat_template: str | None) -> ToolFormat:
    """The call format a chat template teaches its model; Hermes for templates without tool support (the prompt
    rayrunner writes for those asks for Hermes blocks)."""
    template = chat_template or ""
    if "<|channel|>" in template:  # first: gpt-oss's template also names "parameters"
        return ToolFormat.HARMONY
    if "<function_calls>" in template:
        return ToolFormat.OLMO
    if "<|START_ACTION|>" in template:  # before Llama's test: Cohere's template also names "parameters"
        return ToolFormat.COHERE
    if "<|tool_call|>" in template:
        return ToolFormat.GRANITE
    if "[TOOL_CALLS]" in template:
        return ToolFormat.MISTRAL
    if "<tool_call>" in template:
        return ToolFormat.HERMES
    if "<|python_tag|>" in template or '"parameters": ' in template:
        return ToolFormat.LLAMA
    return ToolFormat.HERMES


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedCall:
    """One call found in the output: the function's name and its arguments as a JSON object string."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_tool_call(self) -> ToolCall:
        return ToolCall(id=self.id, function=FunctionCall(name=self.name, arguments=self.arguments))

    def delta(self, index: int) -> ToolCallDelta:
        """The whole call as one streamed piece (OpenAI clients accumulate argument text, so one piece is valid)."""
        return ToolCallDelta(index=index, id=self.id, type="function",
                             function={"name": self.name, "arguments": self.arguments})


Piece = str | ToolCallDelta  # content text, or a tool call


def _call(item: Any) -> ParsedCall | None:
    """A call from a decoded JSON value, or None when it is not `{"name": str, "arguments"|"parameters": {...}}`
    (Cohere names it `tool_name`)."""
    if isinstance(item, dict) and "name" not in item and "tool_name" in item:
        item = {**item, "name": item["tool_name"]}
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(item["name"], json.dumps(args, ensure_ascii=False))


def _named_call(name: str, text: str) -> list[ParsedCall] | None:
    """The call of `name` whose arguments are the JSON object `text`, or None when it is not one."""
    try:
        arguments = json.loads(text)
    except ValueError:
        return None
    call = _call({"name": name, "arguments": arguments})
    return None if call is None else [call]


def _calls_from_json(text: str) -> list[ParsedCall] | None:
    """The calls in a JSON object or array of call objects, or None when any of it is not a call."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(item) for item in items]
    if not calls or None in calls:
        return None
    return [call for call in calls if call is not None]


class _JsonEnd:
    """Finds where the JSON object or array starting at `start` closes, resuming where the last look stopped (the
    text only grows while a call is pending, so streaming costs one pass over it)."""

    def __init__(self, start: int) -> None:
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.end: int | None = None

    def find(self, text: str) -> int | None:
        while self.end is None and self.pos < len(text):
            char = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.pos
        return self.end


_OPENERS = {ToolFormat.HERMES: ("<tool_call>",), ToolFormat.LLAMA: ("<|python_tag|>",),
            ToolFormat.MISTRAL: ("[TOOL_CALLS]",), ToolFormat.GRANITE: ("<|tool_call|>",),
            ToolFormat.COHERE: ("<|START_ACTION|>",), ToolFormat.HARMONY: ("<|start|>", "<|channel|>"),
            ToolFormat.OLMO: ("<function_calls>",)}
_CLOSER = {ToolFormat.HERMES: "</tool_call>", ToolFormat.LLAMA: "", ToolFormat.MISTRAL: "", ToolFormat.GRANITE: "",
           ToolFormat.COHERE: "<|END_ACTION|>", ToolFormat.HARMONY: "<|call|>", ToolFormat.OLMO: "</function_calls>"}
_INNER = {ToolFormat.MISTRAL: ("[CALL_ID]", "[ARGS]"), ToolFormat.HARMONY: ("<|constrain|>", "<|message|>")}
_BODY = {ToolFormat.HERMES: "{[", ToolFormat.LLAMA: "{", ToolFormat.MISTRAL: "[", ToolFormat.GRANITE: "[",
         ToolFormat.COHERE: "[", ToolFormat.HARMONY: "{", ToolFormat.OLMO: ""}  # what a call's JSON opens with
_PENDING = None  # a call's verdict needs more text
_Verdict = tuple[list[ParsedCall] | None, int] | None  # (calls, or None when malformed; text consumed) | pending
# Mistral's named call: `name`, perhaps `[CALL_ID]id`, then `[ARGS]` and the arguments' JSON object
_MISTRAL_NAMED = re.compile(r"(?P<name>[\w.\-]+)(?:\[CALL_ID\](?P<id>\w*))?(?P<args>\[ARGS\])?")
# A harmony message header up to its `<|message|>`; the recipient sits before `<|channel|>` or after the channel
_HARMONY_HEAD = re.compile(r"(?:<\|start\|>assistant)?(?:\s*to=(?P<pre>[^\s<]+))?\s*<\|channel\|>\w+"
                           r"(?:\s*to=(?P<post>[^\s<]+))?\s*(?:<\|constrain\|>)?\s*(?:json)?\s*<\|message\|>")
_PY_LITERALS = {"null": None, "None": None, "true": True, "True": True, "false": False, "False": False}


@dataclass(frozen=True)
class _Head:
    """Where a call's JSON starts, and its function's name when the format writes it outside the JSON (the JSON is
    then the arguments)."""

    body: int
    name: str | None = None


def _literal(node: ast.expr) -> Any:
    """A Python-style argument's value: literals, JSON's `null`/`true`/`false` too; ValueError for anything else."""
    if isinstance(node, ast.Name) and node.id in _PY_LITERALS:
        return _PY_LITERALS[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(key) if key is not None else None: _literal(value)
                for key, value in zip(node.keys, node.values, strict=True)}
    value = ast.literal_eval(node)  # constants and signed numbers; raises ValueError on names and calls
    if not isinstance(value, str | int | float | bool | type(None)):
        raise ValueError(f"not a JSON value: {value!r}")
    return value


def _python_call(node: ast.expr) -> ParsedCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call with keyword arguments")
    arguments = {keyword.arg: _literal(keyword.value) for keyword in node.keywords}
    if None in arguments:
        raise ValueError("** arguments")
    return ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False))


def _python_calls(text: str) -> list[ParsedCall] | None:
    """The calls in OLMo 3's block: `name(key=value, ...)` one a line (a list or tuple of them too), or a JSON call
    object or list; None when any of it is not a call."""
    if text.lstrip(_WS)[:1] in ("{", "["):
        found = _calls_from_json(text)
        if found is not None:
            return found
    try:
        module = ast.parse(text.strip(_WS))
        nodes = [stmt.value for stmt in module.body if isinstance(stmt, ast.Expr)]
        if not nodes or len(nodes) != len(module.body):
            return None
        items = [item for node in nodes for item in (node.elts if isinstance(node, ast.List | ast.Tuple) else [node])]
        return [_python_call(item) for item in items] or None
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def markers(fmt: ToolFormat) -> tuple[str, ...]:
    """The strings that open, punctuate or close a call in `fmt` (where they are special tokens, the detokenizer must
    keep them for the parser)."""
    return tuple(m for m in (*_OPENERS[fmt], *_INNER.get(fmt, ()), _CLOSER[fmt]) if m)


class ToolCallStream:
    """Splits streamed output into content and tool calls. `feed` returns what is certain so far: text that could
    still be the start of a call (a partial marker, a pending call, whitespace before it) is held until it is known,
    then released as a call, or as content when it is not one. `finish` releases the rest. `calls` collects every
    call found."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls: list[ParsedCall] = []
        self._buf = ""  # text not yet released
        self._ws = ""  # trailing whitespace of the content: dropped if a call follows
        self._in_call = False  # `_buf` starts with a call marker
        self._scan: _JsonEnd | None = None
        self._call_position = True  # a Llama `{` here opens a call: the start, or right after a call
        self._after_call = False  # separators after a call are dropped

    def feed(self, delta: str) -> list[Piece]:
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        pieces = self._drain(final=True)
        if self._ws:
            pieces.append(self._ws)
            self._ws = ""
        return pieces

    def _drain(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        progress = True
        while progress:
            progress = self._call_step(pieces, final) if self._in_call else self._content_step(pieces, final)
        return pieces

    def _content_step(self, pieces: list[Piece], final: bool) -> bool:
        """Releases content up to the next call marker (True: one was found) or up to a possible partial one."""
        if self._after_call:
            rest = self._buf.lstrip(_WS + (";" if self.fmt is ToolFormat.LLAMA else ""))
            self._after_call = not rest
            self._buf = rest
        start = self._marker_at(self._buf)
        if start is not None:
            self._release(pieces, self._buf[:start])
            self._buf, self._in_call = self._buf[start:], True
            return True
        keep = 0 if final else self._partial_marker_len(self._buf)
        self._release(pieces, self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _call_step(self, pieces: list[Piece], final: bool) -> bool:
        """Settles the pending call at the start of `_buf` if its text allows (or the output ended)."""
        verdict = self._verdict(final)
        if verdict is _PENDING:
            return False
        calls, end = verdict
        if calls is None:
            self._release(pieces, self._buf[:end])
        else:
            self._ws = ""
            for call in calls:
                pieces.append(call.delta(len(self.calls)))
                self.calls.append(call)
            self._call_position = self._after_call = True
        self._buf, self._in_call, self._scan = self._buf[end:], False, None
        return True

    def _verdict(self, final: bool) -> _Verdict:
        buf = self._buf
        marker = next((m for m in _OPENERS[self.fmt] if buf.startswith(m)), "")
        malformed = (None, max(len(marker), 1))  # the marker becomes content; the text after it is scanned again
        if self.fmt is ToolFormat.OLMO:
            return self._python_block(len(marker), final)
        head = self._head(len(marker), final)
        if not isinstance(head, _Head):
            return head
        if buf[head.body] not in ("{" if head.name else _BODY[self.fmt]):
            return malformed
        self._scan = self._scan or _JsonEnd(head.body)
        end = self._scan.find(buf)
        if end is None:
            return malformed if final else _PENDING
        text = buf[head.body:end]
        calls = _calls_from_json(text) if head.name is None else _named_call(head.name, text)
        if calls is None:
            return malformed
        closed = self._closed(end, final)
        return _PENDING if closed is None else (calls, closed)

    def _closed(self, end: int, final: bool) -> int | None:
        """Where a call whose JSON ends at `end` ends: past the format's closer if it follows (None: it may yet)."""
        buf, closer = self._buf, _CLOSER[self.fmt]
        after = len(buf) - len(buf[end:].lstrip(_WS))
        if closer and buf.startswith(closer, after):
            return after + len(closer)
        if closer and not final and closer.startswith(buf[after:]):
            return None
        return end

    def _head(self, start: int, final: bool) -> _Head | _Verdict:
        """Where the call's JSON starts after its marker (`start`), or the verdict when that is already known."""
        buf = self._buf
        malformed = (None, max(start, 1))
        body = len(buf) - len(buf[start:].lstrip(_WS))
        if body == len(buf):
            return malformed if final else _PENDING
        if self.fmt is ToolFormat.MISTRAL and buf[body] != "[":
            return self._mistral_named(body, final, malformed)
        if self.fmt is ToolFormat.HARMONY:
            return self._harmony_head(final, malformed)
        return _Head(body)

    def _mistral_named(self, start: int, final: bool, malformed: _Verdict) -> _Head | _Verdict:
        """`name[ARGS]` (a `[CALL_ID]id` perhaps between them) at `start`."""
        buf = self._buf
        match = _MISTRAL_NAMED.match(buf, start)
        if match is None:
            return malformed
        if match["args"]:
            body = len(buf) - len(buf[match.end():].lstrip(_WS))
            if body == len(buf):
                return malformed if final else _PENDING
            return _Head(body, match["name"])
        rest = buf[match.end():]
        growing = not rest or "[ARGS]".startswith(rest) or (match["id"] is None and "[CALL_ID]".startswith(rest))
        return _PENDING if growing and not final else malformed

    def _harmony_head(self, final: bool, malformed: _Verdict) -> _Head | _Verdict:
        """A harmony message header: a call's when its recipient is `functions.NAME`, else dropped (its text is
        content)."""
        buf = self._buf
        end = buf.find("<|message|>")
        if end < 0:
            return malformed if final else _PENDING
        end += len("<|message|>")
        match = _HARMONY_HEAD.fullmatch(buf, 0, end)
        if match is None:
            return malformed
        recipient = match["pre"] or match["post"] or ""
        if not recipient.startswith("functions.") or recipient == "functions.":
            return [], end
        body = len(buf) - len(buf[end:].lstrip(_WS))
        if body == len(buf):
            return malformed if final else _PENDING
        return _Head(body, recipient.removeprefix("functions."))

    def _python_block(self, start: int, final: bool) -> _Verdict:
        """OLMo 3's `<function_calls>...</function_calls>` block (unclosed at the end of the output too)."""
        closer = _CLOSER[self.fmt]
        close = self._buf.find(closer, start)
        if close < 0 and not final:
            return _PENDING
        end = len(self._buf) if close < 0 else close + len(closer)
        calls = _python_calls(self._buf[start:close if close >= 0 else end])
        return (calls, end) if calls is not None else (None, max(start, 1))

    def _marker_at(self, buf: str) -> int | None:
        """Where the first call marker in `buf` starts (a Llama `{` counts only at a call position)."""
        found = [i for i in (buf.find(m) for m in _OPENERS[self.fmt]) if i >= 0]
        if self.fmt is ToolFormat.LLAMA and self._call_position:
            first = len(buf) - len(buf.lstrip(_WS))
            if buf[first:first + 1] == "{":
                found.append(first)
        return min(found, default=None)

    def _partial_marker_len(self, buf: str) -> int:
        """Length of the longest end of `buf` that is the start of a marker."""
        longest = max(len(m) for m in _OPENERS[self.fmt])
        for size in range(min(longest - 1, len(buf)), 0, -1):
            if any(m.startswith(buf[-size:]) for m in _OPENERS[self.fmt]):
                return size
        return 0

    def _release(self, pieces: list[Piece], text: str) -> None:
        """Releases content, holding its trailing whitespace back until it is known whether a call follows."""
        text = self._ws + text
        body = text.rstrip(_WS)
        self._ws = text[len(body):]
        if body:
            pieces.append(body)
            self._call_position = False


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str | None, list[ParsedCall]]:
    """The content left once the calls are taken out (None if empty), and the calls."""
    stream = ToolCallStream(fmt)
    pieces = stream.feed(text) + stream.finish()
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    return content or None, stream.calls


def forced_call_schema(tools: list[Tool], choice: Literal["required"] | NamedToolChoice, parallel: bool
                       ) -> dict[str, Any]:
    """JSON Schema for the output of a forced call: `{"name": ..., "arguments": {...}}` for one of the tools (the
    named one, or any for `required`), in an array of 1 to MAX_FORCED_CALLS calls when `parallel`. Each tool's
    `$defs` move to the root, where its `#/$defs/...` references point."""
    wanted = None if choice == "required" else choice.function.name
    chosen = [tool.function for tool in tools if wanted in (None, tool.function.name)]
    if not chosen:
        raise InvalidRequestError(f"tool_choice names `{wanted}`, which is not among the tools", param="tool_choice")
    defs: dict[str, Any] = {}
    options = []
    for function in chosen:
        parameters = dict(function.parameters)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise InvalidRequestError(f"two tools define `$defs/{name}` differently", param="tools")
        options.append({"type": "object", "properties": {"name": {"const": function.name}, "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})
    call = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_FORCED_CALLS} if parallel else call
    return {**schema, "$defs": defs} if defs else schema


def parse_forced_calls(text: str) -> list[ParsedCall]:
    """The calls in output constrained by `forced_call_schema`; empty when it is not valid (e.g. cut short by
    max_tokens), in which case the text is the answer's content."""
    return _calls_from_json(text) or []
