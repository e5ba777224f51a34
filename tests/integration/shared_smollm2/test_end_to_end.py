"""SmolLM2 served end to end: router + model deployment on a real cluster, over real HTTP."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.conftest import Service

QUESTION = "What is the capital of France?"


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_greedy_answer_names_paris(service: Service) -> None:
    response = service.chat(QUESTION, temperature=0, max_tokens=20)
    assert response.status_code == 200
    body = response.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["model"] == "smollm2-135m-instruct"
    assert body["choices"][0]["finish_reason"] == "stop"


def test_stream_joins_to_the_unary_text(service: Service) -> None:
    unary = service.chat(QUESTION, max_tokens=20).json()["choices"][0]["message"]["content"]
    streamed = service.chat(QUESTION, max_tokens=20, stream=True)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks]
    assert sum(1 for p in pieces if p) >= 3
    assert "".join(pieces) == unary
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] >= 3


def test_usage_counts_tokens(service: Service) -> None:
    from transformers import AutoTokenizer

    from rayrunner.models.sources import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve("smollm2-135m-instruct").path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           tokenize=False)
    expected_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    body = service.chat(QUESTION, max_tokens=4).json()
    usage = body["usage"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] == expected_prompt
    assert usage["completion_tokens"] == 4
    assert usage["total_tokens"] == expected_prompt + 4
    assert usage["total_time_sec"] > 0 and usage["avg_tok_per_sec"] > 0
    assert len(tokenizer(body["choices"][0]["message"]["content"], add_special_tokens=False)["input_ids"]) <= 5


def test_stop_string_cuts_the_text(service: Service) -> None:
    body = service.chat(QUESTION, max_tokens=20, stop=["Paris"]).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert "Paris" not in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["message"]["content"].startswith("The capital of France is")


def test_text_completion(service: Service) -> None:
    body = service.http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 5}).json()
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["text"]


def test_models_listing_and_card(service: Service) -> None:
    listing = service.http.get("/v1/models").json()
    assert listing["object"] == "list"
    (card,) = [m for m in listing["data"] if m["id"] == "smollm2-135m-instruct"]
    assert card["status"] == "loaded" and card["aliases"] == ["smol"] and card["is_default"]
    assert service.card("smol")["id"] == "smollm2-135m-instruct"
    assert service.card("default")["weight_bytes"] > 100_000_000


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found"),
        ({"messages": "hello"}, 400, "invalid_request"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "invalid_request"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "invalid_request"),
        ({"messages": []}, 400, "invalid_request"),
    ],
)
def test_bad_requests_get_openai_errors(service: Service, body: dict[str, Any], status: int, code: str) -> None:
    response = service.http.post("/v1/chat/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]


def test_malformed_json_is_a_400(service: Service) -> None:
    response = service.http.post("/v1/chat/completions", content=b"{not json",
                                 headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    not_an_object = service.http.post("/v1/chat/completions", json=["hi"])
    assert not_an_object.status_code == 400 and not_an_object.json()["error"]["code"] == "invalid_request"
    no_content_type = service.http.post("/v1/models/status", content=b'{"model_id": "smol"}')
    assert no_content_type.status_code == 200, no_content_type.text  # read as JSON, as it always was


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        ("/v1/completions", "best_of", 3),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_fields_not_implemented_yet_are_a_400(service: Service, path: str, field: str, value: Any,
                                              stream: bool) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", field: value, "stream": stream}
    response = service.http.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and "not supported yet" in error["message"] and error["code"] == "invalid_request"


def test_default_values_and_ignored_fields_still_answer(service: Service) -> None:
    response = service.chat(QUESTION, max_tokens=2, n=1, logprobs=False, response_format={"type": "text"},
                            tools=[], tool_choice="none", user="u-1", metadata={"k": "v"}, store=False)
    assert response.status_code == 200, response.text


def test_openapi_declares_every_request_body(service: Service) -> None:
    spec = service.http.get("/openapi.json").json()
    expected = {
        "/v1/chat/completions": "ChatCompletionRequest",
        "/v1/completions": "CompletionRequest",
        "/v1/embeddings": "EmbeddingRequest",
        "/v1/responses": "ResponsesRequest",
        "/v1/models/add": "AddModelBody",
        "/v1/models/aliases": "AliasBody",
        **{f"/v1/models/{op}": "ModelIdBody" for op in ("status", "reload", "remove", "default", "pin", "unpin")},
        "/v1/models/unload": "UnloadBody",
        "/v1/models/scale": "ScaleBody",
    }
    posts = {path: ops["post"] for path, ops in spec["paths"].items() if "post" in ops}
    assert set(posts) == set(expected)
    for path, model in expected.items():
        schema = posts[path]["requestBody"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{model}"}, path
        added = {"201"} if model == "AddModelBody" else set()  # 201 registered, 200 attached to the same model
        assert set(posts[path]["responses"]) == {"200", "default", *added}, path
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "logit_bias", "tools"} <= set(chat["properties"]) and chat["required"] == ["messages"]
    assert service.http.get("/docs").status_code == 200


def test_eight_concurrent_requests_succeed(service: Service) -> None:
    questions = [f"Count from 1 to {n}." for n in range(1, 9)]
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda q: service.chat(q, max_tokens=12), questions))
    assert [r.status_code for r in responses] == [200] * 8
    assert all(r.json()["choices"][0]["message"]["content"] for r in responses)


def test_openai_sdk_chat_and_stream(service: Service) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{service.url}/v1", api_key="none")
    reply = client.chat.completions.create(model="default", messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=20, temperature=0)
    assert "Paris" in (reply.choices[0].message.content or "")
    stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=20, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reply.choices[0].message.content


@pytest.mark.parametrize("isq", ["Q8_0"])  # Q4K over Serve: test_mistralrs_example; every level: quantization/
def test_in_situ_quantized_smollm2_still_answers(service: Service, isq: str) -> None:
    model_id = f"smollm2-{isq.lower()}"
    which = {"type": "plain", "model_id": "smollm2-135m-instruct"}
    added = service.http.post("/v1/models/add", json={"model_id": model_id, "which": which, "in_situ_quant": isq})
    assert added.status_code == 201, added.text
    card = added.json()
    assert card["quantization"]["requested"] == isq and card["quantization"]["applied"]
    assert card["weight_bytes"] < 0.65 * service.card("smollm2-135m-instruct")["weight_bytes"]
    answer = service.chat(QUESTION, model=model_id, max_tokens=20).json()["choices"][0]["message"]["content"]
    assert "Paris" in answer
    assert service.http.post("/v1/models/remove", json={"model_id": model_id}).status_code == 200
