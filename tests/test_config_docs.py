"""docs/configuration.md is what the config models say (`python scripts/config_docs.py` regenerates it), and every
level of the router's args and of a model's spec has its table."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def config_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "scripts" / "config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_are_current() -> None:
    assert config_docs().check() is None


def test_every_level_has_one_table() -> None:
    text = config_docs().render()
    for name in ("RegistryConfig", "ModelEntry", "SourcePolicy", "RequestLimits", "ApiKeys", "ModelSpec", "Plain",
                 "MultimodalPlain", "Embedding", "GGUF", "Lora", "EngineSettings", "Autoscaling", "VllmSettings"):
        assert text.count(f"\n### {name}\n") == 1, name


def test_stale_docs_are_one_line(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text("# Configuration\n")
    problem = config_docs().check(stale)
    assert problem is not None and "\n" not in problem and "python scripts/config_docs.py" in problem
