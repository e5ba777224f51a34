"""The Grafana dashboard queries only metrics rayrunner records."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_dashboard_query_names_a_recorded_metric() -> None:
    recorded = set(re.findall(r'"(rayrunner_\w+)"', (ROOT / "rayrunner/runtime/metrics.py").read_text()))
    dashboard = json.loads((ROOT / "cluster/grafana/rayrunner.json").read_text())
    queried = {re.sub(r"_(total|bucket|sum|count)$", "", name)
               for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"ray_(rayrunner_\w+)", target["expr"])}
    assert queried and queried <= recorded, queried - recorded
    assert recorded <= queried, f"recorded but on no panel: {recorded - queried}"
