"""Models quantized in situ, kept in a local file, so that loading one again skips `from_pretrained` and quantizing
(a reload after a `stop` unload, a replica that Serve restarts, a second cluster on the same host).

The file holds data only, no pickle: a safetensors file of the model's tensors with a JSON manifest in its metadata
(`weights.save_tensors`: each storage once; torchao's quantized tensor subclasses flattened into their plain inner
tensors plus their class and attributes by name, rebuilt only from the classes torchao registers as safe). Reading
it is parsing JSON and copying bytes, so a shared or writable cache folder can change weights at worst, never run
code; a file that is unreadable, or names anything the reader does not rebuild, is removed and the model is loaded
from its source instead. Why not `torch.load(weights_only=True)`, which refuses code too (torchao registers its
tensor classes for it): its unpickler runs in Python, once per tensor, and for a model's hundreds of tensors that
alone took longer than the whole cached load did before; safetensors reads them natively. The tensors are copied
out of the file into memory of their own, as `torch.load` read them before, so a file removed or rewritten later
cannot change or fault a loaded model.

The module tree is not in the file. It is built again from the source's own config on the meta device (what
`from_pretrained` builds, without memory or initialisation); the manifest then names the modules that quantizing
put in (rayrunner's int8 kinds, `MODULE_KINDS`, made empty and filled, and modules shared between two places), the
place of each parameter and buffer, the generation config (plain values) and the quantization report. The result
must have the tree the manifest recorded and no tensor left on the meta device, or the file is not used.

The file's name is a hash of everything the result depends on: the sha256 of the source's weight and config files'
bytes, the ISQ level, dtype, device and model class, the versions of torch, torchao and transformers, and the
source of rayrunner's quantization modules (they made the tensors). Hashing the source's bytes at every load would
cost more than reading the cached model, so each file's digest is remembered in `HASHES_FILE` beside the cache files
under its device, inode, size, modification time and change time: a write changes the change time, and setting the
modification time back (`os.utime`) changes it again, so rewritten bytes are always hashed anew. Saving a new file
removes the model's older ones, then the least recently used files of other models while the folder holds more than
`$RAYRUNNER_QUANTIZED_CACHE_GB` (default 20; a load marks its file used).

Only quantized models are cached: for a model in its own dtype the file would copy the source. A model spread over
several devices (accelerate's dispatch hooks) is not cached.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayrunner.quantization.int8_rows import Int8Linear
from rayrunner.quantization.tied_embedding import Int8Embedding, Int8LMHead, Int8Table
from rayrunner.quantization.weights import load_tensors, save_tensors
from rayrunner.runtime.cache_dir import cache_dir

logger = logging.getLogger(__name__)

FORMAT = 2  # of the manifest; 1 was a pickled module tree
SUFFIX = ".safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".json")
LIBRARIES = ("torch", "torchao", "transformers")
LIMIT_ENV_VAR = "RAYRUNNER_QUANTIZED_CACHE_GB"
DEFAULT_LIMIT_GB = 20.0
STALE_PARTIAL_S = 3600.0  # a partial file this old was left by a process that died while writing it
HASHES_FILE = "source-hashes.json"
MODULE_KINDS: dict[str, type[nn.Module]] = {kind.__name__: kind for kind in
                                            (Int8Linear, Int8Table, Int8Embedding, Int8LMHead)}
PLAIN = (type(None), bool, int, float, str)
SLOT_KINDS = ("_parameters", "_buffers")


class QuantizedModelCache:
    """The cache file of one quantized load: `load` it when present, `save` it after quantizing."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def for_load(cls, model_id: str, weights: str, settings: dict[str, Any], folder: Path | None = None
                 ) -> QuantizedModelCache:
        """The file for loading `model_id` from the folder `weights` with `settings` (ISQ level, dtype, device,
        model class: whatever else the quantized model depends on)."""
        folder = folder or cache_dir() / "quantized"
        key = {"format": FORMAT, "weights": source_digests(Path(weights), folder / HASHES_FILE),
               "settings": settings, "libraries": _library_versions(), "code": _quantization_code()}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        return cls(folder / f"{_file_prefix(model_id)}-{digest}{SUFFIX}")

    def load(self, auto_class: Any, config: Any, dtype: torch.dtype) -> tuple[nn.Module, dict[str, Any]] | None:
        """The cached model (built as `auto_class` from the source's `config` in `dtype`, then filled from the file)
        and its quantization report, or None when there is none (or it is unreadable, or not of this model)."""
        if not self.path.is_file():
            return None
        try:
            with torch.inference_mode(False), ThreadPoolExecutor(1) as reader:  # normal tensors, whatever the mode
                read = reader.submit(_read_file, self.path)  # the file is read while the model is built
                model = _empty_model(auto_class, config, dtype)
                report = _fill(model, *read.result())
        except Exception as exc:  # truncated, foreign, refused or of another model: load from the source instead
            logger.warning("ignoring the quantized cache %s: %s: %s", self.path, type(exc).__name__, exc)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path)  # used now: the last file a full folder gives up
        return model, report

    def save(self, model: nn.Module, report: dict[str, Any]) -> None:
        """Write the model's tensors and manifest (atomically: a reader never sees half a file), then remove the same
        model's older files. A failure is logged, not raised: the cache only saves time."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        try:
            save_tensors(partial, *_contents(model, report))
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
        for other in self.path.parent.glob(f"{model_part}-*{SUFFIX}"):
            if other != self.path and other.name.rsplit("-", 1)[0] == model_part:
                with contextlib.suppress(FileNotFoundError):
                    other.unlink()

    def _trim(self, limit: int) -> None:
        """Remove other models' files, least recently used first, while the folder holds more than `limit`, partial
        files left by writers that died, and files of the pickled format (never read now)."""
        for legacy in self.path.parent.glob("*.pt"):
            with contextlib.suppress(FileNotFoundError):
                legacy.unlink()
        for partial in self.path.parent.glob("*.partial"):
            with contextlib.suppress(FileNotFoundError):
                if time.time() - partial.stat().st_mtime > STALE_PARTIAL_S:
                    partial.unlink()
        files = []
        for path in self.path.parent.glob(f"*{SUFFIX}"):
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


def _contents(model: nn.Module, report: dict[str, Any]) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    """What the file holds: the tensors the manifest's slots name, in order, and the manifest."""
    if len(set(getattr(model, "hf_device_map", {"": None}).values())) > 1:
        raise ValueError("the model is spread over several devices")
    slots, tensors = [], []
    for path, module in model.named_modules():  # each module once: a shared one is listed under `modules`
        for kind in SLOT_KINDS:
            for name, tensor in getattr(module, kind).items():
                slots.append([path, kind, name, name not in module._non_persistent_buffers_set])
                tensors.append(tensor)
    generation = getattr(model, "generation_config", None)
    manifest = {
        "format": FORMAT,
        "tree": _tree(model),
        "modules": _module_entries(model),
        "slots": slots,
        "generation_config": None if generation is None else json.loads(generation.to_json_string(use_diff=False)),
        "use_kernels": bool(getattr(model, "_use_kernels", False)),
        "report": report,
    }
    return tensors, manifest


