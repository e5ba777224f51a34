"""`rayrunner chat` and `rayrunner run`: streamed chat completions printed as they arrive.

A chat keeps its whole history (system prompt, every user turn and every answer) and sends it with each turn.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import typer

from rayrunner.cli.api import Api, CliError

EXIT_COMMANDS = ("/exit", "/bye")
PROMPT = ">>> "


@dataclass
class Sampling:
    """The request fields a user may set from the command line (None: the server's default)."""

    max_tokens: int | None = None
    temperature: float | None = None

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in (("max_tokens", self.max_tokens), ("temperature", self.temperature)) if v is not None}


@dataclass
class Conversation:
    """One model's chat history, sent whole with each turn."""

    api: Api
    model: str
    sampling: Sampling
    verbose: bool = False
    messages: list[dict[str, str]] = field(default_factory=list)

    @classmethod
    def start(cls, api: Api, model: str, system: str | None, sampling: Sampling,
              verbose: bool = False) -> Conversation:
        messages = [{"role": "system", "content": system}] if system else []
        return cls(api, model, sampling, verbose, messages)

    def cancel_turn(self) -> None:
        """Forget the last user turn whose answer was cancelled (the next turn is sent without it)."""
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()

    def ask(self, text: str) -> str:
        """Send a user turn, print the answer as it streams, keep both in the history and return the answer."""
        self.messages.append({"role": "user", "content": text})
        body = {"model": self.model, "messages": self.messages, "stream": True,
                "stream_options": {"include_usage": True}, **self.sampling.fields()}
        answer, usage = print_stream(self.api.stream("/v1/chat/completions", body))
        self.messages.append({"role": "assistant", "content": answer})
        if self.verbose and usage:
            typer.echo(usage_line(usage), err=True)
        return answer


def print_stream(chunks: Iterable[dict[str, Any]]) -> tuple[str, dict[str, Any] | None]:
    """Print the content deltas as they come, then a newline; return the answer and the usage (if sent)."""
    parts: list[str] = []
    usage = None
    try:
        for chunk in chunks:
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    typer.echo(piece, nl=False)
                    parts.append(piece)
    except CliError:
        if parts:  # end the answer's line before the error line
            typer.echo()
        raise
    typer.echo()
    return "".join(parts), usage


def usage_line(usage: dict[str, Any]) -> str:
    """`--verbose`'s statistics of one answer."""
    return (f"prompt tokens: {usage.get('prompt_tokens', 0)}, answer tokens: {usage.get('completion_tokens', 0)}, "
            f"{usage.get('avg_compl_tok_per_sec', 0.0):.1f} tok/s, {usage.get('total_time_sec', 0.0):.2f} s")


def _read_turn(stdin: TextIO, interactive: bool) -> str | None:
    """The next user line; None at EOF or an exit command."""
    if interactive:
        try:
            line = input(PROMPT)
        except EOFError:
            typer.echo()
            return None
    else:
        line = stdin.readline()
        if not line:
            return None
    text = line.strip()
    return None if text in EXIT_COMMANDS else text


def chat_loop(conversation: Conversation, stdin: TextIO | None = None) -> None:
    """Read turns from stdin (with a prompt on a terminal) until EOF or `/exit`, answering each one; Ctrl-C during
    an answer cancels that answer only."""
    stdin = stdin or sys.stdin
    interactive = stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):  # line editing and history for input(), where the platform has it
            import readline  # noqa: F401
    while (text := _read_turn(stdin, interactive)) is not None:
        if not text:
            continue
        try:
            conversation.ask(text)
        except KeyboardInterrupt:  # Ctrl-C while an answer streams: stop that answer (the server stops with it)
            conversation.cancel_turn()
            typer.echo("\n(answer cancelled)", err=True)


def run_once(api: Api, model: str, prompt: str, system: str | None, sampling: Sampling, verbose: bool) -> None:
    """One streamed answer to one prompt."""
    if not prompt.strip():
        raise CliError("the prompt is empty")
    Conversation.start(api, model, system, sampling, verbose).ask(prompt)
