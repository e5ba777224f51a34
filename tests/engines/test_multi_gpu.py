"""A replica that reserved two GPUs spreads its model over them (transformers' `device_map="auto"`) and answers as
on one GPU. Skipped without two CUDA GPUs (none on the CI machine): `pytest -m gpu tests/engines`."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rayrunner.engines.transformers.text import TextEngine
from rayrunner.models.spec import build_spec
from rayrunner.openai.sampling_params import sampling_params
from rayrunner.protocol import ChatCompletionRequest

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def greedy(engine: TextEngine) -> str:
    request = ChatCompletionRequest.model_validate({"model": "m", "max_tokens": 24,
                                                    "messages": [{"role": "user", "content": "Name three rivers."}]})

    async def run() -> str:
        return "".join([e.text async for e in engine.chat(request, sampling_params(request, engine.spec.engine))])

    return asyncio.run(run())


def test_a_two_gpu_replica_spreads_the_layers_and_answers_as_one_gpu_does() -> None:
    which = {"type": "plain", "model_id": "smollm2-135m-instruct", "dtype": "f32"}
    spread = TextEngine(build_spec("two", which, engine={"device": "cuda", "num_gpus": 2}))
    one = TextEngine(build_spec("one", which, engine={"device": "cuda", "num_gpus": 1}))
    try:
        devices = {p.device.index for p in spread.model.parameters()}
        assert devices == {0, 1}, devices
        assert greedy(spread) == greedy(one)
    finally:
        spread.close()
        one.close()
