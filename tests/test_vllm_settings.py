"""The vllm backend's settings without vLLM: which specs it refuses (400s naming the field), which interpreter its
replicas get, what capacity counts for it, and that its LoRA models run replicas of their own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rayrunner.engines.vllm import runtime as vllm_runtime
from rayrunner.errors import InvalidSpecError
from rayrunner.models.footprint import estimate_bytes, expected_weight_bytes
from rayrunner.models.spec import build_spec
from rayrunner.registry.state import RegistryState
from rayrunner.replica.model_server import _runtime_env
from rayrunner.runtime.warm_workers import REPLICA_RUNTIME_ENV

SMOL = {"type": "plain", "model_id": "smollm2-135m-instruct"}
VLLM = {"backend": "vllm"}


@pytest.mark.parametrize(("which", "isq", "param", "words"), [
    ({"type": "embedding", "model_id": "all-minilm-l6-v2"}, None, "engine", "serves text models"),
    (SMOL, "Q4K", "in_situ_quant", "only to `FP8`"),
])
def test_what_the_vllm_backend_refuses_is_a_400_naming_the_field(which: dict, isq: str | None, param: str,
                                                                 words: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        build_spec("m", which, isq, VLLM)
    assert caught.value.param == param and words in str(caught.value)


def test_vllm_settings_are_checked_and_fp8_is_accepted() -> None:
    spec = build_spec("m", SMOL, "fp8", {"backend": "vllm", "vllm": {"kv_cache_bytes": 1 << 28, "sleep_level": 2}})
    assert spec.in_situ_quant == "FP8" and spec.engine.vllm.kv_cache_bytes == 1 << 28
    with pytest.raises(InvalidSpecError) as caught:
        build_spec("m", SMOL, None, {"backend": "vllm", "vllm": {"sleep_level": 3}})
    assert caught.value.param == "vllm" and "sleep_level" in str(caught.value)
    with pytest.raises(InvalidSpecError):
        build_spec("m", SMOL, None, {"backend": "sglang"})


def test_replicas_run_the_named_interpreter_and_a_missing_one_is_a_400(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.touch()
    named = build_spec("m", SMOL, None, {"backend": "vllm", "vllm": {"python": str(python)}}).engine
    env = _runtime_env(named)
    assert env["py_executable"] == str(python) and "RAYRUNNER_PRELOAD" not in env["env_vars"]
    monkeypatch.setenv(vllm_runtime.PYTHON_ENV_VAR, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(InvalidSpecError) as caught:
        _runtime_env(build_spec("m", SMOL, None, VLLM).engine)
    assert "install_vllm.sh" in str(caught.value) and caught.value.param == "engine"
    monkeypatch.setenv(vllm_runtime.PYTHON_ENV_VAR, sys.executable)  # this interpreter: no py_executable needed
    assert "py_executable" not in _runtime_env(build_spec("m", SMOL, None, VLLM).engine)
    assert _runtime_env(build_spec("m", SMOL).engine) == REPLICA_RUNTIME_ENV


def test_capacity_counts_the_kv_cache_vllm_reserves() -> None:
    spec = build_spec("m", SMOL, None, {"backend": "vllm", "vllm": {"kv_cache_bytes": 3 << 30}})
    weights = expected_weight_bytes(spec)
    assert weights > 100_000_000  # SmolLM2's 135M weights at bf16
    assert estimate_bytes(spec) == weights + (3 << 30)
    assert estimate_bytes(spec, measured_weight_bytes=5) == 5 + (3 << 30)


def test_a_vllm_lora_model_runs_its_own_replica() -> None:
    state = RegistryState()
    lora = {"type": "lora", "model_id": "smollm2-135m-instruct", "adapter": "/adapters/a"}
    state.add(build_spec("base", SMOL, None, VLLM), [])
    state.add(build_spec("tuned", lora, None, VLLM), [])
    state.add(build_spec("tuned-own", lora), [])
    assert state.host_of("tuned") is None and state.host_of("tuned-own") is None  # the base is a vLLM model
    state.add(build_spec("base-own", SMOL), [])
    assert state.host_of("tuned-own") == "base-own" and state.host_of("tuned") is None