def _module_entries(model: nn.Module) -> list[dict[str, Any]]:
    """The modules the source's model does not have (rayrunner's kinds, with their plain attributes) and the modules
    found in a second place (`same_as` the first), parents before children."""
    first: dict[int, str] = {}
    entries: list[dict[str, Any]] = []
    for path, module in model.named_modules(remove_duplicate=False):
        if id(module) in first:
            entries.append({"path": path, "same_as": first[id(module)]})
            continue
        first[id(module)] = path
        kind = type(module)
        if MODULE_KINDS.get(kind.__name__) is kind:
            entries.append({"path": path, "kind": kind.__name__, "attributes": _plain_attributes(module)})
        elif kind.__module__.startswith("rayrunner."):
            raise ValueError(f"{path}: rayrunner module {kind.__name__} is not one the cache rebuilds")
    return entries


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    attributes = {name: value for name, value in vars(module).items()
                  if not name.startswith("_") and name != "training"}
    odd = [name for name, value in attributes.items() if not isinstance(value, PLAIN)]
    if odd:
        raise ValueError(f"{type(module).__name__} holds attributes the cache cannot write: {odd}")
    return attributes


def _tree(model: nn.Module) -> list[list[str]]:
    return [[path, f"{type(module).__module__}.{type(module).__qualname__}"]
            for path, module in model.named_modules(remove_duplicate=False)]


def _read_file(path: Path) -> tuple[dict[str, Any], list[torch.Tensor | None]]:
    """The file's manifest and tensors, in memory of their own (see the module docstring)."""
    with torch.inference_mode(False):
        tensors, manifest = load_tensors(path, copy=True)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError("not a quantized model file of this format")
    return manifest, tensors


def _empty_model(auto_class: Any, config: Any, dtype: torch.dtype) -> nn.Module:
    """The model `from_pretrained` builds from `config`, its tensors on the meta device (no memory, no values, and
    no initialisation run over them, as in `from_pretrained`)."""
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device("meta"):
        model: nn.Module = auto_class.from_config(copy.deepcopy(config), dtype=dtype)
    return model


