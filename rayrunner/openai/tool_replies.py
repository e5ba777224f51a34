"""How a chat reply's text becomes tool calls: parsed in the model's own format (`tool_choice` auto), or read as the
JSON that constrained decoding forced (`required` or a named function)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rayrunner.openai.tool_calls import (
    ParsedCall,
    Piece,
    ToolCallStream,
    ToolFormat,
    parse_forced_calls,
    parse_tool_calls,
)
from rayrunner.protocol import ChatCompletionRequest, Delta, NamedToolChoice, ToolCallDelta


def forced_choice(request: ChatCompletionRequest) -> Literal["required"] | NamedToolChoice | None:
    """The request's tool_choice when it forces a call (constrained decoding writes it), else None."""
    choice = request.tool_choice
    return choice if request.tools and (choice == "required" or isinstance(choice, NamedToolChoice)) else None


@dataclass
class ToolReplies:
    """The tool-call reading of one request's replies."""

    fmt: ToolFormat
    forced: bool

    @classmethod
    def of(cls, request: ChatCompletionRequest, fmt: ToolFormat) -> ToolReplies | None:
        if not request.tools or request.tool_choice == "none":
            return None
        return cls(fmt, forced_choice(request) is not None)

    def split(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The reply's content (None when it is only calls) and its calls."""
        if self.forced:
            calls = parse_forced_calls(text)
            return (None, calls) if calls else (text, [])
        return parse_tool_calls(text, self.fmt)

    def stream(self) -> ToolDeltas:
        return ToolDeltas(self)


@dataclass
class ToolDeltas:
    """One streamed choice: text in, `Delta`s out (content, or a call's pieces). A forced call's JSON is held back
    and sent whole at the end; a model's own format is parsed as it streams."""

    replies: ToolReplies
    held: list[str] = field(default_factory=list)
    calls: int = 0

    def __post_init__(self) -> None:
        self._parser = None if self.replies.forced else ToolCallStream(self.replies.fmt)

    def feed(self, text: str) -> list[Delta]:
        if self._parser is None:
            self.held.append(text)
            return []
        return self._deltas(self._parser.feed(text))

    def finish(self) -> list[Delta]:
        if self._parser is not None:
            return self._deltas(self._parser.finish())
        content, calls = self.replies.split("".join(self.held))
        self.calls = len(calls)
        deltas = [Delta(tool_calls=[call.delta(i)]) for i, call in enumerate(calls)]
        return deltas if calls else [Delta(content=content)]

    def _deltas(self, pieces: list[Piece]) -> list[Delta]:
        deltas = []
        for piece in pieces:
            if isinstance(piece, ToolCallDelta):
                self.calls += 1
                deltas.append(Delta(tool_calls=[piece]))
            elif piece:
                deltas.append(Delta(content=piece))
        return deltas
