"""The vllm backend loads `dtype: auto` as rayrunner's own engine does (the config's dtype where the device runs it
well), checked in vLLM's own interpreter (`.venv-vllm`, where vLLM imports; one process, vLLM imports slowly)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_vllm_backend import VENV, vllm_venv_ready
from tests.tiny_models import build_tiny_llama

CHECK = """
import sys
from rayrunner.engines.loading import resolve_which
from rayrunner.engines.vllm.engine import _dtype
from rayrunner.models.spec import build_spec
for folder in sys.argv[1:]:
    for dtype in ("auto", "bf16"):
        spec = build_spec("t", {"type": "plain", "model_id": folder, "dtype": dtype})
        print(_dtype(spec, resolve_which(spec)[0], "cpu"))
"""
# A config's dtype -> what `auto` loads on CPU (float16 as bf16: the CPU's fast paths are bf16 ones).
AUTO = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}


@pytest.mark.slow  # vLLM's interpreter imports vLLM (~10 s)
def test_auto_is_the_configs_dtype_and_an_asked_one_wins(tmp_path: Path) -> None:
    vllm_venv_ready()
    folders = []
    for declared in AUTO:
        folder = Path(build_tiny_llama(tmp_path / declared))
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "dtype": declared}))
        folders.append(str(folder))
    found = subprocess.run([str(VENV / "bin" / "python"), "-c", CHECK, *folders], capture_output=True, text=True,
                           check=True, cwd=Path(__file__).parents[1]).stdout.split()
    assert found == [name for auto in AUTO.values() for name in (auto, "bfloat16")]
