"""A sleeping engine's weights, parked in a local file: `park` writes every parameter and buffer of the model as it
is in memory (after in-situ quantization, LoRA adapters included, tied weights written once and shared again) and
drops them; `restore` puts them back into the same modules. Weights on an accelerator are parked in host memory
instead when it has room for them (`HOST_SHARE` of what is available), in pinned (page-locked) buffers: the
accelerator's memory is freed all the same, and a wake is one asynchronous copy back at the bus's speed, with no file
written or read.

Waking this way skips all that rebuilding the engine repeats (config, tokenizer, `from_pretrained`, quantizing
again), and answers token for token as before. The file holds data only (`weights.save_tensors`: a safetensors
file, each storage once, so tied weights and views of one tensor come back sharing it; torchao's quantized tensors
flattened into plain ones, rebuilt only from the classes torchao registers as safe), never a pickle: the folder is
shared by every replica on the host, and a file planted there can at worst change weights, not run code (a file
that cannot be read so is a `ModelLoadError`, and the engine is loaded again). The file is mapped back, not read:
its pages (still in the page cache after a short sleep) become the weights, copy-on-write, faulted in by the first
forward pass. SmolLM2 bf16
on CPU: restore 10 ms and a first forward ~8 ms slower than usual, against 146-185 ms to read the file into new
memory (Q8_0 75-88 ms) and 0.5-0.8 s for a rebuild. Clean file pages are memory the kernel may reclaim under
pressure and read again from the file on use; the next sleep drops them like any other weights.

The file is written at the first sleep and again only when the model's tensors changed since (an adapter loaded);
it is deleted when the engine closes, and a parked file whose process is gone (a replica killed while asleep, a
cluster stopped) is removed by the next replica on the host that starts or parks. Disk: the weights' size (269 MB
for SmolLM2 bf16, 135 MB at Q8_0) in `$RAYRUNNER_CACHE_DIR/parked`.

Weights prepacked for oneDNN (`quantization.packed_linear`) have no storage to write: `park` makes them plain first
and `restore` packs them again.

Weights made in inference mode would be inference tensors, and a Linear whose weight is one runs a sliced input
through a bmm that copies the weight on every call (a 1-token chat took 1.7x as long after such a wake).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from rayrunner.errors import ModelLoadError
from rayrunner.quantization.packed_linear import pack_linears, unpack_linears
from rayrunner.quantization.weights import load_tensors, save_tensors, weight_bytes
from rayrunner.runtime.cache_dir import cache_dir

logger = logging.getLogger(__name__)

Place = tuple[nn.Module, str, str]  # a module, "_parameters" or "_buffers", the tensor's name there
HOST_SHARE = 0.8  # accelerator weights go to host memory when they take at most this share of what is available


class ParkedWeights:
    """The weights of one engine's model while it sleeps; `park` and `restore` run where no model call runs."""

    def __init__(self, name: str, folder: Path | None = None) -> None:
        self.name = name
        self.folder = folder or cache_dir() / "parked"
        self.path = self.folder / f"{_host_prefix()}{os.getpid()}-{name}.safetensors"
        self._written: tuple[Any, ...] | None = None  # what the file holds (see `_signature`)
        self._places: list[Place] | None = None  # where each parked tensor goes back, while parked
        self._in_host: tuple[list[torch.Tensor], list[torch.device]] | None = None  # copies and their devices
        self._unpacked: nn.Module | None = None  # the model whose packed weights `park` made plain, while parked
        _remove_orphans(self.folder)

    @property
    def parked(self) -> bool:
        return self._places is not None

    def park(self, model: nn.Module, host_memory: bool | None = None) -> None:
        """Copy the model's tensors to host memory or write them to the file (unless it holds them already), then
        drop them from the model. `host_memory`: None decides (accelerator weights that fit in host memory)."""
        self._unpacked = model if unpack_linears(model) else None
        slots = _slots(model)
        tensors = [tensor for *_, tensor in slots]
        if host_memory is None:
            host_memory = _fit_in_host_memory(model, tensors)
        if host_memory:
            with torch.inference_mode(False):  # normal tensors, though the step loop calls this in inference mode
                host = _moved(tensors, [torch.device("cpu")] * len(tensors), pinned=True)
            self._in_host = host, [tensor.device for tensor in tensors]
        elif (signature := _signature(slots)) != self._written:
            self._write(tensors)
            self._written = signature
        places: list[Place] = [(module, kind, name) for _, module, kind, name, _ in slots]
        for module, kind, name in places:
            getattr(module, kind)[name] = None
        self._places = places

    def restore(self) -> None:
        """Put the parked tensors back where they were, on the device they were on."""
        if self._places is None:
            return
        with torch.inference_mode(False):  # normal tensors, though the step loop calls this in inference mode
            tensors = _moved(*self._in_host) if self._in_host is not None else self._read()
        for (module, kind, name), tensor in zip(self._places, tensors, strict=True):
            getattr(module, kind)[name] = tensor
        if self._unpacked is not None:
            pack_linears(self._unpacked)
        self._places, self._in_host, self._unpacked = None, None, None

    def discard(self) -> None:
        """Remove the file (the engine is closing)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._written = None

    def _read(self) -> list[torch.Tensor | None]:
        try:
            tensors, _ = load_tensors(self.path)
        except Exception as exc:
            raise ModelLoadError(f"the parked weights in {self.path} cannot be read: {type(exc).__name__}: {exc}"
                                 ) from exc
        if len(tensors) != len(self._places or ()):
            raise ModelLoadError(f"the parked weights in {self.path} are not this model's")
        return tensors

    def _write(self, tensors: list[torch.Tensor]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        _remove_orphans(self.folder)
        partial = self.path.with_suffix(".partial")
        try:
            save_tensors(partial, tensors, {})
            partial.replace(self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
            raise


def _slots(model: nn.Module) -> list[tuple[str, nn.Module, str, str, torch.Tensor]]:
    """Every parameter and buffer of every module, by module: a tensor two modules share (tied embeddings) comes
    twice, and `save_tensors` writes it once and loads it back as one tensor."""
    return [(qualname, module, kind, name, tensor)
            for qualname, module in model.named_modules()
            for kind in ("_parameters", "_buffers")
            for name, tensor in getattr(module, kind).items() if tensor is not None]


def _fit_in_host_memory(model: nn.Module, tensors: list[torch.Tensor]) -> bool:
    """Whether the model's tensors are accelerator weights that host memory has room for."""
    if all(tensor.device.type == "cpu" for tensor in tensors):
        return False  # parking CPU weights in host memory would free nothing
    return weight_bytes(model) <= HOST_SHARE * psutil.virtual_memory().available


