"""Structured output through client libraries nobody here wrote, against the live service on SmolLM2: the openai
SDK's `chat.completions.parse` and `responses.parse` over a corpus of schemas x prompts, greedy and sampled, and
LangChain's `ChatOpenAI` (`with_structured_output`, streamed too, and `bind_tools` with a named tool). Every reply
must parse, validate and end by itself: under a plain JSON grammar these ran to max_tokens (issue 25)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.conftest import Service

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 200  # the replies take 25-90 tokens: only a runaway reaches this
T = TypeVar("T")


class Book(BaseModel):
    title: str
    author: str
    year: int


class Person(BaseModel):
    name: str
    birth_year: int


class Movie(BaseModel):
    title: str
    director: Person
    year: int


class Recipe(BaseModel):
    name: str
    cuisine: Literal["italian", "mexican", "japanese", "indian", "french"]
    ingredients: list[str]


BOOK_PROMPT = "Name a famous novel, its author and the year it was published. Answer in JSON."
CORPUS: list[tuple[type[BaseModel], str]] = [
    (Book, BOOK_PROMPT),
    (Movie, "Name a famous movie, its director (with the year the director was born) and the year it came out."),
    (Recipe, "Suggest a dish to cook tonight, with its cuisine and ingredients. Answer in JSON."),
]
DECODING: dict[str, dict[str, Any]] = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "seed": 7}}


@pytest.fixture(scope="module")
def client(service: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def chat_model(service: Service) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{service.url}/v1", api_key="unused", model=MODEL, temperature=0.0,
                      max_tokens=MAX_TOKENS, max_retries=0, timeout=600)


def _each(ask: Callable[[tuple[type[BaseModel], str]], T]) -> list[T]:
    """`ask` on every case at once (the replica batches them); an assertion in any of them fails the test."""
    with ThreadPoolExecutor(len(CORPUS)) as pool:
        return list(pool.map(ask, CORPUS))


@pytest.mark.parametrize("decoding", DECODING)
def test_sdk_chat_completions_parse(client: openai.OpenAI, decoding: str) -> None:
    def ask(case: tuple[type[BaseModel], str]) -> None:
        schema, prompt = case
        reply = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              response_format=schema, max_tokens=MAX_TOKENS, **DECODING[decoding])
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(reply.choices[0].message.parsed, schema), reply.choices[0].message.content

    _each(ask)


@pytest.mark.parametrize("decoding", DECODING)
def test_sdk_responses_parse(client: openai.OpenAI, decoding: str) -> None:
    settings = dict(DECODING[decoding])
    seed = settings.pop("seed", None)  # not a Responses API parameter: rayrunner takes it as an extension

    def ask(case: tuple[type[BaseModel], str]) -> None:
        schema, prompt = case
        reply = client.responses.parse(model=MODEL, input=prompt, text_format=schema, max_output_tokens=MAX_TOKENS,
                                       extra_body={"seed": seed}, **settings)
        assert reply.status == "completed"
        assert isinstance(reply.output_parsed, schema), reply.output_text

    _each(ask)


def test_langchain_structured_output_plain_and_streamed(chat_model: ChatOpenAI) -> None:
    structured = chat_model.with_structured_output(Book, method="json_schema")
    assert isinstance(structured.invoke(BOOK_PROMPT), Book)
    chunks = list(structured.stream(BOOK_PROMPT))
    assert chunks and isinstance(chunks[-1], Book)


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def test_langchain_named_tool_call_has_only_the_declared_arguments(chat_model: ChatOpenAI) -> None:
    """LangChain's tool schema sets no `additionalProperties`; SmolLM2 used to add `"type": "function", ...`."""
    reply = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke("What's the weather in Paris?")
    assert [call["name"] for call in reply.tool_calls] == ["get_weather"]
    args = reply.tool_calls[0]["args"]
    assert set(args) == {"city"} and isinstance(args["city"], str) and args["city"]
