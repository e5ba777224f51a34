"""How a streamed answer is printed: pieces as they come, one newline at the end, also before an error line."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rayrunner.cli.api import CliError
from rayrunner.cli.conversation import print_stream


def chunk(content: str | None = None, usage: dict[str, int] | None = None) -> dict[str, Any]:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    return {"choices": choices, "usage": usage}


def test_pieces_then_a_newline_and_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    answer, usage = print_stream([chunk("Par"), chunk("is."), chunk(usage={"prompt_tokens": 3})])
    assert (answer, usage, capsys.readouterr().out) == ("Paris.", {"prompt_tokens": 3}, "Paris.\n")


def test_an_error_mid_answer_ends_the_line_then_raises(capsys: pytest.CaptureFixture[str]) -> None:
    def failing() -> Iterator[dict[str, Any]]:
        yield chunk("Par")
        raise CliError("model `m` is unavailable")

    with pytest.raises(CliError, match="unavailable"):
        print_stream(failing())
    assert capsys.readouterr().out == "Par\n"


def test_ctrl_c_during_an_answer_cancels_that_turn_only(capsys: pytest.CaptureFixture[str]) -> None:
    import io

    from rayrunner.cli.conversation import Conversation, Sampling, chat_loop

    sent: list[list[dict[str, str]]] = []
    closed: list[bool] = []

    class Api:
        def stream(self, _: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
            sent.append(list(body["messages"]))
            try:
                yield chunk("Once")
                if len(sent) == 1:
                    raise KeyboardInterrupt  # what Ctrl-C does while the answer streams
                yield chunk(" more")
            finally:
                closed.append(True)  # the stream (and its connection) is closed either way

    conversation = Conversation.start(Api(), "m", None, Sampling())  # type: ignore[arg-type]
    chat_loop(conversation, io.StringIO("tell a story\nhi\n"))
    assert sent[1] == [{"role": "user", "content": "hi"}]  # the cancelled turn is not sent again
    assert conversation.messages[-1] == {"role": "assistant", "content": "Once more"} and closed == [True, True]
    assert "(answer cancelled)" in capsys.readouterr().err
