"""Which sources a model added at runtime may load from."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayrunner.errors import PermissionDeniedError
from rayrunner.models.source_policy import SourcePolicy
from rayrunner.models.which import GGUF, Embedding, Lora, Plain


def test_the_default_allows_builtin_models_only(tmp_path: Path) -> None:
    policy = SourcePolicy()
    policy.check(Plain(model_id="smollm2-135m-instruct"))
    policy.check(Embedding(model_id="all-minilm-l6-v2"))
    for which in (Plain(model_id=str(tmp_path)), Plain(model_id="Qwen/Qwen3-0.6B"), Plain(model_id="gpt2")):
        with pytest.raises(PermissionDeniedError) as caught:
            policy.check(which)
        assert caught.value.param == "which.model_id" and "none allowed" in caught.value.message


def test_local_roots_hold_paths_under_them_only(tmp_path: Path) -> None:
    inside, outside = tmp_path / "models" / "m", tmp_path / "other"
    inside.mkdir(parents=True)
    outside.mkdir()
    (inside / "escape").symlink_to(outside)
    policy = SourcePolicy(local_roots=[str(tmp_path / "models")])
    policy.check(Plain(model_id=str(inside)))
    for path in (outside, inside / "escape", tmp_path / "models" / ".." / "other"):
        with pytest.raises(PermissionDeniedError, match="outside the local folders"):
            policy.check(Plain(model_id=str(path)))


def test_hub_orgs() -> None:
    policy = SourcePolicy(hub_orgs=["Qwen"])
    policy.check(Plain(model_id="Qwen/Qwen3-0.6B"))
    with pytest.raises(PermissionDeniedError, match="not from an organisation"):
        policy.check(Plain(model_id="evil/Qwen3-0.6B"))
    SourcePolicy(hub_orgs=["*"]).check(Plain(model_id="gpt2"))


def test_every_location_field_is_checked(tmp_path: Path) -> None:
    policy = SourcePolicy(hub_orgs=["Qwen"])
    with pytest.raises(PermissionDeniedError) as caught:
        policy.check(Lora(model_id="Qwen/Qwen3-0.6B", adapter="evil/adapter"))
    assert caught.value.param == "which.adapter"
    with pytest.raises(PermissionDeniedError) as caught:
        policy.check(GGUF(quantized_model_id="Qwen/x-GGUF", tok_model_id=str(tmp_path)))
    assert caught.value.param == "which.tok_model_id"
    with pytest.raises(PermissionDeniedError) as caught:
        policy.check(Plain(model_id="Qwen/Qwen3-0.6B", hf_cache_path=str(tmp_path)))
    assert caught.value.param == "which.hf_cache_path"


def test_allow_all() -> None:
    SourcePolicy.allow_all().check(Plain(model_id="/anything", hf_cache_path="/x"))
