"""A model's weights as plain tensors: how many bytes they really take, and a file that holds them as data only.

`numel * element_size` over parameters is wrong twice over: a quantized tensor subclass reports the logical shape
and dtype, not its packed data and scales, and tied weights (embedding / lm_head) would count twice. So walk the
state dict, open tensor subclasses through `__tensor_flatten__`, and count each underlying storage once.

The file (`save_tensors`, `load_tensors`) is a safetensors file: each distinct storage once, as one 1-D tensor of
its dtype, and in its metadata (JSON) where each tensor lies: its storage, offset, shape and stride, so views and
tied weights come back sharing one storage (the same tensor twice comes back as one). A tensor subclass (torchao's
quantized weights) is stored flattened (`__tensor_flatten__`): its inner tensors, and its class and attributes
by name, rebuilt with `__tensor_unflatten__`. The only classes it names are torchao's own that torchao registers
with `torch.serialization.add_safe_globals`, and attribute values are only numbers, strings, lists, tuples, dicts,
sizes, dtypes, devices and members of such registered enums. Reading a file is parsing JSON and mapping bytes:
nothing in it is code, or names code that runs, whoever wrote it.

It is written here, one storage at a time (safetensors' own writer copies every tensor into memory first, which a
sleeping model parking its weights has no room for), and mapped back with safetensors (tensors that are the file's
pages, private, copy-on-write), or read into memory of their own (`copy`).
"""

from __future__ import annotations

import enum
import json
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from rayrunner.quantization.packed_linear import packed_bytes