def _moved(tensors: list[torch.Tensor], devices: list[torch.device], pinned: bool = False) -> list[torch.Tensor]:
    """Each tensor copied to its device in `devices` (a tensor shared by several places is copied once). Copies
    between an accelerator and host memory run asynchronously and are waited for once at the end; `pinned` puts
    plain tensors' host copies in page-locked memory, which the copies back run from at the bus's full speed."""
    copies: dict[int, torch.Tensor] = {}
    for tensor, device in zip(tensors, devices, strict=True):
        if id(tensor) not in copies:
            copies[id(tensor)] = _same_kind(tensor, _copy(tensor, device, pinned))
    if torch.cuda.is_available() and any(t.device.type == "cuda" for t in (*tensors, *copies.values())):
        torch.cuda.synchronize()
    return [copies[id(tensor)] for tensor in tensors]


def _copy(tensor: torch.Tensor, device: torch.device, pinned: bool) -> torch.Tensor:
    """`tensor` on `device`; a plain accelerator tensor's host copy in pinned memory when `pinned`. Tensor
    subclasses (torchao's quantized ones) copy as they define it."""
    plain = type(tensor.data) is torch.Tensor
    if pinned and plain and device.type == "cpu" and tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        return host.copy_(tensor.detach(), non_blocking=True)
    return tensor.to(device, non_blocking=plain and device.type == "cuda" and tensor.is_pinned())


def _same_kind(original: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    """`copy` as a Parameter when `original` is one (a module's parameters must stay parameters)."""
    if isinstance(original, nn.Parameter):
        return nn.Parameter(copy, requires_grad=original.requires_grad)
    return copy


def _signature(slots: list[tuple[str, nn.Module, str, str, torch.Tensor]]) -> tuple[Any, ...]:
    """What identifies the parked tensors: weights never change while serving, only which tensors there are."""
    return tuple((qualname, kind, name, tuple(tensor.shape), str(tensor.dtype), type(tensor).__name__,
                  str(tensor.device)) for qualname, _, kind, name, tensor in slots)


def _host_prefix() -> str:
    return f"{socket.gethostname()}-"


def _remove_orphans(folder: Path) -> None:
    """Delete this host's parked files whose process has exited (a replica killed while asleep)."""
    if not folder.is_dir():
        return
    prefix = _host_prefix()
    for path in folder.glob(f"{prefix}*"):
        pid = path.name.removeprefix(prefix).split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                logger.info("removed %s: its replica has exited", path.name)
