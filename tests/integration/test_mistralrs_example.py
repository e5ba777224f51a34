"""mistral.rs's `examples/python/multi_model_example.py`, its five functions run in one Python process as a user
script, in another order than the file's and with `in_situ_quant` on some and off others: each builds its own
`Runner(which=..., in_situ_quant=...)` and none shuts one down, and each Runner holds exactly the model it was built
with, as in mistral.rs. Only the import and the models differ: a tiny LLaVA whose lm_head has an odd number of
outputs (49,153) stands in for Gemma 3, SmolLM2 for Qwen3. The script starts its own Ray cluster, and its console
must stay free of Ray's logs."""

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
ORDER = sys.argv[2].split(",")  # the examples to run, in this order
UNQUANTIZED = set(sys.argv[3].split(","))  # the examples whose Runner has no in_situ_quant
TEXT = "smollm2-135m-instruct"


def isq(example):
    return None if example.__name__ in UNQUANTIZED else "Q4K"


def example_runner_with_model_id():
    runner = Runner(which=Which.MultimodalPlain(model_id=VISION, arch=MultimodalArchitecture.LLaVA),
                    in_situ_quant=isq(example_runner_with_model_id))
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
    runner = Runner(which=Which.Plain(model_id=TEXT, arch=Architecture.Llama),
                    in_situ_quant=isq(example_model_management))
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
                    in_situ_quant=isq(example_unload_reload))
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
    runner = Runner(which=Which.Plain(model_id=TEXT, arch=Architecture.Llama),
                    in_situ_quant=isq(example_streaming_with_models))
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Tell me a short story"}], stream=True)
    model_ids = runner.list_models()
    if model_ids:
        stream = runner.send_chat_completion_request(request=request, model_id=model_ids[0])
        chunks = [chunk for chunk in stream if chunk.choices[0].delta.content]
        print(f"Streamed from {model_ids[0]}:", len(chunks), "chunks")


def example_multi_model_setup():
    runner = Runner(which=Which.MultimodalPlain(model_id=VISION, arch=MultimodalArchitecture.LLaVA),
                    in_situ_quant=isq(example_multi_model_setup))
    print("Initial models:", runner.list_models())
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "What is 2 + 2?"}])
    response = runner.send_chat_completion_request(request)
    print("Gemma response from:", response.model)
    print("Quantization:", runner.model_card(VISION)["spec"]["in_situ_quant"],
          runner.model_card(TEXT)["spec"]["in_situ_quant"])


if __name__ == "__main__":
    for name in ORDER:
        print(f"=== {name} ===")
        globals()[name]()
'''

# Lines Ray or Serve would print on a user's console: log records, replica output, remote tracebacks.
NOISE = re.compile(r"^(INFO|DEBUG|WARNING|ERROR)\b|^\d{4}-\d\d-\d\d .*(INFO|WARNING|ERROR)|\((Serve|raylet|pid=)|"
                   r"Traceback|RayTaskError", re.MULTILINE)


def test_multi_model_example_runs_in_one_process(tmp_path: Path) -> None:
    vision = build_tiny_llava_odd_head(tmp_path / "llava")
    script = tmp_path / "multi_model_example.py"
    script.write_text(EXAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own cluster, as a user's script
    order = ["example_streaming_with_models", "example_runner_with_model_id", "example_unload_reload",
             "example_multi_model_setup", "example_model_management"]
    unquantized = ["example_streaming_with_models", "example_unload_reload"]
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script), vision, ",".join(order), ",".join(unquantized)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    took = time.monotonic() - started
    out = done.stdout
    assert done.returncode == 0, f"{out}\n{done.stderr}"
    text, vision_full, text_q4k = "smollm2-135m-instruct", f"{vision}@full", "smollm2-135m-instruct@Q4K"
    # The text model without ISQ first, then the vision model with Q4K: both under their plain ids.
    assert re.search(rf"Streamed from {re.escape(text)}: [1-9]\d* chunks", out)
    assert f"Available models: ['{vision}']" in out and f"Default model: {vision}" in out
    assert f"Response from default model: {vision}" in out
    # The vision model without ISQ: beside the Q4K one, under its spec's id; unload and reload touch only it.
    assert f"Initial status: [('{vision_full}', 'loaded')]" in out
    assert f"Status after unload: [('{vision_full}', 'unloaded')]" in out
    assert f"Is {vision_full} loaded? False" in out
    assert f"Status after reload: [('{vision_full}', 'loaded')]" in out
    # The vision model with Q4K again attaches to the first one, which answers its Runner's requests.
    assert f"Initial models: ['{vision}']" in out and f"Gemma response from: {vision}" in out
    assert "Quantization: Q4K None" in out  # the vision model it holds, and the plain text model
    # The text model with Q4K: its own model, alone in its Runner (so the default is not changed).
    assert f"Initial models with status: [('{text_q4k}', 'loaded')]" in out
    assert f"Current default model: {text_q4k}" in out and f"Is {text_q4k} loaded? True" in out
    assert "Changed default model" not in out
    noise = NOISE.findall(out + done.stderr)
    assert not noise, f"Ray/Serve logs reached the console:\n{done.stderr}"
    assert took < 300, f"the example took {took:.0f} s"