METADATA_KEY = "rayrunner"
ALIGN = 64  # bytes: where each storage starts in the file (see `_Writer.write`)
SAFE_PACKAGES = ("torchao",)  # tensor subclasses and enums are rebuilt only from these packages' registered classes
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
PLAIN = (type(None), bool, int, float, str)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the storages behind `model.state_dict()`, each storage counted once, and by its packed
    weights."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in model.state_dict().values():
        for plain in _plain_tensors(tensor):
            storage = plain.untyped_storage()
            seen[(str(storage.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values()) + packed_bytes(model)


def _plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The ordinary tensors a (possibly nested) tensor subclass is made of."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        yield tensor
        return
    inner_names, _ = flatten()
    for name in inner_names:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):
            yield from _plain_tensors(inner)


def save_tensors(path: Path, tensors: Sequence[torch.Tensor | None], metadata: Any) -> None:
    """Write `tensors` (None allowed) and `metadata` (JSON-able) to `path` (see the module docstring)."""
    writer = _Writer()
    seen: dict[int, int] = {}
    entries: list[Any] = []
    for position, tensor in enumerate(tensors):
        if tensor is not None and id(tensor) in seen:
            entries.append({"same_as": seen[id(tensor)]})
            continue
        if tensor is not None:
            seen[id(tensor)] = position
        entries.append(writer.entry(tensor))
    writer.write(path, json.dumps({"tensors": entries, "metadata": metadata}))


def load_tensors(path: Path, copy: bool = False) -> tuple[list[torch.Tensor | None], Any]:
    """The tensors and metadata `save_tensors` wrote to `path`; `copy`: read into memory of their own rather than
    mapped (touching a private mapping's pages one fault at a time is much slower than reading the file). Raises
    for a file that is not one: ValueError for what it refuses, safetensors' or JSON's error for what it cannot
    parse."""
    storages, metadata = _read(path) if copy else _mapped(path)
    header = json.loads(metadata.get(METADATA_KEY, "null"))
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise ValueError(f"{path.name} holds no rayrunner tensors")
    reader = _Reader(storages)
    tensors: list[torch.Tensor | None] = []
    for entry in header["tensors"]:
        if isinstance(entry, dict) and "same_as" in entry:
            tensors.append(tensors[_index(entry["same_as"], len(tensors))])
        else:
            tensors.append(reader.tensor(entry))
    return tensors, header.get("metadata")


def _mapped(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The file's storages as safetensors maps them (the file's pages), and its metadata."""
    with safe_open(str(path), framework="pt") as file:
        return {name: file.get_tensor(name) for name in file.keys()}, file.metadata() or {}  # noqa: SIM118


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The file's storages read into new tensors (each straight from the file into its memory), and its metadata;
    the safetensors layout is checked as safetensors checks it."""
    names = {code: dtype for dtype, code in ST_DTYPES.items()}
    with path.open("rb") as file:
        length = struct.unpack("<Q", file.read(8))[0]
        size = os.fstat(file.fileno()).st_size - 8 - length
        if size < 0:
            raise ValueError(f"{path.name}: a header longer than the file")
        header = json.loads(file.read(length))
        metadata = header.pop("__metadata__", None) or {}
        storages, end = {}, 0
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
            start, stop = _ints(info["data_offsets"])
            dtype, shape = names[info["dtype"]], _ints(info["shape"])
            blob = torch.empty(shape, dtype=dtype)
            if start != end or stop != start + blob.numel() * blob.element_size() or stop > size:
                raise ValueError(f"{path.name}: tensor {name!r} is not where the header says")
            if blob.numel() and file.readinto(blob.view(torch.uint8).numpy().data) != stop - start:
                raise ValueError(f"{path.name}: the file ends inside tensor {name!r}")
            storages[name], end = blob, stop
    return storages, metadata


class _Writer:
    """Collects each distinct storage once and describes tensors by where they lie in them."""

    def __init__(self) -> None:
        self.storages: dict[tuple[str, int], str] = {}
        self.blobs: dict[str, torch.Tensor] = {}

    def entry(self, tensor: torch.Tensor | None) -> Any:
        if tensor is None:
            return None
        common = {"shape": list(tensor.shape), "stride": list(tensor.stride()),
                  "parameter": isinstance(tensor, nn.Parameter), "grad": tensor.requires_grad}
        flatten = getattr(tensor, "__tensor_flatten__", None)
        if flatten is not None:
            names, context = flatten()
            return {**common, "class": _class_name(type(tensor)), "attributes": _encode(context),
                    "inner": {name: self.entry(getattr(tensor, name)) for name in names}}
        return {**common, "storage": self._storage(tensor), "dtype": str(tensor.dtype).removeprefix("torch."),
                "offset": tensor.storage_offset() * tensor.element_size()}

    def _storage(self, tensor: torch.Tensor) -> str:
        storage = tensor.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        if key not in self.storages:
            dtype = tensor.dtype if tensor.dtype in ST_DTYPES and not storage.nbytes() % tensor.element_size() \
                else torch.uint8
            name = f"{len(self.storages)}@{storage.device}"
            blob = torch.empty(0, dtype=dtype, device=storage.device)
            self.blobs[name] = blob.set_(storage, 0, (storage.nbytes() // blob.element_size(),), (1,))
            self.storages[key] = name
        return self.storages[key]

    def write(self, path: Path, metadata: str) -> None:
        """The safetensors layout: header length, JSON header, then the data. The header is padded with spaces and
        each blob with zeros (it is stored that much longer) so that every blob starts `ALIGN`-aligned, as
        `torch.save` aligns its records: CPU kernels read mapped weights in place, some with aligned loads."""
        header: dict[str, Any] = {"__metadata__": {METADATA_KEY: metadata}}
        start = 0
        for name, blob in self.blobs.items():
            end = start + -(-blob.numel() * blob.element_size() // ALIGN) * ALIGN
            header[name] = {"dtype": ST_DTYPES[blob.dtype], "shape": [(end - start) // blob.element_size()],
                            "data_offsets": [start, end]}
            start = end
        text = json.dumps(header).encode()
        text += b" " * (-(8 + len(text)) % ALIGN)
        with path.open("wb") as file:
            file.write(struct.pack("<Q", len(text)) + text)
            for blob in self.blobs.values():
                data = blob.detach().cpu().view(torch.uint8)  # a copy only for an accelerator's storage
                if data.numel():
                    file.write(data.numpy().data)
                file.write(bytes(-data.numel() % ALIGN))


class _Reader:
    """Builds tensors from the file's storages (each moved to its device once) and the entries that describe them."""

    def __init__(self, blobs: dict[str, torch.Tensor]) -> None:
        self.blobs = blobs
        self.ready: dict[str, torch.Tensor] = {}

    def tensor(self, entry: Any) -> torch.Tensor | None:
        if entry is None:
            return None
        if not isinstance(entry, dict):
            raise ValueError("a tensor entry that is not an object")
        shape, stride = torch.Size(_ints(entry["shape"])), tuple(_ints(entry["stride"]))
        if "class" in entry:
            inner = {str(name): self.tensor(value) for name, value in entry["inner"].items()}
            tensor = _tensor_class(entry["class"]).__tensor_unflatten__(inner, _decode(entry["attributes"]), shape,
                                                                        stride)
        else:
            tensor = self._view(entry, shape, stride)
        if entry.get("parameter"):
            return nn.Parameter(tensor, requires_grad=bool(entry.get("grad")))
        return tensor.requires_grad_(True) if entry.get("grad") else tensor

    def _view(self, entry: dict[str, Any], shape: torch.Size, stride: tuple[int, ...]) -> torch.Tensor:
        blob = self._blob(str(entry["storage"]))
        dtype = _dtype(entry["dtype"])
        size = torch.empty(0, dtype=dtype).element_size()
        start = blob.storage_offset() * blob.element_size() + _ints([entry["offset"]])[0]
        reach = sum((extent - 1) * step for extent, step in zip(shape, stride, strict=True)) + 1 if shape.numel() else 0
        if start % size or start + reach * size > blob.untyped_storage().nbytes():
            raise ValueError(f"a tensor outside its storage {entry['storage']}")
        view = torch.empty(0, dtype=dtype, device=blob.device)
        return view.set_(blob.untyped_storage(), start // size, shape, stride)

    def _blob(self, name: str) -> torch.Tensor:
        if name not in self.ready:
            if name not in self.blobs:
                raise ValueError(f"no storage {name!r} in the file")
            blob, device = self.blobs[name], torch.device(name.rpartition("@")[2])
            if blob.data_ptr() % ALIGN:
                raise ValueError(f"storage {name!r} is not {ALIGN}-byte aligned in the file")
            self.ready[name] = blob.to(device)
        return self.ready[name]


def _index(value: Any, bound: int) -> int:
    if not isinstance(value, int) or not 0 <= value < bound:
        raise ValueError(f"a reference to tensor {value!r} of {bound}")
    return value


def _ints(values: Any) -> list[int]:
    if not isinstance(values, list) or not all(isinstance(value, int) and value >= 0 for value in values):
        raise ValueError(f"not a list of sizes: {values!r}")
    return values


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {name!r}")
    return dtype


def _class_name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _registered(name: str) -> type | None:
    """The class `name` among the safe globals registered by `SAFE_PACKAGES`, or None."""
    for item in torch.serialization.get_safe_globals():
        kind = item[0] if isinstance(item, tuple) else item
        if isinstance(kind, type) and kind.__module__.split(".")[0] in SAFE_PACKAGES and _class_name(kind) == name:
            return kind
    return None


def _tensor_class(name: Any) -> Any:
    """A registered tensor subclass (see `_registered`); torchao's formats are imported first if needed."""
    kind = _registered(str(name))
    if kind is None:
        # torchao registers its tensor classes as its modules are imported (those rayrunner's formats use)
        import torchao.prototype.quantization.int4.inference_workflow  # noqa: F401
        import torchao.quantization  # noqa: F401

        kind = _registered(str(name))
    if kind is None or not issubclass(kind, torch.Tensor) or not hasattr(kind, "__tensor_unflatten__"):
        raise ValueError(f"not a tensor class the file may name: {name!r}")
    return kind


def _encode(value: Any) -> Any:
    """`value` as JSON: plain values as they are, the rest tagged (see `_decode`)."""
    if isinstance(value, enum.Enum):
        return {"enum": _class_name(type(value)), "name": value.name}
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if isinstance(value, tuple | list):
        return {type(value).__name__: [_encode(item) for item in value]}
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {"dict": {key: _encode(item) for key, item in value.items()}}
    raise ValueError(f"a tensor attribute the file cannot hold: {type(value).__name__}")


def _decode(value: Any) -> Any:
    if isinstance(value, PLAIN):
        return value
    if not isinstance(value, dict) or not value:
        raise ValueError(f"not an encoded attribute: {value!r}")
    tag, content = next(iter(value.items()))
    if tag == "enum":
        kind = _registered(str(content))
        if kind is None or not issubclass(kind, enum.Enum):
            raise ValueError(f"not an enum the file may name: {content!r}")
        return kind[str(value["name"])]
    decoders = {"dtype": _dtype, "device": lambda text: torch.device(str(text)),
                "size": lambda items: torch.Size(_ints(items)), "list": lambda items: [_decode(i) for i in items],
                "tuple": lambda items: tuple(_decode(i) for i in items),
                "dict": lambda items: {str(key): _decode(item) for key, item in items.items()}}
    if tag not in decoders or len(value) != 1:
        raise ValueError(f"not an encoded attribute: {value!r}")
    return decoders[tag](content)
