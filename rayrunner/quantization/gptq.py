"""Pre-quantized GPTQ checkpoints: detect them, and fail early with the install hint when their kernels are missing.

transformers loads GPTQ weights through `gptqmodel`, an optional extra that needs CUDA torch; without it the load
would fail deep inside transformers with a less helpful message.
"""

from __future__ import annotations

import importlib
from typing import Any

from rayrunner.errors import ModelLoadError

INSTALL_HINT = "pip install 'rayrunner[gptq]'"


def is_gptq_config(config: Any) -> bool:
    """Whether a transformers model config says its weights are GPTQ-quantized."""
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method)).lower() == "gptq"


def require_gptq() -> None:
    """Raise ModelLoadError naming the extra to install when `gptqmodel` cannot be imported."""
    try:
        importlib.import_module("gptqmodel")
    except Exception as exc:  # gptqmodel raises more than ImportError when CUDA torch is absent
        raise ModelLoadError(
            f"this model is GPTQ-quantized and needs `gptqmodel` ({INSTALL_HINT}, which needs CUDA torch): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
