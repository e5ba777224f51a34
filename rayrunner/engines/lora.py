"""LoRA adapters on a loaded causal LM, with peft: several held at once, mixed within one forward pass.

The first adapter wraps the model in a `PeftModel`, which swaps its target layers for LoRA layers in place; from
then on every forward goes through peft with `adapter_names` (one name per row, `__base__` for the plain model), so
rows of different adapters and of the base model share a batch. At most `max_adapters` stay loaded: the least
recently used one not in use is deleted, and its folder is kept so a later request reloads it. Inside peft each
adapter goes by a name of ours (`adapter_<n>`): peft mistakes names that occur in its `lora_` key prefix (`a`,
`lora`) for parts of the weights' keys.
All loading and forwarding happens on the engine's compute thread; only `register` runs elsewhere.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rayrunner.errors import InvalidRequestError, InvalidSpecError, ModelLoadError

BASE = "__base__"  # peft's name for rows that use no adapter
_CONFIG = "adapter_config.json"
_HUB_PATTERNS = [_CONFIG, "*.safetensors", "*.bin"]


def adapter_folder(source: str, hf_cache_path: str | None = None) -> str:
    """A local folder holding the adapter: `source` itself, or a hub id through huggingface_hub (its cache and
    `HF_HUB_OFFLINE` honoured)."""
    path = Path(source).expanduser()
    if path.is_dir() or source.startswith(("/", ".", "~")):
        if not (path / _CONFIG).is_file():
            raise InvalidSpecError(f"`{source}` is not a LoRA adapter folder (no {_CONFIG})", param="adapter")
        return str(path)
    from huggingface_hub import snapshot_download

    try:
        return str(snapshot_download(source, cache_dir=hf_cache_path, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # huggingface_hub raises many types: offline, 404, gated, network
        raise ModelLoadError(
            f"could not get adapter `{source}` from the Hugging Face cache or hub "
            f"(offline={os.environ.get('HF_HUB_OFFLINE', '0')}): {type(exc).__name__}: {exc}"
        ) from None


class LoraAdapters:
    """The adapters known to one model (name -> folder) and the ones loaded into it, least recently used first."""

    def __init__(self, model: Any, max_adapters: int) -> None:
        self.model = model
        self.max_adapters = max_adapters
        self.peft: Any = None  # the PeftModel around `model`, once an adapter was loaded
        self._folders: dict[str, str] = {}
        self._peft_names: dict[str, str] = {}
        self._loaded: collections.OrderedDict[str, None] = collections.OrderedDict()

    def register(self, name: str, folder: str) -> None:
        """Make `name` servable from `folder` (loaded when first used, or by `load`)."""
        if not name or name == BASE:
            raise InvalidRequestError(f"`{name}` cannot name an adapter", param="adapter")
        if self._folders.get(name, folder) != folder:
            raise InvalidRequestError(f"LoRA adapter `{name}` is already loaded from `{self._folders[name]}`",
                                      param="adapter")
        self._folders[name] = folder
        self._peft_names.setdefault(name, f"adapter_{len(self._peft_names)}")

    def known(self, name: str) -> bool:
        return name in self._folders

    def check(self, name: str) -> None:
        """Refuse a request for an adapter this model does not know."""
        if name not in self._folders:
            raise InvalidRequestError(f"LoRA adapter `{name}` is not loaded on this model", param="adapter")

    @property
    def loaded(self) -> list[str]:
        """Loaded adapter names, least recently used first."""
        return list(self._loaded)

    def load(self, name: str, keep: Iterable[str] = ()) -> None:
        """Make `name` loaded and most recently used, evicting least recently used adapters beyond `max_adapters`
        except those in `keep` (used by running sequences). Compute thread only."""
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return
        folder = self._folders[name]
        try:
            self._load_weights(self._peft_names[name], folder)
        except Exception as exc:
            self._forget(name)
            raise ModelLoadError(f"cannot load LoRA adapter `{name}` from `{folder}`: {type(exc).__name__}: {exc}"
                                 ) from None
        self._loaded[name] = None
        self._evict({name, *keep})

    def _load_weights(self, name: str, folder: str) -> None:
        """Normal tensors even when a step (in inference mode) loads the adapter: peft later sets requires_grad on
        every adapter's weights, which inference tensors refuse, and a Linear on an inference-tensor weight runs a
        sliced input through a bmm that copies the weight."""
        import torch

        with torch.inference_mode(False):
            if self.peft is None:
                from peft import PeftModel

                from rayrunner.quantization.packed_linear import unpack_linears

                unpack_linears(self.model)  # peft reads the weights of the Linears it wraps

                self.peft = PeftModel.from_pretrained(self.model, folder, adapter_name=name, is_trainable=False)
            else:
                self.peft.load_adapter(folder, adapter_name=name, is_trainable=False)
        self.peft.eval()

    def _forget(self, name: str) -> None:
        """Drop an adapter that failed to load (and whatever peft kept of it), so requests for it are refused."""
        del self._folders[name]
        if self.peft is not None and self._peft_names[name] in self.peft.peft_config:
            self.peft.delete_adapter(self._peft_names[name])

    def _evict(self, keep: set[str]) -> None:
        for name in [n for n in self._loaded if n not in keep][: max(0, len(self._loaded) - self.max_adapters)]:
            self.peft.delete_adapter(self._peft_names[name])
            del self._loaded[name]

    def forward(self, rows: Sequence[str | None], keep: Iterable[str], **inputs: Any) -> Any:
        """The model's forward over a batch whose row i uses adapter `rows[i]` (None: the base model), loading
        the ones not loaded (sparing `keep`). Compute thread only."""
        for name in dict.fromkeys(n for n in rows if n is not None):
            self.load(name, keep)
        if self.peft is None:
            return self.model(**inputs)
        return self.peft(**inputs, adapter_names=[BASE if name is None else self._peft_names[name] for name in rows])
