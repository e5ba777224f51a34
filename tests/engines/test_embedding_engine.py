"""EmbeddingEngine on the builtin all-MiniLM-L6-v2, in process (no Ray), plus pooling read from model folders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rayrunner.engines.transformers.embedding import EmbeddingEngine, Pooling, pool, read_pooling
from rayrunner.errors import ModelLoadError, UnsupportedRequestError
from rayrunner.models.spec import build_spec
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.protocol import ChatCompletionRequest


@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    return EmbeddingEngine(build_spec("minilm", {"type": "embedding", "model_id": "all-minilm-l6-v2"}))


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


async def test_vectors_are_384_d_unit_norm(engine: EmbeddingEngine) -> None:
    result = await engine.embed(["A man is playing a guitar."])
    assert len(result.vectors) == 1 and len(result.vectors[0]) == 384
    assert math.isclose(math.sqrt(_cosine(result.vectors[0], result.vectors[0])), 1.0, abs_tol=1e-4)
    assert result.prompt_tokens == 9  # [CLS] + 7 word pieces + [SEP]


async def test_paraphrase_is_closer_than_unrelated(engine: EmbeddingEngine) -> None:
    guitar, paraphrase, stocks = (
        await engine.embed(
            ["A man is playing a guitar.", "Someone plays the guitar.", "The stock market fell sharply today."]
        )
    ).vectors
    assert _cosine(guitar, paraphrase) > 0.6
    assert _cosine(guitar, paraphrase) > _cosine(guitar, stocks) + 0.4


async def test_batch_keeps_order_across_chunks(engine: EmbeddingEngine) -> None:
    texts = [f"sentence number {i} about topic {i % 7}" for i in range(40)]  # more than one 32-text chunk
    together = await engine.embed(texts)
    picked = (0, 33, 39)
    alone = [await engine.embed([texts[i]]) for i in picked]
    for index, single in zip(picked, alone, strict=True):
        assert _cosine(together.vectors[index], single.vectors[0]) > 0.999
    assert (await engine.embed([texts[i] for i in picked])).prompt_tokens == sum(r.prompt_tokens for r in alone)


async def test_long_input_is_truncated(engine: EmbeddingEngine) -> None:
    result = await engine.embed(["word " * 2000])
    assert result.prompt_tokens == engine.max_length == 256


async def test_chat_is_refused(engine: EmbeddingEngine) -> None:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(UnsupportedRequestError, match="embedding model"):
        engine.chat(request, SamplingParams(max_tokens=4))


def test_info(engine: EmbeddingEngine) -> None:
    info = engine.info()
    assert info.kind == "embedding" and info.device == "cpu"
    assert info.weight_bytes > 10_000_000
    assert info.extra["dimensions"] == 384 and info.extra["pooling"] == "mean" and info.extra["normalize"]


def _st_folder(tmp_path: Path, modules: list[str], pooling: dict[str, bool]) -> Path:
    listed = [
        {"idx": i, "name": str(i), "path": f"{i}_{m}" if i else "", "type": f"sentence_transformers.models.{m}"}
        for i, m in enumerate(modules)
    ]
    (tmp_path / "modules.json").write_text(json.dumps(listed))
    (tmp_path / "1_Pooling").mkdir(exist_ok=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_read_pooling(tmp_path: Path) -> None:
    assert read_pooling(tmp_path) == Pooling("mean", normalize=False)  # plain transformers folder
    folder = _st_folder(tmp_path, ["Transformer", "Pooling"], {"pooling_mode_lasttoken": True})
    assert read_pooling(folder) == Pooling("lasttoken", normalize=True)


def test_unsupported_modules_fail_to_load(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="Dense"):
        read_pooling(_st_folder(tmp_path, ["Transformer", "Pooling", "Dense"], {"pooling_mode_mean_tokens": True}))
    with pytest.raises(ModelLoadError, match="max_tokens"):
        read_pooling(_st_folder(tmp_path, ["Transformer", "Pooling"], {"pooling_mode_max_tokens": True}))


@pytest.mark.parametrize(
    ("mode", "expected"), [("mean", [[2.0], [5.0]]), ("cls", [[1.0], [5.0]]), ("lasttoken", [[3.0], [5.0]])]
)
def test_pool_modes_ignore_padding(mode: str, expected: list[list[float]]) -> None:
    hidden = torch.tensor([[[1.0], [2.0], [3.0]], [[5.0], [9.0], [9.0]]])  # second row: one token, right-padded
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert pool(hidden, mask, Pooling(mode)).tolist() == expected  # type: ignore[arg-type]


def test_lasttoken_with_left_padding() -> None:
    hidden = torch.tensor([[[9.0], [4.0], [6.0]]])
    assert pool(hidden, torch.tensor([[0, 1, 1]]), Pooling("lasttoken")).tolist() == [[6.0]]