def _fill(model: Any, manifest: dict[str, Any], tensors: list[torch.Tensor | None]) -> dict[str, Any]:
    """Put the manifest's modules and the file's tensors into the empty transformers `model`; check it; return the
    report."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for entry in manifest["modules"]:
        parent, _, child = entry["path"].rpartition(".")
        if parent not in modules:
            raise ValueError(f"{entry['path']}: no such module in the model")  # and `_check` sees any module added
        module = modules[entry["same_as"]] if "same_as" in entry else _new_module(entry)
        modules[parent]._modules[child] = modules[entry["path"]] = module
    _place_tensors(dict(model.named_modules()), manifest["slots"], tensors)
    _check(model, manifest["tree"])
    if manifest["generation_config"] is not None:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_dict(manifest["generation_config"])
    model.eval()
    if manifest["use_kernels"] and hasattr(model, "set_use_kernels"):
        model.set_use_kernels(True)  # as `from_pretrained` left it
    report: dict[str, Any] = manifest["report"]
    return report


def _new_module(entry: dict[str, Any]) -> nn.Module:
    """An empty module of one of `MODULE_KINDS` with the entry's plain attributes (its tensors come later)."""
    kind = MODULE_KINDS.get(entry["kind"])
    if kind is None:
        raise ValueError(f"{entry['path']}: unknown module kind {entry['kind']!r}")
    module = kind.__new__(kind)
    nn.Module.__init__(module)
    for name, value in entry["attributes"].items():
        if name.startswith("_") or not isinstance(value, PLAIN):
            raise ValueError(f"{entry['path']}: attribute {name!r} is not a plain value")
        setattr(module, name, value)
    return module


def _place_tensors(modules: dict[str, nn.Module], slots: list[list[Any]], tensors: Any) -> None:
    if not isinstance(tensors, list) or len(tensors) != len(slots):
        raise ValueError("the tensors do not match the manifest's slots")
    for (path, kind, name, persistent), tensor in zip(slots, tensors, strict=True):
        module = modules[path]
        if kind not in SLOT_KINDS or not (tensor is None or isinstance(tensor, torch.Tensor)):
            raise ValueError(f"{path}.{name}: not a tensor slot")
        if kind == "_parameters" and tensor is not None and not isinstance(tensor, nn.Parameter):
            raise ValueError(f"{path}.{name}: a parameter that is not an nn.Parameter")
        getattr(module, kind)[name] = tensor
        if kind == "_buffers" and not persistent:
            module._non_persistent_buffers_set.add(name)
        else:
            module._non_persistent_buffers_set.discard(name)


def _check(model: nn.Module, tree: list[list[str]]) -> None:
    """Raise unless `model` has the cached model's module tree and every tensor came from the file."""
    found = _tree(model)
    if found != tree:
        differ = next((f"{a} != {b}" for a, b in zip(found, tree, strict=False) if a != b),
                      f"{len(found)} modules, not {len(tree)}")
        raise ValueError(f"the model built from the source is not the cached one: {differ}")
    for path, module in model.named_modules():
        for name, value in [*module._parameters.items(), *module._buffers.items(), *vars(module).items()]:
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise ValueError(f"{path}.{name} is not in the file")


def source_digests(folder: Path, memo_path: Path) -> list[tuple[str, str]]:
    """Name and sha256 of the folder's weight and config files (links followed), remembered in `memo_path` (see the
    module docstring) so that an unchanged file is not hashed again."""
    memo = _read_memo(memo_path)
    digests, changed = [], False
    for path in sorted(folder.iterdir()):
        if not (path.is_file() and path.name.endswith(WEIGHT_SUFFIXES)):
            continue
        real = path.resolve()
        stat = real.stat()
        identity = [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
        entry = memo.get(str(real))
        if not isinstance(entry, dict) or entry.get("stat") != identity or not isinstance(entry.get("sha256"), str):
            entry = memo[str(real)] = {"stat": identity, "sha256": file_sha256(real)}
            changed = True
        digests.append((path.name, entry["sha256"]))
    if changed:
        _write_memo(memo_path, memo)
    return digests


def file_sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _read_memo(path: Path) -> dict[str, Any]:
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _write_memo(path: Path, memo: dict[str, Any]) -> None:
    """Write the digests of files that still exist (atomically; a lost race only costs a hash later)."""
    kept = {name: entry for name, entry in memo.items() if os.path.exists(name)}
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(kept))
        partial.replace(path)
    except OSError as exc:
        logger.info("could not remember the source digests in %s: %s", path, exc)
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()


def _limit_bytes() -> int:
    value = os.environ.get(LIMIT_ENV_VAR)
    try:
        gigabytes = float(value) if value else DEFAULT_LIMIT_GB
    except ValueError:
        logger.warning("ignoring %s=%r (not a number of GB)", LIMIT_ENV_VAR, value)
        gigabytes = DEFAULT_LIMIT_GB
    return int(gigabytes * 2**30)


@functools.cache
def _library_versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in LIBRARIES}


@functools.cache
def _quantization_code() -> str:
    """A hash of this package's source (read once per process): it made the cached tensors."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _file_prefix(model_id: str) -> str:
    """The model id, readable and unique, without `-` (it separates the prefix from the key's hash)."""
    readable = re.sub(r"[^A-Za-z0-9_.]+", "_", model_id)
    return f"{readable}_{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"
