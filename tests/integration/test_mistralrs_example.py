"""mistral.rs's `examples/python/multi_model_example.py`, its five functions run in a row in one Python process as
a user script: each builds its own `Runner(which=..., in_situ_quant="Q4K")` and none shuts one down. Only the
import and the models differ: a tiny LLaVA whose lm_head has an odd number of outputs (49,153) stands in for
Gemma 3, SmolLM2 for Qwen3. The script starts its own Ray cluster, and its console must stay free of Ray's logs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.tiny_models import build_tiny_llava_odd_head

EXAMPLE = '''
import sys

from rayrunner import Architecture, ChatCompletionRequest, MultimodalArchitecture, Runner, Which

VISION = sys.argv[1]
TEXT = "smollm2-135m-instruct"


def example_runner_with_model_id():
    runner = Runner(which=Which.MultimodalPlain(model_id=VISION, arch=MultimodalArchitecture.LLaVA),
                    in_situ_quant="Q4K")
    model_ids = runner.list_models()
    print("Available models:", model_ids)
    print(f"Default model: {runner.get_default_model_id()}")
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Hello, how are you?"}])
    if model_ids:
        response = runner.send_chat_completion_request(request=request, model_id=model_ids[0])
        print(f"Response from {model_ids[0]}:", response.usage.completion_tokens, "tokens")
        response = runner.send_chat_completion_request(request=request)
        print("Response from default model:", response.model)


def example_model_management():
    runner = Runner(which=Which.Plain(model_id=TEXT, arch=Architecture.Llama), in_situ_quant="Q4K")
    print("Initial models with status:", runner.list_models_with_status())
    print(f"Current default model: {runner.get_default_model_id()}")
    model_ids = runner.list_models()
    if model_ids:
        print(f"Is {model_ids[0]} loaded? {runner.is_model_loaded(model_ids[0])}")
    if model_ids and len(model_ids) > 1:
        runner.set_default_model_id(model_ids[1])
        print(f"Changed default model to: {model_ids[1]}")


def example_unload_reload():
    runner = Runner(which=Which.MultimodalPlain(model_id=VISION, arch=MultimodalArchitecture.LLaVA),
                    in_situ_quant="Q4K")
    model_ids = runner.list_models()
    if not model_ids:
        print("No models loaded")
        return
    model_id = model_ids[0]
    print(f"Initial status: {runner.list_models_with_status()}")
    runner.unload_model(model_id)
    print(f"Status after unload: {runner.list_models_with_status()}")
    print(f"Is {model_id} loaded? {runner.is_model_loaded(model_id)}")
    runner.reload_model(model_id)
    print(f"Status after reload: {runner.list_models_with_status()}")


def example_streaming_with_models():
    runner = Runner(which=Which.Plain(model_id=TEXT, arch=Architecture.Llama), in_situ_quant="Q4K")
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Tell me a short story"}], stream=True)
    model_ids = runner.list_models()
    if model_ids:
        stream = runner.send_chat_completion_request(request=request, model_id=model_ids[0])
        chunks = [chunk for chunk in stream if chunk.choices[0].delta.content]
        print(f"Streamed from {model_ids[0]}:", len(chunks), "chunks")


def example_multi_model_setup():
    runner = Runner(which=Which.MultimodalPlain(model_id=VISION, arch=MultimodalArchitecture.LLaVA),
                    in_situ_quant="Q4K")
    print("Initial models:", runner.list_models())
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "What is 2 + 2?"}])
    response = runner.send_chat_completion_request(request)
    print("Gemma response from:", response.model)
    print("Quantization:", runner.model_card(VISION)["info"]["quantization"]["requested"],
          runner.model_card(TEXT)["info"]["quantization"]["requested"])


if __name__ == "__main__":
    for example in (example_runner_with_model_id, example_model_management, example_unload_reload,
                    example_streaming_with_models, example_multi_model_setup):
        print(f"=== {example.__name__} ===")
        example()
'''

# Lines Ray or Serve would print on a user's console: log records, replica output, remote tracebacks.
NOISE = re.compile(r"^(INFO|DEBUG|WARNING|ERROR)\b|^\d{4}-\d\d-\d\d .*(INFO|WARNING|ERROR)|\((Serve|raylet|pid=)|"
                   r"Traceback|RayTaskError", re.MULTILINE)


def test_multi_model_example_runs_in_one_process(tmp_path: Path) -> None:
    vision = build_tiny_llava_odd_head(tmp_path / "llava")
    script = tmp_path / "multi_model_example.py"
    script.write_text(EXAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own cluster, as a user's script
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script), vision], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    took = time.monotonic() - started
    out = done.stdout
    assert done.returncode == 0, f"{out}\n{done.stderr}"
    text = "smollm2-135m-instruct"
    assert f"Available models: ['{vision}']" in out and f"Default model: {vision}" in out
    assert f"Response from default model: {vision}" in out
    assert f"Initial models with status: [('{vision}', 'loaded'), ('{text}', 'loaded')]" in out
    assert f"Changed default model to: {text}" in out  # the Runners share one service: both models are listed
    assert f"Status after unload: [('{vision}', 'unloaded'), ('{text}', 'loaded')]" in out
    assert f"Status after reload: [('{vision}', 'loaded'), ('{text}', 'loaded')]" in out
    assert re.search(rf"Streamed from {re.escape(vision)}: [1-9]\d* chunks", out)
    assert f"Gemma response from: {text}" in out and "Quantization: Q4K Q4K" in out
    noise = NOISE.findall(out + done.stderr)
    assert not noise, f"Ray/Serve logs reached the console:\n{done.stderr}"
    assert took < 300, f"the example took {took:.0f} s"
