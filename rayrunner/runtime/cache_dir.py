"""Where rayrunner keeps on each node what it can rebuild: converted builtin models, quantized models, parked
weights, the fast decode step's fused operations built for the node's CPU (`kernels/`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """rayrunner's own cache (converted builtin models): `$RAYRUNNER_CACHE_DIR` or `~/.cache/rayrunner`."""
    root = os.environ.get("RAYRUNNER_CACHE_DIR") or os.path.join(Path.home(), ".cache", "rayrunner")
    return Path(root)
