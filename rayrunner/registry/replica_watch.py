"""The model apps' replica counts, watched by the registry: a gauge per model (running and Serve's target), and a
log line each time the target moves (an autoscaled model scaling, an unload, a reload)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from rayrunner.registry.model_apps import ModelApps
from rayrunner.runtime import metrics

logger = logging.getLogger(__name__)
WATCH_S = 5.0
_NONE = {"running": 0, "starting": 0, "target": 0}


async def watch_replicas(apps: ModelApps, models_by_app: Callable[[], dict[str, str]]) -> None:
    """Every `WATCH_S`: each registered model's replicas to metrics, and the targets that changed to the log."""
    targets: dict[str, int] = {}
    while True:
        try:
            counts = await apps.replica_counts()
            for app, model in models_by_app().items():
                now = counts.get(app, _NONE)
                metrics.replicas(model, now["running"], now["target"])
                before = targets.get(model, now["target"])
                if before != now["target"]:
                    logger.info("`%s`: replicas %d -> %d (%d running)", model, before, now["target"], now["running"])
                targets[model] = now["target"]
        except Exception:
            logger.warning("replica counts unavailable", exc_info=True)
        await asyncio.sleep(WATCH_S)
