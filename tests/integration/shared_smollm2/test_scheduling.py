"""The step scheduler seen over real HTTP on a real cluster: concurrent streams share steps, a short request is not
stuck behind a long one, and a client that hangs up frees its slot."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from ray import serve

from rayrunner.replica.model_server import DEPLOYMENT
from tests.conftest import Service

MODEL = "smollm2-135m-instruct"


def scheduler_stats() -> dict[str, int]:
    info: dict[str, Any] = serve.get_deployment_handle(DEPLOYMENT, app_name=MODEL).info.remote().result()
    stats: dict[str, int] = info["extra"]["scheduler"]
    return stats


def stream_chat(service: Service, content: str, max_tokens: int,
                started: threading.Event | None = None) -> tuple[float, int]:
    """Finish time (monotonic) and completion tokens of one streamed chat; `started` is set at its first token."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True}
    tokens = 0
    try:
        with httpx.Client(base_url=service.url, timeout=600) as http, \
                http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
                if started is not None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    started.set()
                tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
    finally:
        if started is not None:
            started.set()
    return time.monotonic(), tokens


def test_sixteen_streams_run_as_one_batch(service: Service) -> None:
    before = scheduler_stats()["steps"]
    prompts = [f"Write a long story about a {topic}." for topic in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: stream_chat(service, p, 24), prompts))
    assert all(tokens > 0 for _, tokens in results)
    steps = scheduler_stats()["steps"] - before
    assert steps < 2 * 24, f"{steps} steps for 16 x 24 tokens: the streams did not share steps"


def test_a_short_request_is_not_stuck_behind_a_long_one(service: Service) -> None:
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(stream_chat, service, "Write a long story about a dragon.", 300, started)
        assert started.wait(120)  # the long one is decoding: its first token is out
        short_done, _ = stream_chat(service, "What is the capital of France?", 8)
        long_done, long_tokens = long.result()
    assert long_tokens > 100 and short_done < long_done


def test_a_client_that_hangs_up_frees_its_slot(service: Service) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 2000,
            "stream": True}
    with httpx.Client(base_url=service.url, timeout=600) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert scheduler_stats()["running"] == 1
    deadline = time.monotonic() + 10
    while scheduler_stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scheduler_stats()["running"] == 0


def test_a_repeated_conversation_reports_its_cached_prompt_tokens(service: Service) -> None:
    """Over HTTP: the second turn of a chat reuses the first turn's cached blocks (usage says how many), and the
    KV figures are in the scheduler's stats, within its budget."""
    history = [{"role": "user", "content": "Tell me about the moon and its phases, in detail. " * 8}]
    with httpx.Client(base_url=service.url, timeout=600) as http:
        first = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 8,
                                                         "temperature": 0}).json()
        history += [first["choices"][0]["message"], {"role": "user", "content": "And the sun?"}]
        second = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 8,
                                                          "temperature": 0}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < first["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens"] - 16 <= cached < second["usage"]["prompt_tokens"]
    stats = scheduler_stats()
    assert stats["prefix_cache_bytes"] > 0 and stats["kv_cache_peak_bytes"] <= stats["kv_cache_budget_bytes"]
