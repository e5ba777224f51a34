"""Models quantized in situ, kept whole in a local file, so that loading one again skips `from_pretrained` and
quantizing (a reload after a `stop` unload, a replica that Serve restarts, a second cluster on the same host).

The file holds the quantized model object itself (`torch.save` of the module tree, quantized tensors and all) and
the quantization report. Its name is a hash of everything the result depends on: the weights' files (name, size,
modification time), the ISQ level, dtype, device and model class, the versions of torch, torchao and transformers,
and the source of rayrunner's quantization modules (their classes are pickled by reference). Anything else changed
gives another name; a file that cannot be read is removed and the model is loaded from its source instead. Saving
a new file removes the model's older ones, then the least recently used files of other models while the folder
holds more than `$RAYRUNNER_QUANTIZED_CACHE_GB` (default 20; a load marks its file used).

SmolLM2 at Q8_0 on CPU: `from_pretrained` plus quantizing takes 0.8 s; reading the cached model 0.05 s, writing it
0.15 s (135 MB). Only quantized models are cached: for a model in its own dtype the file would copy the source.
torchao sets `extra_repr` on each Linear it quantizes to a bound function that cannot be pickled by name; it is only
a repr, so it is left out of the file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayrunner.models.sources import cache_dir

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".json")
LIBRARIES = ("torch", "torchao", "transformers")
LIMIT_ENV_VAR = "RAYRUNNER_QUANTIZED_CACHE_GB"
DEFAULT_LIMIT_GB = 20.0
STALE_PARTIAL_S = 3600.0  # a partial file this old was left by a process that died while writing it


class QuantizedModelCache:
    """The cache file of one quantized load: `load` it when present, `save` it after quantizing."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def for_load(cls, model_id: str, weights: str, settings: dict[str, Any], folder: Path | None = None
                 ) -> QuantizedModelCache:
        """The file for loading `model_id` from the folder `weights` with `settings` (ISQ level, dtype, device,
        model class: whatever else the quantized model depends on)."""
        key = {"weights": _weight_files(Path(weights)), "settings": settings, "libraries": _library_versions(),
               "code": _quantization_code()}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        return cls((folder or cache_dir() / "quantized") / f"{_file_prefix(model_id)}-{digest}.pt")

    def load(self) -> tuple[nn.Module, dict[str, Any]] | None:
        """The cached model and its quantization report, or None when there is none (or it is unreadable)."""
        if not self.path.is_file():
            return None
        try:
            with torch.inference_mode(False):  # normal tensors, whatever mode the caller runs in
                model, report = torch.load(self.path, weights_only=False)  # our own file, written by `save`
        except Exception as exc:  # a truncated or foreign file: load from the source instead
            logger.warning("ignoring the unreadable quantized cache %s: %s", self.path, exc)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path)  # used now: the last file a full folder gives up
        return model, report

    def save(self, model: nn.Module, report: dict[str, Any]) -> None:
        """Write the model and report (atomically: a reader never sees half a file), then remove the same model's
        older files. A failure is logged, not raised: the cache only saves time."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        try:
            with _without_instance_reprs(model):
                torch.save((model, report), partial)
            partial.replace(self.path)
        except Exception as exc:
            logger.warning("could not cache the quantized model at %s: %s", self.path, exc)
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
            return
        self._remove_older()
        self._trim(_limit_bytes())

    def _remove_older(self) -> None:
        model_part = self.path.name.rsplit("-", 1)[0]
        for other in self.path.parent.glob(f"{model_part}-*.pt"):
            if other != self.path and other.name.rsplit("-", 1)[0] == model_part:
                with contextlib.suppress(FileNotFoundError):
                    other.unlink()

    def _trim(self, limit: int) -> None:
        """Remove other models' files, least recently used first, while the folder holds more than `limit`, and
        partial files left by writers that died."""
        for partial in self.path.parent.glob("*.partial"):
            with contextlib.suppress(FileNotFoundError):
                if time.time() - partial.stat().st_mtime > STALE_PARTIAL_S:
                    partial.unlink()
        files = []
        for path in self.path.parent.glob("*.pt"):
            with contextlib.suppress(FileNotFoundError):
                stat = path.stat()
                files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= limit:
                return
            if path != self.path:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    logger.info("removed %s from the quantized model cache (over %d bytes)", path.name, limit)
                total -= size


@contextlib.contextmanager
def _without_instance_reprs(model: nn.Module) -> Any:
    """Take out the `extra_repr` functions set on module instances (torchao's) while the model is pickled."""
    taken = [(module, module.__dict__.pop("extra_repr")) for module in model.modules()
             if "extra_repr" in module.__dict__]
    try:
        yield
    finally:
        for module, extra_repr in taken:
            module.__dict__["extra_repr"] = extra_repr


def _limit_bytes() -> int:
    value = os.environ.get(LIMIT_ENV_VAR)
    try:
        gigabytes = float(value) if value else DEFAULT_LIMIT_GB
    except ValueError:
        logger.warning("ignoring %s=%r (not a number of GB)", LIMIT_ENV_VAR, value)
        gigabytes = DEFAULT_LIMIT_GB
    return int(gigabytes * 2**30)


def _weight_files(folder: Path) -> list[tuple[str, int, int]]:
    """Name, size and modification time of the folder's weight and config files (links followed)."""
    stats = {path.name: path.stat() for path in folder.iterdir()
             if path.is_file() and path.name.endswith(WEIGHT_SUFFIXES)}
    return sorted((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats.items())


@functools.cache
def _library_versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in LIBRARIES}


@functools.cache
def _quantization_code() -> str:
    """A hash of this package's source (read once per process): its module classes are pickled by reference."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _file_prefix(model_id: str) -> str:
    """The model id, readable and unique, without `-` (it separates the prefix from the key's hash)."""
    readable = re.sub(r"[^A-Za-z0-9_.]+", "_", model_id)
    return f"{readable}_{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"
