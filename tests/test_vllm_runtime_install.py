"""Where a `vllm`-backend replica's interpreter comes from in a checkout and in an installed (wheel) rayrunner."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from rayrunner.engines.vllm import runtime as vllm_runtime
from rayrunner.errors import InvalidSpecError
from rayrunner.models.spec import build_spec

SETTINGS = build_spec("m", {"type": "plain", "model_id": "smollm2-135m-instruct"}, None, {"backend": "vllm"}).engine
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this interpreter imports vllm")


def test_a_checkout_uses_its_own_vllm_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_runtime.PYTHON_ENV_VAR, raising=False)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "install_vllm.sh").touch()
    with pytest.raises(InvalidSpecError) as caught:
        vllm_runtime.vllm_python(SETTINGS, checkout=tmp_path)
    assert f"`{tmp_path / '.venv-vllm' / 'bin' / 'python'}`" in str(caught.value)
    assert "install_vllm.sh" in str(caught.value) and caught.value.param == "engine"
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").touch()
    assert vllm_runtime.vllm_python(SETTINGS, checkout=tmp_path) == str(tmp_path / ".venv-vllm" / "bin" / "python")


def test_an_installed_rayrunner_says_how_to_name_vllms_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """A wheel lives in site-packages: no checkout, no `.venv-vllm` beside it to guess at."""
    monkeypatch.delenv(vllm_runtime.PYTHON_ENV_VAR, raising=False)
    assert vllm_runtime.checkout_venv(tmp_path) is None
    with pytest.raises(InvalidSpecError) as caught:
        vllm_runtime.vllm_python(SETTINGS, checkout=tmp_path)
    message = str(caught.value)
    assert "engine.vllm.python" in message and f"${vllm_runtime.PYTHON_ENV_VAR}" in message
    assert "pip install --no-deps rayrunner" in message and "ray[serve]==" in message and ".venv-vllm/" not in message
    monkeypatch.setenv(vllm_runtime.PYTHON_ENV_VAR, sys.executable)  # named: no checkout needed
    assert vllm_runtime.vllm_python(SETTINGS, checkout=tmp_path) == sys.executable


def test_this_checkout_is_one() -> None:
    assert vllm_runtime.checkout_venv() == Path(__file__).resolve().parents[1] / ".venv-vllm"
