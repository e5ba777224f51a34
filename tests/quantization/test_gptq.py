"""GPTQ helpers: config detection and the install hint when `gptqmodel` is missing."""

from __future__ import annotations

import sys
import types
from enum import Enum

import pytest

from rayrunner.errors import ModelLoadError
from rayrunner.quantization import is_gptq_config, require_gptq


class _Method(str, Enum):
    GPTQ = "gptq"
    AWQ = "awq"


@pytest.mark.parametrize(
    ("quantization_config", "expected"),
    [
        ({"quant_method": "gptq", "bits": 4}, True),
        ({"quant_method": "GPTQ"}, True),
        (types.SimpleNamespace(quant_method=_Method.GPTQ), True),
        (types.SimpleNamespace(quant_method=_Method.AWQ), False),
        ({"quant_method": "bitsandbytes"}, False),
        (None, False),
    ],
)
def test_is_gptq_config(quantization_config: object, expected: bool) -> None:
    assert is_gptq_config(types.SimpleNamespace(quantization_config=quantization_config)) is expected


def test_config_without_quantization_is_not_gptq() -> None:
    assert not is_gptq_config(types.SimpleNamespace())


def test_require_gptq_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gptqmodel", None)  # makes `import gptqmodel` raise ImportError
    with pytest.raises(ModelLoadError, match=r"pip install 'rayrunner\[gptq\]'"):
        require_gptq()


def test_require_gptq_passes_when_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gptqmodel", types.ModuleType("gptqmodel"))
    require_gptq()
